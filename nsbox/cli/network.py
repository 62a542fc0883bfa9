"""`nsbox network`: named service networks, which outlive the command that
creates them and which sandboxes of any of your processes join with
`--network net:NAME` (as `docker network create` and `docker run --network`)."""

from __future__ import annotations

import json
import sys

import click

from .. import network as network_mod
from ..errors import NsboxError
from .common import run_async, warn


@click.group()
def network() -> None:
    """Manage named service networks."""


@network.command()
@click.argument("name")
@click.option("--internal", is_flag=True, help="No outbound access (members reach only each other).")
@click.option("--host-access", is_flag=True, help="Members reach the host's loopback as host.nsbox.internal.")
@click.option("--id-mapping", type=click.Choice(["auto", "single"]), default="auto", show_default=True,
              help="The id mapping of the network's members.")
def create(name: str, internal: bool, host_access: bool, id_mapping: str) -> None:
    """Create the network NAME; join sandboxes with `--network net:NAME --hostname HOST`."""
    async def go() -> str:
        net = network_mod.Network(name, internal=internal, host_access=host_access, id_mapping=id_mapping,  # type: ignore[arg-type]
                                  named=True)
        await net.start()
        subnet = str(net._net.subnet)
        await net.close()  # lets go of it: it stays
        return subnet

    try:
        subnet = run_async(go)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    click.echo(name)
    click.echo(f"nsbox: network {name} ({subnet}{', internal' if internal else ''}) runs until "
               f"`nsbox network rm {name}`", err=True)


@network.command("ls")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per network.")
def ls(as_json: bool) -> None:
    """List your named networks and their members."""
    async def go() -> list[dict[str, object]]:
        found = []
        for name in network_mod.named_networks():
            try:
                net = await network_mod.Network.open(name)
            except NsboxError:
                found.append({"name": name, "state": "dead (its process was killed): `nsbox network rm` it"})
                continue
            await net._net.refresh()
            found.append({**net.describe(), "state": "running"})
            await net.close()
        return found

    rows = run_async(go)
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
        return
    click.echo(f"{'NAME':<20} {'SUBNET':<16} {'KIND':<9} MEMBERS")
    for row in rows:
        if row["state"] != "running":
            click.echo(f"{row['name']:<20} {row['state']}")
            continue
        kind = "internal" if row["internal"] else "outbound"
        members = " ".join(f"{n}={ip}" for n, ip in row["members"].items())  # type: ignore[attr-defined]
        click.echo(f"{row['name']:<20} {row['subnet']:<16} {kind:<9} {members}")


@network.command()
@click.argument("names", nargs=-1, required=True)
def rm(names: tuple[str, ...]) -> None:
    """Remove named networks (refused while sandboxes are on them)."""
    failed = False
    for name in names:
        try:
            run_async(_remove, name)
        except (NsboxError, ValueError) as e:
            warn(str(e))
            failed = True
        else:
            click.echo(name)
    sys.exit(1 if failed else 0)


async def _remove(name: str) -> None:
    network_mod.check_network_name(name)
    with network_mod.name_lock(name):
        if await network_mod.is_stale(name):
            network_mod.clear_stale(name)  # its worker was killed: only the socket was left
            return
        net = await network_mod.Network.open(name)
        try:
            await net.remove()
        finally:
            await net.close()
