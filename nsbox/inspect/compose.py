"""Docker-compatible configurations of the Inspect provider: what Inspect
hands a provider whose config_files() lists compose.yaml (a compose file,
a Dockerfile, or its ComposeConfig) runs as nsbox services.

- task_init (`prepare`): the project is read once (nsbox/compose/), every
  service's image is built (nsbox/dockerfile/) or pulled and unpacked, once per
  task; a file nsbox cannot honour fails here, in one message.
- sample_init (`start_sample`): fresh sandboxes for every service on
  networks of the sample's own (nsbox/compose/services.py), its volumes seeded with
  the images' files (nsbox/compose/volumes.py), the default service
  first, ready as `docker compose up --wait` leaves them (every
  healthcheck passed, every other main process running), within the
  deadline Inspect's docker provider sets.

Per-sample variables: Inspect's docker provider runs compose with
SAMPLE_METADATA_<KEY> set from each sample's metadata, so a file may name
its image per sample. The file is read once per distinct set of those
variables (once per task when it uses none), and an image is made ready
once per task whichever variable set names it.
"""

from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from ..host import idmap
from ..compose import (
    ComposeError,
    Project,
    Service,
    aliases,
    dockerfile_project,
    load_project,
    main_command,
    project_from_config,
    sample_network,
    service_spec,
)
from ..compose.load import is_compose_document
from ..compose.mapping import pull_policy
from ..compose.support import BRIDGE, service_networks
from ..host.layers import give
from ..manage import record_volume_users, remove_volumes, volume_base
from ..compose.services import Healthcheck, ServiceSpec, Services, compose_deadline
from ..storage import Store
from ..storage.progress import Progress
from ..storage.resolve import resolve
from ..storage.store import Image
from ..compose.volumes import seed, seeds, start_order

COMPOSE_FILES = ["compose.yaml", "compose.yml", "docker-compose.yaml", "docker-compose.yml"]
DOCKERFILES = ["Dockerfile"]


def is_docker_config(config: object) -> bool:
    """A compose file, a Dockerfile or a ComposeConfig (Inspect's own test),
    or a YAML file of another name (sandbox.yaml, compose_ID.yaml) whose
    content is a compose file's: a top-level `services` mapping."""
    from inspect_ai.util._sandbox.compose import is_docker_compatible_config

    if is_docker_compatible_config(config):  # type: ignore[arg-type]
        return True
    return (isinstance(config, str) and config.endswith((".yaml", ".yml"))
            and is_compose_document(config))


def read_project(config: object, variables: dict[str, str] | None = None) -> Project:
    """The project a Docker-compatible configuration describes, a compose
    file interpolated with the environment plus `variables`."""
    from inspect_ai.util._sandbox.compose import ComposeConfig, is_dockerfile

    if isinstance(config, ComposeConfig):
        return project_from_config(config, Path.cwd())
    path = Path(str(config)).resolve()
    if not path.is_file():
        raise ComposeError(f"{path}: no such file")
    if is_dockerfile(str(path)):
        return dockerfile_project(path)
    return load_project(path, environ={**os.environ, **variables} if variables else None)


SAMPLE_PREFIX = "SAMPLE_METADATA_"


def _compose_text(config: object) -> str | None:
    """A compose file's text when it may use sample variables, else None."""
    from inspect_ai.util._sandbox.compose import is_dockerfile

    if not isinstance(config, str) or is_dockerfile(config):
        return None
    try:
        text = Path(config).read_text(errors="replace")
    except OSError:
        return None
    return text if SAMPLE_PREFIX in text else None


def sample_variables(config: object, metadata: dict[str, Any]) -> dict[str, str]:
    """The variables Inspect's docker provider sets for a sample: each
    metadata key as SAMPLE_METADATA_<KEY> (spaces as `_`, upper-cased), its
    value as str(), for the names the file mentions."""
    text = _compose_text(config)
    if text is None:
        return {}
    named = {SAMPLE_PREFIX + str(k).replace(" ", "_").upper(): str(v) for k, v in metadata.items()}
    return {k: v for k, v in named.items() if k in text}


def environ_variables(config: object) -> dict[str, str]:
    """The sample variables Inspect set in the environment for a task_init
    of their own (task_init_environment)."""
    text = _compose_text(config)
    if text is None:
        return {}
    return {k: v for k, v in os.environ.items() if k.startswith(SAMPLE_PREFIX) and k in text}


def images_depend(config: object, variables: dict[str, str]) -> bool:
    """Whether a sample's variables change which images the file needs
    (then Inspect gives them a task_init of their own, as for docker)."""
    if not variables:
        return False
    try:
        plain = read_project(config)
    except ComposeError:
        return True
    try:
        own = read_project(config, variables)
    except ComposeError:
        return False  # the sample's own start says why
    return [_source(plain, s) for s in plain.services.values()] != [_source(own, s) for s in own.services.values()]


@dataclass
class ComposeTask:
    """A project with every service's image ready (task_init's work)."""

    project: Project
    id_mapping: str
    images: dict[str, Image] = field(default_factory=dict)  # service -> image
    network: str = "none"


async def prepare(config: object, id_mapping: str = "auto", variables: dict[str, str] | None = None,
                  known: dict[tuple[Any, ...], Image] | None = None) -> ComposeTask:
    """The project read with the sample variables `variables`, every
    service's image ready; `known` holds the images already made ready for
    this task (by their source), filled in here."""
    project = read_project(config, variables)  # everything it cannot honour fails here, in one message
    for warning in project.warnings:
        print(f"nsbox: note: {warning}", file=sys.stderr)
    task = ComposeTask(project, id_mapping, network=sample_network(project))
    known = {} if known is None else known
    for service in project.services.values():
        source = _source(project, service)
        if source not in known:
            known[source] = await _image(project, service, id_mapping)
        task.images[service.name] = known[source]
        # What every sample would refuse fails the task here, once.
        service_spec(service, project, image=task.images[service.name].id, network=_mode(task.network, service),
                     check_only=True, pull="never", id_mapping=id_mapping, origin="inspect")
    return task


def _source(project: Project, service: Service) -> tuple[Any, ...]:
    """What a service's image is made from: equal sources, one image."""
    if service.build is not None:
        b = service.build
        return ("build", str(b.context), str(b.dockerfile), tuple(sorted(b.args.items())), b.target,
                _tag(project, service))
    return ("image", service.image, service.platform, pull_policy(service))


def _tag(project: Project, service: Service) -> str:
    """What a built image is called when the file names none (as compose
    does: PROJECT-SERVICE)."""
    return service.image or f"{project.name}-{service.name}".lower()


async def _image(project: Project, service: Service, id_mapping: str) -> Image:
    from ..sandbox import confined

    store = Store(runner=confined)
    if service.build is not None:
        from ..dockerfile import build_image

        b = service.build
        built = await build_image(b.context, dockerfile=b.dockerfile, tag=_tag(project, service), build_args=b.args,
                                  target=b.target, network=b.network, no_cache=b.no_cache,
                                  pull="always" if b.pull else "missing")
        ref = built.name
        return await resolve(store, ref, id_mapping=id_mapping, pull="never")  # type: ignore[arg-type]
    if not service.image:  # "" when it names only variables that are unset (a sample's, say)
        raise ComposeError(f"service {service.name} has neither image nor build"
                           + (" (its image is empty: a variable it names is unset)" if service.image == "" else ""))
    return await resolve(store, service.image, id_mapping=id_mapping, pull=pull_policy(service),  # type: ignore[arg-type]
                         platform=service.platform, progress=Progress(sys.stderr, label=service.name))


@dataclass
class Sample:
    """The running services of one sample, and the host directories of its
    named volumes."""

    services: Services
    volumes: Path | None
    mapping: idmap.IdMap

    async def close(self) -> None:
        await self.services.close()
        if self.volumes is not None:
            await _remove_volumes(self.volumes, self.mapping)


async def _remove_volumes(volumes: Path, mapping: idmap.IdMap) -> None:
    """On a thread: what the sample wrote there (any number of files) must
    not hold the event loop, which every other sample shares; to the end,
    even when cancelled."""
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(remove_volumes, volumes, mapping)


async def start_sample(task: ComposeTask, label: str, *, output_limit_mode: str = "truncate") -> tuple[Sample, dict[str, Any]]:
    """Creates the sample's services; returns them and the sandboxes by
    service name, the default service first."""
    project = task.project
    mapping = idmap.detect(task.id_mapping)  # type: ignore[arg-type]
    volumes = _volume_root(project, mapping) if _uses_named_volumes(project) else None
    names = aliases(project)
    per_service = service_networks(project) if task.network == "services" else {}
    specs = []
    declared = []  # the compose file's healthchecks: they set the deadline, as in Inspect
    try:
        for service in project.services.values():
            image = task.images[service.name]
            spec = service_spec(service, project, image=image.id, network=_mode(task.network, service),
                                volume_root=volumes, pull="never",
                                id_mapping=task.id_mapping, output_limit_mode=output_limit_mode,
                                label=f"{label} ({service.name})", origin="inspect")
            check = None
            if service.healthcheck is not None and not service.healthcheck.disable:
                h = service.healthcheck
                check = Healthcheck.merged(h.test, image.config.healthcheck, image.config.shell,
                                           interval=h.interval, timeout=h.timeout,
                                           retries=h.retries, start_period=h.start_period)
                if check is not None:
                    declared.append(check)
            # main_command applied Docker's rules already: [] runs nothing (not the image's).
            specs.append(ServiceSpec(service.name, spec, command=main_command(service, image.config) or [],
                                     depends_on=dict(service.depends_on), healthcheck=check,
                                     no_healthcheck=service.healthcheck is not None and service.healthcheck.disable,
                                     names=[n for n in names.get(service.name, []) if n != service.name],
                                     networks=per_service.get(service.name, {}), restart=service.restart))
        if volumes is not None:
            give(volumes, mapping.host_root)  # the volume directories service_spec made
            for service in start_order(project):  # the first service to mount a volume seeds it
                await seed(task.images[service.name], seeds(service, volumes), task.id_mapping)
        services = Services(specs, network=task.network, wait_limit=compose_deadline(declared),
                            networks={BRIDGE: False, **{n: d.internal for n, d in project.networks.items()}})
        sample = Sample(services, volumes, mapping)
        try:
            sandboxes = await services.start()
        except BaseException:
            await sample.close()
            raise
    except BaseException:
        if volumes is not None:
            await _remove_volumes(volumes, mapping)
        raise
    if volumes is not None:
        # Kept services (--no-sandbox-cleanup) outlive this process; the
        # volumes go once they are gone (manage.py).
        record_volume_users(volumes, [sb.id for sb in sandboxes.values()])
    return sample, sandboxes


def _mode(network: str, service: Service) -> str:
    """The network mode of a service's spec: the pod mode's, or in the
    "services" mode its own (Services puts it on its networks)."""
    if network != "services":
        return network
    return "host" if service.network_mode == "host" else "none"


def _uses_named_volumes(project: Project) -> bool:
    return any(m.type == "volume" for s in project.services.values() for m in s.volumes)


def _volume_root(project: Project, mapping: idmap.IdMap) -> Path:
    """A fresh directory for this sample's named volumes, owned by sandbox
    root (a volume starts empty and belongs to root, as in Docker, until
    the image's files are copied in)."""
    base = volume_base()
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    root = base / f"{project.name}-{secrets.token_hex(6)}"
    record_volume_users(root, [])  # first: a process killed from here on leaves garbage gc finds
    root.mkdir(mode=0o755)
    for name in project.volumes:
        (root / name).mkdir(mode=0o755)
    give(root, mapping.host_root)
    return root


