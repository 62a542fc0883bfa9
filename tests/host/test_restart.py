"""Restart policies (Docker's --restart, compose's `restart`), kept by the
sandbox's init (csrc/init/main.c): a command runs again as it exits, with
Docker's growing waits, and stops being restarted when its policy says so,
when the host signals it to stop, or when the host lets go of it."""

from __future__ import annotations

import signal

import anyio
import pytest

import nsbox
from nsbox.errors import NsboxError
from nsbox.spec import Restart

pytestmark = pytest.mark.timeout(60)

# Counts its runs in /tmp/runs, then exits with $1.
COUNTING = ["sh", "-c", "echo run >> /tmp/runs; exit $1", "sh"]


async def _runs(sb: nsbox.Sandbox) -> int:
    r = await sb.exec(["sh", "-c", "cat /tmp/runs 2>/dev/null | wc -l"])
    return int(r.stdout)


async def _last_exit(sb: nsbox.Sandbox, cmd: list[str], restart: Restart) -> int | None:
    """Starts `cmd` watched under `restart`; the status of the exit after
    which it is not restarted."""
    chan = await sb.spawn(cmd, watch=True, restart=restart)
    assert chan is not None
    try:
        reply = await chan.next_reply(20)
    finally:
        chan.close()
    return None if reply is None else reply.code


async def _sleepers(sb: nsbox.Sandbox) -> list[list[str]]:
    """Session id and uid of each `sleep 1000` of the sandbox."""
    r = await sb.exec(["ps", "-eo", "sid=,uid=,args="])
    return [line.split()[:2] for line in r.stdout.splitlines() if line.split()[2:] == ["sleep", "1000"]]


async def test_on_failure_runs_until_success_and_the_host_hears_all_of_it() -> None:
    script = ["sh", "-c", "echo attempt; [ -e /tmp/once ] && exit 0; touch /tmp/once; exit 1"]
    async with nsbox.Sandbox() as sb:
        process = await sb.start_process(script, restart="on-failure")
        result = await process.wait()
        assert (result.returncode, result.stdout) == (0, "attempt\nattempt\n")
        # on-failure: a success is not restarted; the init holds nothing of it.
        await anyio.sleep(0.5)
        assert (await sb.status())["running"] == 0


async def test_a_limit_counts_restarts_and_the_last_exit_is_reported() -> None:
    async with nsbox.Sandbox() as sb:
        assert await _last_exit(sb, [*COUNTING, "7"], Restart(on_failure=True, limit=2)) == 7
        assert await _runs(sb) == 3  # the first run and two restarts


async def test_always_restarts_after_growing_waits_not_in_a_loop() -> None:
    async with nsbox.Sandbox() as sb:
        await sb.spawn([*COUNTING, "0"], restart="always")  # exits 0 at once, every time
        await anyio.sleep(2.0)
        runs = await _runs(sb)
        # Waits of 0.1, 0.2, 0.4, 0.8 s: five runs by 1.5 s, the sixth at
        # 3.1 s. A restart loop without waits would have made thousands.
        assert 2 <= runs <= 6, runs


async def test_a_restarted_command_outlives_what_kills_it_inside() -> None:
    async with nsbox.Sandbox() as sb:
        await sb.spawn(["sh", "-c", "echo run >> /tmp/runs; exec sleep 1000"], restart="unless-stopped")
        for _ in range(3):
            runs = await _runs(sb)
            await sb.exec(["pkill", "-KILL", "-x", "sleep"])
            with anyio.fail_after(10):
                while await _runs(sb) == runs:
                    await anyio.sleep(0.05)
        assert await _runs(sb) == 4
        # Started as nsbox starts every command: its own session, as the
        # requested user, in the sandbox's namespaces.
        [[sid, uid]] = await _sleepers(sb)
        assert sid != "1" and uid == "0"


@pytest.mark.parametrize("stop", ["kill", "sigterm", "close"])
async def test_the_host_ends_a_policy_by_killing_or_letting_go(stop: str) -> None:
    async with nsbox.Sandbox() as sb:
        process = await sb.start_process(["sh", "-c", "echo run >> /tmp/runs; exec sleep 1000"], restart="always")
        with anyio.fail_after(10):
            while await _runs(sb) == 0:
                await anyio.sleep(0.05)
        if stop == "kill":
            await process.kill()
            assert process.returncode == 137
        elif stop == "sigterm":
            process.signal(signal.SIGTERM)
            assert (await process.wait()).returncode == 128 + signal.SIGTERM
        else:
            process._chan.close()  # the host's end is gone: as a dropped connection
        await anyio.sleep(0.6)  # six times the first wait: a restart would have come
        assert await _runs(sb) == 1
        assert await _sleepers(sb) == []


async def test_a_restart_starts_without_the_last_runs_leftovers() -> None:
    """As a restarted container starts with no process of its last run: a
    server the run put in the background would keep its port, and the next
    run's would fail to bind it (Docker's restart kills them all)."""
    async with nsbox.Sandbox() as sb:
        process = await sb.start_process(["sh", "-c", "echo run >> /tmp/runs; sleep 1000 & exit 1"],
                                         restart="always")
        with anyio.fail_after(15):
            while await _runs(sb) < 4:
                await anyio.sleep(0.05)
        assert len(await _sleepers(sb)) <= 1  # the current run's, if it has started
        await process.kill()
        assert process.returncode == 137
        assert await _sleepers(sb) == []


async def test_a_kill_while_a_restart_waits_is_reported_as_a_kill() -> None:
    async with nsbox.Sandbox() as sb:
        process = await sb.start_process([*COUNTING, "3"], restart="always")
        with anyio.fail_after(10):
            while await _runs(sb) < 3:  # its waits have grown past the exchange's time
                await anyio.sleep(0.05)
        await process.kill()
        assert process.returncode == 137
        process = await sb.start_process(["sh", "-c", "echo run >> /tmp/more; exit 3"], restart="always")
        with anyio.fail_after(10):
            while (await sb.exec(["sh", "-c", "wc -l < /tmp/more"])).stdout.strip() in ("", "0", "1", "2"):
                await anyio.sleep(0.05)
        process.signal(signal.SIGTERM)
        assert (await process.wait()).returncode == 128 + signal.SIGTERM


async def test_a_signal_that_does_not_stop_leaves_the_policy() -> None:
    async with nsbox.Sandbox() as sb:
        # SIGUSR1 ends sleep; Docker leaves the policy on such a signal too.
        process = await sb.start_process(["sh", "-c", "echo run >> /tmp/runs; exec sleep 1000"], restart="always")
        with anyio.fail_after(10):
            while await _runs(sb) == 0:
                await anyio.sleep(0.05)
        process.signal(signal.SIGUSR1)
        with anyio.fail_after(10):
            while await _runs(sb) < 2:
                await anyio.sleep(0.05)
        await process.kill()


async def test_a_command_that_cannot_start_is_not_restarted() -> None:
    async with nsbox.Sandbox() as sb:
        with pytest.raises(NsboxError, match="No such file or directory"):
            await sb.spawn(["/no/such/command"], restart="always")
        # Its helper is reaped soon after the failure is reported; then the
        # init holds nothing of it (a restart would wait in its job table).
        with anyio.fail_after(5):
            while (await sb.status())["running"]:
                await anyio.sleep(0.05)
        await anyio.sleep(0.5)
        assert (await sb.status())["running"] == 0
        # A later run that cannot start (its file gone) is an exit as any
        # other, restarted on the policy's terms: here, no more than 2 times.
        await sb.exec(["cp", "/bin/true", "/tmp/cmd"])
        vanishing = ["sh", "-c", "rm /tmp/cmd; exec /tmp/cmd"]
        assert await _last_exit(sb, vanishing, Restart(on_failure=True, limit=2)) == 127


def test_policies_parse_as_dockers() -> None:
    assert Restart.parse("no") is None
    assert Restart.parse("always") == Restart.parse("unless-stopped") == Restart()
    assert Restart.parse("on-failure:5") == Restart(on_failure=True, limit=5)
    for bad in ("", "on-failure:x", "on-failure:-1", "always:1", "on-failure:٣"):
        with pytest.raises(ValueError, match="restart policy must be"):
            Restart.parse(bad)
    with pytest.raises(ValueError, match="whole number"):
        Restart(limit=0)


# Stops the first helper of the init's it sees (a forked nsbox-init, child
# of process 1, not yet the command), as sandbox root may: it has the init's
# ids. The helper lives for microseconds before its exec, too short for a
# scan of /proc to see: the stopper signals the next pid the namespace will
# hand out (only the init forks while it waits) until that process exists;
# a fresh child stops before it first runs. The init may kill the stopped
# helper before the stopper reads its state: gone at once counts as
# stopped (the command, once exec'd, would stop before it could exit).
STOPPER = r"""
import os, signal, time
def last():
    with open("/proc/sys/kernel/ns_last_pid") as f:
        return int(f.read())
def stat(p):
    with open(f"/proc/{p}/stat") as f:
        s = f.read()
    return s[s.index("(") + 1:s.rindex(")")], s[s.rindex(")") + 2:].split()
end, p, misses = time.time() + 30, last() + 1, 0
while time.time() < end:
    try:
        os.kill(p, signal.SIGSTOP)
    except ProcessLookupError:
        misses += 1
        if misses % 1000 == 0 and last() >= p:  # it came and went unseen
            p = last() + 1
        continue
    try:
        for _ in range(1000):  # the stop takes effect when it next runs
            name, rest = stat(p)
            if rest[0] in "TtZ":
                break
            time.sleep(0.001)
    except OSError:
        name, rest = "nsbox-init", ["gone", "1"]
    if name != "nsbox-init" or rest[1] != "1" or rest[0] == "Z":  # the command by then
        try:
            os.kill(p, signal.SIGCONT)
        except ProcessLookupError:
            pass
        p = max(p, last()) + 1
        continue
    print("stopped", rest[0], flush=True)
    raise SystemExit
"""


@pytest.mark.timeout(120)
async def test_a_restarts_helper_a_sandbox_process_stops_is_killed() -> None:
    """The init's helper of a restart runs as a sandbox user until its exec;
    stopped then, it had been left so for good, holding copies of the
    init's descriptors, and the policy had ended without a word. Now it is
    killed, as a first run's is, and the command runs again."""
    async with nsbox.Sandbox() as sb:
        await sb.spawn([*COUNTING, "1"], restart="always")
        stopper = await sb.start_process(["python3", "-c", STOPPER])
        result = await stopper.wait()
        if "stopped" not in result.stdout:
            pytest.fail("the stopper saw no helper of the init's in 30 s")
        runs = await _runs(sb)
        with anyio.fail_after(70):  # the next wait may be up to a minute (Docker's)
            while await _runs(sb) < runs + 1:
                await anyio.sleep(0.1)
        r = await sb.exec(["ps", "-eo", "stat=,comm="])
        assert not [line for line in r.stdout.splitlines() if line.split()[0].startswith("T")], r.stdout
