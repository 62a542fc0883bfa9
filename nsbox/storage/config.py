"""An image's runtime configuration (the OCI config's `config` object).

`docker run` starts `Entrypoint + Cmd` as `User` in `WorkingDir` with
`Env`; `docker exec` uses the same User, WorkingDir and Env. A sandbox's
own settings win over the image's (see `merge_env` and `effective_user`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..idmap import IdMap


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
    os: str = "linux"
    architecture: str = ""
    variant: str | None = None
    diff_ids: list[str] = field(default_factory=list)
    created: str | None = None

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> ImageConfig:
        c = doc.get("config") or {}
        env: dict[str, str] = {}
        for item in c.get("Env") or []:
            key, _, value = str(item).partition("=")
            if key:
                env[key] = value
        rootfs = doc.get("rootfs") or {}
        return cls(
            env=env,
            workdir=c.get("WorkingDir") or None,
            user=c.get("User") or None,
            entrypoint=list(c.get("Entrypoint") or []),
            cmd=list(c.get("Cmd") or []),
            exposed_ports=sorted(c.get("ExposedPorts") or {}),
            volumes=sorted(c.get("Volumes") or {}),
            labels=dict(c.get("Labels") or {}),
            stop_signal=c.get("StopSignal") or None,
            healthcheck=dict(c["Healthcheck"]) if isinstance(c.get("Healthcheck"), dict) else None,
            os=doc.get("os") or "linux",
            architecture=doc.get("architecture") or "",
            variant=doc.get("variant") or None,
            diff_ids=list(rootfs.get("diff_ids") or []),
            created=doc.get("created"),
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
