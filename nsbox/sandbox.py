"""Sandbox: the lifecycle of one sandbox, and its public operations.

A sandbox is a set of namespaces whose PID 1 is nsbox-init. Creating one,
and ending what that made, is nsbox/create/procedure.py's (launched by
nsbox/create/launch.py, from a plan of nsbox/plan/assemble.py or a copy of a
template, nsbox/plan/templates.py); its writable layer, nsbox/create/layer.py's;
its network, nsbox/create/netattach.py's; talking to its init is
nsbox/init/client.py's; running a command, nsbox/init/process.py's; files,
nsbox/init/files.py's; its users, nsbox/init/users.py's. This object ties them
together: create or attach, close or detach, and exec, spawn, read_file, write_file.

It owns the control connection to the init, which is also the init's
lifeline: the sandbox dies with the process that created it (unless it is
detached on purpose).
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence

import anyio

from . import network as network_mod
from .host import idmap, live, rlimits
from .init import files, process, protocol
from .plan import netmodes, resources
from .init import users
from .plan import rootfs as rootfs_mod
from .init.capture import CappedBuffer, Forwarder
from .init.client import DEFAULT_PATH, Channel, Command, ExecResult, InitClient
from .errors import (
    SandboxSetupError,
    SandboxUnavailable,
    UserUnsupported,
    note_once,
)
from .create import exhaustion, procedure
from .create.launch import Launched
from .create.netattach import NetAttachment
from .init.output_limits import exec_output_limit
from .init.stdin_relay import StdinRelay
from .manage import collect_in_background
from .spec import FIELDS, NET, Bind, Network, OutputLimitMode, PullPolicy, Restart, SandboxSpec, Tmpfs

if TYPE_CHECKING:
    from .init import streaming
    from .storage import Image

__all__ = ["DEFAULT_PATH", "ExecResult", "Sandbox"]

# How long close() waits for the init to exit before killing it.
CLOSE_WAIT = 2.0
# How long creating a sandbox may take (newuidmap, the setup child).
SETUP_TIMEOUT = 30.0


class Sandbox:
    """A rootless sandbox.

    Use it as an async context manager::

        async with nsbox.Sandbox() as sb:
            result = await sb.exec(["python3", "-c", "print(42)"])

    or call ``await sb.start()`` and ``await sb.close()`` yourself. The
    keyword arguments are those of nsbox.SandboxSpec (see there); a spec can
    be given whole instead, as ``Sandbox(spec=...)``.
    """

    def __init__(
        self,
        rootfs: str | os.PathLike[str] | None = None,
        *,
        image: str | None = None,
        pull: PullPolicy = "missing",
        platform: str | None = None,
        user: str | None = None,
        workdir: str | None = None,
        env: Mapping[str, str] | None = None,
        network: Network = "none",
        allow: Sequence[str] = (),
        ports: Sequence[str] = (),
        hosts: Mapping[str, str] | None = None,
        host_loopback: bool = False,
        hostname: str | None = None,
        network_aliases: Sequence[str] = (),
        more_networks: Mapping[Any, Sequence[str]] | None = None,
        output_limit_mode: OutputLimitMode = "truncate",
        id_mapping: idmap.Requested = "auto",
        timeout: float | None = None,
        mounts: Sequence[Bind] = (),
        tmpfs: Sequence[Tmpfs | str] = (),
        read_only: bool = False,
        label: str = "",
        nested_userns: bool = False,
        privileged: bool = False,
        memory: int | str | None = None,
        pids_limit: int | None = None,
        cpus: float | None = None,
        disk: int | str | None = None,
        strict_limits: bool = False,
        gpus: str | int | None = None,
        spec: SandboxSpec | None = None,
    ) -> None:
        if spec is None:
            # Each keyword is the SandboxSpec field of its name.
            given = {name: value for name, value in locals().items() if name in FIELDS}
            spec = SandboxSpec(**{**given, "rootfs": os.fspath(rootfs) if rootfs is not None else "host",
                                  "env": dict(env or {}), "hosts": dict(hosts or {}),
                                  "more_networks": dict(more_networks or {})})
        self.spec = spec
        self.rootfs: rootfs_mod.Rootfs = rootfs_mod.resolve(spec.rootfs)
        self.image: Image | None = None  # the resolved image, once started
        self.id = ""
        self.hostname = ""
        self.workdir = spec.workdir or ""
        self.idmap: idmap.IdMap | None = None
        self._launched = Launched()
        self._client: InitClient | None = None
        self._layer: Path | None = None
        self._rundir: Path | None = None
        self._identity: users.Identity = users.ROOT
        self._state: Literal["new", "starting", "running", "stopped", "closed"] = "new"
        self._detached = False
        self._attached = False  # connected to a sandbox another process owns
        self._users = users.Users()  # users looked up in the sandbox's own files
        self._network: NetAttachment | None = None  # its network mode's and service networks', once created

    # What the spec says, under the names this class always had.
    user = property(lambda self: self.spec.user or "root")
    env = property(lambda self: self.spec.env)
    network = property(lambda self: self.spec.network)
    output_limit_mode = property(lambda self: self.spec.output_limit_mode)
    timeout = property(lambda self: self.spec.timeout)
    mounts = property(lambda self: self.spec.mounts)
    label = property(lambda self: self.spec.label)
    origin = property(lambda self: self.spec.origin)

    @property
    def pid(self) -> int:
        """The init's pid on the host (0 when not running)."""
        return self._launched.pid

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
        return self._state == "running" and not self._launched.exited

    @property
    def client(self) -> InitClient:
        """The connection to the init (raises SandboxUnavailable if there is none)."""
        self._require_running()
        assert self._client is not None
        return self._client

    # ---- lifecycle ---------------------------------------------------

    async def start(self) -> "Sandbox":
        if self._state != "new":
            raise RuntimeError("a Sandbox can only be started once")
        self._state = "starting"
        try:
            if self.spec.image is not None:
                await self._use_image(self.spec.image)
            with anyio.fail_after(SETUP_TIMEOUT):
                await self._create()
            await self._settle_identity()
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                await self._leave_network()
                await self._teardown()
            if isinstance(e, TimeoutError):
                raise SandboxSetupError(f"creating the sandbox took more than {SETUP_TIMEOUT:.0f}s") from None
            exhausted = exhaustion.translate(e)  # a limit reached: named, with the way to raise it
            if exhausted is not None:
                raise exhausted from e
            raise
        self._state = "running"
        return self

    async def _use_image(self, ref: str) -> None:
        """Resolves (pulls, unpacks) the image and lets its config fill in
        what the sandbox's own settings leave open, as `docker run` does."""
        from .storage.resolve import for_spec

        self.image, spec, note = await for_spec(ref, self.spec, runner=confined)
        if note:
            note_once(note)
        self.rootfs = rootfs_mod.ImageRootfs.of(self.image)
        self.spec = spec

    @classmethod
    def on_image(cls, image: Image, **options: Any) -> "Sandbox":
        """A sandbox on an image that need not be in the store by name (an
        intermediate image of a build): its layers are the root; the image's
        config fills in nothing (give user, workdir, env in `options`)."""
        sb = cls(**options)
        sb.rootfs, sb.image = rootfs_mod.ImageRootfs.of(image), image
        return sb

    @property
    def upper_dir(self) -> Path | None:
        """What the sandbox wrote over its root filesystem (the overlay's
        upper directory), or None where that lives in a size-capped tmpfs
        (the disk limit) or the sandbox is not running."""
        if self._layer is None or self.spec.disk is not None or isinstance(self.rootfs, rootfs_mod.HostRootfs):
            return None
        return self._layer / "upper"

    def image_command(self, args: Sequence[str] = ()) -> list[str]:
        """What `docker run IMAGE ARGS` runs: the image's Entrypoint with ARGS,
        or with its Cmd when there are none (empty without an image)."""
        if self.image is None:
            return list(args)
        return self.image.config.command_for(list(args))

    _plan_inputs = procedure.plan_inputs  # what this sandbox's plan is made of

    async def _create(self) -> None:
        resources.check(resources.ResourceLimits.of(self.spec))  # strict_limits: before anything exists
        rlimits.raise_nofile_limit()  # once per process: soft NOFILE up to the hard limit
        exhaustion.check_nofile()  # one below what a sandbox's setup needs: before anything exists
        collect_in_background()  # once per process: what killed processes of this user left
        procedure.choose(self)  # its id mapping, id and hostname; its GPUs' files in its spec
        service_net = service_view = None
        networks: list[tuple[network_mod.Network, Sequence[str]]] = []  # each with its aliases there
        if self.spec.network.startswith(NET):  # this process's network, or a named one it reaches now
            service_net = await network_mod.lookup(self.spec.network)
            service_net.check_mapping(self.idmap)
            more = network_mod.more_networks(service_net, self.spec.more_networks)
            networks = [(service_net, self.spec.network_aliases), *more]
            # One view of them all for the network modes (/etc/hosts).
            service_view = network_mod.Joined([net for net, _ in networks]) if more else service_net
        await procedure.create(self, service_view, networks)

    @property
    def host_ports(self) -> list[int]:
        """The host port of each published port, in the order of `ports`
        (the port bound when HOSTPORT was 0)."""
        return self._network.host_ports if self._network is not None else []

    def _register(self) -> None:
        procedure.register(self, netmodes.mode(self.spec, network_mod.local(self.spec.network)))

    async def _settle_identity(self) -> None:
        """Resolves the default user and makes sure the working directory exists."""
        assert self.idmap is not None
        client, image = self._setup_client(), self._fresh_image_key()
        known = self.rootfs.identity_files() if not self._attached else {}
        identity = await users.default_identity(client, self.user, known, image, self._users, self.idmap)
        self._identity = identity
        workdir = self.spec.workdir or identity.home
        if workdir != self.workdir and not self._attached:
            self.workdir = workdir
            self._register()  # the home directory was not known at creation
        self.workdir = workdir
        if self.workdir in self.rootfs.known_dirs() and not self._attached:
            return
        await users.ensure_workdir(client, workdir, identity, image,
                                   lambda cmd: self._run(client, list(cmd), users.ROOT, cwd="/"))

    def _fresh_image_key(self) -> tuple[Path, ...] | None:
        """Not for a sandbox this process did not create (rootfs.fresh_image_key)."""
        return None if self._attached else rootfs_mod.fresh_image_key(self.rootfs, self.spec)

    def _setup_client(self) -> InitClient:
        """The client, while the sandbox is still starting."""
        if self._client is None:
            raise SandboxUnavailable(f"sandbox {self.id} is not running")
        return self._client

    @classmethod
    async def attach(cls, sandbox_id: str) -> "Sandbox":
        """Connects to a running sandbox that another process created (or
        that was detached). close() then only disconnects."""
        info = live.read(sandbox_id)
        if info is None:
            raise SandboxUnavailable(f"no sandbox {sandbox_id!r}", hint="run `nsbox ps` to list them")
        if not info.init_alive:
            raise SandboxUnavailable(f"sandbox {sandbox_id} is not running any more",
                                     hint=f"run `nsbox rm {sandbox_id}` to remove what is left of it")
        spec = SandboxSpec(rootfs=info.rootfs if os.path.isdir(info.rootfs) else "host", user=info.user,
                           workdir=info.workdir or None, label=info.label, origin=info.origin)
        sb = cls(spec=spec)
        sb.id, sb.hostname = info.id, info.hostname
        sb.idmap = idmap.IdMap.from_dict(info.idmap)
        sb._launched.pid = info.init_pid
        sb._attached = True
        sb._detached = info.detached
        sb._state = "starting"
        try:
            sb._launched.pidfd = os.pidfd_open(info.init_pid)
            if not info.init_alive:  # the pid was recycled between the checks
                raise SandboxUnavailable(f"sandbox {sandbox_id} is not running any more")
            sb._client = InitClient.connect(os.fspath(live.sandbox_dir(info.id) / live.SOCKET), info.id)
            await sb._settle_identity()
        except BaseException as e:
            await sb._teardown()
            if isinstance(e, OSError):
                raise SandboxUnavailable(f"cannot connect to sandbox {sandbox_id}: {e.strerror}") from None
            raise
        sb._state = "running"
        return sb

    async def close(self, wait: bool = True) -> None:
        """Stops every process of the sandbox (all are gone on return) and
        hands its writable layer to this process's sweeper thread, which
        keeps it for reuse or deletes it (removal.wait_swept waits for that;
        the process does when it exits). For an attached sandbox: disconnects.

        With `wait=False`, returns once the sandbox's init is told to end
        everything: the kernel's teardown of its namespaces, and all that
        waits for it, finish on the sweeper thread too (killed after
        CLOSE_WAIT s, as with wait=True). Nothing of the sandbox runs any
        more, but its processes may still be exiting."""
        if self._state in ("new", "closed"):
            self._state = "closed"
            return
        if self._network is not None:
            self._network.closing = True  # its /etc/hosts no longer matters: peers leaving skip it
        with anyio.CancelScope(shield=True):
            await self._leave_network()
            await self._teardown(wait)

    async def stop(self) -> None:
        """Ends every process of the sandbox now, keeping its writable
        layer (upper_dir) to read until close(). All are gone on return:
        they live in the sandbox's PID namespace, which the kernel empties
        before its init's exit can be waited for."""
        if self._state != "running" or self._attached:
            raise RuntimeError("only a running sandbox this process owns can be stopped")
        with anyio.CancelScope(shield=True):
            self._state = "stopped"
            await procedure.end_init(self._launched, procedure.take_client(self), CLOSE_WAIT)

    async def _leave_network(self) -> None:
        if self._network is not None and not self._attached:
            await self._network.leave()

    async def _teardown(self, wait: bool = True) -> None:
        self._state = "closed"
        client = procedure.take_client(self)
        if self._attached:
            if self._launched.pidfd >= 0:
                os.close(self._launched.pidfd)
                self._launched.pidfd = -1
            if client is not None:
                client.close()
            return
        await procedure.teardown(self, client, CLOSE_WAIT, waiting=wait)

    async def detach(self) -> live.SandboxInfo:
        """Lets the sandbox outlive this process; `nsbox rm` ends it later."""
        await self.client.detach()
        self._detached = True
        netmodes.warn_detached(self.spec, self._network.own_networks() if self._network is not None else ())
        info = live.read(self.id)
        assert info is not None
        info.detached = True
        live.write(info)
        # The layer now belongs to the detached sandbox, not to this object.
        return info

    def __repr__(self) -> str:
        return f"<nsbox.Sandbox {self.id or '(not started)'} {self._state} rootfs={self.rootfs}>"

    # ---- users -------------------------------------------------------

    def _require_running(self) -> None:
        if self._state != "running" or self._client is None:
            raise SandboxUnavailable(f"sandbox {self.id or '(not started)'} is not running "
                                     f"({'closed' if self._state == 'closed' else 'not started'})")

    async def identity(self, user: str | None = None) -> users.Identity:
        """Who `user` (default: the sandbox's user) is in this sandbox.

        Raises UserUnsupported if there is no such user, or if the id
        mapping cannot represent it."""
        if user is None or str(user) == self.user:
            # The default user, resolved when the sandbox started: no reads
            # (Inspect probes root access as user "root" on every sample).
            return self._identity
        assert self.idmap is not None
        found = await self._users.lookup(self._setup_client(), str(user))
        if found is None:
            raise UserUnsupported(f"unable to find user {user}: no matching entries in passwd file")
        users.check_mapped(found, str(user), self.idmap)
        return found

    def command(self, argv: Sequence[str], identity: users.Identity, cwd: str | None = None,
                env: Mapping[str, str] | None = None, restart: Restart | str | None = None) -> Command:
        """`argv` as the init runs it: working directory, environment,
        credentials and restart policy resolved."""
        if isinstance(argv, (str, bytes)) or not argv:
            raise ValueError("cmd must be a non-empty list of strings")
        workdir = posixpath.join(self.workdir, cwd) if cwd else self.workdir
        full_env = {"PATH": DEFAULT_PATH, "HOME": identity.home, **self.env, **(env or {})}
        if isinstance(restart, str):
            restart = Restart.parse(restart)
        if restart is None:
            return Command(list(argv), full_env, workdir, _creds(identity))
        flags = protocol.F_RESTART | (protocol.F_RESTART_ON_FAILURE if restart.on_failure else 0)
        return Command(list(argv), full_env, workdir, _creds(identity), flags, restart.limit or 0)

    # ---- commands ----------------------------------------------------

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
        its last N bytes (N from nsbox.init.output_limits), or raises OutputLimitExceeded
        in "raise" mode.

        Raises:
            CommandTimeout (a TimeoutError): the timeout expired; the
                command's process tree was killed.
            PermissionError: the command (or cwd) is not accessible.
            UserUnsupported: this sandbox's id mapping cannot run `user`.
            SandboxUnavailable: the sandbox is not running.
        """
        client = self.client
        identity = await self._identity_for_command(cmd, user)
        if isinstance(identity, ExecResult):
            return identity
        timeout = self.timeout if timeout is None else timeout
        return await self._run(client, list(cmd), identity, cwd=cwd, env=env, input=input, timeout=timeout)

    async def _identity_for_command(self, cmd: Sequence[str], user: str | None) -> users.Identity | ExecResult:
        """Who runs `cmd`; for a user the sandbox does not have, the result
        exec gives (126 and a message, as docker exec)."""
        if isinstance(cmd, (str, bytes)) or not cmd:
            raise ValueError("cmd must be a non-empty list of strings")
        try:
            return await self.identity(user)
        except UserUnsupported as e:
            if "unable to find user" not in str(e):
                raise
            return ExecResult(False, 126, "", f"{e}\n")

    async def _run(self, client: InitClient, cmd: list[str], identity: users.Identity, *, cwd: str | None = None,
                   env: Mapping[str, str] | None = None, input: str | bytes | None = None,
                   timeout: float | None = None) -> ExecResult:
        command = self.command(cmd, identity, cwd, env)
        data = input.encode("utf-8") if isinstance(input, str) else input
        limit = exec_output_limit()
        out, err = CappedBuffer(limit), CappedBuffer(limit)
        outcome = await process.run(
            client, command, input=data, timeout=timeout, stdout=out, stderr=err,
            stop_on_overflow=self.output_limit_mode == "raise", stdin_fd=process.devnull(),
        )
        return outcome.result(command, self.id, timeout, limit, out.take_text(), err.take_text())

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

        `stdin`: a terminal is replaced by /dev/null (a sandboxed process
        holding the host's terminal could type into it, TIOCSTI); a pipe is
        passed as it is; anything else (a file) is copied into a pipe, as
        the sandbox could reopen the host's file through it (StdinRelay).
        """
        client = self.client
        command = self.command(cmd, await self.identity(user), cwd, env)
        timeout = self.timeout if timeout is None else timeout
        relay = StdinRelay(None if stdin is None or os.isatty(stdin) else stdin, process.devnull())
        try:
            outcome = await process.run(
                client, command, input=None, timeout=timeout, stdout=Forwarder(stdout), stderr=Forwarder(stderr),
                stop_on_overflow=False, stdin_fd=relay.fd,
            )
        finally:
            relay.close()
        result = outcome.result(command, self.id, timeout, 0, "", "")
        if outcome.failure is not None:
            os.write(stderr, result.stderr.encode())
        return result.returncode

    async def spawn(self, cmd: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
                    user: str | None = None, watch: bool = False,
                    restart: Restart | str | None = None) -> "Channel | None":
        """Starts `cmd` in the background, its stdio on /dev/null; it runs on
        its own, like a command started with `&`. Returns once it runs; a
        command that cannot be started raises as exec would; a later exit
        is not reported, unless `watch`: then the init reports it on the
        returned channel while that is open (closing it leaves the command
        running). `restart` (a Restart, or Docker's policy name such as
        "always" or "on-failure:3"): the sandbox starts it again when it
        exits; a watcher hears only the exit after which it is not."""
        client = self.client
        return await client.spawn(self.command(cmd, await self.identity(user), cwd, env, restart),
                                  process.devnull(), watch=watch)

    async def start_process(self, cmd: Sequence[str], *, input: str | bytes | None = None, stdin_open: bool = False,
                            cwd: str | None = None, env: Mapping[str, str] | None = None,
                            user: str | None = None, output_limit: int | None = None,
                            restart: Restart | str | None = None) -> "streaming.Process":
        """Starts `cmd` and returns a Process whose output streams to the
        host as the command writes it (see nsbox/init/streaming.py): iterate it
        for Output and Exit events, write_stdin/close_stdin (stdin_open=True),
        kill(), or wait() for an ExecResult. Returns once the command runs.

        `input` is written to stdin first; stdin is then closed unless
        `stdin_open`. Output waiting for the consumer keeps its last N bytes
        per stream (N from nsbox.init.output_limits; the sandbox's timeout and "raise"
        mode do not apply: the process runs until it exits or is killed;
        `output_limit` sets another N). Start failures are reported as exec
        reports them. `restart` as for spawn(): the process's output and
        Exit are those of all its runs; kill(), or signal() with SIGTERM,
        ends the policy (as `docker kill` does)."""
        from .init import streaming

        client = self.client
        identity = await self._identity_for_command(cmd, user)
        if isinstance(identity, ExecResult):
            return streaming.finished(identity, self.command(cmd, self._identity, cwd, env), self.id)
        data = input.encode("utf-8") if isinstance(input, str) else input
        return await streaming.start(client, self.command(cmd, identity, cwd, env, restart), input=data,
                                     stdin_open=stdin_open,
                                     limit=exec_output_limit() if output_limit is None else output_limit,
                                     devnull=process.devnull(), sandbox_id=self.id)

    # ---- files -------------------------------------------------------

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        """Reads a file of the sandbox as the default user.

        Raises FileNotFoundError, PermissionError, IsADirectoryError,
        UnicodeDecodeError (text mode) and OutputLimitExceeded.
        """
        return await files.read_file(self.client, _creds(self._identity), self._path(file), text)

    async def write_file(self, file: str, contents: str | bytes) -> None:
        """Writes a file of the sandbox as the default user, creating parent
        directories. Raises PermissionError and IsADirectoryError."""
        await files.write_file(self.client, _creds(self._identity), self._path(file), contents)

    def _path(self, file: str) -> str:
        if not file:
            raise ValueError("the file name is empty")
        return posixpath.join(self.workdir, file)

    async def status(self) -> dict[str, int]:
        """The init's counters: execs served and commands running."""
        return await self.client.status()


def confined(binds: Sequence[Bind], *, id_mapping: idmap.Requested, label: str = "") -> Sandbox:
    """The sandbox storage unpacks in (storage/confined.py's Runner): the
    host-composed root, network none, working in /, seeing only `binds` of
    the host's files."""
    return Sandbox(mounts=binds, id_mapping=id_mapping, workdir="/", label=label)


def _creds(identity: users.Identity) -> protocol.Creds:
    return protocol.Creds(identity.uid, identity.gid, identity.groups)

