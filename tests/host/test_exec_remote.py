"""Streaming: Sandbox.start_process, and the provider's native exec_remote.

The first half drives nsbox.init.streaming.Process directly; the second calls
Inspect's exec_remote through Inspect's own SandboxEnvironmentProxy, as
sample code and the sandbox agent bridge do, in the bridge's style: a
long-running process whose events a monitor task reads while the caller
talks to it through stdin, then kills it. Timing is bench/exec_remote.py's;
here only behaviour is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from typing import Any, AsyncIterator

import anyio
import pytest

import nsbox
from nsbox import SandboxUnavailable
from nsbox.init.streaming import Event, Exit, Output, Process

from .test_exec import processes

ECHO_SERVER = ["python3", "-u", "-c",
               "import sys\nprint('ready')\nfor line in sys.stdin: print('echo:' + line.strip())\nprint('bye')"]


async def next_event(proc: Any, timeout: float = 10) -> Any:
    with anyio.fail_after(timeout):
        return await proc.__anext__()


async def all_events(proc: Any, timeout: float = 30) -> list[Any]:
    events = []
    with anyio.fail_after(timeout):
        async for event in proc:
            events.append(event)
    return events


async def line(proc: Process, stream: str = "stdout") -> bytes:
    """The next line of `stream` (nothing else may come first; a line may
    come in pieces: `python3 -u` writes the text and the newline apart)."""
    data = b""
    while not data.endswith(b"\n"):
        event = await next_event(proc)
        assert isinstance(event, Output) and event.stream == stream, event
        data += event.data
    return data


def joined(events: list[Event], stream: str) -> bytes:
    return b"".join(e.data for e in events if isinstance(e, Output) and e.stream == stream)


# ---- nsbox.Sandbox.start_process ---------------------------------------------


async def test_output_arrives_while_the_command_runs(sandbox: nsbox.Sandbox) -> None:
    # Each line comes before the command writes the next one: it waits for
    # the line it answers, so nothing here can be the output of an exit.
    proc = await sandbox.start_process(ECHO_SERVER, stdin_open=True)
    assert proc.running
    assert await line(proc) == b"ready\n"
    for word in ("one", "two", "three"):
        await proc.write_stdin(f"{word}\n")
        assert await line(proc) == f"echo:{word}\n".encode()
    await proc.write_stdin(b"bytes too\n")
    assert await line(proc) == b"echo:bytes too\n"
    await proc.close_stdin()
    await proc.close_stdin()  # idempotent
    events = await all_events(proc)
    assert joined(events, "stdout") == b"bye\n" and events[-1] == Exit(0)
    assert proc.returncode == 0 and not proc.running
    with pytest.raises(BrokenPipeError):
        await proc.write_stdin("too late\n")


async def test_streams_interleave_in_order_and_exit_status_is_an_event(sandbox: nsbox.Sandbox) -> None:
    proc = await sandbox.start_process(["sh", "-c", "echo a; sleep 0.05; echo b >&2; sleep 0.05; echo c; exit 3"])
    events = await all_events(proc)
    assert events == [Output("stdout", b"a\n"), Output("stderr", b"b\n"), Output("stdout", b"c\n"), Exit(3)]
    proc = await sandbox.start_process(["sh", "-c", "kill -TERM $$"])
    assert await all_events(proc) == [Exit(143)]


async def test_input_then_closed_or_kept_open(sandbox: nsbox.Sandbox) -> None:
    # input alone: written, then stdin is closed.
    r = await (await sandbox.start_process(["cat"], input="given\n")).wait()
    assert (r.returncode, r.stdout) == (0, "given\n")
    # Large input does not hold up start_process: the pump feeds it.
    big = b"x" * (4 * 1024 * 1024)
    proc = await sandbox.start_process(["sh", "-c", "sleep 0.2; wc -c"], input=big)
    assert (await proc.wait()).stdout.strip() == str(len(big))
    # input and stdin_open: the input first, then what is written.
    proc = await sandbox.start_process(["cat"], input="first\n", stdin_open=True)
    await proc.write_stdin("second\n")
    await proc.close_stdin()
    assert (await proc.wait()).stdout == "first\nsecond\n"
    # write_stdin waits while the pipe is full, until the command reads.
    proc = await sandbox.start_process(["sh", "-c", "sleep 0.2; wc -c"], stdin_open=True)
    with anyio.fail_after(30):
        await proc.write_stdin(big)
        await proc.write_stdin(big)
    await proc.close_stdin()
    assert (await proc.wait()).stdout.strip() == str(2 * len(big))
    # No input: /dev/null, and stdin cannot be written.
    proc = await sandbox.start_process(["cat"])
    with pytest.raises(ValueError, match="stdin_open"):
        await proc.write_stdin("x")
    assert (await proc.wait()).stdout == ""


async def test_kill_ends_the_tree_and_the_exit_still_arrives(sandbox: nsbox.Sandbox) -> None:
    proc = await sandbox.start_process(["sh", "-c", "echo started; sleep 300 & setsid sleep 301 & sleep 302"])
    assert await line(proc) == b"started\n"
    assert [p for p in await processes(sandbox) if "sleep 30" in p]
    started = time.monotonic()
    await proc.kill()
    assert time.monotonic() - started < 5
    assert not proc.running and proc.returncode == 137
    assert await all_events(proc) == [Exit(137)]
    assert not [p for p in await processes(sandbox) if "sleep" in p]
    await proc.kill()  # a no-op once done


async def test_context_manager_and_signal(sandbox: nsbox.Sandbox) -> None:
    async with await sandbox.start_process(["sleep", "300"]) as proc:
        pass
    assert proc.returncode == 137
    proc = await sandbox.start_process(["sh", "-c", "trap 'echo got TERM; exit 9' TERM; echo ready; "
                                        "while :; do sleep 0.1; done"])
    assert await line(proc) == b"ready\n"
    proc.signal(15)  # to the whole tree: the shell and its sleep
    events = await all_events(proc)
    assert joined(events, "stdout") == b"got TERM\n" and events[-1] == Exit(9)


async def test_the_process_outlives_the_task_that_started_it(sandbox: nsbox.Sandbox) -> None:
    started: list[Process] = []

    async def starter() -> None:
        started.append(await sandbox.start_process(["sh", "-c", "sleep 0.3; echo later"]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(starter)
    assert await all_events(started[0]) == [Output("stdout", b"later\n"), Exit(0)]


async def test_a_background_holder_of_stdout_does_not_keep_it_running(sandbox: nsbox.Sandbox) -> None:
    started = time.monotonic()
    proc = await sandbox.start_process(["sh", "-c", "sleep 300 & echo done"])
    events = await all_events(proc)
    assert events == [Output("stdout", b"done\n"), Exit(0)] and time.monotonic() - started < 5


async def test_many_concurrent_processes(sandbox: nsbox.Sandbox) -> None:
    procs = [await sandbox.start_process(["sh", "-c", f"sleep 0.2; echo {i}; exit {i % 7}"]) for i in range(100)]
    results: dict[int, list[Event]] = {}

    async def collect(i: int, proc: Process) -> None:
        results[i] = await all_events(proc)

    async with anyio.create_task_group() as tg:
        for i, proc in enumerate(procs):
            tg.start_soon(collect, i, proc)
    assert all(results[i] == [Output("stdout", f"{i}\n".encode()), Exit(i % 7)] for i in range(100))


async def test_start_failures_as_exec_reports_them(sandbox: nsbox.Sandbox) -> None:
    r = await (await sandbox.start_process(["no-such-command"])).wait()
    assert (r.returncode, r.stderr) == (127, "nsbox: no-such-command: command not found\n")
    events = await all_events(await sandbox.start_process(["true"], user="no-such-user"))
    assert events[-1] == Exit(126) and b"unable to find user" in joined(events, "stderr")
    with pytest.raises(PermissionError):
        await sandbox.start_process(["/etc/passwd"])
    with pytest.raises(ValueError):
        await sandbox.start_process("echo hi")  # type: ignore[arg-type]


async def test_a_sandbox_that_stops_is_unavailable_not_an_exit() -> None:
    sb = await nsbox.Sandbox.create()
    try:
        proc = await sb.start_process(["sh", "-c", "echo up; sleep 300"])
        assert await line(proc) == b"up\n"
        await sb.close()
        with pytest.raises(SandboxUnavailable):
            await all_events(proc)
    finally:
        await sb.close()
    with pytest.raises(SandboxUnavailable):
        await sb.start_process(["true"])


async def test_a_consumer_that_does_not_read_loses_the_oldest_bytes(
        sandbox: nsbox.Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    limit = 100_000
    monkeypatch.setenv("INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE", str(limit))
    total = 3_000_000
    proc = await sandbox.start_process(
        ["sh", "-c", f"head -c {total} /dev/zero | tr '\\0' x; echo END; echo small >&2"])
    with anyio.fail_after(30):
        while proc.running:  # the command never blocks on us: it finishes unread
            await anyio.sleep(0.05)
    assert proc.returncode == 0
    assert proc.stdout_truncated == total + 4 - limit and proc.stderr_truncated == 0
    events = await all_events(proc)
    out = [e for e in events if isinstance(e, Output) and e.stream == "stdout"]
    assert out[0].dropped == total + 4 - limit and all(e.dropped == 0 for e in out[1:])
    assert joined(events, "stdout") == b"x" * (limit - 4) + b"END\n"
    assert joined(events, "stderr") == b"small\n" and events[-1] == Exit(0)


async def test_wait_returns_the_rest_with_truncation_counts(
        sandbox: nsbox.Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE", "1000")
    proc = await sandbox.start_process(["sh", "-c", "head -c 5000 /dev/zero | tr '\\0' a >&2; printf ok"])
    r = await proc.wait()
    assert (r.success, r.stdout, r.stderr, r.stdout_truncated, r.stderr_truncated) == (True, "ok", "a" * 1000, 0, 4000)


FLOOD = textwrap.dedent("""
    import anyio, json, nsbox
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith(("VmRSS", "VmHWM")):
                yield line.split()[0][:-1], int(line.split()[1]) * 1024
    async def main():
        async with nsbox.Sandbox() as sb:
            await sb.exec(["true"])
            before = dict(rss())["VmRSS"]
            # Both streams flood; nobody reads until the command is done.
            proc = await sb.start_process(["sh", "-c", "head -c 536870912 /dev/zero | tr '\\\\0' x & "
                                           "head -c 268435456 /dev/zero | tr '\\\\0' y >&2; wait; echo END"])
            while proc.running:
                await anyio.sleep(0.05)
            hwm = dict(rss())["VmHWM"]
            r = await proc.wait()
        print(json.dumps({"before": before, "hwm": hwm, "tail": r.stdout[-8:], "len": len(r.stdout),
                          "dropped": [r.stdout_truncated, r.stderr_truncated]}))
    anyio.run(main)
""")


@pytest.mark.timeout(300)
def test_flood_with_no_consumer_keeps_memory_bounded() -> None:
    out = subprocess.run([sys.executable, "-c", FLOOD], capture_output=True, text=True, timeout=280,
                         env={**os.environ, "INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE": str(8 << 20)})
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout)
    limit = 8 << 20
    assert m["len"] == limit and m["tail"] == "xxxxEND\n"
    assert m["dropped"] == [(512 << 20) + 4 - limit, (256 << 20) - limit]
    growth = m["hwm"] - m["before"]
    # Two streams of `limit` each, plus a read and a constant per stream;
    # without the bound this would be 768 MiB.
    assert growth < 2 * limit + 8 * 1024 * 1024, f"host grew by {growth / 2**20:.1f} MiB"


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_streaming_on_trio(anyio_backend: str) -> None:
    async with nsbox.Sandbox() as sb:
        proc = await sb.start_process(ECHO_SERVER, stdin_open=True)
        assert await line(proc) == b"ready\n"
        await proc.write_stdin("hi\n")
        assert await line(proc) == b"echo:hi\n"
        await proc.close_stdin()
        events = await all_events(proc)
        assert joined(events, "stdout") == b"bye\n" and events[-1] == Exit(0)
        proc = await sb.start_process(["wc", "-c"], stdin_open=True)
        await proc.write_stdin(b"z" * (4 << 20))
        await proc.close_stdin()
        assert (await proc.wait()).stdout.strip() == str(4 << 20)
        proc = await sb.start_process(["sleep", "300"])
        await proc.kill()
        assert await all_events(proc) == [Exit(137)]


# ---- Inspect's exec_remote -----------------------------------------------------


@pytest.fixture
async def inspect_env() -> AsyncIterator[Any]:
    """A sample's default environment as sample code sees it: wrapped in
    Inspect's SandboxEnvironmentProxy."""
    from inspect_ai.util._sandbox.events import SandboxEnvironmentProxy

    from nsbox.inspect.provider import NsboxConfig, NsboxSandboxEnvironment

    cfg = NsboxConfig()
    envs = await NsboxSandboxEnvironment.sample_init("exec_remote", cfg, {"__sample_id__": "1"})
    try:
        yield SandboxEnvironmentProxy(envs["default"])
    finally:
        await NsboxSandboxEnvironment.sample_cleanup("exec_remote", cfg, envs, False)


async def test_exec_remote_is_native_through_inspects_proxy(inspect_env: Any) -> None:
    from inspect_ai.util import ExecCompleted, ExecRemoteProcess, ExecStderr, ExecStdout

    from nsbox.inspect.provider import NsboxExecRemoteProcess

    proc = await inspect_env.exec_remote(["sh", "-c", "echo out; sleep 0.05; echo err >&2; exit 4"])
    assert isinstance(proc, ExecRemoteProcess) and isinstance(proc, NsboxExecRemoteProcess)
    assert isinstance(proc.pid, int)
    assert await all_events(proc) == [ExecStdout("out\n"), ExecStderr("err\n"), ExecCompleted(4)]
    with pytest.raises(RuntimeError, match="only be iterated once"):
        aiter(proc)
    # No tool server was injected: nothing polls.
    assert not inspect_env._sandbox._tools_injected


async def test_agent_bridge_style_caller(inspect_env: Any) -> None:
    """A long-running process a monitor task watches (as the sandbox agent
    bridge watches its model proxy), talked to through stdin, then killed."""
    from inspect_ai.util import ExecCompleted, ExecRemoteStreamingOptions, ExecStderr, ExecStdout

    proc = await inspect_env.exec_remote(
        ["python3", "-u", "-c", "import sys\nprint('ready')\nprint('log', file=sys.stderr)\n"
         "for line in sys.stdin: print('echo:' + line.strip())"],
        ExecRemoteStreamingOptions(stdin_open=True, env={"X": "1"}, concurrency=False))
    stdout: list[str] = []
    stderr: list[str] = []
    got_line = anyio.Event()
    monitor_done = anyio.Event()
    completed: list[Any] = []

    async def monitor() -> None:
        nonlocal got_line
        async for event in proc:
            if isinstance(event, ExecStdout):
                stdout.append(event.data)
                got_line.set()
                got_line = anyio.Event()
            elif isinstance(event, ExecStderr):
                stderr.append(event.data)
            elif isinstance(event, ExecCompleted):
                completed.append(event)
        monitor_done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(monitor)
        with anyio.fail_after(10):
            while "ready\n" not in "".join(stdout):
                await got_line.wait()
            for i in range(20):
                await proc.write_stdin(f"message {i}\n")
                while f"echo:message {i}\n" not in "".join(stdout):
                    await got_line.wait()
        await proc.kill()
        with anyio.fail_after(10):
            await monitor_done.wait()
    assert "".join(stdout).splitlines() == ["ready"] + [f"echo:message {i}" for i in range(20)]
    assert "".join(stderr) == "log\n"
    assert completed == []  # killed: no ExecCompleted, as with Inspect's own
    with pytest.raises(RuntimeError, match="terminated"):
        await proc.write_stdin("after kill\n")
    await proc.close_stdin()  # a no-op once killed
    await proc.kill()  # so is a second kill
    assert not [p for p in await processes(inspect_env.as_type(_nsbox_env()).sandbox) if "python3" in p]


def _nsbox_env() -> type:
    from nsbox.inspect.provider import NsboxSandboxEnvironment

    return NsboxSandboxEnvironment


async def test_exec_remote_stdin_rules_and_kill_after_output(inspect_env: Any) -> None:
    from inspect_ai.util import ExecCompleted, ExecStdout

    proc = await inspect_env.exec_remote(["cat"])
    with pytest.raises(RuntimeError, match="stdin_open=True"):
        await proc.write_stdin("x")
    with pytest.raises(RuntimeError, match="stdin_open=True"):
        await proc.close_stdin()
    assert await all_events(proc) == [ExecCompleted(0)]
    # kill() keeps the output written before it for the iterator.
    proc = await inspect_env.exec_remote(["sh", "-c", "echo before; sleep 300"])
    with anyio.fail_after(10):
        while not proc.process.backlog:  # written, not yet taken
            await anyio.sleep(0.01)
    await proc.kill()
    assert await all_events(proc) == [ExecStdout("before\n")]


async def test_exec_remote_cancellation_kills(inspect_env: Any) -> None:
    sandbox = inspect_env.as_type(_nsbox_env()).sandbox
    proc = await inspect_env.exec_remote(["sh", "-c", "sleep 300"])
    with anyio.move_on_after(0.3):
        async for _ in proc:
            pass
    assert proc.process.returncode == 137
    assert not [p for p in await processes(sandbox) if "sleep" in p]


async def test_exec_remote_awaitable(inspect_env: Any) -> None:
    from inspect_ai.util import ExecRemoteAwaitableOptions

    r = await inspect_env.exec_remote(["sh", "-c", "cat; echo err >&2; exit 2"],
                                      ExecRemoteAwaitableOptions(input="in\n"), stream=False)
    assert (r.success, r.returncode, r.stdout, r.stderr) == (False, 2, "in\n", "err\n")
    sandbox = inspect_env.as_type(_nsbox_env()).sandbox
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await inspect_env.exec_remote(["sh", "-c", "sleep 300 & sleep 301"], ExecRemoteAwaitableOptions(timeout=0.5),
                                      stream=False)
    assert time.monotonic() - started < 10
    assert not [p for p in await processes(sandbox) if "sleep" in p]


async def test_exec_remote_utf8_split_across_writes(inspect_env: Any) -> None:
    from inspect_ai.util import ExecCompleted, ExecStdout

    # "é" is two bytes, written one at a time with a pause between them.
    proc = await inspect_env.exec_remote(["sh", "-c", "printf '\\303'; sleep 0.1; printf '\\251!'; printf '\\377'"])
    events = await all_events(proc)
    assert events[-1] == ExecCompleted(0)
    assert "".join(e.data for e in events if isinstance(e, ExecStdout)) == "é!\ufffd"


def test_exec_remote_in_an_eval_streams_natively(tmp_path: Any) -> None:
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.solver import Generate, TaskState, solver
    from inspect_ai.util import ExecCompleted, ExecRemoteStreamingOptions, ExecStdout, sandbox

    @solver
    def streaming() -> Any:
        async def solve(state: TaskState, generate: Generate) -> TaskState:
            proc = await sandbox().exec_remote(["sh", "-c", "read x; echo got $x"],
                                               ExecRemoteStreamingOptions(stdin_open=True))
            await proc.write_stdin("it\n")
            events = [e async for e in proc]
            assert "".join(e.data for e in events if isinstance(e, ExecStdout)) == "got it\n"
            assert events[-1] == ExecCompleted(0)
            assert type(proc).__name__ == "NsboxExecRemoteProcess"
            state.metadata["streamed"] = True
            return state
        return solve

    (log,) = eval(Task(dataset=[Sample(input="a")], solver=streaming(), sandbox="nsbox"), model="mockllm/model",
                  display="none", log_dir=str(tmp_path))
    assert log.status == "success", log.error
    assert log.samples is not None and log.samples[0].metadata.get("streamed") is True
    # Inspect's tool server was neither injected nor polled.
    from inspect_ai.util._sandbox._cli import SANDBOX_CLI

    assert not [e for e in log.samples[0].events if SANDBOX_CLI in str(getattr(e, "cmd", "") or "")]
    assert not [e for e in log.samples[0].events if getattr(e, "action", None) == "write_file"]
