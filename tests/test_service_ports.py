"""The port a project's service is declared on can be used again the moment the service stopped: its closed
connections linger in TIME-WAIT for about a minute, which a server binding with ``SO_REUSEADDR`` (as uvicorn
does) does not mind, so ``up``'s check of the port must not mind either; a port something listens on is
still refused."""

from __future__ import annotations

import socket

import pytest

from stepstream.local.project_services import ServiceRefused, plan
from stepstream.project.model import ServiceDecl


def _server() -> socket.socket:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server


def _time_wait_left_on_a_stopped_servers_port() -> int:
    """A port a server answered one connection on, closed from the server's side (so the TIME-WAIT is on the
    server's port), then stopped listening."""
    server = _server()
    port: int = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server closes first: its side goes to TIME-WAIT once the client's FIN arrives
    assert client.recv(1) == b""
    client.close()
    server.close()
    return port


def test_a_port_left_in_time_wait_by_a_stopped_service_is_planned_at_once() -> None:
    port = _time_wait_left_on_a_stopped_servers_port()
    with socket.socket() as plain, pytest.raises(OSError):  # the check this replaces: refused for a minute
        plain.bind(("127.0.0.1", port))
    started = plan("loans", ServiceDecl(url=f"http://127.0.0.1:{port}"), None)
    assert started.url == f"http://127.0.0.1:{port}"


def test_a_port_a_server_listens_on_is_refused_naming_the_service_and_the_port() -> None:
    with _server() as server:
        port = server.getsockname()[1]
        with pytest.raises(ServiceRefused, match=rf"service loans: port {port} .* Address already in use"):
            plan("loans", ServiceDecl(url=f"http://127.0.0.1:{port}"), None)
