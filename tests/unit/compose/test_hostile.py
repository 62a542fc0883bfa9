"""Compose files written by an attacker: the host paths they may name (the
project directory only, unless NSBOX_COMPOSE_PATHS allows more; see
nsbox/compose/hostpaths.py), and input built to hurt the reader (YAML bombs,
deep nesting, huge or blocking files, costly interpolation, names that
become paths). Ends with a fuzz test of the whole reader. Every test runs in
each identity mode; what differs is noted where it is tested."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nsbox.compose import ComposeError, load_project, service_spec
ENV = "NSBOX_COMPOSE_PATHS"  # the opt-in (nsbox/compose/hostpaths.py)

SECRET = "AKIAsentinelSECRET0123"
OUTSIDE = "outside-7f3a"  # unique names: an open of either shows in the audit log
CREDENTIALS = "credentials-7f3a"

# -- what the reader opens, from Python's audit events ------------------------

_opened: list[str] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _opened is not None and args and isinstance(args[0], (str, bytes)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


class Opened:
    """The paths opened (with open() or os.open(), any dir_fd) inside `with`."""

    def __enter__(self) -> list[str]:
        global _opened
        _opened = []
        return _opened

    def __exit__(self, *exc: object) -> None:
        global _opened
        _opened = None


def touched_outside(opened: list[str]) -> list[str]:
    return [p for p in opened if OUTSIDE in p or CREDENTIALS in p]


# -- fixtures -----------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)


@pytest.fixture
def proj(tmp_path: Path) -> Path:
    d = tmp_path / "proj"
    d.mkdir()
    return d


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A credentials file beside the project, readable by its owner only (as
    root: a root-only file, like /root/.aws/credentials)."""
    d = tmp_path / OUTSIDE
    d.mkdir()
    f = d / CREDENTIALS
    f.write_text(f"AWS_SECRET_ACCESS_KEY={SECRET}\n")
    f.chmod(0o600)
    return f


def compose(proj: Path, text: str, **fmt: Any) -> Path:
    path = proj / "compose.yaml"
    text = textwrap.dedent(text)
    path.write_text(text.format(**fmt) if fmt else text)
    return path


def refused(path: Path, match: str = "outside the project directory") -> str:
    with Opened() as opened, pytest.raises(ComposeError, match=match) as e:
        load_project(path, environ={})
    message = str(e.value)
    assert SECRET not in message
    assert not touched_outside(opened), opened
    return message


@pytest.mark.parametrize("service, top", [
    ("env_file: ../{outside}/{creds}", ""),
    ("env_file: ['{abs}/{creds}']", ""),
    ("env_file: [{{path: ./link/{creds}, required: false}}]", ""),
    ("env_file: ./creds.env", ""),
    ("build: ../{outside}", ""),
    ("build: {{context: ., dockerfile: ../{outside}/{creds}}}", ""),
    ("build: {{context: ., dockerfile: '{abs}/{creds}'}}", ""),
    ("build: {{context: ./link}}", ""),
    ("volumes: ['../{outside}:/x']", ""),
    ("volumes: ['{abs}/{creds}:/x:ro']", ""),
    ("volumes: ['/:/host']", ""),
    ("volumes: ['/root:/r:rw']", ""),
    ("volumes: ['/home:/home']", ""),
    ("volumes: ['/var/run/docker.sock:/var/run/docker.sock']", ""),
    ("volumes: ['~/.ssh:/ssh']", ""),
    ("volumes: ['./link/../../{outside}:/x']", ""),
    ("volumes: [{{type: bind, source: ./link, target: /x, read_only: false}}]", ""),
    ("volumes: ['./link/made-here:/m']", ""),
    ("secrets: [k]", "secrets: {{k: {{file: ../{outside}/{creds}}}}}"),
    ("configs: [c]", "configs: {{c: {{file: ./link/{creds}}}}}"),
])
def test_every_host_path_is_held_to_the_project_directory(proj: Path, secret: Path, service: str, top: str) -> None:
    (proj / "link").symlink_to(secret.parent)  # a symlink inside the project, leading out
    (proj / "creds.env").symlink_to(secret)
    body = "image: alpine\n" + service
    text = "services:\n  s:\n" + textwrap.indent(body, "    ") + "\n" + top + "\n"
    path = compose(proj, text, outside=OUTSIDE, creds=CREDENTIALS, abs=secret.parent)
    refused(path)
    assert not (secret.parent / "made-here").exists()


def test_dot_env_symlink_leading_out_is_refused(proj: Path, secret: Path) -> None:
    (proj / ".env").symlink_to(secret)
    refused(compose(proj, "services: {s: {image: alpine}}\n"), match=r"\.env .* is outside the project directory")


def test_dot_env_cannot_opt_in(proj: Path, secret: Path) -> None:
    (proj / ".env").write_text(f"{ENV}=/\n")
    refused(compose(proj, "services: {{s: {{image: alpine, env_file: '{abs}'}}}}\n", abs=secret))


def test_opt_in_names_directories(proj: Path, secret: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, f"/nonexistent{os.pathsep}{secret.parent}")
    path = compose(proj, """
        services:
          s:
            image: alpine
            volumes: ['{d}:/d:ro']
            secrets: [k]
        secrets: {{k: {{file: '{f}'}}}}
        """, d=secret.parent, f=secret)
    mounts = [(m.source, m.target) for m in load_project(path, environ={}).services["s"].volumes]
    assert mounts == [(str(secret.parent), "/d"), (str(secret), "/run/secrets/k")]
    refused(compose(proj, "services: {s: {image: alpine, volumes: ['/root:/r']}}\n"))
    monkeypatch.setenv(ENV, "relative/dir")
    refused(path, match="not an absolute path")


def test_inside_the_project_symlinks_and_dotdot_are_fine(proj: Path) -> None:
    (proj / "real").mkdir()
    (proj / "real" / "a.env").write_text("A=1\n")
    (proj / "alias").symlink_to("real")
    path = compose(proj, """
        services:
          s:
            image: alpine
            env_file: ./alias/../real/a.env
            volumes: ['./alias:/a']
        """)
    s = load_project(path, environ={}).services["s"]
    assert s.environment == {"A": "1"} and s.volumes[0].source == str(proj / "real")


def test_a_bind_swapped_for_a_symlink_after_loading_is_refused(proj: Path, secret: Path) -> None:
    """A sandbox of one sample may write to the project directory; the next
    sample's binds are checked again, and missing directories are created
    without following a symlink."""
    (proj / "data").mkdir()
    (proj / "sub").mkdir()
    project = load_project(compose(proj, "services: {s: {image: a, volumes: ['./data:/d', './sub/new:/n']}}\n"),
                           environ={})
    (proj / "data").rmdir()
    (proj / "data").symlink_to(secret.parent)
    with pytest.raises(ComposeError, match="outside the project directory"):
        service_spec(project.services["s"], project, image="a", network="none")
    (proj / "data").unlink()
    (proj / "data").mkdir()
    (proj / "sub").rmdir()
    (proj / "sub").symlink_to(secret.parent)
    with pytest.raises(ComposeError, match="outside the project directory"):
        service_spec(project.services["s"], project, image="a", network="none")
    assert not (secret.parent / "new").exists()


def test_a_symlink_appearing_after_the_check_is_not_followed(proj: Path, secret: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The window between check and open: a directory swapped for a symlink
    then makes the open or mkdir fail instead of leaving the project."""
    from nsbox.compose.hostpaths import HostPaths

    paths = HostPaths(proj)
    (proj / "sub").symlink_to(secret.parent)
    monkeypatch.setattr(HostPaths, "check", lambda self, path, what: os.path.normpath(path))  # checked before the swap
    with pytest.raises(ComposeError, match="cannot create"):
        paths.make_dirs(str(proj / "sub" / "new"), "bind source")
    assert not (secret.parent / "new").exists()
    with Opened() as opened, pytest.raises(ComposeError, match="cannot read"):
        paths.read_text(proj / "sub" / CREDENTIALS, "env_file")
    assert not [p for p in opened if CREDENTIALS in p]  # refused at "sub", before the file


@pytest.mark.parametrize("text, match", [
    ("services: {s: {image: a, volumes: ['v:/v']}}\nvolumes: {'../../../escape': {}}\n", "not a valid name"),
    ("services: {s: {image: a, volumes: [{type: volume, source: /root, target: /v}]}}\nvolumes: {/root: {}}\n",
     "not a valid name"),
    ("services: {'..': {image: a, volumes: ['/anon']}}\n", "not a valid name"),
    ("services: {s: {image: a, volumes: [{type: volume, source: v, target: /v, volume: {subpath: ../../x}}]}}\n"
     "volumes: {v: {}}\n", "subpath: must be a relative path inside the volume"),
    ("services: {s: {image: a, x-nsbox: {id_mapping: host-root}}}\n", "unknown setting id_mapping"),
])
def test_names_that_would_leave_the_volume_directory(proj: Path, text: str, match: str) -> None:
    with pytest.raises(ComposeError, match=match):
        load_project(compose(proj, text), environ={})


# -- input built to hurt the reader ----------------------------------------------

def laughs(levels: int, fan: int) -> str:
    lines = ["x-0: &a0 [lol]"]
    lines += [f"x-{i}: &a{i} [{', '.join([f'*a{i - 1}'] * fan)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\nservices: {s: {image: a}}\n"


def merges(levels: int, fan: int) -> str:
    """Merge keys instead of lists: each mapping merges the one before, `fan` times."""
    lines = ["x-0: &m0 {k0: v, k1: v}"]
    lines += [f"x-{i}: &m{i} {{<<: [{', '.join([f'*m{i - 1}'] * fan)}], k{i}: v}}" for i in range(1, levels)]
    return "\n".join(lines) + "\nservices: {s: {image: a}}\n"


@pytest.mark.parametrize("text, match", [
    (laughs(10, 10), "aliases are expanded"),  # ten billion values, once expanded
    (merges(9, 9), "aliases are expanded|not valid YAML"),
    ("x-loop: &l [*l]\nservices: {s: {image: a}}\n", "refers to a node that contains it|not valid YAML"),
    ("x-deep: " + "[" * 5000 + "]" * 5000 + "\nservices: {s: {image: a}}\n", "nested too deeply|levels deep"),
    ("x-deep: " + "[" * 150 + "]" * 150 + "\nservices: {s: {image: a}}\n", "levels deep"),
    ("x-big: 1" + "0" * 5000 + "\nservices: {s: {image: a}}\n", "not valid YAML"),
    ("x-bin: !!binary aGVsbG8=\nservices: {s: {image: a}}\n", "no meaning in a compose file"),
    ("x-set: !!set {a, b}\nservices: {s: {image: a}}\n", "no meaning in a compose file"),
    ("services: {s: {image: a, environment: {~: x}}}\n", "key must be a string"),
    ('services: {s: {image: a, env_file: "a\\0b"}}\n', "NUL character"),
    ("services: {s: {image: a, networks: {front: x}}}\nnetworks: {front: {}}\n", r"networks\.\*: 'x' is not a mapping"),
    ("services: {s: {image: a, deploy: 1, volumes: 1}}\n", "deploy: 1 is not a mapping"),
    ('services: {s: {image: a, volumes: ["./a\\0:/x"]}}\n', "NUL character"),
])
def test_yaml_built_to_hurt(proj: Path, text: str, match: str) -> None:
    start = time.monotonic()
    with pytest.raises(ComposeError, match=match):
        load_project(compose(proj, text), environ={})
    assert time.monotonic() - start < 20


def test_number_and_boolean_keys_become_strings(proj: Path) -> None:
    s = load_project(compose(proj, "services: {s: {image: a, environment: {1: a, false: b, 2.5: c}}}\n"),
                     environ={}).services["s"]
    assert s.environment == {"1": "a", "false": "b", "2.5": "c"}


@pytest.mark.timeout(60)
def test_env_file_size_and_kind(proj: Path) -> None:
    (proj / "big.env").write_text("A=" + "x" * (2 << 20) + "\n")
    with pytest.raises(ComposeError, match="larger than 1024 KiB"):
        load_project(compose(proj, "services: {s: {image: a, env_file: big.env}}\n"), environ={})
    os.mkfifo(proj / "fifo.env")  # nobody writes it: a blocking read would hang here
    with pytest.raises(ComposeError, match="not a regular file"):
        load_project(compose(proj, "services: {s: {image: a, env_file: fifo.env}}\n"), environ={})
    os.mkfifo(proj / "fifo.yaml")
    with pytest.raises(ComposeError, match="not a regular file"):
        load_project(proj / "fifo.yaml", environ={})
    # A file just under the limit, one short variable a line, reads in linear time.
    lines = (1 << 20) // 12
    (proj / "many.env").write_text("".join(f"K{i:07d}=v\n" for i in range(lines)))
    start = time.monotonic()
    env = load_project(compose(proj, "services: {s: {image: a, env_file: many.env}}\n"), environ={})
    assert len(env.services["s"].environment) == lines and time.monotonic() - start < 30


@pytest.mark.parametrize("value, match", [
    ("${A:-y} " * 20000, "too costly"),
    ("${B:-" * 2000 + "}" * 2000, "nested too deeply|too costly"),
    ("${A:-y}" * 3000, None),
])
def test_costly_interpolation(proj: Path, value: str, match: str | None) -> None:
    path = compose(proj, "services: {{s: {{image: a, environment: {{V: '{v}'}}}}}}\n", v=value)
    start = time.monotonic()
    if match is None:
        assert load_project(path, environ={"A": "x"}).services["s"].environment["V"] == "x" * 3000
    else:
        with pytest.raises(ComposeError, match=match):
            load_project(path, environ={"A": "x"})
    assert time.monotonic() - start < 20


@pytest.mark.timeout(60)
def test_variables_that_double_are_bounded(proj: Path) -> None:
    """A .env of 60 lines, each variable twice the one before, would be 2^60
    characters; so would a short value referenced many times over. What
    interpolation makes counts against its budget, as what it scans does."""
    (proj / ".env").write_text("A0=xxxxxxxxxxxxxxxx\n" + "".join(f"A{i}=$A{i - 1}$A{i - 1}\n" for i in range(1, 60)))
    start = time.monotonic()
    with pytest.raises(ComposeError, match="too costly: it scans or makes more than"):
        load_project(compose(proj, "services: {s: {image: a}}\n"), environ={})
    (proj / ".env").write_text("BIG=" + "x" * 1_000_000 + "\n")
    refs = "x-r: &r ${BIG}\n" + "".join(f"x-{i}: [*r, *r, *r, *r]\n" for i in range(100))
    with pytest.raises(ComposeError, match="too costly"):
        load_project(compose(proj, refs + "services: {s: {image: a, environment: {V: '${BIG}'}}}\n"), environ={})
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("service, match", [
    ("ports: ['1-30000000']", "a port is a number up to 65535"),
    ("ports: ['99999:99999']", "a port is a number up to 65535"),
    ("ports: ['1-28232']", "publish 28232 ports, more than the 256 a sample may"),  # the host's whole ephemeral range
    ("deploy: {resources: {reservations: {devices: 5}}}", "devices: 5 is not a list"),
    ("secrets: [{source: s, target: 5}]", "source and target must be strings"),
    ("secrets: [{source: [1]}]", "source and target must be strings"),
    ("healthcheck: {test: 'true', retries: 1e400}", "retries: expected a finite number"),
    ("healthcheck: {test: 'true', retries: .nan}", "retries: expected a finite number"),
    ("healthcheck: {test: 'true', interval: 99999999999999999999h}", "longer than a Go duration"),
    ("pids_limit: .inf", "pids_limit: expected a finite number"),
    ("cpus: .nan", "cpus: expected a finite number"),
    ("restart: [1]", "restart: \\[1\\] is not a string"),
    ("deploy: {restart_policy: {max_attempts: 4294967296}}", "max_attempts: a restart limit must be a whole number"),
    ("depends_on: [s]", "in a cycle: s -> s"),
    ("container_name: 'a b'", "cannot be a host name"),
    ("networks: {default: {aliases: ['evil\\n1.2.3.4 pwn']}}", "cannot be a host name"),
])
def test_bad_values_are_compose_errors_when_the_file_is_read(proj: Path, service: str, match: str) -> None:
    """Each had been a traceback (TypeError, AttributeError, OverflowError),
    a 5 GB list of ports, or an error of every sample instead of the file."""
    (proj / "f").write_text("x")
    start = time.monotonic()
    with pytest.raises(ComposeError, match=match):
        load_project(compose(proj, f"services:\n  s:\n    image: a\n    {service}\n"
                                   "secrets: {s: {file: ./f}}\n"), environ={})
    assert time.monotonic() - start < 20


def test_a_sample_takes_a_bounded_share_of_the_processs_networks(proj: Path) -> None:
    """Each network takes one of the 254 subnets every sample of the process
    shares: 260 networks had left none to the other samples."""
    def text(count: int) -> str:
        nets = [f"n{i}" for i in range(count)]
        return ("services: {s: {image: a, networks: [" + ", ".join(nets) + "]}}\nnetworks: {"
                + ", ".join(f"{n}: {{}}" for n in nets) + "}\n")
    with pytest.raises(ComposeError, match="use 33 networks, more than the 32 a sample may"):
        load_project(compose(proj, text(33)), environ={})
    load_project(compose(proj, text(32)), environ={})


def test_what_every_sample_would_refuse_is_found_without_a_sample(proj: Path) -> None:
    """service_spec(check_only=True), as the provider's task_init calls it:
    the x-nsbox values are checked, nothing is made on disk."""
    project = load_project(compose(proj, "services: {s: {image: a, volumes: ['v:/data'], x-nsbox: {env: 5}}}\n"
                                         "volumes: {v: {}}\n"), environ={})
    with pytest.raises(ComposeError, match="service s: env must be a mapping of names to values, not 5"):
        service_spec(project.services["s"], project, image="a", network="none", check_only=True)
    assert sorted(p.name for p in proj.iterdir()) == ["compose.yaml"]


def test_mount_targets_are_cleaned_as_docker_cleans_them(proj: Path, tmp_path: Path) -> None:
    (proj / "d").mkdir()
    project = load_project(compose(proj, "services: {s: {image: a, volumes: ['./d:/data//x', 'v:/a/../b'], "
                                         "tmpfs: ['/t/./u']}}\nvolumes: {v: {}}\n"), environ={})
    spec = service_spec(project.services["s"], project, image="a", network="none", volume_root=tmp_path / "v")
    assert [b.target for b in spec.mounts] == ["/data/x", "/b"]
    assert [t.target for t in spec.tmpfs] == ["/t/u"]


# -- fuzzing: loads, or one ComposeError; never reads outside ---------------------

NAMES = st.sampled_from(["s", "web", "db", "default", "x-a", "a.b", "..", "", "1"])
PATHS = st.sampled_from([".", "./data", "data", "../" + OUTSIDE, "../" + OUTSIDE + "/" + CREDENTIALS, "./link",
                         "./link/" + CREDENTIALS, "./creds.env", "~", "~/x", "/", "/root", "/etc/passwd",
                         "/var/run/docker.sock", "./a/../../" + OUTSIDE, "./.env", "/dev/zero", "./a\0b"])
TEMPLATES = st.sampled_from(["$A", "${A}", "${A:-x}", "${NOPE:?gone}", "${", "$$", "${A:+${B}}", "${B-}", "$"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 70000), st.floats(allow_nan=False),
                    st.text(max_size=12), PATHS, TEMPLATES,
                    st.builds(lambda a, b: f"{a}:{b}", PATHS, st.sampled_from(["/x", "x", "/y:ro", ""])))
KEYS = st.sampled_from([
    "image", "build", "context", "dockerfile", "env_file", "environment", "volumes", "secrets", "configs",
    "file", "source", "target", "type", "bind", "create_host_path", "command", "entrypoint", "ports",
    "networks", "depends_on", "healthcheck", "test", "deploy", "resources", "limits", "profiles",
    "x-nsbox", "extends", "include", "tmpfs", "volume", "subpath", "path", "required", "args",
    "network_mode", "cap_add", "mem_limit", "cpus", "user", "working_dir", "extra_hosts", "links",
    "security_opt", "storage_opt", "ulimits", "read_only", "internal", "driver", "external", "aliases",
])
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(KEYS, inner, max_size=5)), max_leaves=20)
SHORT_BIND = st.builds(lambda a, b: f"{a}:{b}", PATHS, st.sampled_from(["/x", "/y:ro", "/z:rw", "x", ""]))
LONG_BIND = st.fixed_dictionaries({"type": st.sampled_from(["bind", "volume", "tmpfs", "npipe"]), "source": PATHS,
                                   "target": st.sampled_from(["/x", "x", "/"])},
                                  optional={"read_only": SCALARS, "bind": VALUES, "volume": VALUES})
# Services shaped like real ones (every key that names a host path, in its
# forms), with random keys and values mixed in.
SERVICE = st.fixed_dictionaries({"image": st.sampled_from(["a", "${A}"])}, optional={
    "env_file": st.one_of(PATHS, st.lists(PATHS, max_size=2),
                          st.lists(st.fixed_dictionaries({"path": PATHS}, optional={"required": SCALARS}), max_size=2)),
    "volumes": st.lists(st.one_of(SHORT_BIND, LONG_BIND, SCALARS), max_size=3),
    "build": st.one_of(PATHS, st.fixed_dictionaries({}, optional={"context": PATHS, "dockerfile": PATHS,
                                                                 "args": VALUES})),
    "secrets": st.lists(st.sampled_from(["k", "missing"]), max_size=2),
    "configs": st.lists(st.sampled_from(["k", "missing"]), max_size=2),
    "environment": st.dictionaries(st.sampled_from(["A", "B", "PATH"]), st.one_of(TEMPLATES, SCALARS), max_size=3),
}).flatmap(lambda svc: st.dictionaries(KEYS, VALUES, max_size=3).map(lambda junk: {**junk, **svc}))
FILE_DEFS = st.dictionaries(st.sampled_from(["k", "other"]), st.one_of(
    st.fixed_dictionaries({"file": PATHS}), VALUES), max_size=2)
DOCUMENT = st.fixed_dictionaries(
    {"services": st.dictionaries(NAMES, st.one_of(SERVICE, SERVICE, VALUES), min_size=1, max_size=3)},
    optional={"volumes": st.dictionaries(NAMES, VALUES, max_size=3), "networks": st.dictionaries(NAMES, VALUES, max_size=2),
              "secrets": FILE_DEFS, "configs": FILE_DEFS, "x-any": VALUES,
              "include": st.one_of(VALUES, st.lists(PATHS, max_size=2)), "name": SCALARS})


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("fuzz")
    (base / OUTSIDE).mkdir()
    (base / OUTSIDE / CREDENTIALS).write_text(f"A={SECRET}\n")
    proj = base / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "link").symlink_to(base / OUTSIDE)
    (proj / "creds.env").symlink_to(base / OUTSIDE / CREDENTIALS)
    (proj / ".env").write_text("A=from-dotenv\n")
    return proj


@pytest.mark.timeout(180)
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(doc=DOCUMENT, as_yaml=st.booleans())
def test_fuzz_loads_or_raises_compose_error_and_never_reads_outside(fuzz_dir: Path, doc: dict[str, Any],
                                                                      as_yaml: bool) -> None:
    path = fuzz_dir / "compose.yaml"
    path.write_text(yaml.safe_dump(doc) if as_yaml else repr(doc).replace("None", "null"))
    with Opened() as opened:
        try:
            project = load_project(path, environ={"A": "a"})
        except ComposeError as e:
            assert SECRET not in str(e)
        else:
            for s in project.services.values():
                assert SECRET not in repr(s)
                for m in s.volumes:
                    assert m.type != "bind" or (m.source or "").startswith(str(fuzz_dir))
    assert not touched_outside(opened), opened


def test_fuzz_strategy_reaches_the_reader(fuzz_dir: Path) -> None:
    """The fuzz services are not all rejected at the door: a sample of them
    loads, and some name host paths that are refused."""
    outcomes = {"loaded": 0, "outside": 0}

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=True)  # the same documents every run: a count, not a search
    @given(doc=st.fixed_dictionaries({"services": st.fixed_dictionaries({"s": SERVICE})}))
    def run(doc: dict[str, Any]) -> None:
        (fuzz_dir / "compose.yaml").write_text(yaml.safe_dump(doc))
        try:
            load_project(fuzz_dir / "compose.yaml", environ={"A": "a"})
            outcomes["loaded"] += 1
        except ComposeError as e:
            outcomes["outside"] += "outside the project directory" in str(e)

    run()
    assert outcomes["loaded"] > 0 and outcomes["outside"] > 0, outcomes
