"""From the model to what nsbox runs: the main command (Docker's rules for
entrypoint and command) and a SandboxSpec per service."""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any, Mapping

from ..spec import Bind, SandboxSpec, Tmpfs, check_target
from .errors import ComposeError
from .hostpaths import HostPaths
from .model import Mount, Project, Service

_PULL = {"always": "always", "never": "never", "missing": "missing", "if_not_present": "missing",
         "build": "never"}  # build: the image is made locally; daily, weekly, every_*: as missing


def main_command(service: Service, image_config: Mapping[str, Any] | Any) -> list[str] | None:
    """What `docker compose up` starts, from the service's entrypoint and
    command and the image's Entrypoint and Cmd (an OCI config's `config`
    object, or an nsbox ImageConfig); None when that is nothing.

    A service entrypoint replaces the image's and drops the image's Cmd; an
    empty one ("" or []) removes the image's entrypoint but keeps its Cmd;
    an empty command is the same as none (Docker falls back to the image's).
    """
    if isinstance(image_config, Mapping):
        image_ep = list(image_config.get("Entrypoint") or [])
        image_cmd = list(image_config.get("Cmd") or [])
    else:
        image_ep, image_cmd = list(image_config.entrypoint), list(image_config.cmd)
    command = service.command or None
    if service.entrypoint:
        argv = service.entrypoint + (command or [])
    elif service.entrypoint is not None:
        argv = command or image_cmd
    else:
        argv = image_ep + (command or image_cmd)
    return argv or None


def pull_policy(service: Service) -> str:
    """nsbox's pull policy ("missing", "always", "never") for the service's
    image: `x-local` and `pull_policy: build` mean the image is made here."""
    return "never" if service.x_local else _PULL.get(service.pull_policy or "missing", "missing")


def service_spec(service: Service, project: Project, *, image: str, network: str,
                 volume_root: Path | None = None, check_only: bool = False, **extra: Any) -> SandboxSpec:
    """The SandboxSpec of one service. `image` is the reference to run (the
    caller pulls or builds it); `network` is the sample's mode
    (support.sample_network), or in the "services" mode the service's own
    ("none" or "host"; Services puts it on its networks). Named and anonymous volumes become directories
    under `volume_root` (one per sample, shared by its services), created
    here, as are missing sources of short-syntax binds (Docker does too).
    `extra` sets or overrides any other SandboxSpec field (x-nsbox settings
    come first, `extra` wins). With `check_only`, nothing is made: the
    spec has no binds (their sources are a sample's), only their targets
    are checked, so what every sample would refuse is found once."""
    try:
        return SandboxSpec(**_fields(service, project, image, network, volume_root, check_only, extra))
    except (TypeError, ValueError, AttributeError) as e:  # x-nsbox values are the file's: any type
        raise ComposeError(f"service {service.name}: {e}") from None


def _fields(service: Service, project: Project, image: str, network: str, volume_root: Path | None,
            check_only: bool, extra: dict[str, Any]) -> dict[str, Any]:
    binds = [(i, m) for i, m in enumerate(service.volumes) if m.type != "tmpfs"]
    for _, m in binds:
        check_target("bind", _target(m))
    fields: dict[str, Any] = {
        "image": image,
        "pull": pull_policy(service),
        "platform": service.platform,
        "user": service.user,
        "workdir": service.working_dir,
        "env": dict(service.environment),
        "network": network,
        "ports": tuple(service.ports) if network != "host" else (),
        "hostname": service.hostname,
        "hosts": dict(service.extra_hosts),
        "mounts": () if check_only else tuple(_bind(service, project, m, volume_root, i) for i, m in binds),
        "read_only": service.read_only,
        "tmpfs": tuple(_tmpfs(m) for m in [*service.tmpfs, *(m for m in service.volumes if m.type == "tmpfs")]),
        "memory": service.memory,
        "cpus": service.cpus,
        "pids_limit": service.pids_limit,
        "disk": service.disk,
        "gpus": service.gpus,
        "nested_userns": "SYS_ADMIN" in service.cap_add,
        "privileged": service.privileged,
        "label": f"{project.name}/{service.name}",
    }
    fields.update(service.x_nsbox)
    fields.update(extra)
    return fields


def _target(mount: Mount) -> str:
    """Where a mount goes, cleaned as Docker cleans it ("/data//x", "/a/../b")."""
    return "/" + posixpath.normpath(mount.target).lstrip("/")


def volume_dir(service: Service, m: Mount, index: int, volume_root: Path) -> Path:
    """The directory of a named or anonymous volume (the `index`th entry of
    the service's volumes)."""
    # Apart, so that no volume name (a named volume "_anonymous") reaches
    # the anonymous volumes of every service.
    if m.source:
        return volume_root / "named" / m.source
    return volume_root / "anonymous" / service.name / str(index)


def _tmpfs(mount: Mount) -> Tmpfs:
    return Tmpfs(_target(mount), size=mount.size, mode=0o1777 if mount.mode is None else mount.mode,
                 readonly=mount.read_only, noexec=mount.noexec)


def _bind(service: Service, project: Project, m: Mount, volume_root: Path | None, index: int) -> Bind:
    if m.type == "bind":
        # Checked again: the project directory may have changed since it was
        # read (a sandbox of an earlier sample may write to it).
        paths = m.host_paths or project.host_paths or HostPaths(project.directory)
        what = f"service {service.name}: bind source"
        source = Path(paths.check(m.source or "", what))
        if not source.exists():
            if not m.create_host_path:
                raise ComposeError(f"{what} {source} does not exist",
                                   hint="create it, or use the short syntax, which creates a directory")
            source = Path(paths.make_dirs(str(source), what))
    else:
        if volume_root is None:
            raise ComposeError(f"service {service.name}: volume at {m.target} needs a volume directory",
                               hint="pass volume_root to service_spec")
        source = volume_dir(service, m, index, Path(volume_root)) / (m.subpath or "")
        source.mkdir(parents=True, exist_ok=True)
    # As checked (a bind) or made (a volume) here: not resolved again.
    return Bind.exact(str(source), _target(m), readonly=m.read_only)
