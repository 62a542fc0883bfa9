"""The network modes of real sandboxes, end to end: none cannot reach the
host's loopback; nat reaches it as host.nsbox.internal (or refuses to
start, in one line naming the fix, when /dev/net/tun is not usable); proxy
lets an allowlisted name through and refuses another; a published port is
reachable from the host's 127.0.0.1; nothing is left after close or after
SIGKILL of the owner.

CI network rule: every server binds to 127.0.0.1 (the host's, or the
sandbox's own); nothing is sent to any other address. The proxy's names
map to 127.0.0.1 through its trusted hosts table (NSBOX_PROXY_HOSTS)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest

import nsbox
from nsbox import manage
from nsbox.plan import netmodes
from nsbox.net import usernet
from nsbox.net.client import NetError

from tests.conftest import script_result
from tests.net_members import CLIENT, gone, host_server, http_server, tun_usable  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(90)
needs_tun = pytest.mark.needs("tun", "usernet")

FETCH = textwrap.dedent("""
    import sys, urllib.request, urllib.error
    try:
        print("got", urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())
    except urllib.error.HTTPError as e:
        print("refused", e.code, e.read().decode().strip())
    except OSError as e:
        print("failed", e)
""")
SERVE_INSIDE = textwrap.dedent("""
    import socket
    s = socket.create_server(("127.0.0.1", 8000))
    open("/tmp/listening", "w").close()
    while True:
        c, _ = s.accept(); c.sendall(b"inside"); c.close()
""")


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return False
    except ConnectionRefusedError:
        return True


# ---- the spec ---------------------------------------------------------------

def test_spec_checks_network_settings() -> None:
    spec = nsbox.SandboxSpec(network="proxy", allow=["example.com", "*.example.org:443"], ports=["8080:80"])
    assert spec.allow == ("example.com", "*.example.org:443") and spec.ports == ("127.0.0.1:8080:80",)
    assert nsbox.SandboxSpec(network="nat", ports=("0.0.0.0:1:2",)).ports == ("0.0.0.0:1:2",)
    with pytest.raises(ValueError, match="proxy network mode"):
        nsbox.SandboxSpec(network="nat", allow=("example.com",))
    with pytest.raises(ValueError, match="not a host name"):
        nsbox.SandboxSpec(network="proxy", allow=("exa mple.com",))
    with pytest.raises(ValueError, match="network 'host'"):
        nsbox.SandboxSpec(network="host", ports=("8080:80",))
    with pytest.raises(ValueError, match="HOSTPORT:PORT"):
        nsbox.SandboxSpec(ports=("80",))
    with pytest.raises(ValueError, match="network must be one of"):
        nsbox.SandboxSpec(network="bridge")  # type: ignore[arg-type]


def test_cli_and_inspect_settings_pass_them_on() -> None:
    from nsbox.cli.main import make_sandbox

    sb = make_sandbox(rootfs="host", image=None, pull="missing", platform=None, user=None, workdir=None, env=(),
                      volumes=(), network="proxy", id_mapping="auto", nested_userns=False,
                      publish=("9000:80",), allow=("example.com",))
    assert sb.spec.ports == ("127.0.0.1:9000:80",) and sb.spec.allow == ("example.com",)
    inspect = pytest.importorskip("nsbox.inspect.provider")
    settings = inspect.SandboxSettings(network="nat", ports=("8000:80",))
    assert settings.network == "nat" and settings.ports == ("8000:80",)


# ---- none ---------------------------------------------------------------------

async def test_none_cannot_reach_the_hosts_loopback(host_server: int) -> None:
    async with nsbox.Sandbox(network="none") as sb:
        for address in ("127.0.0.1", usernet.GATEWAY):
            r = await sb.exec(["python3", "-c", CLIENT, address, str(host_server), "2"])
            assert r.stdout.startswith("failed"), (address, r)
        hosts = await sb.read_file("/etc/hosts")
        assert "host.nsbox.internal" not in hosts


# ---- nat ----------------------------------------------------------------------

@needs_tun
async def test_nat_reaches_the_hosts_loopback_by_name_when_asked(host_server: int) -> None:
    async with nsbox.Sandbox(network="nat", host_loopback=True) as sb:
        r = await sb.exec(["python3", "-c", CLIENT, "host.nsbox.internal", str(host_server), "5"])
        assert r.stdout.strip() == "got host", r
        # The sandbox's own loopback is still its own.
        r = await sb.exec(["python3", "-c", CLIENT, "127.0.0.1", str(host_server), "2"])
        assert r.stdout.startswith("failed"), r
        assert f"nameserver {usernet.DNS}" in str(await sb.read_file("/etc/resolv.conf"))
        attached = sb._network.attached if sb._network else None
        pid = attached.usernet_pid if attached else None
        assert pid is not None and Path(f"/proc/{pid}").exists()
    assert gone(pid), "pasta/slirp4netns outlived the sandbox"


@needs_tun
async def test_nat_keeps_the_hosts_loopback_closed_by_default(host_server: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without host_loopback nothing of the host's 127.0.0.1 answers at the
    gateway (tried with slirp4netns, which refuses it locally: pasta would
    pass 10.0.2.2 on to the real network; its --no-map-gw is checked in
    test_net_usernet.py)."""
    monkeypatch.setenv("NSBOX_USERNET_TOOL", "slirp4netns")
    async with nsbox.Sandbox(network="nat") as sb:
        assert "host.nsbox.internal" not in str(await sb.read_file("/etc/hosts"))
        r = await sb.exec(["python3", "-c", CLIENT, usernet.GATEWAY, str(host_server), "2"])
        assert r.stdout.startswith("failed"), r
    with pytest.raises(ValueError, match="host_loopback applies to the nat network mode"):
        nsbox.SandboxSpec(network="none", host_loopback=True)


@needs_tun
async def test_nat_with_a_directory_root(debian_rootfs: Path, host_server: int) -> None:
    """/etc/hosts and /etc/resolv.conf are written through the init (bash's /dev/tcp resolves the name)."""
    async with nsbox.Sandbox(debian_rootfs, network="nat", hosts={"host.nsbox.internal": "host-gateway"}) as sb:
        r = await sb.exec(["bash", "-c", f"exec 3<>/dev/tcp/host.nsbox.internal/{host_server}; cat <&3"])
        assert r.stdout == "host", r
        assert f"nameserver {usernet.DNS}" in str(await sb.read_file("/etc/resolv.conf"))


async def test_nat_refuses_an_unusable_tun_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if os.geteuid() == 0:
            # Root opens any device node: a missing one stands in (the mode
            # 0600 refusal is tested as the unprivileged users).
            monkeypatch.setattr(usernet, "TUN_DEVICE", os.path.join(tmp, "no-tun"))
            fix = "modprobe tun"
        else:
            fake = Path(tmp) / "tun"  # a node this user cannot open, as /dev/net/tun at 0600
            fake.write_bytes(b"")
            fake.chmod(0o600 if os.stat(tmp).st_uid != os.getuid() else 0)
            monkeypatch.setattr(usernet, "TUN_DEVICE", str(fake))
            fix = "chmod 0666"
        before = set(os.listdir(nsbox.host.dirs.runtime_dir()))
        sb = nsbox.Sandbox(network="nat")
        with pytest.raises(NetError) as info:
            await sb.start()
    text = str(info.value)
    assert fix in text and "proxy" in text and "\n" not in text, text
    assert sb.pid == 0 and set(os.listdir(nsbox.host.dirs.runtime_dir())) == before


async def test_nat_refusal_with_the_real_tun_at_0600() -> None:
    if tun_usable():
        pytest.skip("/dev/net/tun is usable here")
    with pytest.raises(NetError, match=r"needs /dev/net/tun.*mode 0600.*chmod 0666"):
        await nsbox.Sandbox(network="nat").start()


# ---- proxy ----------------------------------------------------------------------

async def test_proxy_allows_an_allowlisted_name_and_refuses_another(
        http_server: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(netmodes.PROXY_HOSTS_ENV, "allowed.test=127.0.0.1,denied.test=127.0.0.1")
    async with nsbox.Sandbox(network="proxy", allow=["allowed.test"]) as sb:
        r = await sb.exec(["python3", "-c", FETCH, f"http://allowed.test:{http_server}/"])
        assert r.stdout.strip() == "got hello from allowed.test", r
        r = await sb.exec(["python3", "-c", FETCH, f"http://denied.test:{http_server}/"])
        assert r.stdout.startswith("refused 403") and "not allowed" in r.stdout and "--allow" in r.stdout, r
        # Around the proxy there is no way out: the host's loopback is not the sandbox's.
        r = await sb.exec(["python3", "-c", CLIENT, "127.0.0.1", str(http_server), "2"])
        assert r.stdout.startswith("failed"), r
        # CONNECT (what https uses) goes through the same allowlist.
        r = await sb.exec(["python3", "-c", textwrap.dedent(f"""
            import socket
            for name in ("allowed.test", "denied.test"):
                c = socket.create_connection(("127.0.0.1", 3128), timeout=5)
                c.sendall(b"CONNECT " + name.encode() + b":{http_server} HTTP/1.1\\r\\n\\r\\n")
                print(name, c.recv(100).split(b"\\r\\n")[0].decode())
        """)])
        assert r.stdout.splitlines() == ["allowed.test HTTP/1.1 200 Connection established",
                                         "denied.test HTTP/1.1 403 Forbidden"], r


async def test_proxy_needs_no_tun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(usernet, "TUN_DEVICE", "/nonexistent/tun")
    async with nsbox.Sandbox(network="proxy") as sb:
        r = await sb.exec(["sh", "-c", "echo $HTTPS_PROXY"])
        assert r.stdout.strip() == "http://127.0.0.1:3128"


# ---- published ports ------------------------------------------------------------

MODES = ["none", "proxy", pytest.param("nat", marks=needs_tun)]


@pytest.mark.parametrize("network", MODES)
async def test_a_published_port_is_reachable_from_the_host(network: str) -> None:
    async with nsbox.Sandbox(network=network, ports=["0:8000"]) as sb:  # type: ignore[arg-type]
        (port,) = sb.host_ports
        await sb.spawn(["python3", "-c", SERVE_INSIDE])
        with anyio.fail_after(10):
            while (await sb.exec(["test", "-e", "/tmp/listening"])).returncode:
                await anyio.sleep(0.02)

        def fetch() -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                return c.recv(100)

        assert await anyio.to_thread.run_sync(fetch) == b"inside"
        # Bound to the host's 127.0.0.1 only, by default.
        assert sb.spec.ports == ("127.0.0.1:0:8000",)
    assert _refused(port), "the published port outlived the sandbox"


async def test_a_taken_host_port_fails_creation() -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(nsbox.NsboxError, match="cannot publish port"):
            await nsbox.Sandbox(ports=[f"{taken.getsockname()[1]}:80"]).start()
    finally:
        taken.close()


# ---- lifetimes -------------------------------------------------------------------

OWNER = textwrap.dedent("""
    import anyio, json, os, sys, time, nsbox
    from nsbox.plan import netmodes

    async def main():
        network, fork = sys.argv[1], sys.argv[2] == "fork"
        sbs = [await nsbox.Sandbox(network=network, ports=["0:8000"]).start(),
               await nsbox.Sandbox(network="proxy", allow=["example.com"]).start()]
        child = os.fork() if fork else 0  # (a multiprocessing worker, say)
        if fork and child == 0:
            time.sleep(600)
            os._exit(0)
        print(json.dumps({"inits": [sb.pid for sb in sbs], "helper": netmodes.runner().helper.pid,
                          "usernet": sbs[0]._network.attached.usernet_pid, "port": sbs[0].host_ports[0],
                          "child": child}), flush=True)
        await anyio.sleep(600)

    anyio.run(main)
""")


@pytest.mark.parametrize("network", ["proxy", pytest.param("nat", marks=needs_tun)])
@pytest.mark.parametrize("children", ["none", "fork"])
def test_nothing_is_left_after_sigkill_of_the_owner(network: str, children: str) -> None:
    """Killed, the owner takes down its sandboxes, its network helper,
    pasta and its published ports; also while a child it forked without
    exec lives on (its copies of the helper's channel and of the ports'
    listeners had kept both)."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, network, children], stdout=subprocess.PIPE)
    state: dict[str, Any] = {}
    try:
        assert owner.stdout is not None
        state = json.loads(owner.stdout.readline())
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert state["helper"] and state["port"]
        for pid in [*state["inits"], state["helper"], state["usernet"]]:
            assert gone(pid), f"process {pid} outlived its owner"
        assert _refused(state["port"])
        if children == "fork":
            assert not gone(state["child"], 0)
    finally:
        owner.kill()
        owner.wait()
        if state.get("child"):
            os.kill(state["child"], signal.SIGKILL)


def test_descriptors_nsbox_holds_are_close_on_exec() -> None:
    """What this process holds for a sandbox (its init's pidfd, the proxy's
    socket inside it, a file read from it) is close-on-exec: a program it
    runs (os.system, close_fds=False) inherits none of them
    (socket.recv_fds drops the flag it is given)."""
    code = textwrap.dedent("""
        import anyio, fcntl, json, os, nsbox

        def inheritable():
            found = set()
            for fd in os.listdir("/proc/self/fd"):
                try:
                    if not fcntl.fcntl(int(fd), fcntl.F_GETFD) & fcntl.FD_CLOEXEC:
                        found.add(os.readlink(f"/proc/self/fd/{fd}"))
                except OSError:
                    pass
            return found

        async def main():
            before = inheritable()
            async with nsbox.Sandbox(network="proxy", allow=["example.com"], ports=["0:8000"]) as sb:
                await sb.read_file("/etc/hostname")
                assert (await sb.exec(["true"])).success
                print("RESULT " + json.dumps(sorted(inheritable() - before)))

        anyio.run(main)
    """)
    assert script_result(code, timeout=60) == []


async def test_close_stops_what_the_process_serves() -> None:
    sb = await nsbox.Sandbox(network="proxy", ports=["0:8000"]).start()
    (port,) = sb.host_ports
    assert not _refused(port)
    await sb.close()
    assert _refused(port)
    # The network thread has nothing left of it.
    assert sb._network is not None and sb._network.attached is None


def test_a_detached_sandbox_warns_once(capsys: pytest.CaptureFixture[str]) -> None:
    netmodes._warned = False
    netmodes.warn_detached(nsbox.SandboxSpec(network="nat", ports=("1:2",)))
    netmodes.warn_detached(nsbox.SandboxSpec(network="proxy"))
    netmodes.warn_detached(nsbox.SandboxSpec(network="none"))
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "nat networking and published ports end when this process exits" in err


async def test_detaching_a_member_of_this_processs_network_warns(capsys: pytest.CaptureFixture[str]) -> None:
    """A service network this process made ends with it: a sandbox on it,
    detached, keeps running without it, and says so (a named network
    outlives the process, and a sandbox on one only is not warned about)."""
    netmodes._warned = False
    async with nsbox.Network("kept", internal=True) as net:
        sb = await nsbox.Sandbox(network=net).start()
        try:
            info = await sb.detach()
        except BaseException:
            await sb.close()
            raise
        manage.remove(info, force=True)
    assert "warning: the sandbox is detached, but its network kept end when this process exits" \
        in capsys.readouterr().err


ICMP_ECHO = """
import socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
s.settimeout(5)
s.sendto(struct.pack("!BBHHH", 8, 0, 0, 1, 1) + b"nsbox", ("127.0.0.1", 0))
print("type", s.recvfrom(1024)[0][0])
"""


async def test_every_user_may_ping_as_in_docker(mode: str) -> None:
    """Sandbox root holds no CAP_NET_RAW over its network namespace (it is
    nsbox's): ping works as Docker makes it work for every user, with ICMP
    echo sockets (net.ipv4.ping_group_range). It had failed for root too."""
    async with nsbox.Sandbox(network="none") as sb:
        for user in ("root", "nobody") if mode != "single" else ("root",):
            r = await sb.exec(["python3", "-c", ICMP_ECHO], user=user)
            assert r.stdout == "type 0\n", (user, r)  # an echo reply


HOST_ADDRESS = """\
set -e
ip link add v0 type veth peer name v1
ip addr add 10.5.5.5/24 dev v0
ip link set v0 up
{python} -c 'from nsbox.net.hosts import host_address; print(host_address())'
ip addr flush dev v0
ip addr add 169.254.3.3/16 dev v0
{python} -c 'from nsbox.net.hosts import host_address; print(host_address())'
"""


@pytest.mark.once  # a network namespace of the test's own: no sandbox
@pytest.mark.needs("iproute2")
def test_host_gateway_address_without_a_route_out() -> None:
    """A compose file's host-gateway is the host's own address: found on an
    interface where no route leads out (the UDP probe finds none), and
    none where the host has only loopback and link-local addresses."""
    r = subprocess.run(["unshare", "-rn", "sh", "-c", HOST_ADDRESS.format(python=sys.executable)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["10.5.5.5", "None"]
