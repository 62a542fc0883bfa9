"""The build context: its files as .dockerignore leaves them, COPY's
sources in it (globs), and a content hash of what a COPY takes.

.dockerignore follows Docker's rules (moby's patternmatcher): one pattern
a line, `#` comments, `*` `?` `[...]` within a path component, `**` across
components, `!` re-includes, the last matching pattern wins, and a pattern
that matches a directory excludes everything below it.

The context may change while it is read (another process writing it).
What a build takes from it is therefore read beneath its root by
directory descriptors, through no symlink (a symlink is copied as one),
and a regular file is opened only if it still is the file looked at and
without waiting on it: nothing outside the context gets in, a FIFO
swapped in cannot hang the build.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import hashlib
import os
import posixpath
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .errors import BuildError

GLOB = re.compile(r"[*?\[]")
OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
TEXT_LIMIT = 4 << 20  # a Dockerfile or an ignore file larger than this is not one


def read_text(path: Path, what: str) -> str:
    """The text file `path` (a Dockerfile, an ignore file), read without
    waiting on it (a FIFO would block) and at most TEXT_LIMIT bytes, as a
    BuildError if it is anything else, or not UTF-8 text: a NUL would end
    the text for the parser, silently dropping what follows."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise BuildError(f"cannot read the {what} {path}: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which fails on a directory
            raise BuildError(f"the {what} {path} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(TEXT_LIMIT + 1)
    finally:
        os.close(fd)
    if len(data) > TEXT_LIMIT:
        raise BuildError(f"the {what} {path} is larger than {TEXT_LIMIT >> 20} MiB")
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        raise BuildError(f"the {what} {path} is not UTF-8 text (byte {e.start})") from None
    if "\0" in text:
        raise BuildError(f"the {what} {path} holds a NUL byte (line {text[:text.index(chr(0))].count(chr(10)) + 1})")
    return text


# .dockerignore patterns are matched a path component at a time, as Go's
# filepath.Match does, without backtracking (a regex of `*a*a*a*b` takes
# exponential time on a name of many `a`s): `*` by a two-pointer scan, `**`
# components by a set of positions. `**` counts as such as a whole
# component only; inside one it is a `*`.
ANY = "**"  # any number of components


@dataclass(frozen=True)
class _Class:
    """`[...]`, `[^...]` (ranges, `\\` escapes) or `?` (no ranges, negated)."""

    ranges: tuple[tuple[str, str], ...]
    negated: bool

    @classmethod
    def parse(cls, body: str) -> _Class:
        negated = body.startswith("^")
        ranges, i = [], int(negated)
        while i < len(body):
            lo, i = _char(body, i)
            hi = lo
            if body.startswith("-", i) and i + 1 < len(body):
                hi, i = _char(body, i + 1)
            if lo > hi:
                raise ValueError(f"bad range {lo}-{hi}")
            ranges.append((lo, hi))
        if not ranges:
            raise ValueError("empty character class")
        return cls(tuple(ranges), negated)

    def matches(self, c: str) -> bool:
        return any(lo <= c <= hi for lo, hi in self.ranges) != self.negated


def _char(text: str, i: int) -> tuple[str, int]:
    return (text[i + 1], i + 2) if text[i] == "\\" and i + 1 < len(text) else (text[i], i + 1)


Token = str | _Class  # "*", a literal character, or a class


def _tokens(component: str) -> list[Token]:
    tokens: list[Token] = []
    i = 0
    while i < len(component):
        c = component[i]
        end = component.find("]", i + 1) if c == "[" else -1
        if c == "*":
            if tokens[-1:] != ["*"]:
                tokens.append("*")
            i += 1
        elif c == "?":
            tokens.append(_Class((), True))
            i += 1
        elif end > 0:
            tokens.append(_Class.parse(component[i + 1:end]))
            i = end + 1
        else:
            c, i = _char(component, i)
            tokens.append(c if c != "*" else _Class(((c, c),), False))  # an escaped `*` is literal
    return tokens


def _match(tokens: list[Token], name: str) -> bool:
    """One component: after a mismatch, only the last `*` takes one more
    character (O(len(tokens) * len(name)))."""
    t = n = 0
    star, mark = -1, 0
    while n < len(name):
        tok = tokens[t] if t < len(tokens) else None
        if tok == "*":
            star, mark, t = t, n, t + 1
        elif tok is not None and (tok == name[n] if isinstance(tok, str) else tok.matches(name[n])):
            t, n = t + 1, n + 1
        elif star >= 0:
            t, mark = star + 1, mark + 1
            n = mark
        else:
            return False
    return all(tok == "*" for tok in tokens[t:])


def _compile(pattern: str) -> list[str | list[Token]]:
    parts: list[str | list[Token]] = [ANY if c == ANY else _tokens(c) for c in pattern.split("/")]
    if parts[-1] == ANY:  # a trailing `**` is at least one component (`dir/**` is not dir)
        parts.insert(-1, ["*"])
    return parts


def _skip_any(parts: list[str | list[Token]], states: set[int]) -> set[int]:
    """The positions reached when `**`s match no component."""
    out = set()
    for s in states:
        out.add(s)
        while s < len(parts) and parts[s] == ANY:
            s += 1
            out.add(s)
    return out


def _match_path(parts: list[str | list[Token]], path: str) -> bool:
    states = _skip_any(parts, {0})
    for name in path.split("/"):
        after = set()
        for s in states:
            part = parts[s] if s < len(parts) else None
            if part == ANY:
                after.add(s)  # one more component for it
            elif isinstance(part, list) and _match(part, name):
                after.add(s + 1)
        states = _skip_any(parts, after)
        if not states:
            return False
    return len(parts) in states


@dataclass(frozen=True)
class _Rule:
    parts: list[str | list[Token]]
    exclude: bool


class Ignore:
    def __init__(self, text: str = "") -> None:
        self.rules: list[_Rule] = []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            exclude = not line.startswith("!")
            pat = line.lstrip("!").strip()
            pat = posixpath.normpath(pat).lstrip("/") if pat not in ("", ".") else "."
            if pat and pat != ".":
                try:
                    self.rules.append(_Rule(_compile(pat), exclude))
                except ValueError as e:
                    raise BuildError(f".dockerignore line {number}: invalid pattern {line!r} ({e})") from None
        self.has_exceptions = any(not r.exclude for r in self.rules)

    def excluded(self, rel: str) -> bool:
        """Whether `rel` (or a directory above it) is excluded."""
        parents = [rel]
        while "/" in parents[-1]:
            parents.append(parents[-1].rsplit("/", 1)[0])
        result = False
        for rule in self.rules:
            if any(_match_path(rule.parts, p) for p in parents):
                result = rule.exclude
        return result


@dataclass(frozen=True)
class Source:
    """A COPY/ADD source: `rel` in the context, as named; `real`, what it
    is with symlinks resolved (inside the context); files below it for a
    directory."""

    rel: str  # "" for the context's root
    real: str
    is_dir: bool


class Context:
    def __init__(self, root: Path, dockerfile: Path | None = None) -> None:
        self.root = root.resolve()
        if not self.root.is_dir():
            raise BuildError(f"the build context {root} is not a directory")
        ignore = self.root / ".dockerignore"
        if dockerfile is not None and os.path.lexists(special := Path(f"{dockerfile}.dockerignore")):
            # Dockerfile-specific ignore file, as BuildKit reads it: beside
            # the Dockerfile, which -f may name outside the context.
            ignore = special
            if ignore.is_symlink() and not (self.inside(ignore) or _within(ignore, dockerfile.parent)):
                raise BuildError(f"{ignore.name} is a symlink leading outside the build context")
        elif ignore.is_symlink() and not self.inside(ignore):
            raise BuildError(".dockerignore is a symlink leading outside the build context")
        self.ignore = Ignore(read_text(ignore, "ignore file") if os.path.lexists(ignore) else "")
        self._listing: list[str] | None = None

    def inside(self, path: Path) -> bool:
        """Whether `path`, symlinks resolved, is in the context (a symlink
        loop leads nowhere: reading it says so)."""
        return _within(path, self.root)

    def listing(self) -> list[str]:
        """Every path of the context that .dockerignore keeps, sorted."""
        if self._listing is None:
            found = []
            for dirpath, dirnames, filenames in os.walk(self.root):
                rel_dir = os.path.relpath(dirpath, self.root)
                rel_dir = "" if rel_dir == "." else rel_dir
                keep_dirs = []
                for d in sorted(dirnames):
                    rel = posixpath.join(rel_dir, d)
                    if not self.ignore.excluded(rel):
                        found.append(rel)
                        keep_dirs.append(d)
                    elif self.ignore.has_exceptions:
                        keep_dirs.append(d)  # an exception may re-include something below
                dirnames[:] = keep_dirs
                found += [rel for f in filenames if not self.ignore.excluded(rel := posixpath.join(rel_dir, f))]
            # An excluded directory with something re-included below it is
            # there (Docker sends the parents of what it sends): COPY can name it.
            parents = {p.rsplit("/", i)[0] for p in found for i in range(1, p.count("/") + 1)}
            self._listing = sorted(set(found) | parents)
        return self._listing

    def sources(self, patterns: list[str]) -> list[Source]:
        """The context paths COPY's source arguments name (globs expanded)."""
        listing = set(self.listing())
        out = []
        for pattern in patterns:
            clean = posixpath.normpath("/" + pattern).lstrip("/")
            if clean.startswith(".."):
                raise BuildError(f"{pattern}: outside the build context")
            clean = "" if clean == "." else clean
            if GLOB.search(clean):
                depth = clean.count("/")
                hits = [p for p in sorted(listing) if p.count("/") == depth and fnmatch.fnmatchcase(p, clean)]
                if not hits:
                    raise BuildError(f"no file in the build context matches {pattern}")
            else:
                # Not listed but there: below a symlinked directory (the walk
                # does not follow them), which resolving checks below.
                if clean and clean not in listing and (self.ignore.excluded(clean) or
                                                       not os.path.lexists(self.root / clean)):
                    why = " (excluded by .dockerignore)" if os.path.lexists(self.root / clean) else ""
                    raise BuildError(f"{pattern} is not in the build context{why}")
                hits = [clean]
            for rel in hits:
                try:
                    real = (self.root / rel).resolve()
                except RuntimeError:
                    raise BuildError(f"{pattern}: a symlink loop") from None
                if not real.is_relative_to(self.root):
                    raise BuildError(f"{pattern}: a symlink leading outside the build context")
                real_rel = real.relative_to(self.root).as_posix()
                real_rel = "" if real_rel == "." else real_rel
                if real_rel and real_rel not in listing:
                    # What a symlink leads to must be sent too: .dockerignore
                    # keeps out what it excludes, whatever names it.
                    why = "excluded by .dockerignore" if real.exists() else "missing"
                    raise BuildError(f"{pattern}: a symlink to {real_rel}, which is not in the build context ({why})")
                out.append(Source(rel, real_rel, real.is_dir()))
        return out

    def files_below(self, source: Source) -> list[str]:
        """Context paths below a directory source, relative to it, sorted."""
        prefix = f"{source.real}/" if source.real else ""
        return [p[len(prefix):] for p in self.listing() if p.startswith(prefix)]

    def digest(self, sources: list[Source]) -> str:
        """A hash of what the sources hold: names, types, modes, link
        targets and contents (the cache key of a COPY)."""
        h = hashlib.sha256()
        for src in sources:
            h.update(b"\0src " + os.fsencode(src.rel) + b"\0")
            for rel in [""] + (self.files_below(src) if src.is_dir else []):
                path = posixpath.join(src.real, rel) if rel else src.real
                st = self.lstat(path)
                h.update(os.fsencode(rel) + f"\0{stat.S_IFMT(st.st_mode)}\0{stat.S_IMODE(st.st_mode)}\0".encode())
                if stat.S_ISLNK(st.st_mode):
                    h.update(os.fsencode(self.readlink(path)))
                elif stat.S_ISREG(st.st_mode):
                    with self.open(path, st) as f:
                        h.update(file_digest(f).encode())
                h.update(b"\0")
        return h.hexdigest()

    # ---- reading beneath the root ------------------------------------

    @contextlib.contextmanager
    def _parent(self, rel: str) -> Iterator[tuple[int, str]]:
        """(a descriptor of rel's directory, rel's name), reached from the
        root through no symlink."""
        *dirs, name = rel.split("/") if rel else ["."]
        try:
            fd = os.open(self.root, OPEN_DIR)
        except OSError as e:
            raise BuildError(f"cannot read the build context: {e.strerror}") from None
        try:
            for part in dirs:
                try:
                    fd, old = os.open(part, OPEN_DIR, dir_fd=fd), fd
                except OSError as e:
                    raise self._changed(rel, e) from None
                os.close(old)
            yield fd, name
        finally:
            os.close(fd)

    def _changed(self, rel: str, e: OSError) -> BuildError:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT, errno.EINVAL):  # EINVAL: readlink, no link now
            return BuildError(f"{rel} in the build context changed while it was read (a symlink or gone now)")
        return BuildError(f"cannot read {rel} in the build context: {e.strerror}")

    def lstat(self, rel: str) -> os.stat_result:
        with self._parent(rel) as (fd, name):
            try:
                return os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError as e:
                raise self._changed(rel, e) from None

    def readlink(self, rel: str) -> str:
        with self._parent(rel) as (fd, name):
            try:
                return os.readlink(name, dir_fd=fd)
            except OSError as e:
                raise self._changed(rel, e) from None

    def open(self, rel: str, st: os.stat_result | None = None) -> BinaryIO:
        """The regular file `rel`, opened through no symlink and without
        waiting (on a FIFO); if `st` is given, it must be that very file."""
        with self._parent(rel) as (fd, name):
            try:
                f = os.fdopen(os.open(name, OPEN_FILE, dir_fd=fd), "rb")
            except OSError as e:
                raise self._changed(rel, e) from None
        now = os.fstat(f.fileno())
        if not stat.S_ISREG(now.st_mode) or (st is not None and (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino)):
            f.close()
            raise BuildError(f"{rel} in the build context changed while it was read (another file now)")
        return f


def _within(path: Path, directory: Path) -> bool:
    try:
        return path.resolve().is_relative_to(directory.resolve())
    except RuntimeError:  # a symlink loop
        return True


def file_digest(f: BinaryIO | Path) -> str:
    h = hashlib.sha256()
    with open(f, "rb") if isinstance(f, Path) else contextlib.nullcontext(f) as src:
        while chunk := src.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
