"""vLLM integration: the two entry points vLLM calls, and where the hooks live.

vLLM discovers this package through two entry-point groups (pyproject.toml):

``vllm.general_plugins`` -> :func:`register`
    Called once in every vLLM process (API server, engine core, each worker) before the
    engine is built. Resolves and validates every setting of this package, so a malformed
    value stops the server at start-up with the variable's name; registers the
    ``vllm_neuron`` torch.compile backend; makes this package's log lines visible.
``vllm.platform_plugins`` -> :func:`platform_plugin`
    Returns the Neuron platform when Neuron devices are present, the host platform when
    ``VLLM_NEURON_HOST_MODE=1``, otherwise ``None`` (vLLM picks its own platform).

The hooks themselves are in one place, :mod:`vllm_neuron.plugin.hooks`, shared by both
platforms: the engine configuration (compile backend, worker), the forward context the
model runner publishes for snapshots, and the manifest emitted after warm-up. This module
imports nothing heavy: vLLM imports it in every process, and an import error here would only
be logged while vLLM silently fell back to its stock platform.
"""

from __future__ import annotations

import glob
import logging
import os
import sys

__all__ = [
    "HOST_PLATFORM",
    "NEURON_PLATFORM",
    "neuron_devices_present",
    "platform_plugin",
    "register",
    "resolve_settings",
]

HOST_PLATFORM = "vllm_neuron.plugin.platform.NeuronHostPlatform"
NEURON_PLATFORM = "vllm_neuron.plugin.platform.NeuronPlatform"

logger = logging.getLogger("vllm_neuron")

_registered = False


def neuron_devices_present(dev_dir: str = "/dev") -> bool:
    """Whether this machine exposes Neuron devices (``/dev/neuron0``, ...)."""
    return bool(glob.glob(os.path.join(dev_dir, "neuron[0-9]*")))


def platform_plugin() -> str | None:
    """The ``vllm.platform_plugins`` entry point: which platform class vLLM should use.

    A malformed ``VLLM_NEURON_HOST_MODE`` is not raised here (vLLM swallows exceptions of
    platform detection); :func:`register` raises it with the variable's name instead.
    """
    from vllm_neuron.envs import ConfigError, load_host_mode_settings

    try:
        host_mode = load_host_mode_settings().enabled
    except ConfigError:
        return None
    if host_mode:
        return HOST_PLATFORM
    if neuron_devices_present():
        return NEURON_PLATFORM
    return None


def resolve_settings() -> None:
    """Parse and validate every setting of this package once for this process.

    Raises :class:`vllm_neuron.envs.ConfigError` naming the variable and its value.
    """
    from vllm_neuron.envs import (
        compile_cache_settings,
        host_mode_settings,
        manifest_settings,
    )
    from vllm_neuron.snapshot.config import snapshot_config

    compile_cache_settings()
    manifest_settings()
    host_mode_settings()
    snapshot_config()


def _show_logs() -> None:
    """Make this package's INFO lines visible in the server log, like vLLM's own.

    vLLM configures only its own ``vllm`` logger; without a handler ours would print
    warnings only (through logging's last-resort handler).
    """
    pkg = logging.getLogger("vllm_neuron")
    if pkg.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("(pid=%(process)d) %(levelname)s %(asctime)s [%(name)s] %(message)s",
                          datefmt="%m-%d %H:%M:%S")
    )
    pkg.addHandler(handler)
    pkg.setLevel(logging.INFO)
    pkg.propagate = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point (idempotent per process)."""
    global _registered
    if _registered:
        return
    from vllm_neuron.envs import ConfigError, host_mode_settings

    _show_logs()
    try:
        resolve_settings()
    except ConfigError as exc:
        raise ConfigError(f"vllm_neuron: invalid configuration: {exc}") from None
    if host_mode_settings().enabled:
        # vLLM's own AOT artifact (on by default with torch >= 2.10) restores compiled
        # pieces on a warm restart without calling the compiler at all, so this package's
        # cache would be bypassed; with it off a warm restart calls `load()` (FACTS.md).
        if os.environ.get("VLLM_USE_AOT_COMPILE", "").strip() not in ("", "0"):
            logger.warning(
                "vllm_neuron: VLLM_USE_AOT_COMPILE=%s: warm restarts bypass this package's "
                "compile cache", os.environ["VLLM_USE_AOT_COMPILE"],
            )
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    try:
        from vllm_neuron.compile.backend import register_backend

        register_backend()
    except ImportError as exc:  # torch missing: vLLM itself cannot run either
        logger.warning("vllm_neuron: torch.compile backend not registered: %s", exc)
    _registered = True
    logger.info(
        "vllm_neuron: plugin loaded in pid %d (host mode %s)",
        os.getpid(),
        "on" if host_mode_settings().enabled else "off",
    )
