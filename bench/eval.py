"""An end-to-end Inspect eval, timed: N samples, each a scripted mockllm
agent making 10 bash() and python() tool calls with small outputs, run with
--sandbox nsbox and with Inspect's unisolated `local` sandbox, alternately,
in fresh processes (python bench/eval.py [--samples N] [--rounds R]).

--wide is the concurrency row: 3 tool calls per sample, max_samples =
max_sandboxes = 500, 1000 samples (--samples and --concurrency still
override: `make bench` runs it smaller), target <= 0.80x of `local`.

The evals run with an empty HOME (--user-home: this user's), so that the
bash() tool's `bash --login` on `local` does not time this user's shell
startup files.

Prints wall time per run, the ratio's min/median/max over the rounds, the
target and PASS/FAIL, and the peak RSS of each process (ru_maxrss of the
eval process plus its children: sandboxes, tools). With --profile, writes a
cProfile of one nsbox run to bench/eval.prof.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

TASK = '''
from typing import Any
from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import ChatMessage, ChatMessageTool, ModelOutput, ModelUsage
from inspect_ai.scorer import includes
from inspect_ai.solver import generate, use_tools
from inspect_ai.tool import bash, python

STEPS = [("bash", {"command": "echo $((6*7)) > /tmp/answer && cat /tmp/answer"}),
         ("python", {"code": "print(open('/tmp/answer').read().strip())"}),
         ("bash", {"command": "ls / | wc -l"}),
         ("python", {"code": "import os; print(len(os.listdir('/')))"}),
         ("bash", {"command": "uname -s"}),
         ("python", {"code": "print(sum(range(100)))"}),
         ("bash", {"command": "head -c 100 /etc/passwd | wc -c"}),
         ("python", {"code": "import json; print(json.dumps({'answer': 42}))"}),
         ("bash", {"command": "cat /tmp/answer"}),
         ("python", {"code": "print('done')"})]

N_STEPS = len(STEPS)  # the runner sets it

def script(input: list[ChatMessage], *_: Any) -> ModelOutput:
    n = sum(isinstance(m, ChatMessageTool) for m in input)
    out = (ModelOutput.for_tool_call("mockllm/model", *STEPS[n]) if n < N_STEPS
           else ModelOutput.from_content("mockllm/model", "42"))
    out.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)
    return out

@task
def bench(samples: int = 200) -> Task:
    return Task(dataset=[Sample(input=f"q{i}", target="42", id=i) for i in range(samples)],
                solver=[use_tools([bash(), python()]), generate()], scorer=includes())
'''

RUNNER = '''
import json, resource, sys, time
from inspect_ai import eval
from inspect_ai.model import get_model
sys.path.insert(0, sys.argv[1])
import bench_task
bench_task.N_STEPS = int(sys.argv[5])
t = time.perf_counter()
[log] = eval(bench_task.bench(int(sys.argv[3])), model=get_model("mockllm/model", custom_outputs=bench_task.script),
             sandbox=sys.argv[2], display="none", log_dir=sys.argv[1] + "/logs", max_samples=int(sys.argv[4]),
             max_sandboxes=int(sys.argv[4]))
wall = time.perf_counter() - t
errors = sum(1 for s in log.samples or [] if s.error is not None)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"wall": wall, "status": log.status, "errors": errors, "peak_kib": peak,
                  "samples": len(log.samples or [])}))
'''


def environment(workdir: str, user_home: bool) -> dict[str, str]:
    """The eval's environment: with an empty HOME unless user_home. The
    bash() tool runs `bash --login`, which on `local` reads this user's
    shell startup files (root's .bashrc on the development VM runs `pyenv
    init`: 1.2 s per call) and in a sandbox the sandbox's. nsbox's and
    Inspect's state stay where they were (XDG directories)."""
    env = dict(os.environ)
    if not user_home:
        home = os.path.expanduser("~")
        env.setdefault("XDG_DATA_HOME", os.path.join(home, ".local", "share"))
        env.setdefault("XDG_CACHE_HOME", os.path.join(home, ".cache"))
        env.setdefault("XDG_CONFIG_HOME", os.path.join(home, ".config"))
        env["HOME"] = os.path.join(workdir, "home")
        os.makedirs(env["HOME"], exist_ok=True)
    return env


def run(workdir: str, sandbox: str, samples: int, concurrency: int, steps: int, user_home: bool,
        profile: bool = False) -> dict[str, float]:
    cmd = [sys.executable]
    if profile:
        cmd += ["-m", "cProfile", "-o", os.path.join(os.path.dirname(__file__), "eval.prof")]
    cmd += [os.path.join(workdir, "runner.py"), workdir, sandbox, str(samples), str(concurrency), str(steps)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=environment(workdir, user_home))
    if r.returncode != 0:
        raise SystemExit(f"{sandbox} eval failed:\n{r.stderr[-3000:]}")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    if result["status"] != "success" or result["errors"] or result["samples"] != samples:
        raise SystemExit(f"{sandbox} eval did not succeed: {result}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, help="default 200; --wide: 1000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, help="max_samples and max_sandboxes (default 32; --wide: 500)")
    parser.add_argument("--steps", type=int, help="tool calls per sample, at most 10 (default 10; --wide: 3)")
    parser.add_argument("--wide", action="store_true", help="the concurrency row: 1000 samples x 3 calls, 500 at once")
    parser.add_argument("--check", action="store_true", help="exit with status 1 if the target is missed")
    parser.add_argument("--user-home", action="store_true",
                        help="run the evals with this user's HOME (default: an empty one; see environment())")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    wide = {"samples": 1000, "concurrency": 500, "steps": 3} if args.wide else {"samples": 200, "concurrency": 32,
                                                                                "steps": 10}
    for k, v in wide.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.steps = min(args.steps, 10)
    target = 0.80 if args.wide else 1.10
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "bench_task.py"), "w") as f:
            f.write(TASK)
        with open(os.path.join(d, "runner.py"), "w") as f:
            f.write(RUNNER)
        results: dict[str, list[dict[str, float]]] = {"nsbox": [], "local": []}
        for i in range(args.rounds):
            for sandbox in ("nsbox", "local") if i % 2 == 0 else ("local", "nsbox"):
                results[sandbox].append(run(d, sandbox, args.samples, args.concurrency, args.steps, args.user_home))
                r = results[sandbox][-1]
                print(f"round {i + 1} {sandbox:5}: {r['wall']:.2f} s, peak RSS {r['peak_kib'] / 1024:.0f} MiB",
                      flush=True)
        if args.profile:
            run(d, "nsbox", args.samples, args.concurrency, args.steps, args.user_home, profile=True)
    peak = {k: statistics.median(r["peak_kib"] for r in v) / 1024 for k, v in results.items()}
    # A round's ratio: its nsbox run over its local run (run back to back).
    ratios = [a["wall"] / b["wall"] for a, b in zip(results["nsbox"], results["local"])]
    ratio = statistics.median(ratios)
    result = "PASS" if ratio <= target else "FAIL"
    home = "this user's HOME" if args.user_home else "an empty HOME"
    print(f"\n{args.samples} samples x {args.steps} tool calls, max_samples = max_sandboxes = {args.concurrency}, "
          f"{args.rounds} rounds, {home}:")
    print(f"  wall   nsbox {spread([r['wall'] for r in results['nsbox']])} s   "
          f"local {spread([r['wall'] for r in results['local']])} s (min/median/max)")
    print(f"  ratio  {spread(ratios)}x (min/median/max)   target <= {target:.2f}x at the median: {result}")
    print(f"  peak   nsbox {peak['nsbox']:.0f} MiB   local {peak['local']:.0f} MiB (eval process + largest child)")
    if args.profile:
        print("  profile: bench/eval.prof (python -m pstats bench/eval.prof)")
    return 1 if args.check and result == "FAIL" else 0


def spread(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in (min(values), statistics.median(values), max(values)))


if __name__ == "__main__":
    sys.exit(main())
