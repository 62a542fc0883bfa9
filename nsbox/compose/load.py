"""Reading compose projects: a compose file, Inspect's ComposeConfig, or a
bare Dockerfile, into nsbox's model (model.py).

The reader is lenient where compose is (every form compose accepts for a
key) and strict where nsbox must be (support.py). YAML is read as compose's
Go YAML library reads it: YAML 1.2 scalars, so `no` stays a string and
`22:22` is not a base-60 number.

No maintained PyPI package ships the Compose specification's JSON schema
(docker-compose 1.x is end-of-life; compose-spec and compose-pydantic are
third-party bindings of their own models), so structure is checked here,
key by key.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping

import yaml

from . import dotenv, support
from .errors import ComposeError
from .interpolate import interpolate, unset_warning
from .model import NetworkDef, Project, Service, VolumeDef
from .parse import Reader, read_secret_mounts, read_service

COMPOSE_FILES = ("compose.yaml", "compose.yml", "docker-compose.yaml", "docker-compose.yml")

# Inspect's docker provider turns a bare Dockerfile into this compose file
# (inspect_ai/util/_sandbox/docker/config.py, COMPOSE_DOCKERFILE_YAML).
DOCKERFILE_COMPOSE = """\
services:
  default:
    build:
      context: "."
      dockerfile: "{dockerfile}"
    command: "tail -f /dev/null"
    init: true
    network_mode: none
    stop_grace_period: 1s
"""


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema booleans and numbers, as Go's
    yaml.v3 (compose's parser) resolves them; no implicit timestamps."""


_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers
         if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int",
                        "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp")]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                              list("-+0123456789"))
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node))
    return int(text, 0) if text.startswith(("0o", "0x")) else int(text)  # "010" is ten, as in YAML 1.2


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def load_project(path: Path, *, environ: Mapping[str, str] | None = None) -> Project:
    """The project a compose file describes (or the compose file found in a
    directory). Variables come from `environ` (default: os.environ) over the
    `.env` file next to the compose file."""
    path = Path(path)
    if path.is_dir():
        found = next((path / n for n in COMPOSE_FILES if (path / n).is_file()), None)
        if found is None:
            raise ComposeError(f"no compose file in {path}", hint=f"add one of {', '.join(COMPOSE_FILES)}")
        path = found
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ComposeError(f"cannot read compose file {path}: {e.strerror}") from None
    try:
        raw = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ComposeError(f"{path}: not valid YAML: {e}") from None
    directory = path.parent.resolve()
    env = project_environment(directory, os.environ if environ is None else environ)
    return _project(raw, directory, env, source=str(path))


def project_from_config(config: Any, directory: Path, *, environ: Mapping[str, str] | None = None) -> Project:
    """The project of Inspect's ComposeConfig; relative paths resolve against
    `directory` (Inspect uses the working directory). Variables are
    interpolated as docker compose would when Inspect hands it the file."""
    raw = config.model_dump(mode="json", exclude_none=True, by_alias=True)
    env = dict(os.environ if environ is None else environ)
    return _project(raw, Path(directory).resolve(), env, source="ComposeConfig")


def dockerfile_project(dockerfile: Path) -> Project:
    """What Inspect's docker provider makes of a bare Dockerfile: one
    `default` service built from it, kept alive by `tail -f /dev/null`,
    with an init and no network."""
    dockerfile = Path(dockerfile).resolve()
    raw = yaml.load(DOCKERFILE_COMPOSE.format(dockerfile=dockerfile.name), Loader=_Loader)  # noqa: S506
    raw["name"] = _normalise_name(dockerfile.parent.name)
    return _project(raw, dockerfile.parent, {}, source=str(dockerfile))


def project_environment(directory: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` over the variables of `directory/.env`, as compose does."""
    env_path = directory / ".env"
    values: dict[str, str] = {}
    if env_path.is_file():
        values = dotenv.parse(env_path.read_text(encoding="utf-8"), environ.get, str(env_path))
    return {**values, **environ}


def _project(raw: Any, directory: Path, environ: Mapping[str, str], source: str) -> Project:
    if not isinstance(raw, dict) or not isinstance(raw.get("services"), dict) or not raw["services"]:
        raise ComposeError(f"{source}: a compose file needs a `services` mapping with at least one service")
    unset: list[str] = []
    raw = interpolate(raw, environ, unset)
    warnings = [unset_warning(name) for name in unset]
    issues, top_warnings = support.review_top_level(raw)
    scoped = [("top level", i) for i in issues]
    warnings += top_warnings
    active = {p.strip() for p in environ.get("COMPOSE_PROFILES", "").split(",") if p.strip()}
    services: dict[str, Service] = {}
    for name, svc in raw["services"].items():
        svc = svc or {}
        if not isinstance(svc, dict):
            raise ComposeError(f"{source}: service {name} must be a mapping")
        profiles = svc.get("profiles") or []
        if profiles and not active & set(profiles) and "*" not in active:
            continue  # compose leaves services of inactive profiles out
        if svc.get("image") is None and svc.get("build") is None:
            raise ComposeError(f"{source}: service {name} has neither an image nor a build context")
        review = support.review_service(name, svc)
        service_issues: list[str] = list(review.issues)
        svc = _with_env_files(name, svc, directory, environ)
        service = read_service(name, svc, directory, environ, service_issues)
        for kind in ("secrets", "configs"):
            service.volumes += read_secret_mounts(name, svc, raw.get(kind) or {}, directory, kind)
        service.ignored = review.ignored
        warnings += review.warnings
        scoped += [(f"service {name}", i) for i in service_issues]
        services[name] = service
    if not services:
        raise ComposeError(f"{source}: every service is in an inactive profile",
                           hint="set COMPOSE_PROFILES to the profiles to run")
    project = Project(
        name=_project_name(raw, directory, environ),
        directory=directory,
        services=services,
        networks={n: NetworkDef(n, internal=bool((d or {}).get("internal")), driver=(d or {}).get("driver"),
                                external=bool((d or {}).get("external")))
                  for n, d in (raw.get("networks") or {}).items()},
        volumes={n: VolumeDef(n, external=bool((d or {}).get("external"))) for n, d in (raw.get("volumes") or {}).items()},
        warnings=warnings,
    )
    support.check_references(project)
    project.networks.setdefault("default", NetworkDef("default"))
    default = project.default_service.name
    project.services = {default: services[default], **{n: s for n, s in services.items() if n != default}}
    scoped += [("project", i) for i in support.review_project(project)]
    _, net_issues, net_warnings = support.network_shape(project)
    scoped += [("project", i) for i in net_issues]
    project.warnings += net_warnings
    if scoped:
        raise support.cannot_honour(scoped, source)
    project.warnings += support.mount_warnings(project)
    return project


def _with_env_files(name: str, svc: dict[str, Any], directory: Path, environ: Mapping[str, str]) -> dict[str, Any]:
    """`svc` with its env_file values under its own `environment`, which wins."""
    files = svc.get("env_file")
    if files is None:
        return svc
    reader = Reader(name, directory, environ, [])
    values: dict[str, str] = {}
    for entry in files if isinstance(files, list) else [files]:
        path, required = (entry, True) if isinstance(entry, str) else (entry.get("path"), entry.get("required", True))
        full = Path(reader.host_path(str(path)))
        if not full.is_file():
            if reader.boolean("env_file.required", required):
                raise ComposeError(f"service {name}: env_file {full} not found",
                                   hint="create it, or mark it `required: false`")
            continue
        values.update(dotenv.parse(full.read_text(encoding="utf-8"), environ.get, str(full)))
    own = reader.mapping("environment", svc.get("environment"))
    merged: dict[str, Any] = dict(values)
    for key, value in own.items():
        if value is not None or key in environ or key not in values:
            merged[key] = value  # a bare KEY not in the environment keeps the file's value
    return {**svc, "environment": merged}


def _project_name(raw: dict[str, Any], directory: Path, environ: Mapping[str, str]) -> str:
    name = raw.get("name") or environ.get("COMPOSE_PROJECT_NAME") or directory.name
    return _normalise_name(str(name)) or "default"


def _normalise_name(name: str) -> str:
    # compose-go's NormalizeProjectName
    return re.sub(r"[^a-z0-9_-]", "", name.lower()).lstrip("_-")
