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
first time a request needs it.

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
  bridge   {user_fd?, bridge}                     -> a new network namespace (fd)
           holding an up bridge
  attach   {user_fd?, net_fd, member_fd, bridge, host_ifname, ifname, address}
           a veth pair: host_ifname on the bridge, ifname with address in the
           member's network namespace
  detach   {user_fd?, net_fd, host_ifname}

When the nsbox process closes its end (it exited, crashed or was killed),
the helper kills every process it spawned and exits.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import socket
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


def op_bridge(req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
    if req.get("user_fd") is not None:
        setns(fds[req["user_fd"]], CLONE_NEWUSER, "user namespace")
    unshare(CLONE_NEWNET, "network namespace")
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        ipr.link("set", index=1, state="up")
        ipr.link("add", ifname=req["bridge"], kind="bridge")
        ipr.link("set", index=ipr.link_lookup(ifname=req["bridge"])[0], state="up")
    return {}, [os.open("/proc/self/ns/net", os.O_RDONLY)]


def op_attach(req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
    enter(req, fds)  # the network's namespace, where the bridge is
    from pyroute2 import IPRoute

    member = fds[req["member_fd"]]
    with IPRoute() as ipr:
        bridge = ipr.link_lookup(ifname=req["bridge"])[0]
        ipr.link("add", ifname=req["host_ifname"], kind="veth",
                 peer={"ifname": req["ifname"], "net_ns_fd": member})
        ipr.link("set", index=ipr.link_lookup(ifname=req["host_ifname"])[0], master=bridge, state="up")
    setns(member, CLONE_NEWNET, "member's network namespace")
    address, prefix = req["address"].split("/")
    with IPRoute() as ipr:
        index = ipr.link_lookup(ifname=req["ifname"])[0]
        ipr.addr("add", index=index, address=address, prefixlen=int(prefix))
        ipr.link("set", index=index, state="up")
        ipr.link("set", index=1, state="up")
    return {}, []


def op_detach(req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
    enter(req, fds)
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        found = ipr.link_lookup(ifname=req["host_ifname"])
        if found:
            ipr.link("del", index=found[0])  # its peer in the member goes with it
    return {}, []


IN_CHILD = {"listen": op_listen, "connect": op_connect, "bridge": op_bridge, "attach": op_attach,
            "detach": op_detach}
NEEDS_PYROUTE2 = {"bridge", "attach", "detach"}


def run_in_child(chan: socket.socket, req: dict[str, Any], fds: list[int]) -> None:
    """Forks; the child joins namespaces, runs the op and sends the reply itself."""
    if req["op"] in NEEDS_PYROUTE2:
        import pyroute2  # noqa: F401  (imported once here, so each child has it)
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


IN_HELPER = {"spawn": op_spawn, "kill": op_kill, "userns": op_userns}


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
