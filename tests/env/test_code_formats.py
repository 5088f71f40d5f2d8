"""CodeEnv reads each code data set's test format by its meaning (rows written in the published schemas of
MBPP, APPS / TACO and LiveCodeBench; HumanEval's real rows are in test_humaneval.py), takes every verdict
outside the sandbox, and refuses what it cannot read. Each attack here scored 1.0 before (main at 14d1366)."""

import base64
import json
import pickle
import warnings
import zlib

import pytest

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.env.code import CodeEnv, parse_report
from SimpleTorchLLMRL.env.code_tests import CallTests, CodeTests, StdioTests
from SimpleTorchLLMRL.env.tool_use import ToolEpisode
from SimpleTorchLLMRL.tools.sandbox import PythonSandbox

NOT_A_SOLUTION = "print('I did not write add()')\n"

# MBPP (Austin et al. 2021), original schema: text, code, task_id, test_setup_code, test_list, challenge_test_list
MBPP_ROW = {
    "text": "Write a function to find the similar elements from the given two tuple lists.",
    "code": "def similar_elements(test_tup1, test_tup2):\r\n  res = tuple(set(test_tup1) & set(test_tup2))\r\n  return (res) ",
    "task_id": 2, "test_setup_code": "", "challenge_test_list": [],
    "test_list": ["assert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)",
                  "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))",
                  "assert set(similar_elements((11, 12, 14, 13),(17, 15, 14, 13))) == set((13, 14))"],
}
# MBPP sanitized schema: source_file, task_id, prompt, code, test_imports, test_list
MBPP_SANITIZED_ROW = {
    "source_file": "Benchmark Questions Verification V2.ipynb", "task_id": 17,
    "prompt": "Write a function to find the volume of a cone.",
    "code": "import math\ndef volume_cone(r, h):\n  return (1.0 / 3) * math.pi * r * r * h",
    "test_imports": ["import math"],
    "test_list": ["assert math.isclose(volume_cone(5,12), 314.15926535897927, rel_tol=0.001)",
                  "assert math.isclose(volume_cone(10,15), 1570.7963267948965, rel_tol=0.001)"],
}
APPS_STDIN_ROW = {
    "problem_id": 4001, "question": "Read n and n integers; print their sum.", "solutions": "[]",
    "starter_code": "", "difficulty": "introductory", "url": "https://example.invalid/1",
    "input_output": json.dumps({"inputs": ["3\n1 2 3\n", "1\n-5\n"], "outputs": ["6\n", "-5\n"]}),
}
APPS_CALL_ROW = {  # call-based: fn_name, inputs[i] the arguments, outputs[i] the result wrapped in a list
    "problem_id": 2650, "question": "Return the pair of indices whose values add up to target.", "solutions": "[]",
    "starter_code": "def two_sum(nums, target):", "difficulty": "interview", "url": "https://example.invalid/2",
    "input_output": json.dumps({"fn_name": "two_sum", "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]],
                                "outputs": [[[0, 1]], [[1, 2]]]}),
}
TWO_SUM = ("def two_sum(nums, target):\n    seen = {}\n    for i, x in enumerate(nums):\n"
           "        if target - x in seen:\n            return (seen[target - x], i)\n        seen[x] = i\n")
TWO_SUM_CLASS = ("class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
                 "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
                 "                return (seen[target - x], i)\n            seen[x] = i\n")


def _private(cases: list) -> str:  # LiveCodeBench's release files: base64(zlib(pickle(json text)))
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()


LCB_FUNCTIONAL_ROW = {
    "question_title": "Two Sum", "question_content": "Return indices of the two numbers adding up to target.",
    "platform": "leetcode", "question_id": "1", "contest_id": "weekly-contest-1", "contest_date": "2023-05-01T00:00:00",
    "starter_code": "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        ",
    "difficulty": "easy",
    "public_test_cases": json.dumps([{"input": "[2,7,11,15]\n9", "output": "[0, 1]", "testtype": "functional"}]),
    "private_test_cases": _private([{"input": "[3,2,4]\n6", "output": "[1, 2]", "testtype": "functional"}]),
    "metadata": json.dumps({"func_name": "twoSum"}),
}
LCB_STDIN_ROW = {
    "question_title": "A+B", "question_content": "Print A+B.", "platform": "atcoder", "question_id": "abc000_a",
    "contest_id": "abc000", "contest_date": "2023-05-01T00:00:00", "starter_code": "", "difficulty": "easy",
    "public_test_cases": json.dumps([{"input": "2 3\n", "output": "5\n", "testtype": "stdin"}]),
    "private_test_cases": _private([{"input": "10 -4\n", "output": "6\n", "testtype": "stdin"}]),
    "metadata": "{}",
}
HUMANEVAL_LIKE = {  # the HumanEval schema; its real rows run in test_humaneval.py
    "task_id": "Local/0", "entry_point": "add",
    "prompt": "def add(x: int, y: int) -> int:\n    \"\"\"Add two numbers.\"\"\"\n",
    "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate(2, 3) == 5\n"
            "    assert abs(candidate(1.5, 1.0) - 2.5) < 1e-6\n    assert candidate(2, 3) in (5, 6)\n",
    "canonical_solution": "    return x + y\n",
}


@pytest.fixture(scope="module")
def env():
    return CodeEnv(PythonSandbox(timeout=10), workers=2)


def verdict(env, solution: str, tests):
    rollout = Rollout([Message(f"```python\n{solution}\n```", MessageType.MODEL)])
    return env.verdict(rollout, ToolEpisode(answer=tests))


# ---- each format, right and wrong ------------------------------------------------------------------------

CASES = {
    "mbpp": (MBPP_ROW, MBPP_ROW["code"], "def similar_elements(a, b):\n    return tuple(set(a) | set(b))\n"),
    "mbpp-sanitized": (MBPP_SANITIZED_ROW, MBPP_SANITIZED_ROW["code"],
                       "import math\ndef volume_cone(r, h):\n    return math.pi * r * r * h\n"),
    "mbpp test_list": (MBPP_ROW["test_list"], MBPP_ROW["code"], "def similar_elements(a, b):\n    return ()\n"),
    "apps stdin": (APPS_STDIN_ROW, "input()\nprint(sum(map(int, input().split())))\n",
                   "input()\nprint(max(map(int, input().split())))\n"),
    "apps call": (APPS_CALL_ROW, TWO_SUM, "def two_sum(nums, target):\n    return [0, 1]\n"),
    "taco class Solution": ({**APPS_CALL_ROW, "input_output": json.loads(APPS_CALL_ROW["input_output"]) | {
        "fn_name": "twoSum"}}, TWO_SUM_CLASS, "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1]\n"),
    "livecodebench functional": (LCB_FUNCTIONAL_ROW, TWO_SUM_CLASS, "class Solution:\n    def twoSum(self, n, t):\n"
                                                                   "        return [0, 1]\n"),
    "livecodebench stdin": (LCB_STDIN_ROW, "a, b = map(int, input().split())\nprint(a + b)\n",
                            "a, b = map(int, input().split())\nprint(a - b + 2)\n"),
    "humaneval schema": (HUMANEVAL_LIKE, HUMANEVAL_LIKE["prompt"] + HUMANEVAL_LIKE["canonical_solution"],
                         HUMANEVAL_LIKE["prompt"] + "    return 5\n"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_format_pays_the_right_solution_and_not_the_wrong_one_or_a_print(env, name):
    tests, right, wrong = CASES[name]
    assert verdict(env, right, tests).reward == 1.0, verdict(env, right, tests)
    assert verdict(env, wrong, tests).reward == 0.0
    assert verdict(env, NOT_A_SOLUTION, tests).reward == 0.0


def test_the_constructors_name_their_format_and_question():
    assert CodeTests.from_mbpp(MBPP_ROW).kind == "mbpp" and "similar elements" in CodeTests.from_mbpp(MBPP_ROW).question
    apps = CodeTests.from_apps(APPS_CALL_ROW)
    assert isinstance(apps, CallTests) and apps.compare == "apps" and len(apps) == 2
    assert isinstance(CodeTests.from_taco(APPS_STDIN_ROW), StdioTests)
    lcb = CodeTests.from_livecodebench(LCB_FUNCTIONAL_ROW)
    assert len(lcb) == 2 and lcb.calls[0].method_of == "Solution"  # the private case was decompressed
    assert CodeTests.from_humaneval(HUMANEVAL_LIKE).question == HUMANEVAL_LIKE["prompt"]
    assert len(CodeTests.from_humaneval(HUMANEVAL_LIKE)) == 3


def test_rows_from_parquet_arrive_with_numpy_lists_and_nan_cells(env):
    np = pytest.importorskip("numpy")
    row = {**MBPP_SANITIZED_ROW, "test_list": np.array(MBPP_SANITIZED_ROW["test_list"], dtype=object),
           "test_imports": np.array(["import math"], dtype=object), "test_setup_code": float("nan")}
    assert verdict(env, MBPP_SANITIZED_ROW["code"], row).reward == 1.0


# ---- what used to run as text and pay ---------------------------------------------------------------------

@pytest.mark.parametrize("tests", ["", [], "   ", {"question": "q"}, [1, 2], {"inputs": [], "outputs": []},
                                   {"test": "def check(candidate):\n    pass\n", "entry_point": "f", "prompt": ""},
                                   "assert True", "x = 1", {"input_output": "not json"}, [{"stdin": 1}]])
def test_tests_of_no_known_shape_are_refused_at_setup_never_paid(env, tests):
    with pytest.raises(ValueError, match="accepted|tests|row|cases|input_output|check"):
        env.setup("Write add(a, b).", tests)
    with pytest.raises(ValueError):
        verdict(env, NOT_A_SOLUTION, tests)


@pytest.mark.parametrize("missing", [None, float("nan"), "  "])
def test_a_missing_ground_truth_is_refused_by_name(env, missing):
    with pytest.raises(ValueError, match="missing|blank|NaN|None"):
        env.setup("q", missing)
    rollout = Rollout([Message("```python\nprint(1)\n```", MessageType.MODEL)], metadata={
        "env_state": ToolEpisode(answer=missing)})
    with pytest.raises(ValueError, match="row 0"):
        env.score([rollout])


def test_a_program_that_forges_a_deep_report_scores_zero_and_never_raises(env):
    forge = ("import os, sys\n_f = sys._getframe()\n"
             "while _f is not None and 'nonce' not in _f.f_locals:\n    _f = _f.f_back\n"
             "os.write(4, _f.f_locals['nonce'] + b'\\n' + b'[' * 2000 + b'\\n' + b'{' * 5000 + b'\\n')\n"
             "os.write(4, b'[0, \"ok\", ' + b'\"l\", 1, ' * 3000 + b'\"N\"]\\n')\nos._exit(0)\n")
    v = verdict(env, forge, "assert add(2, 3) == 5")
    assert v.reward == 0.0 and v.reason is not None


def test_parse_report_never_raises_on_what_a_program_writes():
    nonce = b"n" * 32
    for body in [b"[" * 100000, b"\xff\xfe", b'[0, "ok", "i", "0xzz"]', b'[0, "ok", "N"]\n[0, "ok", "N"]',
                 b'["end", "x"]', b'[0, "out", 1, 2]', b"[]", b'[0, "ok"' + b', "l", 1' * 10**5 + b']']:
        results, _ = parse_report(nonce + b"\n" + body, nonce)
        assert all(r[0] in ("error", "ok", "end") or isinstance(r[0], int) for r in results.values())
    assert parse_report(nonce + b'\n[0, "ok", "N"]\n[0, "ok", "N"]', nonce)[0][0] == ("error", "reported twice")


EQUAL_TO_EVERYTHING = """
class A:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __lt__ = __le__ = __gt__ = __ge__ = __eq__
    def __sub__(self, other): return self
    def __abs__(self): return self
    def __bool__(self): return True
    def __hash__(self): return 0
def f(*args): return A()
add = candidate = f
"""


@pytest.mark.parametrize("tests", ["assert abs(f(1.5, 1.0) - 2.5) < 1e-6", "assert f(2, 3) in (5, 6)",
                                   "assert f(2, 3) == 5", "assert not f(1) != 3", "assert sorted(f(1)) == [1]",
                                   "assert f(1) is True or f(1) == 1", HUMANEVAL_LIKE])
def test_an_object_that_agrees_with_everything_scores_zero(env, tests):
    assert verdict(env, EQUAL_TO_EVERYTHING, tests).reward == 0.0


@pytest.mark.parametrize("solution,tests", [
    ("from collections import Counter\ndef f(s):\n    return Counter(s)", "assert f('aab') == {'a': 2, 'b': 1}"),
    ("from collections import namedtuple\nP = namedtuple('P', 'x y')\ndef f():\n    return P(1, 2)",
     "assert f() == (1, 2)\nassert f().y == 2"),
    ("import numpy as np\ndef f():\n    return np.int64(3)", "assert f() == 3"),
    ("from fractions import Fraction\ndef f():\n    return Fraction(1, 3)",
     "from fractions import Fraction\nassert f() == Fraction(1, 3)"),
    ("def f():\n    return frozenset({1, 2})", "assert f() == {1, 2}"),
    ("def f():\n    return float('inf')", "assert f() == float('inf')\nassert f() > 10 ** 300"),
    ("from decimal import Decimal\ndef f():\n    return Decimal('0.1')", "assert float(f()) == 0.1"),
    ("def f(xs):\n    xs.append(1)\n    return xs", "xs = [0]\nassert f(xs) == [0, 1]\nassert f(xs) == [0, 1]"),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n        self.items.append(x)\n"
     "    def size(self):\n        return len(self.items)", "s = Stack()\ns.push(1)\nassert s.size() == 1"),
])
def test_correct_solutions_of_every_value_type_score_one(env, solution, tests):
    assert verdict(env, solution, tests).reward == 1.0, verdict(env, solution, tests)


@pytest.mark.parametrize("read", ["input()", "sys.stdin.readline()", "sys.stdin.buffer.read().decode()",
                                  "open(0).read()", "os.read(0, 100).decode()", "sys.stdin.read()"])
def test_stdin_is_the_cases_input_however_it_is_read(env, read):
    program = f"import os, sys\na, b = map(int, {read}.split())\nsys.stdout.buffer.write(str(a + b).encode())\n"
    cases = [{"stdin": "2 3\n", "stdout": "5\n"}, {"stdin": "-4 4\n", "stdout": "0"}]
    assert verdict(env, program, cases).reward == 1.0


def test_the_harness_is_not_on_fd_0_for_calls(env):
    solution = "import os\ndata = os.read(0, 1 << 20)\ndef f():\n    return data\n"
    assert verdict(env, solution, "assert f() == b''").reward == 1.0


def test_a_stdio_case_that_hangs_fails_alone():
    env = CodeEnv(PythonSandbox(timeout=20), reward="fraction")
    tests = CodeTests.from_stdio([{"stdin": "1", "stdout": "1"}, {"stdin": "loop", "stdout": "x"},
                                  {"stdin": "3", "stdout": "3"}], seconds_per_case=1.0)
    program = "s = input()\nwhile s == 'loop':\n    pass\nprint(s)\n"
    v = verdict(env, program, tests)
    assert v.reward == pytest.approx(2 / 3) and v.passed == 2


def test_a_report_over_its_limit_fails_what_it_cut_and_never_raises():
    env = CodeEnv(PythonSandbox(timeout=20), max_report_bytes=8192)
    assert verdict(env, "def f():\n    return list(range(100000))", "assert len(f()) == 100000").reward == 0.0
    assert verdict(env, "def f():\n    return list(range(10))", "assert len(f()) == 10").reward == 1.0


def test_partial_credit_counts_each_assert():
    env = CodeEnv(PythonSandbox(timeout=10), reward="fraction")
    assert verdict(env, "def add(a, b):\n    return 5", "assert add(2, 3) == 5\nassert add(1, 1) == 2").reward == 0.5


def test_tests_whose_calls_depend_on_results_pay_nothing_unless_run_inside():
    tests = "x = f(1)\nassert f(x + 1) == 4"  # the second call's argument is computed from the first result
    right = "def f(x):\n    return x + 1"
    with pytest.warns(UserWarning, match="unsplit='inside'"):
        v = verdict(CodeEnv(PythonSandbox(timeout=10)), right, tests)
    assert v.reward == 0.0 and v.unsplit
    inside = CodeEnv(PythonSandbox(timeout=10), unsplit="inside")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert verdict(inside, right, tests).reward == 1.0
        assert verdict(inside, "def f(x):\n    return x", tests).reward == 0.0
        assert verdict(inside, "def f(x):\n    return x + 1\nimport os\nos._exit(0)", tests).reward == 0.0
    with pytest.raises(ValueError, match="unsplit"):
        CodeEnv(unsplit="maybe")


def test_score_runs_in_parallel_and_agrees_with_one_at_a_time(env):
    solutions = [MBPP_ROW["code"], NOT_A_SOLUTION, "def similar_elements(a, b):\n    return (4, 5)"] * 2
    rollouts = [Rollout([Message(f"```python\n{s}\n```", MessageType.MODEL)],
                        metadata={"env_state": ToolEpisode(answer=CodeTests.from_mbpp(MBPP_ROW))}) for s in solutions]
    scores = env.score(rollouts)
    one_by_one = [env.reward(r, r.metadata["env_state"]) for r in rollouts]
    assert scores.rewards.tolist() == one_by_one == [1.0, 0.0, 0.0] * 2
    assert scores.metrics["code/reward"] == pytest.approx(1 / 3)
    assert scores.verdicts[2].passed == 1 and scores.verdicts[2].total == 3
    with pytest.raises(ValueError, match="workers"):
        CodeEnv(workers=0)


@pytest.mark.parametrize("solution,tests,reward", [
    ("def max(x):\n    return x * x", "assert max(3) == 9", 1.0),  # the solution's max, not the builtin
    ("def max(x):\n    return 3", "assert max(3) == 9", 0.0),
    ("def string(n):\n    return str(n)", "assert string(5) == '5'", 1.0),  # a stdlib module's name
    ("def f(xs):\n    return sorted(xs)", "assert f([2, 1]) == sorted([1, 2])", 1.0),  # the builtin, on the host
])
def test_a_solution_may_name_its_function_as_a_builtin_or_a_module(env, solution, tests, reward):
    assert verdict(env, solution, tests).reward == reward


def test_a_data_sets_test_that_exits_is_an_error_not_an_exit():
    with pytest.raises(ValueError, match="SystemExit"):
        CodeTests.from_asserts("import sys\nsys.exit(0)\nassert f(1) == 1")
    tests = CodeTests.from_asserts("assert f(1) == 1\nimport sys\nsys.exit(0)\nassert f(2) == 2")
    with pytest.warns(UserWarning, match="SystemExit"):  # tests that end half-way cannot be split: they pay 0
        v = verdict(CodeEnv(PythonSandbox(timeout=10)), "def f(x):\n    return x", tests)
    assert v.reward == 0.0 and v.unsplit


def test_reward_takes_the_tests_themselves_as_the_state(env):
    rollout = Rollout([Message("```python\ndef add(a, b):\n    return a + b\n```", MessageType.MODEL)])
    assert env.reward(rollout, CodeTests.from_asserts("assert add(2, 3) == 5")) == 1.0
    assert env.reward(rollout, MBPP_ROW) == 0.0  # a row of its data set: add is not similar_elements
