"""A real `specdec-cli serve` process on a free loopback port, for the server tests."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

ROOT = Path(__file__).parent.parent


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str
    log: IO[str]  # its stderr: a file, so that a server logging every request never blocks

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def metrics(self) -> dict[str, float]:
        """/metrics as {name with labels: value}."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("specdec:") and " " in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(*args: object, ready: bool = True) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "cli.main", "serve", *map(str, args), "--port", str(port)]
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=log, text=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    if ready:
        wait_ready(server)
    return server


def wait_ready(server: Server, seconds: float = 180) -> list[int]:
    """Polls /health until 200; returns the statuses seen on the way."""
    seen: list[int] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(f"the server exited: {server.stderr()}")
        try:
            status = httpx.get(server.url + "/health", timeout=2).status_code
            seen.append(status)
            if status == 200:
                return seen
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError("the server did not become ready")
