"""tmpfs mounts and a read-only root (`tmpfs`, `read_only`; `nsbox run
--tmpfs`, `--read-only`; compose `tmpfs:`, `read_only:`).

As Docker mounts them: empty, writable, nosuid, nodev and noexec unless
told `exec`, `size` caps them, `mode` is their root's, a parent mount
before what is mounted under it. Under a disk or memory limit they are part
of the limit's one tmpfs, whatever their own size says (docs/security.md).
A mount point is never followed through a symlink: one leading out of a
bind to the host's files is refused, and nothing reaches the host.

A read-only root is Docker's --read-only: what is mounted on it stays
writable, and so do the /etc files nsbox keeps up to date; no process of
the sandbox can make it writable again, whatever it was granted.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

import nsbox
from nsbox.spec import Bind
from nsbox.host import live

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20


def mounted(mountinfo: str, target: str) -> tuple[str, set[str]]:
    """The root inside its filesystem and the per-mount options of `target`
    in a /proc/self/mountinfo."""
    for line in mountinfo.splitlines():
        fields = line.split()
        if fields[4] == target:
            return fields[3], set(fields[5].split(","))
    raise AssertionError(f"{target} is not mounted:\n{mountinfo}")


async def sh(box: nsbox.Sandbox, script: str) -> nsbox.ExecResult:
    return await box.exec(["sh", "-c", script])


async def test_a_tmpfs_is_mounted_as_docker_mounts_one() -> None:
    # The nested one is given first: mounted first, the outer one would hide it.
    tmpfs = ["/scratch/inner:exec", "/scratch:size=1m,mode=700", "/ro:ro", "/usr/share/doc"]
    async with nsbox.Sandbox(tmpfs=tmpfs) as box:
        info = (await box.exec(["cat", "/proc/self/mountinfo"])).stdout
        for target in ("/scratch", "/scratch/inner", "/ro", "/usr/share/doc"):
            assert (await box.exec(["stat", "-f", "-c", "%T", target])).stdout == "tmpfs\n", target
        assert {"nosuid", "nodev", "noexec", "rw"} <= mounted(info, "/scratch")[1]
        assert "noexec" not in mounted(info, "/scratch/inner")[1]
        assert "ro" in mounted(info, "/ro")[1]
        assert (await box.exec(["stat", "-c", "%a", "/scratch", "/usr/share/doc"])).stdout.split() == ["700", "1777"]
        # Empty: the root filesystem's files there are hidden.
        assert (await box.exec(["ls", "-A", "/usr/share/doc"])).stdout == ""
        r = await sh(box, "head -c 2000000 /dev/zero > /scratch/f")
        assert r.returncode != 0 and "No space left on device" in r.stderr, r
        r = await sh(box, "rm /scratch/f && cp /bin/true /scratch/t && /scratch/t")
        assert r.returncode == 126, r  # noexec
        r = await sh(box, "cp /bin/true /scratch/inner/t && /scratch/inner/t")
        assert r.success, r
        r = await sh(box, "touch /ro/f")
        assert not r.success and "Read-only file system" in r.stderr, r


async def test_under_a_limit_a_tmpfs_is_part_of_the_limits() -> None:
    """Its own size cannot lift the limit: a tmpfs of its own per mount
    would let a sandbox of 8 MiB pin half the host's memory each."""
    async with nsbox.Sandbox(tmpfs=["/big:size=1g", "/a-b", "/a/b"], disk="8m") as box:
        info = (await box.exec(["cat", "/proc/self/mountinfo"])).stdout
        roots = {mounted(info, t)[0] for t in ("/big", "/a-b", "/a/b")}
        assert len(roots) == 3, info  # each its own directory of the limit's tmpfs
        assert "noexec" in mounted(info, "/big")[1]
        r = await sh(box, "head -c 9000000 /dev/zero > /big/f")
        assert r.returncode != 0 and "No space left on device" in r.stderr, r
        r = await sh(box, "rm /big/f && echo x > /a-b/f && ! test -e /a/b/f && df -B1 --output=size /big /tmp | tail -n +2")
        assert r.success, r
        sizes = r.stdout.split()
        assert sizes[0] == sizes[1] and int(sizes[0]) <= 8 * MiB, r


async def test_a_mount_point_through_a_symlink_is_refused(tmp_path: Path) -> None:
    """A bound directory holds `escape`, a symlink to a host directory:
    a tmpfs at /b/escape/x would have to follow it. Refused; the host's
    directory gets nothing, and no sandbox is left."""
    outside = tmp_path / "outside"
    outside.mkdir()
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "escape").symlink_to(outside)
    (shared / "up").symlink_to("../../../../../../.." + str(outside))
    before = {i.id for i in live.entries() if i.owner_pid == os.getpid()}
    for target in ("/b/escape/x", "/b/up/x", "/b/escape"):
        box = nsbox.Sandbox(mounts=[f"{shared}:/b"], tmpfs=[target])
        with pytest.raises(nsbox.SandboxSetupError, match="symlink"):
            await box.start()
    assert list(outside.iterdir()) == []
    assert sorted(p.name for p in shared.iterdir()) == ["escape", "up"]
    assert {i.id for i in live.entries() if i.owner_pid == os.getpid()} == before
    with open("/proc/self/mountinfo") as f:
        assert str(outside) not in f.read()


async def test_a_mount_point_follows_the_images_symlinks_inside_it(tmp_path: Path, debian_rootfs: Path) -> None:
    """As Docker resolves a mount's target in the container's root: on
    Debian /var/run is a link to /run, and a tmpfs or bind at /var/run/x
    (or at /var/run itself) had failed ("it must not be a symlink")."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "f").write_text("bound\n")
    tmp_path.chmod(0o755)
    data.chmod(0o755)
    async with nsbox.Sandbox(debian_rootfs, tmpfs=["/var/run/app"], mounts=[f"{data}:/var/run/data:ro"]) as sb:
        r = await sb.exec(["sh", "-c", "readlink /var/run; stat -f -c %T /run/app; cat /run/data/f"])
        assert r.stdout == "/run\ntmpfs\nbound\n", r
    async with nsbox.Sandbox(debian_rootfs, tmpfs=["/var/run"]) as sb:
        assert (await sb.exec(["stat", "-f", "-c", "%T", "/run"])).stdout == "tmpfs\n"
    # Where a link leads into /proc or /sys, or through a magic link to one
    # of the setup's descriptors (host directories among them): refused.
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "sys").symlink_to("/proc/sys/kernel")
    (shared / "magic").symlink_to("/proc/self/fd/3")
    for target in ("/b/sys/x", "/b/magic/x", "/b/magic"):
        with pytest.raises(nsbox.SandboxSetupError, match="symlinks lead inside the sandbox's root"):
            await nsbox.Sandbox(debian_rootfs, mounts=[f"{shared}:/b"], tmpfs=[target]).start()
    # A link to the root itself: a mount there would cover the whole setup.
    (shared / "root").symlink_to("/")
    with pytest.raises(nsbox.SandboxSetupError, match="mount a tmpfs on /b/root: Device or resource busy"):
        await nsbox.Sandbox(debian_rootfs, mounts=[f"{shared}:/b"], tmpfs=["/b/root"]).start()
    # A FIFO as a file's mount point is mounted over, not waited on.
    os.mkfifo(shared / "fifo")
    (tmp_path / "file").write_text("over the fifo\n")
    (tmp_path / "file").chmod(0o644)
    with anyio.fail_after(20):
        async with nsbox.Sandbox(debian_rootfs, mounts=[f"{shared}:/b", f"{tmp_path / 'file'}:/b/fifo:ro"]) as sb:
            assert (await sb.exec(["cat", "/b/fifo"])).stdout == "over the fifo\n"
    # A read-only root whose working directory is "/" (an image without WORKDIR).
    async with nsbox.Sandbox(debian_rootfs, read_only=True, workdir="/") as sb:
        assert (await sb.exec(["pwd"])).stdout == "/\n"


async def test_a_bind_source_turned_into_a_symlink_since_is_refused(tmp_path: Path) -> None:
    """A compose sample's specs are made before its services run, and its
    services share volume directories: one service may swap a directory of
    a volume for a symlink to / before a later service's sandbox binds it.
    The Bind was resolved when made; a symlink in its source since then is
    refused, and nothing of the host is bound."""
    volume = tmp_path / "volume"
    (volume / "sub").mkdir(parents=True)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "flag").write_text("host\n")
    later = Bind(str(volume / "sub"), "/data")  # as service_spec makes it
    (volume / "sub").rmdir()  # what the earlier service does through its own bind
    (volume / "sub").symlink_to(secret)
    before = {i.id for i in live.entries() if i.owner_pid == os.getpid()}
    box = nsbox.Sandbox(mounts=[later])
    with pytest.raises(nsbox.SandboxSetupError, match="symlink in it is refused.*symbolic links"):
        await box.start()
    assert {i.id for i in live.entries() if i.owner_pid == os.getpid()} == before
    # A symlink that was there when the Bind was made is resolved, as Docker does.
    async with nsbox.Sandbox(mounts=[Bind(str(volume / "sub"), "/data")]) as sb:
        assert (await sb.exec(["cat", "/data/flag"])).stdout == "host\n"


def test_bad_tmpfs_options_are_clear_errors() -> None:
    for spec, message in [("scratch", "absolute path"), ("/x:uid=5", "'uid=5' is not supported"),
                          ("/x:mode=99", "octal"), ("/x:size=lots", "size"), ("/:size=1m", "below /"),
                          ("/x/../y", "normalized")]:
        with pytest.raises(ValueError, match=message):
            nsbox.SandboxSpec(tmpfs=(spec,))
    with pytest.raises(ValueError, match="two mounts at /x"):
        nsbox.SandboxSpec(tmpfs=("/x", "/x/"))


async def test_a_read_only_root(tmp_path: Path) -> None:
    (tmp_path / "bound").mkdir()
    (tmp_path / "bound").chmod(0o777)  # sandbox root is a subordinate id but in single mode
    tmp_path.chmod(0o755)
    async with nsbox.Network("ro", internal=True) as net, \
            nsbox.Sandbox(read_only=True, workdir="/srv/app", network=net, hostname="box", tmpfs=["/scratch"],
                          mounts=[f"{tmp_path / 'bound'}:/bound"]) as box:
        r = await sh(box, "pwd; for p in /x /etc/passwd /var/tmp/x /usr/x; do touch $p 2>&1; done")
        lines = r.stdout.splitlines()
        assert lines[0] == "/srv/app" and len(lines) == 5, r  # the working directory was made first
        assert all("Read-only file system" in line for line in lines[1:]), r
        r = await sh(box, "for p in /tmp /run /dev/shm /scratch /bound; do touch $p/x || exit 1; done")
        assert r.success, r
        # /etc/hosts follows the network: a member joining is written in.
        async with nsbox.Sandbox(network=net, hostname="peer"):
            r = await box.exec(["cat", "/etc/hosts"])
            assert "peer" in r.stdout, r
    assert (tmp_path / "bound" / "x").exists()


@pytest.mark.parametrize("grant", ["none", "nested_userns", "privileged"])
async def test_a_read_only_root_stays_read_only(grant: str) -> None:
    """Not even with mounts allowed (nested user namespaces, or privileged):
    the root's flags are locked before any process of the sandbox runs."""
    kw = {} if grant == "none" else {grant: True}
    async with nsbox.Sandbox(read_only=True, **kw) as box:  # type: ignore[arg-type]
        r = await sh(box, "mount -o remount,rw / 2>/dev/null; mount -o remount,bind,rw / 2>/dev/null; touch /a;"
                          "unshare -Urm sh -c 'mount -o remount,rw / || mount -o remount,bind,rw /; touch /b' ;"
                          "ls /a /b 2>&1 | grep -c 'No such file'")
        assert r.stdout.strip() == "2", r


async def test_a_file_bound_over_a_read_only_file(tmp_path: Path) -> None:
    """The mount point exists and cannot be written (the host's /usr, read
    only in the sandbox): binding over it needs no write (it had failed
    with EROFS, as did a read-only root's /etc files that are the host's)."""
    tmp_path.chmod(0o755)
    (tmp_path / "env").write_text("mine\n")
    (tmp_path / "env").chmod(0o644)
    async with nsbox.Sandbox(mounts=[f"{tmp_path / 'env'}:/usr/bin/env:ro"]) as box:
        assert (await box.exec(["cat", "/usr/bin/env"])).stdout == "mine\n"
