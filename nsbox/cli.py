"""The nsbox command line."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable, NoReturn, Sequence, TypeVar

import anyio
import click

from . import __version__
from .errors import CommandTimeout, NsboxError
from .rootfs import Bind
from .sandbox import Sandbox

T = TypeVar("T")
# Exit statuses of `nsbox run` for failures of nsbox itself (as docker run).
EXIT_NSBOX, EXIT_CANNOT_RUN, EXIT_NOT_FOUND, EXIT_TIMEOUT = 125, 126, 127, 124


def fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"nsbox: {message}", err=True)
    sys.exit(code)


def run_async(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    try:
        return anyio.run(fn, *args)
    except KeyboardInterrupt:
        fail("interrupted", 130)


def _parse_env(values: Sequence[str]) -> dict[str, str]:
    env = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--env")
        env[key] = value
    return env


def _parse_binds(values: Sequence[str]) -> list[Bind]:
    try:
        return [Bind.parse(v) for v in values]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--volume") from None


def sandbox_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The options that describe a sandbox, shared by the commands that make one."""
    options = [
        click.option("--rootfs", default="host", show_default=True, metavar="DIR",
                     help="Root filesystem: 'host' (composed from this host) or a directory."),
        click.option("-u", "--user", default="root", show_default=True, help="User to run as."),
        click.option("-w", "--workdir", default=None, help="Working directory (default: the user's home)."),
        click.option("-e", "--env", "env", multiple=True, metavar="KEY=VALUE", help="Set an environment variable."),
        click.option("-v", "--volume", "volumes", multiple=True, metavar="SRC:DST[:ro]",
                     help="Bind a host file or directory into the sandbox."),
        click.option("--network", type=click.Choice(["none", "host"]), default="none", show_default=True,
                     help="'none': loopback only; 'host': the host's network."),
        click.option("--id-mapping", type=click.Choice(["auto", "single"]), default="auto", show_default=True,
                     help="'single' maps only your own uid, even when subordinate ids exist."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def make_sandbox(rootfs: str, user: str, workdir: str | None, env: Sequence[str], volumes: Sequence[str],
                 network: str, id_mapping: str) -> Sandbox:
    try:
        return Sandbox(rootfs, user=user, workdir=workdir, env=_parse_env(env), mounts=_parse_binds(volumes),
                       network=network, id_mapping=id_mapping)  # type: ignore[arg-type]
    except ValueError as e:
        raise click.UsageError(str(e)) from None


class Group(click.Group):
    """Turns nsbox errors from any command into a message and an exit status."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except NsboxError as e:
            fail(str(e), EXIT_NSBOX if ctx.invoked_subcommand == "run" else 1)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="nsbox")
def main() -> None:
    """Rootless sandboxes on Linux namespaces: no daemon, no root, no setuid."""


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@sandbox_options
@click.option("-t", "--timeout", type=float, default=None, help="Kill the command after this many seconds.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(command: tuple[str, ...], timeout: float | None, **options: Any) -> None:
    """Run COMMAND in a fresh sandbox, then destroy it.

    \b
    Examples:
      nsbox run -- python3 -c 'print(42)'
      nsbox run --rootfs ./debian -v "$PWD:/work" -w /work -- make test

    Output streams as the command writes it; the exit status is the
    command's (124 on timeout, 125 if nsbox itself failed).
    """
    sandbox = make_sandbox(**options)

    async def go() -> int:
        async with sandbox:
            return await sandbox.run_forwarded(list(command), stdin=0, timeout=timeout)

    try:
        code = run_async(go)
    except CommandTimeout as e:
        fail(str(e), EXIT_TIMEOUT)
    except PermissionError as e:
        fail(f"{command[0]}: {e.strerror}", EXIT_CANNOT_RUN)
    sys.exit(code)


@main.command("import")
@click.argument("tarball", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--id-mapping", type=click.Choice(["auto", "single"]), default="auto", show_default=True)
def import_(tarball: Path, directory: Path, id_mapping: str) -> None:
    """Unpack a root filesystem TARBALL into DIRECTORY, for --rootfs.

    The files are owned by ids mapped into your sandboxes, so sandboxes can
    modify them (in their private layers). The archive is unpacked inside a
    sandbox that can write nowhere else.
    """
    from .images import import_tarball

    def progress(msg: str) -> None:
        click.echo(f"nsbox: {msg}", err=True)

    dest = run_async(import_tarball, tarball, directory, id_mapping, progress)
    click.echo(os.fspath(dest))
