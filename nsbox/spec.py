"""SandboxSpec: one validated description of a sandbox.

The Python API (Sandbox(...)), the command line, nsbox.yaml and the Inspect
provider all produce one, so each option is declared and checked here, once.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass, field, fields, replace
from typing import Literal, Mapping, Sequence

from .errors import SandboxSetupError
from .host.idmap import REQUESTS

Network = Literal["none", "host", "nat", "proxy"]
OutputLimitMode = Literal["truncate", "raise"]
PullPolicy = Literal["missing", "always", "never"]
PULL_POLICIES = ("missing", "always", "never")
NETWORKS = ("none", "host", "nat", "proxy")
CONTAINER = "container:"  # network "container:ID": join sandbox ID's network namespace
NET = "net:"  # network "net:NAME": this process's service network NAME (nsbox.Network)
HOST_GATEWAY = "host-gateway"  # a `hosts` address: the host's loopback (Docker's --add-host NAME:host-gateway)
NETWORK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SANDBOX_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
OUTPUT_LIMIT_MODES = ("truncate", "raise")
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,62})?")
_ENV_NAME = re.compile(r"[^=\0]+")


# Published ports of one sandbox (or compose sample): each listens on a port
# of the host's, taken from the ephemeral range (28,232 by default) that
# every outgoing connection of the host draws from.
MAX_PORTS = 256
# The largest memory or disk limit a cgroup or tmpfs takes (a signed 64-bit
# count of bytes), and the kernel's most processes (PID_MAX_LIMIT).
_BYTES_MAX = 2**63 - 1
_PIDS_MAX = 4 * 1024 * 1024
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)i?b?\s*", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: str | int | float, name: str = "size") -> int:
    """Bytes, from a number or a size as Docker writes it: "512m", "2g",
    "0.5gb", "1.5GiB", "100k", "4096" (units of 1024; b, k, m, g, t)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a size such as 512m or 2g, not {value!r}")
    if isinstance(value, (int, float)):
        size = int(value)
    else:
        m = _SIZE.fullmatch(str(value))
        if m is None:
            raise ValueError(f"{name} must be a size such as 512m or 2g, not {value!r}")
        size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size <= 0:
        raise ValueError(f"{name} must be positive, not {value!r}")
    return size


def check_target(kind: str, target: str) -> None:
    """A mount point: absolute, below /, normalized (ValueError otherwise)."""
    if not posixpath.isabs(target) or posixpath.normpath(target) in ("/", "//"):
        raise ValueError(f"{kind} target must be an absolute path below /, not {target!r}")
    if posixpath.normpath(target) != target.rstrip("/") or "\0" in target:
        raise ValueError(f"{kind} target must be a normalized path, not {target!r}")


@dataclass(frozen=True)
class Restart:
    """A restart policy for a command: Docker's `--restart` and compose's
    `restart`. The sandbox's init starts the command again when it exits
    (with `on_failure`, only after a non-zero status), at most `limit`
    times (None: no limit), after Docker's waits: 100 ms, doubled at each
    restart up to one minute, back to 100 ms after a run of 10 s."""

    on_failure: bool = False
    limit: int | None = None

    # The most restarts the init counts (a uint32 on the wire).
    MAX_LIMIT = 2**32 - 1

    def __post_init__(self) -> None:
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int)
                                       or not 1 <= self.limit <= self.MAX_LIMIT):
            raise ValueError(f"a restart limit must be a whole number from 1, not {self.limit!r}")

    @classmethod
    def parse(cls, policy: str) -> "Restart | None":
        """Docker's policy names: "no" (None), "always", "unless-stopped"
        (the same here: nothing stops a service but its sandbox's end),
        "on-failure" and "on-failure:N"."""
        name, colon, count = str(policy).partition(":")
        if name in ("no", "always", "unless-stopped") and not colon:
            return None if name == "no" else cls()
        if name == "on-failure":
            if not colon:
                return cls(on_failure=True)
            if count.isdigit() and count.isascii():
                # Docker: on-failure:0 is on-failure with no limit.
                return cls(on_failure=True, limit=int(count) or None)
        raise ValueError(f"restart policy must be no, always, unless-stopped, on-failure or on-failure:N, "
                         f"not {policy!r}")


@dataclass(frozen=True)
class Bind:
    """A host file or directory made visible inside the sandbox at `target`."""

    source: str  # resolved when made: no symlink in it (see __post_init__)
    target: str
    readonly: bool = False

    def __post_init__(self) -> None:
        check_target("bind", self.target)
        # Resolved now: the sandbox is then made from this path with no
        # symlink followed, so one swapped in since (by a sandbox writing
        # where the source lies) fails its creation instead of leading
        # elsewhere (nsbox/plan/mounts.py).
        object.__setattr__(self, "source", os.path.realpath(self.source))
        if not os.path.exists(self.source):
            raise SandboxSetupError(f"bind source {self.source} does not exist")

    @classmethod
    def exact(cls, source: str, target: str, readonly: bool = False) -> "Bind":
        """A Bind of `source` as it was resolved and checked before (a
        compose or nsbox.yaml file's host path, for every sample): one that
        resolves elsewhere now, a symlink put in it since by a sandbox
        writing there, is refused rather than resolved again."""
        bind = cls(source, target, readonly)
        if bind.source != os.path.abspath(source):
            raise SandboxSetupError(f"bind source {source} now leads to {bind.source}: a symlink was put in it "
                                    "since it was checked, and is not followed")
        return bind

    @classmethod
    def parse(cls, spec: str, *, exact: bool = False) -> "Bind":
        """SOURCE:TARGET[:ro|:rw], as in `nsbox run -v`; with `exact`, a
        SOURCE resolved before (see Bind.exact)."""
        parts = spec.split(":")
        mode = "rw"
        if len(parts) == 3 and parts[2] in ("ro", "rw"):
            mode = parts.pop()
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise ValueError(f"expected SOURCE:TARGET[:ro], got {spec!r}")
        make = cls.exact if exact else cls
        return make(os.path.abspath(os.path.expanduser(parts[0])), parts[1], readonly=mode == "ro")


@dataclass(frozen=True)
class Tmpfs:
    """An empty tmpfs mounted at `target` (Docker's and podman's --tmpfs): its
    files are memory, gone with the sandbox. As there, it is writable and
    noexec unless `readonly` or `noexec=False` say otherwise, and always
    nosuid and nodev. `size` caps it in bytes (default: the kernel's, half
    the host's memory); `mode` is its root directory's. Under a `memory`
    or `disk` limit it is a directory of the limit's one tmpfs instead
    (nsbox/plan/resources.py), so the limit caps it together with /tmp,
    /dev/shm and /run, and `size` is not applied on its own."""

    target: str
    size: int | None = None
    mode: int = 0o1777
    readonly: bool = False
    noexec: bool = True

    # The options `parse` takes; nosuid and nodev are always set.
    OPTIONS = "size=SIZE, mode=OCTAL, ro, rw, exec, noexec, nosuid, nodev"

    def __post_init__(self) -> None:
        check_target("tmpfs", self.target)
        if self.size is not None:
            object.__setattr__(self, "size", parse_size(self.size, "tmpfs size"))
        if isinstance(self.mode, bool) or not isinstance(self.mode, int) or not 0 <= self.mode <= 0o7777:
            raise ValueError(f"tmpfs mode must be octal permissions such as 1777, not {self.mode!r}")

    @classmethod
    def parse(cls, spec: str) -> "Tmpfs":
        """TARGET[:OPTIONS], as in `nsbox run --tmpfs` and Docker's: OPTIONS
        are comma-separated, of Tmpfs.OPTIONS."""
        target, fields, others = cls.split(spec)
        if others:
            raise ValueError(f"tmpfs option {others[0]!r} is not supported (nsbox takes {cls.OPTIONS}; "
                             "every tmpfs is nosuid and nodev)")
        return cls(target, **fields)  # type: ignore[arg-type]

    @staticmethod
    def split(spec: str) -> tuple[str, dict[str, object], list[str]]:
        """TARGET[:OPTIONS] as the target, the fields its options of
        Tmpfs.OPTIONS set (size as given, mode read as octal), and the
        options it has beyond them (a compose file's uid=, nr_inodes=...)."""
        target, _, options = spec.partition(":")
        fields: dict[str, object] = {}
        others = []
        for option in filter(None, options.split(",")):
            name, eq, value = option.partition("=")
            if name == "size" and eq:
                fields["size"] = value
            elif name == "mode" and eq:
                try:
                    fields["mode"] = int(value, 8)
                except ValueError:
                    raise ValueError(f"tmpfs mode must be octal permissions such as 1777, not {value!r}") from None
            elif option in ("ro", "rw"):
                fields["readonly"] = option == "ro"
            elif option in ("exec", "noexec"):
                fields["noexec"] = option == "noexec"
            elif option not in ("nosuid", "nodev"):
                others.append(option)
        return target, fields, others


# GPU requests (nsbox/plan/gpu.py turns them into binds and environment).
_GPU_COUNT = re.compile(r"[1-9][0-9]{0,3}")
GPUS_USAGE = "gpus must be 'all', a number of GPUs, or device=ID[,ID...]"


def normalize_gpus(value: object) -> str | None:
    """A `gpus` request in one form: None, "all", "N" or "device=ID,ID"."""
    if value is None or value == "" or value is False:
        return None
    if value is True or value == -1 or value == "-1":
        return "all"
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{GPUS_USAGE}, not {value!r}")
        return str(value)
    if not isinstance(value, str):
        raise ValueError(f"{GPUS_USAGE}, not {value!r}")
    text = value.strip().strip('"').strip("'")
    if text.startswith("count="):
        text = text[len("count="):]
    if text == "all" or _GPU_COUNT.fullmatch(text):
        return text
    if text.startswith("device="):
        ids = [i.strip() for i in text[len("device="):].split(",")]
        if ids and all(re.fullmatch(r"[A-Za-z0-9_./=:-]+", i) for i in ids):
            return "device=" + ",".join(ids)
    raise ValueError(f"{GPUS_USAGE}, not {value!r}")


def _check_network(spec: "SandboxSpec") -> None:
    from .net.ports import PortSpec
    from .net.proxy import Allowlist

    for name in ("allow", "ports", "network_aliases"):
        value = getattr(spec, name)
        if isinstance(value, str):
            value = (value,)
        object.__setattr__(spec, name, tuple(value))
    if spec.network.startswith(NET) and not NETWORK_NAME.fullmatch(spec.network[len(NET):]):
        raise ValueError(f"network {spec.network!r}: expected net:NAME, the name of an nsbox.Network")
    if spec.network.startswith(CONTAINER):
        if not _SANDBOX_ID.fullmatch(spec.network[len(CONTAINER):]):
            raise ValueError(f"network {spec.network!r}: expected container:ID, the id of a running sandbox")
        if spec.ports:
            raise ValueError("ports cannot be published by a sandbox that joins another's network: "
                             "publish them on that sandbox")
    from .net.hosts import check_address, check_name

    hosts = {}
    for name, address in dict(spec.hosts).items():
        # HOST_GATEWAY (Docker's "host-gateway"): the host's loopback, which
        # the entry also asks nat to open (nothing else opens it).
        hosts[check_name(name)] = HOST_GATEWAY if address == HOST_GATEWAY else check_address(address)
    object.__setattr__(spec, "hosts", hosts)
    if spec.host_loopback and spec.network not in ("nat", "host") and not spec.network.startswith(CONTAINER):
        raise ValueError(f"host_loopback applies to the nat network mode, not to {spec.network!r}"
                         + (" (a service network opens it with host_access)" if spec.network.startswith(NET) else ""))
    for alias in spec.network_aliases:
        check_name(alias)
    if spec.network_aliases and not spec.network.startswith(NET):
        raise ValueError("network_aliases apply to a service network (net:NAME), not to "
                         f"{spec.network!r}")
    more = {}
    for net, aliases in dict(spec.more_networks).items():
        value = net if isinstance(net, str) else net.spec_value  # an nsbox.Network
        if not value.startswith(NET) or not NETWORK_NAME.fullmatch(value[len(NET):]) or value == spec.network:
            raise ValueError(f"more_networks: {value!r} is not another service network (net:NAME)")
        more[value] = tuple(check_name(a) for a in ((aliases,) if isinstance(aliases, str) else aliases))
    if more and not spec.network.startswith(NET):
        raise ValueError(f"more_networks apply to a sandbox on a service network, not to {spec.network!r}")
    object.__setattr__(spec, "more_networks", more)
    if spec.allow and spec.network != "proxy":
        raise ValueError(f"allow applies to the proxy network mode, not to {spec.network!r}")
    Allowlist(spec.allow)  # raises ValueError naming a bad entry
    if len(spec.ports) > MAX_PORTS:
        raise ValueError(f"at most {MAX_PORTS} ports may be published by one sandbox, not {len(spec.ports)}: each "
                         "takes a port of the host's, from the range every outgoing connection of the host uses")
    ports = tuple(str(PortSpec.parse(p)) for p in spec.ports)
    if ports and spec.network == "host":
        raise ValueError("ports cannot be published with network 'host': the sandbox already uses the host's ports")
    object.__setattr__(spec, "ports", ports)


def _choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, not {value!r}")


@dataclass(frozen=True)
class SandboxSpec:
    """What a sandbox is made of and how its commands run.

    rootfs: "host" (the built-in root composed from this host) or a
        directory holding a root filesystem.
    image: an OCI or Docker image instead (a reference such as
        "python:3.12", or the name an import gave it); pulled if missing
        (`pull`: "missing", "always" or "never"), for `platform` if given.
        Its Env, WorkingDir and User apply unless the settings here say
        otherwise.
    user: the default user of exec, read_file and write_file (default:
        the image's USER, else root).
    workdir: the working directory (absolute); relative paths resolve
        against it. Default: the image's WorkingDir, else the user's home
        directory (created if missing).
    env: environment variables of every command (over the image's).
    network: "none" (a network namespace with loopback only), "host",
        "nat" (outbound through pasta or slirp4netns; the host's loopback
        only with host_loopback) or "proxy" (loopback only, plus an HTTP and
        SOCKS5 proxy that lets through only the hosts `allow` names), or
        an nsbox.Network (or "net:NAME") to join that service network, or
        "container:ID" to share the network namespace of the running
        sandbox ID (Docker's --network container:ID; both must have the
        same owner and id mapping): the two reach each other on 127.0.0.1,
        as the containers of a pod do.
    hosts: extra /etc/hosts entries, name -> address (Docker's --add-host);
        the address "host-gateway" is the host's loopback, and asks for it
        as host_loopback does.
    host_loopback: in nat mode, make the host's loopback (its 127.0.0.1)
        reachable as host.nsbox.internal (10.0.2.2). Off by default: any
        unauthenticated service the host's users bind to 127.0.0.1 would be
        open to the sandbox.
    allow: the proxy mode's allowlist ("example.com", "*.example.org",
        "host:443", an IP address, "*").
    ports: published ports, "[ADDRESS:]HOSTPORT:PORT" (ADDRESS defaults to
        127.0.0.1), as Docker's -p.
    hostname: default: the sandbox's id.
    network_aliases: other names the sandbox answers to on its service
        network (Docker's --network-alias).
    more_networks: further service networks to join besides `network`
        (which must be one), each with the aliases the sandbox has there:
        {nsbox.Network or "net:NAME": (alias, ...)}; interfaces eth1,
        eth2... in this order. Networks of this process only, not named
        ones. Outbound traffic goes through `network` alone.
    mounts: host files or directories bound into the sandbox.
    tmpfs: empty tmpfs mounts (Tmpfs, or "TARGET[:OPTIONS]" as Docker's
        --tmpfs), noexec unless they say exec; under a memory or disk limit
        they share the limit's tmpfs.
    read_only: the root filesystem read-only (Docker's --read-only): binds,
        tmpfs mounts, /dev, /dev/shm and the host-composed root's /tmp and
        /run stay writable, and so do the /etc files nsbox keeps (hosts;
        resolv.conf in nat mode); `workdir` is made before, where missing.
    id_mapping: "auto", "single" or "host-root" (see nsbox/host/idmap.py).
    nested_userns: let commands create user namespaces and mount (to run
        a sandbox inside); denied by default, as in Docker.
    privileged: what rootless podman's --privileged means: nested_userns,
        no seccomp filter at all, every capability of the sandbox's own user
        namespace, a sysfs at /sys; never host root (id_mapping stays as set).
    output_limit_mode: "truncate" keeps the last bytes of a long output
        stream; "raise" raises OutputLimitExceeded.
    timeout: default exec timeout in seconds (None: none).
    memory: memory limit of the whole sandbox, in bytes or as "512m", "2g"
        (Docker's --memory); a process that exceeds it is killed (exit 137).
    pids_limit: most processes the sandbox may have at once.
    cpus: CPU time, in CPUs (1.5: one and a half CPUs' worth).
    disk: size cap of the writable layer (with /tmp, /dev/shm and /run), in
        bytes or as "2g".
        Limits are enforced by a cgroup where the host offers one, else
        approximated (see nsbox/plan/resources.py and `nsbox doctor`).
    strict_limits: refuse memory, pids_limit or cpus where no cgroup
        enforces it, instead of approximating it.
    gpus: NVIDIA GPUs to pass through: "all", a number of them, or
        "device=0,1" (indices, UUIDs or CDI names); see nsbox/plan/gpu.py.
    label, origin: what `nsbox ps` shows (origin: "api", "cli", "inspect").
    """

    rootfs: str = "host"
    image: str | None = None
    pull: PullPolicy = "missing"
    platform: str | None = None
    user: str | None = None
    workdir: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    network: Network = "none"
    allow: tuple[str, ...] = ()
    ports: tuple[str, ...] = ()
    hosts: Mapping[str, str] = field(default_factory=dict)
    host_loopback: bool = False
    hostname: str | None = None
    network_aliases: tuple[str, ...] = ()
    more_networks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    mounts: tuple[Bind, ...] = ()
    tmpfs: tuple[Tmpfs, ...] = ()
    read_only: bool = False
    id_mapping: str = "auto"
    nested_userns: bool = False
    privileged: bool = False
    output_limit_mode: OutputLimitMode = "truncate"
    timeout: float | None = None
    memory: int | None = None
    pids_limit: int | None = None
    cpus: float | None = None
    disk: int | None = None
    strict_limits: bool = False
    gpus: str | None = None
    label: str = ""
    origin: str = "api"

    def __post_init__(self) -> None:
        if not isinstance(self.network, str):  # an nsbox.Network
            object.__setattr__(self, "network", self.network.spec_value)
        if not self.network.startswith((CONTAINER, NET)):
            _choice("network", self.network, NETWORKS)
        _check_network(self)
        _choice("output_limit_mode", self.output_limit_mode, OUTPUT_LIMIT_MODES)
        _choice("id_mapping", self.id_mapping, REQUESTS)
        _choice("pull", self.pull, PULL_POLICIES)
        if self.user == "":
            raise ValueError("user must not be empty")
        if self.image is not None and str(self.rootfs or "host") != "host":
            raise ValueError("give either rootfs or image, not both")
        if self.image == "":
            raise ValueError("image must not be empty")
        if self.workdir is not None and not posixpath.isabs(self.workdir):
            raise ValueError(f"workdir must be an absolute path inside the sandbox, not {self.workdir!r}")
        if self.hostname is not None and not _HOSTNAME.fullmatch(self.hostname):
            raise ValueError(f"hostname must be 1-64 letters, digits, '.' or '-', not {self.hostname!r}")
        if not isinstance(self.env, Mapping):
            raise ValueError(f"env must be a mapping of names to values, not {self.env!r}")
        for name, value in self.env.items():
            if not isinstance(name, str) or not _ENV_NAME.fullmatch(name) or "\0" in str(value):
                raise ValueError(f"invalid environment variable {name!r}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"timeout must be positive, not {self.timeout!r}")
        # Frozen: normalise through object.__setattr__.
        for name in ("memory", "disk"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, parse_size(value, name))  # type: ignore[arg-type]
        if self.memory is not None and self.memory < 6 << 20:
            raise ValueError(f"memory must be at least 6m (as in Docker), not {self.memory}")
        for name in ("memory", "disk"):  # what a cgroup or a tmpfs takes
            if (getattr(self, name) or 0) > _BYTES_MAX:
                raise ValueError(f"{name} must be at most {_BYTES_MAX} bytes (8 EiB), not {getattr(self, name)}")
        if self.pids_limit is not None:
            if isinstance(self.pids_limit, bool) or int(self.pids_limit) != self.pids_limit or self.pids_limit < 1:
                raise ValueError(f"pids_limit must be a positive whole number, not {self.pids_limit!r}")
            if self.pids_limit < 2:
                raise ValueError("pids_limit must be at least 2 (the sandbox's init takes one)")
            if self.pids_limit > _PIDS_MAX:
                raise ValueError(f"pids_limit must be at most {_PIDS_MAX} (the kernel's most processes), "
                                 f"not {self.pids_limit!r}")
            object.__setattr__(self, "pids_limit", int(self.pids_limit))
        for name in ("strict_limits", "read_only", "host_loopback", "nested_userns", "privileged"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, not {getattr(self, name)!r}")
        if self.cpus is not None:
            if isinstance(self.cpus, bool) or not isinstance(self.cpus, (int, float)) or not self.cpus >= 0.01:
                raise ValueError(f"cpus must be a number of CPUs of at least 0.01, not {self.cpus!r}")
            object.__setattr__(self, "cpus", float(self.cpus))
        object.__setattr__(self, "gpus", normalize_gpus(self.gpus))
        object.__setattr__(self, "rootfs", str(self.rootfs or "host"))
        object.__setattr__(self, "env", dict(self.env))
        object.__setattr__(self, "mounts", tuple(m if isinstance(m, Bind) else Bind.parse(m) for m in self.mounts))
        object.__setattr__(self, "tmpfs", tuple(t if isinstance(t, Tmpfs) else Tmpfs.parse(t) for t in self.tmpfs))
        targets = [posixpath.normpath(m.target) for m in (*self.mounts, *self.tmpfs)]
        twice = sorted({t for t in targets if targets.count(t) > 1})
        if twice:
            raise ValueError(f"two mounts at {twice[0]}: each target takes one bind or tmpfs")

    def replace(self, **changes: object) -> "SandboxSpec":
        return replace(self, **changes)  # type: ignore[arg-type]


# The option names: each door passes what it was given through by them.
FIELDS = frozenset(f.name for f in fields(SandboxSpec))
