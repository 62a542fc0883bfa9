"""The capped output buffer, on its own and through exec."""

from __future__ import annotations

import os
import random

import pytest

import nsbox
from nsbox.capture import READ_CHUNK, CappedBuffer


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


def test_text_across_the_wrap_point() -> None:
    # "é" is two bytes; with an odd limit the ring wraps inside characters.
    text = "é" * 50_000 + "€end"
    for limit in (101, 65_537, 99_999):
        got = feed(limit, [text.encode()]).take_text()
        assert got == text.encode()[-limit:].decode("utf-8", "replace")


async def test_reused_rings_do_not_leak_between_execs(sandbox: nsbox.Sandbox) -> None:
    # A large output leaves its ring for the next exec; a shorter output in
    # the same ring must not show the rest of the earlier one.
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
