"""nsbox's own model of a compose project: what a compose file asks for, in
the forms compose itself normalises to (lists for commands, mappings for
environment and depends_on, seconds for durations, bytes for sizes, absolute
host paths)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..spec import Restart
from .errors import ComposeError

if TYPE_CHECKING:
    from .hostpaths import HostPaths

Condition = Literal["service_started", "service_healthy", "service_completed_successfully"]
CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")
MountType = Literal["bind", "volume", "tmpfs"]


@dataclass
class Build:
    context: Path  # absolute
    dockerfile: Path  # absolute (relative names are relative to context)
    args: dict[str, str] = field(default_factory=dict)
    target: str | None = None
    network: str | None = None  # what RUN steps get: "none", "host", or None (the builder's default, nat)
    no_cache: bool = False
    pull: bool = False  # pull FROM images again


@dataclass
class Healthcheck:
    """What the file says; None (or 0, as Docker reads it) is unset: the
    image's HEALTHCHECK gives it, else Docker's default. `test` None means
    the image's test; ["NONE"] means disabled."""

    test: list[str] | None = None  # ["CMD", ...], ["CMD-SHELL", "..."] or ["NONE"]
    interval: float | None = None
    timeout: float | None = None
    retries: int | None = None
    start_period: float | None = None
    start_interval: float | None = None

    @property
    def disable(self) -> bool:
        return self.test == ["NONE"]


@dataclass
class Mount:
    """A volume entry. bind: `source` is an absolute host path; volume:
    `source` is a top-level volume name, None for an anonymous volume;
    tmpfs: no source."""

    type: MountType
    target: str
    source: str | None = None
    read_only: bool = False
    create_host_path: bool = False  # short syntax binds: Docker creates a missing source directory
    subpath: str | None = None  # volume: mount this path inside the volume
    nocopy: bool = False  # volume: not seeded with the image's files (volume.nocopy)
    size: int | None = None  # tmpfs
    mode: int | None = None  # tmpfs
    noexec: bool = True  # tmpfs: Docker mounts one noexec unless told `exec`
    dropped: tuple[str, ...] = ()  # options given that nsbox does not apply (a warning says so)
    # bind: the policy of the file that named it (an included file's own
    # directory), checked again when the sandbox is made; None: the project's
    host_paths: "HostPaths | None" = field(default=None, repr=False, compare=False)


@dataclass
class Service:
    name: str
    image: str | None = None
    build: Build | None = None
    command: list[str] | None = None  # None: not set ([] is set and empty)
    entrypoint: list[str] | None = None
    working_dir: str | None = None
    environment: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    hostname: str | None = None
    container_name: str | None = None
    init: bool | None = None
    healthcheck: Healthcheck | None = None
    depends_on: dict[str, Condition] = field(default_factory=dict)
    optional_deps: set[str] = field(default_factory=set)  # depends_on entries with `required: false`
    volumes: list[Mount] = field(default_factory=list)  # binds, volumes, tmpfs, secrets and configs
    tmpfs: list[Mount] = field(default_factory=list)  # the `tmpfs:` key
    read_only: bool = False
    restart: Restart | None = None  # restart, or deploy.restart_policy
    ports: list[str] = field(default_factory=list)  # nsbox's form: [ADDRESS:]HOSTPORT:PORT
    network_mode: str | None = None
    networks: dict[str, list[str]] = field(default_factory=dict)  # network -> aliases
    links: dict[str, str] = field(default_factory=dict)  # alias -> service
    extra_hosts: dict[str, str] = field(default_factory=dict)  # name -> address, in /etc/hosts
    memory: int | None = None
    cpus: float | None = None
    pids_limit: int | None = None
    disk: int | None = None  # storage_opt.size
    gpus: str | None = None  # nsbox/plan/gpu.py's form: "all", "N", "device=ID,ID"
    cap_add: list[str] = field(default_factory=list)  # upper case, without CAP_
    cap_drop: list[str] = field(default_factory=list)
    privileged: bool = False
    platform: str | None = None
    pull_policy: str | None = None
    x_default: bool = False
    x_local: bool = False
    x_nsbox: dict[str, Any] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)  # harmless keys seen


@dataclass
class NetworkDef:
    name: str
    internal: bool = False
    driver: str | None = None
    external: bool = False


@dataclass
class VolumeDef:
    name: str
    external: bool = False


@dataclass
class Project:
    name: str
    directory: Path
    services: dict[str, Service]  # the default service first, then file order
    networks: dict[str, NetworkDef] = field(default_factory=dict)
    volumes: dict[str, VolumeDef] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # what nsbox honours only approximately
    host_paths: "HostPaths | None" = None  # where the file may name host paths (None: its directory)

    @property
    def default_service(self) -> Service:
        """The service marked `x-default: true`, else the one named
        `default`, else the first."""
        for service in self.services.values():
            if service.x_default:
                return service
        return self.services.get("default") or next(iter(self.services.values()))

    def dependency_order(self) -> list[str]:
        """Service names, each after those it depends on (depth first, in
        file order). A cycle is an error, as Compose refuses one."""
        order: list[str] = []
        done: set[str] = set()
        for first in self.services:
            path: list[str] = []  # the names being visited, each a dependency of the one before
            stack = [(first, False)]
            while stack:
                name, leaving = stack.pop()
                if leaving:
                    path.pop()
                    done.add(name)
                    order.append(name)
                    continue
                if name in done:
                    continue
                if name in path:
                    cycle = path[path.index(name):] + [name]
                    raise ComposeError(f"services depend on each other in a cycle: {' -> '.join(cycle)}")
                path.append(name)
                stack.append((name, True))
                deps = [d for d in self.services[name].depends_on if d in self.services]
                stack.extend((d, False) for d in reversed(deps))
        return order
