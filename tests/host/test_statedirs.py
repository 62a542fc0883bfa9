"""State directories (nsbox/host/dirs.py): nobody but you and root may be able
to swap a directory on the way to them, at the first use or later.

The attacker is another local user. As root (and in the root run of
tests/run.sh) it is a real one: directories and symlinks are given to
another uid, and the victim is root and, in a process of its own, the
unprivileged test user. In the unprivileged modes the attacker is whoever
can write a directory that is open to all (mode 0777, not sticky).
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Callable

import pytest

from nsbox.host import dirs
from nsbox.errors import NsboxError

pytestmark = pytest.mark.timeout(60)
ROOT = os.geteuid() == 0
FINDERS = (dirs.runtime_dir, dirs.data_dir, dirs.cache_dir)


def other_uid() -> int:
    """The attacker: another user than the one running the tests."""
    for name in ("nsbox-single", "nobody"):
        try:
            uid = pwd.getpwnam(name).pw_uid
        except KeyError:
            continue
        if uid != os.geteuid():
            return uid
    return 65534


@pytest.fixture
def use_state(monkeypatch: pytest.MonkeyPatch) -> Callable[[Path], Path]:
    def use(path: Path) -> Path:
        monkeypatch.setenv("NSBOX_STATE_DIR", str(path))
        return path
    return use


def refused(finder: Callable[[], Path], component: Path, words: str) -> NsboxError:
    with pytest.raises(NsboxError) as e:
        finder()
    assert f"{component} {words}" in str(e.value) or f": {component} {words}" in str(e.value), e.value
    assert e.value.hint and "\n" not in str(e.value), e.value
    return e.value


def test_private_paths_accepted(use_state: Callable[[Path], Path], tmp_path: Path) -> None:
    """No false refusal: directories of yours, a symlink of yours, a sticky
    directory open to all (as /tmp) with your directory in it."""
    base = use_state(tmp_path / "new" / "state")
    for find in FINDERS:
        d = find()
        st = os.lstat(d)
        assert d.parent == base and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
        assert stat.S_IMODE(st.st_mode) == 0o700
    (tmp_path / "link").symlink_to(tmp_path / "new")
    use_state(tmp_path / "link" / "state")
    assert dirs.data_dir() == tmp_path / "link" / "state" / "data"
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    use_state(sticky / "mine")
    assert dirs.data_dir() == sticky / "mine" / "data"
    # The leaf is made private, as before.
    (sticky / "mine" / "data").chmod(0o755)
    time.sleep(dirs._RECHECK_AFTER)
    dirs.data_dir()
    assert stat.S_IMODE(os.lstat(sticky / "mine" / "data").st_mode) == 0o700


def test_parent_open_to_others_refused(use_state: Callable[[Path], Path], tmp_path: Path) -> None:
    """A directory on the way that others may write to (not sticky): they
    could rename run/, data/ or cache/ away and put theirs there."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    use_state(shared / "state")
    for find in FINDERS:
        err = refused(find, shared, "is writable by others (mode 777, not sticky)")
        assert f"chmod go-w {shared}" in (err.hint or "")
    # Through a symlink of yours that leads there.
    (tmp_path / "link").symlink_to(shared)
    use_state(tmp_path / "link" / "deeper" / "state")
    refused(dirs.data_dir, shared, "is writable by others")
    assert not (shared / "deeper").exists()  # nothing made in it
    # Writable by its group only: the same.
    group = tmp_path / "group"
    group.mkdir()
    group.chmod(0o770)
    use_state(group / "state")
    refused(dirs.cache_dir, group, "is writable by group")


def test_taken_again_after_first_use(use_state: Callable[[Path], Path], tmp_path: Path) -> None:
    """A long-lived process checks again: the state directory's parent is
    removed (by a /tmp cleaner, say) and made again by someone else, who
    would get the victim's next layers and images."""
    parent = tmp_path / "parent"
    use_state(parent / "state")
    first = [find() for find in FINDERS]
    shutil.rmtree(parent)
    parent.mkdir()
    if ROOT:
        os.chown(parent, other_uid(), other_uid())
        words = f"belongs to uid {other_uid()}"
    else:
        parent.chmod(0o777)
        words = "is writable by others"
    time.sleep(dirs._RECHECK_AFTER)  # a check younger than this is trusted
    for find in FINDERS:
        refused(find, parent, words)
    assert not (parent / "state").exists()
    assert first == [parent / "state" / k for k in ("run", "data", "cache")]


@pytest.mark.skipif(not ROOT, reason="making a directory of another user needs root (see the 0777 tests)")
def test_another_users_directory_refused(use_state: Callable[[Path], Path], tmp_path: Path) -> None:
    """Another user made /tmp/NAME first (NAME as a victim would choose
    it): its own, sticky or not, or a symlink of its own to the victim's."""
    attacker = other_uid()
    tmp = Path(tempfile.gettempdir())
    taken = tmp / f"nsbox-victim-{secrets.token_hex(4)}"
    link = tmp / f"nsbox-victim-{secrets.token_hex(4)}"
    taken.mkdir(mode=0o755)
    try:
        os.chown(taken, attacker, attacker)
        use_state(taken)
        for find in FINDERS:
            refused(find, taken, f"belongs to uid {attacker}")
        taken.chmod(0o1777)
        refused(dirs.data_dir, taken, f"belongs to uid {attacker}")
        mine = tmp_path / "mine"
        mine.mkdir()
        link.symlink_to(mine)
        os.lchown(link, attacker, attacker)
        use_state(link)
        refused(dirs.data_dir, link, f"belongs to uid {attacker}")
        assert list(mine.iterdir()) == [] and list(taken.iterdir()) == []
        # The victim an unprivileged user, in a process of its own: one
        # line on stderr, nothing made.
        taken.chmod(0o755)
        try:
            victim = pwd.getpwnam("nsbox-sub")
            r = subprocess.run([sys.executable, "-m", "nsbox", "ps"], capture_output=True, text=True, timeout=30,
                               user=victim.pw_uid, group=victim.pw_gid, extra_groups=[], cwd="/",
                               env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": victim.pw_dir,
                                    "NSBOX_STATE_DIR": str(taken)})
        except (KeyError, PermissionError):
            if os.environ.get("NSBOX_TEST_EXPECT_MODE"):
                raise
            return  # a plain root run: tests/run.sh makes the user and a Python it may run
        assert r.returncode != 0, r
        assert f"refusing to use the state directory {taken}/run: {taken} belongs to uid {attacker}" in r.stderr, r
        assert "Traceback" not in r.stderr and list(taken.iterdir()) == [], r
    finally:
        shutil.rmtree(taken, ignore_errors=True)
        link.unlink(missing_ok=True)


def test_a_relative_state_directory_is_refused(use_state: Callable[[Path], Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """NSBOX_STATE_DIR=state would name another directory in each working
    directory: refused in one line, nothing made."""
    monkeypatch.chdir(tmp_path)
    use_state(Path("state"))
    for find in FINDERS:
        with pytest.raises(NsboxError, match="NSBOX_STATE_DIR must be an absolute path, not 'state'") as e:
            find()
        assert e.value.hint and "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_a_changed_environment_names_its_directories_at_once(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The directories chosen are kept for a moment (a create asks for them
    several times), but not across a change of what chose them."""
    monkeypatch.delenv("NSBOX_STATE_DIR", raising=False)
    for n in (1, 2):
        home, data, cache, run = (tmp_path / f"{k}{n}" for k in ("home", "data", "cache", "run"))
        for d in (home, data, run):
            d.mkdir(mode=0o700)
        monkeypatch.setenv("HOME", str(home))
        monkeypatch.setenv("XDG_DATA_HOME", str(data))
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
        assert [find() for find in FINDERS] == [run / "nsbox", data / "nsbox", home / ".cache" / "nsbox"]
    monkeypatch.setenv("NSBOX_STATE_DIR", str(tmp_path / "state"))
    assert [find() for find in FINDERS] == [tmp_path / "state" / k for k in ("run", "data", "cache")]


def test_a_directory_is_walked_again_a_second_after_its_last_walk(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two spellings of one state directory share its walk: the second may
    not make that walk count for longer than a second."""
    clock = [1000.0]
    # This module's clock only (the process's other threads keep theirs).
    monkeypatch.setattr(dirs, "time", types.SimpleNamespace(monotonic=lambda: clock[0], time=time.time))
    # Fresh memories, put back afterwards: none of this clock's times may stay.
    monkeypatch.setattr(dirs, "_chosen", {})
    monkeypatch.setattr(dirs, "_checked_at", {})
    walks: list[Path] = []
    real_open = dirs._open_private_dir

    def counted(path: Path) -> int:
        walks.append(path)
        return real_open(path)

    monkeypatch.setattr(dirs, "_open_private_dir", counted)
    state = tmp_path / "state"
    monkeypatch.setenv("NSBOX_STATE_DIR", str(state))
    assert dirs.data_dir() == state / "data" and len(walks) == 1
    clock[0] += 0.9
    monkeypatch.setenv("NSBOX_STATE_DIR", f"{state}/")  # the same directory, another key
    assert dirs.data_dir() == state / "data" and len(walks) == 1  # the walk 0.9 s ago holds
    clock[0] += 0.3
    assert dirs.data_dir() == state / "data" and len(walks) == 2, "trusted a walk 1.2 s old"
