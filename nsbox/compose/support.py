"""What nsbox does with each compose key: the policy, in one place.

Three outcomes, never a silent change of behaviour:
- honoured (modelled in model.py, or harmless: accepted and listed in
  Service.ignored with the reason below);
- honoured approximately: accepted, with a line in Project.warnings;
- cannot honour: one ComposeError naming every such key of every service
  (`service web: nsbox cannot honour: devices, pid: host (see README
  "Compose support")`).

The network shape (network_shape): as Docker, each service of a sample has
a network namespace of its own, an address on each of its networks (one
nsbox.Network per compose network), and names and aliases per network
("services"). The pod mode, all services in one namespace reaching each
other by name on 127.0.0.1 ("none", "nat", "host"), is kept where it is
the better answer: a single service, every service with network_mode
none or host, or a service sharing another's namespace
(network_mode service:X). Only there do two services' ports collide.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal

from ..net.hosts import check_name
from ..spec import HOST_GATEWAY, MAX_PORTS, SandboxSpec, Tmpfs
from .errors import ComposeError
from .model import Project, Service

SEE = '(see README "Compose support")'

# Keys parse.py reads into the model (x-* extensions are handled apart).
MODELLED = frozenset({
    "image", "build", "command", "entrypoint", "working_dir", "environment", "env_file", "user",
    "hostname", "container_name", "init", "healthcheck", "depends_on", "volumes", "tmpfs",
    "read_only", "ports", "network_mode", "networks", "links", "mem_limit", "cpus", "pids_limit",
    "deploy", "cap_add", "cap_drop", "privileged", "platform", "pull_policy", "secrets", "configs",
    "profiles", "scale", "storage_opt", "security_opt", "pid", "ipc", "uts", "cgroup", "userns_mode",
    "runtime", "extra_hosts", "gpus", "restart",
})

# Accepted silently (listed in Service.ignored): they do not change what
# commands in the sandbox see.
HARMLESS = {
    "stop_grace_period": "only shapes how a container stops; nsbox ends the whole sandbox",
    "stop_signal": "only shapes how a container stops; nsbox ends the whole sandbox",
    "pre_stop": "teardown hooks; nsbox ends the whole sandbox",
    "labels": "metadata", "label_file": "metadata", "annotations": "metadata",
    "expose": "documentation only: every port of a service is reachable from its networks",
    "logging": "log drivers collect main-process output, which nsbox does not keep",
    "tty": "the main process's terminal", "stdin_open": "the main process's stdin",
    "attach": "whether compose shows the main process's output",
    "mem_reservation": "a scheduling hint, not a limit",
    "pull_refresh_after": "when to pull again",
    "develop": "compose watch only",
    "mac_address": "nsbox's veth devices get the kernel's addresses",
    "isolation": "Windows only",
}

# Accepted, honoured only approximately: a warning says how.
APPROXIMATE = {
    "ulimits": "ulimits are not applied",
    "shm_size": "/dev/shm keeps nsbox's size",
    "memswap_limit": "swap is not limited separately (memory is)",
    "mem_swappiness": "not applied",
    "cpu_shares": "not applied (cpus is)", "cpu_quota": "not applied (cpus is)",
    "cpu_period": "not applied (cpus is)", "cpuset": "not applied (cpus is)",
    "cpu_count": "not applied (cpus is)", "cpu_percent": "not applied (cpus is)",
    "cpu_rt_runtime": "not applied", "cpu_rt_period": "not applied",
    "blkio_config": "not applied", "oom_score_adj": "not applied", "oom_kill_disable": "not applied",
    "dns": "name resolution is nsbox's", "dns_search": "name resolution is nsbox's",
    "dns_opt": "name resolution is nsbox's", "domainname": "not applied",
}

# Cannot honour: what each would need.
UNSUPPORTED = {
    "sysctls": "kernel parameters",
    "external_links": "containers outside the project", "volumes_from": "another container's volumes",
    "extends": "extends (inline the base service)", "group_add": "supplementary groups",
    "post_start": "lifecycle hooks", "credential_spec": "Windows credentials",
    "use_api_socket": "the Docker API", "cgroup_parent": "the host's cgroup tree",
    "provider": "service providers", "models": "model runners",
}

# Device access nsbox refuses, and why (GPUs are honoured: gpus:,
# runtime: nvidia, deploy.resources.reservations.devices).
DEVICE_KEYS = {
    "devices": "host devices other than GPUs are not passed through; GPUs: use gpus",
    "device_cgroup_rules": "a rootless sandbox has no device cgroup",
}
RUNTIMES = (None, "runc", "nvidia")

# Capabilities root of the sandbox's user namespace already holds over the
# sandbox's own namespaces (or Docker grants by default): cap_add is a no-op.
NAMESPACED_CAPS = frozenset({
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
    "SETPCAP", "SETFCAP", "NET_BIND_SERVICE", "NET_BROADCAST", "SYS_CHROOT", "SYS_PTRACE",
    "MKNOD", "AUDIT_WRITE", "IPC_OWNER", "LEASE", "CHECKPOINT_RESTORE",
})
APPROXIMATE_CAPS = {
    "SYS_ADMIN": "granted as nested_userns (mounts and namespaces inside the sandbox), not the host's SYS_ADMIN",
    "NET_RAW": "raw sockets are not granted (the service's network namespace is nsbox's); ping works, through "
               "ICMP echo sockets, as for every user",
    "NET_ADMIN": "not granted: the service's network namespace is nsbox's, so commands that configure it "
                 "(ip addr, ip route, iptables) fail with 'Operation not permitted'",
}
# Any other capability (SYS_MODULE, SYS_TIME, SYS_RAWIO, SYS_BOOT, SYS_NICE,
# IPC_LOCK, SYS_RESOURCE, BPF, PERFMON, ALL, ...) needs real privilege.

NAMESPACE_MODES = {"pid": ("", "private"), "ipc": ("", "private", "shareable", "none"),
                   "uts": ("", "private"), "cgroup": ("", "private"), "userns_mode": ("",)}
TOP_LEVEL = frozenset({"name", "version", "include", "services", "networks", "volumes", "secrets", "configs"})
DEPLOY_HARMLESS = frozenset({"mode", "placement", "update_config", "rollback_config",
                             "labels", "endpoint_mode"})
# SandboxSpec settings `x-nsbox` may set; the rest come from compose keys,
# and the id mapping is the operator's choice, never a compose file's
# (host-root would make sandbox root host root).
X_NSBOX = frozenset(f.name for f in dataclasses.fields(SandboxSpec)) - {
    "rootfs", "image", "pull", "platform", "mounts", "network", "more_networks", "ports", "label", "origin",
    "id_mapping"}


@dataclasses.dataclass
class Review:
    ignored: list[str] = dataclasses.field(default_factory=list)
    issues: list[str] = dataclasses.field(default_factory=list)  # cannot honour
    warnings: list[str] = dataclasses.field(default_factory=list)


# The YAML types compose's schema allows for the keys read here (a value
# of another type is a ComposeError before anything reads it): "KEY[]" is
# each item of a list, "KEY.*" each value of a mapping.
STR, LIST, MAP, NULL = str, list, dict, type(None)
SCALAR = (str, int, float, bool)
SHAPES: dict[str, Any] = {
    "build": (STR, MAP), "build.args": (MAP, LIST), "build.args.*": SCALAR + (NULL,), "build.args[]": SCALAR,
    "command": (STR, LIST), "entrypoint": (STR, LIST), "environment": (MAP, LIST),
    "environment.*": SCALAR + (NULL,), "environment[]": SCALAR, "env_file": (STR, LIST), "env_file[]": (STR, MAP),
    "healthcheck": MAP, "healthcheck.test": (STR, LIST), "depends_on": (LIST, MAP), "depends_on[]": STR,
    "depends_on.*": (STR, MAP, NULL), "volumes": LIST, "volumes[]": (STR, MAP), "volumes[].bind": MAP,
    "volumes[].volume": MAP, "volumes[].tmpfs": MAP, "tmpfs": (STR, LIST), "ports": LIST,
    "ports[]": SCALAR + (MAP,), "networks": (LIST, MAP), "networks[]": STR, "networks.*": (MAP, NULL),
    "links": (STR, LIST), "extra_hosts": (MAP, LIST), "deploy": MAP, "deploy.resources": MAP,
    "deploy.resources.limits": MAP, "deploy.resources.reservations": MAP, "cap_add": (STR, LIST),
    "cap_add[]": STR, "cap_drop": (STR, LIST), "security_opt": LIST, "profiles": LIST, "profiles[]": STR,
    "storage_opt": MAP, "secrets": LIST, "secrets[]": (STR, MAP), "configs": LIST, "configs[]": (STR, MAP),
    "x-nsbox": MAP, "labels": (MAP, LIST), "ulimits": MAP, "sysctls": (MAP, LIST),
    "deploy.resources.reservations.devices": LIST,
    "deploy.restart_policy": MAP, "network_mode": STR, "restart": (STR, bool),
}


def check_shapes(name: str, raw: dict[str, Any]) -> None:
    """Raises a ComposeError for the first value of a type compose does not
    allow for its key (SHAPES)."""
    def walk(key: str, value: Any) -> None:
        allowed = SHAPES.get(key)
        if allowed is None or value is None and not key.endswith(("*", "[]")):
            return
        if not isinstance(value, allowed) or isinstance(value, bool) and bool not in _flat(allowed):
            raise ComposeError(f"service {name}: {key}: {value!r} is not "
                               f"{' or '.join(dict.fromkeys(_TYPE_NAMES[t] for t in _flat(allowed)))}")
        if isinstance(value, list):
            for item in value:
                walk(f"{key}[]", item)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{key}.*", v)
                walk(f"{key}.{k}", v)
    for key, value in raw.items():
        walk(key, value)


_TYPE_NAMES = {str: "a string", int: "a number", float: "a number", bool: "a boolean", list: "a list",
               dict: "a mapping", NULL: "null"}


def _flat(allowed: Any) -> list[type]:
    return list(dict.fromkeys(allowed)) if isinstance(allowed, tuple) else [allowed]


def review_service(name: str, raw: dict[str, Any]) -> Review:
    """Sorts one service's keys (and the values that decide) into the three outcomes."""
    r = Review()
    for key, value in raw.items():
        if key.startswith("x-"):
            continue
        if key in HARMLESS:
            r.ignored.append(key)
        elif key in APPROXIMATE:
            r.warnings.append(f"service {name}: {key}: {APPROXIMATE[key]}")
        elif key in DEVICE_KEYS:
            r.issues.append(f"{key} ({DEVICE_KEYS[key]})")
        elif key in UNSUPPORTED:
            r.issues.append(key)
        elif key not in MODELLED:
            r.issues.append(f"unknown key {key}")
    for key, allowed in NAMESPACE_MODES.items():
        value = raw.get(key)
        if value is not None and str(value) not in allowed:
            r.issues.append(f"{key}: {value}")
    if raw.get("runtime") not in RUNTIMES:
        r.issues.append(f"runtime: {raw['runtime']}")
    _review_network_mode(raw.get("network_mode"), r)
    _review_host_loopback(raw.get("x-nsbox"), r)
    _review_build(name, raw.get("build"), r)
    _review_capabilities(name, raw, r)
    _review_security_opt(name, raw.get("security_opt") or [], r, privileged=_true(raw.get("privileged")))
    _review_deploy(raw.get("deploy") or {}, raw.get("scale"), r)
    for key in set(raw.get("storage_opt") or {}) - {"size"}:
        r.issues.append(f"storage_opt.{key}")
    for key in set(raw.get("x-nsbox") or {}) - X_NSBOX:
        r.issues.append(f"x-nsbox: unknown setting {key} (known: {', '.join(sorted(X_NSBOX))})")
    return r


def _true(value: Any) -> bool:
    return value is True or str(value).strip().lower() in ("true", "yes", "y", "on")


# The host's network is the operator's to grant, not a compose file's (it
# reaches every service on the host's loopback and its abstract sockets).
HOST_NETWORK_ENV = "NSBOX_COMPOSE_HOST_NETWORK"


def host_network_granted() -> bool:
    return os.environ.get(HOST_NETWORK_ENV, "").strip().lower() in ("1", "true", "yes")


# So is the host's loopback, which `extra_hosts: NAME:host-gateway` opened:
# without the grant that name is the host's own address, as under Docker
# (its services on that address or every address, not its 127.0.0.1 ones).
HOST_LOOPBACK_ENV = "NSBOX_COMPOSE_HOST_LOOPBACK"


def host_loopback_granted() -> bool:
    return os.environ.get(HOST_LOOPBACK_ENV, "").strip().lower() in ("1", "true", "yes")


def _review_host_loopback(x_nsbox: Any, r: Review) -> None:
    # Any value but false asks (a wrong one is the spec's error), and
    # host-gateway anywhere in `hosts`, whatever shape holds it.
    if not isinstance(x_nsbox, dict) or host_loopback_granted():
        return
    if x_nsbox.get("host_loopback") not in (None, False) or _mentions(x_nsbox.get("hosts"), HOST_GATEWAY):
        r.issues.append(f"x-nsbox: the host's loopback (its 127.0.0.1 services are yours to grant, not a compose "
                        f"file's: set {HOST_LOOPBACK_ENV}=1 to allow it)")


def _review_network_mode(mode: Any, r: Review) -> None:
    if mode == "host" and not host_network_granted():
        r.issues.append(f"network_mode: host (the host's network, its loopback services included, is yours to "
                        f"grant, not a compose file's: set {HOST_NETWORK_ENV}=1 to allow it)")
        return
    if mode is None or mode in ("none", "host", "bridge", "default") or str(mode).startswith("service:"):
        return
    r.issues.append(f"network_mode: {mode}")


# build keys besides context, dockerfile, args, target, network, no_cache and pull.
BUILD_APPROXIMATE = {
    "labels": "not applied to the image", "tags": "the image gets the service's name only",
    "cache_from": "nsbox's builder keeps its own cache", "cache_to": "nsbox's builder keeps its own cache",
    "shm_size": "/dev/shm keeps nsbox's size", "ulimits": "not applied", "extra_hosts": "not applied",
    "isolation": "Windows only", "platforms": "the image is built for this host's platform",
    "secrets": "not given to RUN (nsbox's builder refuses RUN --mount)",
    "ssh": "not given to RUN (nsbox's builder refuses RUN --mount)",
    "additional_contexts": "not available to COPY --from", "privileged": "RUN steps are not privileged",
    "entitlements": "RUN steps get none",
}
BUILD_KEYS = frozenset({"context", "dockerfile", "dockerfile_inline", "args", "target", "network", "no_cache",
                        "pull", *BUILD_APPROXIMATE})


def _mentions(value: Any, text: str) -> bool:
    if isinstance(value, dict):
        return any(_mentions(k, text) or _mentions(v, text) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_mentions(v, text) for v in value)
    return str(value).strip() == text


def _review_build(name: str, build: Any, r: Review) -> None:
    if not isinstance(build, dict):
        return
    for key in build:
        if key in BUILD_APPROXIMATE:
            r.warnings.append(f"service {name}: build.{key}: {BUILD_APPROXIMATE[key]}")
        elif key not in BUILD_KEYS:
            r.issues.append(f"unknown key build.{key}")
    network = build.get("network")
    if network == "host" and not host_network_granted():
        r.issues.append(f"build.network: host (the host's network is yours to grant, not a compose file's: "
                        f"set {HOST_NETWORK_ENV}=1 to allow it)")
    elif network not in (None, "none", "host", "default", "bridge"):
        r.warnings.append(f"service {name}: build.network {network}: RUN steps get the builder's own network "
                          "(nat), not a network of the project")


def _review_capabilities(name: str, raw: dict[str, Any], r: Review) -> None:
    caps = [str(c).upper().removeprefix("CAP_") for c in raw.get("cap_add") or []]
    denied = [c for c in caps if c not in NAMESPACED_CAPS and c not in APPROXIMATE_CAPS]
    if denied:
        r.issues.append(f"cap_add: {', '.join(denied)} (needs privilege outside the sandbox's user namespace)")
    for cap in caps:
        if cap in APPROXIMATE_CAPS:
            r.warnings.append(f"service {name}: cap_add {cap}: {APPROXIMATE_CAPS[cap]}")
    if raw.get("cap_drop"):
        r.warnings.append(f"service {name}: cap_drop is not enforced: root in the sandbox keeps its "
                          "capabilities over the sandbox's own namespaces (never over the host)")


def _review_security_opt(name: str, options: list[Any], r: Review, privileged: bool = False) -> None:
    for opt in options:
        text = str(opt)
        key, value = text, ""
        for sep in ("=", ":"):
            if sep in text:
                key, _, value = text.partition(sep)
                break
        if key == "no-new-privileges" and value in ("", "true"):
            r.warnings.append(f"service {name}: security_opt no-new-privileges is not set "
                              "(the sandbox's seccomp filter and user namespace apply)")
        elif key == "seccomp" and value == "unconfined":
            if privileged:  # honoured: a privileged sandbox has no filter
                continue
            r.warnings.append(f"service {name}: security_opt seccomp=unconfined: nsbox keeps its own "
                              "seccomp deny-list (keyring, bpf, perf_event_open, io_uring, kexec, modules, ...)")
        elif (key in ("apparmor", "label") and value in ("unconfined", "disable")) or key == "no-new-privileges":
            r.ignored.append(f"security_opt {text}")
        else:
            r.issues.append(f"security_opt: {text}")


def _review_deploy(deploy: dict[str, Any], scale: Any, r: Review) -> None:
    for replicas, key in ((deploy.get("replicas"), "deploy.replicas"), (scale, "scale")):
        if replicas is not None and str(replicas) not in ("0", "1"):
            r.issues.append(f"{key}: {replicas} (one sandbox per service)")
    for key in set(deploy) - DEPLOY_HARMLESS - {"resources", "replicas", "restart_policy"}:
        r.issues.append(f"deploy.{key}")
    resources = deploy.get("resources") or {}
    reservations = resources.get("reservations") or {}
    if reservations.get("generic_resources"):
        r.issues.append("deploy.resources.reservations.generic_resources")
    for device in reservations.get("devices") or []:
        if not is_gpu_device(device):
            fields = device.items() if isinstance(device, dict) else ()
            what = ", ".join(f"{k} {v}" for k, v in fields if k in ("driver", "capabilities"))
            r.issues.append(f"deploy.resources.reservations.devices: {what or device} "
                            "(only NVIDIA GPUs are passed through)")
    for key in set(resources.get("limits") or {}) - {"cpus", "memory", "pids"}:
        r.issues.append(f"deploy.resources.limits.{key}")


def is_gpu_device(device: Any) -> bool:
    """A device request of compose (gpus:, deploy...devices) for NVIDIA GPUs."""
    if not isinstance(device, dict):
        return False
    capabilities = device.get("capabilities") or []
    return "gpu" in capabilities and device.get("driver") in (None, "nvidia")


def review_top_level(raw: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Issues and warnings of the top-level keys and definitions."""
    issues: list[str] = []
    warnings: list[str] = []
    for key in raw:
        if not key.startswith("x-") and key not in TOP_LEVEL:
            issues.append(key if key == "models" else f"unknown key {key}")
    for name, net in (raw.get("networks") or {}).items():
        net = net or {}
        if net.get("driver") not in (None, "bridge", "default"):
            issues.append(f"networks.{name}.driver: {net['driver']}")
        if net.get("external"):
            warnings.append(f"network {name} is external: nsbox makes a network of the sample's own instead")
    for name, vol in (raw.get("volumes") or {}).items():
        vol = vol or {}
        if vol.get("driver") not in (None, "local"):
            issues.append(f"volumes.{name}.driver: {vol['driver']}")
        if vol.get("driver_opts"):
            issues.append(f"volumes.{name}.driver_opts")
        if vol.get("external"):
            warnings.append(f"volume {name} is external: it becomes an nsbox directory, not Docker's volume")
    for kind in ("secrets", "configs"):
        for name, definition in (raw.get(kind) or {}).items():
            definition = definition or {}
            if not definition.get("file"):
                source = next((k for k in ("environment", "content", "external") if definition.get(k)), "no file")
                issues.append(f"{kind}.{name}: {source} (only file: sources)")
    return issues, warnings


def review_project(project: Project) -> list[str]:
    """Issues that need every service: in the pod mode, ports two services
    would both listen on."""
    if network_shape(project)[0] == "services":
        return []
    owner: dict[str, str] = {}
    issues = []
    for service in project.services.values():
        for port in service.ports:
            inside = port.rsplit(":", 1)[-1]
            if owner.setdefault(inside, service.name) != service.name:
                issues.append(f"port {inside} in both {owner[inside]} and {service.name} "
                              "(all services share one network namespace)")
    return issues


def check_references(project: Project) -> list[str]:
    """Names a service refers to must exist, as compose requires; a
    dependency marked `required: false` that is not defined is dropped with
    a warning, as Compose warns. The warnings."""
    warnings = []
    names = set(project.services)
    defaults = [s.name for s in project.services.values() if s.x_default]
    if len(defaults) > 1:
        raise ComposeError(f"x-default: true is on more than one service ({', '.join(defaults)})")
    for s in project.services.values():
        for dep in list(s.depends_on):
            if dep in names:
                continue
            if dep not in s.optional_deps:
                raise ComposeError(f"service {s.name} depends on undefined service {dep}")
            del s.depends_on[dep]
            warnings.append(f"service {s.name}: depends_on {dep} (required: false) names no service: left out")
        for target in s.links.values():
            if target not in names:
                raise ComposeError(f"service {s.name} links to undefined service {target}")
        if s.network_mode and s.network_mode.startswith("service:") and s.network_mode[8:] not in names:
            raise ComposeError(f"service {s.name}: network_mode {s.network_mode} names an undefined service")
        for net in s.networks:
            if net != "default" and net not in project.networks:
                raise ComposeError(f"service {s.name} refers to undefined network {net}")
        for m in s.volumes:
            if m.type == "volume" and m.source is not None and m.source not in project.volumes:
                raise ComposeError(f"service {s.name} refers to undefined volume {m.source}")
    project.dependency_order()  # a cycle fails the file, not every sample
    for service, names in aliases(project).items():  # they reach /etc/hosts
        for name in names:
            try:
                check_name(name)
            except ValueError as e:
                raise ComposeError(f"service {service}: {e}") from None
    _check_shared_resources(project)
    return warnings


# A sample's networks: each takes one of the 254 subnets, and a helper
# process, that every sample of this process shares.
MAX_NETWORKS = 32


def _check_shared_resources(project: Project) -> None:
    """What a sample takes of what the host or the other samples share is
    bounded: its published ports (the host's ephemeral range, from which
    every outgoing connection of the host draws) and its networks."""
    ports = sum(len(s.ports) for s in project.services.values())
    if ports > MAX_PORTS:
        raise ComposeError(f"the services publish {ports} ports, more than the {MAX_PORTS} a sample may: each "
                           "takes a port of the host's, from the range its outgoing connections use")
    used = {net for s in project.services.values() for net in s.networks}
    if len(used) > MAX_NETWORKS:
        raise ComposeError(f"the services use {len(used)} networks, more than the {MAX_NETWORKS} a sample may: "
                           "each takes one of the 254 subnets all samples of this process share")


def mount_warnings(project: Project) -> list[str]:
    warnings = []
    for s in project.services.values():
        for m in s.tmpfs:
            if m.dropped:
                warnings.append(f"service {s.name}: tmpfs {m.target}: options {','.join(m.dropped)} are not applied "
                                f"(nsbox applies {Tmpfs.OPTIONS})")
        for m in s.volumes:
            if m.dropped and m.type != "tmpfs":
                warnings.append(f"service {s.name}: volume at {m.target}: {','.join(m.dropped)} is not applied "
                                "(nsbox's binds are private: mounts made under one stay in their sandbox)")
    if any(s.ports for s in project.services.values()):
        warnings.append("ports are published on 127.0.0.1 unless an address is given (Docker: all interfaces)")
    return warnings


SampleNetwork = Literal["none", "nat", "host", "services"]


def network_shape(project: Project) -> tuple[SampleNetwork, list[str], list[str]]:
    """The sample's network: "services" (a namespace per service, on its
    networks), or the pod mode's one network mode; the issues that rule
    one out, and warnings."""
    services = list(project.services.values())
    # network_mode service:X joins X's namespace: what counts is X's mode.
    modes = {s.name: _root(s, project).network_mode for s in services}
    shared = any((s.network_mode or "").startswith("service:") for s in services)
    if len(services) > 1 and not shared and not all(m in ("none", "host") for m in modes.values()):
        return "services", [], []
    host = [n for n, m in modes.items() if m == "host"]
    if host:
        if len(host) == len(services):
            return "host", [], []
        others = [n for n in modes if n not in host]
        return "host", [f"network_mode: host on {', '.join(host)} but not on {', '.join(others)} "
                        "(a service shares another's network namespace: all services share one)"], []
    none = [n for n, m in modes.items() if m == "none"]
    if len(none) == len(services):
        return "none", [], []
    joined = {s.name: _networks_of(s, project) for s in services if s.name not in none}
    if none:
        return "none", [f"network_mode: none on {', '.join(none)} but {', '.join(joined)} have networks; "
                        "a service shares another's network namespace, so all services share one"], []
    groups = _connected(joined)
    if len(groups) > 1:
        described = "; ".join(", ".join(g) for g in groups)
        return "none", [f"services that share no network ({described}): a service shares another's "
                        "network namespace (network_mode service:), so all services share one"], []
    internal = {n for n, d in project.networks.items() if d.internal}
    used = set().union(*joined.values())
    if not used & internal:
        return "nat", [], []
    warnings = [f"service {name}: network {', '.join(sorted(nets - internal))} is not internal, but "
                f"{', '.join(sorted(used & internal))} is: the whole sample has no outbound access"
                for name, nets in joined.items() if nets - internal]
    return "none", [], warnings


def service_networks(project: Project) -> dict[str, dict[str, list[str]]]:
    """In the "services" shape: each service's networks (those with
    outbound access first: a service's outbound goes through its first)
    and the names it answers to on each (its name, container_name, that
    network's aliases, the aliases links give it). A service with
    network_mode none or host has none."""
    names = {s.name: [s.name, *([s.container_name] if s.container_name else [])] for s in project.services.values()}
    for s in project.services.values():
        for alias, target in s.links.items():
            names[target].append(alias)
    out = {}
    for s in project.services.values():
        nets = {} if s.network_mode in ("none", "host") else {
            net: list(dict.fromkeys([*names[s.name], *aliases])) for net, aliases in
            ({BRIDGE: []} if s.network_mode in ("bridge", "default") else s.networks).items()}
        out[s.name] = dict(sorted(nets.items(), key=lambda kv: network_internal(project, kv[0])))
    return out


BRIDGE = "bridge"  # network_mode bridge: a network of its own, with outbound access


def network_internal(project: Project, name: str) -> bool:
    definition = project.networks.get(name)
    return definition is not None and definition.internal


def _root(service: Service, project: Project) -> Service:
    """The service whose network namespace `service` uses."""
    seen = {service.name}
    while (service.network_mode or "").startswith("service:"):
        target = project.services.get(service.network_mode[8:])  # type: ignore[index]
        if target is None or target.name in seen:
            break
        seen.add(target.name)
        service = target
    return service


def _networks_of(service: Service, project: Project) -> set[str]:
    root = _root(service, project)
    if root.network_mode in ("bridge", "default"):
        return {"(bridge)"}
    return set(root.networks)


def _connected(joined: dict[str, set[str]]) -> list[list[str]]:
    groups: list[tuple[list[str], set[str]]] = []
    for name, nets in joined.items():
        merged = [g for g in groups if g[1] & nets]
        group = ([n for g in merged for n in g[0]] + [name], set(nets).union(*(g[1] for g in merged)))
        groups = [g for g in groups if g not in merged] + [group]
    order = list(joined)
    return sorted((sorted(g[0], key=order.index) for g in groups), key=lambda g: order.index(g[0]))


def sample_network(project: Project) -> SampleNetwork:
    """The sample's network: "services" (a namespace per service), or the
    mode of the one namespace all services share in the pod mode: "none"
    (loopback only: every service has network_mode none, or one of the
    networks used is internal), "host", or "nat" (outbound access)."""
    mode, issues, _ = network_shape(project)
    if issues:
        raise cannot_honour([("project", i) for i in issues])
    return mode


def aliases(project: Project) -> dict[str, list[str]]:
    """In the pod mode, the names each service answers to (all on
    127.0.0.1): its name, its container_name, its network aliases and the
    aliases links give it."""
    out = {name: [name] for name in project.services}
    for s in project.services.values():
        names = out[s.name]
        names += [s.container_name] if s.container_name else []
        names += [a for net in s.networks.values() for a in net]
        for alias, target in s.links.items():
            out[target].append(alias)
    return {name: list(dict.fromkeys(names)) for name, names in out.items()}


def cannot_honour(issues: list[tuple[str, str]], source: str = "") -> ComposeError:
    """One error naming every issue, grouped by where it is."""
    grouped: dict[str, list[str]] = {}
    for scope, text in issues:
        grouped.setdefault(scope, []).append(text)
    parts = [f"{scope}: nsbox cannot honour: {', '.join(texts)}" for scope, texts in grouped.items()]
    prefix = f"{source}: " if source else ""
    return ComposeError(f"{prefix}{'; '.join(parts)} {SEE}", issues=[f"{s}: {t}" for s, t in issues])
