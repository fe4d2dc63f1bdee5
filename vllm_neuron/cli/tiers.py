"""Which tier a `vllm-neuron cache` command works on, shared by its subcommand modules.

Every command that reads a tier takes it the same way: the URL given, else
``--cache-dir``, else the local tier; checked, opened without creating anything, and
probed, so a bad or unreachable tier is exit 2 with the reason, never an empty listing.
"""

from __future__ import annotations

import argparse

from vllm_neuron.backends import (
    Store,
    check_location,
    local_root_missing,
    open_store,
    probe_store,
)
from vllm_neuron.compile.tiers.location import get_neuron_compile_cache_dir


def cache_dir(args: argparse.Namespace) -> str:
    """``--cache-dir``, else the local tier of this environment."""
    return args.cache_dir or get_neuron_compile_cache_dir()


def tier(args: argparse.Namespace) -> Store:
    """The tier a command reads: checked (a malformed URL is a ValueError), opened without
    creating anything, and probed (a missing bucket, refused access or no answer is a
    `StoreUnavailable`): either way exit 2 with the reason, never an empty listing."""
    url = check_location(getattr(args, "url", None) or cache_dir(args))
    if local_root_missing(url):
        raise ValueError(f"no compile cache at {url}")
    store = open_store(url, create=False)
    probe_store(store)
    return store
