"""Launching a sandbox: its plan carried out through the zygote, up to a
running init.

1. The zygote (nsbox/create/zygote.py) clones the first process into the plan's
   namespaces and writes its id maps; the process waits.
2. The host runs the plan's hooks (cgroup) while it waits, then writes the
   "go" byte. A plan without hooks has the zygote write it right after the
   maps, so that the setup does not wait for the host to wake up. Host work
   the setup needs (`before_go`: the writable layer) is done while the
   zygote clones; the process then waits for the host's go too.
3. The process runs its steps and execs nsbox-init, which finds its lifeline
   (nsbox/create/lifeline.py), its listening socket and the locked
   namespaces at fds 3-6 (NSBOX_FD_* in csrc/common/protocol.h). A failed
   step is reported on the error pipe, whose EOF without a report means the
   init runs. The host then connects to the listening socket like any
   client.
"""

from __future__ import annotations

import errno
import os
import select
import signal
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import anyio

from ..init import fdwait
from . import exhaustion, hostcheck, lifeline, zygote
from ..errors import NsboxError, SandboxSetupError
from ..host import live, rlimits
from ..host.idmap import IdMaps
from ..plan.plan import ParentHook, Plan
from ..plan.steps import Kind


# Inits being waited for through a pidfd (reap), at most
# rlimits.descriptor_share(): beyond that, a wait polls without one.
_waiting = 0


@dataclass
class Launched:
    """What launch() leaves to its caller, who owns all of it."""

    pid: int = 0  # the init: a child of this process, so its pid is ours until reaped
    # Held while the sandbox is made (its network watches it), then closed:
    # a running sandbox costs this process no descriptor.
    pidfd: int = -1
    cleanups: list[Callable[[], None]] = field(default_factory=list)  # the plan's, for after the init exits
    started: int | None = None  # the init's start time (start_time())

    @property
    def exited(self) -> bool:
        if self.pidfd >= 0:
            return fdwait.readable_now(self.pidfd)
        if not self.pid:
            return True
        try:  # WNOWAIT: looks without reaping
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped by someone else
            return True

    def start_time(self) -> int | None:
        """The init's start time, read once, while its pidfd pins the pid:
        what tells it from a process that gets the pid if something else in
        this process reaps the init (a waitpid(-1) of the user's) before
        reap() does."""
        if self.started is None and self.pid and self.pidfd >= 0:
            self.started = live.process_start_time(self.pid)
        return self.started

    def release_pidfd(self) -> None:
        if self.pidfd >= 0:
            self.start_time()
            os.close(self.pidfd)
            self.pidfd = -1

    def _still_ours(self) -> bool:
        """False only when shown: the pid names no process, or one that
        started at another time. Unable to tell (out of descriptors, say),
        it is taken to be the init, as before the pidfd was closed."""
        if self.started is None:
            return True
        try:
            return live.read_start_time(self.pid)[1] == self.started  # a zombie still: not reaped
        except (FileNotFoundError, ProcessLookupError):
            return False
        except (OSError, IndexError, ValueError):
            return True

    def _open_pidfd(self) -> int | None:
        """A pidfd of the init, our unreaped child: its pid names it until we
        reap it (unless something else in this process reaps children it
        did not make, which sets self.pid to 0 where shown). -1 if there is
        none; None if there is no descriptor to spare for one."""
        pidfd, self.pidfd = self.pidfd, -1
        if pidfd >= 0 or not self.pid:
            return pidfd
        try:
            pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            return -1  # reaped by someone else
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            return None
        if not self._still_ours():  # reaped by someone else, the pid reused
            os.close(pidfd)
            self.pid = 0
            return -1
        return pidfd

    async def reap(self, wait: float) -> None:
        """Waits up to `wait` seconds for the init to exit, kills it then,
        and reaps it."""
        global _waiting
        busy = self.pidfd < 0 and self.pid and _waiting >= rlimits.descriptor_share()  # a thousand closes at once
        pidfd = None if busy else self._open_pidfd()
        if pidfd is None:
            await self._reap_without_descriptor(wait)  # then reaped by pid, below
        elif pidfd >= 0:
            _waiting += 1
            try:
                if not await fdwait.readable(pidfd, wait):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    await fdwait.readable(pidfd)
                try:  # reaped through the pidfd: no pid that another process may have by now
                    os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
                except ChildProcessError:
                    pass  # reaped by someone else
            finally:
                _waiting -= 1
                os.close(pidfd)
            self.pid = 0
        self._reap_by_pid()

    def _reap_by_pid(self) -> None:
        if self.pid and self._still_ours():  # (else the pid is another process's now)
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
        self.pid = 0

    def reap_blocking(self, wait: float) -> None:
        """reap() on a thread that may block (the sweeper's, for a sandbox
        closed without waiting)."""
        pidfd = self._open_pidfd()
        if pidfd is None:  # no descriptor to spare: polls
            deadline = time.monotonic() + wait
            while not self.exited and time.monotonic() < deadline:
                time.sleep(0.01)
            if not self.exited and self._still_ours():
                os.kill(self.pid, signal.SIGKILL)
        elif pidfd >= 0:
            try:
                poll = select.poll()
                poll.register(pidfd, select.POLLIN)
                if not poll.poll(wait * 1000):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                os.waitid(os.P_PIDFD, pidfd, os.WEXITED)  # blocks until it is gone
            except ChildProcessError:
                pass  # reaped by someone else
            finally:
                os.close(pidfd)
            self.pid = 0
        self._reap_by_pid()

    async def _reap_without_descriptor(self, wait: float) -> None:
        """reap() when this process has no descriptor to spare: polls."""
        deadline = time.monotonic() + wait
        while not self.exited and time.monotonic() < deadline:
            await anyio.sleep(0.01)
        if not self.exited:
            if not self._still_ours():  # reaped by someone else, the pid reused
                self.pid = 0
                return
            os.kill(self.pid, signal.SIGKILL)
            while not self.exited:
                await anyio.sleep(0.01)


async def launch(plan: Plan, launched: Launched, *, sandbox_id: str, socket_path: Path, layer: Path,
                 on_cloned: Callable[[], None] | None = None, before_go: Callable[[], None] | None = None) -> None:
    """Creates the sandbox `plan` describes; fills `launched` as it goes, so
    that a caller can tear down what exists whatever fails. `on_cloned` runs
    once the pid is known, while the setup steps run; `before_go` once the
    zygote has the request, before the setup steps run (if it fails, the
    process exits without running them)."""
    launched.cleanups.extend(plan.cleanups)  # whatever fails from here, the caller runs them
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        go_r, go_w = os.pipe2(os.O_CLOEXEC)
    except BaseException:
        os.close(err_r)
        os.close(err_w)
        raise
    zygote_goes = not plan.hooks  # right after the maps, without waiting for us
    failed: BaseException | None = None
    sub: zygote.SubZygote | None = None  # ours to close
    via: zygote.SubZygote | zygote.Holder | None = None
    try:
        try:
            if plan.join is not None:
                try:
                    via = sub = zygote.SubZygote(*plan.join)
                except OSError as e:
                    raise SandboxSetupError(f"cannot join the other sandbox's network: {e.strerror}") from None
            elif plan.userns is not None:
                try:
                    via = sub = zygote.JoinedHolder(plan.userns)
                except OSError as e:
                    raise SandboxSetupError(f"cannot enter the network's user namespace: {e.strerror}") from None
            elif "CLONE_NEWUSER" in plan.namespaces:
                # Subuid and single modes: a holder saves writing maps with
                # newuidmap per sandbox (None as real root).
                via = zygote.holder(plan.idmap)
            reply = _request(plan, launched, sandbox_id, socket_path, err_w, go_r, via,
                             go_w if zygote_goes else -1, host_go=zygote_goes and before_go is not None)
        finally:
            os.close(err_w)
            os.close(go_r)
        if before_go is not None:
            try:
                before_go()
            except BaseException as e:
                failed = e  # raised once the reply has said which process to reap
                os.close(go_w)  # the process sees EOF instead of its go and exits
                go_w = -1
            else:
                if zygote_goes:  # else after the hooks
                    zygote.go(go_w)
        with reply:
            try:
                await fdwait.readable(reply.fileno())
            except BaseException:
                # Cancelled: the process may run already (the zygote gives
                # it its go when there are no hooks). Its pid, read still,
                # is what lets the caller end it; else it would live on,
                # found by nothing, until this process exits.
                with anyio.CancelScope(shield=True), anyio.move_on_after(REPLY_WAIT):
                    await fdwait.readable(reply.fileno())
                    _note_pid(reply, launched)
                raise
            try:
                launched.pid, launched.pidfd = zygote.read_spawn_reply(reply)
            except zygote.IdMapError as e:
                launched.pid = e.pid  # killed by the zygote; the caller reaps it
                raise SandboxSetupError(
                    f"writing the id maps of the sandbox failed: {e.message or e.strerror}",
                    hint="check your /etc/subuid and /etc/subgid entries, or use id_mapping='single'",
                ) from None
            except OSError as e:
                raise exhaustion.of_clone(e.errno) or hostcheck.clone_failed(e.errno) from None
            finally:
                if sub is not None:
                    sub.close()  # one sandbox per sub-zygote: it exits at EOF
        if failed is not None:
            raise failed
        if plan.hooks:
            await plan.run_hooks(launched.pid)
            zygote.go(go_w)
        if on_cloned is not None:
            on_cloned()
        report = await _setup_alongside(plan.alongside, launched.pid, err_r)
    finally:
        if go_w >= 0:
            os.close(go_w)
        os.close(err_r)
        if sub is not None:
            sub.close()
    if report:
        step, err = struct.unpack("=ii", report[:8])
        raise setup_error(plan, step, err, layer)


# How long a cancelled launch still waits for the zygote's reply (sent
# right after the clone): the pid of what it made.
REPLY_WAIT = 5.0


def _note_pid(reply: socket.socket, launched: Launched) -> None:
    """The spawned process's pid (and pidfd) into `launched`, if the reply
    names one."""
    try:
        launched.pid, launched.pidfd = zygote.read_spawn_reply(reply)
    except zygote.IdMapError as e:
        launched.pid = e.pid
    except OSError:
        pass  # nothing was made


async def _setup_alongside(hooks: list[ParentHook], pid: int, err_r: int) -> bytes:
    """Waits for the child's setup report while `hooks` run; a failed step
    is reported first, else a failed hook is raised."""
    if not hooks:
        await fdwait.readable(err_r)
        return os.read(err_r, 64)
    failed: list[Exception] = []

    async def run(hook: ParentHook) -> None:
        try:
            await hook(pid)
        except Exception as e:  # not cancellation: that ends the task group
            failed.append(e)

    async with anyio.create_task_group() as tg:
        for hook in hooks:
            tg.start_soon(run, hook)
        await anyio.wait_readable(err_r)
        report = os.read(err_r, 64)
    if not report and failed:
        raise failed[0]
    return report


def _request(plan: Plan, launched: Launched, sandbox_id: str, socket_path: Path, err_w: int,
             go_r: int, via: zygote.SubZygote | zygote.Holder | None, go_w: int, host_go: bool) -> socket.socket:
    listener = None
    init_fd = -1
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            listener.bind(os.fspath(socket_path))
        except OSError as e:
            raise exhaustion.of_errno(e.errno, socket_path) or SandboxSetupError(
                f"cannot create the sandbox's socket {socket_path}: {e.strerror}",
                hint="set NSBOX_STATE_DIR to a shorter path") from None
        listener.listen(64)
        init_fd = os.open(zygote.INIT_BINARY, os.O_RDONLY | os.O_CLOEXEC)
        idmaps = plan.idmap.how_to_write()
        if isinstance(via, zygote.Holder):
            # Nested in the holder's namespace, which has the owner's maps:
            # every id maps to itself, written by the holder.
            uid_map, gid_map = plan.idmap.nested_identity()
            idmaps = IdMaps(uid_map, gid_map, deny_setgroups=idmaps.deny_setgroups)
        assert plan.sandbox_id == sandbox_id
        shape = dict(
            clone_flags=zygote.clone_flags(plan.namespaces), idmaps=idmaps,
            # fds 3..6 of the init: lifeline, listener, and the locked user
            # and mount namespaces (NSBOX_FD_*).
            keep_fds=[lifeline.read_end(), listener.fileno(), -1, -1], exec_fd=init_fd, envp=[], keep_stdio=False,
            new_session=True, lock_maps=plan.idmap.nested_identity(), lock_slot=zygote.lib.NSBOX_FD_USERNS - 3,
            go_fd=go_w, host_go=host_go,
        )

        def argv(p: Plan) -> list[str]:
            return ["nsbox-init", p.sandbox_id, *p.init_args]

        def pack(p: Plan) -> bytes:
            return zygote.pack_request(steps=p.steps(), argv=argv(p), **shape)  # type: ignore[arg-type]

        # A plan copied from a template is packed once per shape.
        packed = plan.packed(_shape_key(shape), pack)
        return zygote.request_spawn(steps=[] if packed is not None else plan.steps(), argv=argv(plan), error_fd=err_w,
                                    sync_fd=go_r, via=via, packed=packed, **shape)  # type: ignore[arg-type]
    finally:
        if init_fd >= 0:
            os.close(init_fd)
        if listener is not None:
            listener.close()


def _shape_key(shape: dict[str, object]) -> tuple[object, ...]:
    """What of a clone request's shape its packed bytes depend on: which
    descriptors are given, not their numbers."""
    def part(name: str, value: object) -> object:
        if name == "keep_fds":
            return tuple(fd >= 0 for fd in value)  # type: ignore[attr-defined]
        if name.endswith("_fd"):
            return value >= 0  # type: ignore[operator]
        return tuple(value) if isinstance(value, list) else value
    return tuple((name, part(name, value)) for name, value in shape.items())


# The steps that add mounts (ENOSPC from them is fs.mount-max).
MOUNTING = frozenset({Kind.MOUNT, Kind.TREE_CLONE, Kind.TREE_ATTACH})


def setup_error(plan: Plan, step: int, err: int, layer: Path) -> NsboxError:
    """The error for a setup step (or stage) the child reported failed."""
    steps = plan.steps()
    exhausted = exhaustion.of_setup(
        err, clones=step == zygote.lib.NSBOX_SETUP_LOCK, path=layer,
        places_fds=step == zygote.lib.NSBOX_SETUP_FDS or (0 <= step < len(steps) and steps[step].kind == Kind.PATH_FD),
        mounts=0 <= step < len(steps) and steps[step].kind in MOUNTING)
    if exhausted is not None:
        return exhausted
    if 0 <= step < len(steps):
        return hostcheck.step_failed(steps[step], err, os.fspath(layer))
    stage = {
        zygote.lib.NSBOX_SETUP_SYNC: "waiting for the host's go",
        zygote.lib.NSBOX_SETUP_FDS: "arranging descriptors",
        zygote.lib.NSBOX_SETUP_EXEC: "starting nsbox-init",
        zygote.lib.NSBOX_SETUP_LOCK: "creating the nested namespaces that lock the mounts",
        zygote.lib.NSBOX_SETUP_SESSION: "starting a session",
        zygote.lib.NSBOX_SETUP_SIGNALS: "blocking signals during the setup",
    }.get(step, f"step {step}")
    hint = hostcheck.userns_hint() if err in (errno.EPERM, errno.EACCES) else None
    return SandboxSetupError(f"sandbox setup failed: {stage}: {os.strerror(err)}", hint)

