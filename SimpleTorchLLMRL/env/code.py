"""`CodeEnv`: the model writes Python, the sandbox runs it, tests decide the reward.

    env = CodeEnv(max_turns=3)
    rollouts = collect_rollouts(gen, env, tasks, tests)      # tests: assert-based Python source
    rewards = torch.tensor([env.reward(r, r.metadata["env_state"]) for r in rollouts])

Each MODEL turn's ```python blocks run in the sandbox (each block in a fresh
process) and their output comes back as TOOL messages; the episode ends after a
turn without a code block, or after `max_turns` MODEL turns. `reward` runs the
last code block the model wrote, then the row's answer (test code, e.g.
`assert add(2, 3) == 5`) in the same namespace, and returns 1.0 only when the
tests ran to their end: a harness sends a per-run nonce to the sandbox's private
channel after the last test. An exit (os._exit, sys.exit, atexit, an excepthook)
before that scores 0.0, whatever the exit code. Not covered: a solution written
against the harness itself (reading its frame or its file descriptors), and tests
that a crafted return value satisfies (an object equal to everything).
"""

from __future__ import annotations

import dataclasses
import secrets
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
                 max_turns: int = 3, *, run_code: bool = True):
        self.sandbox = sandbox if sandbox is not None else PythonSandbox()
        registry = ToolRegistry([python_tool(self.sandbox)], formats=("python",))
        super().__init__(registry, DEFAULT_CODE_PROMPT if custom_sys_prompt is None else custom_sys_prompt,
                         max_turns=max_turns if run_code else 1, expose_schemas=False)
        self.run_code = run_code

    def reward(self, rollout: Rollout, state: ToolEpisode | Any) -> float | None:
        """1.0 if the last code block plus the tests (the row's answer) exits cleanly; None without tests."""
        tests = getattr(state, "answer", None)
        if tests is None:
            return None
        code = last_code_block(rollout)
        if code is None:
            return 0.0
        return 1.0 if self.tests_pass(code, str(tests)) else 0.0

    def tests_pass(self, code: str, tests: str) -> bool:
        """Did `tests` run to their end after `code`, in one namespace, in the sandbox? Never raises."""
        if len(code) + len(tests) > self.sandbox.max_code_chars:
            return False
        nonce = secrets.token_hex(16).encode()
        program = _HARNESS.format(solution=code, tests=tests)
        try:  # the limit applies to the model's code and the tests, not to their quoting in the harness
            box = dataclasses.replace(self.sandbox, max_code_chars=max(len(program), self.sandbox.max_code_chars))
            return box.run(program, secret=nonce).report == nonce
        except Exception:
            return False
