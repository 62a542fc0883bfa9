"""A sandbox's plan: what its first process does between clone and the exec
of its init, and what the host does meanwhile.

Each concern contributes to the plan on its own (in the style of nsjail's
modules): namespaces to clone, setup steps for the child, and hooks the host
runs between clone and the "go" byte, while the child waits. The id maps
are written there (by the zygote, from the plan's IdMap); attaching a
network or a cgroup belongs there too. Contributors: resources
(nsbox/plan/resources.py: cgroup, rlimits, a sized tmpfs for the writable
layer); mounts (nsbox/plan/mounts.py with rootfs.py: the root filesystem,
binds, /dev, /proc, /tmp; the binds include the GPUs' of gpu.py); procmask
(nsbox/plan/procmask.py: masked and read-only /proc paths); and, below,
the hostname, the network namespace (what the nat and proxy modes and
published ports add is nsbox/plan/netmodes.py), the init's seccomp flags
and a privileged sandbox's /sys.

Steps run in phases, in this order:

- HOST: host paths are looked up, with the invoking user's credentials
  (devices and binds are cloned, layer directories opened);
- the child becomes sandbox root (for real root a subordinate id);
- MOUNT: mounts onto the new root, still before pivot_root;
- pivot_root into the new root;
- INSIDE: every path is inside the sandbox.

The plan is plain data (nsbox/plan/steps.py): it can be built and checked
without the compiled extension.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Awaitable, Callable

from . import steps
from ..errors import SandboxSetupError
from ..host.idmap import IdMap
from .steps import Step

# Host hooks run between clone and go; they get the child's host pid.
ParentHook = Callable[[int], Awaitable[None]]

# Namespaces every sandbox gets; contributors add the others.
MAX_SLOTS = 256  # NSBOX_SLOTS of csrc/common/create.h: mount trees held between two phases
BASE_NAMESPACES = frozenset({"CLONE_NEWUSER", "CLONE_NEWNS", "CLONE_NEWPID", "CLONE_NEWIPC", "CLONE_NEWCGROUP"})


# Host cleanups run once the sandbox's init is gone (removing its cgroups).
Cleanup = Callable[[], None]


@dataclass(frozen=True)
class Writable:
    """A size-capped tmpfs of the sandbox's own (nsbox/plan/resources.py), for a
    memory or disk limit: `path` names it as the child does in the MOUNT
    phase. /tmp, /dev/shm, /run and upper layers kept in memory are
    directories of it, so that together they stay within `size` (each a
    tmpfs of its own would take up to half the host's memory); with
    `layers` (a disk limit) the sandbox's upper layers are there too."""

    path: str
    size: int
    layers: bool = True


class Phase(IntEnum):
    HOST = 0
    MOUNT = 1
    INSIDE = 2


@dataclass
class Plan:
    """Everything the zygote, the child and the host's hooks do for one sandbox."""

    idmap: IdMap
    root: str  # where the child mounts the new root, as it names it
    namespaces: set[str] = field(default_factory=lambda: set(BASE_NAMESPACES))
    hooks: list[ParentHook] = field(default_factory=list)
    # Host work that needs the child's namespaces but not its waiting: it runs
    # alongside the setup steps, and is done before the sandbox is.
    alongside: list[ParentHook] = field(default_factory=list)
    init_args: list[str] = field(default_factory=list)  # nsbox-init's argv after the sandbox id
    cleanups: list[Cleanup] = field(default_factory=list)  # run by the host after the init exits
    writable: Writable | None = None  # where upper layers go, if not in the layer directory
    join: tuple[int, int] | None = None  # user and network namespace to create the sandbox in (network container:ID)
    userns: int | None = None  # a holder's user namespace to create it in (a named service network's)
    sandbox_id: str = ""  # the sandbox's, as its init is told
    _steps: dict[Phase, list[Step]] = field(default_factory=lambda: {p: [] for p in Phase})
    _host_dirs: list[str] = field(default_factory=list)
    _slots: dict[str, int] = field(default_factory=dict)
    _marks: dict[tuple[str, ...], dict[Phase, list[int]]] = field(default_factory=dict, repr=False, compare=False)
    # A lazy copy (replacing(lazy=True)): its template and what replaces the
    # template's marks, until its steps are asked for.
    _source: "tuple[Plan, dict[str, str]] | None" = field(default=None, repr=False, compare=False)
    _packs: dict[object, bytes] = field(default_factory=dict, repr=False, compare=False)  # a template's, see packed()

    def add(self, phase: Phase, *new: Step) -> None:
        self._steps[phase].extend(new)

    def host_dir(self, path: Path | str) -> str:
        """How steps after HOST name a host directory: the child opens it
        (O_PATH) in the HOST phase, with the invoking user's credentials,
        and later steps say /proc/self/fd/N. For real root this matters:
        overlayfs refuses a mounter whose ids are not mapped in its
        namespace, while sandbox root (a subordinate id) may not search
        root's own 0700 directories where the layers live. The options of
        the sandbox's mounts then name no host path either."""
        slot = len(self._host_dirs)
        self._host_dirs.append(os.fspath(path))
        self.add(Phase.HOST, steps.path_fd(os.fspath(path), slot))
        return f"{steps.PROC_FD}/{steps.PATH_FD_BASE + slot}"

    def tmpfs(self, target: str, mode: int, what: str, *, size: int | None = None, readonly: bool = False,
              noexec: bool = False, name: str | None = None, in_root: bool = False) -> None:
        """A tmpfs on `target` inside the sandbox (/tmp, /dev/shm, /run, the
        spec's; an INSIDE step, after `target` is made), nosuid and nodev.
        Under a limit it is a directory of the capped tmpfs (self.writable),
        `name`d there (default: after `target`), taken in the MOUNT phase,
        and `size` is the cap's; else a tmpfs of its own. `in_root`: the
        target is the user's, resolved in the root (steps.IN_ROOT)."""
        if self.writable is None:
            flags = ["MS_NOSUID", "MS_NODEV"] + ["MS_RDONLY"] * readonly + ["MS_NOEXEC"] * noexec
            options = f"mode={mode:o}" + ("" if size is None else f",size={size}")
            self.add(Phase.INSIDE, steps.mount("tmpfs", target, "tmpfs", flags, options, what, in_root=in_root))
            return
        name = name or target.replace("/", "-")
        where = f"{self.writable.path}/tmpfs{name}"
        slot = self.slot(f"tmpfs:{name}")
        self.add(Phase.MOUNT, steps.mkdir(where, mode),
                 steps.tree_clone(where, slot, what, readonly=readonly, noexec=noexec))
        self.add(Phase.INSIDE, steps.tree_attach(slot, target, what, in_root=in_root))

    def slot(self, name: str) -> int:
        """A slot number for a mount tree detached under `name` (a tree
        cloned in one phase and attached in a later one)."""
        if name not in self._slots:
            if len(self._slots) >= MAX_SLOTS:
                raise SandboxSetupError(f"too many binds: a sandbox takes at most {MAX_SLOTS - 16}")
            self._slots[name] = len(self._slots)
        return self._slots[name]

    def steps(self) -> list[Step]:
        """Every step, in the order the child runs them."""
        if self._source is not None:
            template, texts = self._source
            real = template.replacing(texts)
            self._steps, self._host_dirs, self._slots, self._source = real._steps, real._host_dirs, real._slots, None
        return [*self._steps[Phase.HOST], steps.become_root(), *self._steps[Phase.MOUNT],
                steps.pivot(self.root), *self._steps[Phase.INSIDE]]

    def pure(self) -> bool:
        """Whether the plan is data only: no host code to run, no tmpfs for
        the writable layer (whose contents the host looks at)."""
        return not (self.hooks or self.alongside or self.cleanups or self.writable or self.join or self.userns)

    def replacing(self, texts: dict[str, str], lazy: bool = False) -> "Plan":
        """A copy of a pure plan with each key of `texts` replaced by its
        value wherever a step or host directory names it. Lazy: only once
        its steps are asked for (see packed())."""
        assert self.pure()

        def swap(value: str | None) -> str | None:
            if value is None:
                return None
            for old, new in texts.items():
                value = value.replace(old, new)
            return value

        if lazy:
            return Plan(self.idmap, self.root, set(self.namespaces), init_args=list(self.init_args),
                        sandbox_id=swap(self.sandbox_id) or "", _source=(self, texts))

        def step(st: Step) -> Step:
            return dataclasses.replace(st, what=swap(st.what) or "", a=swap(st.a), b=swap(st.b), c=swap(st.c),
                                       d=swap(st.d))

        copy = Plan(self.idmap, self.root, set(self.namespaces), init_args=list(self.init_args),
                    sandbox_id=swap(self.sandbox_id) or "")
        for phase, marked in self._marked_steps(tuple(texts)).items():
            found = copy._steps[phase] = list(self._steps[phase])  # the same Step objects: see zygote._step_row
            for i in marked:
                found[i] = step(found[i])
        copy._host_dirs = [swap(d) or "" for d in self._host_dirs]
        copy._slots = dict(self._slots)
        return copy

    def packed(self, key: object, pack: Callable[["Plan"], bytes]) -> bytes | None:
        """The packed clone request of a lazy copy: its template's, packed once per
        `key` (what else `pack` puts in it) with the marks in it, then each
        mark replaced in the bytes. None where that cannot be done: not a
        lazy copy, or a replacement not as long as its mark (offsets in
        the request would move). Then pack the copy itself.

        Checked once per key: the template packed with other marks of the
        same length must be the same bytes with those marks."""
        if self._source is None:
            return None
        template, texts = self._source
        pairs = [(old.encode(), new.encode()) for old, new in texts.items()]
        if any(len(old) != len(new) for old, new in pairs):
            return None
        blob = template._packs.get(key)
        if blob is None:
            blob = pack(template)
            others = {old: _another_mark(old) for old in texts}
            expected = blob
            for old, other in others.items():
                expected = expected.replace(old.encode(), other.encode())
            if pack(template.replacing(others)) != expected:
                blob = b""  # the marks are not only where they were put: never patch this one
            template._packs[key] = blob
        if not blob:
            return None
        for old, new in pairs:
            blob = blob.replace(old, new)
        return blob

    def _marked_steps(self, texts: tuple[str, ...]) -> dict[Phase, list[int]]:
        """Where in each phase a step names one of `texts` (found once: a
        template is copied for every sandbox, ~60 steps of which ~6 change)."""
        marked = self._marks.get(texts)
        if marked is None:
            marked = self._marks[texts] = {
                phase: [i for i, st in enumerate(found)
                        if any(old in f for f in (st.what, st.a, st.b, st.c, st.d) if f for old in texts)]
                for phase, found in self._steps.items()}
        return marked

    async def run_hooks(self, pid: int) -> None:
        for hook in self.hooks:
            await hook(pid)


def _another_mark(mark: str) -> str:
    """A mark as long as `mark`, with the same first and last character."""
    middle = secrets.token_hex(len(mark))[: len(mark) - 2]
    return mark[0] + middle + mark[-1] if len(mark) >= 2 else mark


def contribute_hostname(plan: Plan, hostname: str) -> None:
    plan.namespaces.add("CLONE_NEWUTS")
    plan.add(Phase.INSIDE, steps.hostname(hostname))


# Namespaces of each kind that a sandbox with nested_userns may hold at once.
NAMESPACES_MAX = 1024
NAMESPACE_KINDS = ("user", "mnt", "net", "pid", "ipc", "uts", "cgroup", "time")


def contribute_seccomp_relaxation(plan: Plan, nested_userns: bool, unfiltered: bool = False) -> None:
    """The init's flags that relax its seccomp filter, if any. Every command
    runs under nsbox's seccomp filter (csrc/init/seccomp.c, set up by the
    init, which needs nothing from the plan for it); nested_userns lets
    commands create namespaces (and mount), for tasks that run a sandbox
    inside the sandbox; `unfiltered` (privileged) installs no filter: the
    user namespace alone confines."""
    if nested_userns:
        plan.init_args.append("--nested-userns")
        # What its commands may create is counted against the host user's
        # quotas too (user.max_user_namespaces...): a bound of its own, in
        # the sandbox's user namespace, keeps one sandbox from using them up.
        for kind in NAMESPACE_KINDS:
            plan.add(Phase.INSIDE, steps.sysctl(f"/proc/sys/user/max_{kind}_namespaces", str(NAMESPACES_MAX),
                                                f"bound the {kind} namespaces the sandbox may create"))
    if unfiltered:
        plan.init_args.append("--no-seccomp")


def contribute_sysfs(plan: Plan, network: str) -> None:
    """/sys for a privileged sandbox. The kernel mounts a sysfs in a user
    namespace only for a network namespace it owns, and only while a fully
    visible one exists (before the host's tree goes: MOUNT phase); it is
    read-write, though what belongs to the host stays read-only to sandbox
    root. Sharing another's network namespace: the host's /sys, read-only.
    Firmware tables and power counters (an energy side channel) stay
    masked, as OCI runtimes mask them, under the same mount lock as /proc's."""
    if network == "host" or network.startswith("container:"):
        slot = plan.slot("/sys")
        plan.add(Phase.HOST, steps.tree_clone("/sys", slot, "take a read-only copy of the host's /sys",
                                              recursive=True, readonly=True, nosuid=True))
        plan.add(Phase.INSIDE, steps.mkdir("/sys", 0o555), steps.tree_attach(slot, "/sys", "attach /sys"))
    else:
        target = f"{plan.root}/sys"
        plan.add(Phase.MOUNT, steps.mkdir(target, 0o555),
                 steps.mount("sysfs", target, "sysfs", ("MS_NOSUID", "MS_NODEV", "MS_NOEXEC"), None,
                             "mount sysfs at /sys"))
    for path in SYS_MASKED:
        if os.path.isdir(path):
            flags = ("MS_RDONLY", "MS_NOSUID", "MS_NODEV", "MS_NOEXEC")
            plan.add(Phase.INSIDE, steps.mount("tmpfs", path, "tmpfs", flags, "mode=555,size=4k",
                                               f"mask {path} with an empty read-only tmpfs"))


SYS_MASKED = ("/sys/firmware", "/sys/devices/virtual/powercap")


def contribute_network(plan: Plan, network: str) -> None:
    """"none": a network namespace of its own with loopback up; "host": the
    host's network namespace. A service network member ("net:NAME") starts
    as "none"; a host hook adds its interface on the network."""
    if network == "host":
        return
    if network.startswith("container:"):
        # Created inside the other sandbox's user namespace (plan.join), in
        # its network namespace, whose loopback is up already.
        plan.namespaces.discard("CLONE_NEWUSER")
        return
    plan.namespaces.add("CLONE_NEWNET")
    plan.add(Phase.INSIDE, steps.loopback_up(plan.idmap.size))
