"""Inspect's own conformance checks for sandbox providers, run against nsbox.

Four configurations: the Debian fixture rootfs and the built-in host root,
each with root and with a non-root default user. What may fail, and why,
is listed below; every such xfail is strict, so a check that starts passing
is reported too. In the single-uid mode a non-root default user cannot
exist at all; test_non_root_default_user checks that it is refused with a
message that names the fix.

The timeout checks mostly wait (a 2 s timeout, then a 5 s pause before
looking for survivors): run one by one they took 16 s per configuration,
most of this module's time. test_timeout_checks runs each of them in every
configuration, all at once, in about the time of the slowest one.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
import pytest
from inspect_ai.util import SandboxEnvironment
from inspect_ai.util._sandbox.self_check import *  # noqa: F403

import nsbox
from nsbox.inspect.provider import NsboxConfig, NsboxSandboxEnvironment

from tests.conftest import MODE
from tests.imagekit import WAITING_CHECKS

ROOT_BYPASSES_MODES = "sandbox root bypasses file modes, as root in Docker does (Docker xfails it too)"
XFAIL_ROOT_USER = {
    "test_read_file_not_allowed": ROOT_BYPASSES_MODES,
    "test_write_text_file_without_permissions": ROOT_BYPASSES_MODES,
    "test_write_binary_file_without_permissions": ROOT_BYPASSES_MODES,
}
XFAIL_SINGLE = {
    "test_exec_as_user": "a single-uid sandbox cannot run other users; nsbox raises UserUnsupported naming "
                         "the fix (a subordinate id range), see test_exec.py::test_exec_as_other_users",
}

CONFIGS = ["debian-root", "host-root"] + (["debian-user", "host-user"] if MODE.mode != "single" else [])

# Checks that spend their time waiting; collected by test_timeout_checks
# instead of one by one (the star import above brought them in).
TIMEOUT_CHECKS: dict[str, Callable[[SandboxEnvironment], Awaitable[None]]] = {
    name: globals().pop(name)
    for name in WAITING_CHECKS
}


def expected_failure(check: str, config: str) -> str | None:
    """Why `check` is expected to fail in `config` (None: it must pass)."""
    xfails = dict(XFAIL_ROOT_USER) if config.endswith("-root") else {}
    if MODE.mode == "single":
        xfails.update(XFAIL_SINGLE)
    return xfails.get(check)


def make_config(name: str, debian: Path) -> NsboxConfig:
    rootfs = str(debian) if name.startswith("debian") else "host"
    if name.endswith("-user"):
        return NsboxConfig(rootfs=rootfs, user="nobody", workdir="/home/agent")
    return NsboxConfig(rootfs=rootfs)


@pytest.fixture(scope="module", params=CONFIGS)
async def _config_and_env(request: pytest.FixtureRequest, debian_rootfs: Path) -> AsyncIterator[tuple[str, SandboxEnvironment]]:
    cfg = make_config(request.param, debian_rootfs)
    await NsboxSandboxEnvironment.task_init("conformance", cfg)
    envs = await NsboxSandboxEnvironment.sample_init("conformance", cfg, {})
    try:
        yield request.param, envs["default"]
    finally:
        await NsboxSandboxEnvironment.sample_cleanup("conformance", cfg, envs, False)
        await NsboxSandboxEnvironment.task_cleanup("conformance", cfg, True)


@pytest.fixture
def sandbox_env(request: pytest.FixtureRequest, _config_and_env: tuple[str, SandboxEnvironment]) -> SandboxEnvironment:
    name, env = _config_and_env
    reason = expected_failure(request.node.originalname, name)
    if reason:
        request.node.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    return env


async def test_non_root_default_user(debian_rootfs: Path, mode: str) -> None:
    cfg = make_config("debian-user", debian_rootfs)
    if mode == "single":
        # Impossible with one mapped uid: refused up front, naming the fix.
        with pytest.raises(nsbox.UserUnsupported, match="subordinate id range"):
            await NsboxSandboxEnvironment.sample_init("conformance", cfg, {})
        return
    envs = await NsboxSandboxEnvironment.sample_init("conformance", cfg, {})
    try:
        assert (await envs["default"].exec(["id", "-un"])).stdout == "nobody\n"
    finally:
        await NsboxSandboxEnvironment.sample_cleanup("conformance", cfg, envs, False)


class _Unthrottled:
    """A SandboxEnvironment whose exec skips Inspect's subprocess throttle
    (max_subprocesses, the CPU count), which would otherwise queue the
    concurrent checks' sleeping commands two at a time. The throttle is not
    what these checks test."""

    def __init__(self, env: SandboxEnvironment) -> None:
        self._env = env

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    async def exec(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("concurrency", False)
        return await self._env.exec(*args, **kwargs)


async def test_timeout_checks(debian_rootfs: Path) -> None:
    """Every check of TIMEOUT_CHECKS in every configuration, concurrently:
    one sandbox per configuration, as the other checks have, its checks
    running side by side (they look for their own processes by unique
    markers). Expected failures are strict, as above."""
    outcomes: dict[tuple[str, str], str | None] = {}  # (check, config): traceback, None if passed

    async def run(check: str, config: str, env: SandboxEnvironment) -> None:
        try:
            await TIMEOUT_CHECKS[check](_Unthrottled(env))  # type: ignore[arg-type]
            outcomes[(check, config)] = None
        except Exception:
            outcomes[(check, config)] = traceback.format_exc()

    async def in_config(config: str) -> None:
        cfg = make_config(config, debian_rootfs)
        envs = await NsboxSandboxEnvironment.sample_init("conformance", cfg, {})
        try:
            async with anyio.create_task_group() as tg:
                for check in TIMEOUT_CHECKS:
                    tg.start_soon(run, check, config, envs["default"])
        finally:
            await NsboxSandboxEnvironment.sample_cleanup("conformance", cfg, envs, False)

    async with anyio.create_task_group() as tg:
        for config in CONFIGS:
            tg.start_soon(in_config, config)

    problems = []
    for (check, config), error in sorted(outcomes.items()):
        reason = expected_failure(check, config)
        if error is not None and reason is None:
            problems.append(f"{check}[{config}] failed:\n{error}")
        elif error is None and reason is not None:
            problems.append(f"{check}[{config}] passed but was expected to fail ({reason})")
    assert len(outcomes) == len(TIMEOUT_CHECKS) * len(CONFIGS)
    assert not problems, "\n".join(problems)
