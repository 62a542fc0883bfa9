"""Sandbox: create, use, detach and destroy one sandbox.

A sandbox is a set of namespaces whose PID 1 is nsbox-init. This object owns
the control connection to that init; the connection is also the init's
lifeline, so the sandbox dies with the process that created it (unless it
is detached on purpose).
"""

from __future__ import annotations

import errno
import os
import posixpath
import secrets
import select
import signal
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping, Sequence

import anyio

from . import dirs, exec as exec_, files, hostcheck, idmap, native, protocol, registry, users
from . import rootfs as rootfs_mod
from .errors import (
    CommandTimeout,
    NsboxError,
    OutputLimitExceeded,
    SandboxSetupError,
    SandboxUnavailable,
    UserUnsupported,
)
from .limits import exec_output_limit, human_size

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
Network = Literal["none", "host"]
OutputLimitMode = Literal["truncate", "raise"]
# How long close() waits for the init to exit before killing it.
CLOSE_WAIT = 2.0
# How long the host waits for newuidmap and the setup child.
SETUP_TIMEOUT = 30.0


@dataclass(frozen=True)
class ExecResult:
    """The result of Sandbox.exec: as Inspect's ExecResult."""

    success: bool
    returncode: int
    stdout: str
    stderr: str


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, not {value!r}")


class Sandbox:
    """A rootless sandbox.

    Use it as an async context manager::

        async with nsbox.Sandbox() as sb:
            result = await sb.exec(["python3", "-c", "print(42)"])

    or call ``await sb.start()`` and ``await sb.close()`` yourself.

    Args:
        rootfs: "host" or None for the built-in host-composed root, or a
            directory holding a root filesystem.
        user: the default user of exec, read_file and write_file.
        workdir: the working directory; relative paths resolve against it.
            Defaults to the user's home directory (created if missing).
        env: environment variables for every command.
        network: "none" (a private network namespace with loopback only)
            or "host" (the host's network).
        hostname: defaults to the sandbox id.
        output_limit_mode: when an output stream exceeds the limit,
            "truncate" keeps its last bytes, "raise" raises
            OutputLimitExceeded (Inspect's older contract).
        id_mapping: "auto" picks the best mapping this user can have
            (see nsbox.idmap); "single" maps only the invoking uid.
        timeout: default timeout in seconds for exec (None: no timeout).
        mounts: host files or directories to bind into the sandbox.
        label: free text that `nsbox ps` shows for this sandbox.
    """

    def __init__(
        self,
        rootfs: str | os.PathLike[str] | None = None,
        *,
        user: str = "root",
        workdir: str | None = None,
        env: Mapping[str, str] | None = None,
        network: Network = "none",
        hostname: str | None = None,
        output_limit_mode: OutputLimitMode = "truncate",
        id_mapping: Literal["auto", "single"] = "auto",
        timeout: float | None = None,
        mounts: Sequence[rootfs_mod.Bind] = (),
        label: str = "",
    ) -> None:
        _check_choice("network", network, ("none", "host"))
        _check_choice("output_limit_mode", output_limit_mode, ("truncate", "raise"))
        _check_choice("id_mapping", id_mapping, ("auto", "single"))
        if workdir is not None and not posixpath.isabs(workdir):
            raise ValueError(f"workdir must be an absolute path inside the sandbox, not {workdir!r}")
        self.rootfs = rootfs_mod.resolve(rootfs)
        self.user = user
        self.env = dict(env or {})
        self.network = network
        self.output_limit_mode = output_limit_mode
        self.timeout = timeout
        self.mounts = tuple(mounts)
        self.label = label
        self.origin = "api"  # "cli" or "inspect" when those create it
        self._requested_workdir = workdir
        self._requested_hostname = hostname
        self._id_mapping = id_mapping
        self.id = ""
        self.hostname = ""
        self.workdir = workdir or ""
        self.idmap: idmap.IdMap | None = None
        self.pid = 0
        self._pidfd = -1
        self._ctl: socket.socket | None = None
        self._devnull = -1
        self._layer: Path | None = None
        self._rundir: Path | None = None
        self._identity: users.Identity = users.ROOT
        self._state: Literal["new", "starting", "running", "closed"] = "new"
        self._detached = False
        self._attached = False  # connected to a sandbox another process owns
        self._user_cache: dict[str, tuple[bytes, bytes, users.Identity | None]] = {}

    # ---- lifecycle ---------------------------------------------------

    @classmethod
    async def create(cls, rootfs: str | os.PathLike[str] | None = None, **options: object) -> "Sandbox":
        """Creates and starts a sandbox (the explicit alternative to `async with`)."""
        return await cls(rootfs, **options).start()  # type: ignore[arg-type]

    async def __aenter__(self) -> "Sandbox":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def running(self) -> bool:
        return self._state == "running" and not _exited(self._pidfd)

    async def start(self) -> "Sandbox":
        if self._state != "new":
            raise RuntimeError("a Sandbox can only be started once")
        self._state = "starting"
        try:
            with anyio.fail_after(SETUP_TIMEOUT):
                await self._create()
            await self._settle_identity()
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                await self._teardown()
            if isinstance(e, TimeoutError):
                raise SandboxSetupError(f"creating the sandbox took more than {SETUP_TIMEOUT:.0f}s") from None
            raise
        self._state = "running"
        return self

    async def _create(self) -> None:
        self.idmap = idmap.detect(self._id_mapping)
        self.id = secrets.token_hex(6)
        self.hostname = self._requested_hostname or self.id
        self._layer = rootfs_mod.layers_dir() / self.id
        self._rundir = dirs.runtime_dir() / self.id
        self._rundir.mkdir(mode=0o700)
        steps = rootfs_mod.plan(self.rootfs, self._layer, rootfs_mod.mount_point(), idmap=self.idmap,
                                hostname=self.hostname, private_network=self.network == "none",
                                binds=self.mounts)
        err_r, err_w = os.pipe()
        try:
            try:
                await self._clone(steps, err_w)
            finally:
                os.close(err_w)
            # Known now or later: record the sandbox while its setup runs.
            self.workdir = self._requested_workdir or self._known_default_home() or ""
            self._register()
            await anyio.wait_readable(err_r)
            report = os.read(err_r, 64)
        finally:
            os.close(err_r)
        if report:
            step, err = struct.unpack("=ii", report[:8])
            raise self._setup_error(steps, step, err)
        if _exited(self._pidfd):
            raise SandboxSetupError("the sandbox's init exited right after starting")
        self._ctl.setblocking(False)
        self._devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)

    async def _clone(self, steps: Sequence[native.Step], err_w: int) -> None:
        """Has the zygote clone the sandbox's first process and write its id
        maps; sets pid, pidfd and the control connection."""
        assert self.idmap is not None and self._layer is not None and self._rundir is not None
        self._ctl, ctl_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        init_fd = -1
        try:
            try:
                listener.bind(os.fspath(self._rundir / registry.SOCKET))
            except OSError as e:
                raise SandboxSetupError(f"cannot create the sandbox's socket in {self._rundir}: {e.strerror}",
                                        hint="set NSBOX_STATE_DIR to a shorter path") from None
            listener.listen(64)
            init_fd = os.open(native.INIT_BINARY, os.O_RDONLY | os.O_CLOEXEC)
            # The zygote lets the child go as soon as its id maps are written.
            self.rootfs.prepare(self._layer, self.hostname)
            flags = (native.CLONE_NEWUSER | native.CLONE_NEWNS | native.CLONE_NEWPID | native.CLONE_NEWIPC
                     | native.CLONE_NEWUTS | native.CLONE_NEWCGROUP
                     | (native.CLONE_NEWNET if self.network == "none" else 0))
            try:
                reply = native.request_spawn(
                    clone_flags=flags, steps=steps, idmaps=self.idmap.how_to_write(), error_fd=err_w,
                    # fds 3..6 of the init: control, listener, and the
                    # locked user and mount namespaces (NSBOX_FD_*).
                    keep_fds=[ctl_child.fileno(), listener.fileno(), -1, -1], exec_fd=init_fd,
                    argv=["nsbox-init", self.id], envp=[], keep_stdio=False, new_session=True,
                    lock_maps=self.idmap.nested_identity(), lock_slot=native.lib.NSBOX_FD_USERNS - 3,
                )
                with reply:
                    await anyio.wait_readable(reply)
                    self.pid, self._pidfd = native.read_spawn_reply(reply)
            except native.IdMapError as e:
                self.pid = int(e.filename)  # killed by the zygote; reaped by _teardown
                raise SandboxSetupError(
                    f"writing the id maps of the sandbox failed: {e.message or e.strerror}",
                    hint="check your /etc/subuid and /etc/subgid entries, or use id_mapping='single'",
                ) from None
            except OSError as e:
                raise hostcheck.clone_failed(e.errno) from None
        finally:
            if init_fd >= 0:
                os.close(init_fd)
            ctl_child.close()
            listener.close()

    def _known_default_home(self) -> str | None:
        known = self.rootfs.identity_files()
        identity = users.lookup(self.user, known["passwd"], known["group"]) if known else None
        return identity.home if identity else None

    def _setup_error(self, steps: Sequence[native.Step], step: int, err: int) -> NsboxError:
        if 0 <= step < len(steps):
            return hostcheck.step_failed(steps[step], err, os.fspath(self._layer))
        stage = {
            native.lib.NSBOX_SETUP_SYNC: "waiting for the id maps",
            native.lib.NSBOX_SETUP_FDS: "arranging descriptors",
            native.lib.NSBOX_SETUP_EXEC: "starting nsbox-init",
            native.lib.NSBOX_SETUP_IDS: "becoming root in the user namespace",
            native.lib.NSBOX_SETUP_LOCK: "creating the nested namespaces that lock the mounts",
        }.get(step, f"step {step}")
        hint = hostcheck.userns_hint() if err in (errno.EPERM, errno.EACCES) else None
        return SandboxSetupError(f"sandbox setup failed: {stage}: {os.strerror(err)}", hint)

    def _register(self) -> None:
        assert self.idmap is not None and self._layer is not None
        registry.write(registry.SandboxInfo(
            id=self.id, owner_pid=os.getpid(), owner_start=registry.process_start_time(os.getpid()),
            init_pid=self.pid, init_start=registry.process_start_time(self.pid), rootfs=str(self.rootfs),
            layer=os.fspath(self._layer), hostname=self.hostname, user=self.user, workdir=self.workdir,
            idmap=self.idmap.to_dict(), origin=self.origin, label=self.label,
        ))

    async def _settle_identity(self) -> None:
        """Resolves the default user and makes sure the working directory exists."""
        known = self.rootfs.identity_files() if not self._attached else {}
        if known:
            # The sandbox was created a moment ago from files we wrote.
            identity = users.lookup(self.user, known["passwd"], known["group"])
        else:
            identity = await self._lookup_user(self.user)
        if identity is None:
            if self.user not in ("root", "0"):
                raise SandboxSetupError(f"user {self.user!r} does not exist in the sandbox's /etc/passwd")
            identity = users.ROOT
        self._check_mapped(identity, self.user)
        self._identity = identity
        workdir = self._requested_workdir or identity.home
        if workdir != self.workdir and not self._attached:
            self.workdir = workdir
            self._register()  # the home directory was not known at creation
        self.workdir = workdir
        if self.workdir in self.rootfs.known_dirs() and not self._attached:
            return
        try:
            fd, is_dir = await files.open_path(self._send, self._creds(identity), self.workdir, os.O_RDONLY)
            os.close(fd)
            if not is_dir:
                raise SandboxSetupError(f"the working directory {self.workdir} is not a directory")
        except FileNotFoundError:
            await self._make_workdir(identity)

    async def _make_workdir(self, identity: users.Identity) -> None:
        # Created by root, like a Dockerfile's WORKDIR, then given to the user.
        commands = [["mkdir", "-p", "--", self.workdir]]
        if identity.uid != 0:
            commands.append(["chown", f"{identity.uid}:{identity.gid}", "--", self.workdir])
        for cmd in commands:
            r = await self._run(cmd, users.ROOT, cwd="/")
            if not r.success:
                raise SandboxSetupError(f"creating the working directory {self.workdir} failed: "
                                        f"{(r.stderr or r.stdout).strip()}")

    @classmethod
    async def attach(cls, sandbox_id: str) -> "Sandbox":
        """Connects to a running sandbox that another process created (or
        that was detached). close() then only disconnects."""
        info = registry.read(sandbox_id)
        if info is None:
            raise SandboxUnavailable(f"no sandbox {sandbox_id!r}", hint="run `nsbox ps` to list them")
        if not info.init_alive:
            raise SandboxUnavailable(f"sandbox {sandbox_id} is not running any more",
                                     hint=f"run `nsbox rm {sandbox_id}` to remove what is left of it")
        sb = cls(None if info.rootfs == "host" else info.rootfs, user=info.user, workdir=info.workdir or None)
        sb.id, sb.hostname, sb.label, sb.origin = info.id, info.hostname, info.label, info.origin
        sb.idmap = idmap.IdMap.from_dict(info.idmap)
        sb.pid = info.init_pid
        sb._attached = True
        sb._detached = info.detached
        sb._state = "starting"
        try:
            sb._pidfd = os.pidfd_open(info.init_pid)
            if not info.init_alive:  # the pid was recycled between the checks
                raise SandboxUnavailable(f"sandbox {sandbox_id} is not running any more")
            sb._ctl = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sb._ctl.connect(os.fspath(registry.sandbox_dir(info.id) / registry.SOCKET))
            sb._ctl.setblocking(False)
            sb._devnull = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
            await sb._settle_identity()
        except BaseException as e:
            await sb._teardown()
            if isinstance(e, OSError):
                raise SandboxUnavailable(f"cannot connect to sandbox {sandbox_id}: {e.strerror}") from None
            raise
        sb._state = "running"
        return sb

    async def close(self) -> None:
        """Stops every process of the sandbox and deletes its writable layer
        (for an attached sandbox: disconnects)."""
        if self._state in ("new", "closed"):
            self._state = "closed"
            return
        with anyio.CancelScope(shield=True):
            await self._teardown()

    async def _teardown(self) -> None:
        self._state = "closed"
        if self._attached:
            for fd in (self._pidfd, self._devnull):
                if fd >= 0:
                    os.close(fd)
            self._pidfd = self._devnull = -1
            if self._ctl is not None:
                self._ctl.close()
                self._ctl = None
            return
        if self._ctl is not None:
            if self._detached:
                try:
                    protocol.send(self._ctl, protocol.REQUEST.pack(protocol.OP_SHUTDOWN, *[0] * 9), [])
                except OSError:
                    pass
            self._ctl.close()  # the lifeline: the init kills everything and exits
            self._ctl = None
        if self.pid:
            await self._reap()
        if self._devnull >= 0:
            os.close(self._devnull)
            self._devnull = -1
        if self._layer is not None:
            # An untouched layer goes with a few syscalls; anything the
            # sandbox wrote may take long, so it is deleted off the event loop.
            if not self.rootfs.release_layer(self._layer) and not rootfs_mod.remove_untouched_layer(self._layer):
                await anyio.to_thread.run_sync(rootfs_mod.remove_layer, self._layer, self.idmap)
            self._layer = None
        if self._rundir is not None:
            for name in (registry.INFO, registry.SOCKET):
                try:
                    os.unlink(self._rundir / name)
                except FileNotFoundError:
                    pass
            try:
                self._rundir.rmdir()
            except OSError:
                pass
            self._rundir = None

    async def _reap(self) -> None:
        if self._pidfd >= 0:
            with anyio.move_on_after(CLOSE_WAIT) as scope:
                await anyio.wait_readable(self._pidfd)
            if scope.cancelled_caught:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                await anyio.wait_readable(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        self.pid = 0

    async def detach(self) -> registry.SandboxInfo:
        """Lets the sandbox outlive this process; `nsbox rm` ends it later."""
        self._require_running()
        assert self._ctl is not None
        await self._send(protocol.REQUEST.pack(protocol.OP_DETACH, *[0] * 9), [])
        await anyio.wait_readable(self._ctl)
        self._ctl.recv(protocol.STATUS.size)
        self._detached = True
        info = registry.read(self.id)
        assert info is not None
        info.detached = True
        registry.write(info)
        # The layer now belongs to the detached sandbox, not to this object.
        return info

    def __repr__(self) -> str:
        return f"<nsbox.Sandbox {self.id or '(not started)'} {self._state} rootfs={self.rootfs}>"

    # ---- requests -----------------------------------------------------

    def _require_running(self) -> None:
        if self._state != "running" or self._ctl is None:
            raise SandboxUnavailable(f"sandbox {self.id or '(not started)'} is not running "
                                     f"({'closed' if self._state == 'closed' else 'not started'})")

    async def _send(self, message: bytes, fds: Sequence[int]) -> None:
        if self._ctl is None:
            raise SandboxUnavailable(f"sandbox {self.id} is not running")
        while True:
            try:
                protocol.send(self._ctl, message, fds)
                return
            except BlockingIOError:
                await anyio.wait_writable(self._ctl)
            except OSError as e:
                if e.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF):
                    raise SandboxUnavailable(f"sandbox {self.id} is not running (its init has exited)") from None
                raise

    def _creds(self, identity: users.Identity) -> protocol.Creds:
        return protocol.Creds(identity.uid, identity.gid, identity.groups)

    def _check_mapped(self, identity: users.Identity, asked: str) -> None:
        assert self.idmap is not None
        if identity.uid == 0 and identity.gid == 0:
            return
        if self.idmap.mode == "single":
            raise UserUnsupported(
                f"cannot run as {asked!r} (uid {identity.uid}): this sandbox maps only your own uid, "
                f"because {self.idmap.reason}")
        top = max(identity.uid, identity.gid, *identity.groups)
        if top >= self.idmap.size:
            raise UserUnsupported(
                f"cannot run as {asked!r}: id {top} is outside the ids mapped into this sandbox "
                f"(0..{self.idmap.size - 1})")

    async def _read_as_root(self, path: str) -> bytes:
        try:
            data = await files.read_file(self._send, self._creds(users.ROOT), path, text=False)
        except FileNotFoundError:
            return b""
        assert isinstance(data, bytes)
        return data

    async def _lookup_user(self, user: str) -> users.Identity | None:
        found: dict[str, bytes] = {}

        async def read(path: str) -> None:
            found[path] = await self._read_as_root(path)

        async with anyio.create_task_group() as tg:
            for path in ("/etc/passwd", "/etc/group"):
                tg.start_soon(read, path)
        passwd, group = found["/etc/passwd"], found["/etc/group"]
        cached = self._user_cache.get(user)
        if cached is not None and cached[0] == passwd and cached[1] == group:
            return cached[2]
        identity = users.lookup(user, passwd.decode(errors="replace"), group.decode(errors="replace"))
        self._user_cache[user] = (passwd, group, identity)
        return identity

    async def _identity_for(self, user: str | None) -> users.Identity | None:
        """The identity to run as (None: no such user); raises UserUnsupported
        when the id mapping cannot represent it."""
        if user is None:
            return self._identity
        found = await self._lookup_user(str(user))
        if found is not None:
            self._check_mapped(found, str(user))
        return found

    async def exec(
        self,
        cmd: Sequence[str],
        input: str | bytes | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        """Runs `cmd` in the sandbox and returns its exit status and output.

        Output is decoded as UTF-8, invalid bytes replaced. Each stream keeps
        its last N bytes (N from nsbox.limits), or raises OutputLimitExceeded
        in "raise" mode.

        Raises:
            CommandTimeout (a TimeoutError): the timeout expired; the
                command's process tree was killed.
            PermissionError: the command (or cwd) is not accessible.
            UserUnsupported: this sandbox's id mapping cannot run `user`.
            SandboxUnavailable: the sandbox is not running.
        """
        self._require_running()
        if isinstance(cmd, (str, bytes)) or not cmd:
            raise ValueError("cmd must be a non-empty list of strings")
        identity = await self._identity_for(user)
        if identity is None:
            return ExecResult(False, 126, "", f"unable to find user {user}: no matching entries in passwd file\n")
        timeout = self.timeout if timeout is None else timeout
        return await self._run(list(cmd), identity, cwd=cwd, env=env, input=input, timeout=timeout)

    async def _run(
        self,
        cmd: list[str],
        identity: users.Identity,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        input: str | bytes | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        message, memfd, workdir = self._exec_request(cmd, identity, cwd, env)
        data = input.encode("utf-8") if isinstance(input, str) else input
        limit = exec_output_limit()
        out, err = exec_.CappedBuffer(limit), exec_.CappedBuffer(limit)
        outcome = await exec_.run(
            self._send, message, memfd, input=data, timeout=timeout, stdout=out, stderr=err,
            stop_on_overflow=self.output_limit_mode == "raise", stdin_fd=self._devnull,
        )
        stdout, stderr = out.take_text(), err.take_text()
        if outcome.channel_lost:
            raise SandboxUnavailable(f"sandbox {self.id} stopped while running {cmd[0]!r}")
        if outcome.timed_out:
            raise CommandTimeout(f"command timed out after {timeout:g}s: {cmd[0]}", stdout, stderr)
        if outcome.overflowed:
            raise OutputLimitExceeded(
                f"The sandbox output stream limit of {human_size(limit)} was exceeded.", limit, stdout, stderr)
        if outcome.failure is not None:
            return _failed_start(outcome.failure, cmd[0], workdir)
        assert outcome.returncode is not None
        return ExecResult(outcome.returncode == 0, outcome.returncode, stdout, stderr)

    async def run_forwarded(
        self,
        cmd: Sequence[str],
        *,
        stdin: int | None = None,
        stdout: int = 1,
        stderr: int = 2,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        timeout: float | None = None,
    ) -> int:
        """Runs `cmd` with its output copied to host descriptors as it comes
        (what `nsbox run` does); returns the exit status.

        `stdin` is passed to the command as it is unless it is a terminal:
        a sandboxed process holding the host's terminal could type into it
        (TIOCSTI), so a terminal stdin is replaced by /dev/null.
        """
        self._require_running()
        identity = await self._identity_for(user)
        if identity is None:
            raise UserUnsupported(f"unable to find user {user}: no matching entries in passwd file")
        timeout = self.timeout if timeout is None else timeout
        stdin_fd = self._devnull if stdin is None or os.isatty(stdin) else stdin
        message, memfd, workdir = self._exec_request(list(cmd), identity, cwd, env)
        outcome = await exec_.run(
            self._send, message, memfd, input=None, timeout=timeout, stdout=exec_.Forwarder(stdout),
            stderr=exec_.Forwarder(stderr), stop_on_overflow=False, stdin_fd=stdin_fd,
        )
        if outcome.channel_lost:
            raise SandboxUnavailable(f"sandbox {self.id} stopped while running {cmd[0]!r}")
        if outcome.timed_out:
            raise CommandTimeout(f"command timed out after {timeout:g}s: {cmd[0]}", "", "")
        if outcome.failure is not None:
            result = _failed_start(outcome.failure, cmd[0], workdir)
            os.write(stderr, result.stderr.encode())
            return result.returncode
        assert outcome.returncode is not None
        return outcome.returncode

    async def spawn(self, cmd: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
                    user: str | None = None) -> None:
        """Starts `cmd` in the background, its stdio on /dev/null; it runs on
        its own, like a command started with `&`. A command that cannot be
        started raises as exec would; a later exit is not reported."""
        self._require_running()
        identity = await self._identity_for(user)
        if identity is None:
            raise UserUnsupported(f"unable to find user {user}: no matching entries in passwd file")
        message, memfd, workdir = self._exec_request(list(cmd), identity, cwd, env, flags=protocol.F_DETACHED)
        chan, chan_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with chan:
            try:
                fds = [chan_child.fileno(), self._devnull, self._devnull, self._devnull]
                await self._send(message, fds + ([memfd] if memfd is not None else []))
            finally:
                chan_child.close()
                if memfd is not None:
                    os.close(memfd)
            # A failure to start comes back at once; a started command stays quiet.
            chan.setblocking(False)
            with anyio.move_on_after(0.3):
                await anyio.wait_readable(chan)
                data = chan.recv(protocol.REPLY.size)
                if len(data) == protocol.REPLY.size:
                    reply = protocol.Reply(*protocol.REPLY.unpack(data))
                    if reply.kind == protocol.REPLY_FAIL:
                        result = _failed_start(reply, cmd[0], workdir)
                        raise NsboxError(result.stderr.strip())

    def _exec_request(self, cmd: list[str], identity: users.Identity, cwd: str | None,
                      env: Mapping[str, str] | None, flags: int = 0) -> tuple[bytes, int | None, str]:
        workdir = posixpath.join(self.workdir, cwd) if cwd else self.workdir
        full_env = {"PATH": DEFAULT_PATH, "HOME": identity.home, **self.env, **(env or {})}
        strings = [os.fsencode(workdir), *map(os.fsencode, cmd),
                   *(os.fsencode(f"{k}={v}") for k, v in full_env.items())]
        message, memfd = protocol.encode(protocol.OP_EXEC, self._creds(identity), strings,
                                         argc=len(cmd), envc=len(full_env), flags=flags)
        return message, memfd, workdir

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        """Reads a file of the sandbox as the default user.

        Raises FileNotFoundError, PermissionError, IsADirectoryError,
        UnicodeDecodeError (text mode) and OutputLimitExceeded.
        """
        self._require_running()
        return await files.read_file(self._send, self._creds(self._identity), self._path(file), text)

    async def write_file(self, file: str, contents: str | bytes) -> None:
        """Writes a file of the sandbox as the default user, creating parent
        directories. Raises PermissionError and IsADirectoryError."""
        self._require_running()
        await files.write_file(self._send, self._creds(self._identity), self._path(file), contents)

    def _path(self, file: str) -> str:
        if not file:
            raise ValueError("the file name is empty")
        return posixpath.join(self.workdir, file)

    async def status(self) -> dict[str, int]:
        """The init's counters: execs served and commands running."""
        self._require_running()
        assert self._ctl is not None
        await self._send(protocol.REQUEST.pack(protocol.OP_STATUS, *[0] * 9), [])
        await anyio.wait_readable(self._ctl)
        version, running, execs, detached, _ = protocol.STATUS.unpack(self._ctl.recv(protocol.STATUS.size))
        return {"running": running, "execs": execs, "detached": detached}


def _failed_start(failure: protocol.Reply, command: str, workdir: str) -> ExecResult:
    """The result (or exception) for a command the init could not start."""
    err = failure.err
    reason = os.strerror(err)
    if failure.stage == protocol.STAGE_EXEC:
        if err == errno.EACCES:
            raise PermissionError(err, f"{reason}: cannot execute", command)
        if err in (errno.ENOENT, errno.ENOTDIR):
            text = "command not found" if "/" not in command else reason
            return ExecResult(False, 127, "", f"nsbox: {command}: {text}\n")
        return ExecResult(False, 126, "", f"nsbox: {command}: {reason}\n")
    if failure.stage == protocol.STAGE_CWD:
        if err == errno.EACCES:
            raise PermissionError(err, f"{reason}: cannot change to the working directory", workdir)
        return ExecResult(False, 126, "", f"nsbox: cannot change to the working directory {workdir}: {reason}\n")
    if failure.stage == protocol.STAGE_CREDS:
        raise UserUnsupported(f"switching to the requested user failed: {reason}")
    raise NsboxError(f"the sandbox could not start {command!r}: {reason}")


def _exited(pidfd: int) -> bool:
    if pidfd < 0:
        return True
    return bool(select.select([pidfd], [], [], 0)[0])
