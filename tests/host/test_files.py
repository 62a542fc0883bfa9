"""read_file / write_file: the contract, and paths that try to leave the sandbox."""

from __future__ import annotations

import errno
import secrets
from pathlib import Path
from typing import Iterator

import pytest

import nsbox
from nsbox import OutputLimitExceeded, UserUnsupported


async def test_round_trips(sandbox: nsbox.Sandbox) -> None:
    await sandbox.write_file("a/b/c.txt", "line1\r\nline2\n")
    assert await sandbox.read_file("a/b/c.txt") == "line1\r\nline2\n"  # CRLF kept
    assert await sandbox.read_file(f"{sandbox.workdir}/a/b/c.txt", text=False) == b"line1\r\nline2\n"
    await sandbox.write_file("/tmp/bin", b"\xc3\x28\x00")
    assert await sandbox.read_file("/tmp/bin", text=False) == b"\xc3\x28\x00"
    await sandbox.write_file("/tmp/bin", b"")
    assert await sandbox.read_file("/tmp/bin") == ""
    await sandbox.write_file("with space.txt", "✨🚀")
    assert (await sandbox.exec(["cat", "with space.txt"])).stdout == "✨🚀"


async def test_fifty_mib(sandbox: nsbox.Sandbox) -> None:
    data = secrets.token_bytes(1024) * (50 * 1024)
    await sandbox.write_file("/tmp/big", data)
    assert (await sandbox.exec(["wc", "-c", "/tmp/big"])).stdout.split()[0] == str(len(data))
    assert await sandbox.read_file("/tmp/big", text=False) == data


async def test_errors_name_the_path(sandbox: nsbox.Sandbox) -> None:
    with pytest.raises(FileNotFoundError, match="nonexistent-file"):
        await sandbox.read_file("nonexistent-file")
    with pytest.raises(IsADirectoryError, match="directory"):
        await sandbox.read_file("/etc")
    await sandbox.exec(["mkdir", "-p", "/tmp/adir"])
    with pytest.raises(IsADirectoryError, match="directory"):
        await sandbox.write_file("/tmp/adir", "x")
    await sandbox.write_file("/tmp/bad-utf8", b"\xff\xfe")
    with pytest.raises(UnicodeDecodeError):
        await sandbox.read_file("/tmp/bad-utf8")
    with pytest.raises(ValueError):
        await sandbox.read_file("")


async def test_read_limit(sandbox: nsbox.Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    await sandbox.write_file("big.txt", "a" * 2048)
    monkeypatch.setenv("INSPECT_SANDBOX_MAX_READ_FILE_SIZE", "1024")
    with pytest.raises(OutputLimitExceeded, match="limit of 1 KiB was exceeded"):
        await sandbox.read_file("big.txt")
    monkeypatch.setenv("INSPECT_SANDBOX_MAX_READ_FILE_SIZE", "2048")
    assert len(await sandbox.read_file("big.txt")) == 2048


@pytest.mark.parametrize("path", ["/proc/1/cmdline", "/proc/self/oom_score_adj", "/proc/sys/kernel/hostname"])
async def test_files_of_kernel_file_systems_are_refused(sandbox: nsbox.Sandbox, path: str) -> None:
    # They look regular, but the kernel checks the credentials of whoever
    # reads or writes them: here the host process's, not the sandbox's.
    with pytest.raises(PermissionError, match="kernel file system.*exec") as e:
        await sandbox.read_file(path)
    assert e.value.filename == path
    with pytest.raises(OSError) as e:  # or a read-only mount, or no write permission
        await sandbox.write_file(path, "0")
    assert e.value.filename == path and e.value.errno in (errno.EPERM, errno.EROFS, errno.EACCES)


async def test_write_file_cannot_lend_the_hosts_capabilities(sandbox: nsbox.Sandbox) -> None:
    """Sandbox root may not set a negative nice through /proc/PID/autogroup
    (CAP_SYS_NICE over the host); write_file had written it with the host
    process's credentials, which as root have it."""
    await sandbox.spawn(["sleep", "1000"])
    pid = (await sandbox.exec(["pidof", "sleep"])).stdout.split()[0]
    for path in (f"/proc/{pid}/autogroup", "/proc/1/autogroup"):
        before = (await sandbox.exec(["cat", path])).stdout
        with pytest.raises(PermissionError):
            await sandbox.write_file(path, "-20")
        assert (await sandbox.exec(["cat", path])).stdout == before


async def test_permissions_are_the_sandbox_users(mode: str) -> None:
    if mode == "single":
        with pytest.raises(UserUnsupported):
            await nsbox.Sandbox(user="nobody", workdir="/tmp").start()
        return
    async with nsbox.Sandbox(user="nobody", workdir="/tmp/work") as sb:
        assert (await sb.exec(["id", "-un"])).stdout == "nobody\n"
        await sb.write_file("mine.txt", "x")
        assert (await sb.exec(["stat", "-c", "%U", "/tmp/work/mine.txt"])).stdout == "nobody\n"
        await sb.exec(["chmod", "000", "mine.txt"])
        with pytest.raises(PermissionError, match="mine.txt"):
            await sb.read_file("mine.txt")
        with pytest.raises(PermissionError, match="mine.txt"):
            await sb.write_file("mine.txt", "y")
        with pytest.raises(PermissionError):
            await sb.write_file("/etc/nsbox-test", "not root")
        with pytest.raises(PermissionError):
            await sb.read_file("/etc/shadow")


# ---- paths that try to leave the sandbox --------------------------------


@pytest.fixture
def host_secret() -> Iterator[Path]:
    """A file on the host, in a place the sandbox must never see."""
    path = Path("/tmp") / f"nsbox-host-secret-{secrets.token_hex(4)}"
    path.write_text("HOST SECRET\n")
    yield path
    path.unlink(missing_ok=True)


async def test_absolute_symlink_resolves_inside(sandbox: nsbox.Sandbox, host_secret: Path) -> None:
    await sandbox.exec(["ln", "-s", str(host_secret), "link"])
    with pytest.raises(FileNotFoundError):
        await sandbox.read_file("link")
    await sandbox.write_file(str(host_secret), "sandbox copy\n")
    assert await sandbox.read_file("link") == "sandbox copy\n"
    assert host_secret.read_text() == "HOST SECRET\n"


async def test_write_through_symlink_stays_inside(sandbox: nsbox.Sandbox, host_secret: Path) -> None:
    await sandbox.exec(["ln", "-s", str(host_secret), "out"])
    await sandbox.write_file("out", "overwritten?\n")
    assert host_secret.read_text() == "HOST SECRET\n"
    assert (await sandbox.exec(["cat", str(host_secret)])).stdout == "overwritten?\n"
    # Parent directories are created inside too, even through a symlinked dir.
    await sandbox.exec(["ln", "-s", str(host_secret.parent), "/root/hostdir"])
    new = f"new-{secrets.token_hex(4)}"  # in the host's /tmp: a name no one else has
    await sandbox.write_file(f"/root/hostdir/{new}/file", "x")
    assert not (host_secret.parent / new).exists()


async def test_dotdot_cannot_climb_out(sandbox: nsbox.Sandbox) -> None:
    hostname = await sandbox.read_file("../../../../../../../../etc/hostname")
    assert hostname.strip() == sandbox.hostname != Path("/etc/hostname").read_text().strip()
    await sandbox.exec(["ln", "-s", "../../../../../../../..", "up"])
    assert (await sandbox.read_file("up/etc/hostname")).strip() == sandbox.hostname


async def test_magic_links_are_refused(sandbox: nsbox.Sandbox) -> None:
    # /proc/<pid>/root and /proc/<pid>/fd/N jump without path resolution;
    # RESOLVE_NO_MAGICLINKS refuses them.
    await sandbox.exec(["ln", "-s", "/proc/self/root/etc/passwd", "magic"])
    with pytest.raises(OSError) as e:
        await sandbox.read_file("magic")
    assert e.value.errno == errno.ELOOP
    # The init's own links are out of reach on top of that (it is not dumpable).
    with pytest.raises(OSError) as e:
        await sandbox.read_file("/proc/1/root/etc/hostname")
    assert e.value.errno in (errno.ELOOP, errno.EACCES)


async def test_host_home_and_tmp_are_invisible(sandbox: nsbox.Sandbox, host_secret: Path) -> None:
    home_marker = Path.home() / f".nsbox-marker-{secrets.token_hex(4)}"
    home_marker.write_text("x")
    try:
        for path in (str(host_secret), str(home_marker), f"/root/{home_marker.name}",
                     f"/home/{Path.home().name}/{home_marker.name}"):
            r = await sandbox.exec(["test", "-e", path])
            assert r.returncode == 1, f"{path} is visible in the sandbox"
    finally:
        home_marker.unlink()
