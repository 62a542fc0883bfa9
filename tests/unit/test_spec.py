"""The resource options of SandboxSpec (nsbox/spec.py), given through the
API, nsbox.yaml and the CLI; tests/host/test_resources.py checks that each
limit holds."""

from __future__ import annotations

import click
import pytest

import nsbox
from nsbox.cli import main
from nsbox.inspect.provider import NsboxConfig, NsboxSandboxEnvironment
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


def test_spec_api_yaml_cli_agree() -> None:
    want = SandboxSpec(memory=512 * MiB, pids_limit=256, cpus=1.5, disk=2 << 30)
    assert SandboxSpec(memory="512m", pids_limit=256, cpus=1.5, disk="2g") == want
    sb = nsbox.Sandbox(memory="512m", pids_limit=256, cpus=1.5, disk="2g")
    assert (sb.spec.memory, sb.spec.pids_limit, sb.spec.cpus, sb.spec.disk) == (512 * MiB, 256, 1.5, 2 << 30)
    cfg = NsboxConfig.model_validate({"memory": "512m", "pids_limit": 256, "cpus": 1.5, "disk": "2g"})
    assert (cfg.memory, cfg.pids_limit, cfg.cpus, cfg.disk) == (512 * MiB, 256, 1.5, 2 << 30)
    ctx = main.run.make_context("run", ["--memory", "512m", "--pids-limit", "256", "--cpus", "1.5", "--disk", "2g",
                                       "--", "true"])
    opts = {k: v for k, v in ctx.params.items() if k not in ("command", "timeout", "detach")}
    made = main.make_sandbox(**opts).spec
    assert (made.memory, made.pids_limit, made.cpus, made.disk) == (512 * MiB, 256, 1.5, 2 << 30)
    assert not made.strict_limits and not sb.spec.strict_limits and not cfg.strict_limits
    # strict_limits: wherever the limits are given.
    assert nsbox.Sandbox(memory="64m", strict_limits=True).spec.strict_limits
    ctx = main.run.make_context("run", ["--memory", "64m", "--strict-limits", "--", "true"])
    opts = {k: v for k, v in ctx.params.items() if k not in ("command", "timeout", "detach")}
    assert main.make_sandbox(**opts).spec.strict_limits
    cfg = NsboxConfig.model_validate({"memory": "64m", "strict_limits": True})
    (name, settings), = cfg.settings()
    assert NsboxSandboxEnvironment._make(cfg, settings, "t").spec.strict_limits
    for bad in ({"memory": "1m"}, {"pids_limit": 0}, {"cpus": 0}, {"disk": "lots"}, {"strict_limits": "yes"}):
        with pytest.raises(ValueError):
            SandboxSpec(**bad)  # type: ignore[arg-type]
    with pytest.raises(click.UsageError):
        main.make_sandbox(**{**opts, "memory": "lots"})
