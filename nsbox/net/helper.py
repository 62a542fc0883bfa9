"""The network helper: a small single-threaded process that works inside
other processes' namespaces for the nsbox process.

Why a separate process: setns(2) into a user namespace is refused to a
multi-threaded process, and the nsbox process runs threads (anyio workers).
This helper never starts a thread. For each request that must act inside a
namespace it forks a child that joins the namespaces (user first, then
network), does the work and exits; the helper itself never changes
namespace. Forking this small process costs well under a millisecond.

It runs as a plain script (``python helper.py``), not as ``-m nsbox.net...``,
so that it does not import the nsbox package (and anyio): it starts in tens
of milliseconds. It imports only the standard library, and pyroute2 the
first time a service network needs it.

Protocol (over a SOCK_SEQPACKET socket whose fd number is the first
argument; it is also the lifeline):
a request is one JSON object plus descriptors; fields named ``*_fd`` are
indices into the request's descriptor list. The reply is one JSON object
(``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``) plus
descriptors. Requests are served one at a time, in order.

Ops:
  listen   {net_fd, user_fd?, host, port}        -> listening TCP socket inside
  connect  {net_fd, user_fd?, host, port}        -> socket connecting inside (non-blocking)
  spawn    {argv, fds: [i...], ready, watch_fd?, user_fd?}
                                                  -> {id, pid}: a long-running helper
           (pasta, slirp4netns) with descriptors i... as its fds 3, 4, ...;
           ``ready`` is "pidfile" (it writes its pid to fd N, given as
           ready_fd_at) or "none". It gets SIGKILL when this helper dies
           (PR_SET_PDEATHSIG) and when the process behind watch_fd (a pidfd,
           e.g. the sandbox's init) exits.
  kill     {id}                                   -> stops a spawned process
  userns   {uid_map, gid_map, newuidmap?, newgidmap?, deny_setgroups}
                                                  -> a new user namespace (fd)
  network  {user_fd?, bridge}                     -> the network's namespace (fd)
           and a socket to its bridge worker (fd): a forked process that
           stays in that namespace (see "The bridge worker" below)

When the nsbox process closes its end (it exited, crashed or was killed),
the helper kills every process it spawned and exits.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
MAX_MESSAGE = 65536
MAX_FDS = 16
READY_TIMEOUT = 10.0

_libc = ctypes.CDLL(None, use_errno=True)


class Refused(Exception):
    """A request that cannot be served; the message goes back to the caller."""


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def setns(fd: int, nstype: int, what: str) -> None:
    _check(_libc.setns(fd, nstype), f"joining the {what}")


def unshare(flags: int, what: str) -> None:
    _check(_libc.unshare(flags), f"creating a {what}")


def enter(req: dict[str, Any], fds: list[int]) -> None:
    """Joins the request's user namespace (if any), then its network namespace."""
    if req.get("user_fd") is not None:
        setns(fds[req["user_fd"]], CLONE_NEWUSER, "user namespace")
    if req.get("net_fd") is not None:
        setns(fds[req["net_fd"]], CLONE_NEWNET, "network namespace")


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# ---- ops that run in a forked child, inside the namespaces ----------------

def op_listen(req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
    enter(req, fds)
    sock = socket.socket(_family(req["host"]), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((req["host"], int(req["port"])))
    sock.listen(int(req.get("backlog", 128)))
    return {"port": sock.getsockname()[1]}, [sock.detach()]


def op_connect(req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
    enter(req, fds)
    sock = socket.socket(_family(req["host"]), socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.connect((req["host"], int(req["port"])))
    except BlockingIOError:
        pass  # completes later; the caller waits for writability and checks SO_ERROR
    return {}, [sock.detach()]


IN_CHILD = {"listen": op_listen, "connect": op_connect}


def run_in_child(chan: socket.socket, req: dict[str, Any], fds: list[int]) -> None:
    """Forks; the child joins namespaces, runs the op and sends the reply itself."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                result, out = IN_CHILD[req["op"]](req, fds)
                reply(chan, {"ok": True, **result}, out)
            except Exception as e:  # sent back as the reply
                reply(chan, {"ok": False, "error": _describe(e)}, [])
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        reply(chan, {"ok": False, "error": f"the helper's worker failed (status {status})"}, [])


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror if not e.filename else f"{e.filename}: {e.strerror}"
    return f"{type(e).__name__}: {e}"


# ---- ops that run in the helper itself ----------------------------------

class Spawned:
    def __init__(self, proc: subprocess.Popen[bytes], watch: int | None) -> None:
        self.proc = proc
        self.watch = watch  # a pidfd: when it becomes readable, stop proc

    def stop(self, wait: bool = True) -> None:
        """Kills the process; without `wait`, it is reaped later by the loop
        (a pasta with large buffers takes tens of ms to finish exiting)."""
        if self.proc.poll() is None:
            self.proc.kill()
        if wait:
            self.proc.wait()
        elif self.proc.returncode is None:
            dying.append(self.proc)
        if self.watch is not None:
            os.close(self.watch)
            self.watch = None


spawned: dict[int, Spawned] = {}
dying: list[subprocess.Popen[bytes]] = []  # killed, not yet reaped
_next_id = iter(range(1, 1 << 62))


def _pdeathsig() -> None:
    # This helper is single-threaded: the parent-death signal fires when the
    # helper exits, not when some thread does.
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def op_spawn(req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
    """Starts a long-running program and waits until it says it is ready.

    In argv, "{fd0}", "{fd1}"... stand for the request's descriptors as the
    program sees them, "{ready_fd}" for the write end of the readiness pipe.
    ready: "line" (it writes a line there, as pasta's pid file), "byte" (as
    slirp4netns --ready-fd) or "none".
    """
    ready = req.get("ready", "none")
    ready_r, ready_w = os.pipe()
    err_r, err_w = os.pipe()
    passed = [fds[i] for i in req.get("fds", [])]
    names = {f"{{fd{n}}}": str(fd) for n, fd in enumerate(passed)}
    names["{ready_fd}"] = str(ready_w)
    argv = [_substitute(a, names) for a in req["argv"]]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err_w,
                                pass_fds=[*passed, ready_w], preexec_fn=_pdeathsig, close_fds=True)
    except OSError as e:
        raise Refused(f"cannot start {argv[0]}: {e.strerror}") from None
    finally:
        os.close(ready_w)
        os.close(err_w)
    name = os.path.basename(argv[0])
    try:
        got = b""
        deadline = time.monotonic() + READY_TIMEOUT
        while ready != "none" and not (got if ready == "byte" else b"\n" in got):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([ready_r], [], [], left)[0]:
                proc.kill()
                proc.wait()
                raise Refused(f"{name} did not become ready within {READY_TIMEOUT:g}s")
            chunk = os.read(ready_r, 64)
            if not chunk:
                break
            got += chunk
        if proc.poll() is not None or (ready != "none" and not got):
            proc.kill()
            proc.wait()
            raise Refused(_last_line(err_r) or f"{name} exited with status {proc.returncode}")
    finally:
        os.close(ready_r)
        os.close(err_r)  # later messages go nowhere
    watch = os.dup(fds[req["watch_fd"]]) if req.get("watch_fd") is not None else None
    ident = next(_next_id)
    spawned[ident] = Spawned(proc, watch)
    return {"id": ident, "pid": proc.pid}, []


def _substitute(arg: str, names: dict[str, str]) -> str:
    for key, value in names.items():
        arg = arg.replace(key, value)
    return arg


def _last_line(fd: int) -> str:
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, 65536)
    except BlockingIOError:
        data = b""
    lines = [line.strip() for line in data.decode(errors="replace").splitlines()]
    # pasta repeats every message with "Failed to send ... to syslog" when there is none.
    lines = [line for line in lines if line and "to syslog" not in line]
    return lines[-1] if lines else ""


def op_kill(req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
    entry = spawned.pop(int(req["id"]), None)
    if entry is not None:
        entry.stop(wait=req.get("wait", True))
    return {}, []


def op_userns(req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
    """A user namespace with the given maps, held by the returned descriptor."""
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(go_w)
            unshare(CLONE_NEWUSER, "user namespace")
            os.read(go_r, 1)  # until the parent has opened our namespace
        finally:
            os._exit(0)
    os.close(go_r)
    try:
        for _ in range(2000):  # until the child has unshared
            if os.readlink(f"/proc/{pid}/ns/user") != os.readlink("/proc/self/ns/user"):
                break
            time.sleep(0.0005)
        else:
            raise Refused("the user namespace holder did not start")
        _write_maps(pid, req)
        nsfd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(go_w)
        os.waitpid(pid, 0)
    return {}, [nsfd]


def _write_maps(pid: int, req: dict[str, Any]) -> None:
    for kind in ("uid", "gid"):
        text = req[f"{kind}_map"]
        tool = req.get(f"new{kind}map")
        if kind == "gid" and req.get("deny_setgroups"):
            with open(f"/proc/{pid}/setgroups", "w") as f:
                f.write("deny")
        if tool:
            args = [str(x) for line in text.split("\n") if line.strip() for x in line.split()]
            r = subprocess.run([tool, str(pid), *args], capture_output=True, text=True)
            if r.returncode != 0:
                raise Refused(f"{tool} failed: {r.stderr.strip() or r.returncode}")
        else:
            with open(f"/proc/{pid}/{kind}_map", "w") as f:
                f.write(text)


# ---- the bridge worker: one per service network ----------------------------
#
# A member joins a network between its sandbox's clone and its start, so
# the join is on the path of every member's creation. A forked child per
# join, entering namespaces and opening netlink sockets afresh, cost
# ~14 ms. The worker is forked once per network, joins the owner's user
# namespace, makes the network's namespace and stays there with one warm
# netlink socket (pyroute2). A join is one netlink request (a veth pair:
# one end enslaved to the bridge and up, the other made right inside the
# member's namespace) and a few ioctls inside the member (address, netmask,
# up): the worker holds CAP_NET_ADMIN over the member's namespace, whose
# user namespace is a child of the owner's, so it may enter it and come
# back. (Pairs made in advance and moved in would cost more: moving a
# device between namespaces waits for an RCU grace period, ~20 ms here.)
#
# Requests on its socket (same framing as the helper's):
#   take    {member_fd, ifname, address}  -> {host_ifname}
#   detach  {host_ifname}
# It exits when the nsbox process closes the socket (or dies).

SIOCGIFFLAGS, SIOCSIFFLAGS, SIOCSIFADDR, SIOCSIFNETMASK = 0x8913, 0x8914, 0x8916, 0x891C
IFF_UP = 0x1


class BridgeWorker:
    def __init__(self, bridge: str) -> None:
        from pyroute2 import IPRoute

        self.ipr = IPRoute()
        self.ipr.link("set", index=1, state="up")
        self.ipr.link("add", ifname=bridge, kind="bridge")
        self.bridge = self.ipr.link_lookup(ifname=bridge)[0]
        self.ipr.link("set", index=self.bridge, state="up")
        self.home = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self.made = 0

    def take(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        self.made += 1
        host = f"veth{self.made}"
        member = fds[req["member_fd"]]
        self.ipr.link("add", ifname=host, kind="veth", master=self.bridge, state="up",
                      peer={"ifname": req["ifname"], "net_ns_fd": member})
        try:
            setns(member, CLONE_NEWNET, "member's network namespace")
            try:
                configure(req["ifname"], req["address"])
            finally:
                setns(self.home, CLONE_NEWNET, "network's namespace")
        except BaseException:
            self.detach({"host_ifname": host}, [])
            raise
        return {"host_ifname": host}

    def detach(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        found = self.ipr.link_lookup(ifname=req["host_ifname"])
        if found:
            self.ipr.link("del", index=found[0])  # its peer in the member goes with it
        return {}

    def serve(self, chan: socket.socket) -> None:
        global _seq
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(chan, MAX_MESSAGE, MAX_FDS)
            except ConnectionResetError:
                return
            if not data:
                return
            try:
                req = json.loads(data)
                _seq = req.get("seq")
                try:
                    op = {"take": self.take, "detach": self.detach}[req.get("op")]
                    reply(chan, {"ok": True, **op(req, fds)}, [])
                except Exception as e:
                    reply(chan, {"ok": False, "error": _describe(e)}, [])
            finally:
                for fd in fds:
                    os.close(fd)


def configure(ifname: str, address: str) -> None:
    """Addresses and raises an interface of the namespace this process is
    in, and its loopback (plain ioctls: no second netlink socket)."""
    ip, prefix = address.split("/")
    mask = socket.inet_ntoa(int.to_bytes((0xFFFFFFFF << (32 - int(prefix))) & 0xFFFFFFFF, 4, "big"))

    def ifreq_addr(addr: str) -> bytes:
        return struct.pack("16sHH4s8x", ifname.encode(), socket.AF_INET, 0, socket.inet_aton(addr))

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, SIOCSIFADDR, ifreq_addr(ip))
        fcntl.ioctl(s, SIOCSIFNETMASK, ifreq_addr(mask))
        for name in (ifname, "lo"):
            flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH14x", name.encode(), 0)))[1]
            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", name.encode(), flags | IFF_UP))


def op_network(req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
    """Forks the network's bridge worker (detached: a grandchild, its
    socket is its lifeline) and answers with its namespace and socket."""
    import pyroute2  # noqa: F401  (once, in the helper: every worker inherits it)

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ours.close()
            if os.fork() == 0:
                _run_worker(theirs, req, fds)
            code = 0
        finally:
            os._exit(code)
    theirs.close()
    os.waitpid(pid, 0)
    try:
        ours.settimeout(READY_TIMEOUT)
        data, got, _, _ = socket.recv_fds(ours, MAX_MESSAGE, 1)
        ours.settimeout(None)
        answer = json.loads(data) if data else {"error": "the bridge worker exited while starting"}
        if "error" in answer:
            for fd in got:
                os.close(fd)
            raise Refused(answer["error"])
    except BaseException:
        ours.close()
        raise
    return {}, [got[0], ours.detach()]


def _run_worker(chan: socket.socket, req: dict[str, Any], fds: list[int]) -> None:
    keep = {chan.fileno(), *fds}
    for name in os.listdir("/proc/self/fd"):  # nothing of the helper's (its channel, pasta's pipes)
        if int(name) > 2 and int(name) not in keep:
            try:
                os.close(int(name))
            except OSError:
                pass
    code = 1
    try:
        try:
            if req.get("user_fd") is not None:
                setns(fds[req["user_fd"]], CLONE_NEWUSER, "user namespace")
            unshare(CLONE_NEWNET, "network namespace")
            worker = BridgeWorker(req["bridge"])
        except Exception as e:
            chan.send(json.dumps({"error": _describe(e)}).encode())
            return
        for fd in fds:
            os.close(fd)
        socket.send_fds(chan, [b"{}"], [worker.home])
        worker.serve(chan)
        code = 0
    finally:
        os._exit(code)


IN_HELPER = {"spawn": op_spawn, "kill": op_kill, "userns": op_userns,
             "network": op_network}


# ---- the loop -------------------------------------------------------------

# The sequence number of the request being handled (requests are handled
# one at a time), echoed in its reply: a client whose earlier request was
# cancelled while waiting tells that late reply from the one it waits for.
_seq: Any = None


def reply(chan: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
    data = json.dumps({**message, "seq": _seq}).encode()
    if fds:
        socket.send_fds(chan, [data], fds)
    else:
        chan.send(data)


def serve(chan: socket.socket) -> None:
    while True:
        poller = select.poll()
        poller.register(chan, select.POLLIN)
        watched = {s.watch: ident for ident, s in spawned.items() if s.watch is not None}
        for fd in watched:
            poller.register(fd, select.POLLIN)
        events = dict(poller.poll(20 if dying else None))
        dying[:] = [p for p in dying if p.poll() is None]
        for fd in watched:
            if fd in events:  # a watched process (a sandbox's init) exited
                spawned.pop(watched[fd]).stop(wait=False)
        if chan.fileno() not in events:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(chan, MAX_MESSAGE, MAX_FDS)
        except ConnectionResetError:
            data, fds = b"", []
        if not data:
            return  # the nsbox process is gone
        try:
            handle(chan, data, fds)
        finally:
            for fd in fds:
                os.close(fd)


def handle(chan: socket.socket, data: bytes, fds: list[int]) -> None:
    global _seq
    req = json.loads(data)
    _seq = req.get("seq")
    op = req.get("op")
    if op in IN_CHILD:
        run_in_child(chan, req, fds)
        return
    if op not in IN_HELPER:
        reply(chan, {"ok": False, "error": f"unknown request {op!r}"}, [])
        return
    try:
        result, out = IN_HELPER[op](req, fds)
    except (Refused, OSError) as e:
        reply(chan, {"ok": False, "error": str(e) if isinstance(e, Refused) else _describe(e)}, [])
        return
    try:
        reply(chan, {"ok": True, **result}, out)
    finally:
        for fd in out:
            os.close(fd)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the nsbox process
    chan = socket.socket(fileno=int(sys.argv[1]))
    try:
        serve(chan)
    finally:
        for entry in spawned.values():
            entry.stop()


if __name__ == "__main__":
    main()
