"""Signed entries and the trust policy (vllm_neuron/compile/trust/signing.py, policy.py;
docs/trust.md).

Builders sign, serving nodes verify: two caches on local folders share a folder remote, each
with the policy its role would have. The code-running canary and the fleet of real processes
are in test_trust_fleet.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from vllm_neuron.backends import open_store
from vllm_neuron.backends.digests import digest_bytes
from vllm_neuron.compile.entry.events import read_stats
from vllm_neuron.compile.entry.record import ENTRY_RECORD, decode_record, encode_record
from vllm_neuron.compile.flow.cache import PrecompiledOnlyMiss, TwoTierCache
from vllm_neuron.compile.tiers.promote import CannotSign, promote_entry
from vllm_neuron.compile.trust.policy import TrustPolicy, load_trust_policy
from vllm_neuron.compile.trust.signing import (
    SIGNATURE_FILE,
    decode_signature,
    generate_key_pair,
    load_public_keys,
    load_signer,
)
from vllm_neuron.envs import ConfigError, load_trust_settings

KEY = "5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e"


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Any]:
    """Two key pairs: the builder's, and a stranger's."""
    builder = generate_key_pair(str(tmp_path / "keys"), "builder")
    stranger = generate_key_pair(str(tmp_path / "keys"), "stranger")
    return {"builder": builder, "stranger": stranger, "dir": tmp_path / "keys"}


def builder_policy(keys: dict[str, Any]) -> TrustPolicy:
    return load_trust_policy(load_trust_settings({
        "VLLM_NEURON_CACHE_SIGNING_KEY": keys["builder"][0],
        "VLLM_NEURON_CACHE_TRUSTED_KEYS": keys["builder"][1]}))  # fmt: skip


def serving_policy(keys: dict[str, Any], *trusted: str, mode: str = "") -> TrustPolicy:
    env = {"VLLM_NEURON_CACHE_TRUSTED_KEYS": ",".join(trusted or (keys["builder"][1],))}
    if mode:
        env["VLLM_NEURON_CACHE_TRUST"] = mode
    return load_trust_policy(load_trust_settings(env))


def build_and_promote(tmp_path: Path, compile_fn: Any, keys: dict[str, Any]) -> str:
    """A builder compiles KEY and promotes it, signed, to a folder remote; the remote."""
    remote = str(tmp_path / "remote")
    builder = TwoTierCache(str(tmp_path / "builder"), remote=remote, trust=builder_policy(keys))
    builder.get_or_compile(KEY, compile_fn(KEY))
    assert (Path(remote) / KEY / SIGNATURE_FILE).is_file()
    return remote


def tamper(remote: str, *, resign_with: str | None = None) -> None:
    """Replace the remote entry's artifact and recompute every digest its record lists, as a
    writer without the builder's key would (optionally signing with its own key)."""
    entry = Path(remote) / KEY
    record = decode_record((entry / ENTRY_RECORD).read_bytes())
    name = sorted(record.files)[0]
    evil = b"#!/bin/sh\necho owned\n"
    (entry / name).write_bytes(evil)
    files = dict(record.files)
    files[name] = digest_bytes(evil)
    forged = msgspec.structs.replace(record, files=files)
    (entry / ENTRY_RECORD).write_bytes(encode_record(forged))
    if resign_with is not None:
        (entry / SIGNATURE_FILE).write_bytes(load_signer(resign_with).sign_bytes(forged))


def test_a_signature_covers_every_file_and_the_signer(tmp_path: Path, compile_fn: Any,
                                                      keys: dict[str, Any]) -> None:  # fmt: skip
    remote = build_and_promote(tmp_path, compile_fn, keys)
    entry = Path(remote) / KEY
    record_bytes = (entry / ENTRY_RECORD).read_bytes()
    record = decode_record(record_bytes)
    signature = (entry / SIGNATURE_FILE).read_bytes()
    trusted = load_public_keys([keys["builder"][1]])
    assert trusted.judge(record, signature).status == "trusted"
    assert decode_signature(signature).key_id == keys["builder"][2]
    # Nobody trusts the stranger; the builder's key is found in a directory of keys.
    assert load_public_keys([keys["stranger"][1]]).judge(record, signature).status == "untrusted"
    assert load_public_keys([str(keys["dir"])]).judge(record, signature).trusted
    assert trusted.judge(record, None).status == "unsigned"
    # A changed file size, digest, key or toolchain: the signature no longer verifies.
    name = sorted(record.files)[0]
    for changed in (
        msgspec.structs.replace(record, files={**record.files, name: digest_bytes(b"x")}),
        msgspec.structs.replace(record, key="0" * 32),
        msgspec.structs.replace(record, toolchain="neuron"),
    ):
        assert trusted.judge(changed, signature).status == "bad-signature"
    # The signer's key id is signed too: relabelling a signature with another id fails.
    other = decode_signature(signature)
    relabelled = msgspec.json.encode(msgspec.structs.replace(other, key_id=keys["stranger"][2]))
    both = load_public_keys([keys["builder"][1], keys["stranger"][1]])
    assert both.judge(record, relabelled).status == "bad-signature"


@pytest.mark.parametrize("forgery", ["tampered", "unsigned", "stranger-signed", "moved"])
def test_under_require_an_untrusted_remote_entry_is_never_copied_and_the_graph_is_compiled(
    forgery: str, tmp_path: Path, compile_fn: Any, keys: dict[str, Any],
    cache_warnings: Any,
) -> None:  # fmt: skip
    remote = build_and_promote(tmp_path, compile_fn, keys)
    entry = Path(remote) / KEY
    if forgery == "tampered":
        tamper(remote)
    elif forgery == "unsigned":
        (entry / SIGNATURE_FILE).unlink()
    elif forgery == "stranger-signed":
        tamper(remote, resign_with=keys["stranger"][0])
    else:  # a valid signature of another entry, copied onto this one
        other_key = "6f" * 16
        other = TwoTierCache(str(tmp_path / "other"), remote=remote, trust=builder_policy(keys))
        other.get_or_compile(other_key, compile_fn(other_key))
        tamper(remote)
        (entry / SIGNATURE_FILE).write_bytes((Path(remote) / other_key / SIGNATURE_FILE)
                                             .read_bytes())  # fmt: skip
    node_dir = tmp_path / "serving"
    node = TwoTierCache(str(node_dir), remote=remote, trust=serving_policy(keys))
    result = node.get_or_compile(KEY, compile_fn(KEY))
    assert result.source == "compiled"  # compiled for itself, never the remote's bytes
    record = decode_record((node_dir / KEY / ENTRY_RECORD).read_bytes())
    assert all(b"owned" not in (node_dir / KEY / n).read_bytes() for n in record.files)
    stats = read_stats(str(node_dir))
    assert stats.untrusted == 1 and stats.fetches == 0 and stats.promotions == 0
    said = [w for w in cache_warnings() if "untrusted" in w]
    assert len(said) == 1, cache_warnings()
    # It promoted nothing (the stats above). That it never leases is seen while it compiles,
    # on every kind of remote: test_trust_origin.py.


def test_a_trusted_entry_is_fetched_and_its_signer_recorded_and_a_revoked_one_is_refused(
    tmp_path: Path, compile_fn: Any, keys: dict[str, Any], cache_warnings: Any
) -> None:
    remote = build_and_promote(tmp_path, compile_fn, keys)
    node_dir = tmp_path / "serving"
    node = TwoTierCache(str(node_dir), remote=remote, trust=serving_policy(keys))
    assert node.get_or_compile(KEY, compile_fn(KEY)).source == "remote"
    local_record = json.loads((node_dir / KEY / ENTRY_RECORD).read_bytes())
    assert local_record["fetched"]["verified_by"] == keys["builder"][2]
    assert local_record["fetched"]["remote"]
    assert "fetched" not in json.loads((Path(remote) / KEY / ENTRY_RECORD).read_bytes())
    # A later process that still trusts the builder: a local hit.
    again = TwoTierCache(str(node_dir), remote=remote, trust=serving_policy(keys))
    assert again.get_or_compile(KEY, compile_fn(KEY)).source == "local"
    # The builder's key removed from the trusted set (only the stranger's now): revoked.
    revoked = TwoTierCache(str(node_dir), remote=remote,
                           trust=serving_policy(keys, keys["stranger"][1]))  # fmt: skip
    assert revoked.get_or_compile(KEY, compile_fn(KEY)).source == "compiled"
    assert any("untrusted" in w for w in cache_warnings())


def test_pre_compiled_only_names_why_the_entry_was_refused(
    tmp_path: Path, compile_fn: Any, keys: dict[str, Any]
) -> None:
    remote = build_and_promote(tmp_path, compile_fn, keys)
    tamper(remote)
    node = TwoTierCache(str(tmp_path / "serving"), remote=remote, precompiled_only=True,
                        trust=serving_policy(keys))  # fmt: skip
    with pytest.raises(PrecompiledOnlyMiss, match="untrusted: the signature by key"):
        node.get_or_compile(KEY, compile_fn(KEY))


def test_warn_uses_an_untrusted_entry_with_one_warning(
    tmp_path: Path, compile_fn: Any, keys: dict[str, Any], cache_warnings: Any
) -> None:
    remote = build_and_promote(tmp_path, compile_fn, keys)
    (Path(remote) / KEY / SIGNATURE_FILE).unlink()
    node_dir = tmp_path / "serving"
    node = TwoTierCache(str(node_dir), remote=remote, trust=serving_policy(keys, mode="warn"))
    assert node.get_or_compile(KEY, compile_fn(KEY)).source == "remote"
    assert [w for w in cache_warnings() if "untrusted" in w and "warn" in w]
    assert read_stats(str(node_dir)).untrusted == 1


def test_a_node_that_cannot_sign_never_promotes(
    tmp_path: Path, compile_fn: Any, keys: dict[str, Any]
) -> None:
    """(That it never takes the remote lease either is seen while it compiles, on a folder
    with kernel locks, one with leases, and S3: test_trust_origin.py.)"""
    remote = tmp_path / "remote"
    node = TwoTierCache(str(tmp_path / "serving"), remote=str(remote), trust=serving_policy(keys))
    assert node.get_or_compile(KEY, compile_fn(KEY)).source == "compiled"
    assert not (remote / KEY).exists()  # nothing shared
    with pytest.raises(CannotSign, match="VLLM_NEURON_CACHE_SIGNING_KEY"):
        promote_entry(node.local, open_store(str(remote)), KEY, policy=node.trust)


def test_a_builder_trusts_its_own_key_and_off_still_signs(
    tmp_path: Path, compile_fn: Any, keys: dict[str, Any]
) -> None:
    alone = load_trust_policy(load_trust_settings(
        {"VLLM_NEURON_CACHE_SIGNING_KEY": keys["builder"][0]}))  # fmt: skip
    assert alone.mode == "require" and list(alone.keys.keys) == [keys["builder"][2]]
    policy = load_trust_policy(load_trust_settings(
        {"VLLM_NEURON_CACHE_SIGNING_KEY": keys["builder"][0],
         "VLLM_NEURON_CACHE_TRUST": "off"}))  # fmt: skip
    assert policy.mode == "off" and policy.may_publish_remote
    cache = TwoTierCache(str(tmp_path / "c"), trust=policy)
    cache.get_or_compile(KEY, compile_fn(KEY))
    assert (tmp_path / "c" / KEY / SIGNATURE_FILE).is_file()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"VLLM_NEURON_CACHE_TRUST": "strict"}, "VLLM_NEURON_CACHE_TRUST='strict' is not one of"),
        ({"VLLM_NEURON_CACHE_TRUST": "require"}, "needs VLLM_NEURON_CACHE_TRUSTED_KEYS"),
        ({"VLLM_NEURON_CACHE_TRUSTED_KEYS": "/nonexistent/k.pub"},
         "VLLM_NEURON_CACHE_TRUSTED_KEYS: /nonexistent/k.pub: cannot read it"),
        ({"VLLM_NEURON_CACHE_SIGNING_KEY": "/nonexistent/k.key"},
         "VLLM_NEURON_CACHE_SIGNING_KEY: /nonexistent/k.key: cannot read it"),
        ({"VLLM_NEURON_CACHE_TRUSTED_KEYS": " , "}, "names no key file"),
    ],
)
def test_a_bad_trust_setting_names_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_trust_policy(load_trust_settings(env))


def test_a_key_file_of_the_wrong_kind_is_refused(tmp_path: Path, keys: dict[str, Any]) -> None:
    env = {"VLLM_NEURON_CACHE_SIGNING_KEY": keys["builder"][1]}  # a public key as private
    with pytest.raises(ConfigError, match="not an unencrypted PEM private key"):
        load_trust_policy(load_trust_settings(env))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="a directory with no public key file"):
        load_trust_policy(load_trust_settings({"VLLM_NEURON_CACHE_TRUSTED_KEYS": str(empty)}))
    private = Path(keys["builder"][0])
    assert (private.stat().st_mode & 0o777) == 0o600


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_NEURON_CACHE_TRUST")}
    return subprocess.run([sys.executable, "-m", "vllm_neuron.cli", *args], capture_output=True,
                          text=True, timeout=300, env={**base, **(env or {})})  # fmt: skip


def test_keygen_sign_and_verify_migrate_an_unsigned_tier(tmp_path: Path, compile_fn: Any) -> None:
    tier = tmp_path / "tier"
    for key in (KEY, "6f" * 16):
        TwoTierCache(str(tier), trust=TrustPolicy()).get_or_compile(key, compile_fn(key))
    made = cli("cache", "keygen", str(tmp_path / "k"), "--json")
    assert made.returncode == 0, made.stderr
    pair = json.loads(made.stdout)
    assert (Path(pair["private_key"]).stat().st_mode & 0o777) == 0o600
    assert cli("cache", "keygen", str(tmp_path / "k")).returncode == 2  # never overwritten
    # This node's own tier (private to this user): its own compiles are trusted unsigned.
    own = cli("cache", "verify", str(tier), "--keep", "--trusted-keys", pair["public_key"],
              "--json")  # fmt: skip
    assert own.returncode == 0, own.stdout + own.stderr
    assert {(e["trust"], e["signer"]) for e in json.loads(own.stdout)} == {("trusted", None)}
    # The same entries in a folder others may write (a shared tier, however it is named):
    # judged by signature - unsigned, exit 1 - and never signed (their origin is unknown).
    shared = tmp_path / "shared"
    shutil.copytree(tier, shared)
    shared.chmod(0o775)
    before = cli("cache", "--cache-dir", str(shared), "verify", "--keep", "--trusted-keys",
                 pair["public_key"], "--json")  # fmt: skip
    assert before.returncode == 1
    assert {e["trust"] for e in json.loads(before.stdout)} == {"unsigned"}
    refused = cli("cache", "sign", str(shared), "--key", pair["private_key"], "--entry", KEY)
    assert refused.returncode == 1 and "origin is unknown" in refused.stdout, refused.stdout
    assert not (shared / KEY / SIGNATURE_FILE).exists()
    # A corrupted entry is never signed.
    record = decode_record((tier / KEY / ENTRY_RECORD).read_bytes())
    victim = tier / "6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f" / sorted(record.files)[0]
    victim.write_bytes(b"corrupt" + victim.read_bytes()[7:])
    signed = cli("cache", "sign", str(tier), "--key", pair["private_key"], "--json")
    assert signed.returncode == 1, signed.stderr
    outcomes = {e["key"]: e["outcome"] for e in json.loads(signed.stdout)["entries"]}
    assert outcomes[KEY] == "signed" and outcomes["6f" * 16].startswith("not signed")
    again = cli("cache", "sign", str(tier), "--key", pair["private_key"], "--entry", KEY)
    assert again.returncode == 0 and "already signed" in again.stdout
    after = cli("cache", "verify", str(tier), "--keep", "--trusted-keys", pair["public_key"],
                "--json")  # fmt: skip
    rows = {e["key"]: e for e in json.loads(after.stdout)}
    assert rows[KEY]["trust"] == "trusted" and rows[KEY]["signer"] == pair["key_id"]
    listed = cli("cache", "ls", str(tier), "--json")
    assert {e["key"]: e["signer"] for e in json.loads(listed.stdout)}[KEY] == pair["key_id"]
    table = cli("cache", "ls", str(tier)).stdout
    assert "SIGNER" in table and pair["key_id"] in table


def test_a_builder_replaces_an_untrusted_remote_entry_with_its_own_signed_one(
    tmp_path: Path, compile_fn: Any, keys: dict[str, Any]
) -> None:
    remote = build_and_promote(tmp_path, compile_fn, keys)
    tamper(remote)
    builder = TwoTierCache(str(tmp_path / "builder-2"), remote=remote, trust=builder_policy(keys))
    assert builder.get_or_compile(KEY, compile_fn(KEY)).source == "compiled"
    # The forged entry is withdrawn (noted) and the builder's signed one published instead.
    entry = Path(remote) / KEY
    record = decode_record((entry / ENTRY_RECORD).read_bytes())
    assert load_public_keys([keys["builder"][1]]).judge(
        record, (entry / SIGNATURE_FILE).read_bytes()).trusted
    assert (Path(remote) / ".quarantine" / f"{KEY}.json").is_file()
    node = TwoTierCache(str(tmp_path / "serving"), remote=remote, trust=serving_policy(keys))
    assert node.get_or_compile(KEY, compile_fn(KEY)).source == "remote"


def test_the_report_shows_how_a_tiers_entries_are_signed(
    tmp_path: Path, compile_fn: Any, keys: dict[str, Any]
) -> None:
    tier = tmp_path / "tier"
    TwoTierCache(str(tier), trust=builder_policy(keys)).get_or_compile(KEY, compile_fn(KEY))
    TwoTierCache(str(tier), trust=TrustPolicy()).get_or_compile("6f" * 16, compile_fn("6f" * 16))
    page = tmp_path / "report.html"
    plain = cli("report", "--cache-dir", str(tier), "-o", str(page))
    assert plain.returncode == 0, plain.stderr
    html = page.read_text()
    assert f'data-trust="signed by {keys["builder"][2]}"' in html
    assert 'data-trust="unsigned"' in html
    judged = cli("report", "--cache-dir", str(tier), "-o", str(page),
                 env={"VLLM_NEURON_CACHE_TRUSTED_KEYS": keys["builder"][1]})
    assert judged.returncode == 0, judged.stderr
    html = page.read_text()
    assert 'data-trust="trusted"' in html and 'data-trust="unsigned"' in html


def test_a_local_entry_of_unknown_origin_is_judged_by_its_signature(
    tmp_path: Path, compile_fn: Any, keys: dict[str, Any]
) -> None:
    """A record with neither ``compiled_on`` nor ``fetched`` (written by an older version or
    another tool: perhaps fetched from a tampered remote) is trusted only if a trusted key
    signed it, and is never re-signed by a promotion."""
    tier = tmp_path / "node"
    TwoTierCache(str(tier), trust=builder_policy(keys)).get_or_compile(KEY, compile_fn(KEY))
    other = "6f" * 16
    TwoTierCache(str(tier), trust=TrustPolicy()).get_or_compile(other, compile_fn(other))
    for key in (KEY, other):  # as an older version wrote them
        path = tier / key / ENTRY_RECORD
        raw = json.loads(path.read_bytes())
        raw.pop("compiled_on")
        path.write_text(json.dumps(raw))
    node = TwoTierCache(str(tier), trust=serving_policy(keys))
    assert node.get_or_compile(KEY, compile_fn(KEY)).source == "local"  # signed: trusted
    assert node.get_or_compile(other, compile_fn(other)).source == "compiled"  # refused
    assert "compiled_on" in json.loads((tier / other / ENTRY_RECORD).read_bytes())
    # A builder never signs such an entry for the fleet.
    (tier / other / ENTRY_RECORD).write_text(json.dumps(
        {k: v for k, v in json.loads((tier / other / ENTRY_RECORD).read_bytes()).items()
         if k != "compiled_on"}))
    with pytest.raises(CannotSign, match="origin is unknown"):
        promote_entry(open_store(str(tier)), open_store(str(tmp_path / "remote")), other,
                      policy=builder_policy(keys))
