"""The `.env` / `env_file` format, as compose reads it (compose-go's dotenv).

`KEY=VALUE` or `KEY: VALUE` lines, `export ` prefixes, `#` comments (inline
after " #" on unquoted values), single quotes (literal), double quotes
(escapes such as \\n, then interpolation), unquoted values (interpolated),
and a bare `KEY` taking its value from the environment when set there.
Values may use variables set earlier in the same file or in `lookup`
(which wins, as in compose).
"""

from __future__ import annotations

import re
from typing import Callable

from .errors import ComposeError
from .interpolate import BUDGET, substitute

_ESCAPE = re.compile(r'\\(?:[abcfnrtv$"\\]|0\d{0,3})')
_SIMPLE = {"a": "\a", "b": "\b", "c": "\\c", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
           '"': '"', "\\": "\\", "$": "$$"}
_KEY_CHARS = set("_.-[]")
_SPACE = "\t\v\f\r \x85\xa0"  # spaces, but not the newline
_WHITE = re.compile(r"\s*")  # what str.lstrip() strips
_EXPORT = re.compile(r"export\s")


def parse(text: str, lookup: Callable[[str], str | None], source: str) -> dict[str, str]:
    """The variables a dotenv text sets, in order. `source` names it in errors."""
    out: dict[str, str] = {}
    src = text.lstrip("\ufeff")

    def find(name: str) -> str | None:
        value = lookup(name)
        return out.get(name) if value is None else value

    # Positions into `src`, never slices of the rest: a large file stays linear.
    pos = 0
    budget = [BUDGET]  # what every value's interpolation may scan and make, together
    while True:
        pos = _statement_start(src, pos)
        if pos == len(src):
            return out
        line = pos  # where the statement starts, for an error's line number
        if _EXPORT.match(src, pos):
            pos = _skip_space(src, pos + len("export"))
        key, pos, inherited = _key(src, pos, source, line)
        if inherited:
            value = lookup(key)
            if value is not None:
                out[key] = value
            continue
        value, pos = _value(src, pos, find, source, line, budget)
        out[key] = value


def parse_raw(text: str, lookup: Callable[[str], str | None], source: str) -> dict[str, str]:
    """The variables of an env_file in compose's `format: raw`, the format
    of `docker run --env-file`: KEY=VALUE a line, the value as written (no
    quotes, no interpolation); a bare KEY takes the environment's value;
    blank lines and lines starting with # are skipped."""
    out: dict[str, str] = {}
    for number, line in enumerate(text.lstrip("\ufeff").splitlines(), 1):
        line = line.lstrip()
        if not line or line.startswith("#"):
            continue
        key, eq, value = line.partition("=")
        if not key or any(c.isspace() for c in key):
            raise ComposeError(f"{source}, line {number}: a variable name cannot be empty or hold a space")
        if eq:
            out[key] = value
        elif (inherited := lookup(key)) is not None:
            out[key] = inherited
    return out


def _at(source: str, src: str, pos: int) -> str:
    """Where an error is: its line number, never its text (a file named by
    a hostile compose file may be a key or a password file)."""
    return f"{source}, line {src.count(chr(10), 0, pos) + 1}"


def _skip_space(src: str, pos: int) -> int:
    while pos < len(src) and src[pos] in _SPACE:
        pos += 1
    return pos


def _statement_start(src: str, pos: int) -> int:
    while True:
        pos = _WHITE.match(src, pos).end()  # type: ignore[union-attr]
        if not src.startswith("#", pos):
            return pos
        nl = src.find("\n", pos)
        if nl < 0:
            return len(src)
        pos = nl


def _key(src: str, pos: int, source: str, line: int) -> tuple[str, int, bool]:
    for i in range(pos, len(src)):
        ch = src[i]
        if ch in _SPACE:
            continue
        if ch in "=:\n":
            key = src[pos:i].rstrip()
            if " " in key or "\t" in key:
                raise ComposeError(f"{_at(source, src, line)}: key cannot contain a space")
            return key, _skip_space(src, i + 1), ch == "\n"
        if not (ch.isalnum() or ch in _KEY_CHARS):
            raise ComposeError(f"{_at(source, src, line)}: unexpected character {ch!r} in a variable name")
    return src[pos:].rstrip(), len(src), True  # a last line holding only a name


def _value(src: str, pos: int, lookup: Callable[[str], str | None], source: str, line: int,
           budget: list[int]) -> tuple[str, int]:
    if pos == len(src) or src[pos] not in "'\"":
        nl = src.find("\n", pos)
        end = len(src) if nl < 0 else nl
        value = src[pos:end].split(" #", 1)[0].rstrip()
        return substitute(value, lookup, budget=budget), min(end + 1, len(src))
    quote = src[pos]
    chars: list[str] = []
    escaped = False
    for i in range(pos + 1, len(src)):
        ch = src[i]
        if ch != quote:
            if not escaped and ch == "\\":
                escaped = True
                continue
            if escaped:
                escaped = False
                chars.append("\\")
            chars.append(ch)
            continue
        if escaped:  # \" or \' stays in the value, without its backslash
            escaped = False
            chars.append(ch)
            continue
        value = "".join(chars)
        if quote == '"':
            value = substitute(_ESCAPE.sub(_unescape, value), lookup, budget=budget)
        return value, i + 1
    raise ComposeError(f"{_at(source, src, line)}: unterminated quoted value")


def _unescape(m: re.Match[str]) -> str:
    text = m.group(0)
    if text.startswith("\\0"):
        digits = text[2:]
        # Go's \ooo: exactly three octal digits, at most 0377.
        if len(digits) == 3 and all(c in "01234567" for c in digits) and int(digits, 8) < 256:
            return chr(int(digits, 8))
        return text
    return _SIMPLE[text[1]]
