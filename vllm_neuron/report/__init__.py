"""The deployment report: one self-contained HTML page (docs/report.md)."""
