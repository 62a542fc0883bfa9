"""Writable layers: kept for reuse only when nothing of a sandbox remains."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import pytest

import nsbox
from nsbox.host import layers, removal
from nsbox import manage
from nsbox.create.unshare import remove_layer
from nsbox.plan.rootfs import HostRootfs, ImageRootfs


def reuse_dir() -> Path:
    return layers.layers_dir() / layers.REUSE


def kept() -> set[str]:
    """The pool, once this process's closed sandboxes are released."""
    assert removal.wait_swept(10), "the sweeper did not finish"
    try:
        return set(os.listdir(reuse_dir()))
    except FileNotFoundError:
        return set()


async def test_an_untouched_layer_is_kept_and_reused() -> None:
    manage.gc(nsbox.host.idmap.detect())  # start from an empty pool
    async with nsbox.Sandbox() as a:
        await a.exec(["true"])
        layer_a = a._layer
    assert layer_a is not None and layers._pool_name(HostRootfs.layer_kind(), layer_a.name) in kept()
    async with nsbox.Sandbox() as b:
        assert b._layer is not None and not kept()  # taken from the pool
        assert (await b.read_file("/etc/hostname")).strip() == b.hostname
        assert b.hostname in await b.read_file("/etc/hosts")


ETC_CHANGES = [
    "rm /etc/hosts && ln -s /etc/shadow /etc/hosts",
    "ln /etc/hosts /etc/hosts2",
    "chmod 600 /etc/hostname",
    "echo 'evil 10.0.0.1' >> /etc/hosts && mkdir /etc/extra && touch /etc/extra/f",
]


async def test_nothing_of_a_sandbox_carries_over() -> None:
    # Every kind of change to the layer makes it unfit for reuse. Changes
    # to /etc do not reach the layer where /etc's upper layer is in memory:
    # the layer is kept then, and the next sandbox must not see them.
    changes = [
        "echo data > /root/file",
        "chmod 700 /",
        *ETC_CHANGES,
        "mkdir /home/someone",
    ]
    etc_in_memory = HostRootfs.layer_kind() == layers.HOST_MEMORY_ETC_LAYER
    for change in changes:
        manage.gc(nsbox.host.idmap.detect())
        async with nsbox.Sandbox() as a:
            r = await a.exec(["sh", "-c", change])
            assert r.success, (change, r.stderr)
        if etc_in_memory and change in ETC_CHANGES:
            assert len(host_kept()) == 1, f"a layer whose /etc changed in memory ({change!r}) was not kept"
        else:
            assert not kept(), f"a layer changed by {change!r} was kept"
        async with nsbox.Sandbox() as b:
            assert not kept()  # b took the layer, if it was kept
            assert (await b.exec(["ls", "-A", "/etc/extra"])).returncode != 0
            assert "evil" not in await b.read_file("/etc/hosts")
            assert (await b.exec(["ls", "-A", "/root", "/home"])).stdout == "/home:\n\n/root:\n"
            stat = await b.exec(["stat", "-c", "%n %a %F %h", "/", "/etc/hosts", "/etc/hostname"])
            assert stat.stdout.splitlines()[0].startswith("/ 755 directory")
            assert stat.stdout.splitlines()[1:] == ["/etc/hosts 644 regular file 1", "/etc/hostname 644 regular file 1"]


async def test_gc_empties_the_pool() -> None:
    async with nsbox.Sandbox():
        pass
    assert kept()
    manage.gc(nsbox.host.idmap.detect())
    assert not kept()
    assert not [p for p in os.listdir(layers.layers_dir()) if p.startswith(".gc-")]


# ---- what no kind of kept layer may carry: times, flags, the overlay's uuid --

def dir_kept() -> set[str]:
    return {name for name in kept() if name.startswith(layers.DIR_LAYER + ".")}


def host_kept() -> set[str]:
    return {name for name in kept() if layers._of_kind(name, HostRootfs.layer_kind())}


# Printed by a new sandbox: / as the sandbox sees it (its attributes come
# from the upper layer), and its overlay's fsid (from the upper's uuid).
FINGERPRINT = "stat -c '%a %u %g %s %h' /; lsattr -d / 2>/dev/null | cut -d' ' -f1; ls -A /"
FSID_AND_MTIME = "stat -f -c %i /; stat -c %Y /"


async def fingerprint(sb: nsbox.Sandbox) -> tuple[str, str, int]:
    r = await sb.exec(["sh", "-c", FINGERPRINT])
    assert r.success, r.stderr
    fsid, mtime = (await sb.exec(["sh", "-c", FSID_AND_MTIME])).stdout.split()
    return r.stdout, fsid, int(mtime)


def image_sandbox(lower: Path) -> nsbox.Sandbox:
    """A sandbox whose root is an ImageRootfs of one layer, `lower`."""
    sb = nsbox.Sandbox(workdir="/")
    sb.rootfs = ImageRootfs("test-image", (lower,))
    return sb


async def test_a_kept_layer_has_no_overlay_uuid() -> None:
    # The uuid is the overlay's f_fsid: a reused layer would share it.
    for make in (nsbox.Sandbox, lambda: nsbox.Sandbox(workdir="/")):
        manage.gc(nsbox.host.idmap.detect())
        async with make() as sb:
            await sb.exec(["true"])
        (name,) = kept()
        for upper in ("upper", "etc-upper"):
            if (reuse_dir() / name / upper).exists():
                assert not [x for x in os.listxattr(reuse_dir() / name / upper) if ".overlay." in x]


async def test_an_untouched_directory_or_image_layer_is_reused_across_lower_stacks(
        busybox_rootfs: Path, debian_rootfs: Path) -> None:
    manage.gc(nsbox.host.idmap.detect())
    async with nsbox.Sandbox(busybox_rootfs) as a:
        before = await fingerprint(a)
    assert len(dir_kept()) == 1 and not host_kept()
    async with nsbox.Sandbox() as host:  # a host root never takes a directory's layer
        assert len(dir_kept()) == 1
        await host.exec(["true"])
    assert len(dir_kept()) == 1 and len(host_kept()) == 1
    t0 = int(time.time())
    async with image_sandbox(debian_rootfs) as b:
        assert len(dir_kept()) == 0  # taken from the pool, though its lower was busybox
        after = await fingerprint(b)
        assert (await b.exec(["test", "-x", "/usr/bin/apt-get"])).success  # debian's root, not busybox's
    assert after[1] != before[1], "a reused layer gave the new sandbox the old overlay's fsid"
    assert after[2] >= t0 - 1, "a reused layer kept the old upper dir's mtime"
    assert len(dir_kept()) == 1


async def test_nothing_of_a_directory_or_image_sandbox_carries_over(debian_rootfs: Path, mode: str) -> None:
    # Each change either makes the layer unfit for reuse, or (times) is
    # undone when it is reused. Changes a mode cannot make are skipped.
    changes = [
        ("echo data > /root/file", False),
        ("mkdir /newdir", False),
        ("rm /etc/debian_version", False),  # a whiteout in the upper dir
        ("chmod 700 /", False),
        ("chown 1 /", False),
        ("chgrp 1 /", False),
        ("chattr +d /", False),
        ("for i in $(seq 300); do : > /f$i; done; rm /f*", None),  # may grow the upper dir
        ("touch -d 2001-01-01 /", True),
        ("touch /x && rm /x", True),
    ]
    manage.gc(nsbox.host.idmap.detect())
    async with nsbox.Sandbox(debian_rootfs, workdir="/") as fresh:
        expected = await fingerprint(fresh)
    for i, (change, keepable) in enumerate(changes):
        manage.gc(nsbox.host.idmap.detect())
        make = (lambda: nsbox.Sandbox(debian_rootfs, workdir="/")) if i % 2 else (lambda: image_sandbox(debian_rootfs))
        async with make() as a:
            r = await a.exec(["sh", "-c", change])
            fsid = (await fingerprint(a))[1]
        if not r.success:
            assert mode == "single" and "ch" in change, (change, r.stderr)
            continue
        if keepable is not None:
            assert bool(dir_kept()) == keepable, f"after {change!r}: kept {dir_kept()}"
        t0 = int(time.time())
        async with make() as b:
            got = await fingerprint(b)
        assert got[0] == expected[0], f"{change!r} carried over"
        assert got[1] != fsid and got[2] >= t0 - 1, f"{change!r}: fsid or mtime carried over"


async def test_host_layer_times_flags_and_fsid_do_not_carry_over(mode: str) -> None:
    for change in ("touch -d 2001-01-01 / /etc/hosts && touch -a -d 2001-01-01 /etc/hostname",
                   "chattr +d /", "chattr +A /etc/hosts", "chgrp 1 /etc/hosts", "chgrp 1 /"):
        manage.gc(nsbox.host.idmap.detect())
        async with nsbox.Sandbox() as a:
            r = await a.exec(["sh", "-c", change])
            fsid = (await a.exec(["stat", "-f", "-c", "%i", "/"])).stdout
        if not r.success:
            # tmpfs, where /etc's upper layer may be, takes no chattr +A.
            in_memory = HostRootfs.layer_kind() == layers.HOST_MEMORY_ETC_LAYER
            assert (mode == "single" and "ch" in change) or (
                in_memory and change.startswith("chattr") and "/etc/" in change), (change, r.stderr)
            continue
        # Whole seconds, as stat prints them: the kernel stamps files from a
        # coarse clock that may lag time.time() by a tick across a second.
        t0 = int(time.time())
        async with nsbox.Sandbox() as b:
            r = await b.exec(["sh", "-c", "stat -f -c %i /; stat -c '%X %Y %g' / /etc/hosts /etc/hostname; "
                                          "lsattr -d / /etc/hosts | cut -d' ' -f1"])
            lines = r.stdout.split("\n")
        assert lines[0] != fsid.strip(), f"{change!r}: the overlay's fsid carried over"
        for line in lines[1:4]:
            atime, mtime, gid = map(int, line.split())
            assert atime >= t0 - 1 and mtime >= t0 - 1 and gid == 0, f"{change!r} carried over: {lines}"
        assert "A" not in lines[5] and "d" not in lines[4], f"{change!r} carried over: {lines}"


# ---- volatile overlays: their work dirs go to the trash, which is swept --

def trash() -> Path:
    return layers.layers_dir() / layers.TRASH


async def test_overlays_are_volatile_and_their_work_is_swept() -> None:
    manage.gc(nsbox.host.idmap.detect())
    async with nsbox.Sandbox() as a:
        r = await a.exec(["sh", "-c", "grep ' - overlay ' /proc/self/mountinfo"])
        overlays = r.stdout.splitlines()
        assert len(overlays) == 2 and all("volatile" in line for line in overlays), r.stdout
        # sync and fsync still succeed; they just do not wait for the disk.
        assert (await a.exec(["sh", "-c", "echo x > /root/f && sync /root/f && sync"])).success
    async with nsbox.Sandbox() as b:
        await b.exec(["true"])
    (name,) = kept()  # b's: untouched, its work dirs emptied
    for work in set(layers.WORK_DIRS) & set(layers.layer_dirs(HostRootfs.layer_kind())):
        assert os.listdir(reuse_dir() / name / work) == []
    assert removal.wait_swept(10), "the sweeper did not finish"
    assert not trash().exists() or os.listdir(trash()) == []
    # The kernel refuses a work dir holding volatile's marker: the kept
    # layer mounting again shows the marker went with the trash.
    async with nsbox.Sandbox() as c:
        assert c._layer is not None and not kept()
        assert (await c.exec(["true"])).success


async def test_a_layer_whose_work_cannot_be_set_aside_is_not_kept() -> None:
    manage.gc(nsbox.host.idmap.detect())
    if trash().exists():
        removal.remove_tree(trash())
    trash().write_text("not a directory")  # every rename into it fails
    try:
        async with nsbox.Sandbox() as a:
            await a.exec(["true"])
            layer = a._layer
        assert not kept() and layer is not None and not layer.exists()
        async with nsbox.Sandbox() as b:  # a fresh layer
            assert (await b.exec(["true"])).success
    finally:
        trash().unlink()


async def test_gc_sweeps_what_a_sweeper_left() -> None:
    # What a process left in the trash when it exited: a work dir as
    # overlayfs makes it, mode 000, with volatile's marker inside.
    left = trash() / "0123456789ab.work"
    (left / "work" / "incompat" / "volatile").mkdir(parents=True)
    (left / "work" / "incompat" / "volatile" / "dirty").write_text("")
    os.chmod(left / "work", 0)
    report = manage.gc(nsbox.host.idmap.detect())
    assert not report.failures, report.failures
    assert not left.exists()


async def test_gc_leaves_a_layer_alone_between_its_sandboxes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer is in no runtime entry while it passes from one sandbox to
    the next: closed, it waits for the sweeper; kept, it is taken from the
    pool before its new sandbox is registered. Only its age tells `nsbox gc`
    (another process's, say) it is no orphan, and a layer of a sandbox that
    ran for an hour, or was kept for one, is old: each move makes it new."""
    manage.gc(nsbox.host.idmap.detect())  # start from an empty pool
    an_hour_ago = time.time() - 3600
    jobs: list[Callable[[], None]] = []
    with monkeypatch.context() as m:
        m.setattr(removal, "release_later", jobs.append)  # the sweeper, held
        async with nsbox.Sandbox() as sb:
            layer = sb._layer
            assert layer is not None
            os.utime(layer, (an_hour_ago, an_hour_ago))
        assert jobs and layer.is_dir()
        assert layer not in manage.garbage()[1], "gc would delete a layer the sweeper is about to keep"
        for job in jobs:
            job()
    [name] = kept()
    os.utime(reuse_dir() / name, (an_hour_ago, an_hour_ago))
    upper = os.lstat(reuse_dir() / name / "upper")
    taken = layers.layers_dir() / f"taken-by-{os.getpid()}"
    try:
        assert layers.reuse_layer(taken, (upper.st_uid, upper.st_gid), HostRootfs.layer_kind())
        assert taken not in manage.garbage()[1], "gc would delete a layer a sandbox is being made on"
    finally:
        if taken.exists():
            remove_layer(taken, nsbox.host.idmap.detect())
