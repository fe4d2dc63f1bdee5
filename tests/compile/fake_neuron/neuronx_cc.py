"""Fake neuronx-cc (tests/compile/fake_neuron; `compiler_on_path` puts it on PATH):
``compile --framework XLA <model dir> --target T --output NEFF [flags]`` writes
NEFF = "NEFF " + sha256 of the model's HLO.

FAKE_NEURONX_CC_TOGETHER=<dir>:<n>: each compile leaves a file in <dir>, then does not
finish until <n> compiles have started (a handshake: compiles that run one at a time never
meet, and exit 2 after FAKE_NEURONX_CC_PATIENCE seconds, default 120).
FAKE_NEURONX_CC_REJECT=<text>: a graph whose HLO contains <text> fails (exit 1).
FAKE_NEURONX_CC_KILLED_ONCE=<dir>: the first compile (one per <dir>) is killed by SIGKILL,
as the out-of-memory killer ends a compiler."""

import hashlib
import os
import signal
import sys
import time

argv = sys.argv[1:]
model_dir, out = argv[3], argv[argv.index("--output") + 1]
with open(os.path.join(model_dir, "graph.hlo"), "rb") as f:
    hlo = f.read()
reject = os.environ.get("FAKE_NEURONX_CC_REJECT")
if reject and reject.encode() in hlo:
    print(f"ERROR: fake neuronx-cc rejects this graph ({reject})", file=sys.stderr)
    sys.exit(1)
killed_once = os.environ.get("FAKE_NEURONX_CC_KILLED_ONCE")
if killed_once:
    try:
        os.close(os.open(os.path.join(killed_once, "killed"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        pass
    else:
        os.kill(os.getpid(), signal.SIGKILL)
together = os.environ.get("FAKE_NEURONX_CC_TOGETHER")
if together:
    meet_dir, count = together.rsplit(":", 1)
    open(os.path.join(meet_dir, str(os.getpid())), "w").close()
    deadline = time.monotonic() + float(os.environ.get("FAKE_NEURONX_CC_PATIENCE", "120"))
    while len(os.listdir(meet_dir)) < int(count):
        if time.monotonic() > deadline:
            print("fake neuronx-cc: no other compile ran beside this one", file=sys.stderr)
            sys.exit(2)
        time.sleep(0.02)
with open(out, "wb") as f:
    f.write(b"NEFF " + hashlib.sha256(hlo).hexdigest().encode())
