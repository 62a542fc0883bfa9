"""Inspect's own conformance checks for sandbox providers, run against nsbox.

Four configurations: the Debian fixture rootfs and the built-in host root,
each with root and with a non-root default user. What may fail, and why,
is listed below; every such xfail is strict, so a check that starts passing
is reported too. In the single-uid mode a non-root default user cannot
exist at all; test_non_root_default_user_needs_subuids checks that it is
refused with a message that names the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator

import pytest
from inspect_ai.util import SandboxEnvironment
from inspect_ai.util._sandbox.self_check import *  # noqa: F403

import nsbox
from nsbox.inspect_provider import NsboxConfig, NsboxSandboxEnvironment

from .conftest import MODE

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
    xfails = dict(XFAIL_ROOT_USER) if name.endswith("-root") else {}
    if MODE.mode == "single":
        xfails.update(XFAIL_SINGLE)
    reason = xfails.get(request.node.originalname)
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
