"""Named service networks (`nsbox network create`, `--network net:NAME`):
networks that outlive the process that made them, joined by sandboxes of
other processes. Run through the CLI in separate processes, as a user
would: members of different processes talk by name, another network's
member cannot reach them, removal is refused while members live and
leaves nothing behind, and a killed network gives one clear line.
Traffic stays inside the tests' own namespaces."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from typing import Iterator

import psutil
import pytest

import nsbox
from nsbox.host import idmap
from nsbox import network as network_mod
from nsbox.net.client import NetError

pytestmark = pytest.mark.timeout(120)

SERVE = "import http.server as h; h.HTTPServer(('0.0.0.0', 8000), h.SimpleHTTPRequestHandler).serve_forever()"
# FETCH HOST [TRIES]: the status of http://HOST:8000/, or "error: ..."
FETCH = ("import sys, time, urllib.request as u\n"
         "tries = int(sys.argv[2]) if len(sys.argv) > 2 else 50\n"
         "for i in range(tries):\n"
         "  try: print(u.urlopen(f'http://{sys.argv[1]}:8000/', timeout=2).status); break\n"
         "  except Exception as e:\n"
         "    if i == tries - 1 or 'Name or service' in str(e): print('error:', e); break\n"
         "    time.sleep(0.1)\n")


def nsbox_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nsbox", *args], capture_output=True, text=True, timeout=timeout,
                          cwd="/tmp")


def bridge_workers() -> set[int]:
    """Live bridge workers of this user (a zombie has exited)."""
    return {p.pid for p in psutil.process_iter(["name", "uids", "status"])
            if p.info["name"] == "nsbox-bridge" and p.info["status"] != psutil.STATUS_ZOMBIE
            and p.info["uids"] and p.info["uids"].real == os.getuid()}


@pytest.fixture
def names() -> Iterator[list[str]]:
    """Fresh network names; whatever the test leaves is removed."""
    made: list[str] = []

    def fresh() -> str:
        made.append(f"t{secrets.token_hex(4)}")
        return made[-1]

    yield [fresh(), fresh()]
    nsbox_cli("rm", "--all")
    for name in made:
        nsbox_cli("network", "rm", name)


def test_members_of_two_processes_talk_by_name_and_removal_leaves_nothing(names: list[str]) -> None:
    lab = names[0]
    before = bridge_workers()
    r = nsbox_cli("network", "create", "--internal", lab)
    assert r.returncode == 0 and r.stdout.strip() == lab, r.stderr
    r = nsbox_cli("network", "create", lab)
    assert r.returncode != 0 and "exists already" in r.stderr and "Traceback" not in r.stderr
    # db, detached, in this process's child; web in another: both on lab.
    r = nsbox_cli("run", "-d", "--network", f"net:{lab}", "--hostname", "db", "--network-alias", "www",
                  "--add-host", "extra:10.9.9.9", "--", "python3", "-c", SERVE)
    assert r.returncode == 0, r.stderr
    db = r.stdout.strip()
    # (The network's worker socket, from which its member table and user
    # namespace can be had, is not in any member's view.)
    worker_socket = network_mod.socket_path(lab)
    assert worker_socket.exists()
    r = nsbox_cli("run", "--network", f"net:{lab}", "--hostname", "web", "--",
                  "sh", "-c", f"! test -e {worker_socket} && ! test -e {worker_socket.parent} && "
                              f"grep -w db /etc/hosts && python3 -c \"{FETCH}\" db && python3 -c \"{FETCH}\" www")
    assert r.returncode == 0 and r.stdout.strip().endswith("200\n200"), (r.stdout, r.stderr)
    listed = [json.loads(line) for line in nsbox_cli("network", "ls", "--json").stdout.splitlines()]
    row = next(x for x in listed if x["name"] == lab)
    assert list(row["members"]) == ["db"]  # web left when its run ended
    # web's process rewrote db's /etc/hosts as it came and went: db keeps its own extra host.
    hosts = nsbox_cli("exec", db, "--", "cat", "/etc/hosts").stdout
    assert "10.9.9.9\textra" in hosts and "web" not in hosts, hosts
    assert len(bridge_workers() - before) == 1

    r = nsbox_cli("network", "rm", lab)
    assert r.returncode == 1 and "has members: db" in r.stderr and "Traceback" not in r.stderr
    assert nsbox_cli("rm", db).returncode == 0
    deadline = time.monotonic() + 10  # the worker forgets db once its init has exited
    while time.monotonic() < deadline and nsbox_cli("network", "rm", lab).returncode != 0:
        time.sleep(0.2)
    assert lab not in nsbox_cli("network", "ls").stdout
    assert not network_mod.socket_path(lab).exists()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and bridge_workers() - before:
        time.sleep(0.1)
    assert bridge_workers() - before == set()


def test_another_networks_member_cannot_reach_them(names: list[str]) -> None:
    lab, other = names
    for name in (lab, other):
        assert nsbox_cli("network", "create", "--internal", name).returncode == 0
    r = nsbox_cli("run", "-d", "--network", f"net:{lab}", "--hostname", "db", "--", "python3", "-c", SERVE)
    assert r.returncode == 0, r.stderr
    listed = {x["name"]: x for x in map(json.loads, nsbox_cli("network", "ls", "--json").stdout.splitlines())}
    address = listed[lab]["members"]["db"]
    assert listed[lab]["subnet"] != listed[other]["subnet"]  # so spy's own address is never db's
    # Not by name, not by address.
    r = nsbox_cli("run", "--network", f"net:{other}", "--hostname", "spy", "--",
                  "python3", "-c", FETCH, "db", "3")
    assert "error:" in r.stdout, r.stdout
    r = nsbox_cli("run", "--network", f"net:{other}", "--hostname", "spy", "--",
                  "python3", "-c", FETCH, address, "3")
    assert "error:" in r.stdout, r.stdout
    r = nsbox_cli("run", "--network", f"net:{lab}", "--hostname", "friend", "--", "python3", "-c", FETCH, "db")
    assert r.stdout.strip().endswith("200"), (r.stdout, r.stderr)


def test_a_killed_network_is_named_and_can_be_removed(names: list[str]) -> None:
    lab = names[0]
    before = bridge_workers()
    assert nsbox_cli("network", "create", "--internal", lab).returncode == 0
    (worker,) = bridge_workers() - before
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and worker in bridge_workers():
        time.sleep(0.05)
    assert "dead" in nsbox_cli("network", "ls").stdout
    r = nsbox_cli("run", "--network", f"net:{lab}", "--", "true")
    assert r.returncode == 125 and f"network {lab}: no such network" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert nsbox_cli("network", "rm", lab).returncode == 0
    assert not network_mod.socket_path(lab).exists()
    r = nsbox_cli("network", "rm", lab)
    assert r.returncode == 1 and "no such network" in r.stderr


MEMBER = textwrap.dedent("""
    import anyio, sys, nsbox
    async def main():
        async with nsbox.Sandbox(network="net:" + sys.argv[1], hostname="web") as web:
            r = await web.exec(["python3", "-c", sys.argv[2], "db"])
            print(r.stdout.strip().splitlines()[-1])
    anyio.run(main)
""")


async def test_api_named_network_joined_from_another_process(names: list[str]) -> None:
    net = await nsbox.Network(names[0], internal=True, named=True).start()
    try:
        async with nsbox.Sandbox(network=net, hostname="db") as db:
            await db.exec(["sh", "-c", f"python3 -c \"{SERVE}\" >/dev/null 2>&1 &"])
            r = subprocess.run([sys.executable, "-c", MEMBER, names[0], FETCH], capture_output=True, text=True,
                               timeout=60)
            assert r.stdout.strip() == "200", (r.stdout, r.stderr)
            # db's /etc/hosts named web while it was there, and no longer does.
            hosts = (await db.exec(["cat", "/etc/hosts"])).stdout
            assert "web" not in hosts and "db" in hosts
        await net.remove()
    finally:
        await net.close()
    with pytest.raises(NetError, match="no such network"):
        await nsbox.Network.open(names[0])


def test_members_must_have_the_networks_id_mapping(names: list[str]) -> None:
    if idmap.detect("auto").mode != "subuid":
        pytest.skip("needs a subordinate id range: only there do 'auto' and 'single' differ")
    assert nsbox_cli("network", "create", "--internal", "--id-mapping", "single", names[0]).returncode == 0
    r = nsbox_cli("run", "--network", f"net:{names[0]}", "--", "true")
    assert r.returncode == 125 and "another id mapping" in r.stderr, r.stderr
    r = nsbox_cli("run", "--id-mapping", "single", "--network", f"net:{names[0]}", "--", "true")
    assert r.returncode == 0, r.stderr


GHOST = textwrap.dedent("""
    import anyio, os, sys, nsbox
    async def main():
        net = await nsbox.Network.open(sys.argv[1])
        await net._net.reserve("ghost", sandbox="0123456789ab")  # and dies before joining
        print("reserved", flush=True)
        os._exit(0)
    anyio.run(main)
""")


def test_a_reservation_dies_with_its_process(names: list[str]) -> None:
    lab = names[0]
    assert nsbox_cli("network", "create", "--internal", lab).returncode == 0
    r = subprocess.run([sys.executable, "-c", GHOST, lab], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "reserved", r.stderr
    listed = {x["name"]: x for x in map(json.loads, nsbox_cli("network", "ls", "--json").stdout.splitlines())}
    assert listed[lab]["members"] == {}
    assert nsbox_cli("network", "rm", lab).returncode == 0


def test_concurrent_creates_make_one_network(names: list[str]) -> None:
    lab = names[0]
    before = bridge_workers()
    procs = [subprocess.Popen([sys.executable, "-m", "nsbox", "network", "create", "--internal", lab], cwd="/tmp",
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [(p.wait(timeout=60), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
    assert sum(code == 0 for code, _ in results) == 1, results
    for code, err in results:
        assert code == 0 or ("exists already" in err or "being created" in err) and "Traceback" not in err, err
    assert len(bridge_workers() - before) == 1
    assert nsbox_cli("network", "rm", lab).returncode == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and bridge_workers() - before:
        time.sleep(0.1)
    assert bridge_workers() - before == set()


def test_a_malformed_request_does_not_end_the_network(names: list[str]) -> None:
    lab = names[0]
    assert nsbox_cli("network", "create", "--internal", lab).returncode == 0
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(str(network_mod.socket_path(lab)))
        for junk in (b"not json", b"[1, 2]", b'{"op": "nonsense"}', b'{"op": "take"}'):
            s.send(junk)
            assert json.loads(s.recv(65536))["ok"] is False
    r = nsbox_cli("run", "--network", f"net:{lab}", "--", "true")
    assert r.returncode == 0, r.stderr
