"""The components of tests/components.py: a test whose component is absent
is skipped naming the command that installs it, and the run's table lists
it; under CI=true the same test fails. Checked end to end on a real test
(the BusyBox rootfs one) in a pytest of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import components

pytestmark = pytest.mark.timeout(180)
# The component logic (a sub-pytest's skips and report): the same in every identity mode.
once = pytest.mark.once
REPO = Path(__file__).resolve().parents[2]
PROBE = "tests/host/test_rootfs.py::test_busybox_rootfs"


def pytest_run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], dict[str, int]]:
    report = tmp_path / "report.json"
    environ = {k: v for k, v in os.environ.items() if k not in ("CI", "NSBOX_TEST_PRETEND_MISSING")}
    environ.update(env, NSBOX_TEST_COMPONENTS_REPORT=str(report))
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", PROBE], cwd=REPO,
                       env=environ, capture_output=True, text=True, timeout=150)
    return r, json.loads(report.read_text()) if report.exists() else {}


@once
def test_an_absent_component_skips_with_its_install_command(tmp_path: Path) -> None:
    r, counts = pytest_run(tmp_path, NSBOX_TEST_PRETEND_MISSING="busybox")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 skipped" in r.stdout and "passed" not in r.stdout, r.stdout
    assert "needs component busybox" in r.stdout and "apt-get install busybox-static" in r.stdout, r.stdout
    assert "components this run did without" in r.stdout, r.stdout
    assert counts == {"busybox": 1}


@once
def test_under_ci_an_absent_component_fails(tmp_path: Path) -> None:
    r, counts = pytest_run(tmp_path, NSBOX_TEST_PRETEND_MISSING="busybox", CI="true")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 error" in r.stdout or "1 failed" in r.stdout, r.stdout
    assert "component busybox" in r.stdout and "CI runs everything" in r.stdout, r.stdout
    assert counts == {}


@once
def test_a_present_component_runs_the_test(tmp_path: Path) -> None:
    components.require("busybox")
    r, counts = pytest_run(tmp_path)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout + r.stderr
    assert counts == {}


@once
def test_names_and_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(KeyError, match="unknown test component 'skopeo2'"):
        components.here("skopeo2")
    monkeypatch.setenv("NSBOX_TEST_PRETEND_MISSING", "all")
    assert not any(components.here(n) for n in components.COMPONENTS)
    assert components.skipped_by([
        "Skipped: needs component tun (/dev/net/tun ...): sudo chmod 0666 /dev/net/tun",
        "needs component tun (...): ...", "Skipped: root owns /"]) == {"tun": 2}
    lines = components.report([])
    assert lines == ["  none: every component the tests need is here"]


def test_another_checkouts_fixture_rootfs_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  busybox_rootfs: Path) -> None:
    # Two checkouts tested at once by the same user share its cache: the
    # import of one's tarball must not remove the other's unpacked copy.
    from nsbox.create.unshare import remove_layer

    from tests import conftest

    other = tmp_path / "fixtures"
    other.mkdir()
    (other / "busybox.tar").write_bytes(conftest.fixture_tar("busybox").read_bytes())
    monkeypatch.setattr(components, "FIXTURES", other)
    mine = conftest._imported_rootfs("busybox")
    try:
        assert mine != busybox_rootfs and (mine / "bin" / "busybox").exists()
        assert (busybox_rootfs / "bin" / "busybox").exists(), "the other checkout's copy was removed"
    finally:
        remove_layer(mine, conftest.MODE)
