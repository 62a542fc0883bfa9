"""The capped output buffer through exec (tests/unit/init/test_capture.py
has the buffer on its own)."""

from __future__ import annotations

import pytest

import nsbox


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
