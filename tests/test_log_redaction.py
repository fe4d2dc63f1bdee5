"""No secret reaches a log line of this package, however logging was configured
(envs/secrets.py `install_log_redaction`): an application's ``logging.basicConfig`` before
the plugin, a ``dictConfig`` (which replaces the plugin's handler) or a root handler after
it, a handler on one of our child loggers made before the package was imported, the CLI
after ``basicConfig``. Each set-up runs in a fresh process
with a canary credential in its environment and writes its log to a real file, which is
then read; and the documented threshold of what is looked for in free text is the code's.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_neuron.envs.secrets import (
    MIN_SECRET_LENGTH,
    PACKAGE_LOGGERS,
    REDACTED,
    redact_text,
)

ROOT = Path(__file__).resolve().parents[1]
CANARY = "canary-hf-2f9c81d0e7"

# Each set-up configures logging to the file argv[1], in its own order, then logs through
# the package's loggers (`_LINES`) a message with the canary in its arguments, in its text
# and in a traceback.
_SETUPS = {
    "basicConfig before the plugin": """
import logging
logging.basicConfig(filename=LOG, level=logging.DEBUG)
import vllm_neuron.plugin as plugin
plugin._show_logs()
""",
    "dictConfig after the plugin": """
import logging, logging.config
import vllm_neuron.plugin as plugin
plugin._show_logs()
logging.config.dictConfig({
    "version": 1, "disable_existing_loggers": False,
    "handlers": {"file": {"class": "logging.FileHandler", "filename": LOG}},
    "loggers": {"vllm_neuron": {"handlers": ["file"], "level": "DEBUG"}},
    "root": {"handlers": ["file"], "level": "DEBUG"},
})
""",
    "a handler added to the root after the plugin": """
import logging
import vllm_neuron.plugin as plugin
logging.getLogger().addHandler(logging.FileHandler(LOG))
logging.getLogger().setLevel(logging.DEBUG)
""",
    "a child logger's handler made before the import": """
import logging
logging.getLogger("vllm_neuron.compile").addHandler(logging.FileHandler(LOG))
logging.getLogger("vllm_neuron.compile").setLevel(logging.DEBUG)
logging.getLogger("vllm_neuron.manifest").addHandler(logging.FileHandler(LOG))
import vllm_neuron.envs
""",
    "the command line after basicConfig": """
import logging
logging.basicConfig(filename=LOG, level=logging.DEBUG)
from vllm_neuron.cli import main
main(["debug", "env"])
""",
}
_LINES = """
import logging, os
token = os.environ["HF_TOKEN"]
for name in ("vllm_neuron", "vllm_neuron.compile", "vllm_neuron.manifest"):
    log = logging.getLogger(name)
    log.warning("pulling from s3://%s@bucket failed", token)
    log.warning(f"the server was started with --hf-token {token} --port 1")
    try:
        raise RuntimeError(f"refused: {token}")
    except RuntimeError:
        log.exception("upload failed")
"""


@pytest.mark.parametrize("setup", sorted(_SETUPS))
def test_no_log_line_of_ours_holds_a_secret(tmp_path: Path, setup: str) -> None:
    log = tmp_path / "log.txt"
    script = f"LOG = {str(log)!r}\n" + _SETUPS[setup] + _LINES
    env = {**os.environ, "HF_TOKEN": CANARY, "PYTHONPATH": str(ROOT),
           "VLLM_CACHE_ROOT": str(tmp_path / "cache")}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    written = log.read_text()
    assert written.count("upload failed") >= 2, written  # the lines reached the file
    assert REDACTED in written
    assert CANARY not in written, written
    assert CANARY not in done.stdout + done.stderr


def test_every_logger_of_the_package_carries_the_redaction() -> None:
    """A logger's filters see only the records logged through it, not its children's: each
    logger name the package logs through is in `PACKAGE_LOGGERS`."""
    names = set()
    for path in (ROOT / "vllm_neuron").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "getLogger"
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).startswith("vllm_neuron")):
                names.add(node.args[0].value)
    assert names and names <= set(PACKAGE_LOGGERS), names - set(PACKAGE_LOGGERS)


def test_the_documented_threshold_is_the_codes() -> None:
    """docs/trust.md says how long a secret's value must be to be looked for in free text;
    the code looks for exactly those (shorter ones - EMPTY, 1234 - are placeholders and
    ordinary text; they are still redacted after their name)."""
    trust = (ROOT / "docs" / "trust.md").read_text()
    stated = re.findall(r"values of at least (\d+) characters", trust)
    assert stated == [str(MIN_SECRET_LENGTH)], stated
    long_enough = "x" * (MIN_SECRET_LENGTH - 1) + "y"
    too_short = long_enough[1:]
    environ = {"HF_TOKEN": long_enough, "GH_TOKEN": too_short}
    assert redact_text(f"a {long_enough} b", environ) == f"a {REDACTED} b"
    assert redact_text(f"a {too_short} b", environ) == f"a {too_short} b"
    assert redact_text(f"--hf-token {too_short}", environ) == f"--hf-token {REDACTED}"
