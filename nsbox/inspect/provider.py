"""nsbox as an Inspect AI sandbox provider: `inspect eval task.py --sandbox nsbox`.

A thin adapter: every behaviour lives in nsbox.Sandbox; this module maps
Inspect's lifecycle onto it. The configuration is config.py's, the error
mapping errors.py's, exec_remote's process exec_remote.py's, compose
projects compose.py's.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import shlex
import sys
from pathlib import Path
from typing import Any, Literal, Union, overload

import anyio
from pydantic import BaseModel

from inspect_ai.util import (
    ExecRemoteAwaitableOptions,
    ExecRemoteProcess,
    ExecRemoteStreamingOptions,
    ExecResult,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    sandboxenv,
)

from .. import manage
from ..errors import NsboxError
from ..host.live import SandboxInfo
from ..init.output_limits import exec_output_limit, human_size
from ..network import Network
from ..sandbox import Sandbox, confined
from ..spec import NET
from .compose import (
    COMPOSE_FILES,
    DOCKERFILES,
    ComposeTask,
    Sample,
    environ_variables,
    images_depend,
    is_docker_config,
    prepare,
    sample_variables,
    start_sample,
)
from .config import (
    CONFIG_FILES,
    NetworkSettings,
    NsboxConfig,
    SandboxSettings,
    config_key,
    load_config,
    resolve_rootfs,
)
from .errors import as_inspect_errors
from .exec_remote import NsboxExecRemoteProcess, forward_exec_remote
from .throttle import subprocess_slot

__all__ = ["NsboxSandboxEnvironment", "NsboxExecRemoteProcess", "NsboxConfig", "SandboxSettings",
           "NetworkSettings", "load_config", "shell_command"]

logger = logging.getLogger(__name__)


async def _on_sample_network(cfg: NsboxConfig, name: str, spec: SandboxSettings,
                             networks: dict[str, Network]) -> SandboxSettings:
    """The settings of sandbox `name` with the service network its "net:NAME"
    names made the sample's own: started on first use, into `networks`
    (under a name of its own: samples never share one). Unchanged where it
    names none."""
    if not spec.network.startswith(NET):
        return spec
    net = spec.network[len(NET):]
    if net not in networks:
        settings = cfg.networks.get(net, NetworkSettings())
        networks[net] = await Network(f"{net}-{secrets.token_hex(4)}", internal=settings.internal,
                                      host_access=settings.host_access, id_mapping=cfg.id_mapping).start()
    return spec.model_copy(update={"network": networks[net].spec_value, **_known_by(name, spec)})


def _known_by(name: str, settings: SandboxSettings) -> dict[str, Any]:
    """On a service network, the other members know a sandbox by its name in
    the configuration: its hostname, else one of its aliases."""
    if settings.hostname is None:
        return {"hostname": name}
    if name != settings.hostname and name not in settings.network_aliases:
        return {"network_aliases": (*settings.network_aliases, name)}
    return {}


@sandboxenv(name="nsbox")
class NsboxSandboxEnvironment(SandboxEnvironment):
    """An Inspect sandbox backed by an nsbox.Sandbox."""

    # Sandboxes still open, per configuration, for task_cleanup.
    _live: dict[Any, set["NsboxSandboxEnvironment"]] = {}
    # Root filesystems resolved by task_init (tarballs unpacked), per configuration.
    _rootfs: dict[tuple[str, str], str] = {}
    # Images task_init pulled (reference, platform): samples never pull again.
    _pulled: set[tuple[str, str | None]] = set()

    # Compose projects prepared (images ready), per configuration and set of
    # sample variables; the images made ready, per configuration and source.
    _compose: dict[tuple[Any, tuple[tuple[str, str], ...]], ComposeTask] = {}
    _compose_images: dict[Any, dict[tuple[Any, ...], Any]] = {}
    _compose_locks: dict[Any, anyio.Lock] = {}

    def __init__(self, sandbox: Sandbox, config: NsboxConfig) -> None:
        super().__init__()
        self.sandbox = sandbox
        self._config = config
        self._services: Sample | None = None  # the compose sample this sandbox is a service of
        self._networks: list[Network] = []  # the service networks of its sample (nsbox.yaml)

    # ---- configuration -------------------------------------------------

    @classmethod
    def config_files(cls) -> list[str]:
        # Listing compose.yaml makes the provider Docker-compatible: Inspect
        # then hands it a task's compose file, Dockerfile or ComposeConfig.
        return CONFIG_FILES + COMPOSE_FILES + DOCKERFILES

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return NsboxConfig(**config)

    @classmethod
    def default_concurrency(cls) -> int | None:
        # None, as Inspect's `local` sandbox: a sandbox costs ~1 MiB and
        # milliseconds, and max_samples bounds how many run. With a default
        # limit, Inspect 0.3.285 delays every sample by a random 0-1 s
        # (sandboxenv_context), which made a 200-sample eval 1.3x slower than
        # `local`. --max-sandboxes still sets one.
        return None

    # ---- lifecycle -----------------------------------------------------

    @classmethod
    async def _compose_task(cls, config: SandboxEnvironmentConfigType, variables: dict[str, str]) -> ComposeTask:
        """The project read with these sample variables, images ready: once
        per distinct set (samples starting at once wait for the first)."""
        base = config_key(config)
        key = (base, tuple(sorted(variables.items())))
        if key not in cls._compose:
            async with cls._compose_locks.setdefault(base, anyio.Lock()):
                if key not in cls._compose:
                    with as_inspect_errors():
                        cls._compose[key] = await prepare(config, variables=variables,
                                                          known=cls._compose_images.setdefault(base, {}))
        return cls._compose[key]

    @classmethod
    async def task_init_environment(cls, config: SandboxEnvironmentConfigType | None,
                                    metadata: dict[str, str]) -> dict[str, str]:
        # As Inspect's docker provider: a sample whose variables change the
        # images gets a task_init of its own, with them in the environment.
        variables = sample_variables(config, metadata)
        return variables if images_depend(config, variables) else {}

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        if is_docker_config(config):
            assert config is not None
            # Images built or pulled once per task (per set of sample
            # variables that names other images).
            await cls._compose_task(config, environ_variables(config))
            return
        cfg = load_config(config)
        for _, spec in cfg.settings():
            cls._rootfs[(spec.rootfs, cfg.id_mapping)] = await resolve_rootfs(spec.rootfs, cfg.id_mapping)
            if spec.image is not None:
                # Pulled and unpacked once per task, never per sample.
                from ..storage import Store
                from ..storage.progress import Progress
                from ..storage.resolve import resolve

                await resolve(Store(runner=confined), spec.image, id_mapping=cfg.id_mapping, pull=spec.pull,
                              platform=spec.platform, progress=Progress(sys.stderr, label=spec.image))
                cls._pulled.add((spec.image, spec.platform))
        # Start and stop one sandbox now, so that a host that cannot run
        # them fails the task with a clear message before any sample starts
        # (on a service network of its own where the first sandbox has one).
        name, spec = cfg.settings()[0]
        networks: dict[str, Network] = {}
        try:
            spec = await _on_sample_network(cfg, name, spec, networks)
            async with cls._make(cfg, spec, f"{task_name}: startup check"):
                pass
        finally:
            with anyio.CancelScope(shield=True):
                for net in networks.values():
                    await net.close()

    @classmethod
    def _make(cls, cfg: NsboxConfig, settings: SandboxSettings, label: str) -> Sandbox:
        rootfs = cls._rootfs.get((settings.rootfs, cfg.id_mapping), settings.rootfs)
        pulled = (settings.image, settings.platform) in cls._pulled
        return Sandbox(spec=settings.spec(
            rootfs=rootfs, pull="missing" if pulled else settings.pull, output_limit_mode=cfg.output_limit_mode,
            id_mapping=cfg.id_mapping, label=label, origin="inspect"))

    @classmethod
    async def sample_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                          metadata: dict[str, str]) -> dict[str, SandboxEnvironment]:
        sample = metadata.get("__sample_id__", "")
        if is_docker_config(config):
            assert config is not None
            return await cls._compose_sample_init(task_name, config, sample, sample_variables(config, metadata))
        cfg, live_key = load_config(config), config_key(config)
        created: dict[str, NsboxSandboxEnvironment] = {}
        networks: dict[str, Network] = {}  # this sample's service networks, by the config's name
        try:
            for name, spec in cfg.settings():
                key = (spec.rootfs, cfg.id_mapping)
                if key not in cls._rootfs:  # sample_init without task_init (tests, tools)
                    cls._rootfs[key] = await resolve_rootfs(spec.rootfs, cfg.id_mapping)
                spec = await _on_sample_network(cfg, name, spec, networks)
                label = f"{task_name} sample {sample} ({name})" if sample != "" else f"{task_name} ({name})"
                sb = cls._make(cfg, spec, label)
                await sb.start()
                created[name] = cls(sb, cfg)
                created[name]._networks = list(networks.values())
                cls._live.setdefault(live_key, set()).add(created[name])
        except BaseException:
            with anyio.CancelScope(shield=True):
                await cls._close_all(live_key, list(created.values()))
                for net in networks.values():
                    await net.close()
            raise
        for env in created.values():
            env._networks = list(networks.values())
        return dict(created)

    @classmethod
    async def _compose_sample_init(cls, task_name: str, config: SandboxEnvironmentConfigType,
                                   sample: str, variables: dict[str, str]) -> dict[str, SandboxEnvironment]:
        task = await cls._compose_task(config, variables)
        label = f"{task_name} sample {sample}" if sample != "" else task_name
        with as_inspect_errors():
            services, sandboxes = await start_sample(task, label)
        cfg = NsboxConfig()
        envs: dict[str, SandboxEnvironment] = {}
        for name, sb in sandboxes.items():
            env = cls(sb, cfg)
            env._services = services
            envs[name] = env
            cls._live.setdefault(config_key(config), set()).add(env)
        return envs

    @classmethod
    async def _close_all(cls, key: Any, envs: list["NsboxSandboxEnvironment"]) -> None:
        samples = {id(e._services): e._services for e in envs if e._services is not None}
        networks = {id(n): n for e in envs for n in e._networks}
        for env in envs:
            cls._live.get(key, set()).discard(env)
        # A sandbox's end is not waited for: once its init is told to end,
        # nothing of it runs, and the kernel's teardown finishes beside the
        # next sample (Sandbox.close).
        closes = [functools.partial(env.sandbox.close, wait=False) for env in envs if env._services is None]
        closes += [services.close for services in samples.values()]
        if len(closes) == 1:  # most samples: no task to start for one close
            await closes[0]()
        else:
            async with anyio.create_task_group() as tg:
                for close in closes:
                    tg.start_soon(close)
        for net in networks.values():  # once its members are gone
            await net.close()

    @classmethod
    async def sample_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                             environments: dict[str, SandboxEnvironment], interrupted: bool) -> None:
        # Closing kills every process of the sandbox at once, so an
        # interrupted sample is cleaned up just as fast as a finished one.
        envs = [e.as_type(NsboxSandboxEnvironment) for e in environments.values()]
        with anyio.CancelScope(shield=True):
            await cls._close_all(config_key(config), envs)

    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                           cleanup: bool) -> None:
        key = config_key(config)
        live = list(cls._live.pop(key, set()))
        for k in [k for k in cls._compose if k[0] == key]:
            del cls._compose[k]
        cls._compose_images.pop(key, None)
        cls._compose_locks.pop(key, None)
        if cleanup:
            await cls._close_all(key, live)
            return
        if not live:
            return
        # --no-sandbox-cleanup: the sandboxes would die with this process;
        # detach them so they can be inspected, and say how.
        lines = ["", "nsbox sandboxes kept running (--no-sandbox-cleanup):"]
        for env in live:
            await env.sandbox.detach()
            lines.append(f"  {env.sandbox.id}  {env.sandbox.label}")
        lines += ["Log in:     nsbox shell <id>",
                  "Clean up:   inspect sandbox cleanup nsbox   (or: inspect sandbox cleanup nsbox <id>)", ""]
        print("\n".join(lines), file=sys.stderr)

    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:
        # `inspect sandbox cleanup nsbox [ID]`: each failure is one line
        # (not a traceback), the others go on, and the exit status says.
        failed = False

        def remove(info: SandboxInfo, line: str) -> None:
            nonlocal failed
            try:
                manage.remove(info, force=True)
                print(line)
            except NsboxError as e:
                failed = True
                print(f"nsbox: {e}", file=sys.stderr)

        if id is not None:
            try:
                info = manage.find(id)
            except NsboxError as e:
                print(f"nsbox: {e}", file=sys.stderr)
                raise SystemExit(1) from None
            remove(info, f"removed nsbox sandbox {info.id}")
        else:
            # Every sandbox Inspect left behind (detached by --no-sandbox-cleanup,
            # or orphaned), plus anything dead, then compose samples' volumes.
            for e in manage.entries():
                inspect_leftover = e.info.origin == "inspect" and e.state in ("detached", "orphaned")
                if inspect_leftover or e.state == "dead":
                    remove(e.info, f"removed nsbox sandbox {e.info.id} {e.info.label}")
            for volumes in manage.remove_orphan_volumes():
                print(f"removed the volumes of a compose sample: {volumes}")
        if failed:
            raise SystemExit(1)

    # ---- the sandbox contract -------------------------------------------

    async def exec(
        self,
        cmd: list[str],
        input: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        timeout: int | None = None,
        timeout_retry: bool = True,  # advisory; a local runtime does not need retries
        concurrency: bool = True,
    ) -> ExecResult[str]:
        async with subprocess_slot(concurrency):
            with as_inspect_errors():
                r = await self.sandbox.exec(cmd, input=input, cwd=cwd, env=env, user=user, timeout=timeout)
        if r.truncated:
            self._note_truncation(cmd, r.stdout_truncated, r.stderr_truncated)
        return ExecResult(success=r.success, returncode=r.returncode, stdout=r.stdout, stderr=r.stderr)

    # Whether this environment (one per sample and name) has said that it
    # truncated output: Inspect's ExecResult has no field for it, so it is
    # logged, once, at WARNING (which Inspect records in the sample's log).
    _truncation_noted = False

    def _note_truncation(self, cmd: list[str], stdout_dropped: int, stderr_dropped: int) -> None:
        dropped = " and ".join(f"{n} byte{'s' if n != 1 else ''} of {name}"
                               for name, n in (("stdout", stdout_dropped), ("stderr", stderr_dropped)) if n)
        command = shlex.join(cmd)
        if len(command) > 120:
            command = command[:117] + "..."
        if self._truncation_noted:
            logger.debug("nsbox sandbox %s: output truncated, %s dropped: %s", self.sandbox.id, dropped, command)
            return
        self._truncation_noted = True
        logger.warning(
            "nsbox sandbox %s: `%s` wrote more than the output limit of %s per stream: the first %s were "
            "dropped, the last %s kept (SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE or "
            "INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE sets the limit). Later truncation in this sandbox is logged "
            "at debug level only.", self.sandbox.id, command, human_size(exec_output_limit()), dropped,
            human_size(exec_output_limit()))

    @overload
    async def exec_remote(self, cmd: list[str], options: ExecRemoteStreamingOptions | None = None, *,
                          stream: Literal[True] = True) -> ExecRemoteProcess: ...

    @overload
    async def exec_remote(self, cmd: list[str], options: ExecRemoteAwaitableOptions | None = None, *,
                          stream: Literal[False]) -> ExecResult[str]: ...

    async def exec_remote(self, cmd: list[str],
                          options: ExecRemoteStreamingOptions | ExecRemoteAwaitableOptions | None = None, *,
                          stream: bool = True) -> ExecRemoteProcess | ExecResult[str]:
        """Inspect's exec_remote, natively: the command runs on the init's
        spawn server and its output reaches the caller as it is written,
        with no tool injection and no polling (Sandbox.start_process).

        Streaming (default): an ExecRemoteProcess whose events are
        ExecStdout/ExecStderr as the command writes, then ExecCompleted; after
        kill(), the output written before it and no ExecCompleted, as
        Inspect's own. Awaitable (stream=False): an ExecResult (the last N
        bytes per stream), TimeoutError after `timeout` with the process
        tree killed. Cancelling either kills the tree. `concurrency`
        throttles the start only: a long-running process holds no slot.
        poll_interval and the poll_* options do not apply (nothing polls).
        """
        opts = options if options is not None else (ExecRemoteStreamingOptions() if stream
                                                     else ExecRemoteAwaitableOptions())
        stdin_open = isinstance(opts, ExecRemoteStreamingOptions) and opts.stdin_open
        async with subprocess_slot(opts.concurrency):
            with as_inspect_errors():
                proc = await self.sandbox.start_process(cmd, input=opts.input, stdin_open=stdin_open, cwd=opts.cwd,
                                                        env=opts.env, user=opts.user)
        if stream:
            return NsboxExecRemoteProcess(self, proc, opts, cmd)
        timeout = opts.timeout if isinstance(opts, ExecRemoteAwaitableOptions) else None
        with as_inspect_errors():
            async with proc:  # killed on timeout or cancellation
                with anyio.fail_after(timeout):
                    r = await proc.wait()
        if r.truncated:
            self._note_truncation(cmd, r.stdout_truncated, r.stderr_truncated)
        return ExecResult(success=r.success, returncode=r.returncode, stdout=r.stdout, stderr=r.stderr)

    async def write_file(self, file: str, contents: str | bytes) -> None:
        with as_inspect_errors():
            await self.sandbox.write_file(file, contents)

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> Union[str | bytes]:
        with as_inspect_errors():
            return await self.sandbox.read_file(file, text)

    async def connection(self, *, user: str | None = None) -> SandboxConnection:
        if not self.sandbox.running:
            raise ConnectionError(f"nsbox sandbox {self.sandbox.id} is not running")
        return SandboxConnection(type="nsbox", command=await shell_command(self.sandbox, user),
                                 container=self.sandbox.id)

    def default_polling_interval(self) -> float:
        return 0.2


async def shell_command(sb: Sandbox, user: str | None = None) -> str:
    """A command a person can paste into a terminal on this host, as the user
    who created the sandbox, to get a login shell inside it as `user`, in
    its working directory: `nsbox shell ID`.

    What runs on the person's terminal is nsbox itself: it relays a
    terminal that the sandbox's init opens inside the sandbox, and the shell
    runs where every sandbox process runs (the nested user namespace, as
    `user`). So nothing the sandbox can replace (its /bin/sh, its nsenter)
    runs with more privilege than sandbox root, and no sandbox process
    holds the person's own terminal (which TIOCSTI would let it type into).
    """
    with as_inspect_errors():
        await sb.identity(user)  # exists, and the id mapping can run it
    script = Path(sys.executable).parent / "nsbox"
    cli = [os.fspath(script)] if os.access(script, os.X_OK) else [sys.executable, "-m", "nsbox"]
    # The sandbox is found in the live-sandbox list under the state directory.
    env = [f"NSBOX_STATE_DIR={os.environ['NSBOX_STATE_DIR']}"] if os.environ.get("NSBOX_STATE_DIR") else []
    return shlex.join([*(["env", *env] if env else []), *cli, "shell", sb.id, *(["-u", user] if user else [])])


# Inspect's sandbox proxy does not forward exec_remote (see
# forward_exec_remote): patched here, where the provider registers, so that
# the patch is in place whenever Inspect can hand out an nsbox sandbox, and
# only then.
forward_exec_remote(NsboxSandboxEnvironment)
