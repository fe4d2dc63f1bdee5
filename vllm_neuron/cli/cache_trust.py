"""`vllm-neuron cache keygen|sign`, and the trust check of `cache verify` (docs/trust.md).

A builder's key pair comes from `keygen`; `sign` signs the entries of a tier that verify (a
builder that pre-compiled, or the migration of an unsigned remote); `cache verify
--trusted-keys` says which entries a serving node with those keys would refuse.

Registered by `cli/cache.py` (`register`); exit status as every command: 0 done, 1 a problem
found, 2 bad usage or a tier or key that cannot be used.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from vllm_neuron.compile.commands.load_check import is_own_tier
from vllm_neuron.compile.trust.policy import TrustPolicy, judge_tier, sign_tier, trust_policy
from vllm_neuron.compile.trust.signing import (
    KeyProblem,
    TrustedKeys,
    Verdict,
    generate_key_pair,
    load_public_keys,
    load_signer,
)
from vllm_neuron.envs import ConfigError
from vllm_neuron.envs.trust import split_key_paths

from .format import print_json
from .options import JSON_HELP, quiet_option
from .tiers import tier

__all__ = ["load_policy", "register", "trust_check", "trusted_keys_option"]


def register(cmds: Any) -> None:
    keygen = cmds.add_parser("keygen", help="a new Ed25519 key pair for signing entries")
    keygen.add_argument("directory", help="where to write NAME.key (0600) and NAME.pub")
    keygen.add_argument("--name", default="cache-signing", help="file name stem")
    keygen.add_argument("--json", action="store_true", help=JSON_HELP)
    keygen.set_defaults(handler=cmd_keygen)

    sign = cmds.add_parser("sign", help="sign the entries of a tier that verify")
    sign.add_argument("url", nargs="?", help="the tier to sign (default: the local cache)")
    sign.add_argument("--key", required=True, metavar="FILE", help="the private key file")
    sign.add_argument("--entry", action="append", metavar="KEY", help="only this entry "
                      "(repeatable)")  # fmt: skip
    sign.add_argument("--json", action="store_true", help=JSON_HELP)
    quiet_option(sign)
    sign.set_defaults(handler=cmd_sign)


def trusted_keys_option(parser: Any) -> None:
    """``--trusted-keys`` for a command that judges entries (`cache verify`)."""
    parser.add_argument(
        "--trusted-keys", metavar="KEYS", default=None,
        help="public key files or directories (':' or ','): check every entry's signature "
             "(default: VLLM_NEURON_CACHE_TRUSTED_KEYS when the trust policy is on)")  # fmt: skip


def cmd_keygen(args: argparse.Namespace) -> int:
    try:
        private, public, key_id = generate_key_pair(args.directory, args.name)
    except FileExistsError as exc:
        print(f"vllm-neuron: {exc.filename} exists; keys are never overwritten (use --name)",
              file=sys.stderr)  # fmt: skip
        return 2
    except OSError as exc:
        print(f"vllm-neuron: cannot write keys in {args.directory}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print_json({"private_key": private, "public_key": public, "key_id": key_id})
    else:
        print(f"private key {private} (0600: give it to builders only, as "
              f"VLLM_NEURON_CACHE_SIGNING_KEY)\npublic key  {public} (for serving nodes: "
              f"VLLM_NEURON_CACHE_TRUSTED_KEYS)\nkey id      {key_id}")  # fmt: skip
    return 0


def cmd_sign(args: argparse.Namespace) -> int:
    try:
        signer = load_signer(args.key)
    except KeyProblem as exc:
        print(f"vllm-neuron: --key: {exc}", file=sys.stderr)
        return 2
    store = tier(args)
    results = sign_tier(store, signer, args.entry, trusted=trust_policy().keys,
                        own_tier=is_own_tier(store))  # fmt: skip
    failed = [(k, o) for k, o in results if o.startswith("not signed")]
    if args.json:
        print_json({"key_id": signer.key_id,
                    "entries": [{"key": k, "outcome": o} for k, o in results]})  # fmt: skip
    else:
        for key, outcome in results:
            print(f"{key} {outcome}")
        signed = sum(1 for _, o in results if o == "signed")
        print(f"{signed} signed by {signer.key_id}, {len(results) - signed - len(failed)} "
              f"already signed, {len(failed)} not signed (fix or prune them first)")
    return 1 if failed else 0


def _given_keys(args: argparse.Namespace) -> TrustedKeys | None:
    if not args.trusted_keys:
        return None
    try:
        return load_public_keys(split_key_paths(args.trusted_keys, {}))
    except KeyProblem as exc:
        raise ConfigError(f"--trusted-keys: {exc}") from None


def load_policy(args: argparse.Namespace) -> TrustPolicy:
    """The policy `cache verify --load` loads under: ``require`` with ``--trusted-keys``
    when given (nothing they do not trust is ever loaded), else the process's."""
    keys = _given_keys(args)
    return trust_policy() if keys is None else TrustPolicy(mode="require", keys=keys)


def trust_check(args: argparse.Namespace, store: Any) -> dict[str, Verdict] | None:
    """The verdict on each entry of ``store`` for `cache verify`: by ``--trusted-keys``, or
    the process's trusted keys when its policy is on; None when neither asks for it."""
    keys = _given_keys(args)
    if keys is None:
        policy = trust_policy()
        if not policy.checking:
            return None
        keys = policy.keys
    # This node's own tier (by the filesystem, not by which option named it): its entries
    # are judged as a hit judges them (this node's seal, else the signature).
    return dict(judge_tier(store, keys, own_tier=is_own_tier(store)))
