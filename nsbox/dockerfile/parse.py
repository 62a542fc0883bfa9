"""Reading a Dockerfile into stages of checked instructions.

The syntax is parsed by the `dockerfile` package, which wraps BuildKit's
own Go parser (github.com/moby/buildkit/frontend/dockerfile/parser): line
continuations, the escape directive, JSON forms and heredocs come out as
Docker reads them, where the pure-Python `dockerfile-parse` differs (it
does not parse heredocs). What each instruction means is nsbox's
(builder.py); here instructions and their flags are checked so that
anything unsupported fails before the build starts, naming its line.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import BuildError

# Instruction -> the flags nsbox understands (a flag outside these fails).
FLAGS: dict[str, set[str]] = {
    "FROM": {"platform"}, "RUN": {"network"}, "COPY": {"from", "chown", "chmod", "link"},
    "ADD": {"chown", "chmod", "link"}, "ENV": set(), "ARG": set(), "WORKDIR": set(), "USER": set(),
    "SHELL": set(), "ENTRYPOINT": set(), "CMD": set(), "LABEL": set(), "EXPOSE": set(),
    "HEALTHCHECK": {"interval", "timeout", "start-period", "start-interval", "retries"},
    "STOPSIGNAL": set(), "VOLUME": set(), "MAINTAINER": set(),
}
_HINTS = {"ONBUILD": "ONBUILD triggers are not supported by nsbox build",
          "--mount": "RUN --mount (cache, secret, ssh and bind mounts) is not supported by nsbox build; "
                     "COPY what the step needs instead"}
# Far above real Dockerfiles (hundreds of instructions at most); a build
# step costs time in proportion to the steps before it (history, config).
INSTRUCTION_LIMIT = 10_000
_DIRECTIVE = re.compile(r"#\s*([a-z][a-z0-9]*)\s*=(.*)", re.IGNORECASE)


@dataclass(frozen=True)
class Heredoc:
    name: str
    content: str


@dataclass(frozen=True)
class Instruction:
    cmd: str  # upper case
    line: int
    where: str  # "Dockerfile:12", for errors
    args: tuple[str, ...]
    flags: dict[str, str] = field(default_factory=dict)
    json: bool = False  # the exec (JSON array) form
    heredocs: tuple[Heredoc, ...] = ()
    original: str = ""

    def error(self, message: str, hint: str | None = None) -> BuildError:
        return BuildError(message, hint, where=f"{self.where} ({self.cmd})")

    @property
    def text(self) -> str:
        """The instruction as written (continuations joined), for progress and cache keys."""
        return " ".join(self.original.split("\n", 1)[0].split()) if self.heredocs else self.original.strip()


@dataclass
class Stage:
    index: int
    base: str  # as written (variables not yet expanded)
    name: str | None
    platform: str | None
    origin: Instruction  # the FROM
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    path: str
    global_args: list[Instruction]  # ARGs before the first FROM
    stages: list[Stage]
    escape: str = "\\"

    def stage(self, ref: str) -> Stage | None:
        """The stage named `ref` (or numbered), if any."""
        for s in self.stages:
            if s.name == ref.lower() or str(s.index) == ref:
                return s
        return None


def parse(text: str, path: str = "Dockerfile") -> Dockerfile:
    import dockerfile

    name = Path(path).name
    try:
        commands = dockerfile.parse_string(text)
    except dockerfile.GoParseError as e:
        raise BuildError(f"{e}", where=name) from None
    if len(commands) > INSTRUCTION_LIMIT:
        raise BuildError(f"more than {INSTRUCTION_LIMIT} instructions", where=name)
    df = Dockerfile(path, [], [], escape=_directives(text).get("escape") or "\\")
    for c in commands:
        where = f"{name}:{c.start_line}"
        cmd = c.cmd.upper()
        if cmd == "ONBUILD" or cmd not in FLAGS:
            raise BuildError(_HINTS.get(cmd, f"unknown or unsupported instruction {c.cmd}"), where=f"{where} ({cmd})")
        flags = {}
        for f in c.flags:
            key, _, value = f.removeprefix("--").partition("=")
            if key not in FLAGS[cmd]:
                raise BuildError(_HINTS.get(f"--{key}", f"unsupported flag --{key}"), where=f"{where} ({cmd})")
            flags[key] = value
        heredocs = tuple(Heredoc(h.name, _chomp(h, c.value)) for h in c.heredocs)
        ins = Instruction(cmd, c.start_line, where, tuple(c.value), flags, bool(c.json), heredocs, c.original)
        if heredocs and cmd not in ("RUN", "COPY"):
            raise ins.error("heredocs are supported in RUN and COPY only")
        if cmd == "FROM":
            words = list(ins.args)
            stage_name = None
            if len(words) == 3 and words[1].upper() == "AS":
                stage_name = words[2].lower()
                if not re.fullmatch(r"[a-z][a-z0-9_.-]*", stage_name):
                    raise ins.error(f"invalid stage name {words[2]!r}")
            elif len(words) != 1:
                raise ins.error("expected FROM [--platform=P] IMAGE [AS NAME]")
            df.stages.append(Stage(len(df.stages), words[0], stage_name, flags.get("platform"), ins))
        elif not df.stages:
            if cmd != "ARG":
                raise ins.error("only ARG may come before the first FROM")
            df.global_args.append(ins)
        else:
            df.stages[-1].instructions.append(ins)
    if not df.stages:
        raise BuildError("no FROM instruction", where=name)
    return df


def _directives(text: str) -> dict[str, str]:
    """The parser directives (`# syntax=...`, `# escape=...`): every
    leading line of the form `# key=value`, as BuildKit reads them."""
    found: dict[str, str] = {}
    for line in text.lstrip().splitlines():
        m = _DIRECTIVE.match(line.strip())
        if m is None:
            break
        found.setdefault(m.group(1).lower(), m.group(2).strip())
    return found


def _chomp(heredoc: object, value: tuple[str, ...]) -> str:
    """`<<-NAME` strips leading tabs (the wrapper leaves them in)."""
    content = str(getattr(heredoc, "content"))
    name = str(getattr(heredoc, "name"))
    if any(re.search(rf"<<-[\"']?{re.escape(name)}[\"']?", v) for v in value):
        content = "".join(line.lstrip("\t") for line in content.splitlines(keepends=True))
    return content


def key_values(ins: Instruction, expand: Callable[[str], str]) -> list[tuple[str, str]]:
    """ENV and LABEL pairs: `K=V K2=V2` (the parser gives [K, V, K2, V2]),
    or the legacy `ENV K V` form (the same); each word expanded."""
    args = list(ins.args)
    if len(args) % 2:
        raise ins.error("expected KEY=VALUE pairs")
    pairs = [(expand(args[i]), expand(args[i + 1])) for i in range(0, len(args), 2)]
    if any(not key for key, _ in pairs):
        raise ins.error(f"{ins.cmd} names can not be blank")  # Docker's words
    return pairs
