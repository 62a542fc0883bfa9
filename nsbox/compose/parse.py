"""Raw compose data (parsed YAML, already interpolated) into the model.

Every form compose accepts for a modelled key is read here (string or list,
list or mapping, short or long syntax). Malformed values raise ComposeError
at once, naming the service and key; values that are well-formed but ask for
something nsbox cannot do are appended to `issues` (support.py decides about
whole keys).
"""

from __future__ import annotations

import math
import os
import re
import shlex
from pathlib import Path
from typing import Any, Mapping

from ..net.hosts import host_address
from ..spec import HOST_GATEWAY, Restart, Tmpfs, normalize_gpus, parse_size
from .errors import ComposeError
from .hostpaths import HostPaths
from .model import CONDITIONS, Build, Healthcheck, Mount, Service
from .support import HOST_LOOPBACK_ENV, host_loopback_granted

_TRUE = {"y", "yes", "true", "on"}
_FALSE = {"n", "no", "false", "off"}
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0,
                   "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h|d|w)")


# What the short volume syntax's MODE may hold (compose-go's): access,
# SELinux relabelling (no SELinux here: nothing to do), consistency (macOS
# only), propagation, and a volume's nocopy.
_PROPAGATION = ("shared", "rshared", "slave", "rslave", "private", "rprivate")
_VOLUME_OPTIONS = ("ro", "rw", "z", "Z", "nocopy", "cached", "delegated", "consistent", *_PROPAGATION)

# A Go duration is an int64 of nanoseconds.
_DURATION_MAX = (2**63 - 1) / 1e9


class Reader:
    """Reads one service; `where` prefixes error messages."""

    def __init__(self, name: str, directory: Path, environ: Mapping[str, str], issues: list[str],
                 paths: HostPaths) -> None:
        self.name = name
        self.directory = directory
        self.environ = environ
        self.issues = issues
        self.paths = paths

    def fail(self, key: str, message: str) -> ComposeError:
        return ComposeError(f"service {self.name}: {key}: {message}")

    # -- scalars ------------------------------------------------------------

    def boolean(self, key: str, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise self.fail(key, f"expected true or false, not {value!r}")

    def string(self, key: str, value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (str, int, float)):
            return str(value)
        raise self.fail(key, f"expected a string, not {value!r}")

    def number(self, key: str, value: Any) -> float:
        try:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
        except (TypeError, ValueError):
            raise self.fail(key, f"expected a number, not {value!r}") from None
        if not math.isfinite(number):  # .nan, .inf, 1e400
            raise self.fail(key, f"expected a finite number, not {value!r}")
        return number

    def size(self, key: str, value: Any) -> int:
        try:
            return parse_size(value, key)
        except ValueError as e:
            raise self.fail(key, str(e)) from None

    def octal(self, key: str, value: Any) -> int:
        """A file mode: a YAML number is taken as written in octal (1777), as Docker does."""
        try:
            return int(str(value), 8)
        except ValueError:
            raise self.fail(key, f"expected an octal file mode such as 1777, not {value!r}") from None

    def duration(self, key: str, value: Any) -> float:
        """Seconds, from a Go duration as compose takes it: "1m30s", "500ms", "1.5h"."""
        text = str(value).strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        if body == "0":
            return 0.0
        if not body or _DURATION.sub("", body):
            raise self.fail(key, f"expected a duration such as 30s, 1m30s or 500ms, not {value!r}")
        seconds = sign * sum(float(n) * _DURATION_UNITS[u] for n, u in _DURATION.findall(body))
        if not abs(seconds) <= _DURATION_MAX:
            raise self.fail(key, f"{value!r} is longer than a Go duration can be (about 290 years)")
        return seconds

    def command(self, key: str, value: Any) -> list[str] | None:
        """A list as given; a string split as a shell would (compose uses
        go-shellwords); "" or [] is set and empty (it resets the image's)."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                return shlex.split(value)
            except ValueError as e:
                raise self.fail(key, f"cannot split {value!r}: {e}") from None
        if isinstance(value, list):
            return [self.string(key, v) for v in value]
        raise self.fail(key, f"expected a string or a list, not {value!r}")

    def string_list(self, key: str, value: Any) -> list[str]:
        if value is None:
            return []
        if isinstance(value, (str, int)):
            return [str(value)]
        if isinstance(value, list):
            return [self.string(key, v) for v in value]
        raise self.fail(key, f"expected a string or a list, not {value!r}")

    def mapping(self, key: str, value: Any) -> dict[str, str | None]:
        """A mapping, or a list of "KEY=VALUE" / "KEY" (value None)."""
        if value is None:
            return {}
        if isinstance(value, dict):
            return {str(k): None if v is None else self.string(key, v) for k, v in value.items()}
        if isinstance(value, list):
            out: dict[str, str | None] = {}
            for item in value:
                k, has, v = self.string(key, item).partition("=")
                out[k] = v if has else None
            return out
        raise self.fail(key, f"expected a mapping or a list, not {value!r}")

    def host_path(self, text: str, key: str) -> str:
        """A host path the file names: `~` expanded, relative to the compose
        file's directory, resolved and allowed (hostpaths.py)."""
        path = os.path.normpath(self.directory / os.path.expanduser(text))
        return self.paths.check(path, f"service {self.name}: {key}")

    # -- structured keys ----------------------------------------------------

    def environment(self, value: Any) -> dict[str, str]:
        out: dict[str, str] = {}
        for k, v in self.mapping("environment", value).items():
            if v is None:
                v = self.environ.get(k)  # compose: taken from the environment, else dropped
            if v is not None:
                out[k] = v
        return out

    def build(self, value: Any) -> Build:
        if isinstance(value, str):
            value = {"context": value}
        if not isinstance(value, dict):
            raise self.fail("build", f"expected a path or a mapping, not {value!r}")
        context_text = self.string("build.context", value.get("context", "."))
        if "://" in context_text or context_text.startswith("git@"):
            self.issues.append(f"build.context from a URL ({context_text})")
            return Build(self.directory, self.directory / "Dockerfile")  # never used: the issue stops loading
        context = Path(self.host_path(context_text, "build.context"))
        if "dockerfile_inline" in value:
            self.issues.append("build.dockerfile_inline")
        dockerfile_text = self.string("build.dockerfile", value.get("dockerfile", "Dockerfile"))
        dockerfile = Path(self.host_path(str(context / dockerfile_text), "build.dockerfile"))
        args = {k: v if v is not None else self.environ.get(k, "")
                for k, v in self.mapping("build.args", value.get("args")).items()}
        target = value.get("target")
        network = value.get("network")
        network = None if network in (None, "default", "bridge") else self.string("build.network", network)
        return Build(context, dockerfile, args, None if target is None else self.string("build.target", target),
                     network=network if network in ("none", "host") else None,  # another: support.py warns
                     no_cache=self.boolean("build.no_cache", value.get("no_cache", False)),
                     pull=self.boolean("build.pull", value.get("pull", False)))

    def healthcheck(self, value: Any) -> Healthcheck:
        if not isinstance(value, dict):
            raise self.fail("healthcheck", f"expected a mapping, not {value!r}")
        hc = Healthcheck()
        test = value.get("test")
        if isinstance(test, str):
            hc.test = ["CMD-SHELL", test]
        elif isinstance(test, list):
            hc.test = [self.string("healthcheck.test", t) for t in test]
            if not hc.test or hc.test[0] not in ("CMD", "CMD-SHELL", "NONE"):
                raise self.fail("healthcheck.test", f"a list must start with CMD, CMD-SHELL or NONE, not {test!r}")
            if hc.test[0] != "NONE" and not any(hc.test[1:]):
                raise self.fail("healthcheck.test", f"{hc.test[0]} needs a command, not {test!r}")
        elif test is not None:
            raise self.fail("healthcheck.test", f"expected a string or a list, not {test!r}")
        if "disable" in value and self.boolean("healthcheck.disable", value["disable"]):
            hc.test = ["NONE"]
        for key in ("interval", "timeout", "start_period", "start_interval"):
            if value.get(key) is not None:
                seconds = self.duration(f"healthcheck.{key}", value[key])
                if seconds < 0:
                    raise self.fail(f"healthcheck.{key}", f"must not be negative, not {value[key]!r}")
                setattr(hc, key, seconds or None)  # 0: unset, as Docker reads it
        if value.get("retries") is not None:
            retries = self.number("healthcheck.retries", value["retries"])
            if retries != int(retries) or retries < 0:
                raise self.fail("healthcheck.retries", f"expected a whole number, not {value['retries']!r}")
            hc.retries = int(retries) or None
        return hc

    def restart(self, value: Any, policy: Any) -> Restart | None:
        """`restart`, else deploy.restart_policy (as Compose maps it onto a
        container's policy: condition any, on-failure or none, and
        max_attempts; delay and window are swarm's)."""
        if value is None and policy is None:
            return None
        if value is not None:
            try:  # an unquoted `no` is YAML's false
                return Restart.parse("no" if value is False else self.string("restart", value))
            except ValueError as e:
                raise self.fail("restart", str(e)) from None
        if not isinstance(policy, dict):
            raise self.fail("deploy.restart_policy", f"expected a mapping, not {policy!r}")
        condition = policy.get("condition", "any")
        if condition not in ("none", "on-failure", "any"):
            raise self.fail("deploy.restart_policy.condition",
                            f"expected none, on-failure or any, not {condition!r}")
        attempts = policy.get("max_attempts")
        if attempts is not None and (isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 0):
            raise self.fail("deploy.restart_policy.max_attempts", f"expected a whole number, not {attempts!r}")
        if condition == "none":
            return None
        try:
            return Restart(on_failure=condition == "on-failure", limit=attempts or None)
        except ValueError as e:
            raise self.fail("deploy.restart_policy.max_attempts", str(e)) from None

    def depends_on(self, value: Any) -> tuple[dict[str, Any], set[str]]:
        """The dependencies with their conditions, and those not required."""
        if isinstance(value, list):
            return {self.string("depends_on", v): "service_started" for v in value}, set()
        if not isinstance(value, dict):
            raise self.fail("depends_on", f"expected a list or a mapping, not {value!r}")
        out: dict[str, Any] = {}
        optional = set()
        for name, opts in value.items():
            # `restart` does not matter here: every service starts, once.
            condition = (opts or {}).get("condition", "service_started") if isinstance(opts, dict) else opts
            if condition not in CONDITIONS:
                raise self.fail(f"depends_on.{name}.condition", f"expected one of {', '.join(CONDITIONS)}, not {condition!r}")
            out[str(name)] = condition
            if isinstance(opts, dict) and not self.boolean(f"depends_on.{name}.required", opts.get("required", True)):
                optional.add(str(name))
        return out, optional

    def volume(self, value: Any) -> Mount:
        if isinstance(value, str):
            return self._short_volume(value)
        if not isinstance(value, dict):
            raise self.fail("volumes", f"expected a string or a mapping, not {value!r}")
        target = value.get("target")
        if not isinstance(target, str) or not target.startswith("/"):
            raise self.fail("volumes", f"target must be an absolute path in the container, not {target!r}")
        source = value.get("source")
        kind = value.get("type") or ("bind" if isinstance(source, str) and source[:1] in "./~" else "volume")
        read_only = self.boolean("volumes.read_only", value.get("read_only", False))
        if kind == "bind":
            if not source:
                raise self.fail("volumes", f"a bind needs a source ({target})")
            create = self.boolean("volumes.bind.create_host_path",
                                  (value.get("bind") or {}).get("create_host_path", False))
            propagation = str((value.get("bind") or {}).get("propagation") or "rprivate")
            return Mount("bind", target, self.host_path(self.string("volumes.source", source), "volumes"), read_only,
                         create_host_path=create,
                         dropped=() if propagation in ("private", "rprivate") else (f"propagation={propagation}",))
        if kind == "volume":
            subpath = (value.get("volume") or {}).get("subpath")
            if subpath is not None:
                subpath = self.string("volumes.volume.subpath", subpath)
                if subpath.startswith("/") or ".." in subpath.split("/"):
                    raise self.fail("volumes.volume.subpath", f"must be a relative path inside the volume, not {subpath!r}")
            nocopy = self.boolean("volumes.volume.nocopy", (value.get("volume") or {}).get("nocopy", False))
            return Mount("volume", target, None if source is None else str(source), read_only, subpath=subpath,
                         nocopy=nocopy)
        if kind == "tmpfs":
            opts = value.get("tmpfs") or {}
            size = None if opts.get("size") is None else self.size("volumes.tmpfs.size", opts["size"])
            mode = None if opts.get("mode") is None else self.octal("volumes.tmpfs.mode", opts["mode"])
            return Mount("tmpfs", target, None, read_only, size=size, mode=mode)
        self.issues.append(f"volumes of type {kind} ({target})")
        return Mount("tmpfs", target)  # never used: the issue stops loading

    def _short_volume(self, spec: str) -> Mount:
        # compose-go's ParseVolume: SOURCE:TARGET[:MODE], or TARGET alone (an
        # anonymous volume); a source starting with . / or ~ is a bind.
        parts = spec.split(":")
        if len(parts) == 1:
            return Mount("volume", parts[0])
        if len(parts) > 3 or not all(parts[:2]):
            raise self.fail("volumes", f"expected SOURCE:TARGET[:MODE], not {spec!r}")
        source, target = parts[0], parts[1]
        options = [o for o in parts[2].split(",") if o] if len(parts) == 3 else []
        for option in options:
            if option not in _VOLUME_OPTIONS:
                raise self.fail("volumes", f"unknown option {option!r} in {spec!r} (known: {', '.join(_VOLUME_OPTIONS)})")
        read_only = "ro" in options
        # nsbox's binds are private: a propagation other than that is not applied.
        dropped = tuple(o for o in options if o in _PROPAGATION and o not in ("private", "rprivate"))
        if not target.startswith("/"):
            raise self.fail("volumes", f"target must be an absolute path in the container, not {spec!r}")
        if source[:1] in "./~":
            return Mount("bind", target, self.host_path(source, "volumes"), read_only, create_host_path=True,
                         dropped=dropped)
        return Mount("volume", target, source, read_only, nocopy="nocopy" in options, dropped=dropped)

    def tmpfs(self, value: Any) -> list[Mount]:
        """TARGET[:OPTIONS], Docker's --tmpfs: mount options, of which nsbox
        applies those of spec.Tmpfs and drops the others (uid=, nr_inodes=...)."""
        mounts = []
        for item in self.string_list("tmpfs", value):
            try:
                target, fields, dropped = Tmpfs.split(item)
            except ValueError as e:
                raise self.fail("tmpfs", str(e)) from None
            if not target.startswith("/"):
                raise self.fail("tmpfs", f"target must be an absolute path in the container, not {target!r}")
            size = None if "size" not in fields else self.size("tmpfs size", fields["size"])
            mounts.append(Mount("tmpfs", target, read_only=bool(fields.get("readonly", False)), size=size,
                                mode=fields.get("mode"), noexec=bool(fields.get("noexec", True)),  # type: ignore[arg-type]
                                dropped=tuple(dropped)))
        return mounts

    def ports(self, value: Any) -> list[str]:
        """Compose's port forms in nsbox's [ADDRESS:]HOSTPORT:PORT; a port
        without a host port gets any free one (HOSTPORT 0), as in Docker."""
        out: list[str] = []
        for item in value or []:
            if isinstance(item, dict):
                target = item.get("target")
                published = item.get("published")
                address = item.get("host_ip")
                proto = str(item.get("protocol") or "tcp")
                host = "" if published is None else str(published)
                container = "" if target is None else str(target)
            else:
                text, _, proto = str(item).partition("/")
                proto = proto or "tcp"
                address, host, container = self._split_port(item, text)
            if proto != "tcp":
                self.issues.append(f"ports: {item} ({proto}: nsbox publishes TCP only)")
                continue
            out.extend(self._port_pairs(item, address, host, container))
        return out

    def _split_port(self, item: Any, text: str) -> tuple[str | None, str, str]:
        """ADDRESS, HOSTPORT, PORT of [[ADDRESS:]HOSTPORT:]PORT, where ADDRESS
        may be IPv6, bracketed or not ("::1:8080:80", as compose allows)."""
        address = None
        if text.startswith("["):
            address, _, text = text.partition("]")
            address += "]"
            text = text.removeprefix(":")
        parts = text.split(":")
        if len(parts) > 3:
            address, parts = ":".join(parts[:-2]), parts[-2:]
        elif len(parts) == 3:
            address, parts = parts[0], parts[1:]
        if not parts[-1]:
            raise self.fail("ports", f"expected [[ADDRESS:]HOSTPORT:]PORT, not {item!r}")
        return address or None, parts[0] if len(parts) == 2 else "", parts[-1]

    def _port_pairs(self, item: Any, address: str | None, host: str, container: str) -> list[str]:
        def span(text: str) -> list[int]:
            lo, _, hi = text.partition("-")
            try:
                first, last = int(lo), int(hi or lo)
            except ValueError:
                raise self.fail("ports", f"bad port in {item!r}") from None
            # Checked before the range is made: "1-30000000" would be 30 million.
            if not 0 <= first <= last <= 65535:
                raise self.fail("ports", f"{item!r}: a port is a number up to 65535, a range LOW-HIGH")
            return list(range(first, last + 1))
        inside = span(container)
        outside = span(host) if host else [0] * len(inside)
        if len(outside) != len(inside):
            raise self.fail("ports", f"{item!r}: host and container ranges differ in length")
        if address and ":" in address and not address.startswith("["):
            address = f"[{address}]"
        prefix = f"{address}:" if address else ""
        return [f"{prefix}{h}:{c}" for h, c in zip(outside, inside)]

    def networks(self, value: Any) -> dict[str, list[str]]:
        if isinstance(value, list):
            return {self.string("networks", n): [] for n in value}
        if not isinstance(value, dict):
            raise self.fail("networks", f"expected a list or a mapping, not {value!r}")
        out: dict[str, list[str]] = {}
        for net, opts in value.items():
            opts = opts or {}
            for key in ("ipv4_address", "ipv6_address", "link_local_ips"):
                if opts.get(key):
                    self.issues.append(f"networks.{net}.{key} (nsbox gives each service the next free address)")
            out[str(net)] = self.string_list(f"networks.{net}.aliases", opts.get("aliases"))
        return out

    def links(self, value: Any) -> dict[str, str]:
        out = {}
        for link in self.string_list("links", value):
            service, _, alias = link.partition(":")
            out[alias or service] = service
        return out

    def extra_hosts(self, value: Any) -> dict[str, str]:
        """["name:ip", "name=ip"] or {name: ip}. "host-gateway" is the host's
        own address, as under Docker; with the operator's grant it stays as
        it is, and the sandbox's spec opens the host's loopback for it."""
        items = value.items() if isinstance(value, dict) else (
            (text.partition("=")[0], text.partition("=")[2]) if "=" in text else
            (text.partition(":")[0], text.partition(":")[2]) for text in self.string_list("extra_hosts", value))
        out = {}
        for name, address in items:
            address = str(address).strip("[]")
            if address == HOST_GATEWAY and not host_loopback_granted():
                address = host_address() or ""
                if not address:
                    self.issues.append(f"extra_hosts {name}:host-gateway (this host has no IPv4 address but its "
                                       f"loopback, whose services are yours to grant, not a compose file's: "
                                       f"set {HOST_LOOPBACK_ENV}=1 to allow it)")
                    continue
            out[str(name)] = address
        return out

    def capabilities(self, key: str, value: Any) -> list[str]:
        return [c.upper().removeprefix("CAP_") for c in self.string_list(key, value)]


def read_service(name: str, raw: dict[str, Any], directory: Path, environ: Mapping[str, str],
                 issues: list[str], paths: HostPaths) -> Service:
    """The model of one service. `raw` has its env_file already merged into
    `environment` (see load.py)."""
    r = Reader(name, directory, environ, issues, paths)
    s = Service(name)
    get = raw.get
    if get("image") is not None:
        s.image = r.string("image", get("image"))
    if get("build") is not None:
        s.build = r.build(get("build"))
    s.command = r.command("command", get("command"))
    s.entrypoint = r.command("entrypoint", get("entrypoint"))
    if get("working_dir") is not None:
        s.working_dir = r.string("working_dir", get("working_dir"))
        if not s.working_dir.startswith("/"):
            raise r.fail("working_dir", f"must be an absolute path, not {s.working_dir!r}")
    s.environment = r.environment(get("environment"))
    for key in ("user", "hostname", "container_name", "platform", "pull_policy", "network_mode"):
        if get(key) is not None:
            setattr(s, key, r.string(key, get(key)))
    if get("init") is not None:
        s.init = r.boolean("init", get("init"))
    s.read_only = r.boolean("read_only", get("read_only", False))
    s.restart = r.restart(get("restart"), (raw.get("deploy") or {}).get("restart_policy"))
    s.privileged = r.boolean("privileged", get("privileged", False))
    if get("healthcheck") is not None:
        s.healthcheck = r.healthcheck(get("healthcheck"))
    if get("depends_on") is not None:
        s.depends_on, s.optional_deps = r.depends_on(get("depends_on"))
    s.volumes = [r.volume(v) for v in get("volumes") or []]
    s.tmpfs = r.tmpfs(get("tmpfs"))
    s.ports = r.ports(get("ports"))
    s.extra_hosts = r.extra_hosts(get("extra_hosts"))
    if get("networks") is not None:
        s.networks = r.networks(get("networks"))
    elif s.network_mode is None:
        s.networks = {"default": []}  # compose's implicit network
    s.links = r.links(get("links"))
    _limits(r, s, raw)
    s.gpus = _gpus(r, raw, s.environment)
    s.cap_add = r.capabilities("cap_add", get("cap_add"))
    s.cap_drop = r.capabilities("cap_drop", get("cap_drop"))
    s.x_default = r.boolean("x-default", get("x-default", False))
    s.x_local = r.boolean("x-local", get("x-local", False))
    x_nsbox = get("x-nsbox") or {}
    if not isinstance(x_nsbox, dict):
        raise r.fail("x-nsbox", f"expected a mapping of nsbox settings, not {x_nsbox!r}")
    s.x_nsbox = dict(x_nsbox)
    return s


def _limits(r: Reader, s: Service, raw: dict[str, Any]) -> None:
    limits = ((raw.get("deploy") or {}).get("resources") or {}).get("limits") or {}

    def one(key: str, short: Any, deploy_key: str, read: Any) -> Any:
        a = None if short is None else read(key, short)
        b = None if limits.get(deploy_key) is None else read(f"deploy.resources.limits.{deploy_key}", limits[deploy_key])
        if a is not None and b is not None and a != b:
            raise r.fail(key, f"{short!r} differs from deploy.resources.limits.{deploy_key} {limits[deploy_key]!r}")
        return a if a is not None else b

    s.memory = one("mem_limit", raw.get("mem_limit"), "memory", r.size)
    s.cpus = one("cpus", raw.get("cpus"), "cpus", r.number)
    if s.cpus == 0:
        s.cpus = None  # Docker: 0 means no limit
    pids = one("pids_limit", raw.get("pids_limit"), "pids", r.number)
    s.pids_limit = int(pids) if pids is not None and pids > 0 else None  # -1 and 0: unlimited
    size = ((raw.get("storage_opt") or {}).get("size"))
    if size is not None:
        s.disk = r.size("storage_opt.size", size)


def _gpus(r: Reader, raw: dict[str, Any], environment: dict[str, str]) -> str | None:
    """The one GPU request (nsbox/plan/gpu.py's form) of gpus:, runtime: nvidia
    and deploy.resources.reservations.devices; support.py refused the rest."""
    from .support import is_gpu_device

    requests: list[tuple[str, str]] = []
    gpus = raw.get("gpus")
    if gpus is not None:
        entries = gpus if isinstance(gpus, list) else [{"count": gpus}]
        requests += [("gpus", _gpu_entry(r, "gpus", entry)) for entry in entries]
    key = "deploy.resources.reservations.devices"
    devices = (((raw.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
    requests += [(key, _gpu_entry(r, key, entry)) for entry in devices if is_gpu_device(entry)]
    if raw.get("runtime") == "nvidia" and not requests:
        # The NVIDIA runtime exposes what NVIDIA_VISIBLE_DEVICES names (CUDA images say all).
        visible = environment.get("NVIDIA_VISIBLE_DEVICES", "all").strip()
        if visible not in ("", "none", "void"):
            requests.append(("runtime", visible if visible == "all" else f"device={visible}"))
    if len({value for _, value in requests}) > 1:
        raise r.fail(requests[0][0], "GPUs are asked for more than once, differently: give one request")
    try:
        return normalize_gpus(requests[0][1]) if requests else None
    except ValueError as e:
        raise r.fail(requests[0][0], str(e)) from None


def _gpu_entry(r: Reader, key: str, entry: Any) -> str:
    if not isinstance(entry, dict):
        raise r.fail(key, f"expected a device request (count, device_ids), not {entry!r}")
    count, ids = entry.get("count"), entry.get("device_ids")
    if count is not None and ids is not None:
        raise r.fail(key, "count and device_ids cannot both be given")
    if ids is not None:
        if not isinstance(ids, list) or not ids:
            raise r.fail(key, f"device_ids must be a list of GPU ids, not {ids!r}")
        return "device=" + ",".join(str(i) for i in ids)
    if count is None or str(count) in ("all", "-1"):
        return "all"
    if isinstance(count, bool) or not str(count).isdigit() or int(count) < 1:
        raise r.fail(key, f"count must be a positive number or all, not {count!r}")
    return str(int(count))


def read_secret_mounts(r_name: str, raw: dict[str, Any], definitions: dict[str, tuple[dict[str, Any], HostPaths]],
                       kind: str) -> list[Mount]:
    """`secrets:` or `configs:` of a service as read-only binds of their
    `file:` sources: secrets at /run/secrets/NAME, configs at /NAME, unless
    a target is given. Each definition comes with the policy of the file
    that defines it (its `file:` is relative to that file's directory)."""
    mounts = []
    for item in raw.get(kind) or []:
        source, target = (item, None) if isinstance(item, str) else (item.get("source"), item.get("target"))
        if not isinstance(source, str) or not isinstance(target, (str, type(None))):
            raise ComposeError(f"service {r_name}: {kind}: source and target must be strings, not {item!r}")
        definition, paths = definitions.get(source) or (None, None)
        if definition is None or paths is None:
            raise ComposeError(f"service {r_name}: {kind}: {source!r} is not defined in the top-level {kind}")
        if not definition.get("file"):
            continue  # support.py reports the other sources
        if not isinstance(definition["file"], str):
            raise ComposeError(f"{kind}: {source}: file must be a path, not {definition['file']!r}")
        if kind == "secrets":
            target = target if target and target.startswith("/") else f"/run/secrets/{target or source}"
        else:
            target = target if target and target.startswith("/") else f"/{target or source}"
        path = os.path.normpath(Path(paths.directory) / os.path.expanduser(str(definition["file"])))
        path = paths.check(path, f"service {r_name}: {kind}: {source}: file")
        mounts.append(Mount("bind", target, path, read_only=True, host_paths=paths))
    return mounts
