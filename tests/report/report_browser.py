"""Opening a report in a real headless browser (Debian's ``chromium``), from its command line.

Why the command line and not a driver library: chromium's own flags do all a test needs
and add no dependency. ``--dump-dom`` gives the page as the browser parsed it, with
``--enable-logging=stderr --v=0`` every console message of the page on stderr (a page that
has no script logs nothing, so any console line is an error: a refused load, a CSP
violation); ``--screenshot`` gives the picture. ``--virtual-time-budget`` makes the browser
finish when the page is done instead of after a wall-clock pause, so a loaded machine only
makes a test slower. The timeout on each run only catches a hung browser.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import zlib
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

HANG = 300  # seconds: a browser run that takes this long is hung, not slow
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
         "track", "wbr"}


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is not installed: `python3 dev.py test` installs it when run as "
                    "root; otherwise `apt-get install chromium` (Debian's package)")
    return path


def _run(page: Path, profile: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    argv = [chromium(), "--headless", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
            "--mute-audio", f"--user-data-dir={profile}", "--virtual-time-budget=10000",
            *flags, page.resolve().as_uri()]
    if os.geteuid() == 0:
        argv.insert(1, "--no-sandbox")  # chromium refuses to run as root with its sandbox
    done = subprocess.run(argv, capture_output=True, text=True, timeout=HANG)
    assert done.returncode == 0, f"chromium exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done


@dataclass
class Loaded:
    dom: str
    console: list[str]  # every console message the page produced


def load(page: Path, scratch: Path) -> Loaded:
    """The page's DOM as chromium built it, and its console messages."""
    done = _run(page, scratch / "chromium-profile", "--enable-logging=stderr", "--v=0",
                "--dump-dom")
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return Loaded(done.stdout, console)


def screenshot(page: Path, scratch: Path, width: int = 1100, height: int = 900) -> Path:
    out = scratch / "screenshot.png"
    _run(page, scratch / "chromium-profile", f"--window-size={width},{height}",
         f"--screenshot={out}")
    assert out.exists(), "chromium wrote no screenshot"
    return out


# -- the DOM, read back --------------------------------------------------------------------


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    text: str = ""
    children: list[Element] = field(default_factory=list)


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.stack = [self.root]
        self.all: list[Element] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Element(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        self.all.append(node)
        if tag not in _VOID:
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        for node in self.stack[1:]:
            node.text += data


def parse(dom: str) -> list[Element]:
    """Every element of the document, in document order (text: all text inside it)."""
    builder = _Builder()
    builder.feed(dom)
    builder.close()
    return builder.all


def select(elements: list[Element], tag: str | None = None, **attrs: str) -> list[Element]:
    """Elements by tag and attribute values (``data_kind="compile"``: data-kind)."""
    want = {k.rstrip("_").replace("_", "-"): v for k, v in attrs.items()}
    return [e for e in elements if (tag is None or e.tag == tag)
            and all(e.attrs.get(k) == v for k, v in want.items())]


def descendants(node: Element) -> list[Element]:
    out = []
    for child in node.children:
        out.append(child)
        out.extend(descendants(child))
    return out


# -- the screenshot, decoded ---------------------------------------------------------------


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else (b if pb <= pc else c)


def decode_png(data: bytes) -> np.ndarray:
    """An 8-bit RGB or RGBA, non-interlaced PNG (what chromium writes) as an array (h, w, c).

    No image library is a dependency of the project; the five scanline filters are the
    whole format for this case. None, Sub and Up are vectorized; Average and Paeth go byte
    by byte.
    """
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], b""
    while pos < len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    width, height = int.from_bytes(header[0:4], "big"), int.from_bytes(header[4:8], "big")
    depth, colour, interlace = header[8], header[9], header[12]
    assert depth == 8 and colour in (2, 6) and interlace == 0, f"unexpected PNG {header!r}"
    bpp = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8)
    stride = width * bpp
    rows = raw.reshape(height, stride + 1)
    out = np.zeros((height, stride), dtype=np.uint8)
    prior = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        kind, line = rows[y, 0], rows[y, 1:]
        if kind == 0:
            cur = line.copy()
        elif kind == 1:
            cur = (np.cumsum(line.reshape(width, bpp), axis=0, dtype=np.uint64) % 256).astype(
                np.uint8).reshape(stride)
        elif kind == 2:
            cur = (line + prior).astype(np.uint8)
        else:
            buf, up = bytearray(line.tobytes()), prior.tobytes()
            for i in range(stride):
                left = buf[i - bpp] if i >= bpp else 0
                upper = up[i]
                if kind == 3:
                    buf[i] = (buf[i] + ((left + upper) >> 1)) & 0xFF
                else:
                    corner = up[i - bpp] if i >= bpp else 0
                    buf[i] = (buf[i] + _paeth(left, upper, corner)) & 0xFF
            cur = np.frombuffer(bytes(buf), dtype=np.uint8)
        out[y] = cur
        prior = cur
    return out.reshape(height, width, bpp)
