"""This package's settings made known to vLLM: its environment validation and its Ray workers.

vLLM 0.32 checks every ``VLLM_*`` variable of the server's environment against the names in
``vllm.envs.environment_variables`` (``Platform.validate_environ``, while it builds the engine
configuration, after the general plugins ran): an unknown one is warned about
(``Unknown vLLM environment variable detected``), or refused when the server runs with
``--fail-on-environ-validation``. vLLM has no call for a plugin to add names; that module-level
dict is what it checks, and ``vllm.ray.ray_env.get_env_vars_to_copy`` copies every name in it
that is set to the Ray workers, whichever platform runs (the host platform's
``additional_env_vars`` only applies in host mode). So the general plugin adds this
package's own settings (:data:`vllm_neuron.envs.OWN_SETTINGS`) to it, in every process, and
this module is the one place that touches that dict: a vLLM without it gets one warning and
no registration, never a failed start.

Each name is registered with a getter that returns None, not the variable's value: vLLM
hashes every registered getter's value into its own compile-cache key
(``vllm.envs.compile_factors``), and a per-run value such as ``VLLM_NEURON_RUN_ID`` would
give every run a new vLLM compile cache. The values are read by :mod:`vllm_neuron.envs`.
A name vLLM already defines keeps vLLM's getter.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Any

from vllm_neuron.envs import OWN_SETTINGS
from vllm_neuron.vllm_internals import resolve

__all__ = ["register_settings_with_vllm"]

logger = logging.getLogger("vllm_neuron")


def _unset() -> None:
    """The getter of every registered name (see the module: a constant for vLLM's hash)."""
    return None


def register_settings_with_vllm(vllm_envs: Any = None) -> list[str]:
    """Add :data:`OWN_SETTINGS` to vLLM's table of known variables (``vllm_envs``: the
    ``vllm.envs`` module, imported when None). The names added now; [] when vLLM is missing
    (nothing to register with) or its table is (logged once, as a warning)."""
    if vllm_envs is None:
        if importlib.util.find_spec("vllm") is None:  # outside vLLM (the CLI, tests):
            return []  # nothing checks our names
        table = resolve("vllm.envs.environment_variables")  # warns once when missing
        if table is None:
            return []
    else:
        table = getattr(vllm_envs, "environment_variables", None)
    if not isinstance(table, dict):
        logger.warning(
            "vllm_neuron: this vLLM has no vllm.envs.environment_variables table: its "
            "environment validation may report the VLLM_NEURON_* settings as unknown, and "
            "Ray workers get only the VLLM_* ones (set VLLM_RAY_EXTRA_ENV_VARS_TO_COPY)")
        return []
    added = [name for name in OWN_SETTINGS if name not in table]
    for name in added:
        table[name] = _unset
    return added
