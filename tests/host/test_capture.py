"""The capped output buffer, on its own and through exec."""

from __future__ import annotations

import errno
import os
import random
import platform
import string
import sys
import threading
import time

import pytest

import nsbox
from nsbox._text import TextBuffer
from nsbox.init.capture import READ_CHUNK, CappedBuffer


def drain(buf: CappedBuffer, fd: int) -> None:
    while True:
        try:
            if buf.read_from(fd) == 0:
                return
        except BlockingIOError:
            return


def feed(limit: int, writes: list[bytes]) -> CappedBuffer:
    """Feeds `writes` through a pipe into a buffer, as exec does."""
    buf = CappedBuffer(limit)
    r, w = os.pipe()
    os.set_blocking(r, False)
    try:
        for data in writes:
            view = memoryview(data)
            while view:
                view = view[os.write(w, view[:60000]) :]
                drain(buf, r)
    finally:
        os.close(w)
        drain(buf, r)
        os.close(r)
    return buf


@pytest.mark.parametrize("limit", [1, 7, 1000, READ_CHUNK, READ_CHUNK + 3, 300_000])
def test_keeps_exactly_the_last_bytes(limit: int) -> None:
    rng = random.Random(limit)
    for _ in range(5):
        writes = [rng.randbytes(rng.choice([1, 50, 4096, 70_000, 200_000])) for _ in range(rng.randint(1, 12))]
        whole = b"".join(writes)
        buf = feed(limit, writes)
        assert buf.total == len(whole)
        assert buf.truncated == (len(whole) > limit)
        assert buf.take() == whole[-limit:]


LIMITS = [1, 7, 1000, READ_CHUNK, READ_CHUNK + 3, 300_000]


@pytest.mark.parametrize("limit", LIMITS)
def test_ascii_text_is_exactly_the_last_bytes(limit: int) -> None:
    # ASCII comes back as the ring's own str (no decode): it must be a
    # whole, ordinary str, whether the ring wrapped or was shrunk to fit.
    rng = random.Random(limit)
    for _ in range(5):
        writes = [rng.choice(string.printable).encode() * rng.choice([1, 50, 4096, 70_000, 200_000])
                  for _ in range(rng.randint(1, 12))]
        whole = b"".join(writes).decode()
        got = feed(limit, writes).take_text()
        want = whole[-limit:]
        assert type(got) is str and got == want
        assert len(got) == len(want) and hash(got) == hash(want) and got.isascii()
        assert sys.getsizeof(got) == sys.getsizeof(want)  # shrunk to its length
        assert {got: 1}[want] == 1 and (got + "!")[-2:] == want[-1] + "!"


@pytest.mark.parametrize("limit", [1000, READ_CHUNK + 3, 300_000])
def test_bytes_that_are_not_ascii_are_decoded_wherever_they_come(limit: int) -> None:
    ascii_block = b"a" * 100_000
    for writes in (
        [b"\xff" + ascii_block, ascii_block],  # in the first read, kept only with a large limit
        [ascii_block, "é€".encode() * 3, ascii_block],  # in the middle, wrapped or not
        [ascii_block * 3, b"\x80"],  # the very last byte
        [b"\xc3" * 70_000],  # invalid UTF-8 only
    ):
        whole = b"".join(writes)
        assert feed(limit, writes).take_text() == whole[-limit:].decode("utf-8", "replace")


def test_a_limit_of_zero_keeps_nothing_and_counts_all() -> None:
    buf = feed(0, [b"x" * 200_000])
    assert (buf.total, buf.dropped, buf.take_text()) == (200_000, 200_000, "")


def test_text_buffer_refuses_misuse() -> None:
    with pytest.raises(ValueError):
        TextBuffer(0)  # would be the interpreter's shared empty str
    buf = TextBuffer(10)
    with pytest.raises(ValueError):
        buf.write_at(5, b"123456")
    with pytest.raises(ValueError):
        buf.write_at(-1, b"1")
    with pytest.raises(TypeError):
        memoryview(buf)[0] = 1  # read-only: writes go through the ASCII check
    r, w = os.pipe()
    os.write(w, b"x")
    with pytest.raises((TypeError, BufferError)):
        os.readv(r, [buf])
    os.close(r)
    os.close(w)
    buf.write_at(0, b"0123456789")
    with pytest.raises(ValueError):
        buf.read_from(0, 10)
    with pytest.raises(ValueError):
        buf.take(5, 3)  # a start other than 0 means the ring is full
    view = memoryview(buf)
    with pytest.raises(BufferError):
        buf.take(10, 0)  # a view would see the str change under it
    view.release()
    assert buf.take(10, 4) == "4567890123"
    with pytest.raises(BufferError):
        buf.take(10, 0)
    with pytest.raises(BufferError):
        buf.read_from(0, 0)


def test_text_buffer_reads_report_errors_as_os_read_does() -> None:
    buf = TextBuffer(100)
    buf.write_at(0, b"x" * 98)
    r, w = os.pipe()
    os.set_blocking(r, False)
    try:
        with pytest.raises(BlockingIOError):
            buf.read_from(r, 98)
        os.write(w, b"abc")
        assert buf.read_from(r, 98) == 3  # wraps: "ab" at 98, "c" at 0
        os.close(w)
        w = -1
        assert buf.read_from(r, 1) == 0
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    with pytest.raises(OSError) as e:
        buf.read_from(r, 0)
    assert e.value.errno == errno.EBADF
    assert buf.take(100, 1) == "x" * 97 + "abc"


def test_text_buffer_hands_out_only_bytes_it_wrote() -> None:
    # The str's memory starts uninitialised: a byte nobody wrote was never
    # checked for ASCII, and may be anything a freed object left there.
    buf = TextBuffer(100)
    assert len(memoryview(buf)) == 0
    with pytest.raises(ValueError):
        buf.take(1, 0)
    with pytest.raises(ValueError):
        buf.write_at(5, b"a")  # would leave 0..4 unwritten
    r, w = os.pipe()
    try:
        os.write(w, b"z")
        with pytest.raises(ValueError):
            buf.read_from(r, 5)
    finally:
        os.close(r)
        os.close(w)
    buf.write_at(0, b"abcdef")
    with memoryview(buf) as view:
        assert view.tobytes() == b"abcdef"
        buf.write_at(1, view[:5])  # overlapping: memmove
    with pytest.raises(ValueError):
        buf.take(7, 0)
    assert buf.take(6, 0) == "aabcde"


READV = {"x86_64": "19", "aarch64": "65"}  # syscall numbers, as /proc/TID/syscall shows them


def blocked_in_read(tid: int) -> bool:
    task = f"/proc/self/task/{tid}"
    with open(f"{task}/wchan") as f:
        if "pipe_read" in f.read():
            return True
    with open(f"{task}/syscall") as f:
        return f.read().split(" ", 1)[0] == READV.get(platform.machine())


def test_text_buffer_is_not_taken_while_another_thread_reads_into_it() -> None:
    # The read runs without the GIL: handing out (and freeing) the str then
    # would let the kernel write into freed memory.
    buf = TextBuffer(100)
    r, w = os.pipe()
    got: dict[str, object] = {}

    def reader() -> None:
        got["tid"] = threading.get_native_id()
        got["n"] = buf.read_from(r, 0)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while "tid" not in got or not blocked_in_read(got["tid"]):  # type: ignore[arg-type]
            assert time.monotonic() < deadline, "the reader never blocked in its read"
            time.sleep(0.01)
        with pytest.raises(BufferError, match="in use"):
            buf.take(0, 0)
    finally:
        os.write(w, b"hi")
        thread.join(10)
        os.close(r)
        os.close(w)
    assert got["n"] == 2 and buf.take(2, 0) == "hi"


def test_text_across_the_wrap_point() -> None:
    # "é" is two bytes; with an odd limit the ring wraps inside characters.
    text = "é" * 50_000 + "€end"
    for limit in (101, 65_537, 99_999):
        got = feed(limit, [text.encode()]).take_text()
        assert got == text.encode()[-limit:].decode("utf-8", "replace")


async def test_a_shorter_output_shows_nothing_of_an_earlier_longer_one(sandbox: nsbox.Sandbox) -> None:
    first = await sandbox.exec(["sh", "-c", "head -c 300000 /dev/zero | tr '\\0' A"])
    assert first.stdout == "A" * 300_000
    second = await sandbox.exec(["sh", "-c", "head -c 100000 /dev/zero | tr '\\0' B"])
    assert second.stdout == "B" * 100_000


async def test_output_of_exactly_the_limit(sandbox: nsbox.Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE", str(200_000))
    r = await sandbox.exec(["sh", "-c", "head -c 199999 /dev/zero | tr '\\0' x; printf Z"])
    assert r.stdout == "x" * 199_999 + "Z"
    r = await sandbox.exec(["sh", "-c", "printf a; head -c 200000 /dev/zero | tr '\\0' x"])
    assert r.stdout == "x" * 200_000
