"""The holds a pull or import keeps on the layers it counted, and the
records of the layers live sandboxes stack (no sandbox: lock files and
records of this process)."""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

import anyio
import pytest

from nsbox.host import live, stacked
from nsbox.storage.uses import Counted

pytestmark = pytest.mark.timeout(30)


def _layer(tmp_path: Path) -> Path:
    layer = tmp_path / "store" / "layers" / "KEY" / "abc"
    layer.mkdir(parents=True)
    (tmp_path / "store" / "locks").mkdir()
    return layer


async def test_two_tasks_waiting_on_one_layer_share_one_hold(tmp_path: Path) -> None:
    """Both waited while a refusal elsewhere held the layer: the second
    had replaced the first's descriptor, which stayed open and locked for
    the life of the process, so no refusal could take the layer back."""
    layer = _layer(tmp_path)
    counted = Counted(tmp_path / "store" / "locks")
    other = os.open(counted._path(layer), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(other, fcntl.LOCK_EX)  # a refusal in another session, taking it back
    first, second = object(), object()
    async with anyio.create_task_group() as tg:
        tg.start_soon(counted.hold, layer, first)
        tg.start_soon(counted.hold, layer, second)
        await anyio.sleep(0.05)
        os.close(other)
    fd, images = counted.held[layer]
    assert images == {id(first), id(second)}
    with counted.alone(layer, first) as alone:
        assert not alone  # the second image still holds it
    with counted.alone(layer, second) as alone:
        assert alone
    counted.close()
    probe = os.open(counted._path(layer), os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nothing of this session holds it
    finally:
        os.close(probe)


def test_a_store_that_cannot_be_written_records_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only store (its in-use directory there already) does not stop
    a sandbox: no one can prune it either."""
    layer = _layer(tmp_path)
    (tmp_path / "store" / "in-use").mkdir()
    real = os.open

    def read_only(path: object, flags: int, *args: object) -> int:
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", read_only)
    stacked.record("sb1", os.getpid(), live.own_start_time(), [layer])
    monkeypatch.undo()
    assert list((tmp_path / "store" / "in-use").iterdir()) == []
    stacked.record("sb1", os.getpid(), live.own_start_time(), [layer])
    assert stacked.layers_in_use(tmp_path / "store") == {os.path.realpath(layer)}
    stacked.forget("sb1", [layer])
    assert stacked.layers_in_use(tmp_path / "store") == set()


def test_the_part_of_a_record_its_killed_writer_left_is_removed(tmp_path: Path) -> None:
    """A record being written (dirs.write_whole) is not read, and is left
    alone; one whose writer was killed is removed."""
    layer = _layer(tmp_path)
    in_use = tmp_path / "store" / "in-use"
    stacked.record("sb1", os.getpid(), live.own_start_time(), [layer])
    stale, writing = in_use / "sb2.json.tmp", in_use / "sb3.json.tmp"
    for part in (stale, writing):
        part.write_text('{"init_pid": 1')
    os.utime(stale, (time.time() - 120,) * 2)
    assert stacked.layers_in_use(tmp_path / "store") == {os.path.realpath(layer)}
    assert sorted(p.name for p in in_use.iterdir()) == ["sb1.json", "sb3.json.tmp"]
