"""``stepstream serve api``: the HTTP front (``stepstream.http.server``) in the foreground."""

from __future__ import annotations

import argparse

from stepstream.http.server import serve_api


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stepstream serve api``."""
    serve = commands.add_parser("serve", help="serve the dashboard API, the dashboard page and /metrics")
    serve.add_argument("what", choices=["api"])
    serve.add_argument("--host", default=None, help="interface (default STEPSTREAM_API_HOST, 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default STEPSTREAM_API_PORT, 8780; 0: any free)")
    serve.set_defaults(func=lambda a: serve_api(host=a.host, port=a.port))
