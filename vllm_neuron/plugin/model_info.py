"""vLLM's model information, carried to a deployment's new nodes through the remote tier.

Before vLLM builds its configuration it asks what the model's class supports (text
generation, pooling, pipeline parallelism, ...). It learns that by importing the class in a
fresh interpreter (``_run_in_subprocess``: 12-15 s on 2 cores, on the critical path of every
start) and keeps the answer in ``$VLLM_CACHE_ROOT/modelinfos/<module>-<class>.json`` with a
hash of the module's source, which it checks on the next start. A warm restart reads the
file; a new node - a new pod, its cache empty - pays the subprocess again: once every graph
is fetched from the remote tier instead of compiled, that subprocess is most of what a new
node spends beyond a warm restart (benchmarks/RESULTS.md, P11).

So a process that records its deployment on the remote (compile/tiers/deployments.py) also
leaves there vLLM's model information files (`publish`): ``.modelinfos/<vLLM version>/
<file>``, vLLM's bytes as it wrote them. vLLM's first process on a node whose model
information directory holds no file (`restore`, from the plugin's registration, before vLLM
builds its configuration) copies them in, and vLLM finds them as on a warm restart.

Whoever can write the remote can write these files, and vLLM believes what they say. vLLM's
hash check is no defence against that: the hash is of vLLM's public source, and a file that
carries it with well-typed lies (another pooling type, a flipped capability) is believed, and
can make a server answer wrongly without an error. So:

* they are read only where the remote's entries are loaded unsigned anyway (trust ``off`` or
  ``warn``: whoever writes the remote can already have this node run code of theirs), with
  one warning per file copied under ``warn``; under ``require`` none is read, as no
  deployment record is (they are not signed);
* each is read bounded (`MAX_BYTES`, regular files only), at most `MAX_FILES` of them; a name
  vLLM would not give a file is skipped; the content must be exactly vLLM's layout and
  types (`problem`: every field of vLLM's ``_ModelInfo``, each of the type vLLM declares - a
  boolean a JSON boolean, a choice one of vLLM's choices - and the class the name says);
  anything else is ignored, with one warning;
* a file is never written over one of vLLM's (create-only), and only into a directory that
  holds none: vLLM's own answers are never replaced;
* the copy is tried once per start (``_VLLM_NEURON_MODEL_INFO_LOOKED``, inherited by vLLM's
  inspection subprocess and engine processes, which load this plugin too), and gives up at
  `look_within`'s deadline, writing nothing after it.

Where vLLM keeps them, and what it declares, is vLLM's private layout, read through the
fence (vllm_internals.py); without it nothing is carried and vLLM inspects as it does alone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import typing
from typing import Any

from vllm_neuron.backends import Store, open_store
from vllm_neuron.backends.errors import ListingTooLarge, RecordError
from vllm_neuron.compile.head_start import look_within, quick_remote, started_by_an_ancestor
from vllm_neuron.envs import ConfigError, load_compile_cache_settings, load_trust_settings
from vllm_neuron.envs.compile_cache import load_model_info_looked, mark_model_info_looked
from vllm_neuron.vllm_internals import resolve

__all__ = ["MAX_BYTES", "MAX_FILES", "MODEL_INFO_DIR", "local_model_info_dir", "problem",
           "publish", "restore", "restore_for_start"]  # fmt: skip

logger = logging.getLogger("vllm_neuron")

MODEL_INFO_DIR = ".modelinfos"
"""On the remote tier: ``<dir>/<vLLM version>/<vLLM's file name>``."""
MAX_FILES = 64
"""The most files carried either way (a deployment needs one per model class it serves)."""
MAX_BYTES = 64 << 10
"""The largest file read (vLLM's are about 1 KB)."""
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,200}\.json\Z")
"""vLLM's names: ``<module>-<class>.json``, dots made dashes."""
_LAZY = "vllm.model_executor.models.registry._LazyRegisteredModel"
_MODEL_INFO = "vllm.model_executor.models.registry._ModelInfo"
_CHOICES = {  # fields vLLM annotates with choices it imports only for type checkers (Any
    # at run time), and where those choices live
    "attn_type": "vllm.config.model.AttnTypeStr",
    "default_seq_pooling_type": "vllm.config.pooler.SequencePoolingType",
    "default_tok_pooling_type": "vllm.config.pooler.TokenPoolingType",
}

_WARNED: set[str] = set()


def local_model_info_dir() -> str | None:
    """vLLM's model information directory for this process, or None when vLLM keeps it
    otherwise than this package knows (the fence says so once)."""
    lazy = resolve(_LAZY)
    if lazy is None:
        return None
    try:
        return str(lazy._get_cache_dir())
    except Exception as exc:  # noqa: BLE001 - vLLM's settings broke (its own start says so)
        _warn_once("vLLM's model information directory", f"it cannot be read ({exc})")
        return None


def _declared() -> dict[str, Any] | None:
    """Each field of vLLM's ``_ModelInfo`` with the type vLLM declares for it, or None when
    vLLM's declarations are not as this package knows them (then no file is believed)."""
    info = resolve(_MODEL_INFO)
    choices = {name: resolve(qualname) for name, qualname in _CHOICES.items()}
    if info is None or not dataclasses.is_dataclass(info) or None in choices.values():
        return None
    try:
        hints = typing.get_type_hints(info)
    except Exception:  # noqa: BLE001 - an annotation this package cannot read
        return None
    declared = {f.name: hints.get(f.name) for f in dataclasses.fields(info)}
    for name, literal in choices.items():
        if declared.get(name, literal) is Any:  # as vLLM has it at run time
            declared[name] = literal
    return declared


def _fits(value: Any, declared: Any) -> bool:
    """Whether the JSON `value` is one vLLM's `declared` type allows; a type this package
    does not know allows nothing."""
    if declared is bool:
        return isinstance(value, bool)
    if declared is str:
        return isinstance(value, str)
    origin, args = typing.get_origin(declared), typing.get_args(declared)
    if origin is typing.Literal:
        return isinstance(value, str) and value in args
    if origin is tuple and args == (str, Ellipsis):  # saved by vLLM as a list
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return False


def problem(name: str, data: bytes) -> str | None:
    """Why `data`, named `name`, is not a model information file of this vLLM, or None."""
    if not NAME_RE.fullmatch(name):
        return "not a name vLLM gives its files"
    declared = _declared()
    if declared is None:
        return "this vLLM's model information is not as vllm_neuron knows it"
    try:
        found = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        return f"not JSON ({exc})"
    if not isinstance(found, dict) or set(found) != {"hash", "modelinfo"}:
        return "not vLLM's layout (an object of 'hash' and 'modelinfo')"
    digest, info = found["hash"], found["modelinfo"]
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{16,128}", digest):
        return "its hash is not a hex digest"
    if not isinstance(info, dict) or set(info) != set(declared):
        return "its fields are not this vLLM's"
    wrong = sorted(k for k, v in info.items() if not _fits(v, declared[k]))
    if wrong:
        return f"not of the type vLLM declares: {', '.join(wrong)}"
    if not name.endswith(f"-{info['architecture']}.json"):
        return f"it describes {info['architecture'][:80]!r}, not the class its name says"
    return None


def _version_dir() -> str:
    import vllm

    version = re.sub(r"[^A-Za-z0-9._+-]", "_", str(getattr(vllm, "__version__", "unknown")))
    return f"{MODEL_INFO_DIR}/{version}"


def _warn_once(where: str, why: str) -> None:
    if where not in _WARNED:
        _WARNED.add(where)
        logger.warning("vllm_neuron: %s is ignored: %s", where, why)


def _read(store: Store, key: str) -> bytes | None:
    """`key`'s bytes, bounded and regular, or None (said once when it is not)."""
    try:
        return store.read(key, max_size=MAX_BYTES)
    except RecordError as exc:  # too large, or not a regular file
        _warn_once(f"{store.url}/{key}", str(exc))
        return None


def _names(store: Store, prefix: str) -> list[str]:
    try:
        names = store.list_dir(prefix, max_names=MAX_FILES)
    except ListingTooLarge:
        _warn_once(f"{store.url}/{prefix}", f"more than {MAX_FILES} files: none is carried")
        return []
    return [n for n in names if NAME_RE.fullmatch(n)]


def publish(remote: Store) -> int:
    """Copy this node's model information files to `remote` where it lacks them or holds
    other bytes; how many were written. The caller has checked it may write there; a store
    that refuses raises."""
    local_dir = local_model_info_dir()
    if local_dir is None:
        return 0
    local = open_store(local_dir, create=False)
    version_dir, written = _version_dir(), 0
    for name in _names(local, ""):
        data = _read(local, name)
        if data is None or problem(name, data) is not None:
            continue  # vLLM's own, as vLLM wrote it: a file it would not read is not carried
        key = f"{version_dir}/{name}"
        if _read(remote, key) != data:
            remote.write(key, data)
            written += 1
    return written


def _vllm_has_run(local: Store) -> bool:
    """Whether vLLM's directory holds a file of vLLM's: its own answers stand."""
    return any(NAME_RE.fullmatch(n) for n in local.list_dir(""))


def restore(remote: Store, *, unsigned_warning: bool = False,
            gave_up: threading.Event | None = None) -> int:
    """Copy the remote's model information files for this vLLM into this node's directory
    when it holds none; how many were copied (said at info; each one with a warning when
    `unsigned_warning`: trust ``warn``). Nothing is written once `gave_up` is set (the
    start went on without this copy)."""
    local_dir = local_model_info_dir()
    if local_dir is None:
        return 0
    local = open_store(local_dir, create=True)
    if _vllm_has_run(local):
        return 0
    version_dir, copied = _version_dir(), 0
    for name in _names(remote, version_dir):
        data = _read(remote, f"{version_dir}/{name}")
        if data is None:
            continue
        why = problem(name, data)
        if why is not None:
            _warn_once(f"{remote.url}/{version_dir}/{name}", why)
            continue
        if gave_up is not None and gave_up.is_set():
            return copied
        if local.create(name, data):
            copied += 1
            if unsigned_warning:
                logger.warning("vllm_neuron: vLLM's model information %s from %s is not signed "
                               "and is believed (VLLM_NEURON_CACHE_TRUST=warn): whoever writes "
                               "the remote decides what vLLM takes the model class to support",
                               name, remote.url)  # fmt: skip
    if copied:
        logger.info("vllm_neuron: vLLM's model information for %d model class(es) copied "
                    "from the remote tier into %s (vLLM inspects no class in a subprocess)",
                    copied, local_dir)  # fmt: skip
    return copied


def restore_for_start() -> int:
    """`restore` from this process's remote tier, before vLLM builds its configuration (the
    plugin's registration), once per start (``_VLLM_NEURON_MODEL_INFO_LOOKED``, set for the
    processes this one starts): when a remote is set, the cache is on, trust is not
    ``require`` and vLLM's directory holds no file (decided without a remote request); the
    remote's part within `look_within`'s deadline (a hung remote must not hold vLLM's
    start). Never raises: vLLM then inspects the class itself."""
    if started_by_an_ancestor(load_model_info_looked()):
        return 0
    mark_model_info_looked()
    try:
        settings = load_compile_cache_settings()
        if not settings.remote_cache or settings.disable_compile_cache:
            return 0
        mode = load_trust_settings().mode
        if mode == "require":
            return 0  # unsigned, like a deployment record: not believed under require
        local_dir = local_model_info_dir()  # vLLM's module imported here, not in the look
        if local_dir is None or _vllm_has_run(open_store(local_dir, create=False)):
            return 0
    except ConfigError:
        return 0  # the cache's own start says it, naming the setting
    except Exception as exc:  # noqa: BLE001 - a head start, never a need
        return _not_copied(exc)
    remote_url = settings.remote_cache

    def copy(gave_up: threading.Event) -> int:
        try:
            return restore(quick_remote(remote_url), unsigned_warning=mode == "warn",
                           gave_up=gave_up)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a head start, never a need
            return _not_copied(exc)

    return look_within(copy, 0, "a copy of vLLM's model information")


def _not_copied(exc: Exception) -> int:
    logger.info("vllm_neuron: vLLM's model information was not copied from the remote tier "
                "(%s); vLLM inspects the model class itself", exc)
    return 0
