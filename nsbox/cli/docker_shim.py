"""A `docker` command for evaluations that shell out to the Docker CLI.

Some task code runs `docker compose config` or `docker image inspect` while
it builds its dataset; with no Docker on the host that fails before nsbox
is asked. `nsbox docker-shim install --prefix DIR` writes DIR/bin/docker, a
script that answers those few commands from nsbox's own image store and
compose reader (as podman-docker does for podman) and says so clearly for
anything else. Nothing is installed unless asked for, and an existing
`docker` that is not this shim is never overwritten.

The Docker SDK for Python talks to the daemon's socket, not to the CLI: it
is not served.
"""

from __future__ import annotations

import json
import os
import platform
import re
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import click

from .. import __version__
from ..errors import NsboxError
from .common import exit_with, fail

if TYPE_CHECKING:
    from ..storage.reference import Reference

MARK = "# nsbox docker shim"
API_VERSION = "1.43"  # what `docker version` reports, for clients that check
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


def _unsupported(words: list[str]) -> NoReturn:
    exit_with(f"nsbox's docker shim does not do `docker {' '.join(words)}`; it answers only `docker compose config`, "
          "`docker image inspect|ls|pull|build`, `docker pull`, `docker build`, `docker images`, `docker version` "
          "and `docker info` (nsbox runs containers itself: inspect eval ... --sandbox nsbox)")


# ---- installing --------------------------------------------------------

def script(python: str = sys.executable) -> str:
    # `-c`, with the working directory dropped from sys.path: a directory
    # named nsbox where docker is run is not imported.
    boot = "import sys; del sys.path[0]; from nsbox.cli.docker_shim import run; run(sys.argv[1:])"
    return f"#!/bin/sh\n{MARK} (nsbox docker-shim install): see `nsbox docker-shim --help`\n" \
           f"exec {_quote(python)} -c {_quote(boot)} \"$@\"\n"


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def install(prefix: Path) -> Path:
    """Writes PREFIX/bin/docker; refuses to replace a `docker` that is not
    this shim."""
    target = prefix / "bin" / "docker"
    if os.path.lexists(target) and not _is_shim(target):
        raise NsboxError(f"{target} exists and is not nsbox's docker shim: not overwriting it",
                         hint="choose another --prefix, or remove that file yourself")
    target.parent.mkdir(parents=True, exist_ok=True)
    # A file of our own making (not a name another user of the folder could
    # have planted), moved over the old shim in one step.
    fd, tmp = tempfile.mkstemp(prefix=".docker.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(script())
            os.fchmod(f.fileno(), 0o755)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    return target


def _is_shim(path: Path) -> bool:
    """A regular file (never a link or a FIFO, which would hang) that says it is the shim."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return False
        return MARK.encode() in f.read(400)


# ---- answering ---------------------------------------------------------

def run(argv: list[str]) -> None:
    """Answers one docker command line (without the leading `docker`)."""
    args = list(argv)
    while args and args[0] in ("-D", "--debug", "-l", "--log-level", "--context", "-c"):
        args = args[1:] if args[0] in ("-D", "--debug") else args[2:]  # client options that change nothing here
    if not args or args[0] in ("-h", "--help", "help"):
        _unsupported(args or ["(no command)"])
    cmd, rest = args[0], args[1:]
    if cmd in ("-v", "--version"):
        print(f"Docker version {_server()['Version']}, nsbox docker shim")
        return
    if cmd == "image" and rest:
        cmd, rest = {"inspect": "image-inspect", "ls": "images", "list": "images", "pull": "pull",
                     "build": "build"}.get(rest[0], "image " + rest[0]), rest[1:]
    elif cmd == "inspect" and "--type" in rest:  # docker inspect --type image REF
        i = rest.index("--type")
        if rest[i + 1:i + 2] == ["image"]:
            cmd, rest = "image-inspect", rest[:i] + rest[i + 2:]
    handler = HANDLERS.get(cmd)
    if handler is None:
        _unsupported(args[:2] if cmd == "image" or cmd.startswith("image ") else args[:1])
    try:
        handler(rest)
    except NsboxError as e:
        exit_with(f"Error: {e}")


def _options(rest: list[str], flags: set[str], valued: set[str], words: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Docker-style options: flags, options with a value (`--x v`, `--x=v`,
    repeatable), the rest positional; an unknown option is refused."""
    found: dict[str, Any] = {}
    positional: list[str] = []
    i = 0
    while i < len(rest):
        a = rest[i]
        name, eq, value = a.partition("=")
        if a == "--":
            positional += rest[i + 1:]
            break
        if name in valued:
            if not eq:
                i += 1
                if i >= len(rest):
                    exit_with(f"docker {' '.join(words)}: {name} needs a value")
                value = rest[i]
            found.setdefault(name, []).append(value)
        elif a in flags:
            found[a] = True
        elif a.startswith("-") and a != "-":
            _unsupported(words + [a])
        else:
            positional.append(a)
        i += 1
    return found, positional


def _format(template: str, value: Any) -> str:
    """The Go templates scripts use: `{{.A.B}}` and `{{json .A}}`."""
    def field(path: str) -> Any:
        v = value
        for part in path.split(".")[1:] if path != "." else []:
            v = v.get(part) if isinstance(v, dict) else None
        return v

    def one(m: re.Match[str]) -> str:
        expr = m.group(1).strip()
        if expr.startswith("json "):
            return json.dumps(field(expr[5:].strip()))
        if re.fullmatch(r"\.(\w+(\.\w+)*)?", expr):
            v = field(expr)
            if v is None:
                return "<no value>"
            return v if isinstance(v, str) else json.dumps(v) if isinstance(v, (dict, list)) else str(v)
        exit_with(f"nsbox's docker shim does not do the template {{{{{expr}}}}}; it knows {{{{.Field.Sub}}}} "
              "and {{json .Field}}")

    return re.sub(r"\{\{(.*?)\}\}", one, template)


def _print(value: Any, fmt: list[str] | None) -> None:
    if fmt and fmt[-1] != "json":
        print(_format(fmt[-1], value))
    else:
        print(json.dumps(value, indent=None if fmt else 4))


# ---- images --------------------------------------------------------------

def _image_json(store: Any, ref: str) -> dict[str, Any]:
    from ..storage.config import ImageConfig
    from ..storage.oci import layer_descriptors

    rec = store.lookup(ref)
    doc = store.read_json(rec.id)
    cfg = ImageConfig.parse(doc)
    names = sorted(_familiar(n) for n, r in store.records().items() if r.id == rec.id)
    c = doc.get("config") or {}
    config = {"Hostname": "", "User": cfg.user or "", "ExposedPorts": {p: {} for p in cfg.exposed_ports} or None,
              "Env": [f"{k}={v}" for k, v in cfg.env.items()], "Cmd": cfg.cmd or None,
              "Healthcheck": cfg.healthcheck, "Image": "", "Volumes": {v: {} for v in cfg.volumes} or None,
              "WorkingDir": cfg.workdir or "", "Entrypoint": cfg.entrypoint or None, "Labels": cfg.labels or None,
              "StopSignal": cfg.stop_signal or c.get("StopSignal")}
    config = {k: v for k, v in config.items() if v is not None or k in ("Cmd", "Entrypoint", "Labels")}
    size = sum(int(d.get("size") or 0) for d in layer_descriptors(store.read_json(rec.digest)))
    repo_digests = sorted({n.rsplit(":", 1)[0] + "@" + rec.digest for n in names if "/" in n or ":" in n})
    return {"Id": rec.id, "RepoTags": names, "RepoDigests": repo_digests, "Parent": "", "Comment": "",
            "Created": cfg.created or "", "DockerVersion": "", "Author": doc.get("author", ""),
            "Config": config, "Architecture": cfg.architecture or ARCH, "Os": cfg.os,
            "Size": size, "RootFS": {"Type": "layers", "Layers": list(cfg.diff_ids)},
            "Metadata": {"LastTagTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(rec.created))},
            **({"Variant": cfg.variant} if cfg.variant else {})}


def image_inspect(rest: list[str]) -> None:
    from ..storage import Store
    from ..storage.store import ImageNotFound

    opts, refs = _options(rest, set(), {"-f", "--format", "--platform"}, ["image", "inspect"])
    if not refs:
        exit_with('"docker image inspect" requires at least 1 argument.')
    store, found, missing = Store(), [], []
    for ref in refs:
        try:
            found.append(_image_json(store, ref))
        except (ImageNotFound, NsboxError):
            missing.append(ref)
    fmt = opts.get("-f", []) + opts.get("--format", [])
    if fmt and fmt[-1] != "json":
        for item in found:
            print(_format(fmt[-1], item))
    else:
        print(json.dumps(found, indent=4))
    if missing:
        exit_with("\n".join(f"Error: No such image: {r}" for r in missing))


def _reference(name: str) -> "Reference | None":
    """`name` parsed, None if it is not a reference."""
    from ..storage.reference import ReferenceError, parse

    try:
        return parse(name)
    except ReferenceError:
        return None


def _familiar(name: str) -> str:
    """A stored image's name as Docker prints it (`python:3.12`, not
    `docker.io/library/python:3.12`)."""
    ref = _reference(name)
    return name if ref is None else ref.short()


def _repository(name: str) -> str | None:
    ref = _reference(name)
    return None if ref is None else ref.name


def _wanted_names(store: Any, ref: str) -> Callable[[str], bool]:
    """Which stored names `docker images REF` lists: every tag of REF's
    repository when it names none, else (or for an image id) that image."""
    from ..storage.store import ImageNotFound

    if ":" not in ref.rsplit("/", 1)[-1] and "@" not in ref:
        repository = _repository(ref)
        if repository is not None and any(_repository(n) == repository for n in store.records()):
            return lambda name: _repository(name) == repository
    try:
        exact = store.lookup(ref).name
    except (ImageNotFound, NsboxError):
        return lambda name: False
    return lambda name: name == exact


def images(rest: list[str]) -> None:
    from ..storage import Store

    opts, refs = _options(rest, {"-q", "--quiet", "-a", "--all", "--no-trunc", "--digests"},
                          {"--format", "-f", "--filter"}, ["image", "ls"])
    if "-f" in opts or "--filter" in opts:
        _unsupported(["image", "ls", "--filter"])
    store = Store()
    wanted = None  # `docker images REPOSITORY[:TAG]`: that image, or every tag of the repository
    if refs:
        wanted = _wanted_names(store, refs[0])
    rows = []
    for name, rec in sorted(store.records().items()):
        if wanted is not None and not wanted(name):
            continue
        name = _familiar(name)
        repo, _, tag = name.rpartition(":") if ":" in name.rsplit("/", 1)[-1] else (name, "", "<none>")
        short = rec.id.split(":")[-1][:12]
        rows.append({"Repository": repo, "Tag": tag, "ID": rec.id if "--no-trunc" in opts else short,
                     "Digest": rec.digest, "CreatedAt": time.strftime("%Y-%m-%d %H:%M:%S +0000 UTC",
                                                                      time.gmtime(rec.created)),
                     "Size": f"{rec.size / 1e6:.1f}MB"})
    if "-q" in opts or "--quiet" in opts:
        for ident in dict.fromkeys(r["ID"] for r in rows):
            print(ident)
        return
    fmt = opts.get("--format")
    if fmt:
        for r in rows:
            print(json.dumps(r) if fmt[-1] == "json" else _format(fmt[-1], r))
        return
    print(f"{'REPOSITORY':<40} {'TAG':<16} {'IMAGE ID':<14} {'CREATED':<20} SIZE")
    for r in rows:
        print(f"{r['Repository']:<40} {r['Tag']:<16} {r['ID']:<14} {r['CreatedAt'][:19]:<20} {r['Size']}")


def pull(rest: list[str]) -> None:
    from .image import pull_cmd

    opts, refs = _options(rest, {"-q", "--quiet", "-a", "--all-tags"}, {"--platform"}, ["pull"])
    if len(refs) != 1 or "-a" in opts or "--all-tags" in opts:
        exit_with('"docker pull" requires exactly 1 argument (and no --all-tags here).')
    args = ["--quiet"] if "-q" in opts or "--quiet" in opts else []
    args += ["--platform", opts["--platform"][-1]] if "--platform" in opts else []
    pull_cmd.main([*args, refs[0]], prog_name="docker pull")


def build(rest: list[str]) -> None:
    from .build import build as build_cmd

    opts, ctx = _options(rest, {"-q", "--quiet", "--no-cache", "--pull", "--rm", "--force-rm"},
                         {"-t", "--tag", "-f", "--file", "--build-arg", "--target", "--platform", "--network"},
                         ["build"])
    if len(ctx) != 1:
        exit_with('"docker build" requires exactly 1 argument (the context directory; nsbox builds no URL or stdin).')
    if not opts.get("-t") and not opts.get("--tag"):
        exit_with("docker build: give the image a name with -t (nsbox's store keeps named images)")
    args: list[str] = []
    for name in ("-t", "--tag", "-f", "--file", "--build-arg", "--target", "--platform", "--network"):
        for v in opts.get(name, []):
            args += [name, v]
    args += [f for f in ("-q", "--quiet", "--no-cache") if f in opts]
    args += ["--pull", "always"] if "--pull" in opts else []
    build_cmd.main([*args, ctx[0]], prog_name="docker build")


# ---- compose -------------------------------------------------------------

def compose(rest: list[str]) -> None:
    if rest and rest[0] == "version":
        print(f"Docker Compose version v2.27.0 (nsbox docker shim {__version__})")
        return
    files: list[str] = []
    i = 0
    project_dir = project_name = None
    while i < len(rest) and rest[i].startswith("-"):
        name, eq, value = rest[i].partition("=")
        if name not in ("-f", "--file", "--project-directory", "-p", "--project-name"):
            _unsupported(["compose", rest[i]])
        if not eq:
            i += 1
            if i >= len(rest):
                exit_with(f"docker compose: {name} needs a value")
            value = rest[i]
        if name in ("-f", "--file"):
            files.append(value)
        elif name == "--project-directory":
            project_dir = value
        else:
            project_name = value
        i += 1
    if rest[i:i + 1] != ["config"]:
        _unsupported(["compose", *rest[i:i + 1]])
    if len(files) > 1:
        _unsupported(["compose", "-f", files[0], "-f", files[1], "config"])
    opts, extra = _options(rest[i + 1:], {"--images", "--services", "--volumes", "-q", "--quiet", "--no-interpolate",
                                          "--resolve-image-digests", "--no-normalize"},
                           {"--format", "-o", "--output"}, ["compose", "config"])
    if extra:
        _unsupported(["compose", "config", *extra])
    from ..compose import load_project

    path = Path(files[0]) if files else Path(project_dir or ".")
    project = load_project(path)
    project.name = project_name or project.name
    if "-q" in opts or "--quiet" in opts:
        return
    if "--images" in opts:
        for s in project.services.values():
            print(s.image or f"{project.name}-{s.name}".lower())
        return
    if "--services" in opts:
        print("\n".join(project.services))
        return
    if "--volumes" in opts:
        print("\n".join(project.volumes))
        return
    out = _compose_doc(project)
    text = json.dumps(out, indent=2) if opts.get("--format", ["yaml"])[-1] == "json" else _yaml(out)
    target = (opts.get("-o") or opts.get("--output") or [None])[-1]
    if target:
        try:
            Path(target).write_text(text + "\n")
        except OSError as e:
            raise NsboxError(f"cannot write {target}: {e.strerror}") from None
    else:
        print(text)


def _yaml(doc: Any) -> str:
    import yaml

    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False).rstrip("\n")


def _compose_doc(project: Any) -> dict[str, Any]:
    """The project in compose's normalised form, for what nsbox reads."""
    services = {}
    for s in project.services.values():
        d: dict[str, Any] = {}
        if s.build is not None:
            d["build"] = {"context": str(s.build.context), "dockerfile": str(s.build.dockerfile or "Dockerfile")}
            if s.build.args:
                d["build"]["args"] = dict(s.build.args)
            if s.build.target:
                d["build"]["target"] = s.build.target
        d["image"] = s.image or f"{project.name}-{s.name}".lower()
        for key, value in (("command", s.command), ("entrypoint", s.entrypoint), ("working_dir", s.working_dir),
                           ("user", s.user), ("hostname", s.hostname), ("platform", s.platform),
                           ("network_mode", s.network_mode)):
            if value is not None:
                d[key] = value
        if s.environment:
            d["environment"] = dict(s.environment)
        if s.depends_on:
            d["depends_on"] = {n: {"condition": c} for n, c in s.depends_on.items()}
        if s.networks:
            d["networks"] = {n: ({"aliases": a} if a else None) for n, a in s.networks.items()}
        if s.volumes:
            d["volumes"] = [{k: v for k, v in (("type", m.type), ("source", m.source), ("target", m.target),
                                                 ("read_only", m.read_only or None)) if v is not None}
                            for m in s.volumes]
        if s.ports:
            d["ports"] = list(s.ports)
        services[s.name] = d
    doc: dict[str, Any] = {"name": project.name, "services": services}
    if project.networks:
        doc["networks"] = {n: {k: v for k, v in (("name", f"{project.name}_{n}"), ("internal", net.internal or None))
                               if v is not None} for n, net in project.networks.items()}
    if project.volumes:
        doc["volumes"] = {n: {"name": f"{project.name}_{n}"} for n in project.volumes}
    return doc


# ---- the daemon ----------------------------------------------------------

def _server() -> dict[str, Any]:
    return {"Version": f"24.0.0-nsbox-{__version__}", "ApiVersion": API_VERSION, "Os": "linux", "Arch": ARCH}


def version(rest: list[str]) -> None:
    opts, _ = _options(rest, set(), {"-f", "--format"}, ["version"])
    info = {"Client": {**_server(), "Platform": {"Name": "nsbox docker shim"}},
            "Server": {**_server(), "Platform": {"Name": "nsbox (no daemon)"},
                       "Components": [{"Name": "nsbox", "Version": __version__}]}}
    fmt = opts.get("-f", []) + opts.get("--format", [])
    if fmt:
        _print(info, fmt)
        return
    print(f"Client: nsbox docker shim\n Version: {info['Client']['Version']}\n API version: {API_VERSION}\n\n"
          f"Server: nsbox {__version__} (rootless sandboxes, no daemon)\n OS/Arch: linux/{ARCH}")


def info(rest: list[str]) -> None:
    from ..storage import Store

    opts, _ = _options(rest, set(), {"-f", "--format"}, ["info"])
    data = {"ID": "nsbox", "Images": len(Store().records()), "Containers": 0, "Driver": "overlay (nsbox layers)",
            "OperatingSystem": "nsbox docker shim", "OSType": "linux", "Architecture": platform.machine(),
            "ServerVersion": _server()["Version"], "SecurityOptions": ["name=rootless"], "Name": os.uname().nodename}
    fmt = opts.get("-f", []) + opts.get("--format", [])
    if fmt:
        _print(data, fmt)
        return
    print("\n".join(f"{k}: {v}" for k, v in data.items()))


HANDLERS = {"image-inspect": image_inspect, "images": images, "pull": pull, "build": build, "compose": compose,
            "version": version, "info": info}


# ---- nsbox docker-shim ---------------------------------------------------

@click.group("docker-shim")
def docker_shim() -> None:
    """A `docker` command answering a few Docker CLI calls from nsbox.

    For evaluations whose task code runs `docker compose config` or `docker
    image inspect` while it builds its dataset, on a host with no Docker.
    It answers `docker compose config`, `docker image inspect|ls|pull|build`,
    `docker version` and `docker info`; anything else fails and says so.
    The Docker SDK for Python (a socket client) is not served.
    """


@docker_shim.command("install")
@click.option("--prefix", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Writes PREFIX/bin/docker (put PREFIX/bin on PATH).")
def install_cmd(prefix: Path) -> None:
    """Write the `docker` script (never over another docker)."""
    try:
        target = install(prefix.absolute())
    except NsboxError as e:
        fail(str(e))
    click.echo(target)


@docker_shim.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False,
                                               "help_option_names": []})
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
def run_cmd(argv: tuple[str, ...]) -> None:
    """Answer one docker command line (what the script runs)."""
    run(list(argv))
