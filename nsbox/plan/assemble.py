"""A sandbox's plan, assembled: the one place the contributors are called,
in order (as nsjail's containProc calls each subsystem's init).

Contributors see the SandboxSpec only through READS: reading any other
field raises, so every field the plan depends on is in READS, and READS
is what the plan-template key (nsbox/plan/templates.py) is made of. Every
other field is in NOT_PLANNED, with the reason the plan does not depend
on it; tests/unit/test_option_schema.py checks that each field is in one
of the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING

from ..host import dirs
from ..host.idmap import IdMap
from . import mounts, procmask, resources
from .plan import (Plan, contribute_hostname, contribute_network, contribute_seccomp_relaxation,
                   contribute_sysfs)
from .rootfs import Rootfs

if TYPE_CHECKING:
    from ..spec import SandboxSpec

# The SandboxSpec fields the contributors read.
READS = ("mounts", "tmpfs", "read_only", "workdir", "network", "nested_userns", "privileged", "memory", "pids_limit", "cpus", "disk",
         "strict_limits")

# The fields the contributors do not read, and why the plan does not depend on them.
NOT_PLANNED = {
    "rootfs": "resolved to Inputs.rootfs, which the key holds",
    "image": "resolved to Inputs.rootfs, which the key holds",
    "pull": "how the image is fetched, not what it is",
    "platform": "chooses the image, resolved to Inputs.rootfs",
    "id_mapping": "resolved to Inputs.idmap, which the key holds",
    "hostname": "in the plan as the sandbox's own value (build's `hostname`; a template's mark)",
    "user": "looked up once the sandbox runs (nsbox/init/users.py)",
    "env": "given to each command, not to the sandbox's setup",
    "allow": "served by the host's proxy once the sandbox runs",
    "ports": "published by the host once the sandbox runs",
    "hosts": "written to /etc/hosts in the layer or by the init",
    "host_loopback": "a setting of the host's network helper",
    "network_aliases": "names on a service network, kept by the host",
    "more_networks": "further interfaces, linked by the network's worker after the clone",
    "gpus": "turned into mounts and env before the plan (nsbox/create/procedure.py, choose)",
    "output_limit_mode": "how the host reads command output",
    "timeout": "how long the host waits for commands",
    "label": "what `nsbox ps` shows",
    "origin": "what `nsbox ps` shows",
}


class UndeclaredField(RuntimeError):
    """A contributor read a SandboxSpec field that READS does not name (a
    RuntimeError, so that getattr's default cannot hide it)."""


class _Reading:
    """The spec as contributors see it: the fields of READS only."""

    def __init__(self, spec: "SandboxSpec") -> None:
        self._spec = spec

    def __getattr__(self, name: str) -> object:
        if name not in READS:
            raise UndeclaredField(f"the plan read SandboxSpec.{name}, which nsbox/plan/assemble.py READS "
                                  "does not name: add it there (it then keys the plan templates)")
        return getattr(self._spec, name)


@dataclass(frozen=True)
class Inputs:
    """What a sandbox's plan is made of, but for its layer, id and hostname."""

    spec: "SandboxSpec"
    rootfs: Rootfs  # the resolved root (an image's layers, a directory, the host's)
    idmap: IdMap
    mount_dir: Path  # layers.mount_point(idmap.host_root)
    rundir: Path  # the sandbox's runtime directory (cgroup records; named only by impure plans)


def build(inputs: Inputs, layer: Path, sandbox_id: str, hostname: str) -> Plan:
    """The plan of one sandbox, every contributor in its order."""
    spec = _Reading(inputs.spec)
    plan = Plan(inputs.idmap, root="", sandbox_id=sandbox_id)
    resources.contribute(plan, resources.ResourceLimits.of(spec), sandbox_id, inputs.rundir, inputs.mount_dir)  # before mounts
    mounts.contribute(plan, inputs.rootfs, layer, inputs.mount_dir, spec.mounts, spec.tmpfs)  # type: ignore[arg-type]
    contribute_hostname(plan, hostname)
    contribute_network(plan, spec.network)  # type: ignore[arg-type]
    contribute_seccomp_relaxation(plan, bool(spec.nested_userns or spec.privileged), unfiltered=bool(spec.privileged))
    if spec.privileged:
        contribute_sysfs(plan, spec.network)  # type: ignore[arg-type]
    procmask.contribute(plan)
    if spec.read_only:  # last: every mount point inside is made by now
        mounts.read_only(plan, inputs.rootfs, spec.workdir, spec.network)  # type: ignore[arg-type]
    return plan


def key(inputs: Inputs) -> tuple[object, ...]:
    """What the plan of `inputs` depends on besides the layer, id and hostname:
    the READS fields, the resolved root and id mapping, the directories the
    plan names (the data dir's, as mount_dir is, and the cache dir's: either
    can move with NSBOX_STATE_DIR or XDG_*), and the host switches the
    contributors read."""
    return (inputs.rootfs, inputs.idmap, inputs.mount_dir, dirs.cache_dir(),
            attrgetter(*READS)(inputs.spec),  # hashable values (a dict here fails loudly)
            procmask.enabled, tuple(procmask.covered()), resources.enabled)

