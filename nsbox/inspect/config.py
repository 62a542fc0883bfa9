"""The nsbox provider's configuration: nsbox.yaml (or NsboxConfig in Python),
its loading, and the root filesystems it names, made ready.

SandboxSettings describes one sandbox; NsboxConfig the default one plus
named ones and the sample's service networks.
"""

from __future__ import annotations

import contextvars
import hashlib
import os
import sys
from pathlib import Path
from typing import Any, Literal

import anyio
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from inspect_ai.util import SandboxEnvironmentConfigType

from ..errors import NsboxError, SandboxSetupError
from ..host import dirs
from ..host.idmap import detect as detect_idmap
from ..spec import NET, NETWORKS, Bind, SandboxSpec, normalize_gpus, parse_size
from ..sandbox import confined
from ..storage.tarball import import_tarball
from ..compose.hostpaths import HostPaths
from ..compose.support import HOST_NETWORK_ENV, host_network_granted

CONFIG_FILES = ["nsbox.yaml", "nsbox.yml"]

# Set while NsboxConfig validates its `sandboxes` entries, which are checked
# as sandboxes only once merged with the top-level settings.
_ENTRIES: contextvars.ContextVar[bool] = contextvars.ContextVar("nsbox_config_entries", default=False)


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
    """Working directory; relative paths resolve against it (default: an
    image's WORKDIR, else /; a root filesystem: the user's home)."""
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
    hostname: str | None = None
    """The sandbox's host name (default: its name in `sandboxes` on a service
    network, which it keeps answering to, else its id)."""
    hosts: dict[str, str] = {}
    """Extra /etc/hosts entries, NAME: ADDRESS ("host-gateway": the host's loopback)."""
    ports: tuple[str, ...] = ()
    """Published ports, "[IP:]HOSTPORT:PORT", on 127.0.0.1 unless IP is given."""
    mounts: tuple[str, ...] = ()
    """Host paths to bind in, as SOURCE:TARGET[:ro]."""
    tmpfs: tuple[str, ...] = ()
    """Empty tmpfs mounts, as TARGET[:OPTIONS] (Docker's --tmpfs; noexec unless OPTIONS say exec)."""
    read_only: bool = False
    """The root filesystem read-only (Docker's --read-only); mounts, /tmp and /run stay writable."""
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

    # Normalised here (as SandboxSpec does) so that equal settings compare
    # and hash equal: Inspect keys its sandboxes by configuration.
    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: int | str | None) -> str | None:
        return normalize_gpus(v)

    @field_validator("memory", "disk")
    @classmethod
    def _size(cls, v: int | str | None, info: ValidationInfo) -> int | None:
        return None if v is None else parse_size(v, info.field_name or "size")

    @field_validator("network")
    @classmethod
    def _network(cls, v: str) -> str:
        # The modes this door offers, said as it offers them: SandboxSpec's
        # but container:ID, with a NAME short enough for the sample's suffix
        # (provider._sample_network); the NAME's syntax is SandboxSpec's (below).
        if not (v in NETWORKS or (v.startswith(NET) and len(v) - len(NET) <= 41)):
            raise ValueError(f"Input should be {', '.join(map(repr, NETWORKS))} or 'net:NAME', not {v!r}")
        return v

    @model_validator(mode="after")
    def _valid_sandbox(self) -> "SandboxSettings":
        # The rules are SandboxSpec's: make one. An entry of `sandboxes` is
        # checked once merged with the top-level settings (NsboxConfig).
        if not _ENTRIES.get():
            try:
                self.spec(mounts=())
                for mount in self.mounts:
                    _bind(mount)
            except ValueError as e:
                raise _located(self, e) from None
        return self

    def spec(self, **changes: Any) -> SandboxSpec:
        """The SandboxSpec of these settings; `changes` replace or add fields.
        The mounts' sources were resolved (and a file's checked) when the
        configuration was read: each sample takes them as they were then."""
        fields = {name: getattr(self, name) for name in SandboxSettings.model_fields}
        if "mounts" not in changes:
            fields["mounts"] = tuple(Bind.parse(m, exact=True) for m in self.mounts)
        return SandboxSpec(**{**fields, **changes})

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

    @model_validator(mode="wrap")
    @classmethod
    def _valid_sandboxes(cls, data: Any, handler: ModelWrapValidatorHandler["NsboxConfig"]) -> "NsboxConfig":
        # An entry of `sandboxes` states only what it overrides, so neither it
        # nor the top level alone is a sandbox: each sandbox is checked merged.
        token = _ENTRIES.set(True)
        try:
            config = handler(data)
        finally:
            _ENTRIES.reset(token)
        for name, entry in (config.sandboxes or {"default": None}).items():
            try:
                config._merged(entry)
            except ValidationError as e:
                raise _in_entry(e, name, entry) from None
        return config

    @field_serializer("sandboxes")
    def _entries_as_stated(self, sandboxes: dict[str, SandboxSettings] | None) -> dict[str, Any] | None:
        # An entry is what it overrides: dumped whole, its defaults would
        # override the top level when the dump is read back (an eval log's).
        if sandboxes is None:
            return None
        return {name: entry.model_dump(mode="json", exclude_unset=True) for name, entry in sandboxes.items()}

    # settings(), worked out once: every sample of a task asks.
    _settings: list[tuple[str, SandboxSettings]] | None = PrivateAttr(default=None)

    def settings(self) -> list[tuple[str, SandboxSettings]]:
        """Each sandbox of a sample, by name, the default one first (the
        configuration is not to be changed once a sample asked)."""
        if self._settings is None:
            if not self.sandboxes:
                self._settings = [("default", self._merged(None))]
            else:
                self._settings = [(name, self._merged(entry)) for name, entry in self.sandboxes.items()]
        return list(self._settings)

    def _merged(self, entry: SandboxSettings | None) -> SandboxSettings:
        """The top-level settings, with what `entry` states over them."""
        base = self.model_dump(include=set(SandboxSettings.model_fields))
        return SandboxSettings(**{**base, **(entry.model_dump(exclude_unset=True) if entry is not None else {})})

    # Equal as the hash says (the settings worked out, a private attribute,
    # would make pydantic's __eq__ tell a used configuration from a fresh
    # load of it): the provider finds a task's sandboxes by configuration.
    def __hash__(self) -> int:
        return hash(self.model_dump_json())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NsboxConfig):
            return NotImplemented
        return self is other or self.model_dump_json() == other.model_dump_json()


def _bind(mount: str) -> None:
    """Bind.parse's checks of `mount`, but for its source's existence: a
    relative source is not resolved yet, and a missing one is refused when
    the sandbox starts."""
    try:
        Bind.parse(mount)
    except SandboxSetupError:
        pass


def _located(settings: SandboxSettings, e: ValueError) -> ValidationError:
    """SandboxSpec's error `e`, as pydantic's: at the field whose value alone
    raises it, else at the sandbox (a rule between fields, as rootfs-or-image)."""
    message = str(e)
    for name in SandboxSettings.model_fields:
        try:
            SandboxSpec(**{name: getattr(settings, name)})
        except (ValueError, SandboxSetupError) as alone:
            if str(alone) == message:
                return _error(type(settings).__name__, (name,), getattr(settings, name), message)
    return _error(type(settings).__name__, (), None, message)


def _in_entry(e: ValidationError, name: str, entry: SandboxSettings | None) -> ValidationError:
    """A merged sandbox's errors, at `sandboxes.NAME` where the entry states
    the field (or they are between fields), else at the top-level field."""
    errors = []
    for err in e.errors():
        loc = err["loc"]
        if entry is not None and (not loc or loc[0] in entry.model_fields_set):
            loc = ("sandboxes", name, *loc)
        errors.append({"type": err["type"], "loc": loc, "input": err["input"], "ctx": err.get("ctx", {})})
    return ValidationError.from_exception_data("NsboxConfig", errors)  # type: ignore[arg-type]


def _error(title: str, loc: tuple[str, ...], value: Any, message: str) -> ValidationError:
    return ValidationError.from_exception_data(
        title, [{"type": "value_error", "loc": loc, "input": value, "ctx": {"error": message}}])


def config_key(config: SandboxEnvironmentConfigType | None) -> Any:
    """What identifies a configuration across task_init, the samples and
    task_cleanup: what Inspect hands each of them. Models are compared by
    content; a file by its name, not by what it holds, so that a file
    edited during the eval still names the sandboxes made under it."""
    if isinstance(config, BaseModel) and not isinstance(config, NsboxConfig):
        return (type(config).__name__, config.model_dump_json())
    return config


# Configurations loaded, by what names them: None, or a file as it is now.
# Every sample of a task loads its configuration (sample_init): reading
# and validating it again cost ~0.15 ms of CPU a sample.
_LOADED: dict[tuple[Any, ...], NsboxConfig] = {}


def load_config(config: SandboxEnvironmentConfigType | None) -> NsboxConfig:
    """The configuration, with relative host paths made absolute (a file's
    against its directory). Invalid configuration raises one clear error."""
    key = _loaded_key(config)
    if key is not None and (cfg := _LOADED.get(key)) is not None:
        return cfg
    cfg = _load_config(config)
    if key is not None:
        if len(_LOADED) >= 64:
            _LOADED.clear()
        _LOADED[key] = cfg
    return cfg


def _loaded_key(config: SandboxEnvironmentConfigType | None) -> tuple[Any, ...] | None:
    if config is None:
        return ("defaults",)
    if isinstance(config, str):
        try:
            st = os.stat(config)
        except OSError:
            return None  # _load_config says why
        return ("file", os.path.abspath(config), st.st_ino, st.st_mtime_ns, st.st_size)
    return None


def _load_config(config: SandboxEnvironmentConfigType | None) -> NsboxConfig:
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
            cfg = _absolute_paths(NsboxConfig(**data), path.parent)
        except ValidationError as e:
            raise NsboxError(f"invalid nsbox configuration {path}:\n{_field_errors(e)}") from None
        _held_to_a_files_rights(cfg, path)
        return cfg
    raise NsboxError(f"the nsbox provider takes an NsboxConfig or a YAML file name, not {type(config).__name__}")


def _field_errors(e: ValidationError) -> str:
    return "\n".join(f"  {'.'.join(map(str, err['loc'])) or '(top)'}: {err['msg']}" for err in e.errors())


def _held_to_a_files_rights(config: NsboxConfig, path: Path) -> None:
    """A file is an eval suite's, as a compose file is (a sample may name
    its own): its host paths must lie in its directory (or
    NSBOX_COMPOSE_PATHS), and the host's network and root are the
    operator's to grant (docs/security.md, "Inputs")."""
    paths = HostPaths(path.parent.resolve())
    for name, spec in [("", config), *((f"sandboxes.{k}.", v) for k, v in (config.sandboxes or {}).items())]:
        if spec.rootfs != "host":
            paths.check(spec.rootfs, f"{path}: {name}rootfs")
        for mount in spec.mounts:
            paths.check(mount.split(":")[0], f"{path}: {name}mounts: source")
        if spec.network == "host" and not host_network_granted():
            raise NsboxError(f"{path}: {name}network: host reaches every service on the host's loopback: yours to "
                             f"grant, not a file's: set {HOST_NETWORK_ENV}=1 to allow it")
    if config.id_mapping == "host-root":
        raise NsboxError(f"{path}: id_mapping: host-root makes sandbox root host root: yours to choose, not a "
                         "file's: pass NsboxConfig(id_mapping='host-root') from the task's code")


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


async def resolve_rootfs(rootfs: str, id_mapping: Literal["auto", "single", "host-root"]) -> str:
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
