"""Masked and read-only /proc paths (nsbox/plan/procmask.py), as OCI runtimes
set them up, and the fallback where the host's /proc is masked already.

NSBOX_TEST_SWITCH_OFF=procmask runs these tests with the masks switched
off: the protection tests must then fail (they do; see the report).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import nsbox
from nsbox.plan import procmask

pytestmark = pytest.mark.timeout(60)

MASKED_FILES = [n for n in procmask.MASKED if os.path.isfile(f"/proc/{n}")]
MASKED_DIRS = [n for n in procmask.MASKED if os.path.isdir(f"/proc/{n}")]


@pytest.fixture(autouse=True)
def _switch(monkeypatch: pytest.MonkeyPatch) -> None:
    if "procmask" in os.environ.get("NSBOX_TEST_SWITCH_OFF", ""):
        monkeypatch.setattr(procmask, "enabled", False)


def test_this_kernel_has_paths_to_mask() -> None:
    # Otherwise the tests below would prove nothing here.
    assert "timer_list" in MASKED_FILES and "keys" in MASKED_FILES and os.path.isdir("/proc/sys")


@pytest.mark.parametrize("id_mapping", ["auto", "host-root"])
async def test_masked_files_read_empty(id_mapping: str, mode: str) -> None:
    """With host root mapped (as root only), sandbox root could read
    /proc/timer_list and /proc/kcore but for the masks."""
    if id_mapping == "host-root" and mode != "root":
        pytest.skip("only root can map host root")
    async with nsbox.Sandbox(id_mapping=id_mapping) as sb:  # type: ignore[arg-type]
        for name in MASKED_FILES:
            r = await sb.exec(["sh", "-c", f"wc -c < /proc/{name}"])
            assert r.stdout.strip() == "0" and r.returncode == 0, (name, r)
        for name in MASKED_DIRS:
            r = await sb.exec(["sh", "-c", f"ls -A /proc/{name}; touch /proc/{name}/x"])
            assert r.stdout == "" and "Read-only file system" in r.stderr, (name, r)


async def test_read_only_paths() -> None:
    async with nsbox.Sandbox() as sb:
        # Sandbox root may set its own user namespace's limits: without the
        # read-only /proc/sys this write would succeed.
        r = await sb.exec(["sh", "-c", "echo 5 > /proc/sys/user/max_user_namespaces"])
        assert r.returncode != 0 and "Read-only file system" in r.stderr, r
        for name in (n for n in procmask.READ_ONLY if os.path.exists(f"/proc/{n}")):
            r = await sb.exec(["awk", f'$5 == "/proc/{name}" {{ print $6 }}', "/proc/self/mountinfo"])
            assert r.stdout.split()[-1].startswith("ro,"), (name, r.stdout)


@pytest.mark.parametrize("nested_userns", [False, True], ids=["default", "nested_userns"])
async def test_masks_cannot_be_removed(nested_userns: bool) -> None:
    """With nested_userns the seccomp filter lets mount(2) and umount(2)
    through: the mount lock alone must keep the masks."""
    attacks = [
        "umount -l /proc/timer_list", "umount /proc/timer_list", "umount -l /proc/sys",
        "mount -o remount,bind,rw /proc/sys", "mount -o remount,rw /proc/sys",
        "mkdir -p /tmp/p && mount -t proc proc /tmp/p",
    ]
    prefix = "unshare -Urm " if nested_userns else ""
    async with nsbox.Sandbox(nested_userns=nested_userns) as sb:
        for attack in attacks:
            for how in ("", prefix):
                r = await sb.exec(["sh", "-c", f"{how}sh -c '{attack}' && echo UNDONE; wc -c < /proc/timer_list; "
                                                f"echo 5 > /proc/sys/user/max_user_namespaces"])
                assert "UNDONE" not in r.stdout and r.stdout.split()[-1:] == ["0"], (how, attack, r)
                assert "Read-only file system" in r.stderr, (how, attack, r)


async def test_no_sysfs() -> None:
    """nsbox mounts no /sys: nothing of it, /sys/firmware and powercap
    included, is visible (an image's empty /sys stays empty)."""
    async with nsbox.Sandbox() as sb:
        for path in ("/sys/firmware", "/sys/devices/virtual/powercap", "/sys/kernel"):
            r = await sb.exec(["ls", path])
            assert r.returncode != 0 and "No such file" in r.stderr, (path, r)


FALLBACK = textwrap.dedent("""
    import anyio, nsbox
    async def main():
        async with nsbox.Sandbox(id_mapping="single") as sb:
            r = await sb.exec(["sh", "-c", "wc -c < /proc/timer_list; wc -c < /proc/keys; "
                               "(echo x > /proc/sys/kernel/hostname) 2>/dev/null || echo RO; ls /proc | grep -c '^[0-9]'"])
            print(r.stdout, end="")
            r = await sb.exec(["sh", "-c", "umount -l /proc/keys 2>/dev/null || echo LOCKED"])
            print(r.stdout, end="")
    anyio.run(main)
""")


def test_fallback_where_the_host_masks_proc(tmp_path: Path) -> None:
    """A host whose /proc is masked (a container's, simulated with a user
    namespace and a bind over /proc/timer_list) refuses a fresh procfs:
    nsbox binds that /proc, puts the masks over it and says so."""
    script = tmp_path / "fallback.py"
    script.write_text(FALLBACK)
    env = {**os.environ, "NSBOX_STATE_DIR": str(tmp_path / "state"), "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    (tmp_path / "run").mkdir(mode=0o700)
    r = subprocess.run(["unshare", "-Urm", "sh", "-c", 'mount --bind /dev/null /proc/timer_list && exec "$@"', "sh",
                        sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=50, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count(procmask.FALLBACK_NOTE) == 1, r.stderr
    timer_list, keys, ro, nprocs, locked = r.stdout.split()
    assert timer_list == keys == "0" and ro == "RO" and locked == "LOCKED", r.stdout
    assert int(nprocs) > 2  # the host's processes: what the note warns about


WATCH = textwrap.dedent("""\
    import subprocess
    from nsbox.plan import procmask
    seen = [procmask._covered.get()]
    subprocess.run(["mount", "--bind", "/dev/null", "/proc/timer_list"], check=True)
    seen.append(procmask._covered.get())
    seen.append(procmask._covered.get())  # no change since: the table is not read again
    subprocess.run(["umount", "/proc/timer_list"], check=True)
    seen.append(procmask._covered.get())
    print(seen)
""")


def test_a_mount_over_proc_after_the_first_sandbox_is_noticed(tmp_path: Path) -> None:
    """Whether /proc is covered is read once and then again only when the
    mount table changes: a mount made after the first check is seen."""
    script = tmp_path / "watch.py"
    script.write_text(WATCH)
    r = subprocess.run(["unshare", "-Urm", sys.executable, str(script)], check=False, capture_output=True, text=True,
                       timeout=50)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[[], ['/proc/timer_list'], ['/proc/timer_list'], []]", r.stdout
