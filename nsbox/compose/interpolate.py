"""Variable interpolation in compose files, as `docker compose` does it.

Mirrors compose-go's template package: `$VAR`, `${VAR}`, `${VAR:-default}`,
`${VAR-default}`, `${VAR:?err}`, `${VAR?err}`, `${VAR:+alt}`, `${VAR+alt}`,
`$$` for a literal `$`, defaults that hold further templates. A `$` not
followed by a name, `$` or `{` stays literal; `${` not followed by a valid
template is an error. An unset variable without a default becomes "" with a
warning, as compose's "The "X" variable is not set" does.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

from .errors import ComposeError

# compose-go's pattern: the braced form's `.*` is greedy (to the last `}` on
# the line); the closing brace that matches is found by counting afterwards.
_PATTERN = re.compile(
    r"\$(?i:(?P<escaped>\$)|(?P<named>[_a-z][_a-z0-9]*)"
    r"|\{(?:(?P<braced>[_a-z][_a-z0-9]*(?::?[-+?].*)?)\}|(?P<invalid>)))"
)
_OPERATORS = (":?", "?", ":-", "-", ":+", "+")
_NAME = re.compile(r"[_a-zA-Z][_a-zA-Z0-9]*")


class _Missing(Exception):
    def __init__(self, name: str, reason: str) -> None:
        self.name, self.reason = name, reason


def substitute(template: str, lookup: Callable[[str], str | None], unset: list[str] | None = None) -> str:
    """`template` with its variables replaced. `lookup` returns a variable's
    value or None when unset; names used while unset are appended to `unset`.
    Raises ComposeError for a missing required variable or a bad template."""
    try:
        return _substitute(template, lookup, unset)
    except _Missing as e:
        msg = f"required variable {e.name} is missing a value"
        raise ComposeError(msg + (f": {e.reason}" if e.reason else ""),
                           hint=f"set {e.name} in the environment or in the .env file next to the compose file") from None


def _substitute(template: str, lookup: Callable[[str], str | None], unset: list[str] | None) -> str:
    out: list[str] = []
    pos = 0
    for m in _PATTERN.finditer(template):
        out.append(template[pos:m.start()])
        pos = m.end()
        out.append(_replace(m.group(0), template, lookup, unset))
    out.append(template[pos:])
    return "".join(out)


def _replace(text: str, template: str, lookup: Callable[[str], str | None], unset: list[str] | None) -> str:
    close = _closing_brace(text)
    rest = ""
    if close >= 0:
        text, rest = text[:close + 1], text[close + 1:]
    m = _PATTERN.fullmatch(text)
    if m is None or m.group("invalid") is not None:
        raise ComposeError(f"invalid interpolation template {template!r}",
                           hint="write $$ for a literal $")
    if m.group("escaped"):
        return "$"
    if m.group("named"):
        return _value(m.group("named"), lookup, unset)
    body = m.group("braced")
    name = _NAME.match(body).group(0)  # type: ignore[union-attr]
    op_text = body[len(name):]
    if not op_text:
        return _value(name, lookup, unset) + _substitute(rest, lookup, unset)
    op = ":" + op_text[1] if op_text[0] == ":" else op_text[0]
    arg = op_text[len(op):]
    value = lookup(name)
    if op in (":?", "?"):
        if value is None or (op == ":?" and value == ""):
            raise _Missing(name, _substitute(arg, lookup, unset))
        result = value
    elif op in (":-", "-"):
        result = _substitute(arg, lookup, unset) if value is None or (op == ":-" and value == "") else value
    else:  # ":+", "+": the alternative when set (and, for ":+", not empty)
        result = _substitute(arg, lookup, unset) if value is not None and (op == "+" or value != "") else (value or "")
    return result + _substitute(rest, lookup, unset)


def _value(name: str, lookup: Callable[[str], str | None], unset: list[str] | None) -> str:
    value = lookup(name)
    if value is None:
        if unset is not None and name not in unset:
            unset.append(name)
        return ""
    return value


def _closing_brace(s: str) -> int:
    """Index of the `}` closing the first `{`, counting nested braces."""
    depth = 0
    i = 0
    while i < len(s):
        if s[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        if s[i] == "{":
            depth += 1
            i += 1  # as compose-go does: the character after "{" is not examined
        i += 1
    return -1


def interpolate(value: Any, environ: Mapping[str, str], unset: list[str] | None = None) -> Any:
    """Every string value of a parsed YAML tree interpolated (keys are not,
    as in compose)."""
    lookup = environ.get
    if isinstance(value, str):
        return substitute(value, lookup, unset)
    if isinstance(value, dict):
        return {k: interpolate(v, environ, unset) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, environ, unset) for v in value]
    return value


def unset_warning(name: str) -> str:
    return f'the "{name}" variable is not set; defaulting to a blank string'
