"""Compose `include:`: files that include shared stacks (a task's compose
file including ../shared/STACK/compose.yaml), loaded as compose loads them,
with nsbox's host-path policy; and compose files recognised by content
whatever their name. Unit tests: no sandbox is created (the end-to-end eval
is in test_compose_eval.py)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from nsbox.compose import ComposeError, load_project, service_spec
from nsbox.compose import load as compose_load
from nsbox.inspect.compose import is_docker_config, read_project
from nsbox.inspect.config import config_key

from .test_hostile import Opened


def put(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    """suite/tasks/t1/compose.yaml including suite/shared/web/compose.yaml,
    which has its own network, volume, .env, bind and build context."""
    root = tmp_path / "suite"
    put(root / "shared/web/compose.yaml", """\
        services:
          web:
            build: ./app
            image: web:${WEB_TAG}
            networks: [backend]
            volumes:
              - ./www:/srv:ro
              - data:/data
            env_file: web.env
          db:
            image: busybox
            networks: [backend]
            secrets: [dbpass]
        networks:
          backend: {}
        volumes:
          data: {}
        secrets:
          dbpass:
            file: ./dbpass.txt
        """)
    put(root / "shared/web/.env", "WEB_TAG=from-included-env\n")
    put(root / "shared/web/web.env", "GREETING=hello\n")
    put(root / "shared/web/dbpass.txt", "s3cret\n")
    put(root / "shared/web/app/Dockerfile", "FROM busybox\n")
    (root / "shared/web/www").mkdir()
    put(root / "tasks/t1/compose.yaml", """\
        include:
          - ../../shared/web/compose.yaml
        services:
          default:
            image: busybox
            depends_on: [web]
            networks: [default, backend]
        """)
    return root


def test_include_of_a_sibling_stack(suite: Path, tmp_path: Path) -> None:
    project = load_project(suite / "tasks/t1/compose.yaml", environ={})
    web_dir = (suite / "shared/web").resolve()
    assert list(project.services) == ["default", "web", "db"]
    assert project.directory == (suite / "tasks/t1").resolve()
    web = project.services["web"]
    assert web.image == "web:from-included-env"  # its own .env interpolates it
    assert web.environment["GREETING"] == "hello"  # its env_file, relative to its directory
    assert web.build is not None and web.build.context == web_dir / "app"
    bind = next(m for m in web.volumes if m.type == "bind")
    assert bind.source == str(web_dir / "www")
    assert {"backend", "default"} <= set(project.networks)
    assert "data" in project.volumes
    [secret] = [m for m in project.services["db"].volumes if m.target == "/run/secrets/dbpass"]
    assert secret.source == str(web_dir / "dbpass.txt")
    # the bind is checked again against the included file's own directory when the sandbox is made
    spec = service_spec(web, project, image="web", network="nat", volume_root=tmp_path / "vols")
    assert any(b.source == str(web_dir / "www") for b in spec.mounts)


def test_the_including_projects_variables_win(suite: Path) -> None:
    project = load_project(suite / "tasks/t1/compose.yaml", environ={"WEB_TAG": "outer"})
    assert project.services["web"].image == "web:outer"


def test_long_form_with_project_directory_and_env_file(tmp_path: Path) -> None:
    put(tmp_path / "stack/compose.yaml", """\
        services:
          app:
            image: app:${TAG}
            volumes: [./data:/data]
        """)
    put(tmp_path / "stack/override.yaml", """\
        services:
          app:
            environment: {MODE: override}
        """)
    (tmp_path / "main/elsewhere/data").mkdir(parents=True)
    put(tmp_path / "main/vars.env", "TAG=from-env-file\n")
    put(tmp_path / "main/compose.yaml", """\
        include:
          - path: [../stack/compose.yaml, ../stack/override.yaml]
            project_directory: elsewhere
            env_file: vars.env
        services:
          default:
            image: busybox
        """)
    project = load_project(tmp_path / "main/compose.yaml", environ={})
    app = project.services["app"]
    assert app.image == "app:from-env-file"
    assert app.environment == {"MODE": "override"}
    assert [m.source for m in app.volumes] == [str((tmp_path / "main/elsewhere/data").resolve())]


def test_long_form_paths_merge_as_override_files(tmp_path: Path) -> None:
    put(tmp_path / "stack/base.yaml", """\
        services:
          app:
            image: app:1
            command: [serve, --slow]
            environment: [A=1, B=2]
            ports: ["8080:80"]
            volumes: [./one:/data, ./logs:/logs]
        """)
    put(tmp_path / "stack/more.yaml", """\
        services:
          app:
            command: [serve]
            environment: {B: "3", C: "4"}
            ports: ["8443:443"]
            volumes: [./two:/data]
        """)
    for d in ("one", "two", "logs"):
        (tmp_path / "stack" / d).mkdir()
    put(tmp_path / "stack/compose.yaml", """\
        include:
          - path: [base.yaml, more.yaml]
        services:
          default:
            image: busybox
        """)
    app = load_project(tmp_path / "stack/compose.yaml", environ={}).services["app"]
    assert app.command == ["serve"]
    assert app.environment == {"A": "1", "B": "3", "C": "4"}
    assert app.ports == ["8080:80", "8443:443"]
    stack = (tmp_path / "stack").resolve()
    assert sorted((m.target, m.source) for m in app.volumes) == [("/data", str(stack / "two")),
                                                                  ("/logs", str(stack / "logs"))]


def test_include_only_top_level_file(tmp_path: Path) -> None:
    put(tmp_path / "stack/compose.yaml", "services:\n  default:\n    image: busybox\n")
    put(tmp_path / "task/compose.yaml", "include: [../stack/compose.yaml]\n")
    assert list(load_project(tmp_path / "task/compose.yaml", environ={}).services) == ["default"]


@pytest.mark.parametrize("kind,body", [
    ("service", "services:\n  web:\n    image: busybox\n"),
    ("networks", "services:\n  other:\n    image: busybox\nnetworks:\n  backend: {}\n"),
    ("volumes", "services:\n  other:\n    image: busybox\nvolumes:\n  data: {}\n"),
])
def test_a_resource_defined_in_two_files_names_both(suite: Path, kind: str, body: str) -> None:
    put(suite / "tasks/t1/more.yaml", body)
    top = suite / "tasks/t1/compose.yaml"
    top.write_text(top.read_text().replace("  - ../../shared/web/compose.yaml\n",
                                           "  - ../../shared/web/compose.yaml\n  - more.yaml\n"))
    with pytest.raises(ComposeError) as e:
        load_project(top, environ={})
    msg = str(e.value)
    assert "defined in both" in msg and "shared/web/compose.yaml" in msg and "more.yaml" in msg, msg


def test_a_service_of_the_including_file_conflicts_with_an_included_one(suite: Path) -> None:
    top = suite / "tasks/t1/compose.yaml"
    top.write_text(top.read_text() + "  web:\n    image: busybox\n")
    with pytest.raises(ComposeError, match=r"^services web is defined in both ") as e:
        load_project(top, environ={})
    assert "shared/web/compose.yaml" in str(e.value) and "t1/compose.yaml" in str(e.value)


def test_include_cycle_is_refused(tmp_path: Path) -> None:
    put(tmp_path / "a/compose.yaml", "include: [../b/compose.yaml]\nservices:\n  a:\n    image: busybox\n")
    put(tmp_path / "b/compose.yaml", "include: [../a/compose.yaml]\nservices:\n  b:\n    image: busybox\n")
    with pytest.raises(ComposeError, match=r"^include cycle: .*a/compose.yaml -> .*b/compose.yaml -> .*a/compose.yaml$"):
        load_project(tmp_path / "a/compose.yaml", environ={})
    put(tmp_path / "self/compose.yaml", "include: [compose.yaml]\nservices:\n  a:\n    image: busybox\n")
    with pytest.raises(ComposeError, match="include cycle"):
        load_project(tmp_path / "self/compose.yaml", environ={})


def test_include_depth_is_bounded(tmp_path: Path) -> None:
    for i in range(compose_load.MAX_INCLUDE_DEPTH + 2):
        put(tmp_path / f"c{i}.yaml", f"include: [c{i + 1}.yaml]\nservices:\n  s{i}:\n    image: busybox\n")
    put(tmp_path / f"c{compose_load.MAX_INCLUDE_DEPTH + 2}.yaml", "services:\n  last:\n    image: busybox\n")
    with pytest.raises(ComposeError, match="nested more than"):
        load_project(tmp_path / "c0.yaml", environ={})


# ---- hostile includes --------------------------------------------------------

SECRET = "AKIA-TOP-SECRET-VALUE"


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    """A credentials file outside the suite, its content not a compose file."""
    path = put(tmp_path / "home/.aws/credentials", f"[default]\naws_access_key_id = {SECRET}\n")
    return path


def _refused(top: Path, *, match: str, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ComposeError, match=match) as e:
        load_project(top, environ=environ or {})
    text = str(e.value)
    assert SECRET not in text and "aws_access_key_id" not in text
    assert "\n" not in text
    return text


@pytest.mark.parametrize("entry", [
    "{path}", "~/.aws/credentials", "../../../../home/.aws/credentials", "/etc/shadow",
])
def test_include_outside_the_allowed_directories(tmp_path: Path, secret_file: Path, entry: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    top = put(tmp_path / "suite/a/b/task/compose.yaml", f"""\
        include: ["{entry.format(path=secret_file)}"]
        services:
          default:
            image: busybox
        """)
    _refused(top, match="outside the directories a compose file may include from")


def test_include_project_directory_cannot_widen_to_the_suite(tmp_path: Path) -> None:
    """A file in the task's own directory, included with project_directory
    ../.. (in reach as the suite directory), would name host paths anywhere
    in the suite: refused."""
    put(tmp_path / "suite/private/key.txt", f"{SECRET}\n")
    put(tmp_path / "suite/a/task/sub.yaml", "services:\n  web:\n    image: busybox\n"
                                            "    volumes: [./private:/x]\n")
    top = put(tmp_path / "suite/a/task/compose.yaml", """\
        include:
          - path: sub.yaml
            project_directory: ../..
        services:
          default:
            image: busybox
        """)
    _refused(top, match="include project_directory .* is outside the project directory")


def test_include_env_file_outside_is_refused(tmp_path: Path, secret_file: Path) -> None:
    put(tmp_path / "suite/shared/compose.yaml", "services:\n  web:\n    image: busybox:${aws_access_key_id}\n")
    top = put(tmp_path / "suite/task/compose.yaml", f"""\
        include:
          - path: ../shared/compose.yaml
            env_file: {secret_file}
        services:
          default:
            image: busybox
        """)
    _refused(top, match="include env_file .* is outside the project directory")


def test_a_non_compose_file_in_reach_is_refused_without_its_content(tmp_path: Path) -> None:
    """With the credentials allowed as a path (NSBOX_COMPOSE_PATHS), their
    content is still neither loaded nor quoted."""
    put(tmp_path / "suite/shared/credentials", f"[default]\naws_access_key_id = {SECRET}\n")
    put(tmp_path / "suite/shared/token.yaml", f"token: {SECRET}\n")
    put(tmp_path / "suite/shared/bad.yaml", f"services: [\n  {SECRET}: x: y\n")
    for name in ("credentials", "token.yaml", "bad.yaml"):
        top = put(tmp_path / f"suite/task/{name}.compose.yaml", f"""\
            include: [../shared/{name}]
            services:
              default:
                image: busybox
            """)
        _refused(top, match=r"(is not a compose file|not a valid compose file|is not named \*\.yaml)")


def test_an_include_of_a_credentials_file_in_reach_never_opens_it(tmp_path: Path) -> None:
    creds = put(tmp_path / "suite/shared/credentials-7f3a", f"{SECRET}\n")
    top = put(tmp_path / "suite/task/compose.yaml", "include: [../shared/credentials-7f3a]\n"
                                                    "services:\n  default:\n    image: busybox\n")
    with Opened() as opened:
        _refused(top, match=r"is not named \*\.yaml or \*\.yml")
    assert not [p for p in opened if str(creds) in p or "credentials-7f3a" in p], opened


def test_an_included_file_names_host_paths_in_its_own_directory_only(tmp_path: Path, secret_file: Path) -> None:
    put(tmp_path / "suite/shared/compose.yaml", f"""\
        services:
          web:
            image: busybox
            env_file: {secret_file}
        """)
    top = put(tmp_path / "suite/task/compose.yaml", "include: [../shared/compose.yaml]\n"
                                                    "services:\n  default:\n    image: busybox\n")
    _refused(top, match="env_file .* is outside the project directory .*suite/shared")
    # nor a bind into the including file's directory
    put(tmp_path / "suite/shared/compose.yaml", "services:\n  web:\n    image: busybox\n"
                                                "    volumes: [../task:/t]\n")
    _refused(top, match="volumes .* is outside the project directory .*suite/shared")


def test_an_override_file_from_elsewhere_cannot_borrow_another_projects_directory(tmp_path: Path) -> None:
    """`path: [victim/compose.yaml, ./evil.yaml]`: the files of a path list
    are read as the first one's project, so evil.yaml's `./` would be the
    victim's directory (its binds, env_files, secrets)."""
    put(tmp_path / "suite/victim/compose.yaml", "services:\n  app:\n    image: busybox\n")
    put(tmp_path / "suite/victim/.env", "TOKEN=victim-token\n")
    put(tmp_path / "suite/task/evil.yaml", "services:\n  app:\n    volumes: [./:/loot]\n"
                                           "    environment: [T=${TOKEN}]\n")
    top = put(tmp_path / "suite/task/compose.yaml", """\
        include:
          - path: [../victim/compose.yaml, ./evil.yaml]
        services:
          default:
            image: busybox
        """)
    _refused(top, match="evil.yaml is merged into .*victim/compose.yaml, so it must lie in that file's directory")


def test_included_symlink_and_special_files(tmp_path: Path, secret_file: Path) -> None:
    shared = tmp_path / "suite/x/shared"
    shared.mkdir(parents=True)
    (shared / "link.yaml").symlink_to(secret_file)
    os.mkfifo(shared / "fifo.yaml")
    put(shared / "big.yaml", "services:\n  web:\n    image: busybox\n" + "#" * (5 << 20) + "\n")
    (shared / "dir.yaml").mkdir()
    cases = {"link.yaml": "outside the directories", "fifo.yaml": "not a regular file",
             "big.yaml": "larger than", "dir.yaml": "not a regular file"}
    for name, match in cases.items():
        top = put(tmp_path / "suite/x/task/compose.yaml", f"include: [../shared/{name}]\n"
                                                          "services:\n  default:\n    image: busybox\n")
        _refused(top, match=match)


def test_the_suite_directory_is_bounded(tmp_path: Path) -> None:
    """Three levels up is beyond the suite directory; NSBOX_COMPOSE_PATHS allows it."""
    put(tmp_path / "far/compose.yaml", "services:\n  web:\n    image: busybox\n")
    top = put(tmp_path / "suite/a/b/compose.yaml", "include: [../../../far/compose.yaml]\n"
                                                   "services:\n  default:\n    image: busybox\n")
    _refused(top, match="outside the directories")
    os.environ["NSBOX_COMPOSE_PATHS"] = str(tmp_path / "far")
    try:
        assert "web" in load_project(top, environ={}).services
    finally:
        del os.environ["NSBOX_COMPOSE_PATHS"]


# ---- compose files by content ------------------------------------------------

def test_a_compose_file_of_another_name_is_read_as_compose(tmp_path: Path) -> None:
    for name in ("sandbox.yaml", "compose_1234.yaml"):
        path = put(tmp_path / name, "services:\n  default:\n    image: busybox\n")
        assert is_docker_config(str(path))
        assert config_key(str(path)) == str(path)  # handed on as compose, not read as nsbox.yaml
        assert list(read_project(str(path)).services) == ["default"]
    nsbox_yaml = put(tmp_path / "nsbox.yaml", "rootfs: host\n")
    assert not compose_load.is_compose_document(nsbox_yaml) and not is_docker_config(str(nsbox_yaml))
    assert not compose_load.is_compose_document(put(tmp_path / "list.yaml", "- services\n"))
    assert not compose_load.is_compose_document(tmp_path / "missing.yaml")
