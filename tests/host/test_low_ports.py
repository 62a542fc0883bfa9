"""Ports below 1024 in a sandbox's own network namespace: sandbox root and
any other sandbox user bind them, as in a Docker container (Docker sets
net.ipv4.ip_unprivileged_port_start=0 in each one), in every network mode
that gives the sandbox a namespace of its own, and in a build's RUN steps.
Sandbox root cannot set it back: /proc/sys is read-only in a sandbox.
Nothing changes on the host. Every server binds inside the sandboxes'
own namespaces; traffic stays there."""

from __future__ import annotations

import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import nsbox

from tests.conftest import MODE
from tests.net_members import tun_usable

pytestmark = pytest.mark.timeout(120)
needs_tun = pytest.mark.needs("tun", "usernet")
# Single-uid mode maps no user but root (exec as another user is refused).
USERS = ["root", pytest.param("nobody", marks=pytest.mark.skipif(MODE.mode == "single", reason="single-uid mode"))]

BIND = "import socket; s = socket.socket(); s.bind(('0.0.0.0', {port})); s.listen(); print('bound', {port})"
SERVE = textwrap.dedent("""
    import socket
    s = socket.create_server(("0.0.0.0", 80))
    while True:
        c, _ = s.accept(); c.sendall(socket.gethostname().encode()); c.close()
""")
FETCH = ("import socket, sys, time\n"
         "for _ in range(100):\n"
         "  try: print(socket.create_connection((sys.argv[1], 80), timeout=3).recv(100).decode()); break\n"
         "  except ConnectionRefusedError: time.sleep(0.05)\n")


def bind(port: int = 80) -> list[str]:
    return ["python3", "-c", BIND.format(port=port)]


@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("network", ["none", "proxy", pytest.param("nat", marks=needs_tun)])
async def test_any_user_binds_port_80(network: str, user: str) -> None:
    async with nsbox.Sandbox(network=network) as sb:  # type: ignore[arg-type]
        r = await sb.exec(bind(), user=user)
        assert r.stdout == "bound 80\n", r
        # Sandbox root cannot take it back (nor change anything else there).
        r = await sb.exec(["sh", "-c", "echo 1024 > /proc/sys/net/ipv4/ip_unprivileged_port_start"])
        assert not r.success and "Read-only file system" in r.stderr, r
        r = await sb.exec(["cat", "/proc/sys/net/ipv4/ip_unprivileged_port_start"])
        assert r.stdout == "0\n", r


def test_the_host_keeps_its_own_setting() -> None:
    with open("/proc/sys/net/ipv4/ip_unprivileged_port_start") as f:
        before = f.read()
    r = subprocess.run([sys.executable, "-m", "nsbox", "run", "--", *bind()], capture_output=True, text=True,
                       timeout=60)
    assert r.stdout == "bound 80\n", r.stderr
    with open("/proc/sys/net/ipv4/ip_unprivileged_port_start") as f:
        assert f.read() == before


@pytest.mark.parametrize("user", USERS)
async def test_service_network_members_and_a_pod_serve_on_80(user: str) -> None:
    """Members of a service network serve :80 to each other by name; a
    sandbox joining one's namespace (container:ID, as compose services
    of a sample do) binds another low port there."""
    async with nsbox.Network("low", internal=True) as net:
        async with nsbox.Sandbox(network=net, hostname="web") as web, \
                nsbox.Sandbox(network=net, hostname="client") as client:
            await web.exec(["sh", "-c", f"python3 -c '{SERVE}' >/dev/null 2>&1 &"], user=user)
            r = await client.exec(["python3", "-c", FETCH, "web"], user=user)
            assert r.stdout == "web\n", r
            async with nsbox.Sandbox(network=f"container:{web.id}") as pod:
                r = await pod.exec(bind(81), user=user)
                assert r.stdout == "bound 81\n", r


@pytest.mark.timeout(180)
@needs_tun  # a named network reaches out through nat
def test_named_network_member_binds_80() -> None:
    name = f"t{secrets.token_hex(4)}"
    cli = [sys.executable, "-m", "nsbox"]
    r = subprocess.run([*cli, "network", "create", name], capture_output=True, text=True, timeout=60, cwd="/tmp")
    assert r.returncode == 0, r.stderr
    try:
        user = ["--user", "nobody"] if MODE.mode != "single" else []
        r = subprocess.run([*cli, "run", "--network", f"net:{name}", *user, "--", *bind()], capture_output=True,
                           text=True, timeout=60, cwd="/tmp")
        assert r.stdout == "bound 80\n", r.stderr
    finally:
        subprocess.run([*cli, "network", "rm", name], capture_output=True, timeout=60, cwd="/tmp")


@pytest.mark.timeout(300)
async def test_a_run_step_binds_80(tmp_path: Path) -> None:
    """busybox httpd exits 1 when it cannot bind its port."""
    from nsbox.dockerfile import build
    from nsbox.storage import ImageNotFound, Store

    from .test_build import _base, context

    base = _base("busybox")
    tag = f"localhost/nsbox-build-test:low-port-{secrets.token_hex(3)}"
    ctx = context(tmp_path, f"FROM {base}\nRUN httpd -p 80 && echo bound > /bound\n")
    try:
        for network in ("none", *(("nat",) if tun_usable() else ())):
            await build(ctx, tag=tag, network=network, no_cache=True)
            async with nsbox.Sandbox(image=tag) as sb:
                assert (await sb.read_file("/bound")).strip() == "bound"
    finally:
        try:
            await Store().remove(tag)
        except ImageNotFound:
            pass
