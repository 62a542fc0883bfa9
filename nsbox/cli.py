"""The nsbox command line."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, NoReturn, Sequence, TypeVar

import anyio
import click

from . import __version__, idmap, manage, registry
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
@click.option("-d", "--detach", is_flag=True,
              help="Keep the sandbox running after nsbox exits (COMMAND, if any, runs in the background).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run(command: tuple[str, ...], timeout: float | None, detach: bool, **options: Any) -> None:
    """Run COMMAND in a fresh sandbox, then destroy it.

    \b
    Examples:
      nsbox run -- python3 -c 'print(42)'
      nsbox run --rootfs ./debian -v "$PWD:/work" -w /work -- make test
      nsbox run --detach -- python3 -m http.server

    Output streams as the command writes it; the exit status is the
    command's (124 on timeout, 125 if nsbox itself failed). With --detach
    the sandbox's id is printed and the sandbox lives on until `nsbox rm`.
    """
    if not command and not detach:
        raise click.UsageError("Missing argument 'COMMAND...' (or use --detach).")
    sandbox = make_sandbox(**options)
    sandbox.origin = "cli"
    if detach:
        async def start() -> str:
            await sandbox.start()
            if command:
                await sandbox.spawn(list(command))
            await sandbox.detach()
            return sandbox.id

        sandbox_id = run_async(start)
        click.echo(sandbox_id)
        click.echo(f"nsbox: sandbox {sandbox_id} keeps running: `nsbox shell {sandbox_id}` to log in, "
                   f"`nsbox rm {sandbox_id}` to remove it", err=True)
        return

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


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("sandbox_id", metavar="ID")
@click.option("-u", "--user", default=None, help="User to run as (default: the sandbox's).")
@click.option("-w", "--workdir", default=None, help="Directory to run in.")
@click.option("-e", "--env", "env", multiple=True, metavar="KEY=VALUE", help="Set an environment variable.")
@click.option("-t", "--timeout", type=float, default=None, help="Kill the command after this many seconds.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def exec(sandbox_id: str, command: tuple[str, ...], user: str | None, workdir: str | None, env: Sequence[str],
         timeout: float | None) -> None:
    """Run COMMAND in the running sandbox ID."""
    if command[:1] == ("--",):  # click keeps "--" once a positional came first
        command = command[1:]
    if not command:
        raise click.UsageError("Missing argument 'COMMAND...'.")
    environment = _parse_env(env)

    async def go() -> int:
        sb = await Sandbox.attach(manage.find(sandbox_id).id)
        try:
            return await sb.run_forwarded(list(command), stdin=0, cwd=workdir, env=environment, user=user,
                                          timeout=timeout)
        finally:
            await sb.close()

    try:
        sys.exit(run_async(go))
    except CommandTimeout as e:
        fail(str(e), EXIT_TIMEOUT)
    except PermissionError as e:
        fail(f"{command[0]}: {e.strerror}", EXIT_CANNOT_RUN)


@main.command()
@click.argument("sandbox_id", metavar="[ID]", required=False)
@sandbox_options
def shell(sandbox_id: str | None, **options: Any) -> None:
    """Log in to the running sandbox ID, or to a fresh one.

    The session runs on a terminal allocated inside the sandbox, with job
    control and window-size changes. A fresh sandbox is destroyed when the
    shell exits; the sandbox options apply only to a fresh one.
    """
    from .shell import interactive

    async def go() -> int:
        if sandbox_id is None:
            sb = make_sandbox(**options)
            sb.origin = "cli"
            async with sb:
                return await interactive(sb)
        sb = await Sandbox.attach(manage.find(sandbox_id).id)
        try:
            user = options["user"] if options["user"] != "root" else None
            return await interactive(sb, user=user)
        finally:
            await sb.close()

    sys.exit(run_async(go))


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


@main.command()
@click.option("-q", "--quiet", is_flag=True, help="Print only the ids.")
def ps(quiet: bool) -> None:
    """List your sandboxes."""
    rows = manage.entries(with_status=not quiet)
    if quiet:
        for e in rows:
            click.echo(e.info.id)
        return
    now = time.time()
    click.echo(f"{'ID':<13} {'STATE':<9} {'OWNER':<8} {'AGE':>5} {'EXECS':>6}  {'ROOTFS':<24} LABEL")
    for e in rows:
        owner = str(e.info.owner_pid) if e.info.owner_alive else "-"
        execs = "-" if e.execs is None else str(e.execs)
        click.echo(f"{e.info.id:<13} {e.state:<9} {owner:<8} {_age(now - e.info.created):>5} {execs:>6}  "
                   f"{e.info.rootfs:<24} {e.info.label}")


@main.command()
@click.argument("sandbox_ids", metavar="[ID]...", nargs=-1)
@click.option("-a", "--all", "all_", is_flag=True, help="Remove every sandbox.")
@click.option("-f", "--force", is_flag=True, help="Also remove sandboxes a running process still owns.")
def rm(sandbox_ids: tuple[str, ...], all_: bool, force: bool) -> None:
    """Remove sandboxes: kill their processes, delete their writable layers."""
    if not sandbox_ids and not all_:
        raise click.UsageError("give sandbox ids, or --all")
    infos = registry.entries() if all_ else [manage.find(i) for i in sandbox_ids]
    failed = False
    for info in infos:
        try:
            manage.remove(info, force=force)
            click.echo(info.id)
        except NsboxError as e:
            click.echo(f"nsbox: {e}", err=True)
            failed = True
    sys.exit(1 if failed else 0)


@main.command()
@click.option("-n", "--dry-run", is_flag=True, help="Only show what would be removed.")
def gc(dry_run: bool) -> None:
    """Remove leftovers: sandboxes whose owner died without detaching them,
    and writable layers no sandbox uses."""
    infos, layers = manage.garbage()
    if not dry_run:
        ids, layers = manage.gc(idmap.detect())
    else:
        ids = [i.id for i in infos]
    verb = "would remove" if dry_run else "removed"
    for i in ids:
        click.echo(f"{verb} sandbox {i}")
    for layer in layers:
        click.echo(f"{verb} layer {layer}")
    if not ids and not layers:
        click.echo("nothing to remove")
