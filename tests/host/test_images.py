"""Unpacking rootfs tarballs, including hostile ones."""

from __future__ import annotations

import io
import os
import secrets
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import nsbox
import nsbox.plan.rootfs
from nsbox import NsboxError
from nsbox.sandbox import confined
from nsbox.storage.tarball import import_tarball

from tests.conftest import fixture_tar


def add(tar: tarfile.TarFile, name: str, data: bytes = b"", **attrs: object) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for k, v in attrs.items():
        setattr(info, k, v)
    tar.addfile(info, io.BytesIO(data) if data else None)


def make_tar(path: Path, build) -> Path:  # type: ignore[no-untyped-def]
    with tarfile.open(path, "w") as tar:
        build(tar)
    return path


async def test_import_then_use(tmp_path: Path, busybox_rootfs: Path) -> None:
    # busybox_rootfs itself came through import_tarball; use it again fresh.
    src = fixture_tar("busybox")
    dest = await import_tarball(src, tmp_path / "bb", runner=confined)
    async with nsbox.Sandbox(dest) as sb:
        assert (await sb.exec(["busybox", "true"])).success
    with pytest.raises(NsboxError, match="already exists"):
        await import_tarball(src, dest, runner=confined)


def test_cli_import_unpacks_a_tarball(tmp_path: Path) -> None:
    """`nsbox import TARBALL DIRECTORY`, as a person runs it."""
    dest = tmp_path / "bb"
    r = subprocess.run([sys.executable, "-m", "nsbox", "import", str(fixture_tar("busybox")), str(dest)],
                       capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout) == (0, f"{dest}\n"), r.stderr
    assert os.path.lexists(dest / "bin" / "ash")


async def test_hostile_members_stay_inside(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    sentinel = outside / "sentinel"
    sentinel.write_text("untouched\n")
    os.chmod(tmp_path, 0o755)
    secret = secrets.token_hex(4)

    def build(tar: tarfile.TarFile) -> None:
        add(tar, "bin", type=tarfile.DIRTYPE, mode=0o755)
        add(tar, f"../escape-{secret}", b"dotdot\n")
        add(tar, f"/abs-{secret}", b"absolute\n")
        add(tar, "link", type=tarfile.SYMTYPE, linkname=str(outside))
        add(tar, "link/through-symlink", b"via link\n")
        add(tar, "up", type=tarfile.SYMTYPE, linkname="../../../../../../..")
        add(tar, f"up{outside}/sentinel", b"overwritten\n")
        add(tar, "hard", type=tarfile.LNKTYPE, linkname=str(sentinel))
        add(tar, "dev/evil", type=tarfile.CHRTYPE, devmajor=1, devminor=1)

    archive = make_tar(tmp_path / "hostile.tar", build)
    dest = tmp_path / "dest"
    try:
        await import_tarball(archive, dest, runner=confined)
    except NsboxError:
        pass  # tar may refuse some members; either way nothing may leak
    assert sentinel.read_text() == "untouched\n"
    assert sorted(os.listdir(outside)) == ["sentinel"]
    assert not (tmp_path / f"escape-{secret}").exists() and not Path(f"/abs-{secret}").exists()
    assert sorted(os.listdir(tmp_path)) in (["dest", "hostile.tar", "outside"], ["hostile.tar", "outside"])
    if dest.exists():
        # No device node could be created from the archive.
        assert not (dest / "dev" / "evil").exists() or not (dest / "dev" / "evil").is_char_device()


async def test_broken_archive_leaves_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"this is not a tarball" * 100)
    with pytest.raises(NsboxError, match="unpacking"):
        await import_tarball(bad, tmp_path / "dest", runner=confined)
    assert sorted(os.listdir(tmp_path)) == ["bad.tar"]
    with pytest.raises(NsboxError, match="not a file"):
        await import_tarball(tmp_path / "missing.tar", tmp_path / "dest", runner=confined)


async def test_confinement_holds_even_for_a_careless_tar(tmp_path: Path) -> None:
    """GNU tar refuses the members above by itself; import_tarball must not
    depend on that. Here tar runs with -P (absolute names, '..' and symlinks
    all followed) in the same confinement import_tarball uses: the host
    outside the destination must still be untouched."""
    outside = tmp_path / "outside"
    outside.mkdir()
    sentinel = outside / "sentinel"
    sentinel.write_text("untouched\n")
    dest = tmp_path / "dest"
    dest.mkdir()
    os.chmod(tmp_path, 0o755)

    def build(tar: tarfile.TarFile) -> None:
        add(tar, str(sentinel), b"overwritten by absolute path\n")
        add(tar, "../outside/sentinel", b"overwritten by dotdot\n")
        add(tar, "link", type=tarfile.SYMTYPE, linkname=str(outside))
        add(tar, "link/planted", b"planted through a symlink\n")

    archive = make_tar(tmp_path / "careless.tar", build)
    binds = [nsbox.plan.rootfs.Bind(str(dest), "/target"), nsbox.plan.rootfs.Bind(str(archive), "/image", readonly=True)]
    async with confined(binds, id_mapping="auto") as sb:
        r = await sb.exec(["tar", "-x", "-P", "-f", "/image", "-C", "/target"])
        # Inside, the writes landed in the sandbox's own private root...
        assert (await sb.exec(["cat", str(sentinel)])).stdout.startswith("overwritten")
    # ...and on the host nothing outside the destination changed.
    assert sentinel.read_text() == "untouched\n"
    assert sorted(os.listdir(outside)) == ["sentinel"]
    assert r.returncode in (0, 2)
