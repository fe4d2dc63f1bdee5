"""vLLM Neuron artifact store: compile cache, compile manifest, input snapshots, profiles.

``torch.compile(model, backend="vllm_neuron")`` works once this package is imported (it
registers the backend when torch is already loaded) and, for an installed package, without
any import at all through the ``torch_dynamo_backends`` entry point. Importing this package
never imports torch itself, so the CLI and the storage layer stay fast to start.
"""

import sys as _sys

from .version import __version__

__all__ = ["__version__"]

if "torch" in _sys.modules:  # pragma: no branch - both paths are exercised by tests
    try:
        from .dynamo_backend import register_backend as _register_backend

        _register_backend()
    except Exception:  # noqa: BLE001 - the entry point still registers it lazily
        pass
