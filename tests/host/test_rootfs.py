"""Root filesystems: the host-composed default, directories, bind mounts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import nsbox
from nsbox.plan.rootfs import Bind

from tests.conftest import MODE


async def test_host_root_shares_usr_read_only(sandbox: nsbox.Sandbox) -> None:
    r = await sandbox.exec(["touch", "/usr/nsbox-test"])
    assert not r.success and "Read-only" in r.stderr
    assert (await sandbox.exec(["python3", "-c", "print(42)"])).stdout == "42\n"
    assert (await sandbox.exec(["readlink", "/bin"])).stdout.strip() == os.readlink("/bin")


async def test_host_root_has_fresh_identity_files(sandbox: nsbox.Sandbox) -> None:
    passwd = await sandbox.read_file("/etc/passwd")
    assert [line.split(":")[0] for line in passwd.splitlines()] == ["root", "nobody"]
    assert "nogroup" in await sandbox.read_file("/etc/group")
    # The rest of /etc is the host's (the dynamic linker cache, say).
    assert await sandbox.read_file("/etc/ld.so.conf") == Path("/etc/ld.so.conf").read_text()


async def test_host_root_writable_dirs_are_private(sandbox: nsbox.Sandbox) -> None:
    for d in ("/etc", "/root", "/home", "/tmp", "/var/tmp", "/run"):
        await sandbox.write_file(f"{d}/nsbox-private", d)
    assert not Path("/etc/nsbox-private").exists()
    async with nsbox.Sandbox() as other:
        for d in ("/etc", "/root", "/home", "/tmp", "/var/tmp", "/run"):
            assert (await other.exec(["test", "-e", f"{d}/nsbox-private"])).returncode == 1


ETC_OPERATIONS = (
    "set -e; rm /etc/passwd; test ! -e /etc/passwd; echo 'root:x:0:0::/root:/bin/sh' > /etc/passwd; "
    "mkdir -p /etc/d/e; touch /etc/d/e/f; mv /etc/d /etc/moved; test -f /etc/moved/e/f; "
    "rm -rf /etc/moved; mkdir /etc/moved; test -z \"$(ls -A /etc/moved)\"; "
    "head -c 1048576 /dev/zero > /etc/big; cat /etc/hostname"
)


@pytest.mark.parametrize("in_memory", [True, False], ids=["etc-in-memory", "etc-on-disk"])
async def test_etc_upper_in_memory_or_on_disk(monkeypatch: pytest.MonkeyPatch, in_memory: bool) -> None:
    """/etc's upper layer is a tmpfs where the kernel's tmpfs keeps user.*
    xattrs (overlayfs needs them to delete and rename directories), else
    the layer directory: either way /etc takes what a sandbox does to it,
    and with the upper in memory nothing of it reaches the host's disk."""
    from nsbox.host import layers, removal
    from nsbox import manage, sandbox as sandbox_mod
    from nsbox.plan.rootfs import HostRootfs

    if in_memory and not layers.etc_upper_in_memory():
        pytest.skip(f"this kernel ({os.uname().release}) keeps /etc's upper layer on disk: tmpfs has no user xattrs")
    monkeypatch.setattr("nsbox.plan.rootfs.etc_upper_in_memory", lambda: in_memory)
    monkeypatch.setattr(sandbox_mod, "_plan_templates", {})
    kind = HostRootfs.layer_kind()
    manage.gc(nsbox.host.idmap.detect())  # an empty pool
    async with nsbox.Sandbox() as sb:
        r = await sb.exec(["sh", "-c", ETC_OPERATIONS])
        assert r.success and r.stdout == f"{sb.hostname}\n", r.stderr
        layer = sb._layer
        assert layer is not None
        assert sorted(os.listdir(layer)) == sorted(layers.layer_dirs(kind))
        etc_upper = layer / "etc-upper"
        if in_memory:
            assert sorted(os.listdir(HostRootfs.etc_dir(layer))) == ["hostname", "hosts"]  # written by nsbox only
            mounts = (await sb.exec(["cat", "/proc/self/mountinfo"])).stdout
            etc = [line for line in mounts.splitlines() if line.split()[4] == "/etc"]
            assert [line.split(" - ")[1].split()[0] for line in etc] == ["tmpfs", "overlay"], etc
        else:
            assert {"big", "moved", "passwd"} <= set(os.listdir(etc_upper))
    # A kept layer of one kind never serves a sandbox of the other.
    pool = layers.layers_dir() / layers.REUSE

    def kept() -> list[str]:
        assert removal.wait_swept(10)
        return os.listdir(pool) if pool.exists() else []

    if in_memory:
        assert [layers._of_kind(name, kind) for name in kept()] == [True]  # /etc's writes left it untouched
    else:
        assert kept() == []  # they are in it
        async with nsbox.Sandbox():
            pass
        assert [layers._of_kind(name, kind) for name in kept()] == [True]
    monkeypatch.setattr("nsbox.plan.rootfs.etc_upper_in_memory", lambda: not in_memory)
    monkeypatch.setattr(sandbox_mod, "_plan_templates", {})
    async with nsbox.Sandbox() as other:
        assert sorted(os.listdir(other._layer)) == sorted(layers.layer_dirs(HostRootfs.layer_kind()))
        assert (await other.exec(["test", "-e", "/etc/big"])).returncode == 1
        assert len(kept()) == 1  # the other kind's, still there


async def test_overlay_directory_semantics(debian: nsbox.Sandbox) -> None:
    # Without userxattr these fail with EIO on overlayfs in a user namespace.
    script = ("set -e; mkdir -p /opt/a/b; echo x > /opt/a/b/f; mv /opt/a /opt/c; "
              "rm -rf /etc/apt && mkdir /etc/apt && ls -A /etc/apt; cat /opt/c/b/f; "
              "rm -rf /usr/share/doc; mkdir /usr/share/doc; ls -A /usr/share/doc | wc -l")
    r = await debian.exec(["sh", "-c", script])
    assert r.success, r.stderr
    assert r.stdout == "x\n0\n"


async def test_directory_rootfs_is_never_modified(debian_rootfs: Path) -> None:
    before = sorted(os.listdir(debian_rootfs / "etc"))
    async with nsbox.Sandbox(debian_rootfs) as a, nsbox.Sandbox(debian_rootfs) as b:
        assert (await a.read_file("/etc/debian_version")).startswith("12")
        await a.exec(["sh", "-c", "echo changed > /etc/motd; rm /etc/debian_version; touch /etc/new"])
        assert (await b.exec(["cat", "/etc/debian_version"])).success
        assert (await b.exec(["test", "-e", "/etc/new"])).returncode == 1
    assert sorted(os.listdir(debian_rootfs / "etc")) == before


async def test_busybox_rootfs(busybox_rootfs: Path) -> None:
    async with nsbox.Sandbox(busybox_rootfs) as sb:
        r = await sb.exec(["sh", "-c", "echo $0; ps | head -2; ls /dev/null /proc/self"])
        assert r.success and r.stdout.startswith("sh\n"), r.stderr
        assert (await sb.exec(["id", "-u"])).stdout == "0\n"


async def test_proc_dev_tmp_and_hostname(sandbox: nsbox.Sandbox) -> None:
    r = await sandbox.exec(["sh", "-c", "hostname; ls /dev | tr '\\n' ' '; echo; stat -c %a /tmp /dev/shm; "
                                        "echo hi > /dev/null && head -c 4 /dev/zero | wc -c"])
    lines = r.stdout.splitlines()
    assert lines[0] == sandbox.hostname
    assert set("full null ptmx pts random shm tty urandom zero".split()) <= set(lines[1].split())
    assert lines[2:] == ["1777", "1777", "4"]
    # A fresh devpts: a pty can be opened (Inspect's bash_session needs one).
    r = await sandbox.exec(["python3", "-c", "import os; m, s = os.openpty(); print(os.ttyname(s))"])
    assert r.stdout.startswith("/dev/pts/"), r.stderr


async def test_private_network_has_only_loopback(sandbox: nsbox.Sandbox) -> None:
    r = await sandbox.exec(["cat", "/proc/net/dev"])
    assert [line.split(":")[0].strip() for line in r.stdout.splitlines()[2:]] == ["lo"]
    r = await sandbox.exec(["python3", "-c", "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); "
                                             "s.listen(); c = socket.create_connection(s.getsockname()); print('ok')"])
    assert r.stdout == "ok\n", r.stderr


async def test_host_network_mode() -> None:
    host_ifaces = {line.split(":")[0].strip() for line in Path("/proc/net/dev").read_text().splitlines()[2:]}
    async with nsbox.Sandbox(network="host") as sb:
        r = await sb.exec(["cat", "/proc/net/dev"])
        assert {line.split(":")[0].strip() for line in r.stdout.splitlines()[2:]} == host_ifaces


async def test_bind_mounts(tmp_path: Path) -> None:
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "f").write_text("from host\n")
    (tmp_path / "rw").mkdir()
    # A writable bind must belong to sandbox root's host ids (for real root a
    # subordinate id, as in rootless podman), or sandbox root cannot write.
    os.chown(tmp_path / "rw", *MODE.host_root)
    os.chmod(tmp_path, 0o755)
    binds = [Bind(str(tmp_path / "ro"), "/mnt/in", readonly=True), Bind(str(tmp_path / "rw"), "/data/out")]
    async with nsbox.Sandbox(mounts=binds) as sb:
        assert await sb.read_file("/mnt/in/f") == "from host\n"
        assert not (await sb.exec(["touch", "/mnt/in/g"])).success
        await sb.write_file("/data/out/result", "written inside\n")
        # `..` from a bind leads to the sandbox's root, not the host's.
        assert (await sb.exec(["ls", "/mnt/in/../../"])).stdout.split() == (await sb.exec(["ls", "/"])).stdout.split()
    assert (tmp_path / "rw" / "result").read_text() == "written inside\n"
    with pytest.raises(ValueError):
        Bind(str(tmp_path), "relative/target")
    with pytest.raises(ValueError):
        Bind(str(tmp_path), "/a/../b")
    with pytest.raises(nsbox.SandboxSetupError):
        Bind(str(tmp_path / "missing"), "/x")


async def test_bad_rootfs_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(nsbox.SandboxSetupError, match="No such file"):
        nsbox.Sandbox(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(nsbox.SandboxSetupError, match="not a directory"):
        nsbox.Sandbox(tmp_path / "file")



async def test_a_process_that_moves_its_state_dir_uses_the_new_one(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Pointing NSBOX_STATE_DIR or XDG_CACHE_HOME elsewhere in a running
    process moves its sandboxes' layers, or the cached layers under them,
    at once: nothing this process remembered names the old directory,
    which may be gone."""
    from nsbox.host import removal
    from nsbox.host.removal import remove_layer

    async def two_sandboxes(layers_in: Path, cached_in: Path) -> None:
        for _ in range(2):  # the second one's plan is copied from a template
            async with nsbox.Sandbox() as sb:
                r = await sb.exec(["cat", "/etc/hostname"])
                assert r.stdout == f"{sb.hostname}\n", r.stderr
                assert sb._layer is not None and layers_in in sb._layer.parents
        assert sorted(name.split("-")[0] for name in os.listdir(cached_in / "layers")) == ["etc", "skeleton"]
        assert removal.wait_swept(10)

    monkeypatch.setenv("NSBOX_STATE_DIR", str(tmp_path / "first"))
    await two_sandboxes(tmp_path / "first", tmp_path / "first/cache")
    remove_layer(tmp_path / "first", MODE)
    monkeypatch.setenv("NSBOX_STATE_DIR", str(tmp_path / "second"))
    await two_sandboxes(tmp_path / "second", tmp_path / "second/cache")

    monkeypatch.delenv("NSBOX_STATE_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache1"))
    await two_sandboxes(tmp_path / "data", tmp_path / "cache1/nsbox")
    remove_layer(tmp_path / "cache1", MODE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache2"))  # the data directory stays
    await two_sandboxes(tmp_path / "data", tmp_path / "cache2/nsbox")
    for name in ("second", "data", "cache2"):
        remove_layer(tmp_path / name, MODE)
