"""The resource options of SandboxSpec (nsbox/spec.py): sizes and the
values each limit refuses; tests/host/test_resources.py checks that each
limit holds."""

from __future__ import annotations

import pytest

from nsbox.spec import SandboxSpec, parse_size

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20


@pytest.mark.parametrize("text, size", [("512m", 512 * MiB), ("2g", 2 << 30), ("0.5gb", 512 * MiB),
                                        ("1.5GiB", 3 << 29), ("100k", 102400), ("4096", 4096), (4096, 4096)])
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["", "abc", "-1", "0", "1x", "5mm", True])
def test_parse_size_refuses(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)  # type: ignore[arg-type]


def test_limits_refuse_bad_values() -> None:
    """(That each limit reaches the spec from every door is
    tests/unit/test_option_schema.py's.)"""
    assert SandboxSpec(memory="512m", pids_limit=256, cpus=1.5, disk="2g") == SandboxSpec(
        memory=512 * MiB, pids_limit=256, cpus=1.5, disk=2 << 30)
    for bad in ({"memory": "1m"}, {"pids_limit": 0}, {"cpus": 0}, {"disk": "lots"}, {"strict_limits": "yes"}):
        with pytest.raises(ValueError):
            SandboxSpec(**bad)  # type: ignore[arg-type]
    # Beyond what a cgroup or tmpfs takes: had failed the sandbox's setup
    # ("the init exited right after starting") or raised EINVAL from a write.
    for bad, message in (({"memory": 2**64}, "memory must be at most"), ({"disk": "9000000t"}, "disk must be at most"),
                         ({"pids_limit": 2**40}, "pids_limit must be at most 4194304")):
        with pytest.raises(ValueError, match=message):
            SandboxSpec(**bad)  # type: ignore[arg-type]
    assert SandboxSpec(memory=2**63 - 1, pids_limit=4194304).pids_limit == 4194304
    # Each published port takes one of the host's ephemeral ports: bounded.
    with pytest.raises(ValueError, match="at most 256 ports may be published"):
        SandboxSpec(network="nat", ports=[f"0:{p}" for p in range(1, 258)])
    assert len(SandboxSpec(network="nat", ports=[f"0:{p}" for p in range(1, 257)]).ports) == 256
