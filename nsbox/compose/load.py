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
from .hostpaths import HostPaths
from .interpolate import interpolate, unset_warning
from .model import NetworkDef, Project, Service, VolumeDef
from .parse import Reader, read_secret_mounts, read_service

MAX_COMPOSE = 4 << 20  # bytes of a compose file
MAX_NODES = 200_000  # values of a compose file once its YAML aliases are expanded
MAX_DEPTH = 100  # levels of nesting
_NAME = re.compile(r"[a-zA-Z0-9._-]+")  # services, volumes (compose's schema)

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
    `.env` file next to the compose file. Host paths it names must lie in
    its directory (hostpaths.py)."""
    path = Path(path)
    if path.is_dir():
        found = next((path / n for n in COMPOSE_FILES if (path / n).is_file()), None)
        if found is None:
            raise ComposeError(f"no compose file in {path}", hint=f"add one of {', '.join(COMPOSE_FILES)}")
        path = found
    path = path.resolve()  # its directory is the project's, as Inspect's read_project takes it
    paths = HostPaths(path.parent)
    text = paths.read_text(path, "compose file", limit=MAX_COMPOSE)
    if text is None:
        raise ComposeError(f"cannot read compose file {path}: No such file or directory")
    raw = read_yaml(text, str(path))
    env = project_environment(path.parent, os.environ if environ is None else environ, paths)
    return _project(raw, path.parent, env, source=str(path), paths=paths)


def project_from_config(config: Any, directory: Path, *, environ: Mapping[str, str] | None = None) -> Project:
    """The project of Inspect's ComposeConfig; relative paths resolve against
    `directory` (Inspect uses the working directory). Variables are
    interpolated as docker compose would when Inspect hands it the file."""
    raw = config.model_dump(mode="json", exclude_none=True, by_alias=True)
    env = dict(os.environ if environ is None else environ)
    directory = Path(directory).resolve()
    return _project(raw, directory, env, source="ComposeConfig", paths=HostPaths(directory))


def dockerfile_project(dockerfile: Path) -> Project:
    """What Inspect's docker provider makes of a bare Dockerfile: one
    `default` service built from it, kept alive by `tail -f /dev/null`,
    with an init and no network."""
    dockerfile = Path(dockerfile).resolve()
    raw = yaml.load(DOCKERFILE_COMPOSE.format(dockerfile=dockerfile.name), Loader=_Loader)  # noqa: S506
    raw["name"] = _normalise_name(dockerfile.parent.name)
    return _project(raw, dockerfile.parent, {}, source=str(dockerfile), paths=HostPaths(dockerfile.parent))


def project_environment(directory: Path, environ: Mapping[str, str], paths: HostPaths | None = None) -> dict[str, str]:
    """`environ` over the variables of `directory/.env`, as compose does."""
    paths = paths or HostPaths(directory)
    env_path = Path(directory) / ".env"
    text = paths.read_text(env_path, ".env")
    values = {} if text is None else dotenv.parse(text, environ.get, str(env_path))
    return {**values, **environ}


def read_yaml(text: str, source: str) -> Any:
    """A YAML document as compose's parser reads it, bounded: a document
    that is larger than MAX_NODES values once its aliases are expanded
    (a "billion laughs"), nested deeper than MAX_DEPTH, or holds a value
    of another type than JSON's is refused before it is built."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, source)
        return _plain(loader.construct_document(node), source)
    except yaml.YAMLError as e:
        raise ComposeError(f"{source}: not valid YAML: {e}") from None
    except RecursionError:
        raise ComposeError(f"{source}: not valid YAML: nested too deeply") from None
    except ValueError as e:  # a number too long to convert, say
        raise ComposeError(f"{source}: not valid YAML: {e}") from None
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, source: str) -> int:
    sizes: dict[int, int] = {}
    inside: set[int] = set()  # the nodes being counted: an alias to one of them is a cycle

    def size(n: yaml.Node, depth: int) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        if depth > MAX_DEPTH:
            raise ComposeError(f"{source}: nested more than {MAX_DEPTH} levels deep")
        if id(n) in inside:
            raise ComposeError(f"{source}: a YAML alias refers to a node that contains it")
        total = 1
        if isinstance(n, (yaml.SequenceNode, yaml.MappingNode)):
            inside.add(id(n))
            children = n.value if isinstance(n, yaml.SequenceNode) else [c for pair in n.value for c in pair]
            for child in children:
                total += size(child, depth + 1)
                if total > MAX_NODES:
                    raise ComposeError(f"{source}: more than {MAX_NODES} values once YAML aliases are expanded")
            inside.discard(id(n))
        sizes[id(n)] = total
        return total

    return size(node, 0)


def _plain(value: Any, source: str) -> Any:
    """`value` as a tree of its own (aliases copied) of JSON's types, with
    string keys (a number or boolean key becomes its YAML text)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if isinstance(k, bool):
                k = "true" if k else "false"
            elif isinstance(k, (int, float)):
                k = str(k)
            elif not isinstance(k, str):
                raise ComposeError(f"{source}: a mapping key must be a string, not {k!r}")
            out[k] = _plain(v, source)
        return out
    if isinstance(value, list):
        return [_plain(v, source) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise ComposeError(f"{source}: a value of YAML type {type(value).__name__} ({str(value)[:40]!r}) "
                       "has no meaning in a compose file")


def _project(raw: Any, directory: Path, environ: Mapping[str, str], source: str, paths: HostPaths) -> Project:
    if not isinstance(raw, dict) or not isinstance(raw.get("services"), dict) or not raw["services"]:
        raise ComposeError(f"{source}: a compose file needs a `services` mapping with at least one service")
    unset: list[str] = []
    raw = interpolate(raw, environ, unset)
    for kind in ("volumes", "networks", "secrets", "configs"):
        if not isinstance(raw.get(kind) or {}, dict):
            raise ComposeError(f"{source}: top-level {kind} must be a mapping")
        for name, definition in (raw.get(kind) or {}).items():
            if not isinstance(definition or {}, dict):
                raise ComposeError(f"{source}: {kind}.{name} must be a mapping")
    for name in [*raw["services"], *(raw.get("volumes") or {})]:
        # Names become directory names (a service's anonymous volumes, named
        # volumes): compose's own rule, without "." and "..".
        if not _NAME.fullmatch(name) or name in (".", ".."):
            raise ComposeError(f"{source}: {name!r} is not a valid name (letters, digits, '.', '_', '-')")
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
        support.check_shapes(name, svc)
        profiles = svc.get("profiles") or []
        if profiles and not active & set(profiles) and "*" not in active:
            continue  # compose leaves services of inactive profiles out
        if svc.get("image") is None and svc.get("build") is None:
            raise ComposeError(f"{source}: service {name} has neither an image nor a build context")
        review = support.review_service(name, svc)
        service_issues: list[str] = list(review.issues)
        svc = _with_env_files(name, svc, directory, environ, paths)
        service = read_service(name, svc, directory, environ, service_issues, paths)
        for kind in ("secrets", "configs"):
            service.volumes += read_secret_mounts(name, svc, raw.get(kind) or {}, paths, kind)
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
        host_paths=paths,
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


def _with_env_files(name: str, svc: dict[str, Any], directory: Path, environ: Mapping[str, str],
                    paths: HostPaths) -> dict[str, Any]:
    """`svc` with its env_file values under its own `environment`, which wins."""
    files = svc.get("env_file")
    if files is None:
        return svc
    reader = Reader(name, directory, environ, [], paths)
    values: dict[str, str] = {}
    for entry in files if isinstance(files, list) else [files]:
        path, required = (entry, True) if not isinstance(entry, dict) else (entry.get("path"), entry.get("required", True))
        full = reader.host_path(reader.string("env_file", path), "env_file")
        text = paths.read_text(full, f"service {name}: env_file")
        if text is None:
            if reader.boolean("env_file.required", required):
                raise ComposeError(f"service {name}: env_file {full} not found",
                                   hint="create it, or mark it `required: false`")
            continue
        values.update(dotenv.parse(text, environ.get, full))
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
