"""Stand-in sandboxes for the network tests: processes with their own user,
network and mount namespaces, started with unshare(1) (inside an owner's
user namespace for service networks), each with a bind-mounted /etc/hosts
the test can rewrite."""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

import nsbox
from nsbox.net import usernet
from nsbox.net.bridge import OwnerUserns
from nsbox.net.client import Namespaces

from . import components

def gone(pid: int | None, within: float = 5.0) -> bool:
    """Whether process `pid` exits within `within` seconds (a zombie has:
    it waits only for its parent to reap it)."""
    deadline = time.monotonic() + within
    while pid is not None and Path(f"/proc/{pid}").exists():
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[2] if len(sys.argv) > 2 else "0.0.0.0", 8000)); s.listen()
    print("listening", flush=True)
    while True:
        c, _ = s.accept(); c.sendall(sys.argv[1].encode()); c.close()
""")
CLIENT = textwrap.dedent("""
    import socket, sys
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
        print("got", c.recv(100).decode())
    except OSError as e:
        print("failed", type(e).__name__, e)
""")


def tun_usable() -> bool:
    """Whether this user can really open /dev/net/tun (the refusal tests
    need the real answer; tests that need nat mark needs("tun", "usernet"))."""
    try:
        usernet.check_tun()
        return True
    except nsbox.NsboxError:
        return False


class Member:
    """A stand-in sandbox: its own user (inside the owner's), network and mount namespaces."""

    def __init__(self, owner: OwnerUserns | None, tmp: Path, name: str) -> None:
        components.require("iproute2")
        self.hosts = tmp / f"hosts-{name}"
        self.hosts.write_text("127.0.0.1 localhost\n")
        self.hosts.chmod(0o644)
        inner = ["unshare", "-Urnm", "sh", "-c",
                 f"ip link set lo up && mount --bind {self.hosts} /etc/hosts && exec sleep 300"]
        self.proc = subprocess.Popen([*(enter_owner(owner) if owner else []), *inner])
        deadline = time.monotonic() + 10
        while comm(self.proc.pid) != "sleep":
            assert self.proc.poll() is None and time.monotonic() < deadline, "the member did not start"
            time.sleep(0.01)
        self.ns = Namespaces.of_pid(self.proc.pid, with_user=True)
        self.pidfd = os.pidfd_open(self.proc.pid)

    def serve(self, reply: str, address: str = "0.0.0.0") -> subprocess.Popen[str]:
        """Runs SERVER on port 8000 inside; returns once it listens."""
        server = self.start(SERVER, reply, address)
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "listening"
        return server

    def _cmd(self, code: str, args: tuple[str, ...]) -> list[str]:
        return ["nsenter", "--preserve-credentials", "-t", str(self.proc.pid), "-U", "-n", "-m",
                sys.executable, "-c", code, *args]

    def run(self, code: str, *args: str) -> str:
        """Runs Python `code` inside; returns its stripped output."""
        return subprocess.run(self._cmd(code, args), capture_output=True, text=True, timeout=30).stdout.strip()

    def start(self, code: str, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(self._cmd(code, args), stdout=subprocess.PIPE, text=True)

    def links(self) -> str:
        return subprocess.run(["nsenter", "--preserve-credentials", "-t", str(self.proc.pid), "-U", "-n",
                               "ip", "-o", "link"], capture_output=True, text=True).stdout

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.ns.close()
        os.close(self.pidfd)


def enter_owner(owner: OwnerUserns) -> list[str]:
    """nsenter into the owner's user namespace as its root (the invoking user
    is its root, except for real root, whose sandboxes map onto a range)."""
    return ["nsenter", f"--user={owner.path}", *(["--preserve-credentials"] if os.geteuid() else []), "--"]


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


# ---- servers on the host's 127.0.0.1 (test modules import the fixtures by name)

@pytest.fixture
def host_server() -> Iterator[int]:
    """A TCP server on the host's 127.0.0.1 answering "host"."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = False

    def serve() -> None:
        while not stop:
            try:
                c, _ = listener.accept()
            except OSError:
                continue
            c.sendall(b"host")
            c.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop = True
    thread.join()
    listener.close()


@contextlib.contextmanager
def loopback_http(body_for: Callable[[http.server.BaseHTTPRequestHandler], bytes]) -> Iterator[tuple[int, list[str]]]:
    """An HTTP server on the host's 127.0.0.1 answering each GET with
    `body_for(request)`: (its port, the paths asked for so far)."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            body = body_for(self)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def http_server() -> Iterator[int]:
    """An HTTP server on the host's 127.0.0.1 answering "hello from <Host header>"."""
    with loopback_http(lambda req: f"hello from {req.headers['Host'].split(':')[0]}".encode()) as (port, _):
        yield port
