"""Network "container:ID": a sandbox created in another sandbox's user and
network namespaces (a sub-zygote enters them; csrc/create/main.c), as the
containers of a pod or Docker's --network container:ID. The services of a
compose sample share a network this way.

What must hold: the two reach each other on 127.0.0.1 and by the names
given as hosts; they share nothing else (processes, mounts); neither can
reconfigure the shared network; a missing target or a different id mapping
is refused in one line, leaving nothing behind; the joiner outlives the
target; the sub-zygote is gone once the sandbox exists."""

from __future__ import annotations

import os

import psutil
import pytest

import nsbox
from nsbox.plan import netmodes
from nsbox.host import live
from nsbox.net.client import NetError

from tests.conftest import process_named
from tests import components

pytestmark = pytest.mark.timeout(60)

SERVE = ("import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
         "s.bind(('127.0.0.1', 8080)); s.listen()\n"
         "while True:\n c, _ = s.accept(); c.send(b'hello from a'); c.close()")
FETCH = "import socket; print(socket.create_connection(('web', 8080), timeout=5).recv(100).decode())"


async def _serve(sb: nsbox.Sandbox) -> None:
    await sb.exec(["sh", "-c", f"python3 -c \"{SERVE}\" >/dev/null 2>&1 &"])
    await sb.exec(["python3", "-c", "import socket, time\nfor _ in range(100):\n"
                   " try: socket.create_connection(('127.0.0.1', 8080)); break\n"
                   " except OSError: time.sleep(0.05)"])


async def _ns(sb: nsbox.Sandbox, name: str) -> str:
    return (await sb.exec(["readlink", f"/proc/self/ns/{name}"])).stdout.strip()


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children()}


async def test_joiner_reaches_target_by_name_and_shares_nothing_else() -> None:
    async with nsbox.Sandbox() as a:
        await _serve(a)
        before = _children()
        async with nsbox.Sandbox(network=f"container:{a.id}", hosts={"web": "127.0.0.1"}) as b:
            # The sub-zygote exited and was reaped: the only new child is b's init.
            assert _children() - before == {b.pid}
            r = await b.exec(["python3", "-c", FETCH])
            assert r.stdout == "hello from a\n", r
            assert await _ns(a, "net") == await _ns(b, "net")
            for ns in ("mnt", "pid", "user", "uts", "ipc"):
                assert await _ns(a, ns) != await _ns(b, ns), ns
            # b sees only its own processes: a's server is not among them.
            ps = await b.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"])
            assert "socket" not in ps.stdout and "8080" not in ps.stdout
            # Killing everything it can leaves a's server alive.
            await b.exec(["sh", "-c", "kill -9 -1; true"])
            assert (await b.exec(["python3", "-c", FETCH])).stdout == "hello from a\n"
            # Neither sandbox's root may reconfigure the shared namespace.
            for sb in (a, b):
                r = await sb.exec(["python3", "-c", "import fcntl, socket, struct\n"
                                   "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                                   "req = struct.pack('16sH14s', b'lo', 0, b'')\n"
                                   "fcntl.ioctl(s, 0x8914, req)"])  # SIOCSIFFLAGS: lo down
                assert r.returncode != 0 and "Operation not permitted" in r.stderr, r
            assert (await b.exec(["cat", "/etc/hosts"])).stdout.count("127.0.0.1\tweb") == 1


async def test_joiner_outlives_its_target() -> None:
    a = nsbox.Sandbox()
    await a.start()
    try:
        await _serve(a)
        b = nsbox.Sandbox(network=f"container:{a.id}")
        await b.start()
    finally:
        await a.close()
    try:
        # a's processes are gone; the network namespace stays, held by b.
        r = await b.exec(["python3", "-c", "import socket; s = socket.socket(); s.bind(('127.0.0.1', 8080)); "
                          "s.listen(); socket.create_connection(('127.0.0.1', 8080)); print('ok')"])
        assert r.stdout == "ok\n", r
    finally:
        await b.close()


async def test_missing_target_is_refused_and_leaves_nothing() -> None:
    before = {i.id for i in live.entries()}
    children = _children()
    with pytest.raises(NetError, match="no running sandbox nosuchbox"):
        await nsbox.Sandbox(network="container:nosuchbox").start()
    assert {i.id for i in live.entries()} == before
    assert _children() <= children


async def test_another_id_mapping_is_refused(mode: str) -> None:
    if mode == "single":
        pytest.skip("a single-uid user has only one id mapping")
    async with nsbox.Sandbox() as a:
        with pytest.raises(NetError, match="another id mapping"):
            await nsbox.Sandbox(network=f"container:{a.id}", id_mapping="single").start()


def test_spec_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="container:ID"):
        nsbox.SandboxSpec(network="container:")
    with pytest.raises(ValueError, match="publish them on that sandbox"):
        nsbox.SandboxSpec(network="container:abc", ports=("8080:80",))
    with pytest.raises(ValueError, match="host name"):
        nsbox.SandboxSpec(hosts={"bad name": "127.0.0.1"})
    with pytest.raises(ValueError):
        nsbox.SandboxSpec(hosts={"web": "not-an-address"})
    assert nsbox.SandboxSpec(hosts={"web": "127.0.0.1"}).hosts == {"web": "127.0.0.1"}


def test_hosts_names_cannot_carry_a_line_break() -> None:
    """Names from a compose file (services, aliases, extra_hosts) go into
    /etc/hosts: a trailing newline must not pass as part of a name."""
    from nsbox.net.hosts import check_name

    for bad in ("web\n", "web\n10.0.0.1 evil", "web\r"):
        with pytest.raises(ValueError, match="host name"):
            nsbox.SandboxSpec(hosts={bad: "127.0.0.1"})
        with pytest.raises(ValueError):
            check_name(bad)


async def test_joiner_gets_its_targets_network_settings() -> None:
    """A joiner of a proxy sandbox uses the same proxy; of a nat sandbox, the
    same DNS forwarder (and host.nsbox.internal, where it asks for the
    host's loopback, which only the target's nat can open)."""
    async with nsbox.Sandbox(network="proxy", allow=["example.com"]) as a:
        async with nsbox.Sandbox(network=f"container:{a.id}") as b:
            r = await b.exec(["sh", "-c", "echo $HTTP_PROXY"])
            assert r.stdout.strip() == "http://127.0.0.1:3128", r
    if not components.usable("tun", "usernet"):
        return  # nat needs /dev/net/tun (CI makes it usable; tests/test_net_usernet.py covers the refusal)
    async with nsbox.Sandbox(network="nat", host_loopback=True) as a:
        async with nsbox.Sandbox(network=f"container:{a.id}", host_loopback=True) as b:
            assert "10.0.2.3" in (await b.exec(["cat", "/etc/resolv.conf"])).stdout
            assert "host.nsbox.internal" in (await b.exec(["cat", "/etc/hosts"])).stdout
        async with nsbox.Sandbox(network=f"container:{a.id}") as b:
            assert "host.nsbox.internal" not in (await b.exec(["cat", "/etc/hosts"])).stdout


async def test_only_namespaces_of_a_sandbox_init_can_be_joined() -> None:
    """A user namespace that sandbox root made (nested_userns) shows the same
    id maps from the host as the init's, but joining it would put the new
    sandbox's init under that sandbox's root: refused."""
    async with nsbox.Sandbox(nested_userns=True) as a:
        r = await a.exec(["sh", "-c", "unshare -U -n --map-root-user sleep 60 >/dev/null 2>&1 & sleep 0.3; echo ok"])
        assert r.stdout == "ok\n", r
        nested = process_named(a.pid, "sleep")
        for pid, expected in ((a.pid, True), (nested.pid, False)):
            fds = [os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC) for ns in ("user", "net")]
            try:
                assert netmodes._sandbox_namespaces(*fds) is expected, pid
            finally:
                for fd in fds:
                    os.close(fd)
