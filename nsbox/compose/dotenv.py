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
from .interpolate import substitute

_ESCAPE = re.compile(r'\\(?:[abcfnrtv$"\\]|0\d{0,3})')
_SIMPLE = {"a": "\a", "b": "\b", "c": "\\c", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
           '"': '"', "\\": "\\", "$": "$$"}
_KEY_CHARS = set("_.-[]")
_SPACE = "\t\v\f\r \x85\xa0"  # spaces, but not the newline


def parse(text: str, lookup: Callable[[str], str | None], source: str) -> dict[str, str]:
    """The variables a dotenv text sets, in order. `source` names it in errors."""
    out: dict[str, str] = {}
    rest = text.lstrip("\ufeff")

    def find(name: str) -> str | None:
        value = lookup(name)
        return out.get(name) if value is None else value

    while True:
        rest = _statement_start(rest)
        if not rest:
            return out
        line = rest.split("\n", 1)[0]
        if re.match(r"export\s", rest):
            rest = rest[len("export"):].lstrip(_SPACE)
        key, rest, inherited = _key(rest, source, line)
        if inherited:
            value = lookup(key)
            if value is not None:
                out[key] = value
            continue
        value, rest = _value(rest, find, source, line)
        out[key] = value


def _statement_start(src: str) -> str:
    while True:
        src = src.lstrip()
        if not src.startswith("#"):
            return src
        nl = src.find("\n")
        if nl < 0:
            return ""
        src = src[nl:]


def _key(src: str, source: str, line: str) -> tuple[str, str, bool]:
    for i, ch in enumerate(src):
        if ch in _SPACE:
            continue
        if ch in "=:\n":
            key = src[:i].rstrip()
            if " " in key or "\t" in key:
                raise ComposeError(f"{source}: key cannot contain a space: {line!r}")
            return key, src[i + 1:].lstrip(_SPACE), ch == "\n"
        if not (ch.isalnum() or ch in _KEY_CHARS):
            raise ComposeError(f"{source}: unexpected character {ch!r} in variable name {line!r}")
    return src.rstrip(), "", True  # a last line holding only a name


def _value(src: str, lookup: Callable[[str], str | None], source: str, line: str) -> tuple[str, str]:
    if not src or src[0] not in "'\"":
        value, _, rest = src.partition("\n")
        value = value.split(" #", 1)[0].rstrip()
        return substitute(value, lookup), rest
    quote = src[0]
    chars: list[str] = []
    escaped = False
    for i in range(1, len(src)):
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
            value = substitute(_ESCAPE.sub(_unescape, value), lookup)
        return value, src[i + 1:]
    raise ComposeError(f"{source}: unterminated quoted value {line!r}")


def _unescape(m: re.Match[str]) -> str:
    text = m.group(0)
    if text.startswith("\\0"):
        digits = text[2:]
        # Go's \ooo: exactly three octal digits, at most 0377.
        if len(digits) == 3 and all(c in "01234567" for c in digits) and int(digits, 8) < 256:
            return chr(int(digits, 8))
        return text
    return _SIMPLE[text[1]]
