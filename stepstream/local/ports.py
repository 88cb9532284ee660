"""Whether a port can be listened on, asked the way the servers ``up`` starts will ask: with ``SO_REUSEADDR``.

Why that option: a service that just stopped leaves its closed connections in TIME-WAIT on its port for about
a minute. A server binding with ``SO_REUSEADDR`` (uvicorn, and every common HTTP server) starts there at once;
a probe binding without it is refused (``Address already in use``), which would make ``up`` refuse to start
again for a minute after it stopped. A port something still listens on is refused either way.
"""

from __future__ import annotations

import socket


def bindable_port(host: str, port: int) -> int:
    """The port a server could bind on ``host`` now (``port``, or a free one for 0); OSError if it cannot."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        chosen: int = probe.getsockname()[1]
    return chosen
