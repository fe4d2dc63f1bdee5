"""Building HTML and SVG as text, every value escaped on the way in.

Why our own twenty lines and not a template engine: the page is a handful of tables and one
SVG, and the package depends on no template library; what matters is that nothing read
from a store (a key, a path, an error message, a model name) can ever become markup, so
every text and every attribute value goes through `html.escape` here, and callers pass
only `Markup` (already built) or plain values. The same door redacts secrets
(`vllm_neuron.envs.secrets`): records are written without them, but a page may show one
written before that, or by another writer, and a page is passed around.
"""

from __future__ import annotations

import html
from collections.abc import Iterable

from vllm_neuron.envs import redact_text

__all__ = ["Markup", "el", "esc", "join"]


class Markup(str):
    """Text that is already markup: `el` inserts it as is (everything else is escaped)."""


def esc(value: object) -> Markup:
    """`value` as text, secrets redacted, escaped for use inside an element or a quoted
    attribute."""
    if isinstance(value, Markup):
        return value
    return Markup(html.escape(redact_text(str(value)), quote=True))


# HTML elements that have no end tag.
_VOID = frozenset({"br", "hr", "img", "input", "link", "meta"})


def _attr_name(name: str) -> str:
    # Python names to HTML names: data_kind -> data-kind, class_ -> class.
    return name.rstrip("_").replace("_", "-")


def el(tag: str, *children: object, **attrs: object) -> Markup:
    """``<tag attrs>children</tag>``: attributes with a None value are left out, True is
    written bare; children are escaped unless they are `Markup`; None children are skipped."""
    parts = [tag]
    for name, value in attrs.items():
        if value is None or value is False:
            continue
        key = _attr_name(name)
        parts.append(key if value is True else f'{key}="{esc(value)}"')
    if tag in _VOID:
        return Markup(f"<{' '.join(parts)}>")
    body = "".join(esc(c) for c in children if c is not None)
    return Markup(f"<{' '.join(parts)}>{body}</{tag}>")


def join(items: Iterable[object], sep: str = "") -> Markup:
    """Items joined into one piece of markup (each escaped unless it is `Markup`)."""
    return Markup(sep.join(esc(i) for i in items))
