"""nsbox as an Inspect AI sandbox provider: `inspect eval task.py --sandbox nsbox`.

A thin adapter: every behaviour lives in nsbox.Sandbox; this module maps
Inspect's lifecycle onto it, loads the configuration, and translates
nsbox's exceptions into Inspect's.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import shlex
import sys
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Literal, Union, overload

import anyio
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxUnavailableError,
    SandboxUserUnsupportedError,
    sandboxenv,
)
from inspect_ai.util import (
    ExecCompleted,
    ExecOutput,
    ExecRemoteAwaitableOptions,
    ExecRemoteProcess,
    ExecRemoteStreamingOptions,
    ExecStderr,
    ExecStdout,
)

from ..host import dirs
from ..plan import gpu
from .. import manage
from ..errors import NsboxError, OutputLimitExceeded, SandboxUnavailable, UserUnsupported
from ..host.idmap import detect as detect_idmap
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
    remove_orphan_volumes,
    start_sample,
)
from ..storage.tarball import import_tarball
from ..init.output_limits import exec_output_limit, human_size
from ..network import Network
from ..plan.rootfs import Bind
from ..sandbox import Sandbox, confined
from ..init.streaming import Exit, Output, Process, decoder
from ..spec import NET, NETWORK_NAME, SandboxSpec, parse_size

CONFIG_FILES = ["nsbox.yaml", "nsbox.yml"]

logger = logging.getLogger(__name__)


class SandboxSettings(BaseModel):
    """Settings of one sandbox."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rootfs: str = "host"
    """'host' (the built-in root composed from this host), a directory, or a
    root filesystem tarball (unpacked once, at task start)."""
    image: str | None = None
    """An OCI/Docker image instead of rootfs (pulled and unpacked once, at task start)."""
    pull: Literal["missing", "always", "never"] = "missing"
    platform: str | None = None
    """The image's platform, e.g. linux/arm64 (default: this host's)."""
    user: str | None = None
    """The default user of exec, read_file and write_file (default: the image's USER, else root)."""
    workdir: str | None = None
    """Working directory; relative paths resolve against it (default: the user's home)."""
    env: dict[str, str] = {}
    network: str = "none"
    """'none': a private network with loopback only; 'host': the host's network;
    'nat': outbound access (pasta or slirp4netns; the host's loopback as
    host.nsbox.internal only with host_loopback); 'proxy': only the hosts `allow` names, through a proxy;
    'net:NAME': the sample's service network NAME (see `networks`), which
    the sample's sandboxes naming it share, each with its own address."""
    host_loopback: bool = False
    """nat: the host's loopback reachable as host.nsbox.internal (off: the
    host's 127.0.0.1 services stay closed to the sandbox)."""
    allow: tuple[str, ...] = ()
    """The proxy mode's allowlist: "example.com", "*.example.org", "host:443", "*"."""
    network_aliases: tuple[str, ...] = ()
    """On a service network: other names the sandbox answers to (besides its name in `sandboxes`)."""
    ports: tuple[str, ...] = ()
    """Published ports, "[IP:]HOSTPORT:PORT", on 127.0.0.1 unless IP is given."""
    mounts: tuple[str, ...] = ()
    """Host paths to bind in, as SOURCE:TARGET[:ro]."""
    timeout: int | None = None
    """Default timeout of exec, in seconds."""
    nested_userns: bool = False
    """Let commands create user namespaces and mount (to run a sandbox inside)."""
    privileged: bool = False
    """As rootless podman's --privileged: nested_userns, no seccomp filter, every
    capability of the sandbox's own user namespace, a sysfs at /sys; never host root."""
    memory: int | str | None = None
    """Memory limit of the sandbox, as in Docker: bytes, or "512m", "2g"."""
    pids_limit: int | None = Field(default=None, ge=1)
    """Most processes the sandbox may have at once."""
    cpus: float | None = Field(default=None, ge=0.01)
    """CPU time, in CPUs (1.5: one and a half)."""
    disk: int | str | None = None
    """Size cap of the writable layer (with /tmp, /dev/shm and /run): bytes, or "2g"."""
    strict_limits: bool = False
    """Refuse memory, pids_limit or cpus where no cgroup enforces it (see `nsbox doctor`)."""
    gpus: int | str | None = None
    """NVIDIA GPUs to pass through: "all", a number, or "device=0,1"."""

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: int | str | None) -> str | None:
        return gpu.normalize(v)

    @field_validator("memory", "disk")
    @classmethod
    def _size(cls, v: int | str | None, info: ValidationInfo) -> int | None:
        return None if v is None else parse_size(v, info.field_name or "size")

    @model_validator(mode="after")
    def _rootfs_or_image(self) -> "SandboxSettings":
        if self.image is not None and self.rootfs != "host":
            raise ValueError("give either rootfs or image, not both")
        return self

    @field_validator("network")
    @classmethod
    def _network(cls, v: str) -> str:
        # net:NAME: a network name, short enough for the sample's suffix (_sample_network).
        name = v[len(NET):]
        if v not in ("none", "host", "nat", "proxy") and not (
                v.startswith(NET) and NETWORK_NAME.fullmatch(name) and len(name) <= 41):
            raise ValueError(f"Input should be 'none', 'host', 'nat', 'proxy' or 'net:NAME', not {v!r}")
        return v

    @field_validator("workdir")
    @classmethod
    def _absolute_workdir(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError("must be an absolute path inside the sandbox")
        return v

    @field_validator("mounts")
    @classmethod
    def _mount_syntax(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for m in v:
            parts = m.split(":")
            if not (len(parts) == 2 or (len(parts) == 3 and parts[2] in ("ro", "rw"))) or not all(parts[:2]):
                raise ValueError(f"{m!r} is not SOURCE:TARGET[:ro]")
        return v

    def __hash__(self) -> int:  # Inspect keeps configs in sets; dict fields are not hashable
        return hash(self.model_dump_json())


class NetworkSettings(BaseModel):
    """A service network of each sample (nsbox.Network)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    internal: bool = True
    """No outbound access (false: outbound as the nat mode, /dev/net/tun needed)."""
    host_access: bool = False
    """The host's loopback reachable as host.nsbox.internal (outbound networks)."""


class NsboxConfig(SandboxSettings):
    """Configuration of the nsbox provider (nsbox.yaml, or this model in Python).

    The top-level settings describe the "default" sandbox. `sandboxes` gives
    a sample several named sandboxes; each entry starts from the top-level
    settings and overrides what it names. The first is the default one.
    """

    output_limit_mode: Literal["truncate", "raise"] = "truncate"
    """Output over the limit: 'truncate' keeps the last bytes; 'raise'
    raises OutputLimitExceededError (Inspect's older contract)."""
    id_mapping: Literal["auto", "single", "host-root"] = "auto"
    """'single' maps only your uid; 'host-root' (real root only) maps host root."""
    sandboxes: dict[str, SandboxSettings] | None = None
    networks: dict[str, NetworkSettings] = {}
    """Service networks of each sample, by the NAME sandboxes give as
    `network: net:NAME` (one not listed here is internal)."""

    def specs(self) -> list[tuple[str, SandboxSettings]]:
        base = self.model_dump(include=set(SandboxSettings.model_fields))
        if not self.sandboxes:
            return [("default", SandboxSettings(**base))]
        return [(name, SandboxSettings(**{**base, **spec.model_dump(exclude_unset=True)}))
                for name, spec in self.sandboxes.items()]

    def __hash__(self) -> int:
        return hash(self.model_dump_json())


async def _sample_network(cfg: NsboxConfig, value: str, networks: dict[str, Network]) -> Network:
    """The sample's network `value` ("net:NAME") names, started on first use
    (under a name of its own: samples never share one)."""
    name = value[len(NET):]
    if name not in networks:
        settings = cfg.networks.get(name, NetworkSettings())
        networks[name] = await Network(f"{name}-{secrets.token_hex(4)}", internal=settings.internal,
                                       host_access=settings.host_access, id_mapping=cfg.id_mapping).start()
    return networks[name]


def _config_key(config: SandboxEnvironmentConfigType | None) -> Any:
    """What identifies a configuration across task_init, the samples and
    task_cleanup (models are compared by content)."""
    if isinstance(config, BaseModel) and not isinstance(config, NsboxConfig):
        return (type(config).__name__, config.model_dump_json())
    return load_config(config) if not is_docker_config(config) else config


def load_config(config: SandboxEnvironmentConfigType | None) -> NsboxConfig:
    """The configuration, with relative host paths made absolute (a file's
    against its directory). Invalid configuration raises one clear error."""
    if config is None:
        return NsboxConfig()
    if isinstance(config, NsboxConfig):
        return _absolute_paths(config, Path.cwd())
    if isinstance(config, str):
        path = Path(config)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except OSError as e:
            raise NsboxError(f"cannot read the nsbox configuration {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise NsboxError(f"{path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise NsboxError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
        try:
            return _absolute_paths(NsboxConfig(**data), path.parent)
        except ValidationError as e:
            raise NsboxError(f"invalid nsbox configuration {path}:\n{_field_errors(e)}") from None
    raise NsboxError(f"the nsbox provider takes an NsboxConfig or a YAML file name, not {type(config).__name__}")


def _field_errors(e: ValidationError) -> str:
    return "\n".join(f"  {'.'.join(map(str, err['loc'])) or '(top)'}: {err['msg']}" for err in e.errors())


def _absolute_paths(config: NsboxConfig, base: Path) -> NsboxConfig:
    def fix(spec: SandboxSettings) -> dict[str, Any]:
        changes: dict[str, Any] = {}
        if "rootfs" in spec.model_fields_set and spec.rootfs != "host":
            changes["rootfs"] = str((base / os.path.expanduser(spec.rootfs)).resolve())
        if spec.mounts:
            changes["mounts"] = tuple(
                ":".join([str((base / os.path.expanduser(m.split(":")[0])).resolve()), *m.split(":")[1:]])
                for m in spec.mounts)
        return changes

    named = None
    if config.sandboxes:
        named = {k: v.model_copy(update=fix(v)) for k, v in config.sandboxes.items()}
    return config.model_copy(update={**fix(config), "sandboxes": named})


async def _resolve_rootfs(rootfs: str, id_mapping: Literal["auto", "single", "host-root"]) -> str:
    """A directory for `rootfs`; a tarball is unpacked once per content and
    id mapping, into the data directory."""
    if rootfs == "host" or os.path.isdir(rootfs):
        return rootfs
    if not os.path.isfile(rootfs):
        raise NsboxError(f"rootfs {rootfs} does not exist",
                         hint="give 'host', a directory holding a root filesystem, or a tarball of one")
    digest = await anyio.to_thread.run_sync(_sha256, rootfs)
    mapping = detect_idmap(id_mapping).key
    dest = dirs.data_dir() / "images" / f"{digest[:24]}-{mapping}"
    if not dest.exists():
        await import_tarball(rootfs, dest, runner=confined, id_mapping=id_mapping,
                             progress=lambda msg: print(f"nsbox: {msg}", file=sys.stderr))
    return os.fspath(dest)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _as_inspect_errors() -> Iterator[None]:
    """nsbox's exceptions, as the ones Inspect's contract names."""
    try:
        yield
    except UserUnsupported as e:
        raise SandboxUserUnsupportedError(str(e)) from e
    except SandboxUnavailable as e:
        raise SandboxUnavailableError(str(e)) from e
    except OutputLimitExceeded as e:
        output = None if e.stdout is None else e.stdout + (e.stderr or "")
        raise OutputLimitExceededError(human_size(e.limit), output) from e


@contextlib.asynccontextmanager
async def _throttle(enabled: bool) -> AsyncIterator[None]:
    """Inspect's throttle for local subprocesses, the one its `local`
    sandbox uses (max_subprocesses, default: the CPU count)."""
    if not enabled:
        yield
        return
    try:
        from inspect_ai.util import concurrency
        from inspect_ai.util._subprocess import max_subprocesses_context_var
    except ImportError:  # another Inspect version: run unthrottled
        yield
        return
    async with concurrency("subprocesses", max_subprocesses_context_var.get(), resizable=True):
        yield


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
        base = _config_key(config)
        key = (base, tuple(sorted(variables.items())))
        if key not in cls._compose:
            async with cls._compose_locks.setdefault(base, anyio.Lock()):
                if key not in cls._compose:
                    with _as_inspect_errors():
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
        for _, spec in cfg.specs():
            cls._rootfs[(spec.rootfs, cfg.id_mapping)] = await _resolve_rootfs(spec.rootfs, cfg.id_mapping)
            if spec.image is not None:
                # Pulled and unpacked once per task, never per sample.
                from ..storage import Store
                from ..storage.progress import Progress
                from ..storage.resolve import resolve

                await resolve(Store(runner=confined), spec.image, id_mapping=cfg.id_mapping, pull=spec.pull,
                              platform=spec.platform, progress=Progress(sys.stderr, label=spec.image))
                cls._pulled.add((spec.image, spec.platform))
        # Start and stop one sandbox now, so that a host that cannot run
        # them fails the task with a clear message before any sample starts.
        _, spec = cfg.specs()[0]
        async with cls._make(cfg, spec, f"{task_name}: startup check"):
            pass

    @classmethod
    def _make(cls, cfg: NsboxConfig, settings: SandboxSettings, label: str, hostname: str | None = None) -> Sandbox:
        rootfs = cls._rootfs.get((settings.rootfs, cfg.id_mapping), settings.rootfs)
        pulled = (settings.image, settings.platform) in cls._pulled
        return Sandbox(spec=SandboxSpec(
            rootfs=rootfs, image=settings.image, pull="missing" if pulled else settings.pull,
            platform=settings.platform, user=settings.user, workdir=settings.workdir, env=settings.env,
            network=settings.network, host_loopback=settings.host_loopback, allow=settings.allow, ports=settings.ports,
            network_aliases=settings.network_aliases, output_limit_mode=cfg.output_limit_mode, id_mapping=cfg.id_mapping,
            timeout=settings.timeout, mounts=tuple(Bind.parse(m) for m in settings.mounts), label=label,
            nested_userns=settings.nested_userns, privileged=settings.privileged,
            memory=settings.memory, hostname=hostname,  # type: ignore[arg-type]
            pids_limit=settings.pids_limit, cpus=settings.cpus, disk=settings.disk,  # type: ignore[arg-type]
            strict_limits=settings.strict_limits, gpus=settings.gpus,
            origin="inspect",
        ))

    @classmethod
    async def sample_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                          metadata: dict[str, str]) -> dict[str, SandboxEnvironment]:
        sample = metadata.get("__sample_id__", "")
        if is_docker_config(config):
            assert config is not None
            return await cls._compose_sample_init(task_name, config, sample, sample_variables(config, metadata))
        cfg = load_config(config)
        created: dict[str, NsboxSandboxEnvironment] = {}
        networks: dict[str, Network] = {}  # this sample's service networks, by the config's name
        try:
            for name, spec in cfg.specs():
                key = (spec.rootfs, cfg.id_mapping)
                if key not in cls._rootfs:  # sample_init without task_init (tests, tools)
                    cls._rootfs[key] = await _resolve_rootfs(spec.rootfs, cfg.id_mapping)
                on_net = spec.network.startswith(NET)
                if on_net:  # known to the other members by its name in the configuration
                    spec = spec.model_copy(update={"network": (await _sample_network(cfg, spec.network, networks))
                                                   .spec_value})
                label = f"{task_name} sample {sample} ({name})" if sample != "" else f"{task_name} ({name})"
                sb = cls._make(cfg, spec, label, hostname=name if on_net else None)
                await sb.start()
                created[name] = cls(sb, cfg)
                created[name]._networks = list(networks.values())
                cls._live.setdefault(cfg, set()).add(created[name])
        except BaseException:
            with anyio.CancelScope(shield=True):
                await cls._close_all(cfg, list(created.values()))
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
        with _as_inspect_errors():
            services, sandboxes = await start_sample(task, label)
        cfg = NsboxConfig()
        envs: dict[str, SandboxEnvironment] = {}
        for name, sb in sandboxes.items():
            env = cls(sb, cfg)
            env._services = services
            envs[name] = env
            cls._live.setdefault(_config_key(config), set()).add(env)
        return envs

    @classmethod
    async def _close_all(cls, key: Any, envs: list["NsboxSandboxEnvironment"]) -> None:
        samples = {id(e._services): e._services for e in envs if e._services is not None}
        networks = {id(n): n for e in envs for n in e._networks}
        async with anyio.create_task_group() as tg:
            for env in envs:
                cls._live.get(key, set()).discard(env)
                if env._services is None:
                    tg.start_soon(env.sandbox.close)
            for services in samples.values():
                tg.start_soon(services.close)
        for net in networks.values():  # once its members are gone
            await net.close()

    @classmethod
    async def sample_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                             environments: dict[str, SandboxEnvironment], interrupted: bool) -> None:
        # Closing kills every process of the sandbox at once, so an
        # interrupted sample is cleaned up just as fast as a finished one.
        envs = [e.as_type(NsboxSandboxEnvironment) for e in environments.values()]
        with anyio.CancelScope(shield=True):
            await cls._close_all(_config_key(config), envs)

    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                           cleanup: bool) -> None:
        key = _config_key(config)
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
        if id is not None:
            info = manage.find(id)
            manage.remove(info, force=True)
            print(f"removed nsbox sandbox {info.id}")
            return
        # Every sandbox Inspect left behind (detached by --no-sandbox-cleanup,
        # or orphaned), plus anything dead, then compose samples' volumes.
        for e in manage.entries():
            inspect_leftover = e.info.origin == "inspect" and e.state in ("detached", "orphaned")
            if inspect_leftover or e.state == "dead":
                manage.remove(e.info, force=True)
                print(f"removed nsbox sandbox {e.info.id} {e.info.label}")
        for volumes in remove_orphan_volumes():
            print(f"removed the volumes of a compose sample: {volumes}")

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
        async with _throttle(concurrency):
            with _as_inspect_errors():
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
        async with _throttle(opts.concurrency):
            with _as_inspect_errors():
                proc = await self.sandbox.start_process(cmd, input=opts.input, stdin_open=stdin_open, cwd=opts.cwd,
                                                        env=opts.env, user=opts.user)
        if stream:
            return NsboxExecRemoteProcess(self, proc, opts, cmd)
        timeout = opts.timeout if isinstance(opts, ExecRemoteAwaitableOptions) else None
        with _as_inspect_errors():
            async with proc:  # killed on timeout or cancellation
                with anyio.fail_after(timeout):
                    r = await proc.wait()
        if r.truncated:
            self._note_truncation(cmd, r.stdout_truncated, r.stderr_truncated)
        return ExecResult(success=r.success, returncode=r.returncode, stdout=r.stdout, stderr=r.stderr)

    async def write_file(self, file: str, contents: str | bytes) -> None:
        with _as_inspect_errors():
            await self.sandbox.write_file(file, contents)

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> Union[str | bytes]:
        with _as_inspect_errors():
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
    with _as_inspect_errors():
        await sb.identity(user)  # exists, and the id mapping can run it
    script = Path(sys.executable).parent / "nsbox"
    cli = [os.fspath(script)] if os.access(script, os.X_OK) else [sys.executable, "-m", "nsbox"]
    # The sandbox is found in the registry under the state directory.
    env = [f"NSBOX_STATE_DIR={os.environ['NSBOX_STATE_DIR']}"] if os.environ.get("NSBOX_STATE_DIR") else []
    return shlex.join([*(["env", *env] if env else []), *cli, "shell", sb.id, *(["-u", user] if user else [])])


class NsboxExecRemoteProcess(ExecRemoteProcess):
    """Inspect's ExecRemoteProcess on an nsbox streaming Process: events come
    as the command writes its output (no tool server, no polling).

    Behaves as Inspect's own: iterable once; ExecStdout/ExecStderr, then
    ExecCompleted; kill() ends iteration after the output written before it,
    without ExecCompleted; cancelling the iteration kills the process;
    write_stdin/close_stdin need stdin_open=True. `pid` is nsbox's number
    for the process (the init does not report the command's pid).
    """

    def __init__(self, env: NsboxSandboxEnvironment, process: Process,
                 options: ExecRemoteStreamingOptions | ExecRemoteAwaitableOptions, cmd: list[str]) -> None:
        # Not ExecRemoteProcess.__init__: it sets up the JSON-RPC transport
        # to the injected tool server that this class does without.
        self._env = env
        self._sandbox = env
        self._process = process
        self._options = options
        self._cmd = cmd
        self._pid = process.id
        self._killed = False
        self._completed = False
        self._iteration_started = False
        self._pending_events: list[ExecOutput] = []
        self._decoders = {"stdout": decoder(), "stderr": decoder()}

    @property
    def pid(self) -> int:
        return self._process.id

    @property
    def process(self) -> Process:
        """The nsbox Process underneath (truncation counts, signal())."""
        return self._process

    def __aiter__(self) -> "NsboxExecRemoteProcess":
        if self._iteration_started:
            raise RuntimeError("ExecRemoteProcess can only be iterated once")
        self._iteration_started = True
        return self

    def _convert(self, event: Output) -> ExecOutput | None:
        if event.dropped:
            p = self._process
            self._env._note_truncation(self._cmd, p.stdout_truncated, p.stderr_truncated)
        text = self._decoders[event.stream].decode(event.data)
        if not text:
            return None
        return ExecStdout(data=text) if event.stream == "stdout" else ExecStderr(data=text)

    def _flush(self) -> list[ExecOutput]:
        """What the decoders held back (an incomplete character at the end)."""
        out: list[ExecOutput] = []
        for stream, dec in self._decoders.items():
            text = dec.decode(b"", final=True)
            if text:
                out.append(ExecStdout(data=text) if stream == "stdout" else ExecStderr(data=text))
        return out

    async def __anext__(self) -> ExecOutput:
        if self._pending_events:
            return self._pending_events.pop(0)
        if self._completed or self._killed:
            raise StopAsyncIteration
        try:
            with _as_inspect_errors():
                while True:
                    event = await self._process.__anext__()
                    if isinstance(event, Output):
                        converted = self._convert(event)
                        if converted is not None:
                            return converted
                        continue
                    assert isinstance(event, Exit)
                    if self._killed:  # kill() was called while we waited
                        if self._pending_events:
                            return self._pending_events.pop(0)
                        raise StopAsyncIteration
                    self._completed = True
                    self._pending_events += [*self._flush(), ExecCompleted(exit_code=event.returncode)]
                    return self._pending_events.pop(0)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self.kill()
            raise

    def _check_stdin(self) -> None:
        if not (isinstance(self._options, ExecRemoteStreamingOptions) and self._options.stdin_open):
            raise RuntimeError("write_stdin() requires stdin_open=True in ExecRemoteStreamingOptions")

    async def write_stdin(self, data: str | bytes) -> None:
        self._check_stdin()
        if self._completed or self._killed:
            raise RuntimeError("Cannot write to stdin: process has terminated")
        try:
            await self._process.write_stdin(data)
        except BrokenPipeError:
            raise RuntimeError("Cannot write to stdin: process has terminated") from None

    async def close_stdin(self) -> None:
        if not (isinstance(self._options, ExecRemoteStreamingOptions) and self._options.stdin_open):
            raise RuntimeError("close_stdin() requires stdin_open=True in ExecRemoteStreamingOptions")
        if self._completed or self._killed:
            return
        await self._process.close_stdin()

    async def kill(self) -> None:
        if self._completed or self._killed:
            return
        self._killed = True
        await self._process.kill()
        for event in self._process.take_output():
            converted = self._convert(event)
            if converted is not None:
                self._pending_events.append(converted)
        self._pending_events += self._flush()


def _forward_exec_remote() -> None:
    """Makes sample code reach NsboxSandboxEnvironment.exec_remote.

    Inspect hands samples each environment wrapped in SandboxEnvironmentProxy
    (which records exec events), and the proxy of this Inspect version does
    not forward exec_remote: it runs the base class's, which injects Inspect's
    tool server into the sandbox and polls it. For environments of this
    provider only, the proxy's exec_remote now forwards to the native one;
    every other provider keeps the original. Nothing is changed if the
    proxy defines exec_remote itself (a later Inspect that forwards it).
    """
    try:
        from inspect_ai.util._sandbox.events import SandboxEnvironmentProxy
    except ImportError:
        return
    if "exec_remote" in vars(SandboxEnvironmentProxy):
        return
    original = SandboxEnvironment.exec_remote

    async def exec_remote(self: Any, cmd: list[str], options: Any = None, *, stream: bool = True) -> Any:
        inner = getattr(self, "_sandbox", None)
        if isinstance(inner, NsboxSandboxEnvironment):
            return await inner.exec_remote(cmd, options, stream=stream)  # type: ignore[call-overload]
        return await original(self, cmd, options, stream=stream)  # type: ignore[call-overload]

    exec_remote.__doc__ = original.__doc__
    exec_remote.__nsbox_forward__ = True  # type: ignore[attr-defined]
    SandboxEnvironmentProxy.exec_remote = exec_remote  # type: ignore[method-assign,assignment]


_forward_exec_remote()
