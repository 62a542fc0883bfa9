"""Truncation is reported: ExecResult counts the bytes dropped, the Inspect
provider logs it once per sandbox environment, the CLI never truncates."""

from __future__ import annotations

import logging
import os
from typing import Any

import anyio
import pytest

import nsbox
from nsbox.init.client import ExecResult

from .test_cli import nsbox as run_cli
from .test_manage import detached

LIMIT = 1000
PROVIDER_LOGGER = "nsbox.inspect.provider"


@pytest.fixture
def small_limit(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setenv("INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE", str(LIMIT))
    return LIMIT


def writes(stdout: int, stderr: int = 0) -> list[str]:
    return ["sh", "-c", f"head -c {stdout} /dev/zero | tr '\\0' o; head -c {stderr} /dev/zero | tr '\\0' e >&2"]


def test_exec_result_stays_compatible() -> None:
    r = ExecResult(True, 0, "out", "err")  # positional, as before
    assert (r.stdout_truncated, r.stderr_truncated, r.truncated) == (0, 0, False)
    r = ExecResult(False, 1, "", "", stderr_truncated=5)
    assert r.truncated and r.stderr_truncated == 5


async def test_exec_counts_the_bytes_dropped(sandbox: nsbox.Sandbox, small_limit: int) -> None:
    r = await sandbox.exec(writes(small_limit + 1234, small_limit + 1))
    assert (r.stdout, r.stdout_truncated) == ("o" * small_limit, 1234)
    assert (r.stderr, r.stderr_truncated) == ("e" * small_limit, 1)
    assert r.truncated
    # One large write that passes the limit in a single read.
    r = await sandbox.exec(writes(300_000 + small_limit))
    assert r.stdout_truncated == 300_000 and len(r.stdout) == small_limit
    # At the limit and below, nothing is dropped.
    for n in (small_limit, 10, 0):
        r = await sandbox.exec(writes(n, n))
        assert (r.stdout_truncated, r.stderr_truncated, len(r.stdout)) == (0, 0, n)


async def test_counts_are_bytes_not_characters(sandbox: nsbox.Sandbox, small_limit: int) -> None:
    # 1500 two-byte characters: 3000 bytes, of which 2000 are dropped.
    r = await sandbox.exec(["python3", "-c", "import sys; sys.stdout.write('é' * 1500)"])
    assert r.stdout_truncated == 2000 and r.stdout == "é" * 500


async def _sample(name: str) -> tuple[Any, Any, dict[str, Any]]:
    from nsbox.inspect.provider import NsboxConfig, NsboxSandboxEnvironment

    cfg = NsboxConfig()
    return cfg, NsboxSandboxEnvironment, await NsboxSandboxEnvironment.sample_init("truncation", cfg,
                                                                                  {"__sample_id__": name})


def warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == PROVIDER_LOGGER and r.levelno >= logging.WARNING]


async def test_provider_logs_truncation_once_per_sample(small_limit: int, caplog: pytest.LogCaptureFixture) -> None:
    from inspect_ai.util import ExecRemoteAwaitableOptions, ExecStdout

    caplog.set_level(logging.DEBUG, logger=PROVIDER_LOGGER)
    cfg, cls, envs = await _sample("1")
    try:
        env = envs["default"]
        r = await env.exec(["true"])
        assert r.success and not warnings(caplog)  # nothing truncated, nothing said
        r = await env.exec(writes(small_limit + 1234, small_limit + 7))
        assert len(r.stdout) == small_limit  # Inspect's ExecResult: the tail, as before
        (record,) = warnings(caplog)
        message = record.getMessage()
        assert "1234 bytes of stdout and 7 bytes of stderr" in message, message
        assert "1000 bytes" in message and env.sandbox.id in message and "head -c" in message
        # More truncation in the same sample: no second warning (debug only),
        # whatever path truncates.
        await env.exec(writes(small_limit + 99))
        await env.exec_remote(writes(small_limit + 5), ExecRemoteAwaitableOptions(), stream=False)
        proc = await env.exec_remote(writes(small_limit + 3000))
        assert proc.process is not None
        while proc.process.running:  # read nothing until it is done: the oldest bytes go
            await anyio.sleep(0.02)
        text = "".join([e.data async for e in proc if isinstance(e, ExecStdout)])
        assert text == "o" * small_limit
        assert len(warnings(caplog)) == 1
        assert len([r for r in caplog.records if r.name == PROVIDER_LOGGER and r.levelno == logging.DEBUG
                    and "truncated" in r.getMessage()]) >= 3
    finally:
        await cls.sample_cleanup("truncation", cfg, envs, False)
    # Another sample says it again, once.
    cfg, cls, envs = await _sample("2")
    try:
        await envs["default"].exec(writes(small_limit + 1))
        await envs["default"].exec(writes(small_limit + 1))
        assert len(warnings(caplog)) == 2
        assert "1 byte of stdout" in warnings(caplog)[-1].getMessage()
    finally:
        await cls.sample_cleanup("truncation", cfg, envs, False)


async def test_provider_streaming_truncation_is_logged(small_limit: int, caplog: pytest.LogCaptureFixture) -> None:
    cfg, cls, envs = await _sample("3")
    try:
        proc = await envs["default"].exec_remote(writes(0, small_limit + 500))
        while proc.process.running:
            await anyio.sleep(0.02)
        events = [e async for e in proc]
        assert events[-1].exit_code == 0
        (record,) = warnings(caplog)
        assert "500 bytes of stderr" in record.getMessage()
    finally:
        await cls.sample_cleanup("truncation", cfg, envs, False)


def test_cli_exec_forwards_everything_and_notes_nothing() -> None:
    # `nsbox exec` copies output as it comes: no limit applies, so nothing
    # is truncated and there is nothing to note on stderr.
    with detached("sleep", "1000") as info:
        env_before = os.environ.get("INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE")
        os.environ["INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE"] = str(LIMIT)
        try:
            r = run_cli("exec", info.id, "--", *writes(5 * LIMIT, 3 * LIMIT))
        finally:
            if env_before is None:
                del os.environ["INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE"]
            else:
                os.environ["INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE"] = env_before
        assert r.returncode == 0
        assert r.stdout == "o" * 5 * LIMIT and r.stderr == "e" * 3 * LIMIT  # no note, nothing dropped


def test_eval_log_says_it_once_per_sample(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.event import LoggerEvent
    from inspect_ai.solver import Generate, TaskState, solver
    from inspect_ai.util import sandbox

    monkeypatch.setenv("INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE", str(LIMIT))

    @solver
    def truncating() -> Any:
        async def solve(state: TaskState, generate: Generate) -> TaskState:
            for n in (2000, 3000):
                r = await sandbox().exec(["seq", "1", str(n)])
                assert len(r.stdout) == LIMIT
            return state
        return solve

    task = Task(dataset=[Sample(input="a"), Sample(input="b")], solver=truncating(), sandbox="nsbox")
    (log,) = eval(task, model="mockllm/model", display="none", log_dir=str(tmp_path))
    assert log.status == "success", log.error
    assert log.samples is not None and len(log.samples) == 2
    for sample in log.samples:
        said = [e.message.message for e in sample.events
                if isinstance(e, LoggerEvent) and e.message.level == "warning" and "nsbox" in e.message.message]
        assert len(said) == 1, said
        assert "`seq 1 2000`" in said[0] and "7893 bytes of stdout" in said[0]
