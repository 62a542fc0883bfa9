"""Dockerfile words: variable expansion and quote removal, as BuildKit's
shell lexer does them for FROM, COPY, ENV, LABEL, WORKDIR, USER and the like.

`$VAR`, `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:+alt}`,
`${VAR+alt}`, `${VAR:?message}`; single quotes are literal, double quotes
expand; the escape character (backslash, or a backtick after
`# escape=`` ` ``) quotes the next character. RUN, CMD and ENTRYPOINT are not
expanded here: their shell does it.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import NsboxError


# Bounds far above any real Dockerfile, so that `ARG B=$A$A` repeated
# (each doubling) or `${X:-${X:-...}}` nested thousands deep is an error,
# not all memory or a RecursionError.
WORD_LIMIT = 1 << 20  # characters the variables of one expansion (a word, a heredoc) give
DEPTH_LIMIT = 100  # ${...} nested in ${...}


class WordError(NsboxError):
    pass


def expand(word: str, env: Mapping[str, str], escape: str = "\\") -> str:
    """One word with variables expanded and quotes removed."""
    return _Lexer(word, env, escape).word(stop="")


def split_expand(text: str, env: Mapping[str, str], escape: str = "\\") -> list[str]:
    """Whitespace-separated words (quotes group), each expanded."""
    lexer = _Lexer(text, env, escape)
    words = []
    while True:
        lexer.skip_space()
        if lexer.done:
            return words
        words.append(lexer.word(stop=" \t\n"))


class _Lexer:
    def __init__(self, text: str, env: Mapping[str, str], escape: str) -> None:
        self.text, self.env, self.esc, self.i = text, env, escape, 0
        self.expanded, self.depth = 0, 0

    @property
    def done(self) -> bool:
        return self.i >= len(self.text)

    def skip_space(self) -> None:
        while not self.done and self.text[self.i] in " \t\n":
            self.i += 1

    def word(self, stop: str) -> str:
        out = []
        while not self.done and self.text[self.i] not in stop:
            c = self.text[self.i]
            self.i += 1
            if c == "'":
                end = self.text.find("'", self.i)
                if end < 0:
                    raise WordError(f"unterminated single quote in {self.text!r}")
                out.append(self.text[self.i:end])
                self.i = end + 1
            elif c == '"':
                out.append(self._double())
            elif c == self.esc and not self.done:
                out.append(self.text[self.i])
                self.i += 1
            elif c == "$":
                out.append(self._var())
            else:
                out.append(c)
        return "".join(out)

    def _double(self) -> str:
        out = []
        while True:
            if self.done:
                raise WordError(f"unterminated double quote in {self.text!r}")
            c = self.text[self.i]
            self.i += 1
            if c == '"':
                return "".join(out)
            if c == self.esc and not self.done and self.text[self.i] in ('"', "$", self.esc):
                out.append(self.text[self.i])
                self.i += 1
            elif c == "$":
                out.append(self._var())
            else:
                out.append(c)

    def _name(self) -> str:
        start = self.i
        while not self.done and (self.text[self.i].isalnum() or self.text[self.i] == "_"):
            self.i += 1
        return self.text[start:self.i]

    def _var(self) -> str:
        if self.done:
            return "$"
        if self.text[self.i] != "{":
            name = self._name()
            return self._used(self.env.get(name, "")) if name else "$"
        self.i += 1
        name = self._name()
        if self.done:
            raise WordError(f"missing '}}' in {self.text!r}")
        if self.text[self.i] == "}":
            self.i += 1
            return self._used(self.env.get(name, ""))
        op = self.text[self.i]
        colon = op == ":"
        if colon:
            self.i += 1
            op = self.text[self.i] if not self.done else ""
        if op not in ("-", "+", "?"):
            raise WordError(f"unsupported modifier in ${{{name}{':' if colon else ''}{op}...}} in {self.text!r}")
        self.i += 1
        self.depth += 1
        if self.depth > DEPTH_LIMIT:
            raise WordError(f"${{...}} nested more than {DEPTH_LIMIT} deep")
        arg = self.word(stop="}")
        self.depth -= 1
        if self.done:
            raise WordError(f"missing '}}' in {self.text!r}")
        self.i += 1
        value = self.env.get(name)
        is_set = value is not None and (value != "" or not colon)
        if op == "-":
            return self._used(value) if is_set else arg  # type: ignore[arg-type]
        if op == "+":
            return arg if is_set else ""
        if not is_set:
            raise WordError(f"{name}: {arg or 'is not set'}")
        return self._used(value)  # type: ignore[arg-type]

    def _used(self, value: str) -> str:
        """A variable's value, counted against WORD_LIMIT."""
        self.expanded += len(value)
        if self.expanded > WORD_LIMIT:
            raise WordError(f"variables expand to more than {WORD_LIMIT >> 20} MiB")
        return value
