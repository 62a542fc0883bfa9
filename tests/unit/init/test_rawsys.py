"""The init's errno-free system calls (csrc/init/rawsys.h), for each
architecture it is built for: the x86_64 and aarch64 inline assembly is
compiled into tests/rawsys_probe.c and run (aarch64 under qemu-user)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.host.test_seccomp import source_dir, toolchain

pytestmark = pytest.mark.timeout(120)
TESTS = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_raw_calls_return_the_kernels_result_and_leave_errno(arch: str, tmp_path: Path) -> None:
    cc, runner = toolchain(arch)
    binary = tmp_path / f"rawsys-{arch}"
    build = [*cc, "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-static", f"-I{source_dir()}",
             "-o", str(binary), str(TESTS / "rawsys_probe.c")]
    r = subprocess.run(build, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([*runner, str(binary)], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert (r.returncode, r.stdout) == (0, "ok\n"), r.stdout + r.stderr
