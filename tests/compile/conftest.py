"""Fixtures of the compile-cache tests (the S3 server itself is in tests/conftest.py); they
live in helpers/compile_fixtures.py, which tests/cli uses too."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))

from compile_fixtures import cache_warnings, compile_fn, shared_remote  # noqa: E402, F401
