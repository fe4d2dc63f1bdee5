"""Every environment variable of vllm_neuron: parsed once, typed, validated.

Why one package: a deployment is configured through environment variables that are read
in every vLLM process (API server, engine core, each worker). Parsing them in one place
means a typo such as ``NEURON_LIBTORCH_DISABLE_COMPILE_CACHE=ture`` fails loudly at
start-up with the variable's name and value, instead of being silently read as "false" by
one process and differently by another. No other module of the package reads
``os.environ`` for a setting (tests/test_single_reader.py checks it).

Settings are grouped per feature, one module each: a frozen dataclass, a pure ``load_*``
function that takes a mapping (tests feed it dicts), and, for the groups a process reads
many times, a cached accessor that parses ``os.environ`` once per process. Groups only
parse: what a value means for a feature (where the local tier finally goes, which forward
a snapshot rule selects) is decided in that feature, from the parsed group.

- :mod:`.compile_cache` - the two-tier compile cache;
- :mod:`.trust` - whose compile-cache entries this process loads, and its signing key;
- :mod:`.manifest` and :mod:`.run` - the manifest directory and the engine run's id;
- :mod:`.snapshot` - input snapshot capture;
- :mod:`.host_mode` - the vLLM plugin's host mode;
- :mod:`.profiling` - profile capture;
- :mod:`.identity` - cores, ranks and user (read at each use, never cached);
- :mod:`.faults` - the fault point crash tests kill a process at (arms the registry);
- :mod:`.metrics` - where the cache's live metrics go inside vLLM (read at each use);
- :mod:`.secrets` - which variables hold credentials, and their redaction from everything
  the package writes (manifests, run specs, logs, reports);
- :mod:`.listing` - every setting with its value, origin and error (``debug env``), and
  the check each command runs on the groups it reads (`validate_groups`);
- :mod:`._parse` - the shared primitives.

Conventions shared by every variable:

- surrounding whitespace is ignored, and a variable set to the empty string counts as
  unset (``export VAR=`` is how shells "unset" a variable in many launch scripts);
- booleans accept ``0/1/true/false/yes/no/on/off`` in any case, nothing else;
- a malformed value raises :class:`ConfigError` naming the variable and the value.
"""

from __future__ import annotations

from . import (
    compile_cache,
    faults,
    host_mode,
    identity,
    manifest,
    metrics,
    profiling,
    run,
    snapshot,
    trust,
)
from ._parse import (
    ConfigError,
    EnvVar,
    forget_parsed_groups,
    parse_bool,
    parse_positive_float,
    require_directory,
)
from .compile_cache import (
    TOOLCHAIN_NAMES,
    CompileCacheSettings,
    ToolchainName,
    compile_cache_settings,
    default_cache_root,
    load_compile_cache_settings,
    remote_cache_url,
)
from .faults import FaultSettings, fault_settings, load_fault_settings
from .host_mode import (
    COLD_START_MECHANISMS,
    HostModeSettings,
    cold_start_without,
    host_mode_settings,
    load_cpu_probe_marker,
    load_host_mode_settings,
    mark_cpu_probe_started,
)
from .identity import IdentitySettings, load_identity_settings
from .listing import (
    GROUPS,
    OTHER_READ,
    SettingRow,
    group_errors,
    setting_rows,
    validate_groups,
)
from .manifest import ManifestSettings, load_manifest_settings, manifest_settings
from .metrics import MetricsSettings, load_metrics_settings
from .profiling import ProfilingSettings, load_profiling_settings
from .run import load_run_id, run_id
from .secrets import (
    REDACTED,
    RedactingFilter,
    environment_with,
    install_log_redaction,
    is_secret_name,
    redact_argv,
    redact_config,
    redact_environment,
    redact_text,
)
from .snapshot import (
    SNAPSHOT_FORMATS,
    SnapshotFormat,
    SnapshotSettings,
    check_snapshot_root,
    load_snapshot_settings,
    snapshot_settings,
)
from .trust import TrustSettings, load_trust_settings, trust_settings

__all__ = [
    "ENVIRONMENT_VARIABLES",
    "GROUPS",
    "INTERNAL_MARKERS",
    "OTHER_READ",
    "OWN_SETTINGS",
    "READ_VARIABLES",
    "REDACTED",
    "SNAPSHOT_FORMATS",
    "TOOLCHAIN_NAMES",
    "CompileCacheSettings",
    "ConfigError",
    "EnvVar",
    "FaultSettings",
    "COLD_START_MECHANISMS",
    "HostModeSettings",
    "IdentitySettings",
    "ManifestSettings",
    "MetricsSettings",
    "ProfilingSettings",
    "RedactingFilter",
    "SettingRow",
    "SnapshotFormat",
    "SnapshotSettings",
    "ToolchainName",
    "TrustSettings",
    "check_snapshot_root",
    "compile_cache_settings",
    "default_cache_root",
    "environment_with",
    "fault_settings",
    "group_errors",
    "cold_start_without",
    "host_mode_settings",
    "install_log_redaction",
    "is_secret_name",
    "mark_cpu_probe_started",
    "load_compile_cache_settings",
    "load_cpu_probe_marker",
    "load_fault_settings",
    "load_host_mode_settings",
    "load_identity_settings",
    "load_manifest_settings",
    "load_metrics_settings",
    "load_profiling_settings",
    "load_run_id",
    "load_snapshot_settings",
    "load_trust_settings",
    "manifest_settings",
    "parse_bool",
    "parse_positive_float",
    "redact_argv",
    "redact_config",
    "redact_environment",
    "redact_text",
    "remote_cache_url",
    "require_directory",
    "reset_for_tests",
    "run_id",
    "setting_rows",
    "snapshot_settings",
    "trust_settings",
    "validate_groups",
]

# Every documented variable, grouped by feature, so the CLI and docs can list them all.
ENVIRONMENT_VARIABLES: tuple[EnvVar, ...] = (
    compile_cache.VARIABLES
    + trust.VARIABLES
    + manifest.VARIABLES
    + run.VARIABLES
    + snapshot.VARIABLES
    + profiling.VARIABLES
    + host_mode.VARIABLES
    + identity.VARIABLES
    + faults.VARIABLES
    + metrics.VARIABLES
)

# The settings this package owns: its VLLM_NEURON_* and NEURON_* variables, not vLLM's
# (VLLM_CACHE_ROOT, VLLM_DP_RANK), nor a launcher's (RANK, NEURON_VISIBLE_DEVICES: a worker's
# own, never the driver's). The plugin makes them known to vLLM's environment validation and
# hands them to Ray workers (vllm_neuron/plugin/vllm_env.py).
OWN_SETTINGS: tuple[str, ...] = tuple(
    v.name for v in ENVIRONMENT_VARIABLES
    if v.name.startswith(("VLLM_NEURON_", "NEURON_")) and v.feature != "identity"
)
# What the package sets itself for the processes it starts. Not settings, so named outside
# vLLM's VLLM_* namespace (vLLM checks every VLLM_* variable against its own list); handed to
# Ray workers with the settings.
INTERNAL_MARKERS: tuple[str, ...] = (
    host_mode.VLLM_NEURON_CPU_PROBE_STARTED,
    host_mode.VLLM_NEURON_WITHOUT,
    metrics.VLLM_NEURON_METRICS_DIR,
    compile_cache.VLLM_NEURON_NODE_FILES,
    compile_cache.VLLM_NEURON_SHARED_NODE_FILES,
    compile_cache.VLLM_NEURON_MODEL_INFO_LOOKED,
)

# Every variable this package reads: the documented ones, vLLM's VLLM_USE_AOT_COMPILE
# (host mode turns it off), prometheus_client's PROMETHEUS_MULTIPROC_DIR (where vLLM's
# /metrics collects from when set) and the standard ones defaults are derived from. No module
# outside this package may read one of them (tests/test_single_reader.py).
READ_VARIABLES: frozenset[str] = frozenset(v.name for v in ENVIRONMENT_VARIABLES) | OTHER_READ


def reset_for_tests() -> None:
    """Forget every cached settings group, snapshot settings included, so the next access
    re-reads os.environ. The snapshot capture budget is the snapshot feature's state, not
    a setting: ``vllm_neuron.snapshot.reset_snapshot_config`` resets both."""
    forget_parsed_groups()
    faults.disarm_faults()
