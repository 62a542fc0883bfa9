"""`nsbox build` against a hostile Dockerfile and build context: what a
build takes from the host is the context's own files, nothing else, and
what a RUN step starts ends with it.

Every test runs in each identity mode (tests/run.sh).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import secrets
import socket
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import anyio
import psutil
import pytest

import nsbox
from nsbox.dockerfile import BuildError, build_image
from nsbox.dockerfile.context import Context
from nsbox.storage import Store, oci

from tests.conftest import MODE
from tests.net_members import loopback_http
from .test_build import busybox, context, name  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(300)

SWAP_RACE = Path(__file__).resolve().parents[1] / "swap_race.c"


@pytest.fixture(scope="module")
def swap_race_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/swap_race.c, linked statically: it runs in a busybox image too."""
    out = tmp_path_factory.mktemp("swap") / "swap_race"
    subprocess.run(["cc", "-O2", "-static", "-o", str(out), str(SWAP_RACE)], check=True, timeout=60)
    return out


@pytest.fixture
def swap_race(swap_race_program: Path) -> bytes:
    return swap_race_program.read_bytes()


@pytest.fixture
def host_secret() -> Iterator[tuple[str, bytes]]:
    """(path, bytes) of a host file the build's helpers could read: one
    made for the test as root; a user cannot write where they look (the
    host's /etc and /usr), so there a file every Debian host has."""
    if MODE.mode != "root":
        path = "/usr/lib/os-release"
        yield path, Path(path).read_bytes()
        return
    path = Path(f"/etc/nsbox-build-secret-{secrets.token_hex(6)}")
    data = f"host secret {secrets.token_hex(16)}\n".encode()
    path.write_bytes(data)
    path.chmod(0o644)
    try:
        yield str(path), data
    finally:
        path.unlink()


def layer_members(image_digest: str) -> Iterator[tuple[tarfile.TarInfo, bytes | None]]:
    """Every member of the image's layers, with the data of regular files."""
    store = Store()
    for d in oci.layer_descriptors(store.read_json(image_digest)):
        with tarfile.open(store.blob_path(d["digest"]), "r:*") as tf:
            for m in tf:
                f = tf.extractfile(m) if m.isreg() else None
                yield m, f.read() if f is not None else None


def last_layer(image_digest: str) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    store = Store()
    last = oci.layer_descriptors(store.read_json(image_digest))[-1]
    with tarfile.open(store.blob_path(last["digest"]), "r:*") as tf:
        return [(m, f.read() if (f := tf.extractfile(m) if m.isreg() else None) else None) for m in tf]


def processes_with(token: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if token in (p.info["cmdline"] or []):
            found.append(p)
    return found


def racing_dockerfile(base: str, kind: str, target: str, token: str) -> str:
    # The step leaves swap_race running; its own command ends once the
    # swapping has begun.
    return (f"FROM {base}\nCOPY swap_race /swap_race\n"
            f"RUN /swap_race {kind} /race 64 {target} {token} </dev/null >/dev/null 2>&1 & "
            "while [ ! -e /race.ready ]; do sleep 0.02; done\n")


@pytest.mark.timeout(400)
async def test_a_racing_run_process_gets_no_host_file_into_the_layer(
        tmp_path: Path, name: str, busybox: str, swap_race: bytes, host_secret: tuple[str, bytes]) -> None:
    # The archiver looks at a name, then opens it: a process swapping a
    # regular file with a symlink to a host file in between would have it
    # archive the host file, were the process still running and the open
    # following symlinks.
    target, secret = host_secret
    token = f"race-{secrets.token_hex(6)}"
    ctx = context(tmp_path, racing_dockerfile(busybox, "symlink", target, token), {"swap_race": swap_race})
    (ctx / "swap_race").chmod(0o755)
    for _ in range(3):
        with anyio.fail_after(120):
            result = await build_image(ctx, tag=name, network="none", no_cache=True, progress=lambda _: None)
        assert processes_with(token) == []
        race = [(m, data) for m, data in layer_members(result.digest) if m.name.startswith("race/")]
        assert len(race) == 128, [m.name for m, _ in race]
        for m, data in race:
            assert m.isreg() or (m.issym() and m.linkname == target), (m.name, m.type)
            assert data in (None, b"harmless\n"), (m.name, data[:200])
        assert all(secret not in (data or b"") for _, data in layer_members(result.digest))


@pytest.mark.timeout(300)
async def test_a_fifo_swapped_in_does_not_hang_the_build(
        tmp_path: Path, name: str, busybox: str, swap_race: bytes) -> None:
    # Opening a FIFO waits for a writer that never comes.
    token = f"race-{secrets.token_hex(6)}"
    ctx = context(tmp_path, racing_dockerfile(busybox, "fifo", "-", token), {"swap_race": swap_race})
    (ctx / "swap_race").chmod(0o755)
    for _ in range(2):
        with anyio.fail_after(90):
            result = await build_image(ctx, tag=name, network="none", no_cache=True, progress=lambda _: None)
        assert processes_with(token) == []
        race = [(m, data) for m, data in layer_members(result.digest) if m.name.startswith("race/")]
        assert len(race) == 128
        assert all((m.isreg() and data == b"harmless\n") or m.isfifo() for m, data in race)


def test_the_archiver_opens_only_what_it_looked_at(tmp_path: Path) -> None:
    # The archiver's second guard, should a process still run: a name
    # swapped for a symlink or a FIFO after it was looked at is not opened
    # through, and not waited on.
    from nsbox.dockerfile import capture_tar

    (tmp_path / "f").write_text("harmless\n")
    os.symlink("/etc/passwd", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        looked = os.stat("f", dir_fd=dfd, follow_symlinks=False)
        for swapped in ("link", "fifo"):
            os.rename(tmp_path / swapped, tmp_path / "f")
            with pytest.raises(capture_tar.Changed):
                capture_tar.opened("f", dfd, capture_tar.OPEN_FILE, looked)
        (tmp_path / "f").unlink()
        (tmp_path / "f").write_text("harmless\n")
        looked = os.stat("f", dir_fd=dfd, follow_symlinks=False)
        os.close(capture_tar.opened("f", dfd, capture_tar.OPEN_FILE, looked))
    finally:
        os.close(dfd)


async def test_run_layer_keeps_links_and_fifos_as_they_are(tmp_path: Path, name: str, busybox: str) -> None:
    # Archived without following anything: symlinks stay symlinks (even
    # to host paths), hardlinks stay one file, a FIFO is a FIFO.
    ctx = context(tmp_path, f"FROM {busybox}\nRUN mkdir /d && echo data > /d/a && ln /d/a /d/b && "
                            "ln -s /etc/shadow /d/host && mkfifo /d/fifo\n")
    result = await build_image(ctx, tag=name, network="none", progress=lambda _: None)
    members = {m.name: (m, data) for m, data in layer_members(result.digest) if m.name.startswith("d/")}
    assert sorted(members) == ["d/a", "d/b", "d/fifo", "d/host"]
    assert members["d/a"][1] == b"data\n" and members["d/b"][0].islnk() and members["d/b"][0].linkname == "d/a"
    assert members["d/host"][0].issym() and members["d/host"][0].linkname == "/etc/shadow"
    assert members["d/fifo"][0].isfifo()


@contextlib.contextmanager
def racing(program: Path, kind: str, directory: Path, target: str) -> Iterator[None]:
    """swap_race swapping in `directory` on the host, while the block runs."""
    proc = subprocess.Popen([str(program), kind, str(directory), "64", target, "host-race"])
    try:
        deadline = time.monotonic() + 10
        while not directory.with_name(directory.name + ".ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "swap_race did not start"
            time.sleep(0.01)
        yield
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", ["symlink", "dir", "fifo"])
async def test_a_context_changing_during_the_build_lets_no_host_file_in(
        tmp_path: Path, name: str, busybox: str, swap_race_program: Path, kind: str) -> None:
    # Another process changes the context while it is read: a file or a
    # directory swapped for a symlink to a host file or directory must not
    # be read through, a FIFO swapped in must not be waited on. The build
    # may fail (the context changed).
    secret = tmp_path / "secret"  # outside the context
    secret.write_text(f"host secret {secrets.token_hex(16)}\n")
    if kind == "dir":
        secret.rename(tmp_path / "f")
        secret.mkdir()
        (tmp_path / "f").rename(secret / "f")
    ctx = context(tmp_path, f"FROM {busybox}\nCOPY race /race/\n")
    outcomes = []
    with racing(swap_race_program, kind, ctx / "race", str(secret)):
        for _ in range(3):
            try:
                with anyio.fail_after(60):
                    result = await build_image(ctx, tag=name, network="none", no_cache=True, progress=lambda _: None)
            except BuildError as e:
                assert "race/" in str(e) and "changed while it was read" in str(e), e
                outcomes.append("changed")
                continue
            outcomes.append("built")
            for m, data in layer_members(result.digest):
                if m.name.startswith("race/"):
                    assert m.isdir() or m.issym() or data == b"harmless\n", (m.name, data and data[:100])
                    assert not m.issym() or m.linkname == str(secret)
    assert outcomes


async def test_context_symlinks_do_not_lead_out(tmp_path: Path, name: str, busybox: str) -> None:
    secret = tmp_path / "secret"
    secret.write_text(f"SECRET-{secrets.token_hex(8)} is not an instruction\n")
    ctx = context(tmp_path, f"FROM {busybox}\nCOPY . /ctx/\n", {"real/f": "in the context\n"})
    os.symlink(secret, ctx / "out")  # copied as a symlink
    os.symlink("real", ctx / "in")  # a source that is a symlink inside: followed
    result = await build_image(ctx, tag=name, network="none", progress=lambda _: None)
    members = {m.name: (m, data) for m, data in layer_members(result.digest)}
    assert members["ctx/out"][0].issym() and members["ctx/out"][0].linkname == str(secret)
    assert all(secret.read_bytes() not in (data or b"") for _, data in members.values())

    (ctx / "Dockerfile").write_text(f"FROM {busybox}\nCOPY in /copied\n")
    result = await build_image(ctx, tag=name, network="none", progress=lambda _: None)
    assert [(m.name, data) for m, data in layer_members(result.digest) if m.name.startswith("copied/")] == \
        [("copied/f", b"in the context\n")]

    (ctx / "Dockerfile").write_text(f"FROM {busybox}\nCOPY out /x\n")
    with pytest.raises(BuildError, match="a symlink leading outside the build context"):
        await build_image(ctx, tag=name, network="none", progress=lambda _: None)

    os.symlink(secret, ctx / ".dockerignore")
    with pytest.raises(BuildError, match=r"^\.dockerignore is a symlink leading outside the build context"):
        await build_image(ctx, tag=name, network="none", progress=lambda _: None)
    (ctx / ".dockerignore").unlink()

    (ctx / "Dockerfile").unlink()
    os.symlink(secret, ctx / "Dockerfile")
    with pytest.raises(BuildError) as e:
        await build_image(ctx, tag=name, network="none", progress=lambda _: None)
    assert "SECRET" not in str(e.value) and "symlink leading outside the build context" in str(e.value)


async def test_dockerignore_keeps_out_what_it_excludes_whatever_names_it(tmp_path: Path, name: str,
                                                                          busybox: str) -> None:
    """A symlink in the context to an excluded file does not carry it in
    (Docker never sends the file); nor may the Dockerfile's own ignore file
    be a symlink to a host file that would decide what is sent."""
    ctx = context(tmp_path, f"FROM {busybox}\nCOPY alias /f\n", {".dockerignore": ".env\n", ".env": "TOKEN=1\n"})
    os.symlink(".env", ctx / "alias")
    with pytest.raises(BuildError, match=r"alias: a symlink to \.env, which is not in the build context "
                                         r"\(excluded by \.dockerignore\)"):
        await build_image(ctx, tag=name, network="none", progress=lambda _: None)
    # Through a symlinked directory to what is sent: followed, as BuildKit does.
    (ctx / "real").mkdir()
    (ctx / "real" / "f").write_text("sent\n")
    os.symlink("real", ctx / "linkdir")
    (ctx / "Dockerfile").write_text(f"FROM {busybox}\nCOPY linkdir/f /f\n")
    result = await build_image(ctx, tag=name, network="none", progress=lambda _: None)
    assert ("f", b"sent\n") in [(m.name, d) for m, d in last_layer(result.digest)]

    secret = tmp_path / "host-file"
    secret.write_text("real\n")
    os.symlink(secret, ctx / "Dockerfile.dockerignore")
    with pytest.raises(BuildError, match="Dockerfile.dockerignore is a symlink leading outside the build context"):
        await build_image(ctx, dockerfile=ctx / "Dockerfile", tag=name, network="none", progress=lambda _: None)


async def test_an_excluded_directory_with_an_exception_can_be_copied(tmp_path: Path, name: str,
                                                                     busybox: str) -> None:
    ctx = context(tmp_path, f"FROM {busybox}\nCOPY docs /docs\n",
                  {".dockerignore": "docs\n!docs/keep.md\n", "docs/keep.md": "k\n", "docs/drop.md": "d\n"})
    result = await build_image(ctx, tag=name, network="none", progress=lambda _: None)
    assert sorted(m.name for m, _ in last_layer(result.digest) if m.isfile()) == ["docs/keep.md"]


@pytest.mark.timeout(20)
def test_dockerignore_patterns_take_no_exponential_time(tmp_path: Path) -> None:
    """A pattern as a backtracking regex took seconds (minutes with more
    stars) on a name of many `a`s, holding the event loop."""
    a = "a" * 60
    ctx = context(tmp_path, "FROM scratch\n", {".dockerignore": "*a*a*a*a*a*a*a*a*b\n**/x/**/*a*a*a*a*a*a*a*a*b\n",
                                               a: "", f"d/x/{a}": "", f"d/x/y/{a}b": ""})
    assert Context(ctx).listing() == [".dockerignore", "Dockerfile", a, "d", "d/x", f"d/x/{a}", "d/x/y"]


@pytest.mark.parametrize("case", ["not utf-8", "ignore not utf-8", "loop", "ignore loop", "bad pattern", "nul",
                                  "fifo", "shebang", "not executable", "blank env", "truncated tar",
                                  "truncated tgz", "dockerfile dir", "ignore dir", "-f dir"])
async def test_bad_input_is_a_build_error(tmp_path: Path, name: str, busybox: str, case: str) -> None:
    """Each one had been a raw traceback, a silently shortened Dockerfile
    (a NUL: the parser reads up to it) or a build waiting forever (a FIFO)."""
    ctx = context(tmp_path, f"FROM {busybox}\nRUN true\n")
    df, ignore = ctx / "Dockerfile", ctx / ".dockerignore"
    message = {"not utf-8": "is not UTF-8 text", "ignore not utf-8": "is not UTF-8 text",
               "loop": "Too many levels of symbolic links", "ignore loop": "Too many levels of symbolic links",
               "bad pattern": "line 2: invalid pattern '[z-a]'", "nul": "holds a NUL byte (line 2)",
               "fifo": "is not a regular file", "shebang": "the heredoc's #! line cannot be read",
               "not executable": "cannot run /etc/passwd", "blank env": "Dockerfile:2 (ENV): ENV names can not be blank",
               "truncated tar": "Dockerfile:2 (ADD): a.tar: the archive cannot be read",
               "truncated tgz": "Dockerfile:2 (ADD): a.tgz: the archive cannot be read",
               "dockerfile dir": "Dockerfile is not a regular file",
               "ignore dir": ".dockerignore is not a regular file",
               "-f dir": "sub is not a regular file"}[case]
    dockerfile = None
    if case == "not utf-8":
        df.write_bytes(f"FROM {busybox}\n".encode() + b"\xff\xfe\n")
    elif case == "ignore not utf-8":
        ignore.write_bytes(b"\xff\n")
    elif case == "loop":
        df.unlink()
        os.symlink("Dockerfile", df)
    elif case == "ignore loop":
        os.symlink(".dockerignore", ignore)
    elif case == "bad pattern":
        ignore.write_text("ok\n[z-a]\n")
    elif case == "nul":
        df.write_text(f"FROM {busybox}\nENV A=x\0y\nRUN echo $A\n")
    elif case == "fifo":
        df.unlink()
        os.mkfifo(df)
    elif case == "dockerfile dir":
        df.unlink()
        df.mkdir()
    elif case == "ignore dir":
        ignore.mkdir()
    elif case == "-f dir":
        dockerfile = ctx / "sub"
        dockerfile.mkdir()
    elif case == "shebang":
        df.write_text(f"FROM {busybox}\nRUN <<EOF\n#!/bin/sh \"\necho hi\nEOF\n")
    elif case == "not executable":
        df.write_text(f'FROM {busybox}\nRUN ["/etc/passwd"]\n')
    elif case == "blank env":
        df.write_text(f"FROM {busybox}\nENV =x\n")
    else:
        suffix = case.split()[1]
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz" if suffix == "tgz" else "w") as tf:
            info = tarfile.TarInfo("big")
            info.size = 100_000
            tf.addfile(info, io.BytesIO(os.urandom(100_000)))
        (ctx / f"a.{suffix}").write_bytes(buf.getvalue()[:len(buf.getvalue()) // 2])
        df.write_text(f"FROM {busybox}\nADD a.{suffix} /x/\n")
    fds = len(os.listdir("/proc/self/fd"))
    with anyio.fail_after(60), pytest.raises(BuildError, match=re.escape(message)):
        await build_image(ctx, dockerfile=dockerfile, tag=name, network="none", no_cache=True, progress=lambda _: None)
    if case.endswith(" dir"):
        assert len(os.listdir("/proc/self/fd")) == fds  # none left open


def _doubling(n: int) -> str:
    """ARG A0 of 16 characters, then A1..An each twice the one before."""
    return "ARG A0=" + "x" * 16 + "\n" + "".join(f"ARG A{i}=$A{i - 1}$A{i - 1}\n" for i in range(1, n + 1))


@pytest.mark.parametrize("case", ["doubling", "expansion total", "instructions", "nested", "bad url", "idna url"])
async def test_hostile_dockerfiles_are_one_line_errors(tmp_path: Path, name: str, busybox: str, case: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each had taken all memory (variables doubling), minutes (thousands of
    instructions) or ended in a traceback."""
    from nsbox.dockerfile import builder

    monkeypatch.setattr(builder, "EXPANSION_LIMIT", 8 << 20)
    body, message = {
        "doubling": (_doubling(24), "Dockerfile:19 (ARG): variables expand to more than 1 MiB"),
        # under a build bound of 8 MiB (set below), not 64: the same check, a tenth of the time
        "expansion total": (_doubling(15) + "".join(f"ENV E{i}=$A15$A15\n" for i in range(12)),
                            "(ENV): variables expand to more than 8 MiB in this build"),
        "instructions": ("LABEL a=b\n" * 10_000, "Dockerfile: more than 10000 instructions"),
        "nested": ("ENV A=" + "${X:-" * 3000 + "z" + "}" * 3000 + "\n",
                   "Dockerfile:2 (ENV): ${...} nested more than 100 deep"),
        "bad url": ("ADD http://[::1 /x\n", "Dockerfile:2 (ADD): http://[::1: not a URL"),
        "idna url": ("ADD http://xn--/x /x\n", "Dockerfile:2 (ADD): downloading http://xn--/x failed"),
    }[case]
    ctx = context(tmp_path, f"FROM {busybox}\n{body}")
    # The URL's name is refused before any lookup: no network none needed.
    network = None if case == "idna url" else "none"
    with anyio.fail_after(120), pytest.raises(BuildError, match=re.escape(message)):
        await build_image(ctx, tag=name, network=network, no_cache=True, progress=lambda _: None)


async def test_thousands_of_chained_stages_build(tmp_path: Path, name: str, busybox: str) -> None:
    # Finding the stages the target needs had recursed once per stage.
    stages = "".join(f"FROM s{i - 1} AS s{i}\n" for i in range(1, 1500))
    ctx = context(tmp_path, f"FROM {busybox} AS s0\n{stages}ENV LAST=1\n")
    result = await build_image(ctx, tag=name, network="none", progress=lambda _: None)
    assert "LAST=1" in Store().read_json(result.id)["config"]["Env"]


async def test_a_heredoc_holding_every_bmp_private_use_character_is_copied(tmp_path: Path, name: str,
                                                                           busybox: str) -> None:
    # Its expansion stands quotes in for characters the text lacks.
    text = "".join(map(chr, range(0xE000, 0xF900))) + " \"$V\" '$V'\n"
    ctx = context(tmp_path, f"FROM {busybox}\nARG V=v\nCOPY <<EOF /x\n{text}EOF\n")
    result = await build_image(ctx, tag=name, network="none", progress=lambda _: None)
    assert ("x", text.replace("$V", "v").encode()) in [(m.name, d) for m, d in last_layer(result.digest)]


async def test_a_context_file_shrinking_during_copy_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                name: str, busybox: str) -> None:
    """The file is cut short on disk just as the layer writer reads it,
    after its size went into the tar header."""
    ctx = context(tmp_path, f"FROM {busybox}\nCOPY big /big\n", {"big": b"x" * 100_000})
    opened, opens = Context.open, []

    class Shrinking(io.BufferedReader):
        def read(self, size: int | None = -1) -> bytes:
            os.truncate(ctx / "big", 10)
            return super().read(size)

    def open_(self: Context, rel: str, st: os.stat_result | None = None) -> BinaryIO:
        f = opened(self, rel, st)
        opens.append(rel)
        # the content hash reads it first, the layer writer second
        return Shrinking(f.detach()) if opens.count("big") == 2 else f  # type: ignore[attr-defined]

    monkeypatch.setattr(Context, "open", open_)
    with anyio.fail_after(60), pytest.raises(BuildError, match="^big in the build context changed while it was "
                                                              r"read \(shorter now\)$"):
        await build_image(ctx, tag=name, network="none", no_cache=True, progress=lambda _: None)


async def test_an_unreadable_last_modified_is_left_out(tmp_path: Path, name: str, busybox: str) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nLast-Modified: not a date\r\n"
                         b"Connection: close\r\n\r\nhi\n")

    ctx = context(tmp_path, f"FROM {busybox}\nADD http://127.0.0.1:{server.getsockname()[1]}/f /f\n")
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, answer)
            with anyio.fail_after(60):
                result = await build_image(ctx, tag=name, network="host", progress=lambda _: None)
    finally:
        server.close()
    assert ("f", b"hi\n") in [(m.name, d) for m, d in last_layer(result.digest)]


async def test_context_names_need_not_be_utf8(tmp_path: Path, name: str, busybox: str) -> None:
    ctx = context(tmp_path, f"FROM {busybox}\nCOPY . /ctx/\n")
    (ctx / os.fsdecode(b"latin1-\xe9")).write_text("e acute\n")
    result = await build_image(ctx, tag=name, network="none", progress=lambda _: None)
    assert ("ctx/" + os.fsdecode(b"latin1-\xe9"), b"e acute\n") in [(m.name, d) for m, d in last_layer(result.digest)]


async def test_add_of_a_hostile_tar_stays_under_its_destination(tmp_path: Path, name: str, busybox: str) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for member, kind, link in (("../../escape", tarfile.REGTYPE, ""), ("/abs", tarfile.REGTYPE, ""),
                                   ("l", tarfile.SYMTYPE, "/etc"), ("l/passwd", tarfile.REGTYPE, ""),
                                   ("h", tarfile.LNKTYPE, "../../etc/shadow"), ("dev", tarfile.CHRTYPE, ""),
                                   ("blk", tarfile.BLKTYPE, ""), (".wh.bin", tarfile.REGTYPE, ""),
                                   ("d/.wh..wh..opq", tarfile.REGTYPE, "")):
            info = tarfile.TarInfo(member)
            info.type, info.linkname = kind, link
            data = b"evil\n" if kind == tarfile.REGTYPE else b""
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    ctx = context(tmp_path, f"FROM {busybox}\nADD evil.tar /opt/\n", {"evil.tar": buf.getvalue()})
    result = await build_image(ctx, tag=name, network="none", progress=lambda _: None)
    layer = [m for m, _ in last_layer(result.digest)]
    names = {m.name for m in layer}
    assert {"opt/escape", "opt/abs", "opt/l", "opt/h"} <= names
    assert all(n == "opt" or n.startswith("opt/") for n in names)
    assert not any(m.ischr() or m.isblk() or ".wh." in m.name for m in layer)
    assert all(not m.islnk() or m.linkname.startswith("opt/") for m in layer)
    # the image's files are where its layers say (the unsafe ones skipped)
    async with nsbox.Sandbox(image=result.name) as sb:
        r = await sb.exec(["sh", "-c", "cat /opt/escape /opt/abs; ls /escape /abs 2>&1; test -d /bin && echo bin"])
    assert r.stdout.startswith("evil\nevil\n") and r.stdout.endswith("bin\n"), r.stdout


async def test_add_url_with_network_none_connects_nowhere(tmp_path: Path, name: str, busybox: str) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    try:
        port = server.getsockname()[1]
        ctx = context(tmp_path, f"FROM {busybox}\nADD http://127.0.0.1:{port}/file /file\n")
        with pytest.raises(BuildError, match="the build has network none"):
            await build_image(ctx, tag=name, network="none", progress=lambda _: None)
        with pytest.raises(BlockingIOError):
            server.accept()  # no connection came
    finally:
        server.close()


async def test_add_url_never_fetches_the_hosts_loopback_unasked(tmp_path: Path, name: str, busybox: str) -> None:
    """ADD runs its download in nsbox, on the host: a Dockerfile must not
    get the host's 127.0.0.1 services (or cloud metadata) into its image,
    as a RUN step cannot. `--network host` is the explicit opt-in."""
    with loopback_http(lambda _: b"host-only secret\n") as (port, seen):
        for url in (f"http://127.0.0.1:{port}/file", f"http://localhost:{port}/file",
                    f"http://[::ffff:127.0.0.1]:{port}/file"):
            ctx = context(tmp_path, f"FROM {busybox}\nADD {url} /file\n")
            with pytest.raises(BuildError, match="loopback address.*nsbox build --network host"):
                await build_image(ctx, tag=name, progress=lambda _: None)
        assert seen == []  # refused before any request
        ctx = context(tmp_path, f"FROM {busybox}\nADD http://127.0.0.1:{port}/file /file\n")
        result = await build_image(ctx, tag=name, network="host", progress=lambda _: None)
        assert seen == ["/file"]
    async with nsbox.Sandbox(image=result.name) as sb:
        assert (await sb.read_file("/file")) == "host-only secret\n"


async def test_add_url_connects_to_the_address_it_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A name that resolves to a public address when checked and to
    127.0.0.1 a moment later (DNS rebinding) must not reach the host: the
    request goes to the address that was checked, with the name kept for
    the Host header and TLS. Nothing is sent (192.0.2.0/24 is TEST-NET)."""
    import httpx

    from nsbox.dockerfile import builder as builder_mod

    answers = iter([[(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.10", 443))]])

    async def rebinding(host: str, port: int, **kw: object) -> object:
        return next(answers)  # a second lookup would raise StopIteration

    monkeypatch.setattr(builder_mod.anyio, "getaddrinfo", rebinding)
    b = object.__new__(builder_mod.Builder)
    b.network = None
    async with httpx.AsyncClient() as client:
        request = await b._checked_request(None, client, "https://files.example.org:8443/x.tar?v=1")
    assert str(request.url) == "https://192.0.2.10:8443/x.tar?v=1"
    assert request.headers["host"] == "files.example.org:8443"
    assert request.extensions["sni_hostname"] == "files.example.org"


async def test_odd_files_and_links_give_an_error_or_a_build_not_a_hang(tmp_path: Path, name: str, busybox: str) -> None:
    # ADD looks into a local file to see if it is an archive: not into a
    # FIFO (it would wait forever). --chown reads the image's /etc/passwd:
    # a layer may make it a hardlink to itself.
    ctx = context(tmp_path, f"FROM {busybox}\nADD fifo /fifo\nADD loop.tar /\nCOPY --chown=nobody fifo /x\n")
    os.mkfifo(ctx / "fifo")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("etc/passwd")
        info.type, info.linkname = tarfile.LNKTYPE, "etc/passwd"
        tf.addfile(info)
    (ctx / "loop.tar").write_bytes(buf.getvalue())
    with anyio.fail_after(60), pytest.raises(BuildError, match="--chown=nobody: no such user"):
        await build_image(ctx, tag=name, network="none", no_cache=True, progress=lambda _: None)
