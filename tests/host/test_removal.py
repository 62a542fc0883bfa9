"""Deleting layers whatever a sandbox wrote into them: trees deeper than the
recursion limit and longer than PATH_MAX, directories it made unreadable,
files of its other users, symlinks to the host. And `nsbox rm` / `nsbox gc`
go on past an entry they cannot remove, saying so in one line."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from click.testing import CliRunner

import nsbox
from nsbox.cli import main
from nsbox.host import idmap, layers, live, removal
from nsbox import manage
from nsbox.errors import NsboxError
from nsbox.create import unshare
from nsbox.create.unshare import remove_layer
from nsbox.host.removal import RemovalError, remove_tree

pytestmark = pytest.mark.timeout(120)

DEPTH = 3000  # nested directories a sandbox makes: far past the recursion limit and PATH_MAX
# perl is in every rootfs the tests use (python3 is not in the debian one).
# Builds DEPTH directories "d" below ARGV[0] (created if missing), with a
# file at the bottom and a mode-000 directory holding a file.
DEEP_TREE = r"""
my ($dir, $n) = @ARGV;
-d $dir or mkdir $dir or die "mkdir $dir: $!";
chdir $dir or die "chdir $dir: $!";
for (1 .. $n) { mkdir "d" or die "mkdir: $!"; chdir "d" or die "chdir: $!"; }
open(my $f, ">", "bottom") or die "bottom: $!"; close $f;
mkdir "locked" or die "locked: $!";
open($f, ">", "locked/f") or die "locked/f: $!"; close $f;
chmod 0, "locked" or die "chmod: $!";
"""


def deep_tree(top: Path, depth: int, *, every: int = 0, link_to: Path | None = None) -> None:
    """`depth` nested directories "d" below `top`, built through descriptors
    (their paths are too long to name). Each level holds a file "f"; every
    `every` levels a symlink "l" to `link_to`. The bottom holds a mode-000
    and a mode-500 directory, each with a file."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(depth):
            os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
            if every and link_to and level % every == 0:
                os.symlink(link_to, "l", dir_fd=fd)
            os.mkdir("d", dir_fd=fd)
            sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
        for name, mode in (("z", 0o000), ("r", 0o500)):
            os.mkdir(name, dir_fd=fd)
            os.close(os.open(f"{name}/f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
            os.chmod(name, mode, dir_fd=fd)
    finally:
        os.close(fd)


def host_dir_with_a_file(tmp_path: Path) -> Path:
    host = tmp_path / "host"
    (host / "sub").mkdir(parents=True)
    (host / "keep").write_text("host data\n")
    (host / "sub" / "keep").write_text("host data\n")
    return host


def assert_host_dir_intact(host: Path) -> None:
    assert (host / "keep").read_text() == "host data\n"
    assert (host / "sub" / "keep").read_text() == "host data\n"


# ---- the remover on plain trees ---------------------------------------------


def test_a_tree_of_any_depth(tmp_path: Path) -> None:
    host = host_dir_with_a_file(tmp_path)
    tree = tmp_path / "tree"
    tree.mkdir()
    deep_tree(tree, 5000, every=1000, link_to=host)
    os.chmod(tree, 0o500)  # the top itself without write permission
    remove_tree(tree)
    assert not tree.exists()
    assert_host_dir_intact(host)
    remove_tree(tree)  # already gone: nothing to do


def test_symlinks_are_deleted_not_followed(tmp_path: Path) -> None:
    host = host_dir_with_a_file(tmp_path)
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "link").symlink_to(host)
    (tree / "a" / "filelink").symlink_to(host / "keep")
    (tree / "a" / "b" / "sub").symlink_to(host / "sub")
    (tree / "a" / "b" / "dangling").symlink_to(tmp_path / "missing")
    remove_tree(tree)
    assert not tree.exists()
    assert_host_dir_intact(host)
    # A symlink given as the tree itself goes, not what it points to.
    (tmp_path / "toplink").symlink_to(host)
    remove_tree(tmp_path / "toplink")
    assert not os.path.lexists(tmp_path / "toplink")
    assert_host_dir_intact(host)


def test_the_walk_never_leaves_the_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A directory moved out of the tree while it is being deleted (by a
    # process of the sandbox still running, say): going back up through ".."
    # would lead outside. The walk notices and stops.
    tree, outside = tmp_path / "tree", tmp_path / "outside"
    (tree / "a" / "b" / "c").mkdir(parents=True)
    outside.mkdir()
    (outside / "precious").write_text("keep me\n")
    real = removal._unlink_files
    seen = 0

    def moving(fd: int) -> list[str]:
        nonlocal seen
        seen += 1
        if seen == 4:  # in tree/a/b/c: move b out of the tree
            os.rename(tree / "a" / "b", outside / "b")
        return real(fd)

    monkeypatch.setattr(removal, "_unlink_files", moving)
    with pytest.raises(RemovalError, match="was moved while it was being deleted"):
        remove_tree(tree)
    assert (outside / "precious").read_text() == "keep me\n"
    assert (tree / "a").is_dir()


@pytest.mark.once
def test_the_end_of_a_sandbox_is_not_queued_behind_layer_releases() -> None:
    """The sweeper runs the end of a sandbox closed without waiting (queued
    `first`) before the layer releases queued earlier, which may be long
    deletions; each kind in its own order."""
    ran: list[str] = []
    gate = threading.Event()
    removal.release_later(lambda: None if gate.wait(10) else ran.append("gate timed out"))
    for name in ("release 1", "release 2"):
        removal.release_later(functools.partial(ran.append, name))
    for name in ("end 1", "end 2"):
        removal.release_later(functools.partial(ran.append, name), first=True)
    gate.set()
    assert removal.wait_swept(10)
    assert ran == ["end 1", "end 2", "release 1", "release 2"]


async def test_files_of_other_sandbox_users(tmp_path: Path, mode: str) -> None:
    # Files a sandbox user other than root makes: as real root they are
    # removable directly; in subuid mode they belong to subordinate ids, the
    # remover says so, and remove_layer() deletes them in a user namespace.
    if mode == "single":
        pytest.skip("a single-uid sandbox has no other users")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    async with nsbox.Sandbox(mounts=[nsbox.spec.Bind(os.fspath(shared), "/shared")]) as sb:
        r = await sb.exec(["perl", "-e", DEEP_TREE, "/shared/tree", str(DEPTH)], user="nobody", cwd="/")
        assert r.success, r.stderr
        mapping = sb.idmap
    assert mapping is not None
    assert (shared / "tree").stat().st_uid != os.geteuid()
    if mode == "subuid":
        with pytest.raises(PermissionError):
            remove_tree(shared)
    remove_layer(shared, mapping)
    assert not shared.exists()


# ---- sandboxes ---------------------------------------------------------------


async def test_close_deletes_whatever_a_sandbox_wrote(sandbox: nsbox.Sandbox, tmp_path: Path, mode: str) -> None:
    await fill_and_close(sandbox, tmp_path, mode)


async def test_close_deletes_whatever_a_debian_sandbox_wrote(debian: nsbox.Sandbox, tmp_path: Path,
                                                             mode: str) -> None:
    await fill_and_close(debian, tmp_path, mode)


async def test_a_layer_that_cannot_be_deleted_after_close_is_reported(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """close() has returned when the sweeper's thread finds it cannot delete
    the layer: it says so in one line, leaves the layer for gc, and goes on
    with the next."""
    def refuse(layer: Path, mapping: object) -> None:
        raise RemovalError("rm -rf in the sandbox's user namespace failed (exit status 1)")

    monkeypatch.setattr(unshare, "remove_layer", refuse)
    boxes = [await nsbox.Sandbox.create() for _ in range(2)]
    kept = []
    for sb in boxes:
        assert (await sb.exec(["sh", "-c", "echo x > /root/f"])).success  # no longer reusable
        kept.append(sb._layer)
        await sb.close()
    assert removal.wait_swept(10)
    assert capsys.readouterr().err.splitlines() == [
        f"nsbox: could not delete the writable layer of sandbox {sb.id} ({layer}): rm -rf in the sandbox's user "
        "namespace failed (exit status 1); `nsbox gc` tries again" for sb, layer in zip(boxes, kept)]
    monkeypatch.undo()
    for layer in kept:
        assert layer is not None and (layer / "upper" / "root" / "f").exists()
        remove_layer(layer, idmap.detect())


async def fill_and_close(sb: nsbox.Sandbox, tmp_path: Path, mode: str) -> None:
    """Deep trees (of root and, when the mapping has them, of another user),
    unreadable directories, symlinks to the host: close() deletes them all."""
    host = host_dir_with_a_file(tmp_path)
    for top in ("/root/tree", "/var/tmp/tree"):
        r = await sb.exec(["perl", "-e", DEEP_TREE, top, str(DEPTH)])
        assert r.success, r.stderr
    r = await sb.exec(["sh", "-ec", f"""
        mkdir -p /root/locked/sub; touch /root/locked/f /root/locked/sub/g; chmod 0 /root/locked/sub /root/locked
        mkdir /root/ro; touch /root/ro/f; chmod 555 /root/ro
        ln -s {host} /root/hostdir; ln -s {host}/keep /root/hostfile; ln -s {host}/sub /root/tree/d/hostsub
    """])
    assert r.success, r.stderr
    if mode != "single":
        r = await sb.exec(["perl", "-e", DEEP_TREE, "/var/tmp/nobody", str(DEPTH)], user="nobody", cwd="/")
        assert r.success, r.stderr
    layer = sb._layer
    assert layer is not None and layer.is_dir()
    await sb.close()
    assert removal.wait_swept(60)  # the sweeper's thread deletes it
    assert not layer.exists()
    assert_host_dir_intact(host)


# ---- nsbox rm and nsbox gc ---------------------------------------------------

NSBOX = [sys.executable, "-m", "nsbox"]


@pytest.fixture
def state() -> Iterator[Path]:
    """A private state directory (live, layers), so that `rm --all` and
    gc only see this test's sandboxes. Short: socket paths are limited.
    Not set through monkeypatch: tests name `monkeypatch` after this
    fixture, so that their patches are undone before it cleans up."""
    d = Path(tempfile.mkdtemp(prefix="nsbox-rm-"))
    old = os.environ.get("NSBOX_STATE_DIR")
    os.environ["NSBOX_STATE_DIR"] = os.fspath(d)
    try:
        yield d
    finally:
        try:
            for info in live.entries():
                with contextlib.suppress(NsboxError):
                    manage.remove(info, force=True)
            remove_layer(d, idmap.detect())
        finally:
            if old is None:
                del os.environ["NSBOX_STATE_DIR"]
            else:
                os.environ["NSBOX_STATE_DIR"] = old


def nsbox_cmd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NSBOX, *args], capture_output=True, text=True, timeout=60, check=False)


def detached() -> live.SandboxInfo:
    r = nsbox_cmd("run", "--detach", "--", "sleep", "1000")
    assert r.returncode == 0, r.stderr
    info = live.read(r.stdout.strip())
    assert info is not None
    return info


def fill(info: live.SandboxInfo) -> None:
    r = nsbox_cmd("exec", info.id, "--", "perl", "-e", DEEP_TREE, "/var/tmp/tree", str(DEPTH))
    assert r.returncode == 0, r.stderr


def assert_removed(info: live.SandboxInfo) -> None:
    assert live.read(info.id) is None
    assert not live.sandbox_dir(info.id).exists()
    assert not Path(info.layer).exists(), info.layer
    deadline = time.monotonic() + 5
    while info.init_alive:
        assert time.monotonic() < deadline, f"init {info.init_pid} still runs"
        time.sleep(0.02)


def stray_layer(name: str, depth: int = 0) -> Path:
    """A layer no sandbox refers to, old enough for gc."""
    layer = layers.layers_dir() / name
    (layer / "upper").mkdir(parents=True)
    (layer / "upper" / "file").write_text("x")
    if depth:
        deep_tree(layer / "upper", depth)
    old = time.time() - 2 * manage.ORPHAN_LAYER_AGE
    os.utime(layer, (old, old))
    return layer


@contextlib.contextmanager
def immutable_file(path: Path) -> Iterator[None]:
    """A file even real root cannot delete (until chattr -i)."""
    path.write_text("pinned")
    r = subprocess.run(["chattr", "+i", os.fspath(path)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"chattr +i does not work here: {r.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", os.fspath(path)], check=True)


def one_line_each(stderr: str, expected: list[str]) -> None:
    lines = stderr.splitlines()
    assert "Traceback" not in stderr
    assert len(lines) == len(expected), stderr
    for pattern in expected:
        assert any(re.fullmatch(pattern, line) for line in lines), (pattern, stderr)


def test_gc_goes_on_past_a_layer_it_cannot_remove(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deep, plain, stuck = stray_layer("deep", DEPTH), stray_layer("plain"), stray_layer("stuck")
    real = manage.remove_layer

    def failing(layer: Path, mapping: object) -> None:
        if layer == stuck:
            raise RecursionError("maximum recursion depth exceeded")  # as the recursive remover did
        real(layer, mapping)  # type: ignore[arg-type]

    monkeypatch.setattr(manage, "remove_layer", failing)
    r = CliRunner().invoke(main.main, ["gc"])
    assert isinstance(r.exception, SystemExit) and r.exit_code == 1, r.output
    one_line_each(r.stderr, [f"nsbox: cannot remove layer {re.escape(str(stuck))}: RecursionError: .*"])
    assert set(r.stdout.splitlines()) == {f"removed layer {deep}", f"removed layer {plain}"}
    assert not deep.exists() and not plain.exists() and stuck.exists()

    monkeypatch.setattr(manage, "remove_layer", real)
    r = CliRunner().invoke(main.main, ["gc"])
    assert r.exit_code == 0 and r.stdout == f"removed layer {stuck}\n" and r.stderr == "", r.output


def test_gc_on_the_command_line(state: Path, mode: str) -> None:
    # Unpatched: as real root, a file marked immutable is what cannot go.
    deep = stray_layer("deep", DEPTH)
    stuck = stray_layer("stuck") if mode == "root" else None
    with immutable_file(stuck / "upper" / "pinned") if stuck else contextlib.nullcontext():
        r = nsbox_cmd("gc")
        assert f"removed layer {deep}" in r.stdout.splitlines(), r.stdout + r.stderr
        assert not deep.exists()
        if stuck:
            assert r.returncode == 1
            reason = "Operation not permitted: stuck/upper/pinned"
            one_line_each(r.stderr, [f"nsbox: cannot remove layer {re.escape(str(stuck))}: {reason}"])
            assert stuck.exists()
        else:
            assert (r.returncode, r.stderr) == (0, "")
    r = nsbox_cmd("gc")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert not (layers.layers_dir() / "stuck").exists()


def test_rm_all_goes_on_past_sandboxes_it_cannot_remove(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deep, plain, bad_layer, bad_init = (detached() for _ in range(4))
    fill(deep)
    real_remove_layer, real_kill_init = manage.remove_layer, manage._kill_init

    def failing_remove_layer(layer: Path, mapping: object) -> None:
        if layer == Path(bad_layer.layer):
            raise RecursionError("maximum recursion depth exceeded")
        real_remove_layer(layer, mapping)  # type: ignore[arg-type]

    def failing_kill_init(info: live.SandboxInfo) -> None:
        if info.id == bad_init.id:
            raise NsboxError(f"sandbox {info.id}: its init (pid {info.init_pid}) did not exit after SIGKILL")
        real_kill_init(info)

    monkeypatch.setattr(manage, "remove_layer", failing_remove_layer)
    monkeypatch.setattr(manage, "_kill_init", failing_kill_init)
    r = CliRunner().invoke(main.main, ["rm", "--all"])
    assert isinstance(r.exception, SystemExit) and r.exit_code == 1, r.output
    one_line_each(r.stderr, [
        f"nsbox: cannot remove layer {re.escape(bad_layer.layer)} of sandbox {bad_layer.id}: RecursionError: .*",
        f"nsbox: sandbox {bad_init.id}: its init .* did not exit after SIGKILL",
    ])
    assert sorted(r.stdout.split()) == sorted([deep.id, plain.id])
    assert_removed(deep)
    assert_removed(plain)
    assert live.read(bad_layer.id) is not None and Path(bad_layer.layer).exists()
    assert bad_init.init_alive

    monkeypatch.setattr(manage, "remove_layer", real_remove_layer)
    monkeypatch.setattr(manage, "_kill_init", real_kill_init)
    r = CliRunner().invoke(main.main, ["rm", bad_layer.id[:6], "0123456789ab", bad_init.id])
    assert r.exit_code == 1
    one_line_each(r.stderr, ["nsbox: no sandbox '0123456789ab'.*"])
    assert sorted(r.stdout.split()) == sorted([bad_layer.id, bad_init.id])
    assert_removed(bad_layer)
    assert_removed(bad_init)


def test_rm_all_on_the_command_line(state: Path, mode: str) -> None:
    deep, plain = detached(), detached()
    fill(deep)
    stuck = detached() if mode == "root" else None
    pinned = Path(stuck.layer) / "upper" / "pinned" if stuck else None
    with immutable_file(pinned) if pinned else contextlib.nullcontext():
        r = nsbox_cmd("rm", "--all")
        assert {deep.id, plain.id} <= set(r.stdout.split()), r.stdout + r.stderr
        assert_removed(deep)
        assert_removed(plain)
        if stuck:
            assert r.returncode == 1
            reason = f"Operation not permitted: {stuck.id}/upper/pinned"
            one_line_each(r.stderr, [f"nsbox: cannot remove layer {re.escape(stuck.layer)} of sandbox {stuck.id}: {reason}"])
            assert live.read(stuck.id) is not None
        else:
            assert (r.returncode, r.stderr) == (0, "")
    if stuck:
        r = nsbox_cmd("rm", stuck.id)
        assert (r.returncode, r.stdout, r.stderr) == (0, f"{stuck.id}\n", "")
        assert_removed(stuck)

