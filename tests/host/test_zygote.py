"""nsbox-create, the zygote that clones sandboxes for a Python process."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import nsbox
from nsbox.host import idmap
from nsbox.create import zygote
from nsbox.plan import steps


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


async def test_sandboxes_are_children_of_this_process() -> None:
    async with nsbox.Sandbox() as sb:
        with open(f"/proc/{sb.pid}/stat") as f:
            ppid = int(f.read().split(")")[-1].split()[1])
        assert ppid == os.getpid()
        assert zygote.zygote_pid() not in (None, sb.pid)


async def test_a_dead_zygote_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every sandbox through the zygote itself (no holder: test_holder.py
    # kills one of those).
    monkeypatch.setenv("NSBOX_HOLDER", "0")
    async with nsbox.Sandbox():
        pass
    old = zygote.zygote_pid()
    assert old is not None
    os.kill(old, signal.SIGKILL)
    os.waitpid(old, 0)
    async with nsbox.Sandbox() as sb:
        assert (await sb.exec(["echo", "ok"])).stdout == "ok\n"
    assert zygote.zygote_pid() not in (None, old)


FORKED = textwrap.dedent("""
    import anyio, json, os, nsbox
    from nsbox.create import zygote
    async def make():
        sb = await nsbox.Sandbox.create()
        return sb
    anyio.run(make)  # this process now has a zygote (the sandbox dies with the loop's end)
    parent_zygote = zygote.zygote_pid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        async def child():
            async with nsbox.Sandbox() as sb:
                ppid = int(open(f"/proc/{sb.pid}/stat").read().split(")")[-1].split()[1])
                out = (await sb.exec(["echo", "hi"])).stdout
            return {"ppid": ppid, "me": os.getpid(), "zygote": zygote.zygote_pid(), "out": out}
        os.write(w, json.dumps(anyio.run(child)).encode())
        os._exit(0)
    os.close(w)
    data = json.loads(os.read(r, 4096))
    os.waitpid(pid, 0)
    data["parent_zygote"] = parent_zygote
    print(json.dumps(data))
""")


def test_a_forked_child_gets_its_own_zygote() -> None:
    # With its parent's zygote, CLONE_PARENT would make the parent, not the
    # forked child, the sandbox's parent.
    out = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["out"] == "hi\n" and d["ppid"] == d["me"]
    assert d["zygote"] != d["parent_zygote"]


OWNER_EXITS = textwrap.dedent("""
    import anyio, nsbox
    from nsbox.create import zygote
    async def main():
        async with nsbox.Sandbox() as sb:
            await sb.exec(["true"])
        print(zygote.zygote_pid(), flush=True)
    anyio.run(main)
""")


def test_the_zygote_ends_with_its_owner() -> None:
    out = subprocess.run([sys.executable, "-c", OWNER_EXITS], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    zygote = int(out.stdout)
    deadline = time.monotonic() + 5
    while alive(zygote) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(zygote)


async def test_id_map_failure_is_a_clear_error(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if mode != "subuid":
        # root and single write their maps themselves: check the text that
        # decides it, and that no helper is involved.
        assert idmap.detect().how_to_write()[2] is None
        return
    # newuidmap refusing (here: a stand-in that fails, as it would for a
    # bad /etc/subuid entry) must give a message, and leave nothing behind:
    # when it writes a holder's maps (the holder is then not used) and when
    # it writes a sandbox's.
    monkeypatch.setattr(idmap, "_find", lambda tool: "/bin/false")
    monkeypatch.setattr(zygote, "_holders", {})
    monkeypatch.setattr(zygote, "_holder_failed", set())
    children = {c.pid for c in psutil.Process().children()}
    before = set(os.listdir(nsbox.host.dirs.runtime_dir()))
    with pytest.raises(nsbox.SandboxSetupError, match="id maps"):
        await nsbox.Sandbox().start()
    assert set(os.listdir(nsbox.host.dirs.runtime_dir())) == before
    assert zygote._holders == {} and len(zygote._holder_failed) == 1
    assert {c.pid for c in psutil.Process().children()} - children <= {zygote.zygote_pid()}



def _spawn_true(go: bool, host_go: bool = False) -> tuple[int, int, socket.socket]:
    """Asks the zygote for a process that execs `true` as root of a new user
    namespace; returns its error pipe's read end, the go pipe's write end
    and the reply socket, unread. With `go`, the zygote gets the write end;
    with `host_go` too, the process also waits for the host's go."""
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    go_r, go_w = os.pipe2(os.O_CLOEXEC)
    try:
        sock = zygote.request_spawn(
            clone_flags=zygote.CLONE_NEWUSER, steps=[steps.become_root()], idmaps=idmap.detect().how_to_write(),
            error_fd=err_w, sync_fd=go_r, keep_fds=[], exec_fd=-1, argv=["true"], envp=["PATH=/usr/bin:/bin"],
            keep_stdio=False, new_session=False, go_fd=go_w if go else -1, host_go=host_go)
    finally:
        os.close(err_w)
        os.close(go_r)
    return err_r, go_w, sock


@pytest.mark.timeout(60)
@pytest.mark.parametrize("go", [True, False], ids=["zygote-sends-go", "host-sends-go"])
def test_the_zygote_sends_the_go_when_given_the_pipe(go: bool) -> None:
    """Given the go pipe's write end, the zygote lets the child run once its
    maps are written: the child execs before the host reads the reply or
    writes anything. Without it, the child waits for the host."""
    err_r, go_w, sock = _spawn_true(go)
    try:
        ran = bool(select.select([err_r], [], [], 3)[0])  # EOF on the error pipe: the exec happened
        assert ran == go
        if not go:
            zygote.go(go_w)
            assert select.select([err_r], [], [], 5)[0]
        assert os.read(err_r, 64) == b""  # no failure report
        pid, pidfd = zygote.read_spawn_reply(sock)
        os.close(pidfd)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    finally:
        sock.close()
        os.close(err_r)
        os.close(go_w)



@pytest.mark.timeout(60)
@pytest.mark.parametrize("host_goes", [True, False], ids=["host-sends-its-go", "host-closes-instead"])
def test_with_host_go_the_child_waits_for_both(host_goes: bool) -> None:
    """With the zygote's go and host_go, the child runs only once the host
    has sent its go as well, whenever that comes (here: after the reply,
    so after the zygote's go). If the host closes its end instead, the
    child exits, reporting the missing go, without running anything."""
    err_r, go_w, sock = _spawn_true(True, host_go=True)
    try:
        pid, pidfd = zygote.read_spawn_reply(sock)  # the zygote has sent its go
        os.close(pidfd)
        assert not select.select([err_r], [], [], 1)[0], "the child ran without the host's go"
        if host_goes:
            zygote.go(go_w)
        else:
            os.close(go_w)
            go_w = -1
        assert select.select([err_r], [], [], 5)[0]
        report = os.read(err_r, 64)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if host_goes:
            assert report == b"" and status == 0
        else:
            step, err = struct.unpack("=ii", report[:8])
            assert step == zygote.lib.NSBOX_SETUP_SYNC and status != 0
    finally:
        sock.close()
        os.close(err_r)
        if go_w >= 0:
            os.close(go_w)
