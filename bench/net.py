"""Network benchmarks: what each network mode adds to creating a sandbox,
and the throughput of 1 GiB over a service network and over nat to the
host's loopback, beside the host's own loopback.

Stand-in sandboxes are `unshare -Urn` processes (inside the owner's user
namespace for service networks); the operations timed are the ones a real
sandbox goes through. All traffic stays on this machine.

    python bench/net.py [--size-mib 1024] [--runs 20]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import time

import anyio

from nsbox.host import idmap
from nsbox.net import usernet
from nsbox.net.bridge import Network, OwnerUserns
from nsbox.net.client import Namespaces, helper, listen_in

SEND = textwrap.dedent("""
    import socket, sys, time
    host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    buf = b"x" * (1 << 20)
    s = socket.create_connection((host, port))
    t = time.perf_counter()
    for _ in range(size >> 20):
        s.sendall(buf)
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
    print(time.perf_counter() - t)
""")
RECV = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2]))); s.listen()
    print("ready", flush=True)
    c, _ = s.accept()
    buf = bytearray(1 << 20)
    while c.recv_into(buf):
        pass
    c.close()
""")


def stand_in(owner: OwnerUserns | None) -> subprocess.Popen[bytes]:
    enter = []
    if owner is not None:
        enter = ["nsenter", f"--user={owner.path}", *(["--preserve-credentials"] if os.geteuid() else []), "--"]
    p = subprocess.Popen([*enter, "unshare", "-Urn", "sh", "-c", "ip link set lo up; exec sleep 600"])
    while open(f"/proc/{p.pid}/comm").read().strip() != "sleep":
        time.sleep(0.002)
    return p


def run_in(pid: int, *argv: str, background: bool = False) -> subprocess.Popen[str] | str:
    cmd = ["nsenter", "--preserve-credentials", "-t", str(pid), "-U", "-n", sys.executable, *argv]
    if background:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{argv[-3:]} failed: {r.stderr.strip().splitlines()[-1:]}")
    return r.stdout


def transfer(recv_pid: int | None, listen: str, send_pid: int | None, target: str, size: int) -> float:
    """GB/s of `size` bytes from send_pid (None: the host) to a receiver."""
    port = "5201"
    recv = (run_in(recv_pid, "-c", RECV, listen, port, background=True) if recv_pid else
            subprocess.Popen([sys.executable, "-c", RECV, listen, port], stdout=subprocess.PIPE, text=True))
    assert isinstance(recv, subprocess.Popen) and recv.stdout is not None
    recv.stdout.readline()
    if send_pid:
        out = run_in(send_pid, "-c", SEND, target, port, str(size))
    else:
        out = subprocess.run([sys.executable, "-c", SEND, target, port, str(size)], capture_output=True,
                             text=True, check=True).stdout
    recv.wait()
    assert isinstance(out, str)
    return size / float(out) / 1e9


def ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1000:7.2f} ms"


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    size = args.size_mib << 20
    rows: list[tuple[str, str]] = []
    h = helper()

    t = time.perf_counter()
    await h.request("kill", id=0)
    rows.append(("network helper start (once per nsbox process)", ms([time.perf_counter() - t])))

    owner = await OwnerUserns.create(idmap.detect())
    net = await Network("bench", internal=True).start(owner)
    procs = [stand_in(owner) for _ in range(args.runs + 2)]
    member_ns = [Namespaces.of_pid(p.pid, with_user=True) for p in procs]
    attach = []
    for i, ns in enumerate(member_ns[2:]):
        t = time.perf_counter()
        await net.connect(f"m{i}", ns)
        attach.append(time.perf_counter() - t)
    rows.append(("service network member (veth + address)", ms(attach)))

    proxy = []
    for ns in member_ns[2:]:
        t = time.perf_counter()
        (await listen_in(ns, "127.0.0.1", 3128)).close()
        proxy.append(time.perf_counter() - t)
    rows.append(("proxy mode listener inside the sandbox", ms(proxy)))

    tools = [t for t in usernet.TOOLS if shutil.which(t)]
    for tool in tools:
        starts = []
        for ns in member_ns[2:2 + min(args.runs, 10)]:
            t = time.perf_counter()
            un = await usernet.start(ns, tool=tool)
            starts.append(time.perf_counter() - t)
            await un.stop()
        rows.append((f"nat: {tool} start", ms(starts)))

    gib = f"{args.size_mib} MiB"
    rows.append((f"{gib} over the host's loopback", f"{transfer(None, '127.0.0.1', None, '127.0.0.1', size):7.2f} GB/s"))
    a, b = procs[0], procs[1]
    net2 = await Network("bench2", internal=True).start(owner)
    ma = await net2.connect("a", member_ns[0])
    await net2.connect("b", member_ns[1])
    rows.append((f"{gib} over a service network (veth + bridge)",
                 f"{transfer(a.pid, ma.ip, b.pid, ma.ip, size):7.2f} GB/s"))
    for tool in tools:
        un = await usernet.start(member_ns[1], tool=tool)
        rows.append((f"{gib} over nat ({tool}) to the host's loopback",
                     f"{transfer(None, '127.0.0.1', b.pid, un.gateway, size):7.2f} GB/s"))
        await un.stop()

    await net.close()
    await net2.close()
    for p in procs:
        p.kill()
        p.wait()
    width = max(len(r[0]) for r in rows)
    print(f"network benchmarks (identity mode {idmap.detect().mode}, median of {args.runs} where repeated)")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


if __name__ == "__main__":
    anyio.run(main)
