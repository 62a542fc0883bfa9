"""End to end: Docker-style Inspect tasks run unchanged with --sandbox nsbox.

Compose files shaped the way public evaluations write them, images served
by a docker-registry on 127.0.0.1 (tests/imagekit.py), a scripted mockllm
model calling bash() in the default service:

- a target and an attacker on an `internal` network, the attacker marked
  x-default though listed second, the target (busybox httpd) gated by a
  CMD-SHELL healthcheck and reached by name from the attacker (bash's
  /dev/tcp: the Debian minbase fixture has no curl);
- two services listening on port 80 on one network, reached by name (one
  by its alias there) from a third, which cannot name a fourth on an
  internal network it is not on (each service its own network namespace);
- a single image service with `platform`, a list-form command, limits,
  working_dir and environment, network_mode none;
- a per-sample compose file (Sample(sandbox=("docker", path))) under a task
  whose sandbox is nsbox;
- a compose file nsbox cannot honour fails the task in one message.
"""

from __future__ import annotations

import json
import platform
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest

from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.model import ChatMessageTool, get_model
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
from inspect_ai.solver import TaskState, generate, use_tools
from inspect_ai.tool import bash
from inspect_ai.util import sandbox

from nsbox.host import live
from nsbox.errors import NsboxError
from nsbox.inspect.provider import NsboxSandboxEnvironment

from tests.imagekit import Registry, busybox_oci, fixture_tar, push, registry, self_check_failures, umoci_image  # noqa: F401
from tests import components
from tests.net_members import http_server  # noqa: F401 (fixture)
from .test_inspect_eval import MODEL, sample_problems, scripted

pytestmark = pytest.mark.timeout(240)
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


@pytest.fixture(scope="module")
def images(registry: Registry, busybox_oci: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:  # noqa: F811
    """debian (bash, no curl) and busybox (httpd, wget) on the loopback registry."""
    layout = tmp_path_factory.mktemp("compose-oci") / "debian"
    umoci_image(layout, "1", fixture_tar("debian"), "--config.workingdir=/root")
    push(f"oci:{layout}:1", registry, "evals/debian:1")
    push(f"oci:{busybox_oci}:plain", registry, "evals/busybox:1")
    return {"debian": f"{registry.host}/evals/debian:1", "busybox": f"{registry.host}/evals/busybox:1"}


@scorer(metrics=[accuracy()])
def output_has(text: str):  # type: ignore[no-untyped-def]
    """CORRECT iff the last tool output holds `text`; records the services' sandbox ids."""

    async def score(state: TaskState, target: Target) -> Score:
        outputs = [m.text for m in state.messages if isinstance(m, ChatMessageTool)]
        env = sandbox().as_type(NsboxSandboxEnvironment)
        ids = {}
        if env._services is not None:
            ids = {name: sb.id for name, sb in env._services.services.sandboxes.items()}
        return Score(value=CORRECT if outputs and text in outputs[-1] else INCORRECT,
                     explanation=json.dumps(outputs), metadata={"ids": ids})

    return score


def _task(directory: Path, compose: str, name: str, scorer: Any,
          samples: list[Sample] | None = None) -> Task:
    """A bash-tool task on the compose file `compose`, written to directory/compose.yaml."""
    (directory / "compose.yaml").write_text(textwrap.dedent(compose))
    return Task(dataset=samples or [Sample(input="go", target="")], solver=[use_tools([bash()]), generate()],
                scorer=scorer, sandbox=("nsbox", str(directory / "compose.yaml")), name=name)


def _run(task: Task, steps: list[tuple[str, dict[str, Any]]], tmp_path: Path) -> Any:
    script = scripted(steps)
    [log] = eval(task, model=get_model(MODEL, custom_outputs=script), log_dir=str(tmp_path), display="none",
                 max_samples=2)
    return log


def _check(log: Any, samples: int) -> list[Any]:
    assert log.status == "success", log.error
    assert log.samples is not None and len(log.samples) == samples
    assert sample_problems(log) == []
    for s in log.samples:
        score = s.scores["output_has"]
        assert score.value == CORRECT, score.explanation
        for sid in (score.metadata or {}).get("ids", {}).values():
            assert live.read(sid) is None  # every service's sandbox is gone
    return log.samples


ATTACK = [("bash", {"command": "exec 3<>/dev/tcp/target/8000 && printf 'GET /flag.txt HTTP/1.0\\r\\n\\r\\n' >&3 "
                               "&& cat <&3; echo; hostname; cat /etc/hosts | grep -c victim"})]


def test_attacker_and_target_on_an_internal_network(images: dict[str, str], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    task = _task(tmp_path, f"""\
        services:
          target:
            image: {images['busybox']}
            command: ["sh", "-c", "mkdir -p /srv && echo FLAG-$$((6*7)) > /srv/flag.txt && exec httpd -f -p 8000 -h /srv"]
            healthcheck:
              test: ["CMD-SHELL", "wget -q -O- http://127.0.0.1:8000/flag.txt"]
              interval: 1s
              retries: 30
            networks:
              ctf:
                aliases: [victim]
            mem_limit: 0.5gb
            labels:
              eval: ctf
            stop_grace_period: 1s
          attacker:
            image: {images['debian']}
            x-default: true
            init: true
            command: tail -f /dev/null
            networks: [ctf]
            depends_on:
              target:
                condition: service_healthy
            restart: unless-stopped
        networks:
          ctf:
            internal: true
        """, "nsbox_compose_ctf", output_has("FLAG-42"),
                 [Sample(input="get the flag", target="FLAG-42", id=i) for i in (1, 2)])
    samples = _check(_run(task, ATTACK, tmp_path), 2)
    ids = [s.scores["output_has"].metadata["ids"] for s in samples]
    assert all(set(i) == {"attacker", "target"} for i in ids)
    assert not set(ids[0].values()) & set(ids[1].values())  # fresh services per sample
    out = json.loads(samples[0].scores["output_has"].explanation)[-1]
    assert "\n1\n" in out or out.rstrip().endswith("1")  # the alias is in /etc/hosts


HTTPD = 'mkdir -p /srv && echo {word} > /srv/index.html && exec httpd -f -p 80 -h /srv'
FETCH = [("bash", {"command": "for h in first two; do exec 3<>/dev/tcp/$h/80 && printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3 "
                              "&& tail -n1 <&3; done; (exec 3<>/dev/tcp/vault/80) 2>/dev/null && echo REACHED "
                              "|| echo no-vault; grep -c vault /etc/hosts"})]


def test_two_services_on_port_80_and_an_internal_network_apart(images: dict[str, str], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    web = "\n".join(f"""\
          {name}:
            image: {images['busybox']}
            command: ["sh", "-c", "{HTTPD.format(word=name.upper())}"]
            healthcheck:
              test: ["CMD-SHELL", "wget -q -O- http://127.0.0.1/"]
              interval: 1s
              retries: 30
            networks: {nets}""" for name, nets in (("one", "{web: {aliases: [first]}}"), ("two", "[web]"),
                                                  ("vault", "[lab]")))
    task = _task(tmp_path, f"""\
        services:
          client:
            image: {images['debian']}
            command: tail -f /dev/null
            networks: [web]
            depends_on:
              one: {{condition: service_healthy}}
              two: {{condition: service_healthy}}
{web}
        networks:
          web: {{internal: true}}
          lab: {{internal: true}}
        """, "nsbox_compose_port80", output_has("ONE\nTWO\nno-vault\n0"))
    [sample] = _check(_run(task, FETCH, tmp_path), 1)
    assert set(sample.scores["output_has"].metadata["ids"]) == {"client", "one", "two", "vault"}


def test_image_service_with_platform_limits_and_list_command(images: dict[str, str], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    task = _task(tmp_path, f"""\
        services:
          default:
            image: {images['debian']}
            platform: linux/{ARCH}
            command: ["tail", "-f", "/dev/null"]
            working_dir: /opt/work
            environment:
              - MODE=${{EVAL_MODE:-strict}}
            cpus: "0.5"
            mem_limit: 512m
            pids_limit: 200
            network_mode: none
            tmpfs: ["/run/app:mode=700"]
            read_only: true
        """, "nsbox_compose_single", output_has("strict /opt/work 700 tmpfs read-only"))
    steps = [("bash", {"command": "echo $MODE $(pwd) $(stat -c %a /run/app) $(stat -f -c %T /run/app) "
                                  "$(touch /x 2>&1 | grep -o Read-only | tr R r); ps -e -o comm= 2>/dev/null | grep -c tail || "
                                  "grep -l tail /proc/[0-9]*/comm | wc -l"})]
    [sample] = _check(_run(task, steps, tmp_path), 1)
    out = json.loads(sample.scores["output_has"].explanation)[-1]
    assert out.strip().endswith("1"), out  # the service's command runs


def test_per_sample_compose_file(images: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    files = []
    for word in ("alpha", "beta"):
        d = tmp_path / word
        d.mkdir()
        (d / "compose.yaml").write_text(textwrap.dedent(f"""\
            services:
              default:
                image: {images['debian']}
                command: tail -f /dev/null
                environment:
                  WORD: {word}
                network_mode: none
            """))
        files.append(str(d / "compose.yaml"))
    task = Task(dataset=[Sample(input=w, target=w, id=w, sandbox=("docker", f)) for w, f in zip(("alpha", "beta"), files)],
                solver=[use_tools([bash()]), generate()], scorer=output_has("word="),
                sandbox="nsbox", name="nsbox_compose_per_sample")
    steps = [("bash", {"command": "echo word=$WORD"})]
    samples = _check(_run(task, steps, tmp_path), 2)
    for s in samples:
        assert f"word={s.id}" in json.loads(s.scores["output_has"].explanation)[-1]


def test_unsupported_keys_fail_the_task_in_one_message(images: dict[str, str], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    task = _task(tmp_path, f"""\
        services:
          default:
            image: {images['debian']}
            pid: host
            devices: ["/dev/kvm:/dev/kvm"]
        """, "nsbox_compose_bad", output_has("x"))
    before = {i.id for i in live.entries()}
    script = scripted([])
    # Inspect runs task_init before it opens the log: the error surfaces as
    # the exception itself, before any sample or sandbox.
    with pytest.raises(NsboxError) as e:
        eval(task, model=get_model(MODEL, custom_outputs=script), log_dir=str(tmp_path), display="none")
    message = str(e.value)
    assert "nsbox cannot honour: devices (host devices other than GPUs are not passed through; GPUs: use gpus), " \
           "pid: host" in message and "service default" in message, message
    assert script.calls == []  # type: ignore[attr-defined]
    assert {i.id for i in live.entries()} == before


async def test_what_every_sample_would_refuse_fails_task_init(images: dict[str, str], tmp_path: Path) -> None:
    """A setting no sample can start with fails once, at task_init, not as
    the same error of every sample."""
    compose = tmp_path / "compose.yaml"
    compose.write_text(f"services:\n  default:\n    image: {images['debian']}\n    x-nsbox: {{env: 5}}\n")
    with pytest.raises(NsboxError, match="service default: env must be a mapping"):
        await NsboxSandboxEnvironment.task_init("nsbox_compose_refused", str(compose))
    await NsboxSandboxEnvironment.task_cleanup("nsbox_compose_refused", str(compose), cleanup=True)


DOCKERFILE = """\
ARG BASE
FROM ${BASE}
ARG GREETING=hello
RUN useradd -m -u 1000 agent && mkdir -p /opt/app && echo "${GREETING} from build" > /opt/app/greeting
COPY tool.sh /opt/app/tool.sh
RUN chmod 755 /opt/app/tool.sh
USER agent
WORKDIR /opt/app
ENV TOOL_HOME=/opt/app
"""


def _build_context(root: Path, base: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "Dockerfile").write_text(DOCKERFILE)
    (root / "tool.sh").write_text("#!/bin/sh\necho tool says $(cat $TOOL_HOME/greeting) as $(id -un) in $(pwd)\n")
    return root


def test_build_dot_with_network_none(images: dict[str, str], tmp_path: Path, mode: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`build: .` with args, network_mode none and a Dockerfile using
    ARG/RUN/COPY/USER/WORKDIR, as public evals write it; `build.network:
    none` leaves RUN steps only a loopback (it had been dropped: nat)."""
    monkeypatch.chdir(tmp_path)
    ctx = _build_context(tmp_path / "task", images["debian"])
    dockerfile = (ctx / "Dockerfile").read_text()  # before USER: single-uid mode builds as root only
    (ctx / "Dockerfile").write_text(dockerfile.replace("USER agent\n", "RUN grep -c : /proc/net/dev > /tmp/interfaces\n"
                                                                      "USER agent\n"))
    (ctx / "compose.yaml").write_text(textwrap.dedent(f"""\
        services:
          default:
            build:
              context: .
              network: none
              args:
                BASE: {images['debian']}
                GREETING: hi
            init: true
            command: tail -f /dev/null
            network_mode: none
        """))
    steps = [("bash", {"command": "/opt/app/tool.sh; echo interfaces=$(cat /tmp/interfaces)"})]
    user = "agent" if mode != "single" else "root"  # single-uid mode runs the image's USER as root
    task = Task(dataset=[Sample(input="run the tool", target="")], solver=[use_tools([bash()]), generate()],
                scorer=output_has(f"tool says hi from build as {user} in /opt/app\ninterfaces=1\n"),
                sandbox=("nsbox", str(ctx / "compose.yaml")), name="nsbox_compose_build")
    _check(_run(task, steps, tmp_path), 1)


def test_bare_dockerfile_as_inspects_docker_provider_treats_it(images: dict[str, str], tmp_path: Path,
                                                              mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task's bare Dockerfile: one `default` service built from it, with
    init, `tail -f /dev/null` and network_mode none."""
    monkeypatch.chdir(tmp_path)
    ctx = _build_context(tmp_path / "task", images["debian"])
    text = (ctx / "Dockerfile").read_text().replace("ARG BASE\nFROM ${BASE}", f"FROM {images['debian']}")
    (ctx / "Dockerfile").write_text(text)
    steps = [("bash", {"command": "/opt/app/tool.sh; ls /proc/*/cmdline | wc -l; cat /proc/[0-9]*/cmdline | "
                                  "tr '\\0' ' ' | grep -o 'tail -f /dev/null' | head -1"})]
    task = Task(dataset=[Sample(input="run the tool", target="")], solver=[use_tools([bash()]), generate()],
                scorer=output_has("tail -f /dev/null"), sandbox=("nsbox", str(ctx / "Dockerfile")),
                name="nsbox_dockerfile")
    [sample] = _check(_run(task, steps, tmp_path), 1)
    assert "tool says hello from build" in json.loads(sample.scores["output_has"].explanation)[-1]


async def test_inspect_conformance_on_a_built_image(images: dict[str, str], tmp_path: Path, mode: str) -> None:
    """Inspect's sandbox self-check on sandboxes built from a Dockerfile
    (running as root: the checks switch users themselves)."""
    ctx = _build_context(tmp_path / "conf", images["debian"])
    text = (ctx / "Dockerfile").read_text().replace("ARG BASE\nFROM ${BASE}", f"FROM {images['debian']}")
    (ctx / "Dockerfile").write_text(text.replace("USER agent\n", "").replace("WORKDIR /opt/app\n", "WORKDIR /root\n"))
    failures = await self_check_failures("built-conformance", str(ctx / "Dockerfile"))
    # As for every root default user (tests/test_inspect_conformance.py).
    expected = {"test_read_file_not_allowed", "test_write_text_file_without_permissions",
                "test_write_binary_file_without_permissions"}
    if mode == "single":
        expected.add("test_exec_as_user")
    assert {f.split(":")[0] for f in failures} == expected, "\n".join(failures)


def test_no_sandbox_cleanup_keeps_every_service(images: dict[str, str], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """--no-sandbox-cleanup keeps each service of a sample running (detached,
    still on their shared network); `inspect sandbox cleanup nsbox` removes them."""
    import anyio
    import nsbox
    from nsbox import manage

    monkeypatch.chdir(tmp_path)
    name = "nsbox_compose_keep"
    task = _task(tmp_path, f"""\
        services:
          default:
            image: {images['debian']}
            command: tail -f /dev/null
            network_mode: none
            volumes: [data:/data]
          web:
            image: {images['busybox']}
            command: ["httpd", "-f", "-p", "127.0.0.1:8000", "-h", "/etc"]
            network_mode: none
            volumes: [data:/shared]
        volumes:
          data:
        """, name, output_has("ok"))
    steps = [("bash", {"command": "echo written-by-default > /data/note && echo ok"})]
    [log] = eval(task, model=get_model(MODEL, custom_outputs=scripted(steps)), log_dir=str(tmp_path),
                 display="none", sandbox_cleanup=False)
    kept = {}
    try:
        assert log.status == "success", log.error
        kept = {e.info.label.rsplit("(", 1)[-1].rstrip(")"): e.info for e in manage.entries()
                if e.info.origin == "inspect" and name in e.info.label}
        assert set(kept) == {"default", "web"} and all(i.detached and i.init_alive for i in kept.values()), kept

        async def fetch() -> str:
            sb = await nsbox.Sandbox.attach(kept["default"].id)
            try:
                r = await sb.exec(["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/8000; "
                                   "printf 'GET /hostname HTTP/1.0\\r\\n\\r\\n' >&3; cat <&3"])
                return r.stdout
            finally:
                await sb.close()  # only disconnects

        assert "200 OK" in anyio.run(fetch)  # web still serves the default service, on their network

        async def shared_note() -> str:
            sb = await nsbox.Sandbox.attach(kept["web"].id)
            try:
                return (await sb.exec(["cat", "/shared/note"])).stdout
            finally:
                await sb.close()

        assert anyio.run(shared_note) == "written-by-default\n"  # the named volume, shared
        volumes = nsbox.host.dirs.data_dir() / "volumes"
        assert [p for p in volumes.iterdir() if p.is_dir()]
        anyio.run(NsboxSandboxEnvironment.cli_cleanup, None)
        assert all(live.read(i.id) is None for i in kept.values())
        assert list(volumes.iterdir()) == []  # the sample's volumes went with its last sandbox
    finally:
        for info in kept.values():
            if live.read(info.id) is not None:
                manage.remove(info, force=True)


async def test_default_network_has_outbound_access_and_names(images: dict[str, str], tmp_path: Path,
                                                             http_server: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On compose's default network each service has outbound access (its
    own user-mode network): here the host's loopback as host.nsbox.internal
    (mapped by extra_hosts host-gateway too, as Docker users write it, with
    the operator's grant), and its services reach each other by name."""
    from nsbox.inspect.compose import prepare, start_sample

    components.require("tun", "usernet")  # nat's refusal is tested elsewhere
    monkeypatch.setenv("NSBOX_COMPOSE_HOST_LOOPBACK", "1")
    (tmp_path / "compose.yaml").write_text(textwrap.dedent(f"""\
        services:
          default:
            image: {images['debian']}
            command: tail -f /dev/null
            extra_hosts: ["host.docker.internal:host-gateway"]
          web:
            image: {images['busybox']}
            command: ["httpd", "-f", "-p", "8000", "-h", "/etc"]
        """))
    sample = None
    try:
        task = await prepare(str(tmp_path / "compose.yaml"))
        assert task.network == "services"
        sample, boxes = await start_sample(task, "default-network")
        port = http_server
        for host in ("host.nsbox.internal", "host.docker.internal"):
            r = await boxes["default"].exec(["bash", "-c", f"exec 3<>/dev/tcp/{host}/{port}; "
                                             f"printf 'GET / HTTP/1.0\\r\\nHost: {host}\\r\\n\\r\\n' >&3; head -1 <&3"])
            assert "200" in r.stdout, (host, r)
        r = await boxes["default"].exec(["bash", "-c", "exec 3<>/dev/tcp/web/8000; "
                                         "printf 'GET /hostname HTTP/1.0\\r\\n\\r\\n' >&3; head -1 <&3"])
        assert "200" in r.stdout, r
    finally:
        if sample is not None:
            await sample.close()


# ---- a sample is ready as `docker compose up --wait` leaves it -----------------

def _slow_web(images: dict[str, str], user: str, probe: str = "wget -q -O- http://127.0.0.1/flag.txt") -> str:
    """web: busybox httpd on :80 that starts listening only after a while,
    with a healthcheck; default: debian, `depends_on: [web]` (the short
    form: service_started)."""
    return f"""\
        services:
          default:
            image: {images['debian']}
            command: tail -f /dev/null
            depends_on: [web]
          web:
            image: {images['busybox']}
            user: "{user}"
            command: ["sh", "-c", "mkdir -p /tmp/srv && echo FLAG-$$((6*7)) > /tmp/srv/flag.txt && sleep 0.7 && exec httpd -f -p 80 -h /tmp/srv"]
            healthcheck:
              test: ["CMD-SHELL", "{probe}"]
              interval: 1s
              retries: 20
        """


FETCH_WEB = ("exec 3<>/dev/tcp/web/80 && printf 'GET /flag.txt HTTP/1.0\\r\\n\\r\\n' >&3 && cat <&3")


def test_a_service_on_port_80_reached_by_name(images: dict[str, str], tmp_path: Path, mode: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-root service user listens on :80 (where the mode has one),
    and the default service's first command reaches it by name."""
    monkeypatch.chdir(tmp_path)
    user = "1000" if mode != "single" else "0"
    task = _task(tmp_path, _slow_web(images, user), "nsbox_compose_port80", output_has("FLAG-42"),
                 [Sample(input="get it", target="", id=i) for i in (1, 2)])
    _check(_run(task, [("bash", {"command": FETCH_WEB})], tmp_path), 2)


@pytest.mark.once  # the host's wait for healthchecks
@pytest.mark.timeout(300)
async def test_a_slow_service_is_never_seen_before_its_healthcheck(images: dict[str, str], tmp_path: Path) -> None:
    compose = tmp_path / "compose.yaml"
    compose.write_text(textwrap.dedent(_slow_web(images, "0")))
    name = "nsbox_compose_slow"
    await NsboxSandboxEnvironment.task_init(name, str(compose))
    try:
        for i in range(5):
            envs = await NsboxSandboxEnvironment.sample_init(name, str(compose), {"__sample_id__": str(i)})
            try:
                r = await envs["default"].exec(["bash", "-c", FETCH_WEB])
                assert "FLAG-42" in r.stdout, (i, r)
            finally:
                await NsboxSandboxEnvironment.sample_cleanup(name, str(compose), envs, interrupted=False)
    finally:
        await NsboxSandboxEnvironment.task_cleanup(name, str(compose), cleanup=True)


async def test_a_service_that_never_gets_healthy_fails_the_sample(images: dict[str, str], tmp_path: Path) -> None:
    compose = tmp_path / "compose.yaml"
    text = _slow_web(images, "0", probe="echo web is not ready >&2; exit 1").replace("retries: 20", "retries: 2")
    compose.write_text(textwrap.dedent(text.replace("interval: 1s", "interval: 200ms")))
    name = "nsbox_compose_unhealthy"
    await NsboxSandboxEnvironment.task_init(name, str(compose))
    try:
        with pytest.raises(NsboxError, match=r"service web is unhealthy after .*exit status 1: web is not ready"):
            await NsboxSandboxEnvironment.sample_init(name, str(compose), {"__sample_id__": "1"})
        assert [i for i in live.entries() if name in i.label] == []
    finally:
        await NsboxSandboxEnvironment.task_cleanup(name, str(compose), cleanup=True)


async def test_a_service_restarted_by_its_policy(images: dict[str, str], tmp_path: Path) -> None:
    """restart: on-failure through the provider: web fails twice before it
    listens, and its sample comes up all the same; killed inside, it comes
    back. With restart: "no", the same service fails the sample."""
    web = ["sh", "-c", "n=$$(( $$(cat /tmp/n 2>/dev/null || echo 0) + 1 )); echo $$n > /tmp/n; "
                       "[ $$n -ge 3 ] || exit 1; mkdir -p /tmp/srv && echo FLAG-$$n > /tmp/srv/flag.txt "
                       "&& exec httpd -f -p 80 -h /tmp/srv"]
    fetch = FETCH_WEB.replace("cat <&3", "tail -n1 <&3")
    for policy in ("on-failure", '"no"'):
        compose = tmp_path / policy.strip('"') / "compose.yaml"
        compose.parent.mkdir()
        compose.write_text(textwrap.dedent(f"""\
            services:
              default:
                image: {images['debian']}
                command: tail -f /dev/null
              web:
                image: {images['busybox']}
                command: {json.dumps(web)}
                restart: {policy}
                healthcheck:
                  test: ["CMD-SHELL", "wget -q -O- http://127.0.0.1/flag.txt"]
                  interval: 200ms
                  retries: 50
            """))
        name = "nsbox_compose_restart"
        await NsboxSandboxEnvironment.task_init(name, str(compose))
        try:
            if policy == '"no"':
                with pytest.raises(NsboxError, match="service web exited with status 1 before it was healthy"):
                    await NsboxSandboxEnvironment.sample_init(name, str(compose), {"__sample_id__": "1"})
            else:
                envs = await NsboxSandboxEnvironment.sample_init(name, str(compose), {"__sample_id__": "1"})
                try:
                    r = await envs["default"].exec(["bash", "-c", fetch])
                    assert r.stdout == "FLAG-3\n", r
                    await envs["web"].exec(["sh", "-c", "kill $(pidof httpd)"])
                    with anyio.fail_after(20):
                        while "FLAG-4" not in (await envs["default"].exec(["bash", "-c", fetch])).stdout:
                            await anyio.sleep(0.1)
                finally:
                    await NsboxSandboxEnvironment.sample_cleanup(name, str(compose), envs, interrupted=False)
        finally:
            await NsboxSandboxEnvironment.task_cleanup(name, str(compose), cleanup=True)
        assert [i for i in live.entries() if name in i.label] == []


def test_an_included_stack_reached_by_name_from_a_sandbox_yaml(images: dict[str, str], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A suite's task file under a name Inspect does not know (sandbox.yaml)
    includes ../../shared/web/compose.yaml, whose web service serves a bind
    of its own directory on a port from its own .env; the default service
    reaches it by name."""
    monkeypatch.chdir(tmp_path)
    web = tmp_path / "suite/shared/web"
    (web / "www").mkdir(parents=True)
    (web / "www/flag.txt").write_text("FLAG-INCLUDED\n")
    (web / ".env").write_text("WEB_PORT=8000\n")
    (web / "compose.yaml").write_text(textwrap.dedent(f"""\
        services:
          web:
            image: {images['busybox']}
            command: ["httpd", "-f", "-p", "${{WEB_PORT}}", "-h", "/srv"]
            volumes: [./www:/srv:ro]
            healthcheck:
              test: ["CMD-SHELL", "wget -q -O- http://127.0.0.1:${{WEB_PORT}}/flag.txt"]
              interval: 1s
              retries: 30
        """))
    task_dir = tmp_path / "suite/tasks/t1"
    task_dir.mkdir(parents=True)
    (task_dir / "sandbox.yaml").write_text(textwrap.dedent(f"""\
        include:
          - ../../shared/web/compose.yaml
        services:
          default:
            image: {images['debian']}
            command: tail -f /dev/null
            depends_on:
              web:
                condition: service_healthy
        """))
    task = Task(dataset=[Sample(input="get it", target="")], solver=[use_tools([bash()]), generate()],
                scorer=output_has("FLAG-INCLUDED"), sandbox=("nsbox", str(task_dir / "sandbox.yaml")),
                name="nsbox_compose_include")
    fetch = "exec 3<>/dev/tcp/web/8000 && printf 'GET /flag.txt HTTP/1.0\\r\\n\\r\\n' >&3 && cat <&3"
    [sample] = _check(_run(task, [("bash", {"command": fetch})], tmp_path), 1)
    assert set(sample.scores["output_has"].metadata["ids"]) == {"default", "web"}
