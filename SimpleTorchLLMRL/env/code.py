"""`CodeEnv`: the model writes Python, the sandbox runs it, and the verdict is taken outside.

    env = CodeEnv(max_turns=3)
    rollouts = collect_rollouts(gen, env, [CodeTests.from_answer(r).question for r in rows], rows)
    scores = env.score(rollouts)                              # the sandbox runs in parallel (workers=...)
    scores.rewards, scores.metrics, scores.verdicts           # (B,) tensor, counts, one Verdict per rollout

The last ```python block is tested against the row's tests (code_formats.py). The sandbox only computes
values, sent back as typed data (code_codec.py); every comparison runs here (code_replay.py, code_tests.py)
and expected values never enter the sandbox. A run that breaks scores 0 with its reason (docs/rewards.md).
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from SimpleTorchLLMRL.chat.message import MessageType, Rollout
from SimpleTorchLLMRL.env.code_codec import Budget, CodecError, decode
from SimpleTorchLLMRL.env.code_formats import from_answer
from SimpleTorchLLMRL.env.code_tests import CodeTests
from SimpleTorchLLMRL.env.tool_use import ToolEpisode, ToolUseEnv
from SimpleTorchLLMRL.tools.parsers import CodeBlockParser
from SimpleTorchLLMRL.tools.registry import ToolRegistry
from SimpleTorchLLMRL.tools.sandbox import PythonSandbox, python_tool
from SimpleTorchLLMRL.utils.warn import warn_user

DEFAULT_CODE_PROMPT = (
    "You are a careful Python programmer. Write your solution in a ```python code block. "
    "Each block is run and what it prints comes back to you, so you can test your code. "
    "Your last code block is checked against hidden tests."
)
_UNSPLIT = ("zero", "inside")
_NO_CODE = "no ```python block"
_ESCAPES = re.compile(r"\\.", re.DOTALL)  # a backslash and the character after it
_STRINGS = re.compile(r'"[^"]*"')  # once escapes are gone: each match ends at the next quote (linear)


@dataclass(frozen=True)
class Verdict:
    """One rollout's reward and how it was reached. reason: why tests failed as a whole (None: each was judged)."""

    reward: float
    passed: int
    total: int
    reason: str | None = None
    unsplit: bool = False


@dataclass(frozen=True)
class CodeScores:
    rewards: torch.Tensor  # (B,) float32
    verdicts: list[Verdict]
    metrics: dict[str, float]


def last_code_block(rollout: Rollout) -> str | None:
    """The last ```python block of the last MODEL message that has one."""
    parser = CodeBlockParser()
    for m in reversed(rollout.messages):
        if m.type is MessageType.MODEL:
            blocks = parser.parse(m.content)
            if blocks:
                return blocks[-1].text
    return None


@functools.cache
def _harness_source() -> str:
    here = Path(__file__).parent
    return (here / "code_codec.py").read_text() + "\n" + (here / "code_harness.py").read_text()


def harness_program(job: dict) -> str:
    """The whole program a sandbox run executes for `job` (code_harness.py)."""
    return f"{_harness_source()}\n_stlr_main({_literal(job)})\n"


def _literal(value: Any) -> str:
    """`value` (dicts, lists, str, int, float, bool, None: a job) as Python source; JSON floats spelled out."""
    return repr(json.loads(json.dumps(value, allow_nan=False)))


def _flat_json_array(line: str) -> bool:
    """A JSON array with no array or object inside it (checked without parsing: no depth to exhaust), in
    two linear passes: escapes out, then strings out (a quadratic regex let a line of escaped quotes stall)."""
    bare = _STRINGS.sub("", _ESCAPES.sub("", line))
    return bare.startswith("[") and bare.endswith("]") and bare.count("[") == 1 and "{" not in bare


def parse_report(report: bytes, nonce: bytes, seconds: float | None = None) -> tuple[dict[Any, tuple], str | None]:
    """{index: result} from the harness's report (code_tests.py lists the results), and what was wrong with
    it, if anything. Never raises: a line that is not one flat JSON array is skipped; an index reported
    twice is an error for that index. Linear in the report's size (code_codec.Budget bounds what values
    cost); past `seconds` (None: no deadline) the lines not yet read are left out, and the problem says so."""
    head, _, body = report.partition(b"\n")
    if head != nonce:
        return {}, "the program left no report (it ended before the harness ran)"
    budget = Budget(seconds)
    results: dict[Any, tuple] = {}
    problem = None
    for raw in body.split(b"\n"):
        if not raw:
            continue
        try:
            budget.check_time()
        except CodecError:
            return results, f"the report took over {seconds:g} s to read: the rest was left out"
        try:
            line = raw.decode("utf-8")
            item = json.loads(line) if _flat_json_array(line) else None
        except (UnicodeDecodeError, ValueError):
            item = None
        if not item or not isinstance(item[0], (int, str)) or len(item) < 2:
            problem = problem or "a report line is not a flat JSON array (cut short, or forged)"
            continue
        key, value = item[0], _result(item, budget)
        results[key] = ("error", "reported twice") if key in results else value
    return results, problem


def _result(item: list, budget: Budget) -> tuple:
    kind = item[1]
    if kind == "ok":
        try:
            return ("ok", decode(item[2:], budget=budget))
        except CodecError as e:
            return ("error", f"the result does not decode: {e}")
    if kind in ("opaque", "error") and len(item) == 3 and isinstance(item[2], str):
        return (kind, item[2])
    if kind == "out" and len(item) == 4 and isinstance(item[2], str) and type(item[3]) is int:
        return ("out", item[2], item[3])
    if kind == "timeout" or (item[0] == "end" and type(item[1]) is int):
        return tuple(item[1:]) if item[0] == "end" else ("timeout",)
    return ("error", "a report line of an unknown kind")


class CodeEnv(ToolUseEnv):
    """Python code blocks as tool calls, rewarded by tests judged outside the sandbox (module docstring).

    sandbox:          the PythonSandbox that runs the code (default limits when None)
    run_code:         False: never execute during the episode (single-shot generation, reward only)
    reward:           "all" (1.0 when every test passes) or "fraction" (the fraction that pass)
    unsplit:          "zero" (tests that cannot be judged outside pay nothing) or "inside" (run them inside)
    workers:          sandbox runs at once in `score` (default: the CPU count, at most 8)
    max_report_bytes: the most a run may report (results and stdout); a longer report fails what it cut
    """

    def __init__(self, sandbox: PythonSandbox | None = None, custom_sys_prompt: str | None = None,
                 max_turns: int = 3, *, run_code: bool = True, reward: str = "all", unsplit: str = "zero",
                 workers: int | None = None, max_report_bytes: int = 4 << 20):
        if reward not in ("all", "fraction"):
            raise ValueError(f"CodeEnv reward must be 'all' or 'fraction', got {reward!r}")
        if unsplit not in _UNSPLIT:
            raise ValueError(f"CodeEnv unsplit must be one of {_UNSPLIT}, got {unsplit!r}")
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ValueError(f"CodeEnv workers must be an int >= 1 or None, got {workers!r}")
        if isinstance(max_report_bytes, bool) or not isinstance(max_report_bytes, int) or max_report_bytes < 4096:
            raise ValueError(f"CodeEnv max_report_bytes must be an int >= 4096, got {max_report_bytes!r}")
        self.reward_mode, self.unsplit, self.max_report_bytes = reward, unsplit, max_report_bytes
        self.workers = workers if workers is not None else max(1, min(8, os.cpu_count() or 1))
        self.sandbox = sandbox if sandbox is not None else PythonSandbox()
        registry = ToolRegistry([python_tool(self.sandbox)], formats=("python",))
        super().__init__(registry, DEFAULT_CODE_PROMPT if custom_sys_prompt is None else custom_sys_prompt,
                         max_turns=max_turns if run_code else 1, expose_schemas=False)
        self.run_code = run_code
        self._warned_unsplit = False

    def setup(self, question: Any, answer: Any = None):
        """The episode's first messages; the answer is read into CodeTests here (ValueError for unknown shapes)."""
        return super().setup(question, from_answer(answer))

    def reward(self, rollout: Rollout, state: ToolEpisode | Any) -> float:
        """The last code block against the episode's tests (module docstring)."""
        return self.verdict(rollout, state).reward

    def verdict(self, rollout: Rollout, state: ToolEpisode | Any) -> Verdict:
        """How the last code block fares against the tests. ValueError only for tests of an unknown shape."""
        tests = from_answer(getattr(state, "answer", state))  # an episode's state, or the tests themselves
        code = last_code_block(rollout)
        if code is None:
            return Verdict(0.0, 0, len(tests), _NO_CODE)
        if len(code) > self.sandbox.max_code_chars:
            return Verdict(0.0, 0, len(tests), f"the code is over {self.sandbox.max_code_chars} characters")
        results, problem = self._run(tests.job(code))
        try:
            judged = tests.judge(results)
        except Exception as e:  # noqa: BLE001  (what the program reported cannot break the reward)
            return Verdict(0.0, 0, len(tests), f"the results could not be judged: {type(e).__name__}: {e}")
        if judged.unsplit:
            return self._unsplit(tests, code, judged.reason)
        reward = judged.fraction if self.reward_mode == "fraction" else float(judged.all)
        reason = judged.reason or (problem if not judged.all else None)
        if reason is None and not any(judged.passed):  # say why, when nothing passed: the first error
            reason = next((r[1] for r in results.values() if r[0] == "error"), None)
        return Verdict(reward, sum(judged.passed), len(tests), reason)

    def score(self, rollouts: list[Rollout], states: list[Any] | None = None) -> CodeScores:
        """Verdicts for a batch, `workers` sandbox runs at a time. states: default each `metadata["env_state"]`."""
        states = [r.metadata["env_state"] for r in rollouts] if states is None else list(states)
        if len(states) != len(rollouts):
            raise ValueError(f"got {len(rollouts)} rollouts but {len(states)} states")
        tests = []
        for i, s in enumerate(states):  # read once, here: bad tests fail naming the row, before any run
            try:
                tests.append(from_answer(getattr(s, "answer", s)))
            except ValueError as e:
                raise ValueError(f"row {i}: {e}") from None
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            verdicts = list(pool.map(self.verdict, rollouts, tests))
        n = max(1, len(verdicts))
        metrics = {
            "code/reward": sum(v.reward for v in verdicts) / n,
            "code/tests_passed": sum(v.passed for v in verdicts) / max(1, sum(v.total for v in verdicts)),
            "code/no_code": sum(v.reason == _NO_CODE for v in verdicts) / n,
            "code/unsplit": float(sum(v.unsplit for v in verdicts)),
            "code/failed_runs": float(sum(v.reason not in (None, _NO_CODE) and not v.unsplit for v in verdicts)),
        }
        return CodeScores(torch.tensor([v.reward for v in verdicts], dtype=torch.float32), verdicts, metrics)

    def _unsplit(self, tests: CodeTests, code: str, why: str | None) -> Verdict:
        if self.unsplit == "zero":
            if not self._warned_unsplit:
                self._warned_unsplit = True
                warn_user(f"CodeEnv: tests that cannot be judged outside the sandbox pay nothing ({why}); "
                          "CodeEnv(unsplit='inside') runs them inside instead (see docs/rewards.md)")
            return Verdict(0.0, 0, len(tests), why, unsplit=True)
        results, problem = self._run(tests.inside_job(code))
        seen = results.get("end")
        ran = seen is not None and isinstance(seen[0], int) and seen[0] >= 1
        return Verdict(float(ran), len(tests) if ran else 0, len(tests),
                       None if ran else (problem or "the tests did not run to their end inside"), unsplit=True)

    def _run(self, job: dict) -> tuple[dict[Any, tuple], str | None]:
        """The harness's results for `job`, and what went wrong with the run, if anything. Never raises."""
        nonce = secrets.token_hex(16).encode()
        program = harness_program(job)
        try:  # the limit applies to the model's code, not to the harness and the job around it
            box = replace(self.sandbox, max_code_chars=max(len(program), self.sandbox.max_code_chars))
            run = box.run(program, secret=nonce, report_limit=self.max_report_bytes)
        except Exception as e:  # noqa: BLE001  (a sandbox failure scores nothing)
            return {}, f"the sandbox failed: {type(e).__name__}: {e}"
        results, problem = parse_report(run.report, nonce, seconds=self.sandbox.timeout)
        if run.timed_out:
            problem = f"the run timed out after {self.sandbox.timeout:g} s"
        elif run.error is not None:
            problem = f"sandbox: {run.error}"
        return results, problem
