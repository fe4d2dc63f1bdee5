"""Trust never rests on a field someone else could write (docs/trust.md, "Where an entry came
from"): a local record's ``compiled_on`` and ``fetched.verified_by`` count only under this
node's seal (compile/trust/origin.py), the local tier is this node's own only by ownership
and mode (compile/tiers/health.py `not_own_tier`), and a builder signs only what it compiled
or verified. Every path that brings an entry in is tried under ``require`` with an entry
nobody trusted: compile, fetch, warm, owed promotion settling, ``cache promote``, ``cache
verify --load`` and ``manifest check --remote``.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
from test_trust import (  # tests/compile/trust/test_trust.py
    KEY,
    build_and_promote,
    builder_policy,
    cli,
    serving_policy,
)

from vllm_neuron.backends import open_store
from vllm_neuron.compile.commands.warm import warm_keys
from vllm_neuron.compile.entry.record import ENTRY_RECORD, decode_record
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.tiers.location import resolve_local_tier
from vllm_neuron.compile.tiers.promote import CannotSign, promote_entry
from vllm_neuron.compile.tiers.remote import RemoteTier
from vllm_neuron.compile.trust.origin import NODE_KEY_SUFFIX, forget_node_keys
from vllm_neuron.compile.trust.policy import TrustPolicy, forget_trust_policy, load_trust_policy
from vllm_neuron.compile.trust.signing import SIGNATURE_FILE, generate_key_pair, load_signer
from vllm_neuron.compile.upkeep.owed import owe_promotion, settle_owed
from vllm_neuron.envs import load_trust_settings, reset_for_tests
from vllm_neuron.manifest.inspect import check_startup
from vllm_neuron.manifest.schema import GraphEntry, Manifest

OTHER = "6f" * 16
THIRD = "7a" * 16
STRANGER_UID = 65534


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Any]:
    """The builder's key pair (as test_trust.py's fixture)."""
    return {"builder": generate_key_pair(str(tmp_path / "keys"), "builder")}


@pytest.fixture(autouse=True)
def _fresh_keys() -> Any:
    forget_node_keys()
    yield
    forget_node_keys()


@pytest.fixture
def process_trust(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``process_trust(**env)``: the process's trust settings (what a cache started without
    an explicit policy, its upkeep and the CLI's helpers use), forgotten again after."""

    def setting(**env: str) -> None:
        for name in ("VLLM_NEURON_CACHE_TRUST", "VLLM_NEURON_CACHE_TRUSTED_KEYS",
                     "VLLM_NEURON_CACHE_SIGNING_KEY"):  # fmt: skip
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        reset_for_tests()
        forget_trust_policy()

    yield setting
    monkeypatch.undo()
    reset_for_tests()
    forget_trust_policy()


def compiled_elsewhere(tmp_path: Path, key: str, compile_fn: Any) -> Path:
    """``key`` compiled by another node (another tier, another node key), unsigned."""
    tier = tmp_path / f"elsewhere-{key[:6]}"
    TwoTierCache(str(tier), trust=TrustPolicy()).get_or_compile(key, compile_fn(key))
    return tier / key


def plant(tier: Path, key: str, tmp_path: Path, compile_fn: Any, claim: str,
          builder_id: str = "") -> None:  # fmt: skip
    """Put into ``tier`` an entry this node never compiled nor fetched, its record claiming
    what this node writes of its own: ``compiled_on`` (no seal), ``fetched`` verified by
    the builder's key, or another node's record as that node wrote it (its seal and all)."""
    shutil.copytree(compiled_elsewhere(tmp_path, key, compile_fn), tier / key)
    path = tier / key / ENTRY_RECORD
    raw = json.loads(path.read_bytes())
    assert raw["compiled_on"] and raw["sealed"]  # as its node wrote it
    if claim == "compiled_on":
        raw.pop("sealed")
    elif claim == "fetched":
        raw.pop("compiled_on")
        raw["fetched"] = {"remote": "s3://fleet/cache", "at": 1.0, "verified_by": builder_id}
    path.write_text(json.dumps(raw))


CLAIMS = ["compiled_on", "fetched", "another-nodes-seal"]


# -- compile: this node's own, sealed; a changed record is no longer its own -----------------


def test_an_own_compile_is_sealed_and_a_changed_record_is_judged_by_signature(
    tmp_path: Path, compile_fn: Any, keys: dict[str, Any]
) -> None:
    tier = tmp_path / "node"
    node = TwoTierCache(str(tier), trust=serving_policy(keys))
    assert node.get_or_compile(KEY, compile_fn(KEY)).source == "compiled"
    key_file = Path(str(tier) + NODE_KEY_SUFFIX)
    info = key_file.stat()
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
    assert json.loads((tier / KEY / ENTRY_RECORD).read_bytes())["sealed"]
    again = TwoTierCache(str(tier), trust=serving_policy(keys))
    assert again.get_or_compile(KEY, compile_fn(KEY)).source == "local"  # its own: trusted
    raw = json.loads((tier / KEY / ENTRY_RECORD).read_bytes())
    raw["created"] += 1.0  # any change breaks the seal: of unknown origin, unsigned
    (tier / KEY / ENTRY_RECORD).write_text(json.dumps(raw))
    forget_node_keys()
    later = TwoTierCache(str(tier), trust=serving_policy(keys))
    assert later.get_or_compile(KEY, compile_fn(KEY)).source == "compiled"


# -- a planted entry: never trusted, never signed, never published ----------------------------


@pytest.mark.parametrize("claim", CLAIMS)
def test_a_planted_entry_is_of_unknown_origin_on_every_path(
    claim: str, tmp_path: Path, compile_fn: Any, keys: dict[str, Any], cache_warnings: Any,
    process_trust: Any,
) -> None:  # fmt: skip
    """The attack: an entry planted in a builder's local tier, with a note that its
    promotion is owed, was signed with the builder's key and published at the next start."""
    remote, tier = tmp_path / "remote", tmp_path / "builder"
    process_trust(VLLM_NEURON_CACHE_SIGNING_KEY=keys["builder"][0],
                  VLLM_NEURON_CACHE_TRUSTED_KEYS=keys["builder"][1])  # fmt: skip
    TwoTierCache(str(tier)).get_or_compile(THIRD, compile_fn(THIRD))  # its own, not promoted
    plant(tier, KEY, tmp_path, compile_fn, claim, keys["builder"][2])
    local = open_store(str(tier))
    for key in (KEY, THIRD):
        owe_promotion(local, key, str(remote))
    # The builder's next start settles the promotions owed: only its own entry goes.
    restarted = TwoTierCache(str(tier), remote=str(remote))
    assert restarted.get_or_compile(THIRD, compile_fn(THIRD)).source == "local"
    assert restarted.wait_for_upkeep(timeout=120)
    assert (remote / THIRD / SIGNATURE_FILE).is_file()  # the path works: its own, signed
    assert not (remote / KEY).exists(), "a planted entry was signed and published"
    assert any("origin is unknown" in w for w in cache_warnings()), cache_warnings()
    # settle_owed itself, asked again (the note is gone: settled as never to be shared).
    owe_promotion(local, KEY, str(remote))
    settle_owed(local, RemoteTier(str(remote), {}, lambda event: None), [KEY],
                lease_seconds=5.0, lock_lease=5.0, quarantine=lambda key, why: None)  # fmt: skip
    assert not (remote / KEY).exists()
    # `cache promote` and promote_entry: refused the same way.
    with pytest.raises(CannotSign, match="origin is unknown"):
        promote_entry(local, open_store(str(remote)), KEY, policy=builder_policy(keys))
    env = {"VLLM_NEURON_CACHE_SIGNING_KEY": keys["builder"][0],
           "VLLM_NEURON_CACHE_TRUSTED_KEYS": keys["builder"][1]}  # fmt: skip
    done = cli("cache", "--cache-dir", str(tier), "promote", "--to", str(remote), "--key", KEY,
               env=env)  # fmt: skip
    assert done.returncode == 1 and "origin is unknown" in done.stdout + done.stderr
    assert not (remote / KEY).exists()
    # `cache sign` never signs it either.
    signed = cli("cache", "sign", str(tier), "--key", keys["builder"][0], "--entry", KEY)
    assert signed.returncode == 1 and "origin is unknown" in signed.stdout, signed.stdout
    assert not (tier / KEY / SIGNATURE_FILE).exists()
    # A serving process under require: not a local hit, compiled for itself.
    node = TwoTierCache(str(tier), trust=serving_policy(keys))
    assert node.get_or_compile(KEY, compile_fn(KEY)).source == "compiled"


# -- fetch: a builder in warn mode never re-signs what it fetched unsigned -------------------


def test_a_builder_in_warn_mode_never_signs_an_entry_it_fetched_unsigned(
    tmp_path: Path, compile_fn: Any, keys: dict[str, Any]
) -> None:
    remote = build_and_promote(tmp_path, compile_fn, keys)
    (Path(remote) / KEY / SIGNATURE_FILE).unlink()
    warn_builder = load_trust_policy(load_trust_settings({
        "VLLM_NEURON_CACHE_SIGNING_KEY": keys["builder"][0],
        "VLLM_NEURON_CACHE_TRUSTED_KEYS": keys["builder"][1],
        "VLLM_NEURON_CACHE_TRUST": "warn"}))  # fmt: skip
    tier = tmp_path / "warn-builder"
    cache = TwoTierCache(str(tier), remote=remote, trust=warn_builder)
    assert cache.get_or_compile(KEY, compile_fn(KEY)).source == "remote"  # used (warn)
    assert json.loads((tier / KEY / ENTRY_RECORD).read_bytes())["fetched"]["verified_by"] is None
    elsewhere = open_store(str(tmp_path / "another-remote"))
    with pytest.raises(CannotSign, match="without a signature this process trusts"):
        promote_entry(cache.local, elsewhere, KEY, policy=warn_builder)
    assert elsewhere.published(KEY) is None
    signed = cli("cache", "sign", str(tier), "--key", keys["builder"][0], "--entry", KEY)
    assert signed.returncode == 1 and "without a trusted signature" in signed.stdout
    assert not (tier / KEY / SIGNATURE_FILE).exists()


# -- warm: judged before it is copied, and the local tier re-checked -------------------------


def test_warm_under_require_copies_only_trusted_entries_and_rechecks_the_local_tier(
    tmp_path: Path, compile_fn: Any, keys: dict[str, Any]
) -> None:
    remote = build_and_promote(tmp_path, compile_fn, keys)  # KEY, signed
    TwoTierCache(str(tmp_path / "b2"), remote=remote, trust=builder_policy(keys)
                 ).get_or_compile(THIRD, compile_fn(THIRD))  # fmt: skip
    TwoTierCache(str(tmp_path / "unsigned-builder"), remote=remote, trust=TrustPolicy()
                 ).get_or_compile(OTHER, compile_fn(OTHER))  # fmt: skip
    assert not (Path(remote) / OTHER / SIGNATURE_FILE).exists()
    tier = tmp_path / "node"
    TwoTierCache(str(tier), trust=TrustPolicy()).get_or_compile("8b" * 16, compile_fn("8b" * 16))
    plant(tier, THIRD, tmp_path, compile_fn, "compiled_on")  # planted: re-checked, replaced
    result = warm_keys(open_store(str(tier)), open_store(remote), [KEY, OTHER, THIRD],
                       policy=serving_policy(keys))  # fmt: skip
    assert sorted(result.fetched) == sorted([KEY, THIRD]), result
    assert set(result.untrusted) == {OTHER} and not (tier / OTHER).exists()
    fetched = json.loads((tier / THIRD / ENTRY_RECORD).read_bytes())["fetched"]
    assert fetched["verified_by"] == keys["builder"][2]


# -- verify --load: the shared folder's objects are never loaded untrusted -------------------


def _shared_folder(tmp_path: Path, compile_fn: Any, how: str) -> Path:
    """A folder the fleet shares: entries copied in from other nodes (or compiled there by
    this node), and the folder either writable by others or another user's. Named to the
    CLI as ``--cache-dir``: a shared tier all the same (what others may change there, this
    node's seal cannot vouch for)."""
    shared = tmp_path / "shared"
    if how == "own-compiles-world-writable":  # this node's compiles, its seal and all
        TwoTierCache(str(shared), trust=TrustPolicy()).get_or_compile(KEY, compile_fn(KEY))
    else:
        shared.mkdir()
        shutil.copytree(compiled_elsewhere(tmp_path, KEY, compile_fn), shared / KEY)
    if how != "another-users":
        shared.chmod(0o777)
    else:
        os.chown(shared, STRANGER_UID, STRANGER_UID)
    return shared


@pytest.mark.parametrize("where", ["world-writable", "another-users", "own-tier-planted",
                                   "own-compiles-world-writable"])
def test_verify_load_never_loads_an_entry_no_trusted_key_signed(
    where: str, tmp_path: Path, compile_fn: Any, keys: dict[str, Any]
) -> None:
    if where == "own-tier-planted":
        tier = tmp_path / "node"
        TwoTierCache(str(tier), trust=TrustPolicy()).get_or_compile(OTHER, compile_fn(OTHER))
        plant(tier, KEY, tmp_path, compile_fn, "compiled_on")
    else:
        tier = _shared_folder(tmp_path, compile_fn, where)
    done = cli("cache", "--cache-dir", str(tier), "verify", "--load", "--keep",
               "--trusted-keys", keys["builder"][1], "--json")  # fmt: skip
    rows = {r["key"]: r for r in json.loads(done.stdout)}
    assert rows[KEY]["trust"] != "trusted", rows[KEY]
    assert rows[KEY]["loads"] is None and "untrusted" in rows[KEY]["load_detail"], rows[KEY]
    if where == "own-tier-planted":  # its own compile: trusted there, and loaded
        assert rows[OTHER]["trust"] == "trusted"
        assert "untrusted" not in rows[OTHER]["load_detail"], rows[OTHER]


# -- manifest check --remote: what the engine would refuse is missing ------------------------


def test_manifest_check_counts_an_untrusted_entry_as_missing(
    tmp_path: Path, compile_fn: Any, keys: dict[str, Any], process_trust: Any
) -> None:
    remote = build_and_promote(tmp_path, compile_fn, keys)  # KEY signed
    TwoTierCache(str(tmp_path / "unsigned-builder"), remote=remote, trust=TrustPolicy()
                 ).get_or_compile(OTHER, compile_fn(OTHER))  # fmt: skip
    tier = tmp_path / "node"
    TwoTierCache(str(tier), trust=TrustPolicy()).get_or_compile("8b" * 16, compile_fn("8b" * 16))
    plant(tier, THIRD, tmp_path, compile_fn, "compiled_on")  # in neither tier trusted
    process_trust(VLLM_NEURON_CACHE_TRUSTED_KEYS=keys["builder"][1])
    manifest = Manifest(graphs=[GraphEntry(graph_hash=k) for k in (KEY, OTHER, THIRD, "8b" * 16)])
    found = check_startup(manifest, open_store(str(tier)), open_store(remote))
    assert found.sources == {KEY: "remote", "8b" * 16: "local"}, found
    assert set(found.missing) == {OTHER, THIRD}
    assert all(why.startswith("untrusted: ") for why in found.missing.values()), found.missing


# -- the local tier: this user's own by ownership and mode, whatever names it -----------------


def _settings_env(root: Path) -> dict[str, str]:
    return {"VLLM_CACHE_ROOT": str(root), "HOME": str(root.parent)}


@pytest.mark.parametrize("how", ["another-users", "group-writable", "parent-world-writable"])
def test_an_explicit_cache_root_others_can_change_is_bypassed_with_the_reason(
    how: str, tmp_path: Path
) -> None:
    parent = tmp_path / "parent"
    parent.mkdir()
    root = parent / "cache"
    root.mkdir(mode=0o700)
    if how == "another-users":
        os.chown(root, STRANGER_UID, STRANGER_UID)
        said = f"belongs to uid {STRANGER_UID}"
    elif how == "group-writable":
        root.chmod(0o775)
        said = "writable by group or others (mode 0775"
    else:
        parent.chmod(0o777)
        said = "above the tier, is writable by group or others (mode 0777, not sticky)"
    local_dir, bypassed = resolve_local_tier(environ=_settings_env(root))
    assert local_dir == "" and bypassed is not None
    assert f"VLLM_CACHE_ROOT={root}" in bypassed and said in bypassed, bypassed


def test_a_private_cache_root_is_used_and_made_private_whatever_the_umask(tmp_path: Path) -> None:
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # as /tmp: others cannot move what this user made there
    root = sticky / "cache"
    old = os.umask(0o002)
    try:
        local_dir, bypassed = resolve_local_tier(environ=_settings_env(root))
    finally:
        os.umask(old)
    assert bypassed is None and local_dir == str(root / "neuron" / "compile_cache")
    for made in (root, root / "neuron", root / "neuron" / "compile_cache"):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made
    assert resolve_local_tier(environ=_settings_env(root)) == (local_dir, None)  # next start


# -- the node key: refused when others could read it; deleting it costs re-verification -----


@pytest.mark.parametrize("how", ["readable-by-others", "another-users", "deleted"])
def test_a_node_key_others_could_read_is_refused_and_costs_only_a_compile(
    how: str, tmp_path: Path, compile_fn: Any, keys: dict[str, Any], cache_warnings: Any
) -> None:
    tier = tmp_path / "node"
    TwoTierCache(str(tier), trust=serving_policy(keys)).get_or_compile(KEY, compile_fn(KEY))
    key_file = Path(str(tier) + NODE_KEY_SUFFIX)
    if how == "readable-by-others":
        key_file.chmod(0o644)
    elif how == "another-users":
        os.chown(key_file, STRANGER_UID, STRANGER_UID)
    else:
        key_file.unlink()
    forget_node_keys()
    node = TwoTierCache(str(tier), trust=serving_policy(keys))
    assert node.get_or_compile(KEY, compile_fn(KEY)).source == "compiled"  # re-verified
    if how == "deleted":  # a new key made at once: the next start hits again
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        forget_node_keys()
        again = TwoTierCache(str(tier), trust=serving_policy(keys))
        assert again.get_or_compile(KEY, compile_fn(KEY)).source == "local"
    else:
        said = [w for w in cache_warnings() if "node key" in w and "refused" in w]
        assert len(said) == 1, cache_warnings()


def test_a_node_key_that_is_a_fifo_is_refused_without_blocking(
    tmp_path: Path, compile_fn: Any, keys: dict[str, Any], cache_warnings: Any
) -> None:
    """Another user (or a planted file) puts a FIFO where the node key is: reading it must
    not wait for a writer (the node would hang holding the key's lock); it is refused with
    one warning and the entry is re-verified."""
    tier = tmp_path / "node"
    TwoTierCache(str(tier), trust=serving_policy(keys)).get_or_compile(KEY, compile_fn(KEY))
    key_file = Path(str(tier) + NODE_KEY_SUFFIX)
    key_file.unlink()
    os.mkfifo(key_file)
    forget_node_keys()
    out: dict[str, Any] = {}

    def run() -> None:
        node = TwoTierCache(str(tier), trust=serving_policy(keys))
        out["source"] = node.get_or_compile(KEY, compile_fn(KEY)).source

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():  # release the blocked reader, then fail
        os.close(os.open(key_file, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(60)
        raise AssertionError("reading the node key blocked on a FIFO")
    assert out["source"] == "compiled"  # re-verified, not trusted as this node's
    said = [w for w in cache_warnings() if "node key" in w and "refused" in w]
    assert len(said) == 1 and "FIFO" in said[0], cache_warnings()


# -- a node that cannot sign never holds a remote lease, on every kind of remote -------------


@pytest.mark.parametrize("kind", ["folder-kernel-locks", "folder-leases", "s3"])
def test_a_node_that_cannot_sign_never_holds_the_remote_lease(
    kind: str, tmp_path: Path, compile_fn: Any, keys: dict[str, Any],
    request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    """Seen from outside while the node compiles: another holder asks whether the key's
    remote lease is held (a kernel lock tried through its own file, a lease record read).
    A builder holds it then - which shows the probe sees leasing on this remote - and a
    node without a signing key never does."""
    if kind == "s3":
        request.getfixturevalue("s3_env")
        url: str = request.getfixturevalue("s3_store_url")
        options: dict[str, Any] = {}
    else:
        url = str(tmp_path / "remote")
        options = {"lock": "lease"} if kind == "folder-leases" else {}
    observer = open_store(url, **options)
    held: dict[str, bool] = {}
    guard = threading.Lock()

    def watching(node: str, key: str) -> Any:
        def compile_into(out_dir: str) -> Any:
            busy = observer.lock(key, lease_duration=30.0).busy()
            with guard:
                held[node] = busy
            return compile_fn(key)(out_dir)

        return compile_into

    builder = TwoTierCache(str(tmp_path / "builder"), remote=url, remote_options=options,
                           trust=builder_policy(keys))  # fmt: skip
    assert builder.get_or_compile(OTHER, watching("builder", OTHER)).source == "compiled"
    serving = TwoTierCache(str(tmp_path / "serving"), remote=url, remote_options=options,
                           trust=serving_policy(keys))  # fmt: skip
    assert serving.get_or_compile(KEY, watching("serving", KEY)).source == "compiled"
    assert held == {"builder": True, "serving": False}, held
    assert observer.published(KEY) is None  # nothing shared
    with pytest.raises(CannotSign, match="VLLM_NEURON_CACHE_SIGNING_KEY"):
        promote_entry(serving.local, observer, KEY, policy=serving.trust)


def test_a_sealed_record_reads_back_unchanged(tmp_path: Path, compile_fn: Any) -> None:
    """The seal is a field the record codec keeps; an old record without it reads as one of
    unknown origin (the field is optional)."""
    tier = tmp_path / "node"
    TwoTierCache(str(tier), trust=TrustPolicy()).get_or_compile(KEY, compile_fn(KEY))
    record = decode_record((tier / KEY / ENTRY_RECORD).read_bytes())
    assert isinstance(record.sealed, str) and len(record.sealed) == 64
    raw = json.loads((tier / KEY / ENTRY_RECORD).read_bytes())
    raw.pop("sealed")
    assert not isinstance(decode_record(json.dumps(raw).encode()).sealed, str)


def test_owed_promotions_are_settled_under_the_caches_own_policy(
    tmp_path, keys, compile_fn, process_trust
):
    """A cache given its own trust (the builder's key) in a process whose settings name
    another key: what it owed is promoted under the cache's policy (its signature, the
    builder's, goes along), never re-signed with the process's key."""
    remote, tier = tmp_path / "remote", tmp_path / "builder"
    stranger = generate_key_pair(str(tmp_path / "stranger-keys"), "stranger")
    process_trust(VLLM_NEURON_CACHE_SIGNING_KEY=stranger[0],
                  VLLM_NEURON_CACHE_TRUSTED_KEYS=stranger[1])  # fmt: skip
    TwoTierCache(str(tier), trust=builder_policy(keys)).get_or_compile(KEY, compile_fn(KEY))
    owe_promotion(open_store(str(tier)), KEY, str(remote))
    restarted = TwoTierCache(str(tier), remote=str(remote), trust=builder_policy(keys))
    assert restarted.wait_for_upkeep(timeout=120)
    signer = json.loads((remote / KEY / SIGNATURE_FILE).read_bytes())["key_id"]
    assert signer == load_signer(keys["builder"][0]).key_id, "settled under another policy"


def test_cache_sign_on_a_shared_folder_never_believes_the_node_key_beside_it(
    tmp_path, keys, compile_fn, process_trust
):
    """A shared folder (group- and other-writable, as a fleet's NFS folder is) whose entry
    carries a seal made with ``<folder>.node-key`` - which whoever writes beside the folder
    can write too: `cache sign` on it judges by signature only (the seal is not this
    node's word), so the unsigned entry stays unsigned."""
    process_trust()
    shared = tmp_path / "shared"
    TwoTierCache(str(shared)).get_or_compile(KEY, compile_fn(KEY))  # sealed, node key beside
    assert (tmp_path / f"shared{NODE_KEY_SUFFIX}").is_file()
    shared.chmod(0o777)
    signed = cli("cache", "sign", str(shared), "--key", keys["builder"][0], "--entry", KEY)
    assert signed.returncode == 1 and "origin is unknown" in signed.stdout, signed.stdout
    assert not (shared / KEY / SIGNATURE_FILE).exists()
