"""End to end: offline Inspect evals on nsbox sandboxes.

A scripted mockllm model calls bash(), python(), bash_session() and
text_editor(); the last two inject Inspect's sandbox-tools bundle and start
its long-lived server inside the sandbox. A scorer reads back what each
tool wrote. Also: --no-sandbox-cleanup (sandboxes kept, detached, then
removed by `inspect sandbox cleanup nsbox [ID]`) and a configuration error.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Callable

import anyio
import pytest

from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.log import EvalLog
from inspect_ai.model import ChatMessage, ChatMessageTool, ChatMessageUser, ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
from inspect_ai.solver import TaskState, generate, use_tools
from inspect_ai.tool import bash, bash_session, python, text_editor
from inspect_ai.util import sandbox

import nsbox
from nsbox import manage
from nsbox.host import live, removal
from nsbox.errors import NsboxError
from nsbox.inspect.provider import NsboxSandboxEnvironment

MODEL = "mockllm/model"


def _usage(output: ModelOutput) -> ModelOutput:
    # Without usage, mockllm counts tokens with tiktoken, which downloads.
    output.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)
    return output


def scripted(steps: list[tuple[str, dict[str, Any]]],
             final: str = "done") -> Callable[..., ModelOutput]:
    """A mockllm script: the n-th model call of a sample (n = the number
    of tool results so far) makes the n-th tool call, then answers `final`.
    Keyed on the sample's own messages, so concurrent samples don't mix."""
    calls: list[int] = []

    def generate_(input: list[ChatMessage], *_: Any) -> ModelOutput:
        calls.append(1)
        n = sum(isinstance(m, ChatMessageTool) for m in input)
        if n < len(steps):
            tool, args = steps[n]
            prompt = next(m.text for m in input if isinstance(m, ChatMessageUser))
            args = {k: v.replace("{INPUT}", prompt) if isinstance(v, str) else v for k, v in args.items()}
            return _usage(ModelOutput.for_tool_call(MODEL, tool, args))
        return _usage(ModelOutput.from_content(MODEL, final))

    generate_.calls = calls  # type: ignore[attr-defined]
    return generate_


@scorer(metrics=[accuracy()])
def files_are(expected: dict[str, str]):  # type: ignore[no-untyped-def]
    """CORRECT iff each file holds exactly the expected text; records which
    sandbox it looked at (id, init pid and start time) and the root probe."""

    async def score(state: TaskState, target: Target) -> Score:
        got: dict[str, str | None] = {}
        for path in expected:
            try:
                got[path] = await sandbox().read_file(path)
            except FileNotFoundError:
                got[path] = None
        env = sandbox().as_type(NsboxSandboxEnvironment)
        access = env._root_access
        return Score(
            value=CORRECT if got == expected else INCORRECT,
            explanation=json.dumps(got),
            metadata={"id": env.sandbox.id, "pid": env.sandbox.pid,
                      "start": live.process_start_time(env.sandbox.pid),
                      "root_access": access.state if access is not None else None,
                      "tools_user": getattr(sandbox(), "_tools_user", "?")},
        )

    return score


def write_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "nsbox.yaml"
    path.write_text(text)
    return str(path)


def sample_problems(log: EvalLog) -> list[str]:
    """Errors of the samples and of their tool calls, for assertion messages."""
    problems = []
    for s in log.samples or []:
        if s.error is not None:
            problems.append(f"sample {s.id}: {s.error.message}\n{s.error.traceback}")
        for m in s.messages:
            if isinstance(m, ChatMessageTool) and m.error is not None:
                problems.append(f"sample {s.id}: tool {m.function}: {m.error.type}: {m.error.message}")
    return problems


def gone(pid: int, start: int | None) -> bool:
    return not live.process_alive(pid, start)


# Each tool writes a file; bash_session also shows that its shell keeps
# state (cwd, a variable) between calls, which needs the tools server to
# live on between execs.
E2E_STEPS: list[tuple[str, dict[str, Any]]] = [
    ("bash", {"command": "mkdir -p /tmp/e2e && echo bash $((6*7)) $(id -u) > /tmp/e2e/bash.txt"}),
    ("python", {"code": "import os\nopen('/tmp/e2e/python.txt', 'w').write(f'python {sum(range(10))} {os.getuid()}\\n')"}),
    ("bash_session", {"action": "type_submit", "input": "cd /tmp/e2e && WORD=session"}),
    ("bash_session", {"action": "type_submit", "input": 'echo "$WORD $((2+3)) $(pwd)" > session.txt'}),
    ("text_editor", {"command": "create", "path": "/tmp/e2e/editor.txt", "file_text": "first line\nsecond line\n"}),
    ("text_editor", {"command": "str_replace", "path": "/tmp/e2e/editor.txt",
                     "old_str": "second line", "new_str": "replaced line"}),
]
E2E_FILES = {
    "/tmp/e2e/bash.txt": "bash 42 0\n",
    "/tmp/e2e/python.txt": "python 45 0\n",
    "/tmp/e2e/session.txt": "session 5 /tmp/e2e\n",
    "/tmp/e2e/editor.txt": "first line\nreplaced line\n",
}


# [debian]: the tools on a root filesystem without python3, in the root
# pass only; what the identity mode changes (who the tools run as) is
# checked by [host], in every pass.
@pytest.mark.parametrize("rootfs", [pytest.param("debian", marks=pytest.mark.once), "host"])
def test_eval_with_every_tool(rootfs: str, tmp_path: Path, debian_rootfs: Path, mode: str,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no nsbox.yaml is discovered by accident
    steps, files = list(E2E_STEPS), dict(E2E_FILES)
    if rootfs == "debian":
        monkeypatch.setenv("NSBOX_COMPOSE_PATHS", str(debian_rootfs))  # a file's host path, outside its directory
        spec: Any = ("nsbox", write_config(tmp_path, f"rootfs: {debian_rootfs}\n"))
        # The Debian minbase fixture has no python3: the python tool reports
        # that as its output (exit 127), the sample goes on.
        files.pop("/tmp/e2e/python.txt")
    else:
        spec = "nsbox"  # no configuration: the built-in host root
    script = scripted(steps)
    task = Task(dataset=[Sample(input="write the files", target="ok")],
                solver=[use_tools([bash(), python(), bash_session(), text_editor()]), generate()],
                scorer=files_are(files), sandbox=spec, name=f"nsbox_e2e_{rootfs}")
    [log] = eval(task, model=get_model(MODEL, custom_outputs=script), log_dir=str(tmp_path),
                 display="none", max_samples=1)
    assert log.status == "success", log.error
    assert log.samples is not None and len(log.samples) == 1
    sample = log.samples[0]
    assert sample.error is None, sample_problems(log)
    assert len(script.calls) == len(steps) + 1  # type: ignore[attr-defined]
    score = sample.scores["files_are"]
    assert score.value == CORRECT, (score.explanation, sample_problems(log))
    assert sample_problems(log) == []
    if rootfs == "debian":
        python_out = next(m for m in sample.messages if isinstance(m, ChatMessageTool) and m.function == "python")
        assert "python3" in python_out.text and "not found" in python_out.text, python_out.text

    # The root probe: real root and the subuid mode can switch users; the
    # single mapping cannot (setgroups is denied), so the tools run as the
    # default user, root, anyway.
    meta = score.metadata or {}
    assert meta["root_access"] == ("unusable" if mode == "single" else "usable"), meta
    assert meta["tools_user"] == (None if mode == "single" else "root"), meta
    # The sample's sandbox is gone with everything in it (the tools server too).
    assert live.read(meta["id"]) is None
    assert gone(meta["pid"], meta["start"])
    assert removal.wait_swept(10)
    assert not (nsbox.host.dirs.data_dir() / "sandboxes" / meta["id"]).exists()


KEEP_STEPS: list[tuple[str, dict[str, Any]]] = [("bash", {"command": "echo {INPUT} > /tmp/marker"})]


def inspect_entries(task_name: str) -> dict[str, manage.Entry]:
    """The live sandboxes of the samples of `task_name`, by marker."""
    return {e.info.label: e for e in manage.entries() if e.info.origin == "inspect" and task_name in e.info.label}


def test_no_sandbox_cleanup_keeps_detached_sandboxes(tmp_path: Path, debian_rootfs: Path,
                                                     capfd: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NSBOX_COMPOSE_PATHS", str(debian_rootfs))  # a file's host path, outside its directory
    name = f"nsbox_keep_{uuid.uuid4().hex[:8]}"
    script = scripted(KEEP_STEPS)
    task = Task(dataset=[Sample(input="keep-one", target="", id="one"),
                         Sample(input="keep-two", target="", id="two")],
                solver=[use_tools([bash()]), generate()],
                scorer=files_are({"/tmp/marker": "x"}),  # only to record which sandbox
                sandbox=("nsbox", write_config(tmp_path, f"rootfs: {debian_rootfs}\n")), name=name)
    kept: dict[str, live.SandboxInfo] = {}
    try:
        [log] = eval(task, model=get_model(MODEL, custom_outputs=script), log_dir=str(tmp_path),
                     display="none", sandbox_cleanup=False)
        assert log.status == "success", log.error
        assert log.samples is not None and sample_problems(log) == []
        by_sample = {str(s.id): (s.scores["files_are"].metadata or {})["id"] for s in log.samples}
        entries = inspect_entries(name)
        for e in entries.values():
            kept[e.info.id] = e.info
        assert sorted(e.info.id for e in entries.values()) == sorted(by_sample.values()), entries
        # task_cleanup(cleanup=False) says what it kept and how to remove it.
        err = capfd.readouterr().err
        assert "nsbox sandboxes kept running" in err and "inspect sandbox cleanup nsbox" in err, err
        assert all(i in err for i in by_sample.values()), err
        for e in entries.values():
            assert e.state == "detached" and e.info.detached, e
            assert e.info.init_alive and Path(e.info.layer).is_dir()

        async def marker(sandbox_id: str) -> str:
            sb = await nsbox.Sandbox.attach(sandbox_id)
            try:
                return (await sb.exec(["cat", "/tmp/marker"])).stdout
            finally:
                await sb.close()  # only disconnects

        # Each kept sandbox is the sample's own, still running.
        for sample_id, sandbox_id in by_sample.items():
            assert anyio.run(marker, sandbox_id) == f"keep-{sample_id}\n"

        # `inspect sandbox cleanup nsbox ID` removes that one only.
        one, two = by_sample["one"], by_sample["two"]
        anyio.run(NsboxSandboxEnvironment.cli_cleanup, one)
        assert capfd.readouterr().out == f"removed nsbox sandbox {one}\n"
        info = kept[one]
        assert live.read(one) is None
        assert gone(info.init_pid, info.init_start)
        assert not Path(info.layer).exists()
        assert live.read(two) is not None and kept[two].init_alive
        assert anyio.run(marker, two) == "keep-two\n"
        # An id no longer there: one line and a failed status, as for any user mistake.
        with pytest.raises(SystemExit) as exit:
            anyio.run(NsboxSandboxEnvironment.cli_cleanup, one)
        assert exit.value.code == 1
        assert capfd.readouterr().err.startswith(f"nsbox: no sandbox '{one}'")

        # `inspect sandbox cleanup nsbox` removes every one left.
        anyio.run(NsboxSandboxEnvironment.cli_cleanup, None)
        assert f"removed nsbox sandbox {two} " in capfd.readouterr().out
        info = kept[two]
        assert live.read(two) is None
        assert gone(info.init_pid, info.init_start)
        assert not Path(info.layer).exists()
        assert inspect_entries(name) == {}
    finally:
        for info in kept.values():
            if live.read(info.id) is not None:
                manage.remove(info, force=True)


def test_config_error_fails_the_eval_before_any_sample(tmp_path: Path) -> None:
    script = scripted(KEEP_STEPS)
    name = f"nsbox_badcfg_{uuid.uuid4().hex[:8]}"
    task = Task(dataset=[Sample(input="never", target="")], solver=[use_tools([bash()]), generate()],
                scorer=files_are({}), sandbox=("nsbox", write_config(tmp_path, "network: bogus\n")), name=name)
    before = {i.id for i in live.entries()}
    # Inspect runs task_init before it opens the log: the error surfaces as
    # the exception itself (older versions logged it as status "error").
    try:
        [log] = eval(task, model=get_model(MODEL, custom_outputs=script), log_dir=str(tmp_path),
                     display="none")
    except NsboxError as e:
        message = str(e)
    else:
        assert log.status == "error" and log.error is not None, log.status
        assert not log.samples
        message = log.error.message
    assert "invalid nsbox configuration" in message and "nsbox.yaml" in message, message
    assert "network: Value error, Input should be 'none', 'host', 'nat', 'proxy' or 'net:NAME'" in message, message
    assert script.calls == []  # type: ignore[attr-defined]
    assert {i.id for i in live.entries() if name in i.label} - before == set()
