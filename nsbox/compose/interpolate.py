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
# Characters matching may scan, and substitution make, in one file: well
# under a second, and a bound on what `A1=$A0$A0`, `A2=$A1$A1`... can grow to.
BUDGET = 50_000_000


class _Missing(Exception):
    def __init__(self, name: str, reason: str) -> None:
        self.name, self.reason = name, reason


def substitute(template: str, lookup: Callable[[str], str | None], unset: list[str] | None = None,
               budget: list[int] | None = None) -> str:
    """`template` with its variables replaced. `lookup` returns a variable's
    value or None when unset; names used while unset are appended to `unset`.
    `budget` ([characters]) is what matching may scan and substitution
    make, shared by the calls given the same one. Raises ComposeError for
    a missing required variable, a bad template, or one that costs more
    than the budget."""
    budget = [BUDGET] if budget is None else budget
    try:
        return _substitute(template, lookup, unset, budget)
    except _Missing as e:
        msg = f"required variable {e.name} is missing a value"
        raise ComposeError(msg + (f": {e.reason}" if e.reason else ""),
                           hint=f"set {e.name} in the environment or in the .env file next to the compose file") from None
    except RecursionError:
        raise ComposeError(f"interpolation templates nested too deeply in {template[:60]!r}...") from None


def _substitute(template: str, lookup: Callable[[str], str | None], unset: list[str] | None,
                budget: list[int]) -> str:
    out: list[str] = []
    # compose-go substitutes what follows a template's closing brace (up to
    # the end of its greedy match) on its own, recursively; a stack of
    # (text, position) does the same without one Python frame per template.
    stack = [(template, 0)]
    while stack:
        text, pos = stack.pop()
        m = _PATTERN.search(text, pos)
        if m is None:
            out.append(text[pos:])
            continue
        out.append(text[pos:m.start()])
        # A braced template's match runs to the last "}" of its line, and
        # what follows its closing brace is scanned again: many templates on
        # one long line cost their number times its length.
        _charge(budget, m.end() - m.start(), template)
        value, rest = _replace(m.group(0), template, lookup, unset, budget)
        _charge(budget, len(value), template)
        out.append(value)
        stack.append((text, m.end()))
        if rest:
            stack.append((rest, 0))
    return "".join(out)


def _replace(text: str, template: str, lookup: Callable[[str], str | None],
             unset: list[str] | None, budget: list[int]) -> tuple[str, str]:
    """The value of the template `text` begins with, and the text after it."""
    close = _closing_brace(text)
    rest = ""
    if close >= 0:
        text, rest = text[:close + 1], text[close + 1:]
    m = _PATTERN.fullmatch(text)
    if m is None or m.group("invalid") is not None:
        raise ComposeError(f"invalid interpolation template {template!r}",
                           hint="write $$ for a literal $")
    if m.group("escaped"):
        return "$", rest
    if m.group("named"):
        return _value(m.group("named"), lookup, unset), rest
    body = m.group("braced")
    name = _NAME.match(body).group(0)  # type: ignore[union-attr]
    op_text = body[len(name):]
    if not op_text:
        return _value(name, lookup, unset), rest
    op = ":" + op_text[1] if op_text[0] == ":" else op_text[0]
    arg = op_text[len(op):]
    value = lookup(name)
    if op in (":?", "?"):
        if value is None or (op == ":?" and value == ""):
            raise _Missing(name, _substitute(arg, lookup, unset, budget))
        result = value
    elif op in (":-", "-"):
        result = _substitute(arg, lookup, unset, budget) if value is None or (op == ":-" and value == "") else value
    else:  # ":+", "+": the alternative when set (and, for ":+", not empty)
        result = _substitute(arg, lookup, unset, budget) if value is not None and (op == "+" or value != "") else (value or "")
    return result, rest


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


def _charge(budget: list[int], characters: int, template: str) -> None:
    budget[0] -= characters
    if budget[0] < 0:
        raise ComposeError(f"interpolation of {template[:60]!r}... is too costly: it scans or makes more than "
                           f"{BUDGET:,} characters",
                           hint="split long lines that hold many ${...} templates; values of variables that hold "
                                "others grow with each")


def interpolate(value: Any, environ: Mapping[str, str], unset: list[str] | None = None,
                budget: list[int] | None = None) -> Any:
    """Every string value of a parsed YAML tree interpolated (keys are not,
    as in compose), all within one budget."""
    budget = [BUDGET] if budget is None else budget
    if isinstance(value, str):
        return substitute(value, environ.get, unset, budget)
    if isinstance(value, dict):
        return {k: interpolate(v, environ, unset, budget) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, environ, unset, budget) for v in value]
    return value


def unset_warning(name: str) -> str:
    return f'the "{name}" variable is not set; defaulting to a blank string'
