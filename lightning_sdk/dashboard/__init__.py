"""`lightning dashboard`: a local, read-only web page over run directories (runs.py reads, web.py serves,
static/ is the page: one HTML file, plain JavaScript, an SVG chart; no build step)."""

from lightning_sdk.dashboard.web import create_app, new_token, serve
from lightning_sdk.dashboard.runs import CreditSettings, RunReader
from lightning_sdk.gateway.listen import bind

__all__ = ["CreditSettings", "RunReader", "bind", "create_app", "new_token", "serve"]
