"""Compose samples as Docker networks them (nsbox/compose/services.py, the
"services" mode), with real sandboxes: a network namespace per service,
an address on each of its networks, names and aliases per network,
`internal` networks without a way out, no path between services that
share no network, published ports and host-gateway per service (which
samples keep the pod mode: tests/unit/compose/test_compose.py). Traffic stays between the tests' own
namespaces (and the host's 127.0.0.1)."""

from __future__ import annotations

import os

import pytest

import nsbox
from nsbox.compose.services import Healthcheck, ServiceSpec, Services
from nsbox.host import live
from nsbox.net.client import NetError

from tests import components
from tests.net_members import http_server  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(90)

# SERVE WORD PORT: answers WORD (and its hostname) on 0.0.0.0:PORT.
SERVE = ("import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
         "s.bind(('0.0.0.0', int(sys.argv[2]))); s.listen()\n"
         "while True:\n c, _ = s.accept(); c.send(sys.argv[1].encode()); c.close()")
# CONNECT HOST PORT: what answered, or the error (ENETUNREACH, ECONNREFUSED...).
CONNECT = ("import socket, sys\n"
           "try: print('got', socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).recv(100).decode())\n"
           "except OSError as e: print('failed', e.errno, e)")
READY = "import socket, sys, time\nfor _ in range(100):\n try: socket.create_connection(('127.0.0.1', int(sys.argv[1]))); break\n except OSError: time.sleep(0.05)"


def _spec(**kw: object) -> nsbox.SandboxSpec:
    return nsbox.SandboxSpec(workdir="/tmp", **kw)  # type: ignore[arg-type]


def server(name: str, networks: dict[str, list[str]], port: int = 80, **kw: object) -> ServiceSpec:
    """A service answering its name on `port`, healthy once it listens."""
    return ServiceSpec(name, _spec(**kw), command=["python3", "-c", SERVE, name, str(port)],
                       healthcheck=Healthcheck.from_test(["CMD", "python3", "-c", READY, str(port)], interval=0.2,
                                                         retries=50), networks=networks)


def idle(name: str, networks: dict[str, list[str]], **kw: object) -> ServiceSpec:
    return ServiceSpec(name, _spec(**kw), command=["sleep", "infinity"], networks=networks)


async def connect(sb: nsbox.Sandbox, host: str, port: int = 80) -> str:
    r = await sb.exec(["python3", "-c", CONNECT, host, str(port)])
    assert r.success, r
    return r.stdout.strip()


async def hosts(sb: nsbox.Sandbox) -> dict[str, str]:
    """Its /etc/hosts: name -> address (the first line naming it)."""
    table: dict[str, str] = {}
    for line in (await sb.exec(["cat", "/etc/hosts"])).stdout.splitlines():
        address, *names = line.split()
        for n in names:
            table.setdefault(n, address)
    return table


async def interfaces(sb: nsbox.Sandbox) -> dict[str, str]:
    """Its IPv4 addresses: interface -> address (besides lo)."""
    r = await sb.exec(["python3", "-c", "import socket, fcntl, struct\n"
                       "for i, n in socket.if_nameindex():\n"
                       " s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                       " try: print(n, socket.inet_ntoa(fcntl.ioctl(s, 0x8915, struct.pack('256s', n.encode()))[20:24]))\n"
                       " except OSError: print(n, '-')"])
    assert r.success, r
    return {n: a for n, a in (line.split() for line in r.stdout.splitlines()) if n != "lo"}


def default_route(routes: str) -> bool:
    return any(line.split()[1] == "00000000" for line in routes.splitlines()[1:])


async def test_two_services_on_port_80_each_reached_by_name() -> None:
    """Docker's shape the pod mode refused: two services listening on the
    same port, both reached by name from a third that waits for them."""
    client = idle("client", {"web": ["client"]})
    client.depends_on = {"one": "service_healthy", "two": "service_healthy"}
    services = Services([client,
                         server("one", {"web": ["one"]}), server("two", {"web": ["two"]})],
                        network="services", networks={"web": True})
    boxes = await services.start()
    try:
        assert list(boxes) == ["client", "one", "two"]
        assert await connect(boxes["client"], "one") == "got one"
        assert await connect(boxes["client"], "two") == "got two"
        # Each its own namespace and address: one's port 80 is its own.
        addresses = {name: (await interfaces(sb))["eth0"] for name, sb in boxes.items()}
        assert len(set(addresses.values())) == 3 and all(a.startswith("10.89.") for a in addresses.values())
        assert await connect(boxes["one"], "127.0.0.1") == "got one"
        assert (await hosts(boxes["client"]))["two"] == addresses["two"]
    finally:
        await services.close()


async def test_internal_network_has_no_way_in_or_out() -> None:
    """`lab` is internal: its members reach each other and nothing else;
    `outsider`, on another network, can neither name nor route to them.
    (Both networks internal: a refused connection never leaves the test's
    namespaces, there being no default route.)"""
    services = Services([idle("attacker", {"lab": ["attacker"]}), server("target", {"lab": ["target", "victim"]}),
                         idle("outsider", {"other": ["outsider"]})],
                        network="services", networks={"lab": True, "other": True})
    boxes = await services.start()
    try:
        assert await connect(boxes["attacker"], "victim") == "got target"
        target = (await interfaces(boxes["target"]))["eth0"]
        outsider = boxes["outsider"]
        assert "target" not in await hosts(outsider) and "victim" not in await hosts(outsider)
        out = await connect(outsider, target)
        assert out.startswith("failed 101 "), out  # ENETUNREACH: no route to lab's subnet
        for sb in boxes.values():  # no way out: no default route, no user-mode network
            assert not default_route((await sb.exec(["cat", "/proc/net/route"])).stdout)
            assert set(await interfaces(sb)) == {"eth0"}
    finally:
        await services.close()


async def test_a_service_on_two_networks_with_aliases_per_network() -> None:
    """`proxy` is on front and back with an alias on each: it reaches both
    sides, each side knows it by that side's alias only, and the sides
    cannot reach each other."""
    services = Services([idle("proxy", {"front": ["proxy", "gateway"], "back": ["proxy", "client-of-db"]}),
                         server("web", {"front": ["web"]}), server("db", {"back": ["db"]}, port=5432),
                         server("spare", {"back": ["spare"]}, port=5432)],
                        network="services", networks={"front": True, "back": True})
    boxes = await services.start()
    try:
        proxy = boxes["proxy"]
        nics = await interfaces(proxy)
        assert set(nics) == {"eth0", "eth1"} and nics["eth0"].rsplit(".", 1)[0] != nics["eth1"].rsplit(".", 1)[0]
        assert await connect(proxy, "web") == "got web"
        assert await connect(proxy, "db", 5432) == "got db"
        web, db = await hosts(boxes["web"]), await hosts(boxes["db"])
        assert web["gateway"] in nics.values() and "client-of-db" not in web
        assert db["client-of-db"] in nics.values() and "gateway" not in db
        assert web["gateway"] != db["client-of-db"]  # an address per network
        assert "db" not in web and "web" not in db
        out = await connect(boxes["web"], (await interfaces(boxes["db"]))["eth0"], 5432)
        assert out.startswith("failed 101 "), out
        # Two services of `back` on one port: both reached.
        assert await connect(proxy, "spare", 5432) == "got spare"
    finally:
        await services.close()
    assert not services.networks and not services.sandboxes


async def test_published_ports_of_two_services_on_one_inner_port() -> None:
    before = {i.id for i in live.entries() if i.owner_pid == os.getpid()}
    services = Services([server("a", {"n": ["a"]}, ports=("127.0.0.1:0:80",)),
                         server("b", {"n": ["b"]}, ports=("127.0.0.1:0:80",))],
                        network="services", networks={"n": True})
    boxes = await services.start()
    try:
        import socket

        for name, sb in boxes.items():
            [port] = sb.host_ports
            with socket.create_connection(("127.0.0.1", port), timeout=3) as c:
                assert c.recv(100) == name.encode()
    finally:
        await services.close()
    assert {i.id for i in live.entries() if i.owner_pid == os.getpid()} == before


async def test_outbound_network_and_host_gateway(http_server: int) -> None:  # noqa: F811
    """A network that is not internal: each member has its own way out
    (its first network's), and extra_hosts host-gateway reaches the
    host's 127.0.0.1, as in Docker."""
    components.require("tun", "usernet")
    services = Services([idle("app", {"default": ["app"], "lab": ["app"]}, hosts={"host.docker.internal": "host-gateway"}),
                         server("db", {"lab": ["db"]})],
                        network="services", networks={"default": False, "lab": True})
    boxes = await services.start()
    try:
        app = boxes["app"]
        url = f"http://host.docker.internal:{http_server}/"
        r = await app.exec(["python3", "-c", f"import urllib.request as u; print(u.urlopen('{url}', timeout=5).status)"])
        assert r.stdout == "200\n", r
        assert await connect(app, "db") == "got db"
        assert not default_route((await boxes["db"].exec(["cat", "/proc/net/route"])).stdout)
    finally:
        await services.close()


async def test_more_networks_refusals() -> None:
    with pytest.raises(ValueError, match="more_networks apply to a sandbox on a service network"):
        nsbox.SandboxSpec(network="none", more_networks={"net:a": ()})
    with pytest.raises(ValueError, match="is not another service network"):
        nsbox.SandboxSpec(network="net:a", more_networks={"net:a": ()})
    with pytest.raises(ValueError, match="cannot be a host name"):
        nsbox.SandboxSpec(network="net:a", more_networks={"net:b": ("a b",)})
    before = {i.id for i in live.entries() if i.owner_pid == os.getpid()}
    async with nsbox.Network("solo", internal=True) as net:
        with pytest.raises(NetError, match="networks of this process only"):
            await nsbox.Sandbox(spec=_spec(network=net, more_networks={"net:elsewhere": ()})).start()
        assert not net.members
    assert {i.id for i in live.entries() if i.owner_pid == os.getpid()} == before


async def test_emptied_networks_serve_the_next_sample_unless_their_worker_died() -> None:
    import psutil

    def sample() -> Services:
        return Services([idle("a", {"n": ["a"]}), server("b", {"n": ["b"]})], network="services",
                        networks={"n": True})

    first = sample()
    await first.start()
    net = first.networks["n"]
    await first.close()
    second = sample()
    boxes = await second.start()
    try:
        assert second.networks["n"] is net  # emptied: as good as new
        assert await connect(boxes["a"], "b") == "got b"
    finally:
        await second.close()
    netns = os.fstat(net._net._netns).st_ino
    def netns_of(pid: int) -> int | None:
        try:
            return os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:  # another user's worker (a test running beside this one), or gone
            return None

    [worker] = [p for p in psutil.process_iter(["name"]) if p.info["name"] == "nsbox-bridge"
                and netns_of(p.pid) == netns]
    worker.kill()
    worker.wait(5)
    third = sample()
    boxes = await third.start()
    try:
        assert third.networks["n"] is not net
        assert await connect(boxes["a"], "b") == "got b"
    finally:
        await third.close()
