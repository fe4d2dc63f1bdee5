"""Run in the vLLM environment's interpreter (test_model_info.py): vLLM's model information
carried through a folder remote (vllm_neuron/plugin/model_info.py), with vLLM's own files.

``model_info_probe.py WORKDIR``: node A's vLLM writes its model information for Llama as
vLLM does (its own ``_save_modelinfo_to_cache``, the class inspected in this process rather
than in vLLM's subprocess: the same answer); node A publishes it; nodes B-F restore it into
empty (or not) directories, beside hostile files planted on the remote. Each node is its own
``VLLM_CACHE_ROOT``. Prints one ``MODELINFO <json>`` line of what happened.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

ARCH = "LlamaForCausalLM"


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname} {record.getMessage()}")


def main(workdir: Path) -> None:
    from vllm.model_executor.models.registry import ModelRegistry, _ModelInfo

    from vllm_neuron.backends import open_store
    from vllm_neuron.plugin import model_info

    handler = _Count()
    logging.getLogger("vllm_neuron").addHandler(handler)
    logging.getLogger("vllm_neuron").setLevel(logging.INFO)
    lazy = ModelRegistry.models[ARCH]
    out: dict[str, Any] = {}

    def node(name: str) -> Path:
        os.environ["VLLM_CACHE_ROOT"] = str(workdir / name)
        return Path(model_info.local_model_info_dir() or "")

    def vllm_reads() -> Any:  # what vLLM's inspect_model_cls reads before any subprocess
        path = Path(sys.modules[lazy.module_name].__file__ or "")
        found = lazy._load_modelinfo_from_cache(lazy._get_modelinfo_module_hash(path))
        return None if found is None else found.architecture

    # Node A: vLLM's own file, as vLLM writes it.
    a_dir = node("a")
    info = _ModelInfo.from_model_cls(lazy.load_model_cls())
    path = Path(sys.modules[lazy.module_name].__file__ or "")
    lazy._save_modelinfo_to_cache(info, lazy._get_modelinfo_module_hash(path))
    names = sorted(p.name for p in a_dir.iterdir())
    out["a_files"] = names
    out["a_problem"] = model_info.problem(names[0], (a_dir / names[0]).read_bytes())
    remote = open_store(str(workdir / "remote"))
    out["published"] = [model_info.publish(remote), model_info.publish(remote)]
    version_dir = model_info._version_dir()
    out["remote_same"] = remote.read(f"{version_dir}/{names[0]}") == (a_dir / names[0]).read_bytes()

    # Node B: a new node.
    b_dir = node("b")
    out["b_vllm_before"] = vllm_reads()
    out["b_restored"] = [model_info.restore(remote), model_info.restore(remote)]
    out["b_same"] = (b_dir / names[0]).read_bytes() == (a_dir / names[0]).read_bytes()
    out["b_vllm_after"] = vllm_reads()

    # Hostile files beside the good one: each ignored, said once; the good one still copied.
    good = json.loads((a_dir / names[0]).read_bytes())
    remote_dir = workdir / "remote" / version_dir

    def plant(name: str, data: bytes) -> None:
        (remote_dir / name).write_bytes(data)

    plant("junk-Junk.json", b"\x00not json")
    plant("wrong-fields-LlamaForCausalLM.json",
          json.dumps({"hash": good["hash"], "modelinfo": {"architecture": ARCH}}).encode())
    extra = dict(good["modelinfo"], run_this="rm -rf /")
    plant("extra-field-LlamaForCausalLM.json",
          json.dumps({"hash": good["hash"], "modelinfo": extra}).encode())
    plant("other-class-MistralForCausalLM.json", json.dumps(good).encode())
    nested = dict(good["modelinfo"], supports_pp={"yes": True})
    plant("nested-LlamaForCausalLM.json",
          json.dumps({"hash": good["hash"], "modelinfo": nested}).encode())
    for field, value in (("is_attention_free", "false"), ("supports_pp", []),
                         ("attn_type", "nonsense"), ("default_seq_pooling_type", "ZZ"),
                         ("score_type", "x"), ("supported_video_pruning_methods", [1])):
        plant(f"type-{field.replace('_', '-')}-LlamaForCausalLM.json", json.dumps(
            {"hash": good["hash"], "modelinfo": dict(good["modelinfo"], **{field: value})}
        ).encode())
    plant("arch-not-str-True.json", json.dumps(
        {"hash": good["hash"], "modelinfo": dict(good["modelinfo"], architecture=True)}).encode())
    plant("large-LlamaForCausalLM.json", b" " * (model_info.MAX_BYTES + 1))
    os.mkfifo(remote_dir / "fifo-LlamaForCausalLM.json")
    os.symlink(a_dir / names[0], remote_dir / "link-LlamaForCausalLM.json")
    plant("not.a.vllm.name.json", json.dumps(good).encode())
    c_dir = node("c")
    handler.messages.clear()
    out["c_restored"] = model_info.restore(remote)
    out["c_files"] = sorted(p.name for p in c_dir.iterdir())
    out["c_warnings"] = sorted(m for m in handler.messages if m.startswith("WARNING"))

    # Node D: vLLM has run here (a file of its own, of another class): nothing copied.
    d_dir = node("d")
    d_dir.mkdir(parents=True)
    (d_dir / "vllm-model_executor-models-opt-OPTForCausalLM.json").write_text("{}")
    out["d_restored"] = model_info.restore(remote)
    out["d_files"] = sorted(p.name for p in d_dir.iterdir())

    # The plugin's registration: with the remote set (trust off), once per start (the
    # marker its processes inherit), and under warn (said per file) and require (none).
    os.environ["NEURON_LIBTORCH_REMOTE_CACHE"] = str(workdir / "remote")
    node("e")
    out["e_restored"] = model_info.restore_for_start()
    node("e2")
    out["e2_restored_in_the_same_start"] = model_info.restore_for_start()
    del os.environ["_VLLM_NEURON_MODEL_INFO_LOOKED"]
    from vllm_neuron.compile.trust.signing import generate_key_pair

    keys = workdir / "keys"
    _, public, _ = generate_key_pair(str(keys), "builder")
    os.environ.update(VLLM_NEURON_CACHE_TRUST="warn", VLLM_NEURON_CACHE_TRUSTED_KEYS=public)
    node("w")
    handler.messages.clear()
    out["w_restored"] = model_info.restore_for_start()
    out["w_warnings"] = [m for m in handler.messages
                         if m.startswith("WARNING") and "is not signed" in m]
    del os.environ["_VLLM_NEURON_MODEL_INFO_LOOKED"]
    node("f")
    os.environ.update(VLLM_NEURON_CACHE_TRUST="require")
    out["f_restored"] = model_info.restore_for_start()
    out["f_exists"] = (workdir / "f" / "modelinfos").exists()
    print("MODELINFO " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
