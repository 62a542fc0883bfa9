"""`nsbox build` against a hostile Dockerfile and build context: what a
build takes from the host is the context's own files, nothing else, and
what a RUN step starts ends with it.

Every test runs in each identity mode (tests/run.sh).
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import psutil
import pytest

from nsbox.build import BuildError, build_image
from nsbox.storage import Store, oci

from .conftest import MODE
from .test_build import busybox, context, name  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(300)

SWAP_RACE = Path(__file__).parent / "swap_race.c"


@pytest.fixture(scope="module")
def swap_race(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """tests/swap_race.c, linked statically: it runs in a busybox image."""
    out = tmp_path_factory.mktemp("swap") / "swap_race"
    subprocess.run(["cc", "-O2", "-static", "-o", str(out), str(SWAP_RACE)], check=True, timeout=60)
    return out.read_bytes()


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
            "while [ ! -e /dev/shm/ready ]; do sleep 0.02; done\n")


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
    from nsbox.build import capture_tar

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
