"""The live page's static files (package data), readable without importing the server."""

from __future__ import annotations

from importlib import resources


def dashboard_html() -> str:
    """The live page (server/dashboard.py), the same for one server and a node of several."""
    return resources.files(__name__).joinpath("dashboard.html").read_text(encoding="utf-8")
