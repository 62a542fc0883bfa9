"""The Inspect task each SLURM array task runs (tests/host/test_slurm.py).

    inspect eval task.py --sandbox nsbox

Offline: a scripted mockllm model calls the bash tool once, which writes
what PID 1 of the sandbox is, then answers. The scorer checks that the
sandbox's PID 1 is nsbox-init (so the tool ran inside an nsbox sandbox)
and records, for the test to check, where the eval ran: the SLURM array
task, the user, the XDG_RUNTIME_DIR it was given, the state directory nsbox
fell back to and the identity mode.

The task names no sandbox: `--sandbox nsbox` on the command line picks it.
"""

from __future__ import annotations

import os

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import Model, ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
from inspect_ai.solver import TaskState, generate, use_tools
from inspect_ai.tool import bash
from inspect_ai.util import sandbox

MOCK = "mockllm/model"
PROOF = "/root/proof.txt"


def scripted_model() -> Model:
    outputs = [
        ModelOutput.for_tool_call(MOCK, "bash", {"command": f"cat /proc/1/comm > {PROOF} && cat {PROOF}"}),
        ModelOutput.from_content(MOCK, "done"),
    ]
    for output in outputs:
        # Set usage, or mockllm counts tokens with tiktoken, which downloads.
        output.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)
    return get_model(MOCK, custom_outputs=outputs)


@scorer(metrics=[accuracy()])
def ran_in_nsbox():
    async def score(state: TaskState, target: Target) -> Score:
        from nsbox.host import dirs, idmap
        from nsbox.inspect.provider import NsboxSandboxEnvironment

        try:
            written = (await sandbox().read_file(PROOF)).strip()
        except FileNotFoundError:
            written = None
        pid1 = (await sandbox().exec(["cat", "/proc/1/comm"])).stdout.strip()
        ok = written == target.text and pid1 == target.text
        return Score(
            value=CORRECT if ok else INCORRECT,
            answer=written,
            explanation=f"the bash tool wrote {written!r}; PID 1 of the sandbox is {pid1!r}",
            metadata={
                "pid1": pid1,
                "written": written,
                "nsbox_sandbox_id": sandbox().as_type(NsboxSandboxEnvironment).sandbox.id,
                "uid": os.getuid(),
                "array_task": os.environ.get("SLURM_ARRAY_TASK_ID"),
                "job_id": os.environ.get("SLURM_JOB_ID"),
                "xdg_runtime_dir": os.environ.get("XDG_RUNTIME_DIR"),
                "runtime_dir": str(dirs.runtime_dir()),
                "id_mode": idmap.detect().mode,
            },
        )

    return score


@task
def slurm_probe() -> Task:
    return Task(
        dataset=[Sample(input="Write what PID 1 of your machine is to /root/proof.txt, then say done.",
                        target="nsbox-init")],
        solver=[use_tools(bash(timeout=60)), generate()],
        scorer=ran_in_nsbox(),
        model=scripted_model(),
    )
