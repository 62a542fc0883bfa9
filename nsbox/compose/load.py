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
import stat
from dataclasses import dataclass, field, replace
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


def read_yaml(text: str, source: str, quiet: bool = False) -> Any:
    """A YAML document as compose's parser reads it, bounded: a document
    that is larger than MAX_NODES values once its aliases are expanded
    (a "billion laughs"), nested deeper than MAX_DEPTH, or holds a value
    of another type than JSON's is refused before it is built. `quiet`:
    errors quote nothing of the text (a file that may not be a compose file)."""
    try:
        return _read_yaml(text, source)
    except ComposeError as e:
        if not quiet:
            raise
        mark = getattr(e.__context__, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ComposeError(f"{source}: not a valid compose file{where}") from None


def _read_yaml(text: str, source: str) -> Any:
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


MAX_INCLUDE_DEPTH = 8  # nested include levels
MAX_INCLUDES = 64  # compose files one project may load through include:
SUITE_LEVELS = 2  # an include may reach this many directories above the top-level file's


@dataclass
class _Context:
    """What a project's loading through include: shares."""

    suite: str  # the directory every included file (or NSBOX_COMPOSE_PATHS) must lie in
    chain: tuple[str, ...]  # the files including the one being read, outermost first
    loaded: list[str] = field(default_factory=list)  # every file read


@dataclass
class _Part:
    """The resources of one compose file and the files it includes."""

    services: dict[str, Service] = field(default_factory=dict)
    networks: dict[str, NetworkDef] = field(default_factory=dict)
    volumes: dict[str, VolumeDef] = field(default_factory=dict)
    secrets: dict[str, tuple[dict[str, Any], HostPaths]] = field(default_factory=dict)
    configs: dict[str, tuple[dict[str, Any], HostPaths]] = field(default_factory=dict)
    origin: dict[tuple[str, str], str] = field(default_factory=dict)  # (kind, name) -> file
    warnings: list[str] = field(default_factory=list)
    scoped: list[tuple[str, str]] = field(default_factory=list)
    name: Any = None  # the file's `name:`, interpolated

    def add(self, kind: str, name: str, value: Any, source: str) -> None:
        """Adds a resource; one that two files define is an error naming both."""
        other = self.origin.get((kind, name))
        if other is not None:
            raise ComposeError(f"{kind} {name} is defined in both {other} and {source}",
                               hint="a resource may be defined in one file of a project only")
        self.origin[(kind, name)] = source
        getattr(self, kind)[name] = value

    def merge(self, other: "_Part") -> None:
        for (kind, name), source in other.origin.items():
            self.add(kind, name, getattr(other, kind)[name], source)
        self.warnings += other.warnings
        self.scoped += other.scoped


def suite_directory(directory: Path) -> str:
    """The directory included files may lie in: SUITE_LEVELS above the
    top-level file's `directory`, but never / or a directory just below it
    (/home, /tmp), which would let a file include from anywhere."""
    real = os.path.realpath(directory)
    for _ in range(SUITE_LEVELS):
        parent = os.path.dirname(real)
        if parent.count("/") < 2 or parent == real:  # "/x" has one slash, "/" is the root
            break
        real = parent
    return real


def _project(raw: Any, directory: Path, environ: Mapping[str, str], source: str, paths: HostPaths) -> Project:
    context = _Context(suite=suite_directory(directory), chain=(), loaded=[source])
    part = _read_file(raw, directory, environ, source, paths, context)
    if not part.services:
        raise ComposeError(f"{source}: every service is in an inactive profile",
                           hint="set COMPOSE_PROFILES to the profiles to run")
    scoped = part.scoped
    project = Project(
        name=_project_name({"name": part.name}, directory, environ),
        directory=directory,
        services=part.services,
        networks=part.networks,
        volumes=part.volumes,
        warnings=part.warnings,
        host_paths=paths,
    )
    project.warnings += support.check_references(project)
    project.networks.setdefault("default", NetworkDef("default"))
    default = project.default_service.name
    services = part.services
    project.services = {default: services[default], **{n: s for n, s in services.items() if n != default}}
    scoped += [("project", i) for i in support.review_project(project)]
    _, net_issues, net_warnings = support.network_shape(project)
    scoped += [("project", i) for i in net_issues]
    project.warnings += net_warnings
    if scoped:
        raise support.cannot_honour(scoped, source)
    project.warnings += support.mount_warnings(project)
    return project


def _read_file(raw: Any, directory: Path, environ: Mapping[str, str], source: str, paths: HostPaths,
               context: _Context) -> _Part:
    """The resources of one compose file (its host paths relative to
    `directory`, allowed by `paths`), then those of the files it includes."""
    if not isinstance(raw, dict) or not (
            isinstance(raw.get("services"), dict) and raw["services"] or "include" in raw and not context.chain):
        raise ComposeError(f"{source}: a compose file needs a `services` mapping with at least one service")
    unset: list[str] = []
    raw = interpolate(raw, environ, unset)
    for kind in ("services", "volumes", "networks", "secrets", "configs"):
        if not isinstance(raw.get(kind) or {}, dict):
            raise ComposeError(f"{source}: top-level {kind} must be a mapping")
        for name, definition in (raw.get(kind) or {}).items():
            if kind != "services" and not isinstance(definition or {}, dict):
                raise ComposeError(f"{source}: {kind}.{name} must be a mapping")
    for name in [*(raw.get("services") or {}), *(raw.get("volumes") or {})]:
        # Names become directory names (a service's anonymous volumes, named
        # volumes): compose's own rule, without "." and "..".
        if not _NAME.fullmatch(name) or name in (".", ".."):
            raise ComposeError(f"{source}: {name!r} is not a valid name (letters, digits, '.', '_', '-')")
    part = _Part(warnings=[unset_warning(name) for name in unset], name=raw.get("name"))
    issues, top_warnings = support.review_top_level(raw)
    part.scoped += [("top level", i) for i in issues]
    part.warnings += top_warnings
    for name, d in (raw.get("networks") or {}).items():
        d = d or {}
        part.add("networks", name, NetworkDef(name, internal=bool(d.get("internal")), driver=d.get("driver"),
                                             external=bool(d.get("external"))), source)
    for name, d in (raw.get("volumes") or {}).items():
        part.add("volumes", name, VolumeDef(name, external=bool((d or {}).get("external"))), source)
    for kind in ("secrets", "configs"):
        for name, d in (raw.get(kind) or {}).items():
            part.add(kind, name, (d or {}, paths), source)
    included = _Part()
    for entry in _include_entries(raw.get("include"), source):
        included.merge(_include(entry, directory, environ, source, paths, context))
    for kind in ("networks", "volumes", "secrets", "configs"):  # a service may use an included one
        for name, value in getattr(included, kind).items():
            part.add(kind, name, value, included.origin[(kind, name)])
    active = {p.strip() for p in environ.get("COMPOSE_PROFILES", "").split(",") if p.strip()}
    for name, svc in (raw.get("services") or {}).items():
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
        for mount in service.volumes:
            if mount.type == "bind" and mount.host_paths is None:
                mount.host_paths = paths
        for kind in ("secrets", "configs"):
            service.volumes += read_secret_mounts(name, svc, getattr(part, kind), kind)
        service.ignored = review.ignored
        part.warnings += review.warnings
        part.scoped += [(f"service {name}", i) for i in service_issues]
        part.add("services", name, service, source)
    for name, service in included.services.items():  # after the file's own: its first service stays first
        part.add("services", name, service, included.origin[("services", name)])
    part.warnings += included.warnings
    part.scoped += included.scoped
    return part


def _include_entries(value: Any, source: str) -> list[dict[str, Any]]:
    """The long form of each `include:` entry (a bare string is its path)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ComposeError(f"{source}: include must be a list")
    entries = []
    for entry in value:
        entry = {"path": entry} if isinstance(entry, str) else entry
        if not isinstance(entry, dict):
            raise ComposeError(f"{source}: include: expected a path or a mapping, not {entry!r}")
        unknown = set(entry) - {"path", "project_directory", "env_file"}
        if unknown:
            raise ComposeError(f"{source}: include: unknown key {sorted(unknown)[0]}")
        for key in ("path", "env_file"):
            v = entry.get(key)
            v = [v] if isinstance(v, str) else v
            if v is not None and (not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v)):
                raise ComposeError(f"{source}: include: {key} must be a path or a list of paths")
            entry = {**entry, key: v}
        if not entry.get("path"):
            raise ComposeError(f"{source}: include: an entry needs a path")
        if not isinstance(entry.get("project_directory", ""), str):
            raise ComposeError(f"{source}: include: project_directory must be a path")
        entries.append(entry)
    return entries


def _include(entry: dict[str, Any], directory: Path, environ: Mapping[str, str], source: str,
             paths: HostPaths, context: _Context) -> _Part:
    """The resources of one `include:` entry, loaded as compose loads it: as
    a project of its own, in its own directory with its own variables.

    Its files must lie where the including file may name host paths, or
    in the suite directory; its project directory in the first file's
    directory or where the including file may name host paths; its
    `env_file`s where the including file or the included project may. A file not named *.yaml
    or *.yml is never opened; one that is not a compose document is
    refused without a word of its content."""
    allowed = paths.widened(context.suite)

    def place(text: str, what: str) -> str:
        path = os.path.normpath(directory / os.path.expanduser(text))
        try:
            return allowed.check(path, what)
        except ComposeError:
            raise ComposeError(
                f"{source}: {what} {text} is outside the directories a compose file may include from "
                f"({', '.join(allowed.roots)})",
                hint=f"an included file must lie in the including file's directory or up to {SUITE_LEVELS} "
                     f"levels above the top-level file's; to allow another, set NSBOX_COMPOSE_PATHS=DIR") from None

    files = [place(f, "include") for f in entry["path"]]
    for file in files:  # refused before it is opened: no key file or credentials is ever read
        if not file.endswith((".yaml", ".yml")):
            raise ComposeError(f"{source}: included file {file} is not named *.yaml or *.yml",
                               hint="an included file must be a compose file")
    chain = (*context.chain, source)
    if files[0] in chain:
        cycle = " -> ".join([*chain[chain.index(files[0]):], files[0]])
        raise ComposeError(f"include cycle: {cycle}")
    if len(chain) > MAX_INCLUDE_DEPTH:
        raise ComposeError(f"{files[0]}: includes nested more than {MAX_INCLUDE_DEPTH} levels deep")
    context.loaded += files
    if len(context.loaded) > MAX_INCLUDES:
        raise ComposeError(f"{context.loaded[0]}: includes more than {MAX_INCLUDES} compose files")
    project_dir = Path(os.path.dirname(files[0]))
    # Override files are read as the first file's project: from anywhere
    # else, they would name host paths in the first file's directory.
    beside_first = HostPaths(project_dir, extra="")
    for file in files[1:]:
        try:
            beside_first.check(file, "include")
        except ComposeError:
            raise ComposeError(f"{source}: include: {file} is merged into {files[0]}, so it must lie in that "
                               f"file's directory {project_dir}") from None
    if entry.get("project_directory"):
        # The included file names host paths in its project directory: one
        # that only the suite directory allows (../.. = your home) is refused.
        wanted = os.path.normpath(directory / os.path.expanduser(entry["project_directory"]))
        inside = HostPaths(project_dir, extra="").widened(*paths.roots)
        project_dir = Path(inside.check(wanted, f"{source}: include project_directory"))
    own = HostPaths(project_dir)
    env_paths = own.widened(*paths.roots)
    if entry.get("env_file"):
        env_files = [(env_paths.check(os.path.normpath(directory / os.path.expanduser(f)), "include env_file"), True)
                     for f in entry["env_file"]]
    else:
        env_files = [(str(project_dir / ".env"), False)]
    values: dict[str, str] = {}
    for env_file, required in env_files:
        text = env_paths.read_text(env_file, "include env_file")
        if text is None and required:
            raise ComposeError(f"{source}: include env_file {env_file} not found")
        values.update({} if text is None else dotenv.parse(text, environ.get, env_file))
    env = {**values, **environ}  # the including project's variables win, as in compose
    raw: dict[str, Any] = {}
    for file in files:
        text = allowed.read_text(file, "included compose file", limit=MAX_COMPOSE)
        if text is None:
            raise ComposeError(f"{source}: included compose file {file} not found")
        data = read_yaml(text, file, quiet=True)
        if not isinstance(data, dict) or not isinstance(data.get("services"), dict):
            raise ComposeError(f"{source}: included file {file} is not a compose file (no top-level `services` mapping)")
        raw = _override(raw, data)
    return _read_file(raw, project_dir, env, files[0], own, replace(context, chain=chain))


# Lists a later compose file adds to rather than replaces (compose's merge rules).
_JOINED = frozenset({"include", "ports", "expose", "cap_add", "cap_drop", "dns", "dns_search", "dns_opt",
                     "env_file", "security_opt", "devices", "secrets", "configs", "external_links", "tmpfs"})
_KEYED = frozenset({"environment", "labels", "extra_hosts", "args", "sysctls", "annotations"})


def _override(base: Any, override: Any, key: str = "") -> Any:
    """`override` merged onto `base` as compose merges a later file:
    mappings key by key; `environment`-like keys as mappings whatever
    their form; `volumes` of a service by target; some lists joined; any
    other value replaced."""
    if key in _KEYED and isinstance(base, (dict, list)) and isinstance(override, (dict, list)):
        return {**_as_mapping(base, key), **_as_mapping(override, key)}
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, value in override.items():
            out[k] = _override(out[k], value, k) if k in out else value
        return out
    if isinstance(base, list) and isinstance(override, list):
        if key in _JOINED:
            return base + [v for v in override if v not in base]
        if key == "volumes":
            targets = {_target(v) for v in override}
            return [v for v in base if _target(v) not in targets] + override
    return override


def _as_mapping(value: dict[str, Any] | list[Any], key: str) -> dict[str, Any]:
    """A list of KEY=VALUE (extra_hosts: also HOST:ADDRESS) as a mapping."""
    if isinstance(value, dict):
        return value
    out: dict[str, Any] = {}
    for item in map(str, value):
        sep = ":" if key == "extra_hosts" and "=" not in item else "="
        k, has, v = item.partition(sep)
        out[k] = v if has else None
    return out


def _target(volume: Any) -> Any:
    """The container path of a service's volume entry (what compose merges by)."""
    if isinstance(volume, dict):
        return volume.get("target")
    parts = str(volume).split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def is_compose_document(path: str | os.PathLike[str]) -> bool:
    """Whether the YAML file `path`, whatever its name, is a compose file: a
    mapping with a top-level `services` mapping (an nsbox.yaml has none)."""
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return False
            data = f.read(MAX_COMPOSE + 1)
        if len(data) > MAX_COMPOSE:
            return False
        raw = read_yaml(data.decode("utf-8"), str(path), quiet=True)
    except (OSError, UnicodeDecodeError, ComposeError):
        return False
    return isinstance(raw, dict) and isinstance(raw.get("services"), dict)


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
        form = entry.get("format") if isinstance(entry, dict) else None
        if form not in (None, "raw"):
            raise ComposeError(f"service {name}: env_file {path}: format {form!r} is not one compose knows (raw)")
        full = reader.host_path(reader.string("env_file", path), "env_file")
        text = paths.read_text(full, f"service {name}: env_file")
        if text is None:
            if reader.boolean("env_file.required", required):
                raise ComposeError(f"service {name}: env_file {full} not found",
                                   hint="create it, or mark it `required: false`")
            continue
        values.update((dotenv.parse_raw if form == "raw" else dotenv.parse)(text, environ.get, full))
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
