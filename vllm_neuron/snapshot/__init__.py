"""Input snapshots: capture the inputs of one selected forward per rank, replay it off-device.

See docs/snapshots.md. Policy lives here (what, when, where); the device-to-host
write sits behind a narrow writer interface (:mod:`.tensor_writers`).

- :mod:`.config` - settings and the selection rules, resolved once per process;
- :mod:`.context` - the forward context the model runner publishes, the capture budget;
- :mod:`.capture` - per-executable capturer (which call), ``install_snapshot_capture``;
- :mod:`.capture_spec` - what one executable captures and where, ``SnapshotCaptureError``;
- :mod:`.bundle_writer` - one selected call written as a bundle, ``meta.json`` last;
- :mod:`.tensor_writers` - the device-to-host write: host (torch) or Neuron runtime;
- :mod:`.meta` - ``meta.json``, the bundle's identity and commit record;
- :mod:`.encoding` - pt / npy / safetensors, bit-exact for every dtype they can hold;
- :mod:`.bundles` - find, address (``<hash>/rank<N>/call<K>`` or a path) and load bundles;
- :mod:`.runners` - the compile-cache entry or the exported graph that replay runs;
- :mod:`.compare` - replayed against captured outputs: errors, cosine, tolerances;
- :mod:`.replay` - replay bundles and report per bundle.
"""

from vllm_neuron.identity import RankInfo

from .capture import SnapshotCapturer, build_capturer, install_snapshot_capture
from .capture_spec import CaptureSpec, SnapshotCaptureError, resolve_capture_spec
from .config import (
    CaptureSelector,
    ConfigError,
    ForwardVerdict,
    RowMatch,
    SnapshotConfig,
    check_snapshot_gating,
    load_snapshot_config,
    snapshot_config,
)
from .context import (
    CaptureBudget,
    SnapshotForwardContext,
    clear_current_forward,
    forward_context,
    get_capture_budget,
    get_current_forward,
    reset_capture_budget,
    reset_snapshot_config,
    set_current_forward,
)
from .encoding import SnapshotEncodingError
from .meta import CallMeta, read_call_meta, write_call_meta
from .tensor_writers import (
    HostTensorWriter,
    NeuronRuntimeWriter,
    SnapshotWriter,
    default_writer,
)

__all__ = [
    "CallMeta",
    "CaptureBudget",
    "CaptureSelector",
    "CaptureSpec",
    "ConfigError",
    "ForwardVerdict",
    "HostTensorWriter",
    "NeuronRuntimeWriter",
    "RankInfo",
    "RowMatch",
    "SnapshotCaptureError",
    "SnapshotCapturer",
    "SnapshotConfig",
    "SnapshotEncodingError",
    "SnapshotForwardContext",
    "SnapshotWriter",
    "build_capturer",
    "check_snapshot_gating",
    "clear_current_forward",
    "default_writer",
    "forward_context",
    "get_capture_budget",
    "get_current_forward",
    "install_snapshot_capture",
    "load_snapshot_config",
    "read_call_meta",
    "reset_capture_budget",
    "reset_snapshot_config",
    "resolve_capture_spec",
    "set_current_forward",
    "snapshot_config",
    "write_call_meta",
]
