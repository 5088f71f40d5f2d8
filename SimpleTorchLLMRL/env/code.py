"""`CodeEnv`: the model writes Python, the sandbox runs it, tests decide the reward.

    env = CodeEnv(max_turns=3)
    rollouts = collect_rollouts(gen, env, tasks, tests)      # tests: assert-based Python source
    rewards = torch.tensor([env.reward(r, r.metadata["env_state"]) for r in rollouts])

Each MODEL turn's ```python blocks run in the sandbox (each block in a fresh
process) and their output comes back as TOOL messages; the episode ends after a
turn without a code block, or after `max_turns` MODEL turns. `reward` runs the
last code block the model wrote against the row's answer, in one of two ways:

- **Outputs compared outside** (hack-proof): when every test is `assert EXPR == VALUE`
  with VALUE a plain literal (numbers, strings, bools, None, lists / tuples / dicts /
  sets of them), or the answer is a list of `{"stdin": ..., "stdout": ...}` cases. The
  expected values never enter the sandbox: it runs the solution, evaluates each EXPR
  (or runs the solution on each stdin), and sends back the `repr` of each result (or
  the captured stdout) on its private channel; the caller reads them back as plain data
  (`ast.literal_eval`) and compares. Nothing the solution patches, reads or prints
  inside the sandbox can make a wrong answer equal the expected one, and a result that
  is not plain data (an object equal to everything) scores 0.
- **Tests run inside** (any other test code): the solution, then the tests, in one
  namespace; 1.0 only when the tests ran to their end, proven by a per-run nonce the
  harness writes to the private channel after the last test (an early exit scores 0.0).
  Not covered in this mode: a solution written against the harness itself (reading its
  frame or file descriptors, patching builtins the tests use), and tests that a crafted
  return value satisfies.

`reward="fraction"` gives the fraction of tests passed (outputs compared outside only;
inside, all or nothing).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import secrets
from dataclasses import dataclass
from typing import Any

from SimpleTorchLLMRL.chat.message import MessageType, Rollout
from SimpleTorchLLMRL.env.ToolQASolve import ToolEpisode, ToolUseEnv
from SimpleTorchLLMRL.tools.parsers import CodeBlockParser
from SimpleTorchLLMRL.tools.registry import ToolRegistry
from SimpleTorchLLMRL.tools.sandbox import PythonSandbox, python_tool

DEFAULT_CODE_PROMPT = (
    "You are a careful Python programmer. Write your solution in a ```python code block. "
    "Each block is run and what it prints comes back to you, so you can test your code. "
    "Your last code block is checked against hidden tests."
)

# fd 3: the nonce (read once, then closed); fd 4: where it goes once the last test has passed
_HARNESS = """\
import os as _os
def _stlr_check(solution, tests, write=_os.write, close=_os.close, read=_os.read):
    nonce = read(3, 64)
    close(3)
    namespace = {{"__name__": "__main__", "__builtins__": __builtins__}}
    exec(compile(solution, "<solution>", "exec"), namespace)
    exec(compile(tests, "<tests>", "exec"), namespace)
    write(4, nonce)
_stlr_check({solution!r}, {tests!r})
"""


# fd 3: the nonce; fd 4: nonce, newline, then the JSON list of [status, repr or stdout] per case
_OUTPUTS = """\
import os as _os, json as _json, io as _io, sys as _sys
def _stlr_outputs(solution, cases, stdio, write=_os.write, close=_os.close, read=_os.read, dumps=_json.dumps,
                  StringIO=_io.StringIO, sys=_sys, repr=repr, compile=compile, exec=exec, eval=eval, str=str,
                  type=type, BaseException=BaseException, SystemExit=SystemExit):
    nonce = read(3, 64)
    close(3)
    out = []
    def run(src, mode, namespace):
        code = compile(src, "<solution>" if mode == "exec" else "<test>", mode)
        return exec(code, namespace) if mode == "exec" else eval(code, namespace)
    if stdio:
        for stdin in cases:
            saved = sys.stdin, sys.stdout
            sys.stdin, sys.stdout = StringIO(stdin), StringIO()
            try:
                run(solution, "exec", {{"__name__": "__main__", "__builtins__": __builtins__}})
                out.append(["ok", sys.stdout.getvalue()])
            except SystemExit as e:  # sys.exit() / exit(0) ends a stdin program normally
                out.append(["ok" if e.code in (None, 0) else "error", sys.stdout.getvalue()])
            except BaseException as e:
                out.append(["error", type(e).__name__])
            finally:
                sys.stdin, sys.stdout = saved
    else:
        namespace = {{"__name__": "__main__", "__builtins__": __builtins__}}
        try:
            run(solution, "exec", namespace)
        except BaseException as e:
            out = [["error", type(e).__name__]] * len(cases)
        else:
            for src in cases:
                try:
                    out.append(["ok", repr(run(src, "eval", namespace))])
                except BaseException as e:
                    out.append(["error", type(e).__name__])
    write(4, nonce + b"\\n" + dumps(out).encode())
_stlr_outputs({solution!r}, {cases!r}, {stdio!r})
"""
REPORT_BYTES = 4096  # what the sandbox's private channel carries


@dataclass(frozen=True)
class SplitTests:
    """Tests whose expected values stay outside the sandbox: inputs go in, outputs come out."""

    inputs: tuple[str, ...]  # expressions to evaluate after the solution, or stdin texts (stdio)
    expected: tuple[Any, ...]  # plain data: the values the outputs must equal (stdout texts for stdio)
    stdio: bool = False


def split_tests(tests: Any) -> SplitTests | None:
    """`assert EXPR == LITERAL` lines, or [{"stdin", "stdout"}] cases, as a SplitTests; None for other tests."""
    if isinstance(tests, (list, tuple)):
        if tests and all(isinstance(c, dict) and isinstance(c.get("stdin"), str) and isinstance(c.get("stdout"), str)
                         for c in tests):
            return SplitTests(tuple(c["stdin"] for c in tests), tuple(c["stdout"] for c in tests), stdio=True)
        return None
    try:
        tree = ast.parse(str(tests))
    except SyntaxError:
        return None
    inputs, expected = [], []
    for node in tree.body:
        test = node.test if isinstance(node, ast.Assert) else None
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
            return None
        try:
            value = ast.literal_eval(test.comparators[0])
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        inputs.append(ast.unparse(test.left))
        expected.append(value)
    return SplitTests(tuple(inputs), tuple(expected)) if inputs else None


def _plain(text: str) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _same(got: Any, want: Any) -> bool:
    """Python's == on plain data, without letting a NaN or a type quirk raise."""
    try:
        return bool(got == want)
    except Exception:  # noqa: BLE001
        return False


def last_code_block(rollout: Rollout) -> str | None:
    """The last ```python block of the last MODEL message that has one."""
    parser = CodeBlockParser()
    for m in reversed(rollout.messages):
        if m.type is MessageType.MODEL:
            blocks = parser.parse(m.content)
            if blocks:
                return blocks[-1].text
    return None


class CodeEnv(ToolUseEnv):
    """Python code blocks as tool calls (see the module docstring).

    sandbox:     the PythonSandbox that runs the code (default limits when None)
    run_code:    False: never execute during the episode (single-shot generation, reward only)
    """

    def __init__(self, sandbox: PythonSandbox | None = None, custom_sys_prompt: str | None = None,
                 max_turns: int = 3, *, run_code: bool = True, reward: str = "all"):
        if reward not in ("all", "fraction"):
            raise ValueError(f"CodeEnv reward must be 'all' or 'fraction', got {reward!r}")
        self.reward_mode = reward
        self.sandbox = sandbox if sandbox is not None else PythonSandbox()
        registry = ToolRegistry([python_tool(self.sandbox)], formats=("python",))
        super().__init__(registry, DEFAULT_CODE_PROMPT if custom_sys_prompt is None else custom_sys_prompt,
                         max_turns=max_turns if run_code else 1, expose_schemas=False)
        self.run_code = run_code

    def reward(self, rollout: Rollout, state: ToolEpisode | Any) -> float | None:
        """The last code block against the row's answer (module docstring); None without tests."""
        tests = getattr(state, "answer", None)
        if tests is None:
            return None
        code = last_code_block(rollout)
        if code is None:
            return 0.0
        split = split_tests(tests)
        if split is None:
            return 1.0 if self.tests_pass(code, str(tests)) else 0.0
        passed = self.outputs_pass(code, split)
        if self.reward_mode == "fraction":
            return sum(passed) / len(passed)
        return 1.0 if all(passed) else 0.0

    def outputs_pass(self, code: str, split: SplitTests) -> list[bool]:
        """Per case: did the sandbox's output equal the expected value (compared here)? Never raises."""
        fail = [False] * len(split.inputs)
        if len(code) + sum(map(len, split.inputs)) > self.sandbox.max_code_chars:
            return fail
        nonce = secrets.token_hex(16).encode()
        report = self._run_harness(_OUTPUTS.format(solution=code, cases=list(split.inputs), stdio=split.stdio), nonce)
        head, _, body = report.partition(b"\n")
        try:
            outputs = json.loads(body) if head == nonce else None
        except ValueError:
            outputs = None
        if not isinstance(outputs, list) or len(outputs) != len(split.inputs):
            return fail
        passed = []
        for out, want in zip(outputs, split.expected, strict=True):
            if not (isinstance(out, list) and len(out) == 2 and out[0] == "ok" and isinstance(out[1], str)):
                passed.append(False)
            elif split.stdio:
                passed.append(out[1].strip() == want.strip())
            else:
                ok, got = _plain(out[1])
                passed.append(ok and _same(got, want))
        return passed

    def tests_pass(self, code: str, tests: str) -> bool:
        """Did `tests` run to their end after `code`, in one namespace, in the sandbox? Never raises."""
        if len(code) + len(tests) > self.sandbox.max_code_chars:
            return False
        nonce = secrets.token_hex(16).encode()
        return self._run_harness(_HARNESS.format(solution=code, tests=tests), nonce) == nonce

    def _run_harness(self, program: str, nonce: bytes) -> bytes:
        """What a harness program wrote to its private channel (b"" when the sandbox itself failed)."""
        try:  # the limit applies to the model's code and the tests, not to their quoting in the harness
            box = dataclasses.replace(self.sandbox, max_code_chars=max(len(program), self.sandbox.max_code_chars))
            return box.run(program, secret=nonce).report
        except Exception:  # noqa: BLE001  (a sandbox failure scores nothing)
            return b""
