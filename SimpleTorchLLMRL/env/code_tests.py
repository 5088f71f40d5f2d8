"""What a code answer is tested against, in three kinds; each builds a sandbox job and judges its results.

    tests = CodeTests.from_humaneval(row)       # or from_mbpp / from_apps / from_taco / from_livecodebench,
                                                # from_asserts, from_stdio, from_answer (code_formats.py)
    job = tests.job(solution)                   # what the sandbox runs: never an expected value
    judged = tests.judge(results)               # outside: one bool per test, and why not, when not

`AssertTests` (test code, replayed here on the calls' results: code_replay.py), `CallTests` (a call and
its expected value, compared by the data set's rule) and `StdioTests` (stdout compared token by token).
`results`: index -> ("ok", value), ("opaque", why), ("error", why), ("out", text, exit code), ("timeout",).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from SimpleTorchLLMRL.env.code_replay import Recording, RemoteCall, TestProgram, replay

COMPARES = ("python", "apps", "json")


@dataclass(frozen=True)
class Judged:
    """One run's verdict per test; `reason` says why tests failed as a whole (None when each was judged)."""

    passed: tuple[bool, ...]
    reason: str | None = None
    unsplit: bool = False  # the tests could not be decided outside (code_replay.py)

    @property
    def fraction(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0

    @property
    def all(self) -> bool:
        return bool(self.passed) and all(self.passed) and self.reason is None


class CodeTests:
    """Base of the three kinds; the constructors for each data set's format are attached in code_formats.py."""

    kind: str = ""
    question: str | None = None
    seconds_per_case: float | None = None

    def __len__(self) -> int:
        raise NotImplementedError

    def job(self, solution: str) -> dict:
        raise NotImplementedError

    def judge(self, results: dict[int, tuple]) -> Judged:
        raise NotImplementedError

    def inside_job(self, solution: str) -> dict | None:
        """The tests run after the solution, inside (the opt-in for tests that do not split); None: no such mode."""
        return None


@dataclass(frozen=True, eq=False)
class AssertTests(CodeTests):
    program: TestProgram
    recording: Recording
    inside_prelude: str = ""  # the data set's code the solution may rely on (HumanEval's prompt, MBPP's imports)
    kind: str = "asserts"
    question: str | None = None

    def __len__(self) -> int:
        return self.recording.asserts

    def job(self, solution: str) -> dict:
        return {"mode": "calls", "prelude": self.inside_prelude, "solution": solution,
                "calls": [c.to_json() for c in self.recording.calls]}

    def judge(self, results: dict[int, tuple]) -> Judged:
        outcome = replay(self.program, self.recording, results)
        passed = list(outcome.passed[: len(self)]) + [False] * (len(self) - len(outcome.passed))
        return Judged(tuple(passed), outcome.reason, outcome.unsplit)

    def inside_job(self, solution: str) -> dict:
        tree = _CountAsserts().visit(ast.parse(self.program.tests))
        tests = ast.unparse(ast.fix_missing_locations(tree)) + "\n" + self.program.entry
        return {"mode": "inside", "prelude": self.inside_prelude, "solution": solution, "tests": tests}


class _CountAsserts(ast.NodeTransformer):
    def visit_Assert(self, node):
        seen = ast.Expr(ast.Call(ast.Name("_stlr_seen", ast.Load()), [], []))
        return [ast.copy_location(seen, node), node]


@dataclass(frozen=True, eq=False)
class CallTests(CodeTests):
    calls: tuple[RemoteCall, ...]
    expected: tuple[Any, ...]
    compare: str = "python"  # "python": ==; "apps": APPS's rule; "json": tuples as lists, then ==
    prelude: str = ""
    kind: str = "calls"
    question: str | None = None

    def __post_init__(self):
        if self.compare not in COMPARES:
            raise ValueError(f"CallTests compare must be one of {COMPARES}, got {self.compare!r}")
        if not self.calls or len(self.calls) != len(self.expected):
            raise ValueError(f"CallTests needs one expected value per call, got {len(self.calls)} calls and "
                             f"{len(self.expected)} values")

    def __len__(self) -> int:
        return len(self.calls)

    def job(self, solution: str) -> dict:
        return {"mode": "calls", "prelude": self.prelude, "solution": solution,
                "calls": [c.to_json() for c in self.calls]}

    def judge(self, results: dict[int, tuple]) -> Judged:
        passed = []
        for k, want in enumerate(self.expected):
            got = results.get(k)
            passed.append(got is not None and got[0] == "ok" and same(got[1], want, self.compare))
        return Judged(tuple(passed))


@dataclass(frozen=True, eq=False)
class StdioTests(CodeTests):
    stdin: tuple[str, ...]
    stdout: tuple[str, ...]
    prelude: str = ""
    kind: str = "stdio"
    question: str | None = None
    seconds_per_case: float | None = None  # None: the sandbox's timeout bounds the whole run

    def __post_init__(self):
        if not self.stdin or len(self.stdin) != len(self.stdout):
            raise ValueError(f"StdioTests needs one expected output per input, got {len(self.stdin)} inputs and "
                             f"{len(self.stdout)} outputs")

    def __len__(self) -> int:
        return len(self.stdin)

    def job(self, solution: str) -> dict:
        return {"mode": "stdio", "prelude": self.prelude, "solution": solution, "cases": list(self.stdin),
                "case_seconds": self.seconds_per_case or 1e9}

    def judge(self, results: dict[int, tuple]) -> Judged:
        passed = []
        for k, want in enumerate(self.stdout):
            got = results.get(k)
            passed.append(got is not None and got[0] == "out" and got[2] == 0 and same_output(got[1], want))
        return Judged(tuple(passed))


def top_level_names(src: str) -> set[str]:
    """Names a module's top level binds: defs, classes, imports, assignments."""
    names = set()
    for node in ast.parse(src).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def same_output(got: str, want: str) -> bool:
    """Program output against the expected text, token by token (spaces and line ends do not matter)."""
    return got.split() == want.split()


def _as_json(value: Any) -> Any:
    """Tuples as lists, all the way down (what JSON-born expected values look like)."""
    if isinstance(value, (list, tuple)):
        return [_as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    return value


def same(got: Any, want: Any, compare: str = "python") -> bool:
    """Does a decoded result equal the expected value, by the data set's rule? Never raises.

    python: `got == want`. json: tuples compare as lists (LiveCodeBench). apps: as json, or equal to the
    only element of a one-element expected list (APPS / TACO wrap call results in a list).
    """
    try:
        if compare == "python":
            return bool(got == want)
        got = _as_json(got)
        if bool(got == want):
            return True
        return compare == "apps" and isinstance(want, list) and len(want) == 1 and bool(got == want[0])
    except Exception:  # noqa: BLE001  (numpy's ambiguous truth, a NaN's type quirk: not equal)
        return False
