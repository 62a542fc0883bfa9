"""Per-sample variables in compose files: Inspect's docker provider sets
SAMPLE_METADATA_<KEY> for each sample (its metadata keys upper-cased,
spaces as `_`, values as str()), so `image: ${SAMPLE_METADATA_IMAGE}` names
a different image per sample. nsbox interpolates the file per sample the
same way; task_init does not fail on an image only a sample can name.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from inspect_ai import Task
from inspect_ai.dataset import Sample
from inspect_ai.solver import generate, use_tools
from inspect_ai.tool import bash

from nsbox.compose import ComposeError

from tests.imagekit import Registry, busybox_oci, fixture_tar, push, registry, umoci_image  # noqa: F401
from .test_compose_eval import _check, _run, images, output_has  # noqa: F401

pytestmark = pytest.mark.timeout(240)


def test_variable_names_and_values_as_inspects_docker_provider(tmp_path: Path) -> None:
    from nsbox.inspect.compose import sample_variables

    f = tmp_path / "compose.yaml"
    f.write_text("services:\n  default:\n    image: ${SAMPLE_METADATA_IMAGE_VULNERABLE}\n"
                 "    environment: [N=${SAMPLE_METADATA_LEVEL}, T=${SAMPLE_METADATA___SAMPLE_ID__}]\n")
    got = sample_variables(str(f), {"image vulnerable": "reg/x:1", "level": 3, "unused": "u", "__sample_id__": 7})
    assert got == {"SAMPLE_METADATA_IMAGE_VULNERABLE": "reg/x:1", "SAMPLE_METADATA_LEVEL": "3",
                   "SAMPLE_METADATA___SAMPLE_ID__": "7"}
    assert sample_variables(str(tmp_path / "Dockerfile"), {"image": "x"}) == {}


@pytest.fixture(scope="module")
def flavours(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:  # noqa: F811
    """Two images on the loopback registry that differ only in FLAVOUR."""
    layout = tmp_path_factory.mktemp("flavour-oci") / "debian"
    out = {}
    for name in ("one", "two"):
        umoci_image(layout, name, fixture_tar("debian"), f"--config.env=FLAVOUR={name}")
        push(f"oci:{layout}:{name}", registry, f"evals/flavour:{name}")
        out[name] = f"{registry.host}/evals/flavour:{name}"
    return out


def _task(directory: Path, compose: str, samples: list[Sample], name: str) -> Task:
    (directory / "compose.yaml").write_text(textwrap.dedent(compose))
    return Task(dataset=samples, solver=[use_tools([bash()]), generate()], scorer=output_has("flavour="),
                sandbox=("nsbox", str(directory / "compose.yaml")), name=name)


STEPS = [("bash", {"command": "echo flavour=${FLAVOUR:-none} level=$LEVEL"})]


def test_each_sample_runs_the_image_its_metadata_names(images: dict[str, str], flavours: dict[str, str],
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SAMPLE_METADATA_IMAGE", raising=False)
    task = _task(tmp_path, f"""\
        services:
          default:
            image: ${{SAMPLE_METADATA_IMAGE:-{images['debian']}}}
            command: tail -f /dev/null
            environment:
              LEVEL: ${{SAMPLE_METADATA_LEVEL:-unset}}
            network_mode: none
        """, [Sample(input="a", id="one", metadata={"image": flavours["one"], "level": 1}),
              Sample(input="b", id="two", metadata={"image": flavours["two"], "level": 2}),
              Sample(input="c", id="none", metadata={"level": 3})], "nsbox_compose_sample_vars")
    samples = _check(_run(task, STEPS, tmp_path), 3)
    seen = {s.id: json.loads(s.scores["output_has"].explanation)[-1].strip() for s in samples}
    assert seen == {"one": "flavour=one level=1", "two": "flavour=two level=2", "none": "flavour=none level=3"}


def test_a_sample_without_the_variable_fails_clearly(flavours: dict[str, str], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SAMPLE_METADATA_IMAGE", raising=False)
    task = _task(tmp_path, """\
        services:
          default:
            image: ${SAMPLE_METADATA_IMAGE:?this sample names no image}
            command: tail -f /dev/null
            network_mode: none
        """, [Sample(input="a", id="one", metadata={"image": flavours["one"]}),
              Sample(input="b", id="bare")], "nsbox_compose_sample_vars_missing")
    # As with docker: the sample without it gets the task_init of no
    # variables, which fails the task before any sample starts.
    with pytest.raises(ComposeError) as e:
        _run(task, STEPS, tmp_path)
    assert "required variable SAMPLE_METADATA_IMAGE is missing a value: this sample names no image" in str(e.value)


def test_a_sample_without_the_variable_and_no_default_fails_clearly(flavours: dict[str, str], tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SAMPLE_METADATA_IMAGE", raising=False)
    task = _task(tmp_path, """\
        services:
          default:
            image: ${SAMPLE_METADATA_IMAGE}
            network_mode: none
        """, [Sample(input="a", id="one", metadata={"image": flavours["one"]}),
              Sample(input="b", id="bare")], "nsbox_compose_sample_vars_blank")
    with pytest.raises(ComposeError) as e:
        _run(task, STEPS, tmp_path)
    assert "service default has neither image nor build (its image is empty: a variable it names is unset)" \
        in str(e.value)
