"""`lightning dashboard`: a local, read-only web page over run directories (runs.py reads, explain.py replays how
each call's advantage was made, server.py serves, static/ is the page: one HTML file, plain JavaScript, SVG charts;
no build step)."""

from lightning_sdk.dashboard.server import create_app, new_token, serve
from lightning_sdk.dashboard.runs import CreditSettings, RunReader
from lightning_sdk.gateway.listen import bind

__all__ = ["CreditSettings", "RunReader", "bind", "create_app", "new_token", "serve"]
