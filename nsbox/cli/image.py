"""`nsbox image ...`: pull, import, ls, inspect, rm, prune.

The main CLI adds it with `main.add_command(image)`.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click

from ..errors import NsboxError
from ..storage.applytar import shown
from ..storage.progress import Progress
from ..storage.store import Store
from .common import fail, run_async

T = TypeVar("T")


def _run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """run_async, with nsbox's errors as one line here too: `docker pull`
    of the docker shim runs pull_cmd outside nsbox's command group."""
    try:
        return run_async(fn, *args)
    except NsboxError as e:
        fail(str(e))


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def _age(t: float) -> str:
    s = time.time() - t
    for unit, secs in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if s >= secs:
            return f"{int(s // secs)} {unit} ago"
    return "just now"


id_mapping_option = click.option("--id-mapping", type=click.Choice(["auto", "single"]), default="auto",
                                  show_default=True, help="Unpack the layers for this id mapping.")
platform_option = click.option("--platform", metavar="OS/ARCH[/VARIANT]", default=None,
                               help="Which image of a multi-platform index (default: this machine's).")


@click.group("image")
def image() -> None:
    """Manage images: OCI and Docker images, pulled or imported, run without Docker."""


@image.command("pull")
@platform_option
@id_mapping_option
@click.option("-q", "--quiet", is_flag=True, help="No progress display.")
@click.argument("ref")
def pull_cmd(ref: str, platform: str | None, id_mapping: str, quiet: bool) -> None:
    """Pull REF (e.g. python:3.12, ghcr.io/o/r@sha256:...) from its registry.

    Registries on loopback use plain HTTP. NSBOX_REGISTRY_MIRROR sets a
    docker.io mirror; NSBOX_INSECURE_REGISTRIES lists registries without
    verified TLS. Credentials come from podman's and Docker's auth files.
    """
    from ..sandbox import confined
    from ..storage.registry import pull

    progress = Progress(sys.stderr, bar=False if quiet else None)

    async def go() -> None:
        img = await pull(Store(runner=confined), ref, platform=platform, progress=progress,
                         id_mapping=id_mapping)  # type: ignore[arg-type]
        click.echo(f"{img.name} {img.id[7:19]} ({len(img.layers)} layers)")
    _run(go)


@image.command("import")
@click.option("--name", default=None, help="Name the imported image (e.g. myimage:1).")
@click.option("--tag", default=None, help="Which image of an archive or layout holding several.")
@platform_option
@id_mapping_option
@click.argument("source", type=click.Path(exists=True))
def import_cmd(source: str, name: str | None, tag: str | None, platform: str | None, id_mapping: str) -> None:
    """Import SOURCE: a docker/podman save archive, an OCI layout directory or
    oci-archive, a rootfs tarball (.tar, .tar.gz, .tar.zst) or a directory."""
    from ..sandbox import confined
    from ..storage.archive import import_image

    async def go() -> None:
        img = await import_image(Store(runner=confined), source, name=name, tag=tag, platform=platform,
                                 id_mapping=id_mapping, progress=Progress(sys.stderr))  # type: ignore[arg-type]
        click.echo(f"{img.name} {img.id[7:19]} ({len(img.layers)} layers)")
    _run(go)


@image.command("ls")
@click.option("--json", "as_json", is_flag=True, help="One JSON array.")
def ls_cmd(as_json: bool) -> None:
    """List stored images."""
    records = sorted(Store().records().values(), key=lambda r: r.name)
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in records], indent=2))
        return
    rows = [("NAME", "IMAGE ID", "PLATFORM", "SIZE", "STORED")]
    # The platform is the image config's: its author's text, escaped for the terminal.
    rows += [(r.name, r.id[7:19], shown(r.platform), _size(r.size), _age(r.created)) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


@image.command("inspect")
@click.option("--json", "as_json", is_flag=True, help="Everything, as JSON.")
@click.argument("ref")
def inspect_cmd(ref: str, as_json: bool) -> None:
    """Show an image: names, digest, config (Env, WorkingDir, User, ...), layers."""
    try:
        info = Store().inspect(ref)
    except NsboxError as e:
        fail(str(e))
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    # What comes from the image config is its author's text: escaped for the terminal.
    cfg = info["config"]
    click.echo(f"names:      {', '.join(info['names'])}")
    click.echo(f"id:         {info['id']}\ndigest:     {info['digest']}\nplatform:   {shown(info['platform'])}")
    for label, key in (("user", "User"), ("workdir", "WorkingDir"), ("entrypoint", "Entrypoint"), ("cmd", "Cmd")):
        if cfg.get(key):
            click.echo(f"{label + ':':<11} {shown(str(cfg[key]))}")
    for item in cfg.get("Env") or []:
        click.echo(f"env:        {shown(item)}")
    click.echo(f"layers:     {len(info['layers'])}, {_size(info['size'])} compressed")


@image.command("rm")
@click.argument("refs", nargs=-1, required=True)
def rm_cmd(refs: tuple[str, ...]) -> None:
    """Remove image names (by id: all its names), then prune what nothing uses."""
    async def go() -> None:
        store = Store()
        for ref in refs:
            for name in await store.remove(ref):
                click.echo(f"untagged {name}")
        r = await store.prune()
        click.echo(f"deleted {r.layers} layers and {r.blobs} blobs, {_size(r.bytes)}")
    _run(go)


@image.command("prune")
def prune_cmd() -> None:
    """Delete layers and blobs that no named image and no live sandbox uses."""
    async def go() -> None:
        r = await Store().prune()
        click.echo(f"deleted {r.layers} layers and {r.blobs} blobs, {_size(r.bytes)}")
    _run(go)
