"""The nsbox command line."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import click

from .. import __version__, manage
from ..host import idmap, live
from ..errors import CommandTimeout, NsboxError
from ..sandbox import Sandbox
from .doctor import doctor
from ..spec import FIELDS, PULL_POLICIES, Bind, SandboxSpec
from .image import image as image_group
from .build import build as build_command
from .network import network as network_group
from .docker_shim import docker_shim as docker_shim_group
from .common import fail, run_async

# Exit statuses of `nsbox run` for failures of nsbox itself (as docker run).
EXIT_NSBOX, EXIT_CANNOT_RUN, EXIT_NOT_FOUND, EXIT_TIMEOUT = 125, 126, 127, 124


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
        click.option("--rootfs", default=SandboxSpec.rootfs, show_default=True, metavar="DIR",
                     help="Root filesystem: 'host' (composed from this host) or a directory."),
        click.option("--image", default=None, metavar="REF",
                     help="Run an OCI/Docker image (pulled if missing) instead of --rootfs."),
        click.option("--pull", type=click.Choice(PULL_POLICIES), default=SandboxSpec.pull,
                     show_default=True, help="When to pull --image."),
        click.option("--platform", default=None, metavar="OS/ARCH", help="Platform of --image (default: this host's)."),
        click.option("-u", "--user", default=None, help="User to run as (default: root; for `shell ID`: the sandbox's)."),
        click.option("-w", "--workdir", default=None,
                     help="Working directory (default: an image's WORKDIR, else /; a root filesystem: "
                          "the user's home)."),
        click.option("-e", "--env", "env", multiple=True, metavar="KEY=VALUE", help="Set an environment variable."),
        click.option("-v", "--volume", "volumes", multiple=True, metavar="SRC:DST[:ro]",
                     help="Bind a host file or directory into the sandbox."),
        click.option("--tmpfs", "tmpfs", multiple=True, metavar="DST[:OPTIONS]",
                     help="Mount an empty tmpfs (noexec unless OPTIONS say exec; OPTIONS: size=SIZE, mode=OCTAL, "
                          "ro, exec)."),
        click.option("--read-only", is_flag=True,
                     help="Make the root filesystem read-only (binds, tmpfs mounts, /tmp and /run stay writable)."),
        click.option("--network", default=SandboxSpec.network, show_default=True,
                     metavar="none|host|nat|proxy|container:ID|net:NAME",
                     help="'none': loopback only; 'host': the host's network; 'nat': outbound access (the host's "
                          "loopback only with --host-loopback); 'proxy': only the hosts --allow names, through a proxy; "
                          "'container:ID': the network of the running sandbox ID; 'net:NAME': a member of the "
                          "network `nsbox network create NAME` made, reached by the others as --hostname."),
        click.option("--hostname", default=None, help="The sandbox's host name (default: its id)."),
        click.option("--network-alias", "network_aliases", multiple=True, metavar="NAME",
                     help="With --network net:NAME: another name the others reach this sandbox by."),
        click.option("--add-host", "add_hosts", multiple=True, metavar="NAME:IP",
                     help="An extra /etc/hosts entry (IP 'host-gateway': the host's loopback, opened for it)."),
        click.option("--host-loopback", is_flag=True,
                     help="With --network nat: the host's loopback (its 127.0.0.1) reachable as "
                          "host.nsbox.internal. Off by default."),
        click.option("-p", "--publish", "publish", multiple=True, metavar="[IP:]HOSTPORT:PORT",
                     help="Publish a TCP port of the sandbox on the host (on 127.0.0.1 unless IP is given)."),
        click.option("--allow", "allow", multiple=True, metavar="HOST",
                     help="With --network proxy: a host the sandbox may reach (example.com, *.example.org, "
                          "host:443, '*')."),
        click.option("--nested-userns", is_flag=True,
                     help="Let commands create user namespaces and mount (to nest sandboxes)."),
        click.option("--privileged", is_flag=True,
                     help="As rootless podman's: nested user namespaces, no seccomp filter, every capability of "
                          "the sandbox's user namespace, a sysfs at /sys; never host root."),
        click.option("--id-mapping", type=click.Choice(idmap.REQUESTS), default=SandboxSpec.id_mapping,
                     show_default=True,
                     help="'single' maps only your own uid, even when subordinate ids exist; "
                          "'host-root' (as root only) maps host root into the sandbox."),
        click.option("-m", "--memory", default=None, metavar="SIZE",
                     help="Memory limit, e.g. 512m or 2g (a process beyond it is killed: exit 137)."),
        click.option("--pids-limit", type=click.IntRange(min=1), default=None, help="Most processes at once."),
        click.option("--cpus", type=click.FloatRange(min=0.01), default=None, help="CPU time, in CPUs (e.g. 1.5)."),
        click.option("--disk", default=None, metavar="SIZE",
                     help="Size cap of the writable layer with /tmp, /dev/shm and /run, e.g. 2g."),
        click.option("--strict-limits", is_flag=True,
                     help="Refuse --memory, --pids-limit or --cpus where no cgroup enforces it (see `nsbox doctor`) "
                          "instead of approximating it."),
        click.option("--gpus", default=None, metavar="all|N|device=ID,...",
                     help="NVIDIA GPUs to pass through (CDI spec, else /dev/nvidia* and the driver's libraries)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _parse_hosts(values: Sequence[str]) -> dict[str, str]:
    hosts = {}
    for item in values:
        name, sep, address = item.partition(":")
        if not sep:
            raise ValueError(f"--add-host takes NAME:IP, not {item!r}")
        hosts[name] = address
    return hosts


# The sandbox options whose parameter is not named as its SandboxSpec field
# (every other one is passed through by name): the parameter, and how its
# values become the field's.
RENAMED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "env": ("env", _parse_env),
    "mounts": ("volumes", lambda values: tuple(_parse_binds(values))),
    "ports": ("publish", tuple),
    "hosts": ("add_hosts", _parse_hosts),
}


def make_sandbox(**options: Any) -> Sandbox:
    """The sandbox the options of sandbox_options describe."""
    fields = {name: value for name, value in options.items() if name in FIELDS and name not in RENAMED}
    unknown = set(options) - FIELDS - {param for param, _ in RENAMED.values()}
    if unknown:
        raise TypeError(f"make_sandbox: unknown options {', '.join(sorted(unknown))}")
    try:
        for name, (param, convert) in RENAMED.items():
            if param in options:
                fields[name] = convert(options[param])
        return Sandbox(spec=SandboxSpec(**fields, origin="cli"))
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
      nsbox run --image python:3.12 -- python3 -V

    Output streams as the command writes it, whole (never truncated, as
    with `nsbox exec`); the exit status is the command's (124 on timeout, 125 if nsbox itself failed). With --detach
    the sandbox's id is printed and the sandbox lives on until `nsbox rm`.
    With --image, COMMAND is run as `docker run` runs it (the image's
    Entrypoint, then COMMAND or else its Cmd).
    """
    if not command and not detach and not options["image"]:
        raise click.UsageError("Missing argument 'COMMAND...' (or use --detach).")
    sandbox = make_sandbox(**options)
    argv: list[str] = list(command)
    if detach:
        async def start() -> str:
            await sandbox.start()
            argv[:] = sandbox.image_command(argv)
            if argv:
                await sandbox.spawn(argv)
            await sandbox.detach()
            return sandbox.id

        sandbox_id = run_async(start)
        click.echo(sandbox_id)
        click.echo(f"nsbox: sandbox {sandbox_id} keeps running: `nsbox shell {sandbox_id}` to log in, "
                   f"`nsbox rm {sandbox_id}` to remove it", err=True)
        return

    async def go() -> int:
        async with sandbox:
            argv[:] = sandbox.image_command(argv)
            if not argv:
                raise NsboxError(f"the image {options['image']} has no Entrypoint or Cmd: give a COMMAND")
            return await sandbox.run_forwarded(argv, stdin=0, timeout=timeout)

    try:
        code = run_async(go)
    except CommandTimeout as e:
        fail(str(e), EXIT_TIMEOUT)
    except PermissionError as e:
        fail(f"{argv[0] if argv else 'command'}: {e.strerror}", EXIT_CANNOT_RUN)
    sys.exit(code)


@main.command("import")
@click.argument("tarball", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--id-mapping", type=click.Choice(["auto", "single", "host-root"]), default="auto", show_default=True)
def import_(tarball: Path, directory: Path, id_mapping: str) -> None:
    """Unpack a root filesystem TARBALL into DIRECTORY, for --rootfs.

    The files are owned by ids mapped into your sandboxes, so sandboxes can
    modify them (in their private layers). The archive is unpacked inside a
    sandbox that can write nowhere else.
    """
    from ..sandbox import confined
    from ..storage.tarball import import_tarball

    def progress(msg: str) -> None:
        click.echo(f"nsbox: {msg}", err=True)

    async def go() -> Path:
        return await import_tarball(tarball, directory, runner=confined, id_mapping=id_mapping,  # type: ignore[arg-type]
                                    progress=progress)

    dest = run_async(go)
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
    """Run COMMAND in the running sandbox ID.

    Output is copied here as the command writes it, whole: the output limit
    (INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE) bounds only output nsbox holds in
    memory (the Python API and the Inspect provider, which report what they
    drop), so `nsbox exec` never truncates and prints no truncation note.
    """
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
            async with sb:
                return await interactive(sb)
        sb = await Sandbox.attach(manage.find(sandbox_id).id)
        try:
            return await interactive(sb, user=options["user"])
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
    targets: list[live.SandboxInfo | str] = [*live.entries()] if all_ else [*sandbox_ids]
    failed = False
    # One at a time: a sandbox that cannot be removed does not keep the others.
    for target in targets:
        try:
            info = manage.find(target) if isinstance(target, str) else target
            manage.remove(info, force=force)
        except Exception as e:
            click.echo(f"nsbox: {manage.failure(target if isinstance(target, str) else target.id, e)}", err=True)
            failed = True
        else:
            click.echo(info.id)
    sys.exit(1 if failed else 0)


@main.command()
@click.option("-n", "--dry-run", is_flag=True, help="Only show what would be removed.")
def gc(dry_run: bool) -> None:
    """Remove leftovers: sandboxes whose owner died without detaching them,
    writable layers no sandbox uses, and compose samples' volumes no one uses."""
    failures: list[str] = []
    if dry_run:
        infos, layers = manage.garbage()
        ids, volumes = [i.id for i in infos], manage.orphan_volumes()
    else:
        report = manage.gc(idmap.detect())
        ids, layers, volumes, failures = report.sandboxes, report.layers, report.volumes, report.failures
    verb = "would remove" if dry_run else "removed"
    for i in ids:
        click.echo(f"{verb} sandbox {i}")
    for layer in layers:
        click.echo(f"{verb} layer {layer}")
    for v in volumes:
        click.echo(f"{verb} volumes {v}")
    for failure in failures:
        click.echo(f"nsbox: {failure}", err=True)
    if not ids and not layers and not volumes and not failures:
        click.echo("nothing to remove")
    sys.exit(1 if failures else 0)


main.add_command(image_group)
main.add_command(doctor)
main.add_command(build_command)  # nsbox/cli/build.py
main.add_command(network_group)  # nsbox/cli/network.py
main.add_command(docker_shim_group)  # nsbox/cli/docker_shim.py
