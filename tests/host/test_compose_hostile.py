"""A compose file's host paths against a real sandbox (the rest of the
hostile compose files are tests/unit/compose/test_hostile.py).

The finding: root-only host files into a sandbox."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import nsbox
from nsbox.compose import load_project
from nsbox.spec import Bind

from tests.unit.compose.test_hostile import (  # noqa: F401 (fixtures)
    CREDENTIALS, ENV, OUTSIDE, SECRET, _no_opt_in, compose, proj, refused, secret)


async def test_env_file_cannot_copy_a_host_file_the_sandbox_may_not_read(
        tmp_path: Path, proj: Path, secret: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = compose(proj, """
        services:
          default:
            image: alpine
            env_file: ../{outside}/{creds}
        """, outside=OUTSIDE, creds=CREDENTIALS)
    message = refused(path)
    assert ENV in message and str(secret) in message
    # What the refusal keeps: the sandbox itself cannot read the file as
    # root (sandbox root is not host root), and in the other modes it is
    # your own file, readable by sandbox root, which is why the policy is
    # the same in every mode.
    os.chmod(tmp_path, 0o755)
    async with nsbox.Sandbox(mounts=[Bind(str(secret.parent), "/outside", readonly=True)]) as sb:
        r = await sb.exec(["cat", f"/outside/{CREDENTIALS}"])
    if mode == "root":
        assert os.getuid() == 0 and not r.success and "Permission denied" in r.stderr, (r.stdout, r.stderr)
    else:
        assert r.success and SECRET in r.stdout, r.stderr
    # The operator's explicit opt-in, from nsbox's own environment.
    monkeypatch.setenv(ENV, str(secret.parent))
    env = load_project(path, environ={}).services["default"].environment
    assert env == {"AWS_SECRET_ACCESS_KEY": SECRET}
