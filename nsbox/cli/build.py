"""`nsbox build`: the command line of nsbox.dockerfile."""

from __future__ import annotations

import sys
from typing import Any

import click

from .common import run_async


@click.command("build")
@click.option("-t", "--tag", "tags", multiple=True, required=True, metavar="NAME[:TAG]",
              help="Name the image (repeat for several names).")
@click.option("-f", "--file", "dockerfile", default=None, metavar="FILE",
              help="The Dockerfile (default: CONTEXT/Dockerfile).")
@click.option("--build-arg", "build_args", multiple=True, metavar="KEY=VALUE", help="Set a build argument (ARG).")
@click.option("--target", default=None, metavar="STAGE", help="Build this stage (and what it needs) only.")
@click.option("--platform", default=None, metavar="OS/ARCH", help="Platform of the base images (default: this host's).")
@click.option("--pull", type=click.Choice(["missing", "always", "never"]), default="missing", show_default=True,
              help="When to pull base images.")
@click.option("--no-cache", is_flag=True, help="Run every step, even when the cache has its result.")
@click.option("--network", type=click.Choice(["nat", "host", "none"]), default=None,
              help="Network of RUN steps (default: nat where it works, else none; host only when given).")
@click.option("-q", "--quiet", is_flag=True, help="Print only the image id.")
@click.argument("context", type=click.Path(exists=True, file_okay=False))
def build(tags: tuple[str, ...], dockerfile: str | None, build_args: tuple[str, ...], context: str,
          quiet: bool, **options: Any) -> None:
    """Build an image from a Dockerfile, rootless, into nsbox's image store.

    \b
    Examples:
      nsbox build -t app:1 .
      nsbox build -t app:dev -f docker/Dockerfile --build-arg VERSION=2 --target test .
      nsbox run --image app:1

    RUN steps run in nsbox sandboxes; their changes, and what COPY and ADD
    add, become layers. Unchanged steps come from the cache (CACHED).
    """
    from ..dockerfile import build_image

    args = {}
    for item in build_args:
        key, sep, value = item.partition("=")
        if not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--build-arg")
        if not sep:  # `--build-arg KEY`: the value from this environment, as Docker does
            import os
            if key not in os.environ:
                continue
            value = os.environ[key]
        args[key] = value

    async def go() -> str:
        result = await build_image(context, dockerfile=dockerfile, tag=list(tags), build_args=args,
                                   progress=(lambda _text: None) if quiet else sys.stderr, **options)
        return result.id

    click.echo(run_async(go))  # Ctrl-C: one line, not a traceback
