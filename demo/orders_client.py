"""Start, stop and steer the orders service (``demo.orders_service``) from tests and fault injection.

Why a real subprocess: agents must be tested against real sockets, real timeouts and a service that
can be killed, frozen and restarted, which an in-process ASGI transport cannot imitate.

- ``ServiceProcess`` runs ``python -m demo.orders_service`` on a free 127.0.0.1 port, waits until
  ``/health`` answers (polling, never a fixed sleep), and stops it with SIGTERM, then SIGKILL past a
  timeout. It can also ``kill()`` (crash), ``freeze()``/``thaw()`` (SIGSTOP/SIGCONT: the socket still
  accepts but nothing answers) and ``restart()`` on the same port (so URLs handed to agents stay valid).
- ``OrdersAdmin`` wraps the admin endpoints (faults, counters, records, reset) and offers ``call()``
  for raw business requests in tests; agents use their own runtime, not this client.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypedDict

import httpx

from demo.orders_service import ATTEMPT_HEADER, IDEMPOTENCY_HEADER, OPERATIONS, UNDOES_HEADER, Operation

__all__ = [
    "OPERATIONS",
    "Arrival",
    "CallCounts",
    "FaultsView",
    "Operation",
    "OrdersAdmin",
    "Records",
    "ServiceProcess",
    "ServiceStartError",
    "free_port",
]

_REPO_ROOT = Path(__file__).resolve().parent.parent


class CallCounts(TypedDict):
    """``GET /admin/calls``: per operation and idempotency key, requests received and effects applied."""

    requests: dict[str, dict[str, int]]
    applied: dict[str, dict[str, int]]
    outcomes: dict[str, dict[str, dict[str, int]]]
    in_flight: int
    peak_in_flight: int


class Arrival(TypedDict):
    """One request as ``GET /admin/arrivals`` lists it: its ``X-Attempt`` and when it arrived (epoch s)."""

    attempt: int
    at: float


class Records(TypedDict):
    """``GET /admin/records``: applied effects in order, and the resources keyed by their ids."""

    effects: list[dict[str, Any]]
    reservations: dict[str, dict[str, Any]]
    charges: dict[str, dict[str, Any]]
    shipments: dict[str, dict[str, Any]]
    tombstones: dict[str, dict[str, dict[str, Any]]]


# ``GET /admin/faults``: the global configuration (or None) and per-operation overrides, which replace
# the global one for their operation. Functional syntax because "global" is a Python keyword.
FaultsView = TypedDict("FaultsView", {"global": dict[str, Any] | None, "operations": dict[str, dict[str, Any]]})


class ServiceStartError(RuntimeError):
    """The service process exited or never answered /health; the message carries its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """Ask the kernel for a free port (bind to 0). Racy by nature, so ``ServiceProcess`` retries."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class ServiceProcess:
    """The orders service as a child process; a context manager that starts and stops it.

    ``port=None`` picks a free port and keeps it across ``restart()``. Output goes to ``log_path``
    (a temp file by default) rather than a pipe, because an unread pipe fills and blocks the child.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        seed: int = 0,
        state_file: Path | str | None = None,
        log_path: Path | str | None = None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 20.0,
        stop_timeout_s: float = 10.0,
        graceful_shutdown_s: float = 1.0,
        python: str = sys.executable,
    ) -> None:
        self.host = host
        self._fixed_port = port
        self._port: int | None = port
        self.seed = seed
        self.state_file = Path(state_file) if state_file is not None else None
        self._own_log = log_path is None
        self.log_path = Path(log_path) if log_path is not None else self._temp_log()
        self.env = env
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.graceful_shutdown_s = graceful_shutdown_s
        self.python = python
        self._proc: subprocess.Popen[bytes] | None = None
        self._frozen = False

    @staticmethod
    def _temp_log() -> Path:
        fd, name = tempfile.mkstemp(prefix="orders-service-", suffix=".log")
        os.close(fd)
        return Path(name)

    # ---- properties ----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("service not started")
        return self._port

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def admin(self, *, timeout_s: float = 5.0) -> OrdersAdmin:
        """An admin client for this process (caller closes it, or uses it as a context manager)."""
        return OrdersAdmin(self.base_url, timeout_s=timeout_s)

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-max_bytes:].decode(errors="replace")

    # ---- lifecycle -----------------------------------------------------------------------------

    def _command(self, port: int) -> list[str]:
        cmd = [
            self.python,
            "-m",
            "demo.orders_service",
            "--host",
            self.host,
            "--port",
            str(port),
            "--seed",
            str(self.seed),
            "--graceful-shutdown-s",
            str(self.graceful_shutdown_s),
        ]
        if self.state_file is not None:
            cmd += ["--state-file", str(self.state_file)]
        return cmd

    def _child_env(self) -> dict[str, str]:
        env = dict(self.env if self.env is not None else os.environ)
        existing = env.get("PYTHONPATH")
        env["PYTHONPATH"] = f"{_REPO_ROOT}{os.pathsep}{existing}" if existing else str(_REPO_ROOT)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def start(self) -> Self:
        """Start the process and return once /health answers.

        With an automatic port, a lost race for the port (the child exits early) is retried on a new
        one; a fixed port is the caller's promise, so failure there is raised at once.
        """
        if self.running:
            raise RuntimeError("service already running")
        attempts = 1 if self._fixed_port is not None else 3
        last_error: ServiceStartError | None = None
        for _ in range(attempts):
            port = self._fixed_port if self._fixed_port is not None else (self._port or free_port(self.host))
            try:
                self._spawn(port)
                return self
            except ServiceStartError as exc:
                last_error = exc
                if self._fixed_port is None:
                    self._port = None  # try a fresh port
        assert last_error is not None
        raise last_error

    def _spawn(self, port: int) -> None:
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self._command(port),
                cwd=_REPO_ROOT,
                env=self._child_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._port = port
        self._frozen = False
        try:
            self._wait_healthy()
        except ServiceStartError:
            self._terminate()
            raise

    def _wait_healthy(self) -> None:
        """Poll /health until it answers 200 from *our* child (pid check), or fail with the log tail."""
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        url = f"{self.base_url}/health"
        with httpx.Client(timeout=0.5) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise ServiceStartError(f"orders service exited with {code} during start:\n{self.log_tail()}")
                try:
                    response = client.get(url)
                    if response.status_code == 200 and response.json().get("pid") == self._proc.pid:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise ServiceStartError(
                        f"orders service not healthy after {self.startup_timeout_s}s:\n{self.log_tail()}"
                    )
                time.sleep(0.05)

    def stop(self) -> int | None:
        """SIGTERM, wait up to ``stop_timeout_s``, then SIGKILL. Returns the exit code (None if not started)."""
        return self._terminate()

    def _terminate(self) -> int | None:
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            if self._frozen:
                proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._frozen = False
        return proc.returncode

    def kill(self) -> int | None:
        """SIGKILL at once: a crash, no drain, no final state-file flush."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        self._frozen = False
        return proc.returncode

    def freeze(self) -> None:
        """SIGSTOP: connections are still accepted by the kernel but nothing answers (a grey failure)."""
        if self._proc is None or not self.running:
            raise RuntimeError("service not running")
        self._proc.send_signal(signal.SIGSTOP)
        self._frozen = True

    def thaw(self) -> None:
        """SIGCONT: resume a frozen service."""
        if self._proc is None or not self.running:
            raise RuntimeError("service not running")
        self._proc.send_signal(signal.SIGCONT)
        self._frozen = False

    def restart(self, *, hard: bool = False) -> Self:
        """Stop (or ``hard``: kill) and start again on the same port; with a state file, dedup survives."""
        if hard:
            self.kill()
        else:
            self.stop()
        if self._fixed_port is None and self._port is not None:
            self._fixed_port = self._port
            try:
                return self.start()
            finally:
                self._fixed_port = None
        return self.start()

    def close(self) -> None:
        """Stop the process and delete the log file if we created it."""
        self.stop()
        if self._own_log:
            with contextlib.suppress(OSError):
                self.log_path.unlink()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class OrdersAdmin:
    """Typed access to the service's admin endpoints (and raw calls, for tests).

    Every method raises ``httpx.HTTPStatusError`` on a non-2xx answer, so a typo in a fault
    configuration fails the test that made it instead of running it without faults.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _json(self, response: httpx.Response) -> Any:
        response.raise_for_status()
        return response.json()

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._json(self._http.get("/health"))
        return result

    def set_faults(
        self,
        operation: Operation | None = None,
        *,
        latency_ms: int = 0,
        latency_jitter_ms: int = 0,
        error_rate: float = 0.0,
        throttle_rate: float = 0.0,
        retry_after_s: int = 1,
        permanent_error_rate: float = 0.0,
        hang: bool = False,
        hang_max_s: float = 300.0,
        fail_next: int = 0,
        throttle_first: int = 0,
        throttle_status: int = 429,
    ) -> FaultsView:
        """Replace the fault configuration of ``operation`` (None: the global one, used by every
        operation without its own). Fields left out mean "no such fault"."""
        payload = {
            "operation": operation,
            "latency_ms": latency_ms,
            "latency_jitter_ms": latency_jitter_ms,
            "error_rate": error_rate,
            "throttle_rate": throttle_rate,
            "retry_after_s": retry_after_s,
            "permanent_error_rate": permanent_error_rate,
            "hang": hang,
            "hang_max_s": hang_max_s,
            "fail_next": fail_next,
            "throttle_first": throttle_first,
            "throttle_status": throttle_status,
        }
        return self._faults_view(self._json(self._http.put("/admin/faults", json=payload)))

    def clear_faults(self, operation: Operation | None = None) -> FaultsView:
        """Remove all faults, or only ``operation``'s override (it falls back to the global configuration)."""
        params = {"operation": operation} if operation is not None else None
        return self._faults_view(self._json(self._http.delete("/admin/faults", params=params)))

    def faults(self) -> FaultsView:
        return self._faults_view(self._json(self._http.get("/admin/faults")))

    @staticmethod
    def _faults_view(data: dict[str, Any]) -> FaultsView:
        return {"global": data["global"], "operations": data["operations"]}

    def calls(self) -> CallCounts:
        result: CallCounts = self._json(self._http.get("/admin/calls"))
        return result

    def arrivals(self) -> dict[str, dict[str, list[Arrival]]]:
        """Per operation and idempotency key, each request's ``X-Attempt`` and arrival time, in arrival order."""
        result: dict[str, dict[str, list[Arrival]]] = self._json(self._http.get("/admin/arrivals"))
        return result

    def arrival_order(self, operation: Operation) -> dict[str, list[int]]:
        """Per idempotency key of ``operation``, the attempt numbers in the order their requests arrived."""
        return {key: [a["attempt"] for a in log] for key, log in self.arrivals().get(operation, {}).items()}

    def records(self, order_id: str | None = None) -> Records:
        params = {"order_id": order_id} if order_id is not None else None
        result: Records = self._json(self._http.get("/admin/records", params=params))
        return result

    def reset(self, seed: int | None = None) -> None:
        """Clear all state and faults and reseed the fault RNG (with ``seed``, or the current one)."""
        body = {"seed": seed} if seed is not None else None
        self._json(self._http.post("/admin/reset", json=body))

    def requests_for(self, operation: Operation, key: str) -> int:
        """How many requests the service received for ``operation`` with idempotency key ``key``."""
        return self.calls()["requests"].get(operation, {}).get(key, 0)

    def applied_for(self, operation: Operation, key: str) -> int:
        """How many times the side effect of ``operation`` was applied for ``key`` (0 or 1 if dedup holds)."""
        return self.calls()["applied"].get(operation, {}).get(key, 0)

    def call(
        self,
        operation: Operation,
        body: dict[str, Any],
        *,
        idempotency_key: str | None,
        attempt: int | None,
        timeout_s: float | None = None,
        undoes_key: str | None = None,
    ) -> httpx.Response:
        """A raw business request (headers omitted when None), returned unchecked for tests to inspect.

        ``undoes_key``: for a compensating operation, the forward key it undoes (and tombstones)."""
        headers: dict[str, str] = {}
        if idempotency_key is not None:
            headers[IDEMPOTENCY_HEADER] = idempotency_key
        if attempt is not None:
            headers[ATTEMPT_HEADER] = str(attempt)
        if undoes_key is not None:
            headers[UNDOES_HEADER] = undoes_key
        timeout = httpx.Timeout(timeout_s) if timeout_s is not None else self._http.timeout
        return self._http.post(f"/{operation}", json=body, headers=headers, timeout=timeout)
