"""The deployment report: one self-contained HTML page (docs/report.md).

`resolve_sources` (roots to stores), `gather` (what the page shows, through each feature's
readers), `render_page` (the HTML, with the timeline's inline SVG).
"""

from .gather import Report, gather
from .page import render_page
from .roots import Sources, resolve_sources

__all__ = ["Report", "Sources", "gather", "render_page", "resolve_sources"]
