"""nsbox.compose: compose files, Inspect's ComposeConfig and Dockerfiles read
into nsbox's model, the support policy, and the mapping onto SandboxSpec.
Pure unit tests: no sandbox is created."""

from __future__ import annotations

import ipaddress
import re
import textwrap
from pathlib import Path

import pytest

from nsbox.compose import (
    ComposeError,
    aliases,
    dockerfile_project,
    load_project,
    main_command,
    project_from_config,
    sample_network,
    service_spec,
    substitute,
)
from nsbox.compose import dotenv
from nsbox.compose.support import service_networks
from nsbox.plan import netmodes
from nsbox.errors import NsboxError
from nsbox.spec import Restart, Tmpfs

FIXTURES = Path(__file__).resolve().parents[2] / "compose_fixtures"
MiB = 1 << 20


def write(tmp_path: Path, text: str, name: str = "compose.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load(tmp_path: Path, text: str, environ: dict[str, str] | None = None):
    return load_project(write(tmp_path, text), environ=environ or {})


def one(tmp_path: Path, service_yaml: str, environ: dict[str, str] | None = None):
    """The only service of a compose file whose `services.s` is `service_yaml`."""
    body = textwrap.indent(textwrap.dedent(service_yaml), "    ")
    return load(tmp_path, "services:\n  s:\n" + body, environ).services["s"]


def cannot(tmp_path: Path, text: str) -> str:
    with pytest.raises(ComposeError) as e:
        load(tmp_path, text)
    return str(e.value)


# -- interpolation (cases from compose-go's template tests) ------------------

VARS = {"FOO": "first", "BAR": "", "JSON": '{"json":2}'}


@pytest.mark.parametrize("template, expected", [
    ("$${foo}", "${foo}"),
    ("foo", "foo"),
    ("a $ string", "a $ string"),
    ("^REGEX$", "^REGEX$"),
    ("$}", "$}"),
    ("$1 and $-", "$1 and $-"),
    ("$FOO-bar", "first-bar"),
    ("This ${missing} var", "This  var"),
    ("This ${BAR} var", "This  var"),
    ("This $FOO var", "This first var"),
    ("ok ${missing:-def}", "ok def"),
    ("ok ${missing-def}", "ok def"),
    ("ok ${BAR:-def}", "ok def"),
    ("ok ${FOO:-def}", "ok first"),
    ("ok ${BAR-def}", "ok "),
    ("ok ${UNSET:+presence}", "ok "),
    ("ok ${UNSET+presence}", "ok "),
    ("ok ${FOO:+presence}", "ok presence"),
    ("ok ${FOO+presence}", "ok presence"),
    ("ok ${BAR+presence}", "ok presence"),
    ("ok ${BAR:+presence}", "ok "),
    ("ok ${BAR:-/non:-alphanumeric}", "ok /non:-alphanumeric"),
    ("+ok ${UNSET:-${BAR-defaultValue}}", "+ok "),
    (":-ok ${UNSET-defaultValue}", ":-ok defaultValue"),
    ("ok ${UNSET-${FOO} ${FOO}}", "ok first first"),
    ("ok ${BAR:-$FOO}", "ok first"),
    ("ok ${BAR+$FOO ${FOO:+second}}", "ok first second"),
    ("ok ${FOO:?err}", "ok first"),
    ("ok ${BAR?err}", "ok "),
    ("${UNSET-myerror?msg}", "myerror?msg"),
    ('ok ${missing:-{"json":1}}', 'ok {"json":1}'),
    ('ok ${JSON-{"json":1}}', 'ok {"json":2}'),
    ("ok ${SUBDOMAIN:-redis}.${FOO:?}", "ok redis.first"),
    ("${A:-${B:-${FOO}}}/x", "first/x"),
    ("$$FOO costs $$5", "$FOO costs $5"),
    ("${foo_Bar9:-lower}", "lower"),
])
def test_interpolation_matches_compose(template, expected):
    assert substitute(template, VARS.get) == expected


@pytest.mark.parametrize("template", ["${", "${}", "${ }", "${ foo}", "${foo }", "${foo!}", "x ${1}"])
def test_invalid_template_is_an_error(template):
    with pytest.raises(ComposeError, match="invalid interpolation"):
        substitute(template, VARS.get)


@pytest.mark.parametrize("template, message", [
    ("not ok ${UNSET_VAR:?Mandatory Variable Unset}", "required variable UNSET_VAR is missing a value: Mandatory Variable Unset"),
    ("not ok ${BAR:?must not be empty}", "required variable BAR is missing a value: must not be empty"),
    ("not ok ${UNSET_VAR?}", "required variable UNSET_VAR is missing a value"),
    ("${UNSET_VAR:?needs ${FOO}}", "required variable UNSET_VAR is missing a value: needs first"),
])
def test_missing_required_variable_names_it(template, message):
    with pytest.raises(ComposeError) as e:
        substitute(template, VARS.get)
    assert message in str(e.value)
    assert "UNSET_VAR" in str(e.value) or "BAR" in str(e.value)


def test_unset_variables_are_reported_only_when_used():
    unset: list[str] = []
    assert substitute("${A:+${A},}B ${C:-${D}} $E", VARS.get, unset) == "B  "
    assert unset == ["D", "E"]


def test_unset_variable_becomes_a_warning(tmp_path):
    project = load(tmp_path, "services:\n  default:\n    image: alpine:${TAG}\n")
    assert project.services["default"].image == "alpine:"
    assert any('"TAG" variable is not set' in w for w in project.warnings)


def test_interpolation_reaches_every_string_but_not_keys(tmp_path):
    project = load(tmp_path, """
        services:
          default:
            image: ${IMG}
            command: ["echo", "${MSG}"]
            environment:
              ${KEY}: ${MSG}
            x-nsbox:
              timeout: ${T}
        """, {"IMG": "alpine", "MSG": "hi", "KEY": "k", "T": "30"})
    s = project.services["default"]
    assert (s.image, s.command, s.environment, s.x_nsbox) == ("alpine", ["echo", "hi"], {"${KEY}": "hi"}, {"timeout": "30"})


# -- .env and env_file --------------------------------------------------------

def test_process_environment_overrides_dot_env(tmp_path):
    (tmp_path / ".env").write_text("TAG=from-dotenv\nOTHER=dotenv-only\n")
    text = "services:\n  default:\n    image: img:${TAG}\n    environment: [\"X=${OTHER}\"]\n"
    assert load(tmp_path, text).services["default"].image == "img:from-dotenv"
    s = load(tmp_path, text, {"TAG": "from-env"}).services["default"]
    assert (s.image, s.environment) == ("img:from-env", {"X": "dotenv-only"})


def test_dotenv_format():
    text = textwrap.dedent("""\
        \ufeff# comment
        PLAIN=value # inline comment
        export EXPORTED=yes
        SINGLE='literal $PLAIN \\n'
        DOUBLE="line\\nnext \\"q\\" ${PLAIN}"
        DOLLAR="\\$PLAIN"
        EMPTY=
        YAML_STYLE: colon
        REF=${PLAIN}-x
        INHERITED
        MISSING_INHERITED
          SPACED   =   spaced value
        MULTI="a
        b"
        """)
    values = dotenv.parse(text, {"INHERITED": "from-env"}.get, ".env")
    assert values == {
        "PLAIN": "value", "EXPORTED": "yes", "SINGLE": "literal $PLAIN \\n",
        "DOUBLE": 'line\nnext "q" value', "DOLLAR": "$PLAIN", "EMPTY": "", "YAML_STYLE": "colon",
        "REF": "value-x", "INHERITED": "from-env", "SPACED": "spaced value", "MULTI": "a\nb",
    }


def test_dotenv_errors_name_the_file_and_line_never_its_text():
    # The file may be one a hostile compose file named: a key, a password.
    with pytest.raises(ComposeError, match="x.env, line 2: unterminated quoted value$"):
        dotenv.parse('OK=1\nA="s3cret-open\n', {}.get, "x.env")
    with pytest.raises(ComposeError, match="x.env, line 1: unexpected character '!'") as e:
        dotenv.parse("A!s3cret=1\n", {}.get, "x.env")
    assert "s3cret" not in str(e.value)
    with pytest.raises(ComposeError, match="x.env, line 3: key cannot contain a space$"):
        dotenv.parse("# c\n\nMY s3cret=1\n", {}.get, "x.env")


def test_env_file_forms_and_precedence(tmp_path):
    (tmp_path / "a.env").write_text("A=1\nB=file\nC=${FROM_ENV}\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.env").write_text("D=4\n")
    s = one(tmp_path, """
        image: alpine
        env_file:
          - a.env
          - path: ./sub/b.env
          - path: missing.env
            required: false
        environment:
          B: own
          C:
        """, {"FROM_ENV": "3"})
    # environment wins over env_file; a bare key keeps the environment's value
    assert s.environment == {"A": "1", "B": "own", "C": "3", "D": "4"}
    assert one(tmp_path, "image: alpine\nenv_file: a.env\n", {"FROM_ENV": "x"}).environment["C"] == "x"


def test_missing_required_env_file_is_an_error(tmp_path):
    with pytest.raises(ComposeError, match=r"service s: env_file .*nope.env not found"):
        one(tmp_path, "image: alpine\nenv_file: [nope.env]\n")


# -- every key into the model -------------------------------------------------

def test_service_keys_into_the_model(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    monkeypatch.setenv("NSBOX_COMPOSE_PATHS", str(Path.home()))  # for ~/dotfiles
    project = load(tmp_path, """
        services:
          app:
            image: python:3.12
            build:
              context: ./src
              dockerfile: docker/Dockerfile.dev
              args: [VERSION=1.2, FROM_ENV]
              target: dev
              cache_from: [python:3.12]
            command: python -c 'print("a b")'
            entrypoint: ["/bin/entry", "--flag"]
            working_dir: /app
            environment: [A=1, B=, FROM_ENV, NOT_SET]
            user: "1000"
            hostname: app-host
            container_name: app_1
            init: "true"
            read_only: false
            privileged: false
            platform: linux/arm64
            pull_policy: always
            mem_limit: 512m
            cpus: 0.5
            pids_limit: 100
            storage_opt: {size: 2g}
            cap_add: [cap_net_raw, CHOWN]
            networks:
              front:
                aliases: [api, api.local]
              back:
            links: ["db:database"]
            ports: ["3000", "8080:80", "127.0.0.1:9000:9000", "::1:7000:7000", "5000-5001:6000-6001",
                    {target: 4000, published: "4001", host_ip: 0.0.0.0}]
            volumes:
              - ./data:/data:ro
              - cache:/cache
              - /anonymous
              - type: bind
                source: ~/dotfiles
                target: /home/dot
                bind: {create_host_path: true}
              - type: volume
                source: cache
                target: /sub
                volume: {subpath: part}
              - type: tmpfs
                target: /scratch
                tmpfs: {size: 64m, mode: "1777"}
            tmpfs: ["/run:size=10m,mode=755", /tmp2]
            x-local: true
            x-nsbox: {nested_userns: true}
            restart: always
            labels: {a: b}
          db:
            image: postgres
            networks: [back]
        networks:
          front: {}
          back: {}
        volumes:
          cache:
        """, {"FROM_ENV": "env", "HOME": "/home/me"})
    s = project.services["app"]
    assert s.image == "python:3.12"
    assert s.build.context == tmp_path / "src"
    assert s.build.dockerfile == tmp_path / "src" / "docker" / "Dockerfile.dev"
    assert s.build.args == {"VERSION": "1.2", "FROM_ENV": "env"}
    assert (s.build.target, s.build.network) == ("dev", None)
    assert "service app: build.cache_from: nsbox's builder keeps its own cache" in project.warnings
    assert s.command == ["python", "-c", 'print("a b")']
    assert s.entrypoint == ["/bin/entry", "--flag"]
    assert s.working_dir == "/app"
    assert s.environment == {"A": "1", "B": "", "FROM_ENV": "env"}  # NOT_SET dropped, as compose does
    assert (s.user, s.hostname, s.container_name, s.init) == ("1000", "app-host", "app_1", True)
    assert (s.read_only, s.privileged, s.platform, s.pull_policy) == (False, False, "linux/arm64", "always")
    assert (s.memory, s.cpus, s.pids_limit, s.disk) == (512 * MiB, 0.5, 100, 2 << 30)
    assert s.cap_add == ["NET_RAW", "CHOWN"]
    assert s.networks == {"front": ["api", "api.local"], "back": []}
    assert s.links == {"database": "db"}
    assert s.ports == ["0:3000", "8080:80", "127.0.0.1:9000:9000", "[::1]:7000:7000",
                       "5000:6000", "5001:6001", "0.0.0.0:4001:4000"]
    binds = [(m.type, m.source, m.target, m.read_only, m.create_host_path) for m in s.volumes]
    assert binds[:4] == [
        ("bind", str(tmp_path / "data"), "/data", True, True),
        ("volume", "cache", "/cache", False, False),
        ("volume", None, "/anonymous", False, False),
        ("bind", str(Path.home() / "dotfiles"), "/home/dot", False, True),
    ]
    assert (s.volumes[4].source, s.volumes[4].subpath) == ("cache", "part")
    assert (s.volumes[5].type, s.volumes[5].size, s.volumes[5].mode) == ("tmpfs", 64 * MiB, 0o1777)
    assert [(m.target, m.size, m.mode) for m in s.tmpfs] == [("/run", 10 * MiB, 0o755), ("/tmp2", None, None)]
    assert (s.x_local, s.x_nsbox, s.x_default) == (True, {"nested_userns": True}, False)
    assert s.ignored == ["labels"]
    assert s.restart == Restart()  # always
    assert not any("restart" in w for w in project.warnings), project.warnings
    assert project.services["db"].networks == {"back": []}
    assert set(project.volumes) == {"cache"} and not project.volumes["cache"].external


def test_environment_mapping_form_and_scalars(tmp_path):
    s = one(tmp_path, """
        image: alpine
        environment:
          FLAG: no
          TRUE_: true
          N: 1.50
          EMPTY: ""
          INHERIT:
          GONE:
        """, {"INHERIT": "yes"})
    # YAML 1.2 as compose reads it: `no` stays a string; true is "true"
    assert s.environment == {"FLAG": "no", "TRUE_": "true", "N": "1.5", "EMPTY": "", "INHERIT": "yes"}


@pytest.mark.parametrize("port, expected", [
    ("127.0.0.1::5432", ["127.0.0.1:0:5432"]),
    ("[::1]:8080:80", ["[::1]:8080:80"]),
    ("9000-9001", ["0:9000", "0:9001"]),
    ("80/tcp", ["0:80"]),
])
def test_port_forms(tmp_path, port, expected):
    assert one(tmp_path, f"image: alpine\nports: ['{port}']\n").ports == expected


def test_yaml_port_is_not_a_base_60_number(tmp_path):
    assert one(tmp_path, "image: alpine\nports:\n  - 22:22\n").ports == ["22:22"]


def test_default_network_unless_network_mode(tmp_path):
    assert one(tmp_path, "image: alpine\n").networks == {"default": []}
    s = one(tmp_path, "image: alpine\nnetwork_mode: none\n")
    assert (s.networks, s.network_mode) == ({}, "none")


@pytest.mark.parametrize("value, expected", [
    ("tail -f /dev/null", ["tail", "-f", "/dev/null"]),
    ("sh -c 'echo \"hi there\"'", ["sh", "-c", 'echo "hi there"']),
    ('""', []),
    ("[]", []),
    ("[sleep, 1]", ["sleep", "1"]),
])
def test_command_forms(tmp_path, value, expected):
    s = one(tmp_path, f"image: alpine\ncommand: {value}\nentrypoint: {value}\n")
    assert s.command == expected and s.entrypoint == expected


@pytest.mark.parametrize("limits, memory, cpus, pids", [
    ("mem_limit: 0.5gb\ncpus: '0.5'", 512 * MiB, 0.5, None),
    ("mem_limit: 512m\ncpus: 2", 512 * MiB, 2.0, None),
    ("mem_limit: 1073741824\npids_limit: -1", 1 << 30, None, None),
    ("deploy:\n  resources:\n    limits: {memory: 1.5GiB, cpus: '0.25', pids: 64}", 1536 * MiB, 0.25, 64),
    ("mem_limit: 1g\ndeploy:\n  resources:\n    limits: {memory: 1024m}", 1 << 30, None, None),
])
def test_limits(tmp_path, limits, memory, cpus, pids):
    s = one(tmp_path, "image: alpine\n" + limits + "\n")
    assert (s.memory, s.cpus, s.pids_limit) == (memory, cpus, pids)


def test_conflicting_limits_are_an_error(tmp_path):
    with pytest.raises(ComposeError, match="service s: mem_limit: '1g' differs from deploy.resources.limits.memory"):
        one(tmp_path, "image: alpine\nmem_limit: 1g\ndeploy: {resources: {limits: {memory: 2g}}}\n")


def test_bad_memory_names_the_key(tmp_path):
    with pytest.raises(ComposeError, match="service s: mem_limit: .*512 megs"):
        one(tmp_path, "image: alpine\nmem_limit: 512 megs\n")


# -- healthcheck and depends_on -----------------------------------------------

def test_healthcheck_forms_and_durations(tmp_path):
    s = one(tmp_path, """
        image: alpine
        healthcheck:
          test: ["CMD", "curl", "-f", "http://localhost"]
          interval: 1m30s
          timeout: 500ms
          retries: 5
          start_period: 1h2m3.5s
          start_interval: 0
        """)
    hc = s.healthcheck
    assert (hc.test, hc.interval, hc.timeout, hc.retries, hc.start_period, hc.start_interval) == (
        ["CMD", "curl", "-f", "http://localhost"], 90.0, 0.5, 5, 3723.5, None)  # 0: unset, as Docker reads it
    assert not hc.disable
    shell = one(tmp_path, "image: alpine\nhealthcheck:\n  test: pg_isready\n").healthcheck
    # Unset: the image's HEALTHCHECK fills them in, else Docker's defaults (services.Healthcheck.merged).
    assert (shell.test, shell.interval, shell.timeout, shell.retries) == (["CMD-SHELL", "pg_isready"], None, None, None)
    assert one(tmp_path, "image: alpine\nhealthcheck: {disable: true}\n").healthcheck.disable
    assert one(tmp_path, "image: alpine\nhealthcheck: {test: [NONE]}\n").healthcheck.disable
    assert one(tmp_path, "image: alpine\nhealthcheck: {interval: 2s}\n").healthcheck.test is None  # the image's


@pytest.mark.parametrize("bad, message", [
    ("test: [CMD]", "CMD needs a command"),
    ("test: [CMD-SHELL, '']", "CMD-SHELL needs a command"),
    ("interval: 30", "expected a duration such as 30s"),
    ("interval: 5 s", "expected a duration"),
    ("timeout: -1s", "must not be negative"),
    ("test: [curl, x]", "must start with CMD, CMD-SHELL or NONE"),
    ("retries: 1.5", "expected a whole number"),
])
def test_bad_healthcheck_is_a_clear_error(tmp_path, bad, message):
    with pytest.raises(ComposeError, match=f"service s: healthcheck.*{message}"):
        one(tmp_path, f"image: alpine\nhealthcheck:\n  {bad}\n")


def test_depends_on_forms(tmp_path):
    project = load(tmp_path, """
        services:
          a:
            image: alpine
            depends_on: [b]
          b:
            image: alpine
            depends_on:
              c: {condition: service_healthy, required: false, restart: true}
              d:
                condition: service_completed_successfully
              e: {}
          c: {image: alpine}
          d: {image: alpine}
          e: {image: alpine}
        """)
    assert project.services["a"].depends_on == {"b": "service_started"}
    assert project.services["b"].depends_on == {
        "c": "service_healthy", "d": "service_completed_successfully", "e": "service_started"}


def test_depends_on_errors(tmp_path):
    with pytest.raises(ComposeError, match="service a depends on undefined service nope"):
        load(tmp_path, "services:\n  a:\n    image: x\n    depends_on: [nope]\n")
    with pytest.raises(ComposeError, match="expected one of service_started"):
        load(tmp_path, "services:\n  a:\n    image: x\n    depends_on: {a: {condition: up}}\n")
    # Not required: Compose warns and goes on without it (nsbox had refused the file).
    project = load(tmp_path, "services:\n  a:\n    image: x\n    depends_on: {b: {}, nope: {required: false}}\n"
                             "  b: {image: x}\n")
    assert project.services["a"].depends_on == {"b": "service_started"}
    assert "service a: depends_on nope (required: false) names no service: left out" in project.warnings
    with pytest.raises(ComposeError, match="service a depends on undefined service nope"):
        load(tmp_path, "services:\n  a:\n    image: x\n    depends_on: {nope: {required: true}}\n")


# -- default service and ordering ----------------------------------------------

def test_x_default_second_service_comes_first(tmp_path):
    project = load(tmp_path, """
        services:
          victim: {image: a}
          attacker: {image: b, x-default: true}
          other: {image: c}
        """)
    assert list(project.services) == ["attacker", "victim", "other"]
    assert project.default_service.name == "attacker"


def test_default_service_by_name_else_first(tmp_path):
    project = load(tmp_path, "services:\n  a: {image: a}\n  default: {image: b}\n")
    assert list(project.services) == ["default", "a"]
    assert load(tmp_path, "services:\n  a: {image: a}\n  b: {image: b}\n").default_service.name == "a"


def test_two_x_defaults_are_an_error(tmp_path):
    with pytest.raises(ComposeError, match=r"x-default: true is on more than one service \(a, b\)"):
        load(tmp_path, "services:\n  a: {image: a, x-default: true}\n  b: {image: b, x-default: true}\n")


def test_profiles(tmp_path):
    text = "services:\n  default: {image: a}\n  debug: {image: b, profiles: [debug]}\n"
    assert list(load(tmp_path, text).services) == ["default"]
    assert list(load(tmp_path, text, {"COMPOSE_PROFILES": "debug"}).services) == ["default", "debug"]


def test_project_name(tmp_path):
    assert load(tmp_path, "name: My_Eval!\nservices:\n  a: {image: a}\n").name == "my_eval"
    assert load(tmp_path, "services:\n  a: {image: a}\n", {"COMPOSE_PROJECT_NAME": "x1"}).name == "x1"


# -- what nsbox cannot honour, and what it honours approximately ---------------

def test_cannot_honour_lists_every_key_with_its_service(tmp_path):
    message = cannot(tmp_path, """
        services:
          web:
            image: nginx
            devices: [/dev/kvm]
            pid: host
          db:
            image: postgres
            privileged: true
            cap_add: [SYS_MODULE, SYS_TIME, NET_RAW]
            sysctls: {net.core.somaxconn: 1024}
        """)
    assert message.startswith(str(tmp_path / "compose.yaml") + ": service web: nsbox cannot honour: devices (host "
                              "devices other than GPUs are not passed through; GPUs: use gpus), pid: host; ")
    db = message.split("; service db: nsbox cannot honour: ")[1]
    assert db.startswith("sysctls, cap_add: SYS_MODULE, SYS_TIME (needs privilege")
    assert "privileged" not in message  # honoured, as rootless podman does (tests/test_privileged.py)
    assert "NET_RAW" not in message
    assert message.endswith('(see README "Compose support")')


@pytest.mark.parametrize("service_yaml, named", [
    ("extends: {service: base}", "extends"),
    ("runtime: kata", "runtime: kata"),
    ("ipc: host", "ipc: host"),
    ("network_mode: container:abc", "network_mode: container:abc"),
    ("security_opt: ['seccomp=./profile.json']", "security_opt: seccomp=./profile.json"),
    ("scale: 3", "scale: 3"),
    ("deploy: {replicas: 2}", "deploy.replicas: 2"),
    ("deploy: {resources: {reservations: {devices: [{capabilities: [tpu]}]}}}",
     "deploy.resources.reservations.devices: capabilities ['tpu'] (only NVIDIA GPUs are passed through)"),
    ("ports: ['53:53/udp']", "ports: 53:53/udp"),
    ("networks: {n: {ipv4_address: 10.0.0.5}}", "networks.n.ipv4_address"),
    ("cap_add: [ALL]", "cap_add: ALL"),
    ("volumes: [{type: npipe, source: x, target: /x}]", "volumes of type npipe"),
    ("frobnicate: 1", "unknown key frobnicate"),
    ("x-nsbox: {rootfs: /x}", "x-nsbox: unknown setting rootfs"),
    ("build: {context: 'https://github.com/x/y.git'}", "build.context from a URL"),
])
def test_each_unhonourable_key_is_named(tmp_path, service_yaml, named):
    text = "services:\n  s:\n    image: alpine\n" + textwrap.indent(service_yaml, "    ") + "\nnetworks: {n: {}}\n"
    message = cannot(tmp_path, text)
    assert f"service s: nsbox cannot honour: {named}" in message


@pytest.mark.parametrize("top_level, named", [
    ("models: {m: {model: x}}", "top level: nsbox cannot honour: models"),
    ("secrets: {k: {environment: KEY}}", "secrets.k: environment (only file: sources)"),
    ("configs: {c: {content: hi}}", "configs.c: content"),
    ("volumes: {v: {driver: nfs}}", "volumes.v.driver: nfs"),
    ("networks: {n: {driver: macvlan}}", "networks.n.driver: macvlan"),
    ("whatever: 1", "unknown key whatever"),
])
def test_top_level_issues(tmp_path, top_level, named):
    assert named in cannot(tmp_path, "services:\n  s: {image: a}\n" + top_level + "\n")


def test_compose_error_is_an_nsbox_error_with_issues(tmp_path):
    with pytest.raises(NsboxError) as e:
        load(tmp_path, "services:\n  s: {image: a, pid: host, tty: true}\n")
    assert e.value.issues == ["service s: pid: host"]


def test_harmless_keys_are_accepted_and_listed(tmp_path):
    s = one(tmp_path, """
        image: alpine
        restart: "no"
        stop_grace_period: 1m
        stop_signal: SIGINT
        container_name: box
        labels: [a=b]
        expose: [80]
        logging: {driver: none}
        tty: true
        stdin_open: true
        mem_reservation: 1g
        security_opt: [apparmor=unconfined, "label:disable"]
        deploy: {restart_policy: {condition: any}, resources: {reservations: {memory: 1g}}}
        """)
    assert s.ignored == ["stop_grace_period", "stop_signal", "labels", "expose", "logging", "tty",
                         "stdin_open", "mem_reservation", "security_opt apparmor=unconfined",
                         "security_opt label:disable"]


def test_env_file_in_the_raw_format_is_taken_as_written(tmp_path):
    """compose's `format: raw` (docker run --env-file's): no quotes, no
    interpolation; a bare name takes the environment's value. It had been
    read as a dotenv file, quotes and $ processed."""
    (tmp_path / "raw.env").write_text("# a comment\nJSON='{\"key\": \"value\"}'\nPRICE=$5\n  SPACED=a b \nHOME\n\n")
    s = one(tmp_path, "image: a\nenv_file: [{path: ./raw.env, format: raw}]\n", {"HOME": "/home/me"})
    assert s.environment == {"JSON": "'{\"key\": \"value\"}'", "PRICE": "$5", "SPACED": "a b ", "HOME": "/home/me"}
    assert "format 'yaml' is not one compose knows" in cannot(
        tmp_path, "services:\n  s: {image: a, env_file: [{path: ./raw.env, format: yaml}]}\n")
    (tmp_path / "bad.env").write_text("A B=1\n")
    assert "bad.env, line 1: a variable name cannot" in cannot(
        tmp_path, "services:\n  s: {image: a, env_file: [{path: ./bad.env, format: raw}]}\n")


def test_short_volume_options(tmp_path):
    """nocopy keeps a volume unseeded, SELinux and consistency options have
    nothing to do here, a propagation other than private is a warning, and
    an option compose does not know is an error."""
    (tmp_path / "d").mkdir()
    project = load(tmp_path, "services:\n  s:\n    image: a\n    volumes: [\"v:/v:nocopy,ro\", \"./d:/x:z\", "
                             "\"./d:/y:rshared\", {type: bind, source: ./d, target: /w, bind: {propagation: slave}}]\n"
                             "volumes: {v: {}}\n")
    s = project.services["s"]
    assert [(m.target, m.read_only, m.nocopy, m.dropped) for m in s.volumes] == [
        ("/v", True, True, ()), ("/x", False, False, ()), ("/y", False, False, ("rshared",)),
        ("/w", False, False, ("propagation=slave",))]
    assert [w for w in project.warnings if "is not applied (nsbox's binds are private" in w] == [
        "service s: volume at /y: rshared is not applied (nsbox's binds are private: mounts made under one stay "
        "in their sandbox)",
        "service s: volume at /w: propagation=slave is not applied (nsbox's binds are private: mounts made under "
        "one stay in their sandbox)"]
    assert "unknown option 'rx' in './d:/x:rx'" in cannot(tmp_path, "services:\n  s: {image: a, volumes: ['./d:/x:rx']}\n")


@pytest.mark.parametrize("service_yaml, policy", [
    ("restart: always", Restart()),
    ("restart: unless-stopped", Restart()),
    ("restart: on-failure", Restart(on_failure=True)),
    ("restart: on-failure:3", Restart(on_failure=True, limit=3)),
    ("restart: on-failure:0", Restart(on_failure=True)),  # Docker: 0 is no limit
    ('restart: "no"', None),
    ("restart: no", None),  # YAML's false
    ("deploy: {restart_policy: {}}", Restart()),  # condition any
    ("deploy: {restart_policy: {condition: on-failure, max_attempts: 2, delay: 5s}}", Restart(True, 2)),
    ("deploy: {restart_policy: {condition: none}}", None),
    ("restart: on-failure:1\ndeploy: {restart_policy: {condition: any}}", Restart(True, 1)),  # restart wins
])
def test_restart_policies(tmp_path, service_yaml, policy):
    assert one(tmp_path, "image: alpine\n" + service_yaml).restart == policy


@pytest.mark.parametrize("service_yaml, error", [
    ("restart: sometimes", "restart: restart policy must be no, always, unless-stopped, on-failure or on-failure:N"),
    ("restart: on-failure:-1", "restart policy must be"),
    ("restart: always:2", "restart policy must be"),
    ("deploy: {restart_policy: {condition: never}}", "condition: expected none, on-failure or any"),
    ("deploy: {restart_policy: {max_attempts: two}}", "max_attempts: expected a whole number"),
    ("deploy: {restart_policy: always}", "deploy.restart_policy: 'always' is not a mapping"),
])
def test_bad_restart_policies_are_named(tmp_path, service_yaml, error):
    assert error in cannot(tmp_path, "services:\n  s:\n    image: alpine\n    " + service_yaml + "\n")


@pytest.mark.parametrize("service_yaml, warning", [
    ("cap_drop: [ALL]", "cap_drop is not enforced"),
    ("cap_add: [NET_ADMIN]", "cap_add NET_ADMIN: not granted: the service's network namespace is nsbox's"),
    ("cap_add: [NET_RAW]", "cap_add NET_RAW: raw sockets are not granted"),
    ("cap_add: [SYS_ADMIN]", "granted as nested_userns"),
    ("security_opt: [no-new-privileges:true]", "no-new-privileges is not set"),
    ("security_opt: [seccomp:unconfined]", "nsbox keeps its own seccomp deny-list"),
    ("ulimits: {nofile: 65535}", "ulimits are not applied"),
    ("shm_size: 1g", "/dev/shm keeps nsbox's size"),
    ("ports: ['8080:80']", "published on 127.0.0.1 unless an address is given"),
])
def test_approximations_are_warnings(tmp_path, service_yaml, warning):
    project = load(tmp_path, "services:\n  s:\n    image: alpine\n" + textwrap.indent(service_yaml, "    ") + "\n")
    assert any(warning in w for w in project.warnings), project.warnings


def test_undefined_references(tmp_path):
    with pytest.raises(ComposeError, match="refers to undefined volume data"):
        one(tmp_path, "image: a\nvolumes: ['data:/data']\n")
    with pytest.raises(ComposeError, match="refers to undefined network back"):
        one(tmp_path, "image: a\nnetworks: [back]\n")
    with pytest.raises(ComposeError, match="'k' is not defined in the top-level secrets"):
        one(tmp_path, "image: a\nsecrets: [k]\n")


def test_secrets_and_configs_are_read_only_binds(tmp_path):
    (tmp_path / "key.txt").write_text("k")
    project = load(tmp_path, """
        services:
          s:
            image: a
            secrets: [key, {source: key, target: custom}]
            configs: [{source: conf, target: /etc/app.conf}, conf]
        secrets: {key: {file: ./key.txt}}
        configs: {conf: {file: key.txt}}
        """)
    mounts = [(m.type, m.source, m.target, m.read_only) for m in project.services["s"].volumes]
    key = str(tmp_path / "key.txt")
    assert mounts == [("bind", key, "/run/secrets/key", True), ("bind", key, "/run/secrets/custom", True),
                      ("bind", key, "/etc/app.conf", True), ("bind", key, "/conf", True)]


def test_port_clash_between_services_only_in_one_namespace(tmp_path):
    both = "services:\n  a: {image: a, ports: ['8080:80']}\n  b: {image: b, ports: ['8081:80']}\n"
    assert sample_network(load(tmp_path, both)) == "services"  # each its own namespace, as in Docker
    assert "port 80 in both a and b" in cannot(tmp_path, both + "  c: {image: c, network_mode: 'service:a'}\n")


# -- network shape ---------------------------------------------------------------

def test_network_none_everywhere(tmp_path):
    project = load(tmp_path, "services:\n  a: {image: a, network_mode: none}\n  b: {image: b, network_mode: none}\n")
    assert sample_network(project) == "none"


def test_default_network_is_nat(tmp_path):
    project = load(tmp_path, "services:\n  a: {image: a}\n  b: {image: b, network_mode: 'service:a'}\n")
    assert sample_network(project) == "nat"
    assert sample_network(load(tmp_path, "services:\n  a: {image: a, network_mode: bridge}\n")) == "nat"


def test_host_network_only_for_all(tmp_path, monkeypatch):
    monkeypatch.setenv("NSBOX_COMPOSE_HOST_NETWORK", "1")
    assert sample_network(load(tmp_path, "services:\n  a: {image: a, network_mode: host}\n")) == "host"
    mixed = "services:\n  a: {image: a, network_mode: host}\n  b: {image: b}\n"
    assert sample_network(load(tmp_path, mixed)) == "services"
    assert "network_mode: host on a but not on b, c" in cannot(
        tmp_path, mixed + "  c: {image: c, network_mode: 'service:b'}\n")


def test_the_host_network_is_the_operators_to_grant(tmp_path, monkeypatch):
    """A compose file is an eval suite's: network_mode: host would reach
    every service on the host's loopback. Refused unless the operator says so."""
    monkeypatch.delenv("NSBOX_COMPOSE_HOST_NETWORK", raising=False)
    error = cannot(tmp_path, "services:\n  a: {image: a, network_mode: host}\n")
    assert "network_mode: host (the host's network" in error and "NSBOX_COMPOSE_HOST_NETWORK=1" in error
    monkeypatch.setenv("NSBOX_COMPOSE_HOST_NETWORK", "1")
    assert sample_network(load(tmp_path, "services:\n  a: {image: a, network_mode: host}\n")) == "host"


def test_internal_network_makes_the_sample_internal(tmp_path):
    project = load(tmp_path, """
        services:
          target: {image: a, networks: [lab]}
          attacker: {image: b, networks: [lab, outside]}
          helper: {image: c, network_mode: "service:target"}
        networks:
          lab: {internal: true}
          outside: {}
        """)
    assert sample_network(project) == "none"  # one namespace (service:target): the pod mode
    assert any("service attacker: network outside is not internal, but lab is" in w for w in project.warnings)


def test_services_that_share_no_network_are_an_error(tmp_path):
    message = cannot(tmp_path, """
        services:
          a: {image: a, networks: [net_a]}
          b: {image: b, networks: [net_b]}
          c: {image: c, networks: [net_a]}
          d: {image: d, network_mode: "service:a"}
        networks: {net_a: {}, net_b: {}}
        """)
    assert "services that share no network (a, c, d; b)" in message and "so all services share one" in message


def test_none_beside_networked_services_is_an_error(tmp_path):
    mixed = "services:\n  a: {image: a, network_mode: none}\n  b: {image: b}\n"
    assert sample_network(load(tmp_path, mixed)) == "services"
    assert "network_mode: none on a but b, c have networks" in cannot(
        tmp_path, mixed + "  c: {image: c, network_mode: 'service:b'}\n")


def test_which_samples_keep_the_pod_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("NSBOX_COMPOSE_HOST_NETWORK", "1")
    pod = {
        "services:\n  a: {image: a}\n": "nat",  # a single service
        "services:\n  a: {image: a, network_mode: none}\n  b: {image: b, network_mode: none}\n": "none",
        "services:\n  a: {image: a, network_mode: host}\n  b: {image: b, network_mode: host}\n": "host",
        "services:\n  a: {image: a}\n  b: {image: b, network_mode: 'service:a'}\n": "nat",
    }
    for text, mode in pod.items():
        assert sample_network(load(tmp_path, text)) == mode, text
    project = load(tmp_path, """\
services:
  a: {image: a, ports: ["8080:80"], networks: {lab: {aliases: [x]}, out: null}}
  b: {image: b, ports: ["8081:80"], networks: [lab], links: ["a:web"]}
  c: {image: c, network_mode: none}
  d: {image: d, network_mode: host}
networks:
  lab: {internal: true}
  out: {}
""")
    assert sample_network(project) == "services"  # once refused: a port twice, none and host with networks
    assert service_networks(project) == {"a": {"out": ["a", "web"], "lab": ["a", "web", "x"]},  # outbound first
                                         "b": {"lab": ["b"]}, "c": {}, "d": {}}


def test_aliases(tmp_path):
    project = load(tmp_path, """
        services:
          web:
            image: a
            container_name: web-1
            networks: {n: {aliases: [www, web]}}
          client: {image: b, links: ["web:site"], networks: [n]}
        networks: {n: {}}
        """)
    assert aliases(project) == {"web": ["web", "web-1", "www", "site"], "client": ["client"]}


# -- command and entrypoint ------------------------------------------------------

IMAGE = {"Entrypoint": ["/docker-entrypoint.sh"], "Cmd": ["nginx", "-g", "daemon off;"]}


@pytest.mark.parametrize("service_yaml, image, expected", [
    ("", IMAGE, ["/docker-entrypoint.sh", "nginx", "-g", "daemon off;"]),
    ("command: tail -f /dev/null", IMAGE, ["/docker-entrypoint.sh", "tail", "-f", "/dev/null"]),
    ("entrypoint: [sh, -c]", IMAGE, ["sh", "-c"]),  # the image's Cmd is dropped
    ("entrypoint: [sh, -c]\ncommand: [echo hi]", IMAGE, ["sh", "-c", "echo hi"]),
    ("entrypoint: []", IMAGE, ["nginx", "-g", "daemon off;"]),
    ("entrypoint: ''\ncommand: [sleep, '1']", IMAGE, ["sleep", "1"]),
    ("command: []", IMAGE, ["/docker-entrypoint.sh", "nginx", "-g", "daemon off;"]),
    ("", {"Cmd": ["bash"]}, ["bash"]),
    ("command: [python3]", {"Cmd": ["bash"]}, ["python3"]),
    ("", {}, None),
    ("entrypoint: []", {"Entrypoint": ["/e"]}, None),
])
def test_main_command(tmp_path, service_yaml, image, expected):
    assert main_command(one(tmp_path, "image: a\n" + service_yaml + "\n"), image) == expected


def test_main_command_takes_an_image_config(tmp_path):
    from nsbox.storage.config import ImageConfig

    s = one(tmp_path, "image: a\ncommand: [x]\n")
    assert main_command(s, ImageConfig(entrypoint=["/e"], cmd=["c"])) == ["/e", "x"]


# -- mapping onto SandboxSpec ----------------------------------------------------

def test_service_spec(tmp_path):
    (tmp_path / "src").mkdir()
    project = load(tmp_path, """
        services:
          app:
            image: ignored-here
            platform: linux/amd64
            user: "1000:1000"
            working_dir: /work
            environment: {A: "1"}
            hostname: app
            mem_limit: 256m
            cpus: 1.5
            pids_limit: 64
            ports: ["8080:80"]
            cap_add: [SYS_ADMIN]
            volumes:
              - ./src:/src:ro
              - ./made-by-docker:/made
              - shared:/shared
              - /anon
              - {type: volume, source: shared, target: /part, volume: {subpath: p}}
            tmpfs: [/scratch, "/run:size=10m,mode=755,exec,uid=999,nr_inodes=5"]
            x-nsbox: {timeout: 30, disk: 1g}
        volumes: {shared: {}}
        """)
    spec = service_spec(project.services["app"], project, image="registry/app:1", network="nat",
                        volume_root=tmp_path / "vols", origin="inspect")
    assert (spec.image, spec.pull, spec.platform, spec.user, spec.workdir) == (
        "registry/app:1", "missing", "linux/amd64", "1000:1000", "/work")
    assert (spec.env, spec.network, spec.ports, spec.hostname) == ({"A": "1"}, "nat", ("127.0.0.1:8080:80",), "app")
    assert (spec.memory, spec.cpus, spec.pids_limit, spec.disk, spec.timeout) == (256 * MiB, 1.5, 64, 1 << 30, 30)
    assert spec.nested_userns and spec.origin == "inspect" and spec.label == f"{project.name}/app"
    assert [(b.source, b.target, b.readonly) for b in spec.mounts] == [
        (str(tmp_path / "src"), "/src", True),
        (str(tmp_path / "made-by-docker"), "/made", False),
        (str(tmp_path / "vols" / "named" / "shared"), "/shared", False),
        (str(tmp_path / "vols" / "anonymous" / "app" / "3"), "/anon", False),
        (str(tmp_path / "vols" / "named" / "shared" / "p"), "/part", False),
    ]
    assert (tmp_path / "made-by-docker").is_dir()  # short syntax creates a missing source, as Docker does
    # tmpfs mounts, noexec unless `exec` (Docker's default); what nsbox does not apply is a warning.
    assert spec.tmpfs == (Tmpfs("/scratch"), Tmpfs("/run", size=10 * MiB, mode=0o755, noexec=False))
    assert not spec.read_only and service_spec(load(tmp_path, "services:\n  s: {image: a, read_only: true}\n")
                                               .services["s"], project, image="a", network="none").read_only
    assert "service app: tmpfs /run: options uid=999,nr_inodes=5 are not applied" in "\n".join(project.warnings)
    long = load(tmp_path, "services:\n  s:\n    image: a\n    volumes:\n"
                          "      - {type: tmpfs, target: /t, read_only: true, tmpfs: {size: 1m, mode: '700'}}\n")
    assert service_spec(long.services["s"], long, image="a", network="none").tmpfs == (
        Tmpfs("/t", size=MiB, mode=0o700, readonly=True),)


def test_service_spec_pull_and_host_network(tmp_path, monkeypatch):
    monkeypatch.setenv("NSBOX_COMPOSE_HOST_NETWORK", "1")
    s = one(tmp_path, "image: a\nx-local: true\nnetwork_mode: host\nports: ['80:80']\n")
    project = load(tmp_path, "services:\n  s: {image: a, x-local: true, network_mode: host, ports: ['80:80']}\n")
    spec = service_spec(project.services["s"], project, image="a", network="host")
    assert (spec.pull, spec.ports, spec.network) == ("never", (), "host")
    assert s.x_local


def test_service_spec_errors_name_the_service(tmp_path):
    project = load(tmp_path, """
        services:
          s:
            image: a
            hostname: bad_host!
            volumes: [{type: bind, source: ./missing, target: /m}]
        """)
    with pytest.raises(ComposeError, match=r"service s: bind source .*missing does not exist"):
        service_spec(project.services["s"], project, image="a", network="none")
    project.services["s"].volumes = []
    with pytest.raises(ComposeError, match="service s: hostname must be"):
        service_spec(project.services["s"], project, image="a", network="none")
    named = load(tmp_path, "services:\n  s: {image: a, volumes: ['v:/v']}\nvolumes: {v: {}}\n")
    with pytest.raises(ComposeError, match="needs a volume directory"):
        service_spec(named.services["s"], named, image="a", network="none")


# -- Dockerfiles, Inspect's ComposeConfig and its generated compose files ---------

INSPECT_DOCKER = pytest.importorskip("inspect_ai.util._sandbox.docker.config")


def test_dockerfile_project_is_inspects_generated_compose(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM alpine\n")
    project = dockerfile_project(tmp_path / "Dockerfile")
    s = project.default_service
    assert list(project.services) == ["default"]
    assert (s.build.context, s.build.dockerfile) == (tmp_path, tmp_path / "Dockerfile")
    assert (s.init, s.command, s.network_mode, s.ignored) == (True, ["tail", "-f", "/dev/null"], "none",
                                                              ["stop_grace_period"])
    assert sample_network(project) == "none"
    inspect_text = INSPECT_DOCKER.COMPOSE_DOCKERFILE_YAML.format(dockerfile="Dockerfile")
    from_inspect = load_project(write(tmp_path, inspect_text, ".compose.yaml"), environ={})
    assert from_inspect.default_service == s


def test_named_dockerfile(tmp_path):
    (tmp_path / "agent.Dockerfile").write_text("FROM alpine\n")
    assert dockerfile_project(tmp_path / "agent.Dockerfile").default_service.build.dockerfile == (
        tmp_path / "agent.Dockerfile")


def test_inspect_generic_compose_loads(tmp_path):
    project = load_project(write(tmp_path, INSPECT_DOCKER.COMPOSE_GENERIC_YAML), environ={})
    s = project.default_service
    assert (s.image, s.command, s.init, s.network_mode) == (
        "aisiuk/inspect-tool-support", ["tail", "-f", "/dev/null"], True, "none")


def test_compose_config_input(tmp_path):
    from inspect_ai.util import ComposeConfig

    config = ComposeConfig.model_validate({
        "services": {
            "web": {"image": "nginx", "healthcheck": {"test": ["CMD", "true"], "interval": "2s"},
                    "networks": ["lab"], "environment": {"A": "${X:-1}"}},
            "agent": {"build": {"context": "agent"}, "x-default": True, "command": "sleep infinity",
                      "cpus": 1, "mem_limit": "1g", "networks": ["lab"], "x-local": True,
                      "depends_on": {"web": {"condition": "service_healthy"}}},
        },
        "networks": {"lab": {"internal": True}},
    })
    project = project_from_config(config, tmp_path, environ={})
    assert list(project.services) == ["agent", "web"]
    agent, web = project.services["agent"], project.services["web"]
    assert (agent.build.context, agent.command, agent.cpus, agent.memory, agent.x_local) == (
        tmp_path / "agent", ["sleep", "infinity"], 1.0, 1 << 30, True)
    assert agent.depends_on == {"web": "service_healthy"}
    assert (web.healthcheck.test, web.healthcheck.interval, web.environment) == (["CMD", "true"], 2.0, {"A": "1"})
    assert sample_network(project) == "services"


# -- fixtures shaped like public Inspect evals -------------------------------------

def test_fixture_build_with_network_none():
    project = load_project(FIXTURES / "build_none", environ={})
    s = project.default_service
    assert (s.build.context, s.network_mode, s.working_dir, s.x_local) == (
        FIXTURES / "build_none", "none", "/workspace", True)
    assert sample_network(project) == "none" and project.warnings == []


def test_build_keys_are_honoured_warned_about_or_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`build.network` and the other keys had been dropped without a word:
    `network: none` built with nat."""
    monkeypatch.delenv("NSBOX_COMPOSE_HOST_NETWORK", raising=False)
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    project = load(tmp_path, """\
        services:
          s:
            build: {context: ., network: none, no_cache: true, pull: true, labels: {a: b}, secrets: [x]}
          t:
            build: {context: ., network: default}
          u:
            build: {context: ., network: proj}
        """)
    s, t, u = (project.services[n].build for n in "stu")
    assert (s.network, s.no_cache, s.pull) == ("none", True, True)
    assert (t.network, t.no_cache, t.pull) == (None, False, False) and u.network is None
    assert "service s: build.labels: not applied to the image" in project.warnings
    assert any(w.startswith("service s: build.secrets: not given to RUN") for w in project.warnings)
    assert any(w.startswith("service u: build.network proj: RUN steps get the builder's own") for w in project.warnings)
    message = cannot(tmp_path, "services:\n  s:\n    build: {context: ., network: host, frob: 1}\n")
    assert "build.network: host (the host's network is yours to grant" in message and "unknown key build.frob" in message
    monkeypatch.setenv("NSBOX_COMPOSE_HOST_NETWORK", "1")
    assert one(tmp_path, "build: {context: ., network: host}").build.network == "host"


def test_fixture_image_with_platform_list_command_and_limits():
    s = load_project(FIXTURES / "image_limits", environ={}).default_service
    assert (s.platform, s.command, s.user) == ("linux/amd64", ["tail", "-f", "/dev/null"], "1000:1000")
    assert (s.memory, s.cpus, s.pids_limit) == (512 * MiB, 1.5, 512)
    assert s.environment == {"PYTHONUNBUFFERED": "1", "HOME": "/home/agent"}
    assert s.ignored == ["logging"]
    assert s.restart == Restart()  # unless-stopped: as always, nothing stops a service but its end


def test_fixture_target_and_attacker_on_an_internal_network():
    project = load_project(FIXTURES / "target_attacker", environ={})
    assert list(project.services) == ["attacker", "target"]
    target = project.services["target"]
    assert target.healthcheck.test == ["CMD-SHELL", "curl -fs http://localhost:8080/ || exit 1"]
    assert (target.healthcheck.interval, target.healthcheck.start_period) == (5.0, 90.0)
    assert (target.memory, target.cpus) == (1 << 30, 1.0)
    assert project.services["attacker"].depends_on == {"target": "service_healthy"}
    assert sample_network(project) == "services"
    assert aliases(project)["target"] == ["target", "victim.lab"]


def test_fixture_build_args_labels_and_grace_period():
    s = load_project(FIXTURES / "build_args", environ={"FLAG": "picoCTF{real}"}).default_service
    assert s.build.args == {"FLAG": "picoCTF{real}", "DEBIAN_FRONTEND": "noninteractive"}
    assert (s.build.target, s.build.dockerfile.name) == ("challenge", "Dockerfile.challenge")
    assert set(s.ignored) == {"labels", "stop_grace_period"}
    default_flag = load_project(FIXTURES / "build_args", environ={}).default_service.build.args["FLAG"]
    assert default_flag == "picoCTF{default}"


def test_fixture_pid_host_is_a_clear_error():
    with pytest.raises(ComposeError) as e:
        load_project(FIXTURES / "pid_host", environ={})
    assert str(e.value).endswith(
        'service default: nsbox cannot honour: devices (host devices other than GPUs are not passed through'
        '; GPUs: use gpus), pid: host (see README "Compose support")')


def test_fixture_web_and_db_with_dot_env_and_env_file():
    project = load_project(FIXTURES / "web_db", environ={})
    assert project.name == "webdb"
    default, web, db = project.services.values()
    assert default.environment == {"OPENAI_BASE_URL": "http://web:8000/v1", "AGENT_MODE": "scripted",
                                   "TARGET_URL": "http://web:8000"}
    assert web.image == "ghcr.io/example/shop:1.4.2"
    assert web.environment["DATABASE_URL"] == "postgres://shop:s3cr$t@db:5432/shop"  # '...' in .env is literal
    assert web.depends_on == {"db": "service_healthy"}
    assert db.healthcheck.test == ["CMD-SHELL", "pg_isready -U shop"] and db.healthcheck.timeout == 0.5
    assert sample_network(project) == "services"


def test_fixture_required_variable_missing_names_it(tmp_path):
    # the fixture's .env sets SHOP_TAG; a copy without it shows the error
    for f in (FIXTURES / "web_db").iterdir():
        if f.is_file() and f.name != ".env":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ComposeError, match="required variable SHOP_TAG is missing a value: set SHOP_TAG in .env"):
        load_project(tmp_path / "compose.yaml", environ={})


def test_service_network_mode_follows_its_target(tmp_path):
    project = load(tmp_path, "services:\n  a: {image: a, network_mode: none}\n  b: {image: b, network_mode: 'service:a'}\n")
    assert sample_network(project) == "none"


def test_yaml_anchors_and_merge_keys(tmp_path):
    project = load(tmp_path, """
        x-base: &base
          image: alpine
          init: true
          environment: {A: "1"}
        services:
          a:
            <<: *base
            command: [sh]
          b: *base
        """)
    a, b = project.services["a"], project.services["b"]
    assert (a.image, a.init, a.environment, a.command) == ("alpine", True, {"A": "1"}, ["sh"])
    assert (b.image, b.command) == ("alpine", None)


@pytest.mark.parametrize("text, message", [
    ("services:\n  s: {command: x}\n", "service s has neither an image nor a build context"),
    ("services:\n  s:\n", "service s has neither an image nor a build context"),
    ("services: {}\n", "needs a `services` mapping"),
    ("version: '3'\n", "needs a `services` mapping"),
    ("services:\n  s: {image: a, working_dir: app}\n", "service s: working_dir: must be an absolute path"),
    ("services:\n  s: {image: a, tmpfs: ['/t:mode=rwx']}\n", "tmpfs: tmpfs mode must be octal permissions"),
    ("services:\n  s: {image: a, tmpfs: [rel]}\n", "tmpfs: target must be an absolute path in the container"),
    ("services:\n  s: {image: a, init: maybe}\n", "service s: init: expected true or false"),
    ("services: [", "not valid YAML"),
])
def test_malformed_files_are_clear_errors(tmp_path, text, message):
    with pytest.raises(ComposeError, match=re.escape(message)):
        load(tmp_path, text)


def test_missing_compose_file(tmp_path):
    with pytest.raises(ComposeError, match="no compose file in"):
        load_project(tmp_path)


def test_extra_hosts_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nsbox.net.usernet import GATEWAY

    (tmp_path / "compose.yaml").write_text(
        "services:\n  a:\n    image: x\n    extra_hosts: ['db:10.1.2.3', 'gw=host-gateway', 'v6:[::1]']\n"
        "  b:\n    image: x\n    extra_hosts: {cache: 10.9.9.9}\n")
    monkeypatch.setenv("NSBOX_COMPOSE_HOST_LOOPBACK", "1")
    p = load_project(tmp_path / "compose.yaml")
    assert p.services["a"].extra_hosts == {"db": "10.1.2.3", "gw": "host-gateway", "v6": "::1"}
    a = service_spec(p.services["a"], p, image="x", network="nat")
    assert netmodes.host_loopback(a) and netmodes.extra_hosts(a)["gw"] == GATEWAY
    spec = service_spec(p.services["b"], p, image="x", network="none")
    assert spec.hosts == {"cache": "10.9.9.9"}


def test_host_gateway_is_the_hosts_address_unless_its_loopback_is_granted(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A compose file's host-gateway opened the host's loopback, whose
    services (databases, other sandboxes' ports, a registry) are the
    operator's to grant: as under Docker, it is the host's own address."""
    from nsbox.compose import support
    from nsbox.net import hosts

    monkeypatch.delenv("NSBOX_COMPOSE_HOST_LOOPBACK", raising=False)
    (tmp_path / "compose.yaml").write_text("services:\n  a:\n    image: x\n"
                                           "    extra_hosts: ['host.docker.internal:host-gateway']\n")
    address = hosts.host_address()
    assert address is not None and not ipaddress.ip_address(address).is_loopback
    p = load_project(tmp_path / "compose.yaml")
    assert p.services["a"].extra_hosts == {"host.docker.internal": address}
    assert not netmodes.host_loopback(service_spec(p.services["a"], p, image="x", network="nat"))
    monkeypatch.setattr("nsbox.compose.parse.host_address", lambda: None)  # a host with loopback alone
    with pytest.raises(ComposeError, match="no IPv4 address but its loopback.*NSBOX_COMPOSE_HOST_LOOPBACK=1"):
        load_project(tmp_path / "compose.yaml")
    for x_nsbox in ("{host_loopback: true}", "{host_loopback: 1}", "{host_loopback: 'false'}",
                    "{hosts: {gw: host-gateway}}", "{hosts: [[gw, host-gateway]]}"):
        (tmp_path / "compose.yaml").write_text(f"services:\n  a:\n    image: x\n    x-nsbox: {x_nsbox}\n")
        with pytest.raises(ComposeError, match="the host's loopback.*NSBOX_COMPOSE_HOST_LOOPBACK=1"):
            load_project(tmp_path / "compose.yaml")
        monkeypatch.setenv(support.HOST_LOOPBACK_ENV, "1")
        p = load_project(tmp_path / "compose.yaml")
        if "true" in x_nsbox or "hosts" in x_nsbox:
            assert netmodes.host_loopback(service_spec(p.services["a"], p, image="x", network="nat"))
        else:  # granted, and still not a boolean ('false' had granted it): the spec says so
            with pytest.raises(ComposeError, match="host_loopback must be true or false"):
                service_spec(p.services["a"], p, image="x", network="nat")
        monkeypatch.delenv(support.HOST_LOOPBACK_ENV)
