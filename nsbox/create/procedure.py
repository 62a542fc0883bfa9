"""Creating a sandbox, from choosing its id and hostname to its init
running; and ending what that made.

`choose` picks its id mapping, id and hostname (and adds its GPUs' files to
its spec); once its caller has looked up its service networks, `create`
makes, in order: the sandbox's network attachment
(nsbox/create/netattach.py), its writable layer (nsbox/create/layer.py)
and runtime directory, its plan (a copy of a template where there is one,
nsbox/plan/templates.py: the layer is then prepared while the zygote
clones), and its init (nsbox/create/launch.py), recorded in the live
registry (nsbox/host/live.py) once its pid is known. `teardown` ends all
of it. Both fill in and read the sandbox itself (nsbox.Sandbox, above
create/, seen as a `Member`) as they go, so that whatever fails leaves it
knowing what to end.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import sys
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from ..errors import SandboxSetupError, describe, note_once
from ..host import dirs, idmap, layers, live, removal, stacked
from ..host.idmap import IdMap
from ..init import users
from ..init.client import InitClient
from ..plan import assemble, gpu, netmodes, templates
from ..plan import rootfs as rootfs_mod
from ..spec import SandboxSpec
from . import layer
from .launch import Launched, launch
from .netattach import NetAttachment, ServiceNetwork


class Member(Protocol):
    """The sandbox being made (nsbox.Sandbox): what the procedure reads and
    what it fills in."""

    spec: SandboxSpec
    rootfs: rootfs_mod.Rootfs
    image: Any  # nsbox.storage.Image (above create/), or None
    id: str
    hostname: str
    workdir: str
    idmap: IdMap | None
    _launched: Launched
    _client: InitClient | None
    _layer: Path | None
    _rundir: Path | None
    _network: NetAttachment | None
    _detached: bool

    @property
    def user(self) -> str: ...

    @property
    def pid(self) -> int: ...

    @property
    def origin(self) -> str: ...

    @property
    def label(self) -> str: ...

    def _register(self) -> None: ...


PRIVILEGED_NOTE = ("privileged here means what rootless podman gives: every capability of the sandbox's own user "
                   "namespace, no seccomp filter, nested user namespaces, /sys mounted; never host root")


def choose(sb: Member) -> None:
    """The sandbox's id mapping, id and hostname; the device nodes, driver
    files and environment of its GPUs, as binds and variables of its spec
    (nsbox/plan/gpu.py)."""
    sb.idmap = idmap.detect(sb.spec.id_mapping)  # type: ignore[arg-type]
    if sb.spec.privileged:
        note_once(PRIVILEGED_NOTE)
    sb.id = secrets.token_hex(6)
    sb.hostname = sb.spec.hostname or sb.id
    if sb.spec.gpus is not None:
        setup = gpu.resolve(sb.spec.gpus, host_root=isinstance(sb.rootfs, rootfs_mod.HostRootfs))
        for note in setup.notes:
            note_once(f"gpus: {note}")
        sb.spec = sb.spec.replace(mounts=(*sb.spec.mounts, *setup.binds), env=setup.apply_env(dict(sb.spec.env)))


def plan_inputs(sb: Member) -> assemble.Inputs:
    """What the sandbox's plan is made of (nsbox/plan/assemble.py)."""
    assert sb.idmap is not None and sb._rundir is not None
    return assemble.Inputs(sb.spec, sb.rootfs, sb.idmap, layers.mount_point(sb.idmap.host_root), sb._rundir)


async def create(sb: Member, service_view: netmodes.ServiceNetwork | None,
                 networks: Sequence[tuple[ServiceNetwork, Sequence[str]]]) -> None:
    """Makes the sandbox whose id, hostname and id mapping are chosen, on
    the service `networks` its caller looked up (each with its aliases
    there; `service_view`: one view of them all), up to its init running
    with its network."""
    assert sb.idmap is not None
    sb._network = NetAttachment(sb.spec, service_view, networks, sb.hostname, sb.id, lambda: sb._client)
    sb.spec = sb._network.check()  # nat without a usable tun device: one line, before anything exists
    sb._layer = layer.path(sb.id)
    sb._rundir = dirs.runtime_dir() / sb.id
    sb._rundir.mkdir(mode=0o700)
    await sb._network.reserve()
    prepare_layer = functools.partial(layer.prepare, sb._layer, sb.rootfs, sb.hostname, sb.idmap, sb._network)

    # A plan copied from a template names the layer without looking at
    # it: the layer is then prepared while the zygote clones.
    inputs = plan_inputs(sb)
    plan = templates.copy(inputs, sb.id, sb.hostname)
    prepare_later = plan is not None
    if plan is None:
        prepare_layer()
        plan = templates.build(inputs, sb._layer, sb.id, sb.hostname)
    # Known now or later: record the sandbox while its setup runs.
    sb.workdir = (sb.spec.workdir or users.known_home(sb.user, sb.rootfs.identity_files(),
                                                      rootfs_mod.fresh_image_key(sb.rootfs, sb.spec)) or "")
    sb._network.contribute(plan, sb.idmap, sb._launched)
    try:
        await launch(plan, sb._launched, sandbox_id=sb.id, socket_path=sb._rundir / live.SOCKET,
                     layer=sb._layer, on_cloned=sb._register, before_go=prepare_layer if prepare_later else None)
    finally:
        sb._network.close_plan(plan)
    if sb._launched.exited:
        raise SandboxSetupError("the sandbox's init exited right after starting")
    sb._client = InitClient(os.fspath(sb._rundir / live.SOCKET), sb.id)
    await sb._network.start(sb.pid, sb._launched.pidfd)
    sb._launched.release_pidfd()  # what watches the init holds its own copy


def register(sb: Member, network: str) -> None:
    """Records the sandbox in the live registry (what `nsbox ps`, attach
    and `nsbox rm` read); `network`: its network mode in effect."""
    assert sb.idmap is not None and sb._layer is not None
    live.write(live.SandboxInfo(
        id=sb.id, owner_pid=os.getpid(), owner_start=live.own_start_time(),
        init_pid=sb.pid, init_start=sb._launched.start_time(), rootfs=str(sb.rootfs),
        layer=os.fspath(sb._layer), hostname=sb.hostname, user=sb.user, workdir=sb.workdir,
        idmap=sb.idmap.to_dict(), origin=sb.origin, label=sb.label,
        network=network,
    ))
    if layers := _store_layers(sb):  # a prune from any shell keeps them
        stacked.record(sb.id, sb.pid, sb._launched.start_time(), layers)


def _store_layers(sb: Member) -> tuple[Path, ...]:
    return sb.rootfs.layers if isinstance(sb.rootfs, rootfs_mod.ImageRootfs) else ()


def take_client(sb: Member) -> InitClient | None:
    """The init's client (if it got that far), no longer the sandbox's."""
    client, sb._client = sb._client, None
    return client


async def end_init(launched: Launched, client: InitClient | None, wait: float) -> None:
    """Ends the init, and with it every process of the sandbox; returns
    once it is gone. Through the client's connection where one is open
    (the init kills everything and exits; killed after `wait` seconds if
    not), else by killing it at once: opening a connection to say goodbye
    would cost a descriptor, which a thousand closes at once may not have."""
    polite = _tell_to_end(client)
    if launched.pid:
        await launched.reap(wait if polite else 0)


def _tell_to_end(client: InitClient | None) -> bool:
    """Asks the init to end everything, through the client's connection if
    one is open; whether it was asked (else it is to be killed)."""
    polite = client is not None and client.connected
    if client is not None:
        if polite:
            client.shutdown()
        client.close()
    return polite


async def teardown(sb: Member, client: InitClient | None, wait: float, *, waiting: bool = True) -> None:
    """Ends what creating the sandbox made, as far as it got: its network
    (unless detached), its init (through `client`, taken from the
    sandbox), the plan's cleanups, its layer and runtime directory.
    Without `waiting`, returns once the init is told to end: its exit, and
    all that follows it, are left to the sweeper thread
    (nsbox/host/removal.py), which waits for the init as end_init would."""
    if sb._network is not None and not sb._detached:  # a detached sandbox's ends with this process
        await sb._network.stop()
    launched, after = sb._launched, _after_init(sb)
    if waiting:
        await end_init(launched, client, wait)
        after()
        return
    wait = wait if _tell_to_end(client) else 0

    def finish() -> None:
        try:
            launched.reap_blocking(wait)
            after()
        except Exception as e:
            print(f"nsbox: ending sandbox {sb.id} failed: {describe(e)}", file=sys.stderr)

    removal.release_later(finish, first=True)


def _after_init(sb: Member) -> Callable[[], None]:
    """What is left to do once the sandbox's init is gone: the plan's
    cleanups (its cgroups are empty then), its layer handed to the sweeper,
    its runtime directory and in-use record removed. Taken from the
    sandbox now."""
    cleanups = list(sb._launched.cleanups)
    sb._launched.cleanups.clear()
    sandbox_id, rootfs, mapping = sb.id, sb.rootfs, sb.idmap
    sandbox_layer, sb._layer = sb._layer, None
    rundir, sb._rundir = sb._rundir, None
    store_layers = _store_layers(sb)

    def after() -> None:
        for cleanup in cleanups:
            cleanup()
        if sandbox_layer is not None:  # nothing runs in the sandbox any more
            assert mapping is not None
            # Its runtime entry goes first: until the sweeper has it, only its
            # age keeps `nsbox gc` from taking it for an orphan.
            with contextlib.suppress(OSError):
                os.utime(sandbox_layer, follow_symlinks=False)
            layer.release_later(sandbox_id, sandbox_layer, rootfs, mapping)
        if rundir is not None:
            live.remove_dir(rundir)
            stacked.forget(sandbox_id, store_layers)
    return after
