"""nsbox as an Inspect AI sandbox provider: `inspect eval task.py --sandbox nsbox`.

A thin adapter: every behaviour lives in nsbox.Sandbox; this module maps
Inspect's lifecycle onto it, loads the configuration, and translates
nsbox's exceptions into Inspect's.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import sys
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Literal, Union, overload

import anyio
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

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

from . import dirs, manage, native
from .errors import NsboxError, OutputLimitExceeded, SandboxUnavailable, UserUnsupported
from .idmap import detect as detect_idmap
from .images import import_tarball
from .limits import human_size
from .rootfs import Bind
from .sandbox import DEFAULT_PATH, Sandbox

CONFIG_FILES = ["nsbox.yaml", "nsbox.yml"]


class SandboxSpec(BaseModel):
    """Settings of one sandbox."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rootfs: str = "host"
    """'host' (the built-in root composed from this host), a directory, or a
    root filesystem tarball (unpacked once, at task start)."""
    user: str = "root"
    """The default user of exec, read_file and write_file."""
    workdir: str | None = None
    """Working directory; relative paths resolve against it (default: the user's home)."""
    env: dict[str, str] = {}
    network: Literal["none", "host"] = "none"
    """'none': a private network with loopback only; 'host': the host's network."""
    mounts: tuple[str, ...] = ()
    """Host paths to bind in, as SOURCE:TARGET[:ro]."""
    timeout: int | None = None
    """Default timeout of exec, in seconds."""

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


class NsboxConfig(SandboxSpec):
    """Configuration of the nsbox provider (nsbox.yaml, or this model in Python).

    The top-level settings describe the "default" sandbox. `sandboxes` gives
    a sample several named sandboxes; each entry starts from the top-level
    settings and overrides what it names. The first is the default one.
    """

    output_limit_mode: Literal["truncate", "raise"] = "truncate"
    """Output over the limit: 'truncate' keeps the last bytes; 'raise'
    raises OutputLimitExceededError (Inspect's older contract)."""
    id_mapping: Literal["auto", "single"] = "auto"
    sandboxes: dict[str, SandboxSpec] | None = None

    def specs(self) -> list[tuple[str, SandboxSpec]]:
        base = self.model_dump(include=set(SandboxSpec.model_fields))
        if not self.sandboxes:
            return [("default", SandboxSpec(**base))]
        return [(name, SandboxSpec(**{**base, **spec.model_dump(exclude_unset=True)}))
                for name, spec in self.sandboxes.items()]

    def __hash__(self) -> int:
        return hash(self.model_dump_json())


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
    def fix(spec: SandboxSpec) -> dict[str, Any]:
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


async def _resolve_rootfs(rootfs: str, id_mapping: Literal["auto", "single"]) -> str:
    """A directory for `rootfs`; a tarball is unpacked once per content and
    id mapping, into the data directory."""
    if rootfs == "host" or os.path.isdir(rootfs):
        return rootfs
    if not os.path.isfile(rootfs):
        raise NsboxError(f"rootfs {rootfs} does not exist",
                         hint="give 'host', a directory holding a root filesystem, or a tarball of one")
    digest = await anyio.to_thread.run_sync(_sha256, rootfs)
    mode = detect_idmap(id_mapping).mode
    dest = dirs.data_dir() / "images" / f"{digest[:24]}-{mode}"
    if not dest.exists():
        await import_tarball(rootfs, dest, id_mapping=id_mapping,
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
    _live: dict[NsboxConfig, set["NsboxSandboxEnvironment"]] = {}
    # Root filesystems resolved by task_init (tarballs unpacked), per configuration.
    _rootfs: dict[tuple[str, str], str] = {}

    def __init__(self, sandbox: Sandbox, config: NsboxConfig) -> None:
        super().__init__()
        self.sandbox = sandbox
        self._config = config

    # ---- configuration -------------------------------------------------

    @classmethod
    def config_files(cls) -> list[str]:
        return CONFIG_FILES

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return NsboxConfig(**config)

    @classmethod
    def default_concurrency(cls) -> int | None:
        # A sandbox costs ~1 MiB and milliseconds; what it runs is the limit.
        # Four per CPU, and no more than one per 256 MiB of memory.
        cpus = len(os.sched_getaffinity(0))
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return max(2, min(4 * cpus, mem // (256 << 20)))

    # ---- lifecycle -----------------------------------------------------

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        cfg = load_config(config)
        for _, spec in cfg.specs():
            cls._rootfs[(spec.rootfs, cfg.id_mapping)] = await _resolve_rootfs(spec.rootfs, cfg.id_mapping)
        # Start and stop one sandbox now, so that a host that cannot run
        # them fails the task with a clear message before any sample starts.
        _, spec = cfg.specs()[0]
        async with cls._make(cfg, spec, f"{task_name}: startup check"):
            pass

    @classmethod
    def _make(cls, cfg: NsboxConfig, spec: SandboxSpec, label: str) -> Sandbox:
        rootfs = cls._rootfs.get((spec.rootfs, cfg.id_mapping), spec.rootfs)
        sb = Sandbox(
            rootfs, user=spec.user, workdir=spec.workdir, env=spec.env, network=spec.network,
            output_limit_mode=cfg.output_limit_mode, id_mapping=cfg.id_mapping, timeout=spec.timeout,
            mounts=[Bind.parse(m) for m in spec.mounts], label=label,
        )
        sb.origin = "inspect"
        return sb

    @classmethod
    async def sample_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                          metadata: dict[str, str]) -> dict[str, SandboxEnvironment]:
        cfg = load_config(config)
        sample = metadata.get("__sample_id__", "")
        created: dict[str, NsboxSandboxEnvironment] = {}
        try:
            for name, spec in cfg.specs():
                key = (spec.rootfs, cfg.id_mapping)
                if key not in cls._rootfs:  # sample_init without task_init (tests, tools)
                    cls._rootfs[key] = await _resolve_rootfs(spec.rootfs, cfg.id_mapping)
                label = f"{task_name} sample {sample} ({name})" if sample != "" else f"{task_name} ({name})"
                sb = cls._make(cfg, spec, label)
                await sb.start()
                created[name] = cls(sb, cfg)
                cls._live.setdefault(cfg, set()).add(created[name])
        except BaseException:
            with anyio.CancelScope(shield=True):
                await cls._close_all(cfg, list(created.values()))
            raise
        return dict(created)

    @classmethod
    async def _close_all(cls, cfg: NsboxConfig, envs: list["NsboxSandboxEnvironment"]) -> None:
        async with anyio.create_task_group() as tg:
            for env in envs:
                cls._live.get(cfg, set()).discard(env)
                tg.start_soon(env.sandbox.close)

    @classmethod
    async def sample_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                             environments: dict[str, SandboxEnvironment], interrupted: bool) -> None:
        # Closing kills every process of the sandbox at once, so an
        # interrupted sample is cleaned up just as fast as a finished one.
        envs = [e.as_type(NsboxSandboxEnvironment) for e in environments.values()]
        with anyio.CancelScope(shield=True):
            await cls._close_all(load_config(config), envs)

    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                           cleanup: bool) -> None:
        cfg = load_config(config)
        live = list(cls._live.pop(cfg, set()))
        if cleanup:
            await cls._close_all(cfg, live)
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
        # or orphaned), plus anything dead.
        for e in manage.entries():
            inspect_leftover = e.info.origin == "inspect" and e.state in ("detached", "orphaned")
            if inspect_leftover or e.state == "dead":
                manage.remove(e.info, force=True)
                print(f"removed nsbox sandbox {e.info.id} {e.info.label}")

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
        return SandboxConnection(type="nsbox", command=await nsenter_command(self.sandbox, user),
                                 container=self.sandbox.id)

    def default_polling_interval(self) -> float:
        return 0.2


async def nsenter_command(sb: Sandbox, user: str | None = None) -> str:
    """A command a person can paste into a terminal on this host, as the user
    who created the sandbox, to get a login shell inside it, as `user`, in
    its working directory."""
    with _as_inspect_errors():
        identity = await sb._identity_for(user)
    if identity is None:
        raise SandboxUserUnsupportedError(f"no user {user!r} in the sandbox's /etc/passwd")
    pid = sb.pid
    userns, mntns = native.lib.NSBOX_FD_USERNS, native.lib.NSBOX_FD_MNTNS
    # The sandbox's network, IPC, UTS, cgroup and PID namespaces belong to
    # the init's user namespace, and joining them takes capabilities there:
    # so enter that one (--user), then the others and the locked mount
    # namespace the init holds as a descriptor. A root session then moves
    # into the nested user namespace sandbox processes run in (fd `userns`
    # of PID 1, as the sandbox's /proc shows it), when the root filesystem
    # has nsenter; another user simply switches ids (it has no capabilities).
    # With a single mapped id setgroups is denied, which nsenter would call
    # to become root; there our own uid already is the sandbox's root.
    keep = ["--preserve-credentials"] if sb.idmap is not None and sb.idmap.mode == "single" else []
    cmd = ["nsenter", f"--target={pid}", "--user", "--cgroup", "--ipc", "--uts", "--net", "--pid",
           f"--mount=/proc/{pid}/fd/{mntns}", *keep]
    if identity.uid != 0:
        cmd += [f"--setuid={identity.uid}", f"--setgid={identity.gid}"]
    login = (f"cd {shlex.quote(sb.workdir)} 2>/dev/null || cd {shlex.quote(identity.home)} 2>/dev/null || cd /; "
             "if [ -x /bin/bash ]; then exec /bin/bash -l; else exec /bin/sh -l; fi")
    q = shlex.quote
    # A clean environment; TERM comes through nsenter from the person's terminal.
    session = (f"/usr/bin/env -i {q('HOME=' + identity.home)} {q('PATH=' + DEFAULT_PATH)} "
               f'"TERM=${{TERM:-xterm}}" /bin/sh -c {q(login)}')
    if identity.uid == 0:
        inner = f"nsenter --user=/proc/1/fd/{userns} {' '.join(keep)} -- {session}"
        script = f"if command -v nsenter >/dev/null 2>&1; then exec {inner}; fi; exec {session}"
    else:
        script = f"exec {session}"
    cmd += ["--", "/bin/sh", "-c", script]
    return shlex.join(cmd)
