"""CodeEnv's verdict is taken outside the sandbox: a wrong solution scores 0 whatever it patches or reads inside.

Before outputs were compared by the caller, the tests ran in the solution's interpreter, and a wrong
solution that replaced `builtins.compile` or `builtins.exec` (the tests became `pass`) or read the tests
from fd 0 scored 1.0."""

import pytest

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.env.code import CodeEnv
from SimpleTorchLLMRL.env.tool_use import ToolEpisode
from SimpleTorchLLMRL.tools.sandbox import PythonSandbox

TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 20) == 30"
WRONG = "def add(a, b):\n    return a - b\n"
RIGHT = "def add(a, b):\n    return a + b\n"

HACKS = {
    "builtins.compile -> pass": WRONG + "import builtins\n_c = builtins.compile\n"
                                       "builtins.compile = lambda s, f, m, *a, **k: _c('pass', f, 'exec')\n",
    "builtins.exec skipped": WRONG + "import builtins\nbuiltins.exec = lambda *a, **k: None\n",
    "builtins.eval -> constant": WRONG + "import builtins\nbuiltins.eval = lambda *a, **k: True\n",
    "AssertionError replaced": WRONG + "import builtins\nclass E(Exception): pass\nbuiltins.AssertionError = E\n",
    "equal to everything": "class A:\n    def __eq__(self, other): return True\n    def __repr__(self): return 'A()'\n"
                           "def add(a, b):\n    return A()\n",
    "repr patched": WRONG + "import builtins\nbuiltins.repr = lambda x: '5'\n",
    "json patched": WRONG + "import json\njson.dumps = lambda *a, **k: '[[\"ok\", \"5\"], [\"ok\", \"0\"], [\"ok\", \"30\"]]'\n",
    "os.write patched": WRONG + "import os\n_w = os.write\nos.write = lambda fd, b: _w(fd, b.replace(b'-', b''))\n",
    "tests read from fd 0 as a lookup table": (
        "import os, re\n"
        "src = os.pread(0, 1 << 20, 0).decode('utf-8', 'replace')\n"
        "table = {tuple(map(int, m[:2])): int(m[2]) for m in re.findall(r'add\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)', src)}\n"
        "def add(a, b):\n    return table.get((a, b), 0)\n"),
    "every fd read": (
        "import os\nseen = []\n"
        "for fd in map(int, os.listdir('/proc/self/fd')):\n"
        "    try:\n        seen.append(os.pread(fd, 1 << 20, 0))\n    except OSError:\n        pass\n"
        "def add(a, b):\n    return 0 if b'== 5' not in b''.join(seen) else 5\n"),
    "forged report": WRONG + "import os\nos.write(4, b'x\\n[[\"ok\", \"5\"], [\"ok\", \"0\"], [\"ok\", \"30\"]]')\n"
                             "os._exit(0)\n",
    "exit before the outputs": WRONG + "import os\nos._exit(0)\n",
}


@pytest.fixture(scope="module")
def env():
    return CodeEnv(PythonSandbox(timeout=10))


def reward(env, solution: str, tests=TESTS) -> float:
    rollout = Rollout([Message(f"```python\n{solution}```", MessageType.MODEL)])
    return env.reward(rollout, ToolEpisode(answer=tests))


@pytest.mark.parametrize("name", sorted(HACKS))
def test_a_wrong_solution_scores_zero_whatever_it_does_inside(env, name):
    assert reward(env, HACKS[name]) == 0.0


def test_a_right_solution_still_scores_one(env):
    assert reward(env, RIGHT) == 1.0
    assert reward(env, RIGHT + "print('noise')\nimport sys\nsys.stdout.write('x' * 100000)\n") == 1.0
    assert reward(env, RIGHT, "assert add(1, 1) == 3") == 0.0


def test_the_expected_values_never_enter_the_sandbox(env, monkeypatch):
    programs = []
    run = PythonSandbox.run

    def spy(self, code, **kw):
        programs.append(code)
        return run(self, code, **kw)

    monkeypatch.setattr(PythonSandbox, "run", spy)
    assert reward(env, RIGHT, "assert add(123, 456) == 579\nassert add(7, 8) == 15") == 1.0
    jobs = [p.rsplit("\n_stlr_main(", 1)[1] for p in programs]  # the job: everything but the harness's code
    assert jobs and all(x not in job for job in jobs for x in ("579", hex(579), "15", '"0xf"'))
    assert all(hex(123) in job and hex(456) in job for job in jobs)  # the inputs do, as typed data


def test_plain_data_results_compare_like_python(env):
    solution = "def f(x):\n    return {'a': [x, x * 2.5, None, True, 'é'], 'b': (1, 2)}\n"
    assert reward(env, solution, "assert f(2) == {'a': [2, 5.0, None, True, 'é'], 'b': (1, 2)}") == 1.0
    assert reward(env, solution, "assert f(2) == {'a': [2, 5.0, None, True, 'e'], 'b': (1, 2)}") == 0.0
    assert reward(env, "def f():\n    return object()\n", "assert f() == 1") == 0.0  # not plain data
    assert reward(env, "def f():\n    return float('nan')\n", "assert f() == 1.5") == 0.0


def test_stdin_stdout_cases(env):
    cases = [{"stdin": "2 3\n", "stdout": "5\n"}, {"stdin": "-4 4\n", "stdout": "0"}]
    assert reward(env, "a, b = map(int, input().split())\nprint(a + b)\n", cases) == 1.0
    assert reward(env, "import sys\na, b = map(int, input().split())\nprint(a + b)\nsys.exit(0)\n", cases) == 1.0
    assert reward(env, "a, b = map(int, input().split())\nprint(a - b)\n", cases) == 0.0
    assert reward(env, "import sys\nprint(5)\nsys.exit(3)\n", cases[:1]) == 0.0


def test_partial_credit_when_asked():
    env = CodeEnv(PythonSandbox(timeout=10), reward="fraction")
    assert reward(env, "def add(a, b):\n    return 5\n") == pytest.approx(1 / 3)
    assert reward(env, RIGHT) == 1.0
    with pytest.raises(ValueError, match="'all' or 'fraction'"):
        CodeEnv(reward="most")
