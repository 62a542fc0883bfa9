"""The C side, seen from Python: the zygote that creates sandboxes.

Everything that runs between clone and exec is C (csrc/create/, in the
nsbox-create zygote this module starts once per process); this module packs
the steps Python composed (nsbox/plan/steps.py) into the structures create.h
defines, sends them, and reads the zygote's answer.
"""

from __future__ import annotations

import array
import errno
import functools
import os
import socket
import struct
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from ..init import fdwait
from .._native import ffi, lib
from ..errors import SandboxSetupError
from ..host.fdpass import recv_fds
from ..plan.steps import PATH_FD_BASE, Kind, Step

if TYPE_CHECKING:
    from ..host.idmap import IdMap, IdMaps

INIT_BINARY = Path(__file__).resolve().parent.parent / "nsbox-init"
CREATE_HELPER = os.fsencode(Path(__file__).resolve().parent.parent / "nsbox-create")

# Kernel flags, as the system headers define them: the cffi module takes
# their values from the C compiler (KERNEL_CONSTANTS in nsbox/_build_ffi.py).
# Namespaces, for clone3.
CLONE_NEWNS: int = lib.CLONE_NEWNS
CLONE_NEWCGROUP: int = lib.CLONE_NEWCGROUP
CLONE_NEWUTS: int = lib.CLONE_NEWUTS
CLONE_NEWIPC: int = lib.CLONE_NEWIPC
CLONE_NEWUSER: int = lib.CLONE_NEWUSER
CLONE_NEWPID: int = lib.CLONE_NEWPID
CLONE_NEWNET: int = lib.CLONE_NEWNET

# mount(2) flags.
MS_RDONLY: int = lib.MS_RDONLY
MS_NOSUID: int = lib.MS_NOSUID
MS_NODEV: int = lib.MS_NODEV
MS_NOEXEC: int = lib.MS_NOEXEC
MS_BIND: int = lib.MS_BIND
MS_REC: int = lib.MS_REC
MS_PRIVATE: int = lib.MS_PRIVATE

# open_tree(2) and mount_setattr(2).
AT_RECURSIVE: int = lib.AT_RECURSIVE
MOUNT_ATTR_RDONLY: int = lib.MOUNT_ATTR_RDONLY
MOUNT_ATTR_NOSUID: int = lib.MOUNT_ATTR_NOSUID
MOUNT_ATTR_NODEV: int = lib.MOUNT_ATTR_NODEV
MOUNT_ATTR_NOEXEC: int = lib.MOUNT_ATTR_NOEXEC


# The step vocabulary is plain Python (nsbox/plan/steps.py); its numbers must be
# the C header's.
for _kind in Kind:
    if getattr(lib, f"NSBOX_STEP_{_kind.name}") != _kind.value:
        raise ImportError(f"nsbox: step kind {_kind.name} differs between nsbox/plan/steps.py and csrc/common/create.h")
if lib.NSBOX_PATH_FD_BASE != PATH_FD_BASE:
    raise ImportError("nsbox: NSBOX_PATH_FD_BASE differs between nsbox/plan/steps.py and csrc/common/create.h")


def clone_flags(namespaces: Iterable[str]) -> int:
    """clone3 flags for namespaces named as in <linux/sched.h> (CLONE_NEW*)."""
    return _bits(frozenset(namespaces))


@functools.lru_cache(maxsize=256)
def _bits(names: frozenset[str]) -> int:
    """Kernel flags named in a step, valued by the C headers."""
    value = 0
    for name in names:
        value |= getattr(lib, name)
    return value


# C copies of the strings clone requests use, kept across requests: most
# (mount types, options, device paths) are the same in every sandbox's.
# The C side only reads them.
_c_strings: dict[str | bytes, object] = {}
_C_STRINGS_MAX = 4096


def _c_string(s: str | bytes | None) -> object:
    if s is None:
        return ffi.NULL
    p = _c_strings.get(s)
    if p is None:
        if len(_c_strings) >= _C_STRINGS_MAX:
            _c_strings.clear()
        p = _c_strings[s] = ffi.new("char[]", os.fsencode(s) if isinstance(s, str) else s)
    return p


class _Keep:
    """Holds the cffi allocations a clone request points to until it is packed."""

    def __init__(self) -> None:
        self.objs: list[object] = []

    def str(self, s: str | bytes | None) -> object:
        p = _c_string(s)
        self.objs.append(p)
        return p

    def strv(self, items: Sequence[str | bytes]) -> object:
        arr = ffi.new("char *[]", len(items) + 1)
        for i, s in enumerate(items):
            arr[i] = self.str(s)
        arr[len(items)] = ffi.NULL
        self.objs.append(arr)
        return arr


# Each step's initializer row, by the step object: plans copied from a
# template share all but a few steps (plan.replacing), so a request's ~60 rows
# are mostly found here. The step is kept with its row so that its id is
# not reused while the row is.
_step_rows: dict[int, tuple[Step, tuple[object, ...]]] = {}
_STEP_ROWS_MAX = 4096


def _step_row(s: Step) -> tuple[object, ...]:
    found = _step_rows.get(id(s))
    if found is not None and found[0] is s:
        return found[1]
    row = (int(s.kind), s.slot, s.mode, _bits(s.flags), _bits(s.attr_set), _bits(s.attr_clr),
           _c_string(s.a), _c_string(s.b), _c_string(s.c), _c_string(s.d))
    if len(_step_rows) >= _STEP_ROWS_MAX:
        _step_rows.clear()
    _step_rows[id(s)] = (s, row)
    return row


class CloneError(OSError):
    """Cloning or spawning a process failed with this errno: not a file
    operation's, so ENOSPC is a namespace limit, EAGAIN a process limit
    (nsbox/create/exhaustion.py)."""


# What a clone fails with when a limit is reached (see CloneError).
LIMIT_ERRNOS = frozenset({errno.EAGAIN, errno.ENOSPC, errno.ENOMEM, errno.EMFILE, errno.ENFILE})


class _Zygote:
    """The nsbox-create process that clones sandboxes for this process."""

    def __init__(self) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = lib.nsbox_start_zygote(CREATE_HELPER, theirs.fileno())
        finally:
            theirs.close()
        if pid < 0:
            self.sock.close()
            if -pid in LIMIT_ERRNOS:  # a limit of processes or memory (nsbox/create/exhaustion.py)
                raise CloneError(-pid, f"starting nsbox-create: {os.strerror(-pid)}")
            raise SandboxSetupError(f"cannot start {os.fsdecode(CREATE_HELPER)}: {os.strerror(-pid)}",
                                    hint="reinstall nsbox (`pip install .` in its checkout builds that helper)")
        self.pid = pid
        self.owner = os.getpid()

    def close(self) -> None:
        self.sock.close()  # EOF: it exits
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()


def _forget_zygote_after_fork() -> None:
    # A forked child must not use its parent's zygote: CLONE_PARENT would
    # make the parent, not the child, the sandbox's parent. Nor keep a
    # holder's or sub-zygote's socket open: they exit at EOF.
    global _zygote
    if _zygote is not None:
        _zygote.sock.close()
    _zygote = None
    for z in list(_closers):
        z.sock.close()
    _closers.clear()
    _holders.clear()


os.register_at_fork(after_in_child=_forget_zygote_after_fork)


def zygote_pid() -> int | None:
    """The pid of this process's nsbox-create zygote, if it runs."""
    return _zygote.pid if _zygote is not None and _zygote.owner == os.getpid() else None


def helper_pids() -> set[int]:
    """This process's long-lived nsbox-create processes: the zygote and
    its holders (children of this process that outlive every sandbox)."""
    pids = {h.pid for h in _holders.values() if h.owner == os.getpid()}
    zygote = zygote_pid()
    return pids | ({zygote} if zygote else set())


def _zygote_socket(restart: bool = False) -> socket.socket:
    global _zygote
    with _zygote_lock:
        if restart and _zygote is not None:
            _zygote.close()
            _zygote = None
        if _zygote is None:
            _zygote = _Zygote()
        return _zygote.sock


class _SubZygote:
    """A zygote the zygote forked for a purpose (see Holder, SubZygote): a
    child of this process; close() ends it (EOF on its socket) and reaps it."""

    pid = 0

    def _request(self, byte: bytes, fds: Sequence[int]) -> socket.socket:
        """Asks the zygote for it; returns the socket its reply comes on."""
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            ours, reply = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except BaseException:
            self.sock.close()
            theirs.close()
            raise
        try:
            _send(byte, [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                          array.array("i", [reply.fileno(), theirs.fileno(), *fds]))])
        except BaseException:
            self.sock.close()
            ours.close()
            raise
        finally:
            theirs.close()
            reply.close()
        self.owner = os.getpid()
        return ours

    def alive(self) -> bool:
        # A killed one closes its socket before it can be reaped: a hang-up
        # on ours means it is dying, though waitpid does not say so yet.
        if fdwait.readable_now(self.sock.fileno()):
            return False
        try:
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            return False

    def close(self) -> None:
        _closers.discard(self)
        if self.sock.fileno() >= 0:
            self.sock.close()  # EOF: it exits
            if self.owner == os.getpid() and self.pid > 0:
                try:
                    os.waitpid(self.pid, 0)
                except ChildProcessError:
                    pass


class Holder(_SubZygote):
    """A sub-zygote in a user namespace of the owner's, with the owner's id
    maps (written once, by newuidmap for a subordinate range), in which every
    sandbox gets a nested user namespace whose maps the holder writes
    directly: no setuid helper per sandbox (see hold() in
    csrc/create/main.c). One per id mapping per process, kept until exit."""

    def __init__(self, idmaps: IdMaps) -> None:
        memfd = request_memfd(clone_flags=0, steps=[], idmaps=idmaps, keep_fds=[], exec_fd=-1, argv=["nsbox-holder"],
                              envp=[], keep_stdio=False, new_session=False)
        try:
            ours = self._request(b"h", [memfd])
        finally:
            os.close(memfd)
        try:
            with ours:
                self.pid, pidfd = read_spawn_reply(ours)
            if pidfd >= 0:
                os.close(pidfd)  # waited for by pid: the holder is this process's child
        except IdMapError as e:
            self.pid = e.pid
            self.close()
            raise
        except BaseException:
            self.close()
            raise
        _closers.add(self)


_holders: dict[tuple[str, str], Holder] = {}
_holder_lock = threading.Lock()
_holder_failed: set[tuple[str, str]] = set()
_closers: "weakref.WeakSet[_SubZygote]" = weakref.WeakSet()


def holder(mapping: "IdMap") -> Holder | None:
    """This process's holder for `mapping`, started on first use. None where
    sandbox root is not the owner's own uid and gid (real root writes maps
    directly anyway: a holder's root would not be the owner), or where this
    host cannot have one: the caller then creates sandboxes the direct way."""
    if os.environ.get("NSBOX_HOLDER", "1") == "0" or mapping.host_root != (os.geteuid(), os.getegid()):
        return None
    idmaps = mapping.how_to_write()
    key = (idmaps.uid_map, idmaps.gid_map)
    with _holder_lock:
        h = _holders.get(key)
        if h is not None and h.owner == os.getpid():
            if h.alive():
                return h
            h.close()  # killed: start another
        if key in _holder_failed:
            return None
        try:
            h = _holders[key] = Holder(idmaps)
        except OSError as e:
            if e.errno in LIMIT_ERRNOS:
                raise  # a limit reached (nsbox/create/exhaustion.py): the direct way would reach it too
            _holder_failed.add(key)  # e.g. nested user namespaces refused: the direct way works alike
            return None
        return h


class SubZygote(_SubZygote):
    """A zygote inside another sandbox's user and network namespaces (see
    enter() in csrc/create/main.c): the sandboxes it creates share both.
    Owned by the caller: close() ends and reaps it."""

    def __init__(self, userns_fd: int, netns_fd: int) -> None:
        self._enter([userns_fd, netns_fd])

    def _enter(self, fds: list[int]) -> None:
        ours = self._request(b"j", fds)
        with ours:
            data, fds = recv_fds(ours, REPLY.size, 1)
        for fd in fds:
            os.close(fd)
        if len(data) < REPLY.size:
            self.sock.close()
            raise OSError(errno.EIO, "nsbox-create stopped before answering")
        self.pid, err, _, _ = REPLY.unpack_from(data)
        _closers.add(self)
        if err:
            self.close()
            raise OSError(err, f"entering the namespaces of another sandbox: {os.strerror(err)}")


class JoinedHolder(Holder, SubZygote):
    """A holder made by entering an existing holder's user namespace (a
    named service network's, kept by its bridge worker), so that sandboxes
    of any process of the owner can be created in it, as its members must.
    Owned by the caller: close() ends and reaps it."""

    def __init__(self, userns_fd: int) -> None:
        self._enter([userns_fd])


def _send(byte: bytes, anc: list[tuple[int, int, array.array[int]]], sock: socket.socket | None = None) -> None:
    """Sends one request to `sock`, or to this process's zygote (started,
    or restarted once if it died)."""
    if sock is not None:
        sock.sendmsg([byte], anc)
        return
    for attempt in (0, 1):
        try:
            _zygote_socket(restart=attempt > 0).sendmsg([byte], anc)
            return
        except (BrokenPipeError, ConnectionResetError):
            if attempt:
                raise  # a fresh zygote died at once


def request_spawn(*, error_fd: int, sync_fd: int, via: _SubZygote | None = None, packed: bytes | None = None,
                  **request: Any) -> socket.socket:
    """Asks the zygote to clone the process `request` describes
    (request_memfd's arguments); returns the socket its reply arrives on
    (read it with read_spawn_reply). `packed`: what pack_request() gave for
    `request`, sent as it is. The process waits for one byte on the pipe
    whose read end is `sync_fd` before it runs its steps. Given that pipe's
    write end as `go_fd`, the zygote writes the byte itself once the id
    maps are written; else write it (go()) once the reply came and the
    caller's hooks ran. With `go_fd` and `host_go`, the process waits for a
    second byte, the caller's (go(), at any time)."""
    if packed is None:
        memfd = request_memfd(**request)
    else:
        memfd = os.memfd_create("nsbox-request", os.MFD_CLOEXEC)
        try:
            if os.write(memfd, packed) != len(packed):
                raise OSError(errno.EIO, "writing the clone request was cut short")
        except BaseException:
            os.close(memfd)
            raise
    try:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except BaseException:
        os.close(memfd)
        raise
    try:
        go_fd, exec_fd = request.get("go_fd", -1), request["exec_fd"]
        fds = [theirs.fileno(), memfd, error_fd, sync_fd] + ([go_fd] if go_fd >= 0 else [])
        fds += [exec_fd] if exec_fd >= 0 else []
        fds += [fd for fd in request["keep_fds"] if fd >= 0]
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        _send(b"s", anc, via.sock if via is not None else None)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
        os.close(memfd)
    return ours


def pack_request(**request: Any) -> bytes:
    """The clone request request_spawn() would send for request_memfd's
    arguments."""
    memfd = request_memfd(**request)
    try:
        return os.pread(memfd, os.fstat(memfd).st_size, 0)
    finally:
        os.close(memfd)


def request_memfd(
    *,
    clone_flags: int,
    steps: Sequence[Step],
    idmaps: IdMaps,
    keep_fds: Sequence[int],
    exec_fd: int,
    argv: Sequence[str],
    envp: Sequence[str],
    keep_stdio: bool,
    new_session: bool,
    lock_maps: tuple[str, str] | None = None,
    lock_slot: int = 0,
    go_fd: int = -1,
    host_go: bool = False,
) -> int:
    """The clone request of the process described (struct
    nsbox_clone_request), serialized by nsbox_clone_request_pack into a new
    memfd. Of the descriptors, only which ones are given counts."""
    keep = _Keep()
    # One initializer list (field order of struct nsbox_step): cffi fills
    # the array in C, where setting fields one by one costs ~0.2 ms a request.
    rows = [_step_row(s) for s in steps]
    keep.objs.append(rows)  # the C strings they point to
    c_steps = ffi.new("struct nsbox_step[]", rows or 1)
    req = ffi.new("struct nsbox_clone_request *")
    req.clone_flags = clone_flags
    req.steps = c_steps
    req.nsteps = len(steps)
    if len(keep_fds) > 4:
        raise ValueError("at most 4 descriptors can be passed on")
    for i, fd in enumerate(keep_fds):
        req.keep_fds[i] = fd
    req.nkeep = len(keep_fds)
    req.exec_fd = 0 if exec_fd >= 0 else -1
    req.go_fd = 0 if go_fd >= 0 else -1
    req.host_go = int(host_go)
    req.argv = keep.strv(argv)
    req.envp = keep.strv(envp)
    req.keep_stdio = int(keep_stdio)
    req.new_session = int(new_session)
    if lock_maps is not None:
        req.lock_uid_map = keep.str(lock_maps[0])
        req.lock_gid_map = keep.str(lock_maps[1])
    req.lock_slot = lock_slot
    req.uid_map, req.gid_map = keep.str(idmaps.uid_map), keep.str(idmaps.gid_map)
    req.newuidmap, req.newgidmap = keep.str(idmaps.newuidmap), keep.str(idmaps.newgidmap)
    req.deny_setgroups = int(idmaps.deny_setgroups)
    memfd = os.memfd_create("nsbox-request", os.MFD_CLOEXEC)
    rc = lib.nsbox_clone_request_pack(req, memfd)
    if rc < 0:
        os.close(memfd)
        raise OSError(-rc, os.strerror(-rc))
    return memfd


class IdMapError(OSError):
    """Writing the id maps of process `pid` failed; `message` holds
    newuidmap's complaint. The zygote killed the process; whoever asked
    for it still reaps it."""

    def __init__(self, err: int, message: str, pid: int) -> None:
        super().__init__(err, os.strerror(err))
        self.message = message
        self.pid = pid


REPLY = struct.Struct("=4i")


def read_spawn_reply(sock: socket.socket) -> tuple[int, int]:
    """(pid, pidfd) of the cloned process, which is running its setup steps.

    Raises OSError if cloning failed, IdMapError if writing its id maps
    failed (the process is then killed; the caller still reaps the
    exception's `pid`).
    """
    data, fds = recv_fds(sock, REPLY.size + lib.NSBOX_ZYGOTE_MSG_MAX, 1)
    if len(data) < REPLY.size:
        for fd in fds:
            os.close(fd)
        raise OSError(errno.EIO, "nsbox-create stopped before answering")
    pid, err, stage, msglen = REPLY.unpack_from(data)
    pidfd = fds[0] if fds else -1
    if stage == lib.NSBOX_ZYGOTE_IDMAP:
        if pidfd >= 0:
            os.close(pidfd)
        raise IdMapError(err, data[REPLY.size : REPLY.size + msglen].decode(errors="replace").strip(), pid)
    if pid <= 0:
        raise CloneError(err, os.strerror(err))
    return pid, pidfd


def go(go_w: int) -> None:
    """Lets a cloned process run its steps."""
    try:
        os.write(go_w, b"g")
    except BrokenPipeError:
        pass  # it failed before it waited; its error report says why


def spawn(**kwargs: object) -> tuple[int, int]:
    """request_spawn + read_spawn_reply, blocking, the zygote sending the
    go (for synchronous callers without hooks)."""
    go_r, go_w = os.pipe2(os.O_CLOEXEC)
    try:
        sock = request_spawn(sync_fd=go_r, go_fd=go_w, **kwargs)  # type: ignore[arg-type]
    finally:
        os.close(go_r)  # the zygote holds its own copies once the request went
        os.close(go_w)
    with sock:
        return read_spawn_reply(sock)
