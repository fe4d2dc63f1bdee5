"""This package's variables inside the real vLLM (the ``vllm`` tests' environment, no server).

vLLM's own code decides: ``Platform.validate_environ(hard_fail=True)`` (what
``--fail-on-environ-validation`` runs) refuses an unknown ``VLLM_*`` variable until the
general plugin registered the settings; ``vllm.ray.ray_env.get_env_vars_to_copy`` (what
vLLM's Ray executor calls, with the platform's ``additional_env_vars``) then names every
set setting and marker, NEURON_* ones included; and vLLM's compile-cache hash
(``compile_factors``) does not depend on the settings' values. Ray itself is not installed in
the suite's vLLM environment (a real Ray-backed engine would also need a Ray cluster on two
loaded cores), so the hook vLLM's Ray executor calls is what is run. A real ``vllm serve``
under strict validation is in test_vllm_serve.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from vllm_neuron.envs import INTERNAL_MARKERS, OWN_SETTINGS

pytestmark = pytest.mark.vllm

PROBE = """
import json, os
from vllm import envs
from vllm.platforms.interface import Platform

def strict():
    try:
        Platform.validate_environ(hard_fail=True)
        return None
    except ValueError as exc:
        return str(exc)

out = {"before": strict()}
from vllm_neuron.plugin.vllm_env import register_settings_with_vllm
out["added"] = register_settings_with_vllm()
out["again"] = register_settings_with_vllm()  # idempotent: every process loads the plugin
out["after"] = strict()
from vllm.ray.ray_env import get_env_vars_to_copy
from vllm_neuron.plugin.platform import NeuronHostPlatform
hook = set(NeuronHostPlatform.additional_env_vars)
out["host"] = sorted(n for n in get_env_vars_to_copy(additional_vars=hook) if n in os.environ)
out["other"] = sorted(n for n in get_env_vars_to_copy() if n in os.environ)
factors = envs.compile_factors()
for name in out["added"]:
    os.environ[name] = os.environ[name] + "-changed"
out["same_hash"] = envs.compile_factors() == factors
print("PROBE " + json.dumps(out))
"""


def test_settings_pass_strict_validation_and_reach_ray_workers(vllm_python: Path) -> None:
    settings = {name: "x" for name in OWN_SETTINGS}
    markers = {name: "1" for name in INTERNAL_MARKERS}
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(settings, **markers)
    proc = subprocess.run([str(vllm_python), "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PROBE "))
    out = json.loads(line.removeprefix("PROBE "))
    # Without the registration vLLM's strict mode refuses one of ours: the check is real.
    assert (out["before"] or "").startswith("Unknown vLLM environment variable detected: "
                                            "VLLM_NEURON_")
    assert out["after"] is None
    assert sorted(out["added"]) == sorted(OWN_SETTINGS) and out["again"] == []
    # Host mode (the hook): every setting and marker; any other platform (a Neuron host):
    # every setting, through the registered names. NEURON_* are no prefix vLLM copies.
    assert set(out["host"]) >= set(settings) | set(markers)
    assert set(out["other"]) >= set(settings)
    assert any(n.startswith("NEURON_") for n in settings)
    assert out["same_hash"]  # vLLM's compile cache is not keyed by our values
