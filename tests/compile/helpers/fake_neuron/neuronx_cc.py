"""Fake neuronx-cc (tests/compile/helpers/fake_neuron; `compiler_on_path` puts it on PATH):
``compile --framework XLA <model dir> --target T --output NEFF [flags]`` writes
NEFF = "NEFF " + sha256 of the model's HLO.

FAKE_NEURONX_CC_TOGETHER=<dir>:<n>: each compile takes a ticket in <dir> (``ticket-<i>``,
holding its pid), and the first <n> - 1 do not finish until the <n>th has started: it
writes to a FIFO they wait on (a handshake: compiles that run one at a time never meet, and
exit 2 after FAKE_NEURONX_CC_PATIENCE seconds, default 120).
FAKE_NEURONX_CC_STARTED=<fifo>: each compile writes a byte to it once it has its ticket.
FAKE_NEURONX_CC_REJECT=<text>: a graph whose HLO contains <text> fails (exit 1).
FAKE_NEURONX_CC_KILLED_ONCE=<dir>: the first compile (one per <dir>) is killed by SIGKILL,
as the out-of-memory killer ends a compiler."""

import contextlib
import hashlib
import os
import select
import signal
import sys

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
    fifo = os.path.join(meet_dir, "fifo")
    with contextlib.suppress(FileExistsError):
        os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # before the ticket: see below
    ordinal = 1
    while True:  # this compile's place in line: the first free ticket
        try:
            ticket = os.open(os.path.join(meet_dir, f"ticket-{ordinal}"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            ordinal += 1
            continue
        os.write(ticket, str(os.getpid()).encode())
        os.close(ticket)
        break
    started = os.environ.get("FAKE_NEURONX_CC_STARTED")
    if started:  # a FIFO the test's process reads: it knows a compile is under way
        with open(started, "wb") as f:
            f.write(b"!")
    if ordinal == int(count):  # the last awaited: one byte for each earlier compile, all
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # of whom hold a read end
        os.write(writer, b"!" * (ordinal - 1))
        os.close(writer)
    elif ordinal < int(count):
        poller = select.poll()
        poller.register(reader, select.POLLIN)
        patience = float(os.environ.get("FAKE_NEURONX_CC_PATIENCE", "120"))
        if not poller.poll(patience * 1000) or not os.read(reader, 1):
            print("fake neuronx-cc: no other compile ran beside this one", file=sys.stderr)
            sys.exit(2)
    os.close(reader)
with open(out, "wb") as f:
    f.write(b"NEFF " + hashlib.sha256(hlo).hexdigest().encode())
