"""One schema for sandbox options: every SandboxSpec field at every door.

SandboxSpec (nsbox/spec.py) declares the options. Four doors make one:
Sandbox() keywords, `nsbox run` flags, the Inspect settings (nsbox.yaml),
and a compose service. For each door, each field either reaches the spec
through it (checked by passing a value that is not the default and finding
it in the spec the door makes) or is in that door's table below with the
reason it is not there. A field added to the spec alone fails here, as
does a field that no sample below sets. So does a field that is neither
in the plan-template key nor declared not to change the plan.

Needs no user namespaces: nothing here starts a sandbox.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import click
import pytest

import nsbox
from nsbox.cli import main
from nsbox.spec import SandboxSpec

FIELDS = [f.name for f in dataclasses.fields(SandboxSpec)]
DEFAULTS = SandboxSpec()
ROOTFS = "/"  # a directory the samples name as a root filesystem (never mounted here)

# Values that are not the default, in specs that are valid together: each
# field is set in one of them. A new field needs a value here.
SAMPLES: list[dict[str, Any]] = [
    dict(image="registry.test/app:1", pull="always", platform="linux/arm64", user="app", workdir="/w",
         env={"A": "1"}, network="proxy", allow=("example.com",), ports=("8080:80",), hosts={"db": "10.0.0.2"},
         hostname="box", mounts=("/tmp:/mnt/t:ro",), tmpfs=("/scratch:size=1m,exec",), read_only=True, id_mapping="single", nested_userns=True, privileged=True,
         output_limit_mode="raise", timeout=30, memory="256m", pids_limit=64, cpus=1.5, disk="1g",
         strict_limits=True, gpus="all", label="a label", origin="inspect"),
    dict(rootfs=ROOTFS, network="net:web", network_aliases=("db",), more_networks={"net:back": ("db2",)}),
    dict(network="nat", host_loopback=True),
]

# ---- what each door leaves out, and why -------------------------------------

NOT_API = {
    "origin": "always 'api' from keywords (Sandbox(spec=...) gives another)",
}
NOT_CLI = {
    "output_limit_mode": "`nsbox run` copies output whole as it comes: nothing is truncated or raised on",
    "timeout": "`nsbox run -t` times the one command it runs; there are no later execs to default",
    "label": "a label for `nsbox ps`, given by the API and the Inspect provider",
    "more_networks": "`--network net:NAME` joins one network; several are for compose services and the API",
    "origin": "always 'cli'",
}
# Set once per task, at the top level of nsbox.yaml (NsboxConfig), or by
# the provider itself.
NOT_INSPECT_PER_SANDBOX = {
    "output_limit_mode": "task-wide: NsboxConfig.output_limit_mode",
    "id_mapping": "task-wide: NsboxConfig.id_mapping",
    "label": "the provider names each sandbox after its task and sample",
    "more_networks": "an nsbox.yaml sandbox joins one `network`; compose services get theirs from `networks:`",
    "origin": "always 'inspect'",
}
# The compose key that feeds each field (service_spec in nsbox/compose/mapping.py),
# as YAML of one service; "image" and "network" are the caller's arguments
# (the image it pulled or built; support.sample_network from network_mode and networks).
COMPOSE_KEYS = {
    "image": "image: registry.test/app:1",
    "pull": "pull_policy: always",
    "platform": "platform: linux/arm64",
    "user": "user: app",
    "workdir": "working_dir: /w",
    "env": "environment: {A: '1'}",
    "network": "network_mode: bridge",
    "ports": "ports: ['8080:80']",
    "hostname": "hostname: box",
    "hosts": "extra_hosts: ['db:10.0.0.2']",
    "mounts": "volumes: ['./src:/src:ro']",
    "tmpfs": "tmpfs: ['/scratch:size=1m,exec']",
    "read_only": "read_only: true",
    "memory": "mem_limit: 256m",
    "cpus": "cpus: 1.5",
    "pids_limit": "pids_limit: 64",
    "disk": "storage_opt: {size: 1g}",
    "gpus": "gpus: all",
    "nested_userns": "cap_add: [SYS_ADMIN]",
    "privileged": "privileged: true",
    "label": "(the project's and the service's names)",
}
NOT_COMPOSE = {  # neither a compose key nor x-nsbox (compose/support.py X_NSBOX)
    "rootfs": "compose services run images",
    "id_mapping": "the operator's choice, never a compose file's (host-root would make sandbox root host root)",
    "origin": "the caller's (service_spec's `extra`: the Inspect provider passes 'inspect')",
    "more_networks": "a service's `networks:` beyond its first, joined when the sample starts (compose/services.py)",
}


def sample_of(name: str) -> dict[str, Any]:
    """The sample that sets field `name`."""
    for sample in SAMPLES:
        if name in sample:
            return sample
    raise AssertionError(f"SandboxSpec.{name}: no sample sets it: add a value to SAMPLES in {__file__}")


def wanted(sample: dict[str, Any], **fixed: Any) -> SandboxSpec:
    return SandboxSpec(**{**sample, **fixed})


def differs(spec: SandboxSpec, reference: SandboxSpec, names: list[str]) -> list[str]:
    return [f"{n}: {getattr(spec, n)!r} != {getattr(reference, n)!r}" for n in names
            if getattr(spec, n) != getattr(reference, n)]


def test_every_field_has_a_sample_value() -> None:
    for name in FIELDS:
        sample = sample_of(name)
        assert getattr(wanted(sample), name) != getattr(DEFAULTS, name), f"{name}: the sample gives the default"


# ---- door 1: Sandbox() keywords ----------------------------------------------

def test_sandbox_keywords() -> None:
    params = set(inspect.signature(nsbox.Sandbox).parameters) - {"spec"}
    missing = [n for n in FIELDS if n not in params and n not in NOT_API]
    assert not missing, f"Sandbox() has no keyword for {missing}: add one, or say why in NOT_API"
    assert not params - set(FIELDS), "a Sandbox() keyword that is no SandboxSpec field"
    assert not set(NOT_API) & params, "NOT_API names a keyword Sandbox() has"
    for sample in SAMPLES:
        given = {n: v for n, v in sample.items() if n not in NOT_API}
        assert not differs(nsbox.Sandbox(**given).spec, wanted(given), FIELDS)


# ---- door 2: `nsbox run` flags -------------------------------------------------

def _run_params() -> dict[str, click.Parameter]:
    """The parameters of `nsbox run` that make_sandbox takes (not run's own)."""
    return {p.name: p for p in main.run.params if p.name not in ("command", "timeout", "detach")}  # type: ignore[misc]


def _cli_param(name: str) -> str:
    return main.RENAMED[name][0] if name in main.RENAMED else name


def _argv(sample: dict[str, Any]) -> list[str]:
    params = _run_params()
    argv: list[str] = []
    for name, value in sample.items():
        if name in NOT_CLI:
            continue
        flag = params[_cli_param(name)].opts[-1]
        if value is True:
            argv.append(flag)
        elif isinstance(value, dict):
            sep = ":" if name == "hosts" else "="
            argv += [x for k, v in value.items() for x in (flag, f"{k}{sep}{v}")]
        elif isinstance(value, tuple):
            argv += [x for v in value for x in (flag, str(v))]
        else:
            argv += [flag, str(value)]
    return argv


def test_cli_flags() -> None:
    params = _run_params()
    missing = [n for n in FIELDS if _cli_param(n) not in params and n not in NOT_CLI]
    assert not missing, f"`nsbox run` has no flag for {missing}: add one, or say why in NOT_CLI"
    assert not {_cli_param(n) for n in NOT_CLI} & set(params), "NOT_CLI names a flag `nsbox run` has"
    assert set(params) == {_cli_param(n) for n in FIELDS if n not in NOT_CLI}, "a flag that is no field"
    for sample in SAMPLES:
        ctx = main.run.make_context("run", [*_argv(sample), "--", "true"])
        opts = {k: v for k, v in ctx.params.items() if k in params}
        given = {n: v for n, v in sample.items() if n not in NOT_CLI}
        assert not differs(main.make_sandbox(**opts).spec, wanted(given, origin="cli"), FIELDS)


def test_cli_refuses_what_the_spec_refuses() -> None:
    ctx = main.run.make_context("run", ["--memory", "lots", "--", "true"])
    with pytest.raises(click.UsageError, match="memory"):
        main.make_sandbox(**{k: v for k, v in ctx.params.items() if k in _run_params()})
    with pytest.raises(click.UsageError, match="add-host"):
        main.make_sandbox(add_hosts=("nocolon",))


# ---- door 3: the Inspect settings (nsbox.yaml) -------------------------------

def test_inspect_settings() -> None:
    from nsbox.inspect.config import NsboxConfig, SandboxSettings
    from nsbox.inspect.provider import NsboxSandboxEnvironment

    per_sandbox, task_wide = set(SandboxSettings.model_fields), set(NsboxConfig.model_fields)
    missing = [n for n in FIELDS if n not in per_sandbox and n not in NOT_INSPECT_PER_SANDBOX]
    assert not missing, f"the Inspect settings have no {missing}: add them, or say why in NOT_INSPECT_PER_SANDBOX"
    assert not set(NOT_INSPECT_PER_SANDBOX) & per_sandbox, "NOT_INSPECT_PER_SANDBOX names a setting there is"
    for name, why in NOT_INSPECT_PER_SANDBOX.items():
        assert not why.startswith("task-wide") or name in task_wide, name
    for sample in SAMPLES:
        given = {n: v for n, v in sample.items() if n in task_wide}
        given["mounts"] = tuple(given.get("mounts", ()))
        cfg = NsboxConfig.model_validate(given)
        ((_, settings),) = cfg.settings()
        made = NsboxSandboxEnvironment._make(cfg, settings, "a label")
        reference = wanted({n: v for n, v in given.items() if n != "origin"}, origin="inspect", label="a label")
        assert not differs(made.spec, reference, FIELDS)


# ---- door 4: a compose service ----------------------------------------------

def test_compose_service(tmp_path: Path) -> None:
    from nsbox.compose import load_project, service_spec
    from nsbox.compose.support import X_NSBOX

    missing = [n for n in FIELDS if n not in COMPOSE_KEYS and n not in X_NSBOX and n not in NOT_COMPOSE]
    assert not missing, f"compose sets no {missing}: map a compose key, allow it in x-nsbox, or say why in NOT_COMPOSE"
    assert not set(NOT_COMPOSE) & (set(COMPOSE_KEYS) | X_NSBOX), "NOT_COMPOSE names a field compose sets"
    # Each key of COMPOSE_KEYS feeds its field...
    (tmp_path / "src").mkdir()
    keys = "".join(f"      {line}\n" for n, line in COMPOSE_KEYS.items() if not line.startswith("("))
    (tmp_path / "compose.yaml").write_text(f"services:\n  app:\n{keys}")
    project = load_project(tmp_path, environ={})
    spec = service_spec(project.services["app"], project, image="registry.test/app:1", network="nat",
                        volume_root=tmp_path / "vols")
    unfed = [n for n in COMPOSE_KEYS if getattr(spec, n) == getattr(DEFAULTS, n)]
    assert not unfed, f"COMPOSE_KEYS says a compose key feeds {unfed}, but it does not"
    # ...and x-nsbox sets each field it allows.
    for sample in SAMPLES:
        given = {n: v for n, v in sample.items() if n in X_NSBOX}
        network = sample.get("network", "none")
        service = dataclasses.replace(project.services["app"], x_nsbox=given)
        spec = service_spec(service, project, image="registry.test/app:1", network=network,
                            volume_root=tmp_path / "vols")
        assert not differs(spec, wanted({**given, "network": network}), list(given))


# ---- the plan-template key -----------------------------------------------------

def test_each_field_keys_the_plan_or_is_known_not_to_change_it() -> None:
    from nsbox.plan import assemble

    reads, not_planned = set(assemble.READS), set(assemble.NOT_PLANNED)
    assert not reads & not_planned, f"both read by the plan and said not to change it: {reads & not_planned}"
    unknown = [n for n in FIELDS if n not in reads and n not in not_planned]
    assert not unknown, (f"SandboxSpec fields {unknown} are neither in the plan-template key (assemble.READS) "
                         "nor in assemble.NOT_PLANNED with the reason the plan does not depend on them")
    assert reads | not_planned == set(FIELDS), "assemble names a field SandboxSpec does not have"


def test_the_key_changes_with_each_field_the_plan_reads() -> None:
    from nsbox.host import idmap
    from nsbox.plan import assemble

    mapping = idmap.detect()
    base = assemble.Inputs(SandboxSpec(), nsbox.plan.rootfs.HostRootfs(), mapping, Path("/m"), Path("/r"))
    for name in assemble.READS:
        changed = dataclasses.replace(base, spec=wanted({name: sample_of(name)[name]}))
        assert assemble.key(changed) != assemble.key(base), name


def test_a_contributor_cannot_read_an_undeclared_field(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan sees the spec through READS only: a contributor reading
    another field (here `privileged`, once READS forgets it) fails at once
    instead of being served another sandbox's template."""
    from nsbox.host import idmap
    from nsbox.plan import assemble

    inputs = assemble.Inputs(SandboxSpec(), nsbox.plan.rootfs.HostRootfs(), idmap.detect(), Path("/m"), Path("/r"))
    assemble.build(inputs, Path("/l/x"), "x", "x")
    monkeypatch.setattr(assemble, "READS", tuple(n for n in assemble.READS if n != "privileged"))
    with pytest.raises(assemble.UndeclaredField, match="privileged"):
        assemble.build(inputs, Path("/l/x"), "x", "x")
