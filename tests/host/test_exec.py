"""exec: output, errors, input, users, timeouts, limits, concurrency."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import anyio
import pytest

import nsbox
from nsbox import CommandTimeout, OutputLimitExceeded, SandboxUnavailable, UserUnsupported
from nsbox.init import execfds


async def processes(sb: nsbox.Sandbox) -> list[str]:
    """Command lines of every process in the sandbox except the init and this probe."""
    r = await sb.exec(["sh", "-c", 'for p in /proc/[0-9]*; do [ "${p#/proc/}" = $$ ] || '
                                   'tr "\\0" " " < $p/cmdline; echo; done'])
    return [line.strip() for line in r.stdout.splitlines() if line.strip() and "nsbox-init" not in line]


async def test_output_streams_and_status(sandbox: nsbox.Sandbox) -> None:
    r = await sandbox.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.success, r.returncode, r.stdout, r.stderr) == (False, 3, "out\n", "err\n")


async def test_signal_death_is_128_plus_n(sandbox: nsbox.Sandbox) -> None:
    assert (await sandbox.exec(["sh", "-c", "kill -KILL $$"])).returncode == 137
    assert (await sandbox.exec(["sh", "-c", "kill -TERM $$"], timeout=30)).returncode == 143


async def test_commands_start_with_default_signal_state(sandbox: nsbox.Sandbox) -> None:
    # The init blocks SIGCHLD and ignores SIGPIPE; neither may leak into
    # commands (a shell pipeline would then never see SIGPIPE).
    r = await sandbox.exec(["sh", "-c", "grep -E '^Sig(Blk|Ign)' /proc/self/status"])
    fields = dict(line.split(":\t") for line in r.stdout.splitlines())
    assert fields == {"SigBlk": "0000000000000000", "SigIgn": "0000000000000000"}
    r = await sandbox.exec(["sh", "-c", "yes | head -c 1 >/dev/null; echo ${PIPESTATUS:-done}"])
    assert r.returncode == 0


async def test_missing_command_is_127_with_message(sandbox: nsbox.Sandbox) -> None:
    r = await sandbox.exec(["no-such-command-xyz"])
    assert r.returncode == 127 and not r.success
    assert "no-such-command-xyz" in r.stderr and "not found" in r.stderr


async def test_non_executable_raises_permission_error(sandbox: nsbox.Sandbox) -> None:
    with pytest.raises(PermissionError):
        await sandbox.exec(["/etc/passwd"])


async def test_script_without_shebang_runs_with_sh(sandbox: nsbox.Sandbox) -> None:
    await sandbox.write_file("/tmp/script", "echo from-script\n")
    await sandbox.exec(["chmod", "+x", "/tmp/script"])
    assert (await sandbox.exec(["/tmp/script"])).stdout == "from-script\n"


async def test_missing_cwd_names_it(sandbox: nsbox.Sandbox) -> None:
    r = await sandbox.exec(["true"], cwd="/no/such/dir")
    assert not r.success and "/no/such/dir" in r.stderr


async def test_cwd_relative_to_workdir(sandbox: nsbox.Sandbox) -> None:
    await sandbox.exec(["mkdir", "sub"])
    assert (await sandbox.exec(["pwd"], cwd="sub")).stdout == f"{sandbox.workdir}/sub\n"
    assert (await sandbox.exec(["pwd"])).stdout == f"{sandbox.workdir}\n"


async def test_env_and_path_resolution(sandbox: nsbox.Sandbox) -> None:
    r = await sandbox.exec(["sh", "-c", 'echo "$A|$B"'], env={"A": "1 2", "B": "$HOME `x`"})
    assert r.stdout == "1 2|$HOME `x`\n"
    # cmd[0] is found through the command's own PATH.
    await sandbox.write_file("/opt/bin/hello-nsbox", "#!/bin/sh\necho found\n")
    await sandbox.exec(["chmod", "+x", "/opt/bin/hello-nsbox"])
    assert (await sandbox.exec(["hello-nsbox"])).returncode == 127
    assert (await sandbox.exec(["hello-nsbox"], env={"PATH": "/opt/bin:/usr/bin"})).stdout == "found\n"


async def test_input_text_bytes_and_empty(sandbox: nsbox.Sandbox) -> None:
    assert (await sandbox.exec(["cat"], input="héllo\n")).stdout == "héllo\n"
    r = await sandbox.exec(["sh", "-c", "cat > /tmp/bin"], input=b"\x00\xff\xc3(")
    assert r.success and await sandbox.read_file("/tmp/bin", text=False) == b"\x00\xff\xc3("
    assert (await sandbox.exec(["cat"], input="")).stdout == ""
    # No input at all: stdin is /dev/null, so cat ends at once.
    assert (await sandbox.exec(["cat"], timeout=10)).stdout == ""


async def test_large_input_and_argv(sandbox: nsbox.Sandbox) -> None:
    r = await sandbox.exec(["wc", "-c"], input=b"a" * (50 * 1024 * 1024))
    assert r.stdout.split()[0] == str(50 * 1024 * 1024)
    chunk = "x" * (64 * 1024)
    r = await sandbox.exec(["printf", "%s", *([chunk] * 16)])
    assert r.stdout == chunk * 16


async def test_input_not_read_is_not_an_error(sandbox: nsbox.Sandbox) -> None:
    r = await sandbox.exec(["true"], input=b"z" * (8 * 1024 * 1024))
    assert r.success


async def test_invalid_utf8_is_replaced(sandbox: nsbox.Sandbox) -> None:
    r = await sandbox.exec(["printf", "a\\377b"])
    assert r.stdout == "a\ufffdb"


async def test_front_truncation_keeps_last_bytes(sandbox: nsbox.Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE", "1000")
    script = "i=0; while [ $i -lt 3000 ]; do echo line$i; i=$((i+1)); done"
    full = "".join(f"line{i}\n" for i in range(3000))
    r = await sandbox.exec(["sh", "-c", script])
    assert r.stdout == full[-1000:]
    # One large write that passes the limit in a single read.
    r = await sandbox.exec(["sh", "-c", "head -c 300000 /dev/zero | tr '\\0' a; echo END"])
    assert r.stdout == "a" * 996 + "END\n"
    # Exactly at the limit nothing is lost.
    r = await sandbox.exec(["head", "-c", "1000", "/etc/passwd"])
    assert len(r.stdout) == min(1000, len(await sandbox.read_file("/etc/passwd")))
    # stderr is capped independently.
    r = await sandbox.exec(["sh", "-c", f"({script}) >&2; echo small"])
    assert r.stderr == full[-1000:] and r.stdout == "small\n"


async def test_raise_mode_raises_with_tail() -> None:
    os.environ["INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE"] = "4096"
    try:
        async with nsbox.Sandbox(output_limit_mode="raise") as sb:
            with pytest.raises(OutputLimitExceeded) as e:
                await sb.exec(["sh", "-c", "yes 0123456789 | head -c 100000; sleep 300"], timeout=60)
            assert e.value.limit == 4096 and e.value.stdout and len(e.value.stdout) <= 4096
            assert "limit of 4 KiB was exceeded" in str(e.value)
            assert not [p for p in await processes(sb) if "sleep" in p]
            assert (await sb.exec(["echo", "fine"])).stdout == "fine\n"
    finally:
        del os.environ["INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE"]


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
            r = await sb.exec(["sh", "-c", "head -c 1073741824 /dev/zero | tr '\\\\0' x; echo END"])
            after = dict(rss())
        print(json.dumps({"before": before, "hwm": after["VmHWM"], "tail": r.stdout[-8:], "len": len(r.stdout)}))
    anyio.run(main)
""")


def test_gigabyte_flood_keeps_memory_bounded() -> None:
    # A fresh interpreter, so the peak RSS belongs to this exec alone.
    out = subprocess.run([sys.executable, "-c", FLOOD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout)
    limit = 10 * 1024 * 1024
    assert m["len"] == limit and m["tail"] == "xxxxEND\n"
    growth = m["hwm"] - m["before"]
    # While the command runs the host holds the ring (limit) and one read
    # chunk per stream; returning the tail as text costs one more copy of
    # it. Without the cap this would be more than a gigabyte.
    assert growth < 2 * limit + 4 * 1024 * 1024, f"host grew by {growth / 2**20:.1f} MiB"


async def test_timeout_kills_the_whole_tree(sandbox: nsbox.Sandbox) -> None:
    started = time.monotonic()
    with pytest.raises(CommandTimeout) as e:
        await sandbox.exec(["sh", "-c", "sleep 300 & setsid sleep 301 & echo started; sleep 302; :"], timeout=1)
    assert isinstance(e.value, TimeoutError)
    assert e.value.stdout == "started\n"
    assert time.monotonic() - started < 30
    assert not [p for p in await processes(sandbox) if "sleep" in p]


async def test_fast_signal_death_is_not_a_timeout(sandbox: nsbox.Sandbox) -> None:
    r = await sandbox.exec(["sh", "-c", "kill -TERM $$"], timeout=30)
    assert r.returncode == 143


async def test_cancelled_exec_kills_its_tree(sandbox: nsbox.Sandbox) -> None:
    with anyio.move_on_after(1):
        await sandbox.exec(["sh", "-c", "sleep 300 & sleep 301"])
    for _ in range(50):
        if not [p for p in await processes(sandbox) if "sleep" in p]:
            break
        await anyio.sleep(0.1)
    assert not [p for p in await processes(sandbox) if "sleep" in p]


async def test_background_process_survives_into_next_exec(sandbox: nsbox.Sandbox) -> None:
    await sandbox.exec(["sh", "-c", "sleep 300 >/dev/null 2>&1 &"])
    assert [p for p in await processes(sandbox) if p.startswith("sleep 300")]


async def test_background_process_holding_stdout_does_not_hang(sandbox: nsbox.Sandbox) -> None:
    started = time.monotonic()
    r = await sandbox.exec(["sh", "-c", "echo before; sleep 300 &"], timeout=60)
    assert r.stdout == "before\n" and r.success
    assert time.monotonic() - started < 30  # returns after a short grace, not after the sleep


async def test_two_hundred_concurrent_execs(sandbox: nsbox.Sandbox) -> None:
    results: dict[int, nsbox.ExecResult] = {}

    async def one(i: int) -> None:
        results[i] = await sandbox.exec(["sh", "-c", 'echo "$0"; sleep 0.2', str(i)])

    async with anyio.create_task_group() as tg:
        for i in range(200):
            tg.start_soon(one, i)
    assert all(results[i].stdout == f"{i}\n" and results[i].success for i in range(200))


async def test_exec_as_other_users(sandbox: nsbox.Sandbox, mode: str) -> None:
    if mode == "single":
        for user in ("nobody", "65534"):
            with pytest.raises(UserUnsupported) as e:
                await sandbox.exec(["id"], user=user)
            assert "usermod --add-subuids" in str(e.value)  # names the fix
        return
    assert (await sandbox.exec(["id", "-un"], user="nobody")).stdout == "nobody\n"
    assert (await sandbox.exec(["id", "-u"], user="65534")).stdout == "65534\n"
    # A uid with no passwd entry runs like docker exec --user does.
    assert (await sandbox.exec(["id", "-u"], user="4242")).stdout == "4242\n"


async def test_a_users_supplementary_groups_reach_its_commands(sandbox: nsbox.Sandbox, mode: str) -> None:
    # The init passes the request's group list to setgroups as it came.
    passwd = await sandbox.read_file("/etc/passwd")
    group = await sandbox.read_file("/etc/group")
    await sandbox.write_file("/etc/passwd", passwd + "grouped:x:4100:4100::/tmp:/bin/sh\n")
    await sandbox.write_file("/etc/group", group + "grouped:x:4100:\nfirst:x:4101:grouped\n"
                                                   "second:x:4102:someone,grouped\nother:x:4103:someone\n")
    if mode == "single":
        with pytest.raises(UserUnsupported):
            await sandbox.exec(["id", "-G"], user="grouped")
        return
    r = await sandbox.exec(["id", "-G"], user="grouped")
    assert sorted(r.stdout.split()) == ["4100", "4101", "4102"], r


async def test_failures_at_every_stage_leave_the_init_serving(sandbox: nsbox.Sandbox) -> None:
    # Each command starts in a child that shares the init's memory until its
    # execve; children that fail at each stage, many at once, must neither
    # disturb the init nor each other's results.
    await sandbox.write_file("/tmp/noshebang", "echo script\n")
    await sandbox.exec(["chmod", "+x", "/tmp/noshebang"])
    cases: list[tuple[dict, object]] = [
        (dict(cmd=["sh", "-c", 'echo "$0"', "arg"]), (0, "arg\n")),
        (dict(cmd=["sh", "-c", "exit 7"]), (7, "")),
        (dict(cmd=["no-such-command-xyz"]), (127, "")),
        (dict(cmd=["true"], cwd="/no/such/dir"), (126, "")),
        (dict(cmd=["/etc/passwd"]), PermissionError),
        (dict(cmd=["/tmp/noshebang"]), (0, "script\n")),
        (dict(cmd=["sh", "-c", 'echo "$V"'], env={"V": "x" * 1000}), (0, "x" * 1000 + "\n")),
    ]
    wrong: list[str] = []

    async def one(i: int) -> None:
        kwargs, expected = cases[i % len(cases)]
        try:
            r = await sandbox.exec(**kwargs)  # type: ignore[arg-type]
            got: object = (r.returncode, r.stdout)
        except PermissionError:
            got = PermissionError
        if got != expected:
            wrong.append(f"{kwargs}: {got!r}, expected {expected!r}")

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(350):
                tg.start_soon(one, i)
    assert not wrong, wrong[:5]
    status = await sandbox.client.status()
    assert status["running"] == 0, status


async def test_exec_as_root_and_unknown_user(sandbox: nsbox.Sandbox) -> None:
    assert (await sandbox.exec(["id", "-u"], user="root")).stdout == "0\n"
    r = await sandbox.exec(["id"], user="no-such-user")
    assert not r.success and "no-such-user" in r.stderr


def test_spare_exec_descriptors_stay_with_the_process_that_made_them() -> None:
    # The next exec's pipes and channel are made ahead (nsbox/init/execfds.py);
    # a forked child must not share them with its parent.
    execfds.restock()
    spare = execfds._spare
    assert spare is not None
    fds = (spare.out_r, spare.out_w, spare.err_r, spare.err_w, spare.chan.fileno(), spare.chan_child.fileno())
    pid = os.fork()
    if pid == 0:
        still_open = [fd for fd in fds if _is_open(fd)]
        os._exit(0 if execfds._spare is None and not still_open else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert all(_is_open(fd) for fd in fds)  # the parent's are untouched
    assert execfds.take() is spare
    spare.close()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


async def test_exec_after_close_is_unavailable() -> None:
    sb = await nsbox.Sandbox.create()
    await sb.close()
    with pytest.raises(SandboxUnavailable):
        await sb.exec(["true"])


async def test_dead_init_is_unavailable_not_a_result(sandbox: nsbox.Sandbox) -> None:
    os.kill(sandbox.pid, 9)
    await anyio.sleep(0.2)
    with pytest.raises(SandboxUnavailable):
        await sandbox.exec(["echo", "hi"])


async def test_bad_arguments_are_value_errors(sandbox: nsbox.Sandbox) -> None:
    with pytest.raises(ValueError):
        await sandbox.exec([])
    with pytest.raises(ValueError):
        await sandbox.exec("echo hi")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await sandbox.exec(["echo", "nul\0byte"])
