"""Service networks (nsbox.Network, nsbox/network.py) with real sandboxes:
members talk by name on their own addresses, /etc/hosts follows joins and
leaves, another network's member cannot reach them, an internal network
has no way out, and nothing is left after close or after the owner is
SIGKILLed. Traffic stays between the tests' own namespaces (and, for the
nat case, the host's 127.0.0.1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import anyio
import psutil
import pytest

import nsbox
from nsbox.net.client import NetError

from tests import components
from tests.net_members import http_server  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(90)

SERVE = ("import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
         "s.bind(('0.0.0.0', 7000)); s.listen()\n"
         "while True:\n c, _ = s.accept(); c.send(socket.gethostname().encode()); c.close()")


def fetch(name: str) -> list[str]:
    return ["python3", "-c", f"import socket; print(socket.create_connection(('{name}', 7000), timeout=3).recv(100).decode())"]


async def serve(sb: nsbox.Sandbox) -> None:
    await sb.exec(["sh", "-c", f"python3 -c \"{SERVE}\" >/dev/null 2>&1 &"])
    r = await sb.exec(["python3", "-c", "import socket, time\nfor _ in range(100):\n"
                       " try: socket.create_connection(('127.0.0.1', 7000)); break\n"
                       " except OSError: time.sleep(0.05)"])
    assert r.success, r


async def test_members_talk_by_name_and_others_cannot_reach_them() -> None:
    async with nsbox.Network("backend", internal=True) as net, nsbox.Network("other", internal=True) as other:
        async with nsbox.Sandbox(network=net, hostname="db", network_aliases=["postgres"]) as db:
            await serve(db)
            async with nsbox.Sandbox(network=net, hostname="web") as web, \
                    nsbox.Sandbox(network=other, hostname="stranger") as stranger:
                r = await web.exec(fetch("db"))
                assert r.stdout == "db\n", r
                r = await web.exec(fetch("postgres"))  # by its alias
                assert r.stdout == "db\n", r
                r = await db.exec(fetch("postgres"))  # a member reaches itself by its alias too, as in Docker
                assert r.stdout == "db\n", r
                # Own addresses on the private subnet, not the loopback.
                ip = net.address_of("db")
                assert ip.startswith("10.89.") and ip != net.address_of("web")
                assert f"{ip}\tdb" in (await web.exec(["cat", "/etc/hosts"])).stdout
                assert "web" in (await db.exec(["cat", "/etc/hosts"])).stdout
                # Another network's member knows neither name nor route.
                r = await stranger.exec(fetch("db"))
                assert not r.success and ("Name or service not known" in r.stderr or "resolution" in r.stderr), r
                r = await stranger.exec(fetch(ip))
                assert not r.success, r
                # Internal: no way out (no route beyond the subnet).
                r = await web.exec(["python3", "-c", "import socket; socket.create_connection(('10.0.2.2', 80), timeout=2)"])
                assert not r.success and "unreachable" in r.stderr.lower(), r
            # web left: db's /etc/hosts no longer names it.
            assert "web" not in (await db.exec(["cat", "/etc/hosts"])).stdout


async def test_outbound_network_reaches_the_host_loopback_as_nat_does(http_server: int) -> None:
    components.require("tun", "usernet")  # the refusal is tested in test_net_usernet.py
    async with nsbox.Network("out", host_access=True) as net:
        async with nsbox.Sandbox(network=net, hostname="a") as a:
            url = f"http://host.nsbox.internal:{http_server}/"
            r = await a.exec(["python3", "-c", f"import urllib.request as u; print(u.urlopen('{url}', timeout=5).status)"])
            assert r.stdout == "200\n", r


async def test_a_member_is_rewritten_only_when_its_view_changes() -> None:
    stat = ["stat", "-c", "%y %i", "/etc/hosts"]
    async with nsbox.Network("quiet", internal=True) as net:
        async with nsbox.Sandbox(network=net, hostname="a") as a, nsbox.Sandbox(network=net, hostname="b"):
            before = (await a.exec(stat)).stdout
            assert before and "b" in (await a.exec(["cat", "/etc/hosts"])).stdout.split()
            await anyio.sleep(0.05)
            await net.settle("b")  # b announces itself again: a's view is the same
            assert (await a.exec(stat)).stdout == before
            async with nsbox.Sandbox(network=net, hostname="c"):
                assert (await a.exec(stat)).stdout != before
                assert "c" in (await a.exec(["cat", "/etc/hosts"])).stdout.split()


async def test_members_closed_together_leave_in_one_request() -> None:
    async with nsbox.Network("together", internal=True) as net:
        boxes = [await nsbox.Sandbox.create(network=net, hostname=f"m{i}") for i in range(3)]
        gone = net.release()
        assert sorted(name for name, _ in gone) == ["m0", "m1", "m2"] and not net.members
        await net.forget(gone)
        assert net.describe()["members"] == {}  # the worker's table, as its one answer left it
        async with anyio.create_task_group() as tg:
            for box in boxes:
                tg.start_soon(box.close)
        assert net.idle()  # emptied, as good as new
        async with nsbox.Sandbox(network=net, hostname="m0") as again:  # the name is free again
            assert "m1" not in (await again.exec(["cat", "/etc/hosts"])).stdout.split()


async def test_emptied_networks_serve_later_samples_up_to_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Networks a sample gives back idle are taken again, as they are, by the
    next samples; past the pool's limit, and with members left, they close."""
    from nsbox.compose.services import _Spares

    spares = _Spares()
    monkeypatch.setattr(spares, "LIMIT", 2)
    nets = [await spares.take(True, False, "auto") for _ in range(3)]
    assert len({id(n) for n in nets}) == 3
    kept = await nsbox.Sandbox.create(network=nets[2], hostname="kept")
    try:
        for net in [nets[2], *nets[:2]]:
            await spares.give(net)
        assert spares.nets == nets[:2]
        assert not nets[2]._net.running(), "a network with a member left was kept"
        again = [await spares.take(True, False, "auto") for _ in range(2)]
        assert {id(n) for n in again} == {id(n) for n in nets[:2]} and not spares.nets
        other = await spares.take(False, False, "auto")  # another kind: never one of those
        assert all(other is not n for n in nets)
        for net in [*again, other]:
            await spares.give(net)
        assert len(spares.nets) == 2 and not other._net.running()
    finally:
        await kept.close()
        for net in [*nets, *spares.nets]:
            await net.close()


async def test_spec_and_lookup_errors() -> None:
    with pytest.raises(ValueError, match="network_aliases apply to a service network"):
        nsbox.SandboxSpec(network="nat", network_aliases=("x",))
    with pytest.raises(ValueError, match="cannot be a host name"):
        nsbox.SandboxSpec(network="net:x", network_aliases=("a b",))
    with pytest.raises(ValueError, match="net:NAME"):
        nsbox.SandboxSpec(network="net:bad name")
    with pytest.raises(NetError, match="no such network"):
        await nsbox.Sandbox(network="net:nowhere").start()
    with pytest.raises(ValueError, match="network name"):
        nsbox.Network("a b")
    async with nsbox.Network("twice"):
        with pytest.raises(NetError, match="exists already"):
            await nsbox.Network("twice").start()


OWNER = textwrap.dedent("""
    import anyio, json, os, sys, nsbox
    async def main():
        net = await nsbox.Network("doomed", internal=False if sys.argv[1] == "nat" else True).start()
        boxes = [await nsbox.Sandbox.create(network=net, hostname=f"m{i}") for i in range(2)]
        if sys.argv[1] == "nat":  # a packet out: the member's pasta starts on demand
            await boxes[0].exec(["python3", "-c", "import socket; "
                                 "socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'', ('10.0.2.3', 53))"])
        print(json.dumps({"inits": [b.pid for b in boxes]}), flush=True)
        await anyio.sleep(600)
    anyio.run(main)
""")


def running_name(pid: int) -> str | None:
    """The name of `pid` if it runs (not a zombie); None if it is gone,
    which it may be by the time we ask (pasta forks and its parent exits)."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.name()
    except psutil.NoSuchProcess:
        return None


@pytest.mark.parametrize("kind", ["internal", "nat"])
def test_nothing_is_left_after_the_owner_is_killed(kind: str) -> None:
    if kind == "nat":
        components.require("tun", "usernet")
    proc = subprocess.Popen([sys.executable, "-c", OWNER, kind], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, "the owner did not start its network"
        inits = json.loads(line)["inits"]
        deadline = time.monotonic() + 10
        while True:  # until the member's user-mode networking runs (started on its packet out)
            descendants = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
            names = [running_name(p) or "" for p in descendants]
            outbound = any(name.startswith(("pasta", "passt", "slirp4netns")) for name in names)
            if kind != "nat" or outbound or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert "nsbox-bridge" in names, names
        assert outbound == (kind == "nat"), names
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(running_name(p) for p in descendants):
        time.sleep(0.05)
    left = [(p, name) for p in descendants if (name := running_name(p))]
    assert left == [], f"still running after the owner died: {left}"
    assert not any(running_name(p) for p in inits)


async def test_nsbox_yaml_sandboxes_share_a_network_per_sample(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """nsbox.yaml: sandboxes naming `network: net:NAME` get a service
    network per sample, by their names in the file; samples do not share it."""
    from nsbox.inspect.provider import NsboxSandboxEnvironment as Env

    config = tmp_path / "nsbox.yaml"
    config.write_text("sandboxes:\n  default: {network: 'net:lan'}\n"
                      "  db: {network: 'net:lan', network_aliases: [postgres]}\n"
                      "networks:\n  lan: {internal: true}\n")
    await Env.task_init("nets", str(config))  # its startup check had asked for a host network named lan
    one = await Env.sample_init("nets", str(config), {"__sample_id__": "1"})
    two = await Env.sample_init("nets", str(config), {"__sample_id__": "2"})
    try:
        db1 = one["db"].as_type(Env).sandbox
        await serve(db1)
        r = await one["default"].exec(fetch("db"))
        assert r.stdout == "db\n", r
        r = await one["default"].exec(fetch("postgres"))
        assert r.stdout == "db\n", r
        nets = {n.name for env in (one["default"], two["default"]) for n in env.as_type(Env)._networks}
        assert len(nets) == 2  # one per sample
        r = await two["default"].exec(fetch(one["db"].as_type(Env)._networks[0].address_of("db")))
        assert not r.success, r  # the other sample's network is not reachable
    finally:
        await Env.sample_cleanup("nets", str(config), one, False)
        await Env.sample_cleanup("nets", str(config), two, False)
    from nsbox import network

    assert not [n for n in network._networks if n.startswith("lan-")]


async def test_nsbox_yaml_hostname_on_a_service_network(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A sandbox given a hostname keeps answering to its name in the file."""
    from nsbox.inspect.provider import NsboxSandboxEnvironment as Env

    config = tmp_path / "nsbox.yaml"
    config.write_text("network: 'net:lan'\nsandboxes:\n  default: {}\n  db: {hostname: pg-main}\n")
    envs = await Env.sample_init("nets", str(config), {"__sample_id__": "1"})
    try:
        db = envs["db"].as_type(Env).sandbox
        assert (await db.exec(["hostname"])).stdout == "pg-main\n"
        await serve(db)
        for name in ("db", "pg-main"):
            r = await envs["default"].exec(fetch(name))
            assert r.stdout == "pg-main\n", (name, r)
        assert (await envs["default"].exec(["hostname"])).stdout == "default\n"
    finally:
        await Env.sample_cleanup("nets", str(config), envs, False)


async def test_a_cancelled_network_start_frees_its_subnet() -> None:
    """A process has 254 subnets for its networks: each start cancelled
    (a sample cancelled while it started) had kept one for good, until
    every later network failed with "no free subnet"."""
    from nsbox.net import bridge

    before = set(bridge._subnets_in_use)
    await (await nsbox.Network("warm").start()).close()  # the helper's start is not a network's
    t = time.monotonic()
    await (await nsbox.Network("timing").start()).close()
    took = time.monotonic() - t
    cancelled = 0
    for i in range(10):
        net = None
        with anyio.move_on_after(took * (0.1 + 0.08 * i)):
            net = await nsbox.Network(f"cancelled{i}").start()
        if net is None:
            cancelled += 1
        else:
            await net.close()
    assert cancelled > 0
    assert bridge._subnets_in_use == before


async def test_a_network_whose_worker_fails_says_why_and_keeps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The helper answers once it forked the bridge worker; the worker's
    own failure then reaches the caller from the worker, in its words, and
    leaves no subnet, descriptor or process behind."""
    from nsbox.net import bridge
    from nsbox.net.client import helper

    await (await nsbox.Network("warm").start()).close()
    subnets, fds = set(bridge._subnets_in_use), set(os.listdir("/proc/self/fd"))
    helper_children = lambda: set(psutil.Process(helper().pid).children())  # noqa: E731
    children = helper_children()
    monkeypatch.setattr(bridge, "BRIDGE", "b" * 20)  # longer than an interface name may be
    with pytest.raises(NetError, match="netlink: "):
        await nsbox.Network("broken").start()
    monkeypatch.undo()
    assert bridge._subnets_in_use == subnets
    assert set(os.listdir("/proc/self/fd")) == fds
    deadline = time.monotonic() + 5
    while helper_children() - children and time.monotonic() < deadline:
        await anyio.sleep(0.02)
    assert not helper_children() - children, "the failed worker is still there"
    async with nsbox.Network("fine", internal=True) as net:  # the helper serves on
        async with nsbox.Sandbox(network=net, hostname="a") as a:
            assert (await a.exec(["cat", "/etc/hosts"])).stdout.split().count("a") == 1


CANCELLED_STARTS = """\
import anyio, nsbox
async def main():
    await (await nsbox.Network("warm").start()).close()
    for i in range(3):
        with anyio.move_on_after(0.003):
            await nsbox.Network(f"cancelled{i}").start()
anyio.run(main)
"""


@pytest.mark.once  # the network helper's own exit: no sandbox
def test_the_network_helper_says_nothing_when_its_process_exits_mid_request() -> None:
    """A process that exits while a network request is in flight (a
    Ctrl-C while a sample starts) left the helper a reply to send into a
    closed socket: its traceback on the user's terminal."""
    # The helper shares the stderr pipe: run() reads it until the helper is gone too.
    r = subprocess.run([sys.executable, "-c", CANCELLED_STARTS], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
