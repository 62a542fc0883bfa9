"""Instructions that change only the image config (no layer): ENV, LABEL,
WORKDIR, USER, SHELL, ENTRYPOINT, CMD, EXPOSE, HEALTHCHECK, STOPSIGNAL,
VOLUME, MAINTAINER. Each edits the OCI config's `config` object as
Docker does."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable
from typing import Any

from .parse import Instruction, key_values

DEFAULT_SHELL = ["/bin/sh", "-c"]
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_NS = {"ns": 1, "us": 1_000, "µs": 1_000, "ms": 1_000_000, "s": 1_000_000_000, "m": 60_000_000_000,
       "h": 3_600_000_000_000}

Expand = Callable[[str], str]


# The Env list parsed last: every step asks for its variables, and a build
# step replaces the list, never changes it; parsing it each time made a
# Dockerfile of thousands of ENV lines take quadratic time.
_parsed: list[Any] = [None, {}]


def env_dict(cfg: dict[str, Any]) -> dict[str, str]:
    items = cfg.get("Env") or []
    if items is not _parsed[0]:
        env = {}
        for item in items:
            k, _, v = str(item).partition("=")
            env[k] = v
        _parsed[:] = [items, env]
    return dict(_parsed[1])


def command_form(ins: Instruction, shell: list[str]) -> list[str]:
    """CMD/ENTRYPOINT/RUN arguments: the exec form as written, the shell
    form through the image's SHELL."""
    if ins.json:
        return list(ins.args)
    return [*shell, ins.args[0]] if ins.args and ins.args[0] else []


def apply(ins: Instruction, cfg: dict[str, Any], expand: Expand, cmd_set: bool) -> None:
    """Applies one config instruction to `cfg`. `cmd_set`: whether this
    stage set CMD itself (ENTRYPOINT resets an inherited CMD)."""
    c = ins.cmd
    if c == "ENV":
        env, pairs = env_dict(cfg), dict(key_values(ins, expand))
        if env.keys().isdisjoint(pairs):  # new names: appended (no list rebuilt per ENV)
            cfg["Env"] = [*(cfg.get("Env") or []), *(f"{k}={v}" for k, v in pairs.items())]
        else:
            cfg["Env"] = [f"{k}={v}" for k, v in {**env, **pairs}.items()]
        env.update(pairs)
        _parsed[:] = [cfg["Env"], env]
    elif c == "LABEL":
        cfg["Labels"] = {**(cfg.get("Labels") or {}), **dict(key_values(ins, expand))}
    elif c == "MAINTAINER":
        cfg["Labels"] = {**(cfg.get("Labels") or {}), "maintainer": expand(" ".join(ins.args))}
    elif c == "WORKDIR":
        path = expand(ins.args[0]) if ins.args else ""
        if not path:
            raise ins.error("WORKDIR needs a path")
        cfg["WorkingDir"] = posixpath.normpath(posixpath.join(cfg.get("WorkingDir") or "/", path))
    elif c == "USER":
        cfg["User"] = expand(ins.args[0]) if ins.args else ""
    elif c == "SHELL":
        if not ins.json or not ins.args:
            raise ins.error('SHELL takes a JSON array, e.g. SHELL ["/bin/bash", "-c"]')
        cfg["Shell"] = list(ins.args)
    elif c == "ENTRYPOINT":
        cfg["Entrypoint"] = command_form(ins, shell(cfg)) or None
        if not cmd_set:
            cfg["Cmd"] = None  # as Docker: an inherited CMD no longer applies
    elif c == "CMD":
        cfg["Cmd"] = command_form(ins, shell(cfg)) or None
    elif c == "EXPOSE":
        ports = dict(cfg.get("ExposedPorts") or {})
        for word in ins.args:
            port = expand(word)
            if not re.fullmatch(r"\d+(-\d+)?(/(tcp|udp|sctp))?", port):
                raise ins.error(f"invalid port {port!r}")
            ports[port if "/" in port else f"{port}/tcp"] = {}
        cfg["ExposedPorts"] = ports
    elif c == "VOLUME":
        vols = dict(cfg.get("Volumes") or {})
        for word in ins.args:
            if path := expand(word).strip():
                vols[path] = {}
        cfg["Volumes"] = vols
    elif c == "STOPSIGNAL":
        cfg["StopSignal"] = expand(ins.args[0]) if ins.args else None
    elif c == "HEALTHCHECK":
        cfg["Healthcheck"] = healthcheck(ins, shell(cfg))
    else:
        raise ins.error(f"{c} is not a config instruction")


def shell(cfg: dict[str, Any]) -> list[str]:
    return list(cfg.get("Shell") or DEFAULT_SHELL)


def healthcheck(ins: Instruction, sh: list[str]) -> dict[str, Any]:
    args = list(ins.args)
    kind = args[0].upper() if args else ""
    if kind == "NONE":
        return {"Test": ["NONE"]}
    if kind != "CMD" or len(args) < 2:
        raise ins.error("expected HEALTHCHECK [OPTIONS] CMD command, or HEALTHCHECK NONE")
    test = ["CMD", *args[1:]] if ins.json else ["CMD-SHELL", args[1]]
    check: dict[str, Any] = {"Test": test}
    names = {"interval": "Interval", "timeout": "Timeout", "start-period": "StartPeriod",
             "start-interval": "StartInterval"}
    for flag, value in ins.flags.items():
        if flag == "retries":
            if not value.isdigit():
                raise ins.error(f"--retries must be a whole number, not {value!r}")
            check["Retries"] = int(value)
        else:
            check[names[flag]] = duration(ins, value)
    return check


def duration(ins: Instruction, text: str) -> int:
    """Go's duration syntax ("30s", "1m30s") in nanoseconds."""
    pos, total = 0, 0.0
    for m in _DURATION.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _NS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ins.error(f"invalid duration {text!r} (e.g. 30s, 1m30s)")
    return int(total)
