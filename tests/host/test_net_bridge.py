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
from nsbox.net import usernet
from nsbox.net.bridge import Network, OwnerUserns
from nsbox.net.client import Namespaces, helper
from nsbox.net.usernet import UserNet

from tests import components
from tests.net_members import CLIENT, SERVER, Member, comm, gone


def children_of(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir()
            for c in (t / "children").read_text().split()]

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
    program = None
    if outbound:
        assert m.usernet is not None
        members["web"].run(UDP_ONCE, m.usernet.dns, "53", "0")  # a packet out: pasta starts, if on demand
        program = await running_program(m.usernet)
    await net.close()
    await anyio.sleep(0.2)  # the kernel removes a namespace's interfaces asynchronously
    assert "eth0" not in members["web"].links()
    assert gone(program), "the member's user-mode networking outlived the network"


# One datagram, sent once: nothing would send it again if it were lost.
UDP_ONCE = textwrap.dedent("""
    import socket, sys
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.sendto(b"ping", (sys.argv[1], int(sys.argv[2])))
    s.settimeout(float(sys.argv[3]) or None)
    try:
        print("got", s.recv(100).decode()) if float(sys.argv[3]) else None
    except OSError as e:
        print("failed", type(e).__name__)
""")
# The namespace's count of retransmitted TCP segments (RetransSegs).
RETRANSMITS = "print(open('/proc/net/snmp').read().split('Tcp:')[2].split()[11])"


async def udp_round_trip(member: Member, udp: socket.socket) -> str:
    """UDP_ONCE from `member` to `udp` (a socket on the host's 127.0.0.1,
    through the gateway), which answers "back " + what came; the member's
    output."""

    def echo() -> None:
        data, peer = udp.recvfrom(100)
        udp.sendto(b"back " + data, peer)

    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, echo)
        return await anyio.to_thread.run_sync(member.run, UDP_ONCE, usernet.GATEWAY, str(udp.getsockname()[1]), "10")


async def running_program(un: UserNet, within: float = 10.0) -> int:
    """The pid of the member's user-mode networking program, once it runs."""
    deadline = time.monotonic() + within
    while not (pid := await un.program_pid()):
        assert pid == 0 and time.monotonic() < deadline, f"no program started (pid {pid})"
        await anyio.sleep(0.02)
    return pid


@pytest.mark.needs("tun", "pasta")
async def test_pasta_starts_on_the_first_packet_out_and_loses_none(owner: OwnerUserns,
                                                                   members: dict[str, Member]) -> None:
    """A member's pasta stands by until the member sends a packet out. The
    packets that woke it still arrive: a lone UDP datagram (sent once) is
    answered, and a first TCP connection needs no retransmission."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(10)
    tcp = socket.create_server(("127.0.0.1", 0))
    tcp.settimeout(10)
    net = await Network("n", host_access=True).start(owner)
    try:
        client, web = members["client"], members["web"]
        by_udp = await net.connect("client", client.ns, watch_pidfd=client.pidfd, tool="pasta")
        by_tcp = await net.connect("web", web.ns, watch_pidfd=web.pidfd, tool="pasta")
        assert by_udp.usernet is not None and by_tcp.usernet is not None
        assert await by_udp.usernet.program_pid() == 0 and await by_tcp.usernet.program_pid() == 0
        assert not [p for p in children_of(helper().pid) if comm(p).startswith("pas")], "pasta ran before any packet"

        assert await udp_round_trip(client, udp) == "got back ping"
        pasta = await running_program(by_udp.usernet)
        assert comm(pasta).startswith("pas") and await by_tcp.usernet.program_pid() == 0  # one member's only

        def accept() -> None:
            c, _ = tcp.accept()
            c.sendall(b"host")
            c.close()

        before = web.run(RETRANSMITS)
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, accept)
            out = await anyio.to_thread.run_sync(web.run, CLIENT, usernet.GATEWAY, str(tcp.getsockname()[1]), "10")
        assert out == "got host"
        assert web.run(RETRANSMITS) == before, "the first SYN was lost and sent again"
        await running_program(by_tcp.usernet)
    finally:
        await net.close()
        udp.close()
        tcp.close()


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


FLOOD = textwrap.dedent("""
    import socket, sys
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for i in range(int(sys.argv[3])):
        try:
            s.sendto(bytes(1400), (sys.argv[1], int(sys.argv[2])))
        except OSError:
            pass  # a full queue: the flood goes on
""")


def holds(pid: int, target: str) -> bool:
    """Whether process `pid` holds a descriptor of `target` (e.g. net:[N])."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return True
        except OSError:
            continue  # closed since listed
    return False


@pytest.mark.needs("tun", "pasta")
async def test_standing_by_leaves_nothing_and_survives_a_flood(owner: OwnerUserns,
                                                                members: dict[str, Member]) -> None:
    """The helper lets go of a standing-by member's namespaces (and tap)
    when the member's sandbox ends, when its pasta starts and when the
    network closes; a member that floods its tap before pasta runs wakes it
    once, and its later packets still go out."""
    net = await Network("n", host_access=True).start(owner)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    try:
        web, client = members["web"], members["client"]
        web_net, client_net = (os.readlink(f"/proc/{m.proc.pid}/ns/net") for m in (web, client))
        by_client = (await net.connect("client", client.ns, watch_pidfd=client.pidfd, tool="pasta")).usernet
        m = await net.connect("web", web.ns, watch_pidfd=web.pidfd, tool="pasta")
        assert m.usernet is not None and await m.usernet.program_pid() == 0
        assert holds(helper().pid, web_net) and holds(helper().pid, client_net)  # for pasta, later
        web.proc.kill()  # the sandbox ends while its pasta stands by
        web.proc.wait()
        deadline = time.monotonic() + 10
        while holds(helper().pid, web_net):
            assert time.monotonic() < deadline, "the helper kept a gone member's namespace"
            await anyio.sleep(0.05)
        assert await m.usernet.program_pid() is None

        assert by_client is not None
        port = str(udp.getsockname()[1])
        client.run(FLOOD, usernet.GATEWAY, port, "5000")
        pasta = await running_program(by_client)
        assert not holds(helper().pid, client_net)  # pasta has it now
        while True:  # what the flood brought (pasta passes on what reached it)
            try:
                udp.settimeout(0.5)
                udp.recvfrom(2000)
            except TimeoutError:
                break
        udp.settimeout(10)

        assert await udp_round_trip(client, udp) == "got back ping" and await by_client.program_pid() == pasta
    finally:
        await net.close()
        udp.close()


@pytest.mark.needs("tun", "pasta")
async def test_closing_the_network_lets_go_of_standing_members(owner: OwnerUserns,
                                                               members: dict[str, Member]) -> None:
    net = await Network("n").start(owner)
    web = members["web"]
    web_net = os.readlink(f"/proc/{web.proc.pid}/ns/net")
    try:
        await net.connect("web", web.ns, tool="pasta")  # no pidfd: only the close ends its standby
        assert holds(helper().pid, web_net)
    finally:
        await net.close()
    assert not holds(helper().pid, web_net), "the helper kept a member of a closed network"


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
        pasta = 0
        if m.usernet:  # a packet out, so that pasta runs (it starts on demand)
            send = "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'', ('10.0.2.3', 53))"
            subprocess.run(["nsenter", "--preserve-credentials", "-t", str(p.pid), "-U", "-n", sys.executable,
                            "-c", send], check=True, timeout=30)
            while not (pasta := await m.usernet.program_pid()):
                await anyio.sleep(0.02)
        print(p.pid, helper().pid, pasta, flush=True)
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
        assert pasta or kind == "internal", "no user-mode networking ran"
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


RTNL_SCRIPT = textwrap.dedent("""
    import os, socket, subprocess, sys
    sys.path.insert(0, sys.argv[1])
    import bridge_worker as bw, nscalls
    nscalls.unshare(nscalls.CLONE_NEWUSER | nscalls.CLONE_NEWNET, "user and network namespaces")
    rtnl = bw.Rtnl()
    rtnl.link(bw.RTM_NEWLINK, index=1, up=True)
    rtnl.link(bw.RTM_NEWLINK, ifname="br9", kind="bridge", up=True, create=True)
    here = os.open("/proc/self/ns/net", os.O_RDONLY)
    rtnl.link(bw.RTM_NEWLINK, ifname="veth9", kind="veth", master=socket.if_nametoindex("br9"), up=True,
              create=True, peer=[("IFLA_IFNAME", "peer9"), ("IFLA_NET_NS_FD", here)])
    print(subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.replace(chr(10), "|"))
    for what, ask in [("again", lambda: rtnl.link(bw.RTM_NEWLINK, ifname="br9", kind="bridge", create=True)),
                      ("del", lambda: rtnl.link(bw.RTM_DELLINK, ifname="veth9")),
                      ("del again", lambda: rtnl.link(bw.RTM_DELLINK, ifname="veth9"))]:
        try:
            ask()
            print(what, "ok")
        except OSError as e:
            print(what, e.errno, e.strerror)
    print("left", sorted(name for _, name in socket.if_nameindex()))
""")


@pytest.mark.needs("iproute2")
def test_link_requests_make_the_links_and_report_the_kernels_refusal() -> None:
    """The bridge worker's netlink requests (bridge_worker.Rtnl), in a user
    and network namespace of their own: the bridge and a veth pair on it
    are made, up, and a refused request raises the kernel's errno instead of
    passing silently."""
    import errno

    out = subprocess.run([sys.executable, "-c", RTNL_SCRIPT, str(Path(nsbox.__file__).parent / "net")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    links, *answers = out.stdout.splitlines()
    veth = next(line for line in links.split("|") if "veth9@peer9" in line)
    assert "master br9" in veth and ",UP" in veth, links
    assert any("br9:" in line and ",UP" in line for line in links.split("|")), links
    assert any(line.startswith("1: lo:") and ",UP" in line for line in links.split("|")), links
    assert answers == [f"again {errno.EEXIST} netlink: {os.strerror(errno.EEXIST)}", "del ok",
                       f"del again {errno.ENODEV} netlink: {os.strerror(errno.ENODEV)}", "left ['br9', 'lo']"]
