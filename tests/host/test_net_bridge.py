"""Service networks: members talk by name, other networks and the host stay
out of reach, and nothing is left after close or after SIGKILL of the owner.

Members are stand-ins for sandboxes: `unshare -Urnm` processes started
inside the owner's user namespace (as sandboxes on a network will be), with
a bind-mounted /etc/hosts that the test writes from Network.hosts_for().
As root, real nsbox sandboxes are members too. All traffic stays inside the
namespaces the tests create, or goes to a server on the host's 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import AsyncIterator, Iterator

import anyio
import pytest

import nsbox
from nsbox.host import idmap
from nsbox.net.bridge import Network, OwnerUserns
from nsbox.net.client import Namespaces

from tests import components
from tests.net_members import CLIENT, SERVER, Member

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def owner() -> AsyncIterator[OwnerUserns]:
    o = await OwnerUserns.create(idmap.detect())
    yield o
    o.close()


@pytest.fixture
def members(owner: OwnerUserns) -> Iterator[dict[str, Member]]:
    # The members' root may be another host uid (root mode): their files
    # live where anyone can read them.
    with tempfile.TemporaryDirectory(prefix="nsbox-net-") as tmp:
        os.chmod(tmp, 0o755)
        made = {name: Member(owner, Path(tmp), name) for name in ("web", "client", "other")}
        yield made
        for m in made.values():
            m.close()


async def test_members_talk_by_name_and_other_networks_cannot(owner: OwnerUserns,
                                                              members: dict[str, Member]) -> None:
    front = await Network("front", internal=True).start(owner)
    # Same subnet on purpose: isolation must not depend on addresses differing.
    back = await Network("back", internal=True, subnet=front.subnet).start(owner)
    try:
        web, client, other = members["web"], members["client"], members["other"]
        await front.connect("web", web.ns, aliases=["www"])
        await front.connect("client", client.ns)
        member = await back.connect("other", other.ns)
        for name, net in (("web", front), ("client", front), ("other", back)):
            members[name].hosts.write_text(net.hosts_for(name))
        assert "www" in client.hosts.read_text()
        server = web.serve("hello from web")
        try:
            assert client.run(CLIENT, "web", "8000", "5") == "got hello from web"
            assert client.run(CLIENT, "www", "8000", "5") == "got hello from web"
            web_ip = front.members["web"].ip
            assert member.ip == web_ip or other.run(CLIENT, web_ip, "8000", "2").startswith("failed")
            # "other" has web's address on its own, separate bridge, or none at all.
            assert other.run(CLIENT, "web", "8000", "2").startswith("failed")  # no such name there
            for ip in {str(ip) for ip in list(front.subnet.hosts())[:4]} - {member.ip}:  # type: ignore[union-attr]
                assert other.run(CLIENT, ip, "8000", "1").startswith("failed"), ip
        finally:
            server.kill()
            server.wait()
    finally:
        await front.close()
        await back.close()


async def test_internal_members_cannot_reach_the_host(owner: OwnerUserns, members: dict[str, Member]) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    net = await Network("n", internal=True).start(owner)
    try:
        await net.connect("client", members["client"].ns)
        for target in ("127.0.0.1", "10.0.2.2", str(net.subnet.network_address + 1)):  # type: ignore[union-attr]
            assert members["client"].run(CLIENT, target, str(port), "1").startswith("failed"), target
    finally:
        await net.close()
        listener.close()


async def test_close_leaves_nothing(owner: OwnerUserns, members: dict[str, Member]) -> None:
    outbound = components.usable("tun", "usernet")
    net = await Network("n", internal=not outbound).start(owner)
    m = await net.connect("web", members["web"].ns, watch_pidfd=members["web"].pidfd)
    assert "eth0" in members["web"].links()
    if outbound:
        assert m.usernet is not None and Path(f"/proc/{m.usernet.pid}").exists()
    await net.close()
    await anyio.sleep(0.2)  # the kernel removes a namespace's interfaces asynchronously
    assert "eth0" not in members["web"].links()
    if outbound:
        assert m.usernet is not None and not Path(f"/proc/{m.usernet.pid}").exists()


@pytest.mark.needs("tun", "usernet")
@pytest.mark.parametrize("host_access", [True, False])
async def test_outbound_network_and_host_access(owner: OwnerUserns, members: dict[str, Member],
                                                host_access: bool) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    net = await Network("n", host_access=host_access).start(owner)
    try:
        web, client = members["web"], members["client"]
        await net.connect("web", web.ns)
        m = await net.connect("client", client.ns)
        assert m.usernet is not None
        for name in ("web", "client"):
            members[name].hosts.write_text(net.hosts_for(name))
        assert ("host.nsbox.internal" in client.hosts.read_text()) == host_access
        server = web.serve("hi")
        try:
            assert client.run(CLIENT, "web", "8000", "5") == "got hi"  # the bridge still works
        finally:
            server.kill()
            server.wait()
        accepted = []

        def accept() -> None:
            listener.settimeout(3)
            try:
                c, _ = listener.accept()
                c.sendall(b"host")
                c.close()
                accepted.append(True)
            except OSError:
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, accept)
            target = "host.nsbox.internal" if host_access else m.usernet.gateway
            out = await anyio.to_thread.run_sync(client.run, CLIENT, target, str(port), "2")
        if host_access:
            assert out == "got host" and accepted
        else:
            assert out.startswith("failed") and not accepted
    finally:
        await net.close()
        listener.close()


OWNER_SCRIPT = textwrap.dedent("""
    import anyio, os, subprocess, sys, time
    from nsbox.host import idmap
    from nsbox.net.bridge import Network, OwnerUserns
    from nsbox.net.client import Namespaces, helper
    async def main():
        owner = await OwnerUserns.create(idmap.detect())
        cred = ["--preserve-credentials"] if os.geteuid() else []
        p = subprocess.Popen(["nsenter", f"--user={owner.path}", *cred, "--",
                              "unshare", "-Urn", "sleep", "300"], start_new_session=True)
        while open(f"/proc/{p.pid}/comm").read().strip() != "sleep":
            time.sleep(0.01)
        net = await Network("n", internal=sys.argv[1] == "internal").start(owner)
        m = await net.connect("a", Namespaces.of_pid(p.pid, with_user=True))
        print(p.pid, helper().pid, m.usernet.pid if m.usernet else 0, flush=True)
        await anyio.sleep(300)
    anyio.run(main)
""")


@pytest.mark.needs("iproute2")
def test_sigkill_of_the_owner_leaves_nothing() -> None:
    kind = "outbound" if components.usable("tun", "usernet") else "internal"
    owner = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT, kind], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        member, helper_pid, pasta = map(int, owner.stdout.readline().split())
    except BaseException:
        owner.kill()
        raise
    try:
        links = lambda: subprocess.run(["nsenter", "--preserve-credentials", "-t", str(member), "-U", "-n",  # noqa: E731
                                        "ip", "-o", "link"], capture_output=True, text=True).stdout
        assert "eth0" in links()
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and ("eth0" in links() or Path(f"/proc/{helper_pid}").exists()
                                                or (pasta and Path(f"/proc/{pasta}").exists())):
            time.sleep(0.05)
        assert not Path(f"/proc/{helper_pid}").exists(), "the network helper outlived its owner"
        assert not pasta or not Path(f"/proc/{pasta}").exists(), "pasta outlived the owner"
        assert "eth0" not in links(), "the network's namespace outlived its owner"
    finally:
        os.kill(member, signal.SIGKILL)


@pytest.mark.skipif(os.geteuid() != 0, reason="real sandboxes join a network without an owner namespace only as root")
async def test_real_sandboxes_talk_by_name() -> None:
    net = await Network("svc", internal=True).start(None)
    try:
        async with nsbox.Sandbox() as web, nsbox.Sandbox() as client:
            for name, sb, aliases in (("web", web, ["db"]), ("client", client, [])):
                ns = Namespaces.of_pid(sb.pid)
                try:
                    await net.connect(name, ns, aliases=aliases)
                finally:
                    ns.close()
            for name, sb in (("web", web), ("client", client)):
                await sb.write_file("/etc/hosts", net.hosts_for(name))
            await web.exec(["sh", "-c", f"python3 -c '{SERVER}' web-in-a-sandbox >/dev/null 2>&1 &"])
            for _ in range(100):
                r = await client.exec(["python3", "-c", CLIENT, "db", "8000", "2"])
                if r.stdout.startswith("got"):
                    break
                await anyio.sleep(0.05)
            assert r.stdout.strip() == "got web-in-a-sandbox"
    finally:
        await net.close()
