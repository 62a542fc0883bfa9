"""nsbox's public surface, pinned: what `import nsbox` offers (README,
docs/usage.md), that the package and its plan and spec modules import
without the C extension, and the entry points pyproject.toml names (the
`nsbox` command, and Inspect's `--sandbox nsbox`)."""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import nsbox
import nsbox.errors

pytestmark = pytest.mark.timeout(60)

ERRORS = {"NsboxError", "HostPrerequisiteError", "SandboxSetupError", "ResourceExhausted", "SandboxUnavailable",
          "UserUnsupported", "OutputLimitExceeded", "CommandTimeout"}
DOCUMENTED = {"Sandbox", "SandboxSpec", "Network", "ExecResult", "__version__"} | ERRORS
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_all_is_exactly_the_documented_set() -> None:
    assert sorted(nsbox.__all__) == sorted(DOCUMENTED)
    assert len(nsbox.__all__) == len(set(nsbox.__all__))


def test_each_public_name_resolves() -> None:
    for name in nsbox.__all__:
        assert getattr(nsbox, name) is not None, name
    from nsbox.init.client import ExecResult
    from nsbox.network import Network
    from nsbox.sandbox import Sandbox
    from nsbox.spec import SandboxSpec

    assert (nsbox.Sandbox, nsbox.SandboxSpec, nsbox.Network, nsbox.ExecResult) == (
        Sandbox, SandboxSpec, Network, ExecResult)
    assert nsbox.__version__ == importlib.metadata.version("nsbox")
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        nsbox.Nope  # noqa: B018


def test_the_errors_are_every_exception_of_nsbox_errors() -> None:
    defined = {name for name, obj in vars(nsbox.errors).items()
               if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == "nsbox.errors"}
    assert defined == ERRORS
    for name in ERRORS:
        assert getattr(nsbox, name) is getattr(nsbox.errors, name)
    for name in ERRORS - {"NsboxError", "CommandTimeout"}:
        assert issubclass(getattr(nsbox, name), nsbox.NsboxError), name
    assert issubclass(nsbox.CommandTimeout, TimeoutError)  # what asyncio and Inspect callers catch


NO_EXTENSION = r"""
import json, sys
sys.modules["nsbox._native"] = None  # importing the C extension now fails
sys.modules["nsbox._text"] = None
import nsbox
import nsbox.plan
import nsbox.spec
from nsbox.plan import mounts, netmodes, plan, procmask, resources, rootfs, steps
spec = nsbox.SandboxSpec(memory="64m", network="none")
print(json.dumps({"memory": spec.memory, "all": sorted(nsbox.__all__),
                  "native": sys.modules["nsbox._native"] is None}))
"""


def test_nsbox_plan_and_spec_import_without_the_c_extension() -> None:
    r = subprocess.run([sys.executable, "-c", NO_EXTENSION], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out == {"memory": 64 << 20, "all": sorted(DOCUMENTED), "native": True}


def test_without_the_c_extension_only_sandboxes_fail() -> None:
    r = subprocess.run([sys.executable, "-c", NO_EXTENSION + "nsbox.Sandbox\n"], capture_output=True, text=True,
                       timeout=30)
    assert json.loads(r.stdout)["native"]  # everything before the last line worked
    assert r.returncode == 1 and "ModuleNotFoundError" in r.stderr and "nsbox._native" in r.stderr, r.stderr


def _entry_point(group: str, name: str) -> importlib.metadata.EntryPoint:
    found = [ep for ep in importlib.metadata.entry_points(group=group) if ep.name == name]
    assert len(found) == 1, (group, name, found)
    return found[0]


def test_the_entry_points_are_the_ones_pyproject_names() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert project["scripts"] == {"nsbox": _entry_point("console_scripts", "nsbox").value}
    assert project["entry-points"]["inspect_ai"] == {"nsbox": _entry_point("inspect_ai", "nsbox").value}


def test_the_cli_entry_point_resolves() -> None:
    import click

    main = _entry_point("console_scripts", "nsbox").load()
    assert isinstance(main, click.Group)
    assert {"run", "exec", "ps", "rm", "gc", "doctor", "image", "build", "network"} <= set(main.commands)


def test_the_inspect_entry_point_registers_the_provider() -> None:
    from inspect_ai.util import SandboxEnvironment
    from inspect_ai.util._sandbox.registry import registry_find_sandboxenv

    module = _entry_point("inspect_ai", "nsbox").load()
    found = registry_find_sandboxenv("nsbox")
    assert found is module.NsboxSandboxEnvironment and issubclass(found, SandboxEnvironment)


# The public names of nsbox/inspect_provider.py before the provider moved
# to nsbox/inspect/: configurations and code written against them.
OLD_PROVIDER_NAMES = ["CONFIG_FILES", "NetworkSettings", "NsboxConfig", "NsboxExecRemoteProcess",
                      "NsboxSandboxEnvironment", "SandboxSettings", "load_config", "shell_command"]


def test_the_old_provider_module_still_imports() -> None:
    code = ("import json, nsbox.inspect_provider as old\n"
            "from inspect_ai.util._sandbox.registry import registry_find_sandboxenv\n"
            "from nsbox.inspect import config, exec_remote, provider\n"
            f"names = {OLD_PROVIDER_NAMES!r}\n"
            "new = {**vars(config), **vars(exec_remote), **vars(provider)}\n"
            "print(json.dumps({'same': [n for n in names if getattr(old, n) is new[n]],\n"
            "                  'registered': registry_find_sandboxenv('nsbox') is old.NsboxSandboxEnvironment}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"same": OLD_PROVIDER_NAMES, "registered": True}
