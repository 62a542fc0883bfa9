"""COPY and ADD: which files go where, as Docker decides it, written as
one layer tar (layer.py).

- Sources: build-context paths and globs (.dockerignore applied; context.py),
  another stage's or image's files (`--from`, read from its layer blobs;
  fsview.py), heredocs (`COPY <<EOF /path`, variables expanded unless the
  delimiter is quoted), and for ADD a URL (downloaded) or a local tar
  archive (extracted, whatever its compression).
- Destination: relative to WORKDIR; a directory if it ends in `/`, if
  there are several sources, or if the image already has a directory
  there; symlinks in it, and below it, resolve inside the image (layer.py).
- Owners: root unless `--chown` (names from the image's /etc/passwd and
  /etc/group), also of the directories COPY creates; context files keep
  their mode and mtime unless `--chmod`, and a directory copied to a new
  destination gives it its mode; `--from` files keep their owners too.
"""

from __future__ import annotations

import fnmatch
import itertools
import lzma
import posixpath
import re
import stat
import tarfile
import urllib.parse
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..init import users
from .context import GLOB, Context, Source
from .fsview import View, copy_data, norm
from .layer import LayerWriter
from .parse import Heredoc, Instruction


@dataclass
class Plan:
    """What one COPY/ADD takes, resolved before the cache is asked."""

    ins: Instruction
    sources: list[str]  # expanded source arguments
    dest: str  # absolute, in the image
    owner: tuple[int, int] | None
    mode: int | None
    context: list[Source] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    heredocs: list[Heredoc] = field(default_factory=list)  # variables expanded


def plan(ins: Instruction, expand: Callable[[str], str], workdir: str, ctx: Context | None) -> Plan:
    words = [w if w.startswith("<<") and ins.heredocs else expand(w) for w in ins.args]
    if len(words) < 2:
        raise ins.error(f"{ins.cmd} needs a source and a destination")
    *sources, dest = words
    dest_abs = posixpath.join(workdir or "/", dest) + ("/" if dest.endswith("/") or dest in (".", "..") else "")
    mode = None
    if chmod := ins.flags.get("chmod"):
        # int() alone takes a sign, "0o" or more digits, whose extra bits would become setuid and the like
        if not re.fullmatch(r"0*[0-7]{1,4}", chmod):
            raise ins.error(f"--chmod takes an octal mode from 0 to 7777, not {chmod!r}")
        mode = int(chmod, 8)
    p = Plan(ins, sources, dest_abs, None, mode, heredocs=_heredocs(ins, expand))
    if len(sources) > 1 and not dest_abs.endswith("/"):
        raise ins.error(f"with more than one source, the destination must be a directory ending in /: {dest}")
    if ins.cmd == "ADD":
        p.urls = [s for s in sources if _scheme(ins, s) in ("http", "https")]
    if "from" not in ins.flags and ctx is not None:
        local = [s for s in sources if s not in p.urls and not (s.startswith("<<") and ins.heredocs)]
        try:
            p.context = ctx.sources(local) if local else []
        except Exception as e:
            raise ins.error(str(getattr(e, "message", e))) from None
    return p


def _scheme(ins: Instruction, source: str) -> str:
    try:
        return urllib.parse.urlparse(source).scheme
    except ValueError as e:  # http://[::1
        raise ins.error(f"{source}: not a URL ({e})") from None


def _heredocs(ins: Instruction, expand: Callable[[str], str]) -> list[Heredoc]:
    """As BuildKit reads them: variables expanded unless the delimiter is
    quoted (<<"EOF", <<'EOF')."""
    marks = [w for w in ins.args if w.startswith("<<")]
    return [h if re.search(r"[\"'\\]", mark) else replace(h, content=_expand_text(ins, h.content, expand))
            for h, mark in zip(ins.heredocs, marks)]


def _expand_text(ins: Instruction, text: str, expand: Callable[[str], str]) -> str:
    """Variables expanded, quotes kept as written (BuildKit's heredoc
    expansion): they go through `expand` as characters the text does not
    hold (private-use ones), so that they neither quote nor are removed."""
    used = set(text)
    free = (c for c in map(chr, itertools.chain(range(0xE000, 0xF900), range(0xF0000, 0x10FFFE))) if c not in used)
    double, single = next(free, None), next(free, None)
    if double is None or single is None:
        raise ins.error("the heredoc holds every private-use character: write it with a quoted delimiter (<<'EOF')")
    text = expand(text.translate({ord('"'): double, ord("'"): single}))
    return text.translate({ord(double): '"', ord(single): "'"})


def owner_of(ins: Instruction, chown: str, view: View) -> tuple[int, int]:
    """`--chown=USER[:GROUP]` as ids of the image's own users."""
    user, _, group = chown.partition(":")
    passwd = (view.read("/etc/passwd") or b"").decode(errors="replace")
    groups = (view.read("/etc/group") or b"").decode(errors="replace")
    found = users.lookup(f"{user}:{group}" if group else user, passwd, groups)
    if found is None:
        raise ins.error(f"--chown={chown}: no such user or group in the image's /etc/passwd or /etc/group")
    return found.uid, (found.gid if group or not user.isdigit() else found.uid)


def _target(view: View, dest: str, name: str, into_dir: bool) -> str:
    """Where a source named `name` lands."""
    if into_dir:
        return posixpath.join(view.resolve(dest), name)
    parent, base = posixpath.split(dest.rstrip("/"))
    return posixpath.join(view.resolve(parent), base)


def write_context(p: Plan, ctx: Context, view: View, out: LayerWriter) -> None:
    globbed = any(GLOB.search(s) for s in p.sources)
    into_dir = p.dest.endswith("/") or globbed or view.is_dir(view.resolve(p.dest))
    for src in p.context:
        if src.is_dir:
            base = view.resolve(p.dest)
            if not view.is_dir(base):  # made here: the source's mode and the COPY's owner, as BuildKit does
                out.add_context_file(base, ctx, src.real, owner=p.owner, mode=p.mode)
            for rel in ctx.files_below(src):
                out.add_context_file(posixpath.join(base, rel), ctx, posixpath.join(src.real, rel), owner=p.owner,
                                     mode=p.mode)
        else:
            out.add_context_file(_target(view, p.dest, posixpath.basename(src.rel), into_dir), ctx, src.real,
                                 owner=p.owner, mode=p.mode)
    for h in p.heredocs:
        out.add_bytes(_target(view, p.dest, h.name, into_dir or len(p.heredocs) > 1), h.content.encode(),
                      owner=p.owner, mode=p.mode or 0o644)


def write_from(p: Plan, src_view: View, view: View, out: LayerWriter) -> None:
    """COPY --from: members of another image's layers."""
    into_dir = p.dest.endswith("/") or view.is_dir(view.resolve(p.dest))
    wanted: dict[Path, dict[str, list[str]]] = {}
    targets: dict[Path, set[str]] = {}
    for pattern in p.sources:
        clean = norm(pattern)
        if GLOB.search(clean):
            depth = clean.count("/")
            hits = [k for k in sorted(src_view.entries) if k.count("/") == depth and fnmatch.fnmatchcase(k, clean)]
            into_dir = True
        else:
            hits = [src_view.resolve(clean)]
        for path in hits:
            entry = src_view.get(path)
            if entry is None and path:
                raise p.ins.error(f"{pattern} does not exist in the --from={p.ins.flags['from']} image")
            if path == "" or entry.info.isdir():  # type: ignore[union-attr]
                base = view.resolve(p.dest)
                if entry is not None and not view.is_dir(base):  # made here: as the source directory
                    out.add(base, entry.info, owner=p.owner, mode=p.mode)
                members = [(k, posixpath.join(base, k[len(path):].lstrip("/"))) for k in src_view.below(path)]
            else:
                members = [(path, _target(view, p.dest, posixpath.basename(path), into_dir))]
            for name, dest in members:
                e = src_view.entries[name]
                if e.info.isreg() or e.info.islnk():
                    wanted.setdefault(e.blob, {}).setdefault(name, []).append(dest)
                    if e.info.islnk():
                        targets.setdefault(e.blob, set()).add(norm(e.info.linkname))
                else:  # directories, symlinks: no data; written first, parents before children
                    out.add(dest, e.info, owner=p.owner, mode=p.mode)
    copy_data(wanted, targets, lambda dest, info, data: out.add(dest, info, data, owner=p.owner, mode=p.mode))


def is_archive(ctx: Context, src: Source) -> bool:
    if not stat.S_ISREG(ctx.lstat(src.real).st_mode):
        return False  # a FIFO, say: copied as COPY would
    with ctx.open(src.real) as f:
        try:
            with tarfile.open(fileobj=f, mode="r:*") as tf:
                return tf.next() is not None
        except (tarfile.TarError, OSError, EOFError):
            return False


def write_archive(p: Plan, ctx: Context, src: Source, view: View, out: LayerWriter) -> None:
    """ADD of a local tar: its members under the destination directory."""
    base = view.resolve(p.dest)
    try:
        with ctx.open(src.real) as f, tarfile.open(fileobj=f, mode="r:*") as tf:
            for m in tf:
                name = norm(m.name)
                if not name or posixpath.basename(name).startswith(".wh.") or m.ischr() or m.isblk():
                    continue
                if m.islnk():
                    m.linkname = posixpath.join(base, norm(m.linkname))
                out.add(posixpath.join(base, name), m, tf.extractfile(m) if m.isreg() else None, owner=p.owner)
    # A truncated or corrupt archive: what its decompressor or tarfile
    # says (an OSError with an errno is the disk's, not the archive's).
    except (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError) as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise
        raise p.ins.error(f"{src.rel}: the archive cannot be read ({e or type(e).__name__})") from None
