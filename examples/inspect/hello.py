"""A small Inspect task in an nsbox sandbox.

    inspect eval examples/inspect/hello.py --sandbox nsbox

runs offline: unless you pass -T scripted=false and a real --model, a
scripted mock model makes the tool calls, so the example needs no API key.
The agent writes /root/answer.txt with the bash tool and checks it with the
python tool; the scorer reads the file back from the sandbox.
"""

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import Model, ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
from inspect_ai.solver import TaskState, generate, use_tools
from inspect_ai.tool import bash, python
from inspect_ai.util import sandbox

MOCK = "mockllm/model"


def scripted_model() -> Model:
    outputs = [
        ModelOutput.for_tool_call(MOCK, "bash", {"command": "echo 42 > /root/answer.txt && uname -a"}),
        ModelOutput.for_tool_call(MOCK, "python", {"code": "print(open('/root/answer.txt').read())"}),
        ModelOutput.from_content(MOCK, "done"),
    ]
    for output in outputs:
        # Set usage, or mockllm counts tokens with tiktoken, which downloads.
        output.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)
    return get_model(MOCK, custom_outputs=outputs)


@scorer(metrics=[accuracy()])
def answer_file():
    async def score(state: TaskState, target: Target) -> Score:
        try:
            answer = (await sandbox().read_file("/root/answer.txt")).strip()
        except FileNotFoundError:
            return Score(value=INCORRECT, explanation="/root/answer.txt was not written")
        return Score(value=CORRECT if answer == target.text else INCORRECT, answer=answer)

    return score


@task
def hello(scripted: bool = True) -> Task:
    return Task(
        dataset=[Sample(input="Write the number 42 to /root/answer.txt, check it, then say done.", target="42")],
        solver=[use_tools(bash(timeout=60), python(timeout=60)), generate()],
        scorer=answer_file(),
        sandbox="nsbox",
        model=scripted_model() if scripted else None,
    )
