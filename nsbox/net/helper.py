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
           (pasta, slirp4netns, run through nsbox-tied) with descriptors i... as its fds 3, 4, ...;
           ``ready`` is "pidfile" (it writes its pid to fd N, given as
           ready_fd_at) or "none". It gets SIGKILL when this helper dies
           (PR_SET_PDEATHSIG) and when the process behind watch_fd (a pidfd,
           e.g. the sandbox's init) exits.
  standby  {argv, fds, ready, watch_fd?, tap_fd, sender_fd}
                                                  -> {id, pid: 0}: as spawn, but the program
           is started only when the namespace first sends a frame out of the tap (tap_fd, made by
           the bridge worker with a packet socket onto it, sender_fd: ondemand.py)
  query    {id}                                   -> {pid}: the program's pid, 0 while standing
           by, null once stopped
  kill     {id}                                   -> stops a spawned process
  userns   {uid_map, gid_map, newuidmap?, newgidmap?, deny_setgroups}
                                                  -> a new user namespace (fd)
  network  {user_fd?, bridge, subnet, internal, host_access, mapping, path?}
                                                  -> a socket to its bridge worker (fd): a
           forked process that makes the network's namespace and stays in it
           (bridge_worker.py). Answered once forked: the worker's first message
           on that socket is its ready one ({} and the namespace's fd, or
           {error}), for the caller to wait for, not the helper.

When the nsbox process closes its end (it exited, crashed or was killed),
the helper kills every process it spawned and exits.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any

READY_TIMEOUT = 10.0

import ondemand  # noqa: E402
from nscalls import (CLONE_NEWNET, CLONE_NEWUSER, MAX_FDS, MAX_MESSAGE, PR_SET_NAME,  # noqa: E402
                     PR_SET_PDEATHSIG, describe as _describe, libc as _libc, send_reply, setns, unshare)


class Refused(Exception):
    """A request that cannot be served; the message goes back to the caller."""


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


# Runs a program with the same parent-death signal, set in C after a vfork
# (csrc/tied/main.c): a preexec_fn would make Python fork this whole
# process and run Python in the child, ~3 ms per program.
TIED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nsbox-tied")


def op_spawn(req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
    """Starts a long-running program and waits until it says it is ready.

    In argv, "{fd0}", "{fd1}"... stand for the request's descriptors as the
    program sees them, "{ready_fd}" for the write end of the readiness pipe.
    ready: "line" (it writes a line there, as pasta's pid file), "byte" (as
    slirp4netns --ready-fd) or "none".
    """
    proc = start_program(req["argv"], req.get("ready", "none"), [fds[i] for i in req.get("fds", [])])
    watch = os.dup(fds[req["watch_fd"]]) if req.get("watch_fd") is not None else None
    ident = next(_next_id)
    spawned[ident] = Spawned(proc, watch)
    return {"id": ident, "pid": proc.pid}, []


def start_program(template: list[str], ready: str, passed: list[int]) -> subprocess.Popen[bytes]:
    """op_spawn's program, started and ready, or Refused."""
    ready_r, ready_w = os.pipe()
    err_r, err_w = os.pipe()
    names = {f"{{fd{n}}}": str(fd) for n, fd in enumerate(passed)}
    names["{ready_fd}"] = str(ready_w)
    argv = [_substitute(a, names) for a in template]
    try:
        proc = subprocess.Popen([TIED, str(os.getpid()), *argv], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err_w, pass_fds=[*passed, ready_w], close_fds=True)
    except OSError as e:  # nsbox-tied itself (the program's own failure comes on stderr)
        raise Refused(f"cannot start {argv[0]}: {TIED}: {e.strerror}") from None
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
    return proc


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
    waiting = standing.pop(int(req["id"]), None)
    if waiting is not None:
        waiting.close()
    return {}, []


def op_query(req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
    ident = int(req["id"])
    if ident in standing:
        return {"pid": 0}, []
    entry = spawned.get(ident)
    return {"pid": entry.proc.pid if entry is not None and entry.proc.poll() is None else None}, []


class Standby:
    """A program to start when its namespace first sends a frame out of the
    tap made for it (ondemand.py): the tap, a packet socket onto it, the
    descriptors the program will be given, and the pidfd that ends it all."""

    def __init__(self, req: dict[str, Any], fds: list[int]) -> None:
        self.argv: list[str] = req["argv"]
        self.ready: str = req.get("ready", "none")
        self.tap = self.sender = -1
        self.passed: list[int] = []
        self.watch: int | None = None
        try:
            self.tap, self.sender = os.dup(fds[req["tap_fd"]]), os.dup(fds[req["sender_fd"]])
            os.set_blocking(self.tap, False)
            self.passed = [os.dup(fds[i]) for i in req.get("fds", [])]
            if req.get("watch_fd") is not None:
                self.watch = os.dup(fds[req["watch_fd"]])
        except BaseException:
            self.close()
            raise

    def wake(self) -> Spawned:
        """Starts the program on the tap and hands it the frames that woke
        us; the tap is let go of first (it takes one reader at a time)."""
        frames = ondemand.read_frames(self.tap)
        os.close(self.tap)
        self.tap = -1
        try:
            proc = start_program(self.argv, self.ready, self.passed)
            ondemand.send_frames(self.sender, frames)
            spawned_entry = Spawned(proc, self.watch)
            self.watch = None
            return spawned_entry
        finally:
            self.close()

    def close(self) -> None:
        for fd in [self.tap, self.sender, *self.passed, *([self.watch] if self.watch is not None else [])]:
            if fd >= 0:
                os.close(fd)
        self.tap = self.sender = -1
        self.passed, self.watch = [], None


standing: dict[int, Standby] = {}


def op_standby(req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
    """spawn's program, started on the namespace's first frame out."""
    ident = next(_next_id)
    standing[ident] = Standby(req, fds)
    return {"id": ident, "pid": 0}, []


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


def op_network(req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
    """Forks the network's bridge worker (bridge_worker.py) and answers with
    a socket to it at once: the worker's setup (~10 ms) runs while this
    helper serves other requests, and the caller reads the worker's ready
    message itself (nsbox/net/bridge.py), so that networks made at once
    are made side by side.

    A network of this process: the worker stays this helper's child (reaped
    on SIGCHLD) and dies with it (PR_SET_PDEATHSIG) or when its socket
    closes. A named one (``path`` given, where it listens) outlives us: it
    is forked twice, so that it is nobody's child here."""
    import bridge_worker  # and pyroute2 with it, once: every worker inherits them

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # SIGCHLD held until the pid is recorded, so that the reaper knows it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    try:
        pid = os.fork()
        if pid == 0:
            try:  # never back into the helper's loop, whatever fails
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
                ours.close()
                if not req.get("path"):
                    _pdeathsig()
                elif os.fork() != 0:
                    os._exit(0)
                bridge_worker.run(theirs, req, fds)
            finally:
                os._exit(1)
        workers.add(pid)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    theirs.close()
    return {}, [ours.detach()]


workers: set[int] = set()


def _reap_workers(signum: int, frame: object) -> None:
    for pid in list(workers):  # only these: pasta and slirp4netns are subprocess's to reap
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                workers.discard(pid)
        except ChildProcessError:
            workers.discard(pid)


IN_HELPER = {"spawn": op_spawn, "standby": op_standby, "query": op_query, "kill": op_kill,
             "userns": op_userns, "network": op_network}


# ---- the loop -------------------------------------------------------------

# The sequence number of the request being handled (requests are handled
# one at a time), echoed in its reply: a client whose earlier request was
# cancelled while waiting tells that late reply from the one it waits for.
_seq: Any = None


def reply(chan: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
    send_reply(chan, message, fds, _seq)


def serve(chan: socket.socket) -> None:
    while True:
        poller = select.poll()
        poller.register(chan, select.POLLIN)
        watched = {s.watch: ident for ident, s in [*spawned.items(), *standing.items()] if s.watch is not None}
        taps = {s.tap: ident for ident, s in standing.items()}
        for fd in [*watched, *taps]:
            poller.register(fd, select.POLLIN)
        events = dict(poller.poll(20 if dying else None))
        dying[:] = [p for p in dying if p.poll() is None]
        for fd in watched:
            if fd in events:  # a watched process (a sandbox's init) exited
                ident = watched[fd]
                if ident in spawned:
                    spawned.pop(ident).stop(wait=False)
                else:
                    standing.pop(ident).close()
        for fd, ident in taps.items():
            if fd in events and ident in standing:  # its namespace reaches out
                wake(ident)
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
        except (ConnectionResetError, BrokenPipeError):
            return  # the nsbox process went while we answered (a Ctrl-C): nothing to say
        finally:
            for fd in fds:
                os.close(fd)


def wake(ident: int) -> None:
    """Starts a standing-by program; a failure has nobody to answer, so it
    is said on stderr (the nsbox process's), and that sandbox stays without
    outbound traffic."""
    try:
        spawned[ident] = standing.pop(ident).wake()
    except (Refused, OSError) as e:
        print(f"nsbox: starting user-mode networking on a sandbox's first packet out failed: "
              f"{e if isinstance(e, Refused) else _describe(e)}", file=sys.stderr, flush=True)


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
    signal.signal(signal.SIGCHLD, _reap_workers)
    chan = socket.socket(fileno=int(sys.argv[1]))
    try:
        serve(chan)
    finally:
        for entry in spawned.values():
            entry.stop()


if __name__ == "__main__":
    main()
