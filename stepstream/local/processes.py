"""Service processes started and stopped as a group: by ``stepstream up``, the demo and the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from eventstore.errors import StepstreamError


class ProcessExited(StepstreamError, RuntimeError):
    """A process ended while it was expected to start: its exit code and the end of its log say why."""


@dataclass
class ServiceProcesses:
    """Named child processes; each logs to ``<log_dir>/<name>.log``."""

    env: dict[str, str]
    log_dir: Path
    cwd: Path | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _terminated: set[int] = field(default_factory=set)
    # Where each process's output starts in its log file: logs are appended to across runs and restarts,
    # and a marker an earlier run logged must not pass for this one's.
    _log_start: dict[str, int] = field(default_factory=dict)
    # How each process was started, so it can be started again the same way.
    _commands: dict[str, tuple[tuple[str, ...], Mapping[str, str] | None]] = field(default_factory=dict)

    def start(self, name: str, *args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``python -m <args>`` under ``name`` (``env``: variables of its own on top of the group's); a
        process of that name still running is an error."""
        return self.launch(name, (sys.executable, "-m", *args), env=env)

    def launch(self, name: str, argv: tuple[str, ...], env: Mapping[str, str] | None = None
               ) -> subprocess.Popen[bytes]:
        """Start the command ``argv`` under ``name`` (a project's own service, say), as ``start`` does."""
        running = self.procs.get(name)
        if running is not None and running.poll() is None:
            raise RuntimeError(f"{name} is already running (pid {running.pid})")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self._log_start[name] = log.tell()
            proc = subprocess.Popen(argv, env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=self.cwd)
        self.procs[name] = proc
        self._commands[name] = (argv, env)
        return proc

    def start_again(self, name: str) -> subprocess.Popen[bytes]:
        """Start ``name`` as it was started last time (it must have exited)."""
        argv, env = self._commands[name]
        return self.launch(name, argv, env=env)

    def service(self, name: str, *args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start a ``stepstream run ...`` service."""
        return self.start(name, "stepstream", "run", *args, env=env)

    def wait_started(self, name: str, marker: str = "service starting", timeout_s: float = 60.0,
                     count: int = 1) -> None:
        """Wait until the process logged ``marker`` (``count`` times): from the first "service starting" on,
        it handles SIGTERM by draining; later markers say it owns its partitions."""
        deadline = time.monotonic() + timeout_s
        while self.log(name).count(marker) < count:
            if not self.alive(name):
                raise ProcessExited(f"{name} exited ({self.exit_status(name)}) while starting{self.log_tail(name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not log {marker!r} x{count} within {timeout_s}s")
            time.sleep(0.05)

    def signal(self, name: str, signum: signal.Signals) -> None:
        self.procs[name].send_signal(signum)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def terminate(self, name: str, timeout_s: float = 60.0) -> int:
        """SIGTERM once and wait for the drain; returns the exit code (SIGKILL past the timeout).

        Never a second SIGTERM: a process already past its drain, in interpreter shutdown, no longer
        has its handler and would die of it.
        """
        self._signal_once(name)
        proc = self.procs[name]
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            return -9

    def terminate_all(self, timeout_s: float = 60.0, last: Collection[str] = ()) -> dict[str, int]:
        """Stop every process, newest first, all signalled before any is waited for; those named in ``last``
        (the services the others call) only once the others exited, so a drain's last calls are answered."""
        codes: dict[str, int] = {}
        for wave in ([n for n in reversed(list(self.procs)) if n not in last], [n for n in last if n in self.procs]):
            for name in wave:
                self._signal_once(name)
            codes |= {name: self.terminate(name, timeout_s) for name in wave}
        return codes

    def _signal_once(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None and proc.pid not in self._terminated:
            proc.send_signal(signal.SIGTERM)
            self._terminated.add(proc.pid)

    def alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.poll() is None

    def exit_status(self, name: str) -> str:
        """How the exited process ``name`` ended: "exit code N" or "killed by signal N"."""
        code = self.procs[name].returncode
        return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"

    def log_tail(self, name: str, lines: int = 8) -> str:
        """The last ``lines`` of the process's log (where an exited one's reason is), indented under a line
        naming the file, each on a line of its own after a newline: to follow a console line about it."""
        tail = [line for line in self.log(name).splitlines() if line.strip()][-lines:]
        where = self.log_dir / f"{name}.log"
        if not tail:
            return f"\n    (its log {where} is empty)"
        return f"\n    the end of its log {where}:" + "".join(f"\n    {line}" for line in tail)

    def log(self, name: str) -> str:
        """What the process of that name (its latest start) has logged so far."""
        path = self.log_dir / f"{name}.log"
        if not path.exists():
            return ""
        with open(path, "rb") as log:
            log.seek(self._log_start.get(name, 0))
            return log.read().decode(errors="replace")


def child_env(**overrides: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.update(overrides)
    return env
