"""The hostile-remote model's machinery (tests/compile/flow/test_hostile_remote_model.py):
the shared objects it loads, the long-lived node processes it drives, and the adversary
that writes into the remote without any trusted key.

Nodes (`NodeProcess`, running helpers/hostile_node.py) answer one request a line; a reply
is awaited with `select` up to a deadline, so a node that hangs fails the model at its time
bound instead of hanging the test, and is then killed (by its own pid) and started again.

The adversary (`Adversary`) writes the remote as any writer with access could: on a folder
with plain file system calls (FIFOs, symbolic links, sparse files), on S3 with plain PUTs
through the storage layer (no special files there). It knows the layout (docs/storage.md):
an entry's files under the location `Store.published` names, failure notes in
``.failures/<key>.json``, lease records in ``.locks/<key>/<generation>``, and on S3 each
entry's commit record ``<key>/.commit``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
from hostile_node import PREFIX, SO_NAME

from vllm_neuron.backends import join, open_store
from vllm_neuron.backends.records import LeaseRecord, encode
from vllm_neuron.compile.entry.failure_notes import FailureNote
from vllm_neuron.compile.entry.notes import FAILURES
from vllm_neuron.compile.entry.record import ENTRY_RECORD, read_record
from vllm_neuron.compile.trust.signing import SIGNATURE_FILE

HERE = os.path.dirname(os.path.abspath(__file__))

CANARY_SOURCE = r"""
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void canary(void) {
    int fd = open("%s", O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) { write(fd, "ran\n", 4); close(fd); }
}
"""
BENIGN_SOURCE = "int vllm_neuron_test_kernel(int x) { return x + 1; }\n"

DEEP = b"[" * 100_000 + b"]" * 100_000
OVERSIZE_FOLDER = 768 << 20  # a sparse file: no disk, but a reader without a bound reads it
OVERSIZE_S3 = (1 << 20) + 4096  # a real upload, just past RECORD_MAX_BYTES
YEAR_2100 = 4102444800.0


def build_shared_objects(workdir: Path, canary_marker: Path) -> tuple[Path, Path]:
    """A benign shared object (the test toolchain's ``kernel.so``) and the canary, whose
    constructor appends to `canary_marker` the moment any process loads it."""
    workdir.mkdir(parents=True, exist_ok=True)
    built = []
    for name, source in (("benign", BENIGN_SOURCE), ("canary", CANARY_SOURCE % canary_marker)):
        c_file, so_file = workdir / f"{name}.c", workdir / f"{name}.so"
        c_file.write_text(source)
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so_file), str(c_file)], check=True,
                       timeout=120)  # fmt: skip
        built.append(so_file)
    return built[0], built[1]


class NodeProcess:
    """One node: a hostile_node.py process with its trust environment (`kind`)."""

    def __init__(self, name: str, kind: str, env: dict[str, str], benign: Path,
                 log: Path) -> None:  # fmt: skip
        self.name, self.kind, self.env, self.benign, self.log = name, kind, env, benign, log
        self.proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self.baseline_kib = 0
        self.restarts = 0

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.join(HERE, "hostile_node.py"), str(self.benign)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=self.env)
        self._buffer = b""
        ready = self.receive(time.monotonic() + 300)
        self.baseline_kib = int(ready["VmRSS"])

    def send(self, request: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()

    def receive(self, deadline: float) -> dict[str, Any]:
        """The node's next answer; `TimeoutError` when none came by `deadline`
        (monotonic), `RuntimeError` when the node exited."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            line, newline, rest = self._buffer.partition(b"\n")
            if newline:
                self._buffer = rest
                text = line.decode(errors="replace")
                if text.startswith(PREFIX):
                    return dict(json.loads(text[len(PREFIX):]))
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"node {self.name} gave no answer in time")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"node {self.name} exited: {self.tail()}")
                self._buffer += chunk

    def tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Kill this node's own process (by its pid) and reap it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()


def fresh_keys(example: int, pool: str, n: int) -> list[str]:
    return [uuid.uuid5(uuid.NAMESPACE_URL, f"hostile-model-{example}-{pool}-{i}").hex
            for i in range(n)]


class Adversary:
    """Writes the remote at `url` as a writer without any trusted key (see the module doc);
    every move returns a name for `hypothesis.event`."""

    def __init__(self, url: str, folder: bool, *, canary: Path, secret: Path) -> None:
        self.url, self.folder = url, folder
        self.store = open_store(url)  # the storage layer as a plain writer: no locks, no checks
        self.canary, self.secret = canary, secret
        self.kept: dict[str, dict[str, bytes]] = {}  # key -> an older version's files

    # ------------------------------------------------------------ where things are
    def path(self, name: str) -> str:
        """A folder remote's file (only for special files)."""
        assert self.folder
        return os.path.join(self.url, name)

    def published(self, key: str) -> str | None:
        return self.store.published(key)

    def _put(self, name: str, what: str, data: bytes = b"") -> None:
        """Put at `name` one hostile thing: ``bytes`` (`data`), ``oversize``, ``deep``, and
        on a folder ``fifo``, ``link-zero`` (to /dev/zero), ``link-secret`` (to a
        node-local file) - replacing whatever is there."""
        if what == "bytes":
            self.store.write(name, data)
        elif what == "oversize" and not self.folder:
            self.store.write(name, b'{"schema": "' + b"x" * OVERSIZE_S3 + b'"}')
        elif what == "deep":
            self.store.write(name, DEEP)
        else:
            path = self.path(name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if os.path.lexists(path):
                if os.path.isdir(path) and not os.path.islink(path):
                    return  # a directory in its place: leave it
                os.unlink(path)
            if what == "oversize":
                with open(path, "wb") as f:
                    f.truncate(OVERSIZE_FOLDER)
            elif what == "fifo":
                os.mkfifo(path)
            elif what == "link-zero":
                os.symlink("/dev/zero", path)
            elif what == "link-secret":
                os.symlink(str(self.secret), path)
            else:  # pragma: no cover
                raise ValueError(what)

    # ------------------------------------------------------------------ moves
    def entry_file(self, key: str, name: str, what: str, data: bytes) -> str:
        prefix = self.published(key)
        if prefix is None:
            return "entry-file: nothing published"
        self._put(join(prefix, name), what, data)
        return f"entry-file: {name} <- {what}"

    def commit_record(self, key: str, what: str, data: bytes) -> str:
        """S3: the entry's commit record (which version is published)."""
        self._put(join(key, ".commit"), what, data)
        return f"commit-record <- {what}"

    def canary_entry(self, key: str, signature: str) -> str:
        """The canary in place of the entry's shared object, every size and digest in
        entry.json recomputed: only the signature can tell. `signature`: ``keep`` (the
        builder's, now of other bytes), ``drop``, or ``junk``."""
        prefix = self.published(key)
        if prefix is None:
            return "canary: nothing published"
        try:
            record = read_record(self.store, prefix)
        except Exception:  # noqa: BLE001 - an earlier move broke the record: plant anyway
            return self.entry_file(key, SO_NAME, "bytes", self.canary.read_bytes())
        self.store.write(join(prefix, SO_NAME), self.canary.read_bytes())
        files = {name: self.store.digest(join(prefix, name)) for name in record.files}
        if any(d is None for d in files.values()):
            return "canary: files missing"
        forged = msgspec.structs.replace(record, files=files)
        self.store.write(join(prefix, ENTRY_RECORD), encode(forged))
        if signature == "drop":
            self.store.delete(join(prefix, SIGNATURE_FILE))
        elif signature == "junk":
            self.store.write(join(prefix, SIGNATURE_FILE), b'{"schema": "nonsense"}')
        return f"canary: re-digested, signature {signature}"

    def keep_version(self, key: str) -> str:
        """Remember the key's published files, to put back later (an older version)."""
        prefix = self.published(key)
        if prefix is None:
            return "keep: nothing published"
        files = {}
        for name in self.store.list(prefix):
            data = self.store.read(name, max_size=64 << 20) if self._plain(name) else None
            if data is not None:
                files[name[len(prefix) + 1:]] = data
        self.kept[key] = files
        return "keep: an older version"

    def replay(self, source: str, target: str) -> str:
        """Put `source`'s kept (signed) version - or, none kept, its current one - under
        `target`'s name: the same key (an older version), or another key (a valid signature
        of another entry)."""
        if source not in self.kept:
            self.keep_version(source)  # nothing kept yet: what is published now
        files = self.kept.get(source)
        if not files:
            return "replay: nothing published"
        prefix = self.published(target)
        if prefix is None:
            prefix = target if self.folder else join(target, ".v", uuid.uuid4().hex)
            if not self.folder:
                from vllm_neuron.backends.records import CommitRecord

                version = prefix.rsplit("/", 1)[1]
                commit = CommitRecord(version=version, committed_at=time.time())
                self.store.write(join(target, ".commit"), encode(commit))
        for name, data in files.items():
            self.store.write(join(prefix, name), data)
        return "replay: older version" if source == target else "replay: under another key"

    def note(self, key: str, what: str, data: bytes) -> str:
        """A failure note of `key`: ``fresh`` (dated now), ``near-future`` (within the
        clock-skew margin), ``far-future`` (past it), ``year-2100``, ``malformed`` (a note
        record with a field of the wrong type), or a `_put` thing."""
        from vllm_neuron.compile.entry.failure_notes import CLOCK_SKEW

        name = FAILURES.path(key)
        dates = {"fresh": time.time(), "near-future": time.time() + CLOCK_SKEW / 2,
                 "far-future": time.time() + 10 * CLOCK_SKEW, "year-2100": YEAR_2100}
        if what in dates:
            note = FailureNote(at=dates[what], error="ValueError: \x1b[31mthe compiler crashed"
                               "\nFAKE LOG LINE", pid=4242, host="mallory")  # fmt: skip
            self.store.write(name, encode(note))
        elif what == "malformed":
            self.store.write(name, json.dumps({"type": "compile-failure", "at": "soon",
                                               "error": 7}).encode())  # fmt: skip
        else:
            self._put(name, what, data)
        return f"note <- {what}"

    def lease(self, key: str, what: str, data: bytes) -> str:
        """In `key`'s lease folder: ``forged`` (a record claiming a billion-second lease
        until 2100), ``huge-generation`` (a name past MAX_GENERATION), ``junk-names``
        (files named like no generation), or a `_put` thing at a generation's name."""
        folder = f".locks/{key}"
        if what == "forged":
            self.store.write(f"{folder}/000000000007", encode(LeaseRecord(
                owner="mallory:1:forged", generation=7, expires=YEAR_2100, renewal=1,
                duration=1e9)))  # fmt: skip
        elif what == "huge-generation":
            self.store.write(f"{folder}/999999999999999999", encode(LeaseRecord(
                owner="mallory:1:huge", generation=999999999999999999, expires=YEAR_2100,
                renewal=1, duration=1e9)))  # fmt: skip
        elif what == "junk-names":
            for name in ("\u00b2", "\u0661\u0662", "1e9", "9" * 200, "notes.txt"):
                self.store.write(f"{folder}/{name}", b"junk")
        else:
            self._put(f"{folder}/000000000005", what, data)
        return f"lease <- {what}"

    # ------------------------------------------------------------------ checks
    def _plain(self, name: str) -> bool:
        """Whether `name` is a file the checks may read (a folder's special files, links and
        sparse giants are the adversary's own, never read)."""
        if not self.folder:
            return True
        try:
            st = os.lstat(self.path(name))
        except OSError:
            return False
        import stat

        return stat.S_ISREG(st.st_mode) and st.st_size <= 8 << 20

    def everything(self) -> dict[str, bytes]:
        """Every plain file of the remote and its bytes (see `_plain`)."""
        found = {}
        for name in self.store.list(""):
            if self._plain(name):
                data = self.store.read(name, max_size=8 << 20) if self.folder else (
                    self.store.read(name))
                if data is not None:
                    found[name] = data
        return found
