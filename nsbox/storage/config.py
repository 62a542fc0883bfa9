"""An image's runtime configuration (the OCI config's `config` object).

`docker run` starts `Entrypoint + Cmd` as `User` in `WorkingDir` with
`Env`; `docker exec` uses the same User, WorkingDir and Env. A sandbox's
own settings win over the image's (see `merge_env` and `effective_user`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import NsboxError
from ..host.idmap import IdMap
from .oci import MAX_LAYERS, check_digest


@dataclass(frozen=True)
class ImageConfig:
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None  # "app", "1000", "1000:1000", "app:staff"
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    exposed_ports: list[str] = field(default_factory=list)  # ["80/tcp"]
    volumes: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    stop_signal: str | None = None
    healthcheck: dict[str, Any] | None = None  # Docker's Healthcheck: Test, Interval (ns), Timeout, Retries, ...
    shell: list[str] = field(default_factory=list)  # SHELL: what runs a CMD-SHELL healthcheck (default /bin/sh -c)
    os: str = "linux"
    architecture: str = ""
    variant: str | None = None
    diff_ids: list[str] = field(default_factory=list)
    created: str | None = None

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> ImageConfig:
        """The config of an image, whose author may be hostile: every field
        must have its documented type (one clear error otherwise), and the
        diff_ids, which the store turns into paths, must be digests."""
        if not isinstance(doc, Mapping):
            raise NsboxError("the image config is not a JSON object")
        c = _mapping(doc.get("config"), "config")
        env: dict[str, str] = {}
        for item in _strings(c.get("Env"), "Env"):
            key, _, value = item.partition("=")
            if key:
                env[key] = value
        rootfs = _mapping(doc.get("rootfs"), "rootfs")
        diff_ids = _strings(rootfs.get("diff_ids"), "rootfs.diff_ids")
        for d in diff_ids:
            check_digest(d, "the image config's rootfs.diff_ids")
        if len(diff_ids) > MAX_LAYERS:
            raise NsboxError(f"the image has {len(diff_ids)} layers, more than the {MAX_LAYERS} nsbox stacks")
        return cls(
            env=env,
            workdir=_string(c.get("WorkingDir"), "WorkingDir"),
            user=_string(c.get("User"), "User"),
            entrypoint=_strings(c.get("Entrypoint"), "Entrypoint"),
            cmd=_strings(c.get("Cmd"), "Cmd"),
            exposed_ports=sorted(str(p) for p in _mapping(c.get("ExposedPorts"), "ExposedPorts")),
            volumes=sorted(str(v) for v in _mapping(c.get("Volumes"), "Volumes")),
            labels={str(k): str(v) for k, v in _mapping(c.get("Labels"), "Labels").items()},
            stop_signal=_string(c.get("StopSignal"), "StopSignal"),
            healthcheck=_healthcheck(c.get("Healthcheck")),
            shell=_strings(c.get("Shell"), "Shell"),
            os=_string(doc.get("os"), "os") or "linux",
            architecture=_string(doc.get("architecture"), "architecture") or "",
            variant=_string(doc.get("variant"), "variant"),
            diff_ids=diff_ids,
            created=doc.get("created") if isinstance(doc.get("created"), str) else None,
        )

    @property
    def command(self) -> list[str]:
        """What `docker run IMAGE` runs with no arguments."""
        return [*self.entrypoint, *self.cmd]

    def command_for(self, args: list[str] | None) -> list[str]:
        """`docker run IMAGE ARGS...`: arguments replace Cmd, not Entrypoint."""
        return [*self.entrypoint, *args] if args else self.command

    def merge_env(self, override: Mapping[str, str] | None) -> dict[str, str]:
        """The image's Env under the sandbox's own (which wins)."""
        return {**self.env, **(override or {})}

    def effective_user(self, mapping: IdMap, override: str | None = None) -> tuple[str, str | None]:
        """(user to run as, a note for the person or None).

        In single-uid mode only sandbox root exists and every image file
        belongs to it, so an image USER other than root runs as root: the
        program sees uid 0 but can read and write everything it owns, which
        is what the image's USER needed. An explicit user from the sandbox's
        own settings is not rewritten (it fails with UserUnsupported, naming
        the fix).
        """
        if override:
            return override, None
        user = self.user or "root"
        if mapping.mode == "single" and user.split(":")[0] not in ("root", "0"):
            return "root", (f"the image's USER {user} runs as root: single-uid mode maps only your own uid "
                            f"({mapping.reason})")
        return user, None

    def to_dict(self) -> dict[str, Any]:
        return {
            "Env": [f"{k}={v}" for k, v in self.env.items()], "WorkingDir": self.workdir, "User": self.user,
            "Entrypoint": self.entrypoint, "Cmd": self.cmd, "ExposedPorts": self.exposed_ports,
            "Volumes": self.volumes, "Labels": self.labels, "StopSignal": self.stop_signal,
            "Os": self.os, "Architecture": self.architecture, "Variant": self.variant, "Created": self.created,
        }


def _bad(field: str, wanted: str) -> NsboxError:
    return NsboxError(f"the image config's {field} is not {wanted}", hint="the image is damaged or hostile")


def _mapping(value: Any, field: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _bad(field, "an object")
    return value


def _string(value: Any, field: str) -> str | None:
    """A string without NUL (which no exec or path can hold); "" is None."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or "\0" in value:
        raise _bad(field, "a string")
    return value


# Docker's durations are Go's time.Duration: int64 nanoseconds.
_INT64_MAX = (1 << 63) - 1
_DURATIONS = ("Interval", "Timeout", "StartPeriod", "StartInterval")


def _healthcheck(value: Any) -> dict[str, Any] | None:
    """Docker's Healthcheck, its fields of their documented types: Test a
    string or a list of strings, the durations and Retries int64s (a
    larger one would overflow the arithmetic on them later)."""
    if value is None:
        return None
    health = dict(_mapping(value, "Healthcheck"))
    test = health.get("Test")
    parts = [test] if isinstance(test, str) else test if isinstance(test, list) else None
    if test is not None and (parts is None or not all(isinstance(p, str) and "\0" not in p for p in parts)):
        raise _bad("Healthcheck.Test", "a string or a list of strings")
    for key in (*_DURATIONS, "Retries"):
        n = health.get(key)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= _INT64_MAX):
            raise _bad(f"Healthcheck.{key}", "a count" if key == "Retries" else "a duration in nanoseconds")
    return health


def _strings(value: Any, field: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str) and field in ("Entrypoint", "Cmd"):
        value = [value]  # Docker reads one string as a list of one
    if not isinstance(value, list) or not all(isinstance(v, str) and "\0" not in v for v in value):
        raise _bad(field, "a list of strings")
    return list(value)
