"""Triggers (interrupt, append, resume) and the TriggerEnv adapter."""

import pytest

from SimpleTorchLLMRL.chat.message import MessageType
from SimpleTorchLLMRL.env import CodeTrigger, NoneTrigger, Trigger, TriggerEnv, collect_rollouts
from SimpleTorchLLMRL.tools import PythonSandbox
from tests.support.scripted_agent import ScriptedGenerator, assert_only_model_turns_trained, run_scripted

BLOCK = "Let me check.\n```python\nprint(6 * 7)\n```\n"


@pytest.fixture(scope="module")
def sandbox():
    return PythonSandbox(timeout=5)


def test_none_trigger_never_fires():
    t = NoneTrigger()
    assert t.trigger(BLOCK) is None and t("anything") is None and isinstance(t.copy(), NoneTrigger)


def test_code_trigger_runs_a_block_that_ends_the_text(sandbox):
    t = CodeTrigger(sandbox)
    assert t.stop_strings == ("```\n",)
    assert t.trigger(BLOCK) == "\n<Code Result>\n42\n</Code Result>\n"
    assert t.trigger(BLOCK.rstrip()) == "\n<Code Result>\n42\n</Code Result>\n"  # stopped right at the fence
    assert t.calls == 2


@pytest.mark.parametrize("text", [
    "no code here",
    "```python\nprint(1)\n",                       # still open: the model is mid-block
    BLOCK + "So the answer is 42.",                # the block is not at the end any more
    BLOCK + "\n<Code Result>\n42\n</Code Result>\n",  # already answered: never run twice
    "```bash\necho hi\n```\n",                     # not python
])
def test_code_trigger_does_not_fire(sandbox, text):
    t = CodeTrigger(sandbox)
    assert t.trigger(text) is None and t.calls == 0


def test_interrupt_and_resume_loop(sandbox):
    """The generation loop a trigger plugs into: stop at the pattern, append, resume."""
    t = CodeTrigger(sandbox)
    pieces = [BLOCK, "The product is 42. Now squared:\n```python\nprint(42 ** 2)\n```\n", "Done: \\boxed{1764}"]
    text = ""
    for piece in pieces:  # each piece is what the model generated before stopping
        text += piece
        extra = t.trigger(text)
        if extra is not None:
            text += extra
    assert text == (pieces[0] + "\n<Code Result>\n42\n</Code Result>\n" + pieces[1]
                    + "\n<Code Result>\n1764\n</Code Result>\n" + pieces[2])


def test_code_trigger_errors_and_limits(sandbox):
    t = CodeTrigger(sandbox, max_calls=1, tag="output")
    out = t.trigger("```python\n1/0\n```")
    assert out.startswith("\n<output>\n") and "ZeroDivisionError" in out and out.endswith("[exit code 1]\n</output>\n")
    assert t.trigger(BLOCK) is None  # max_calls reached
    fresh = t.copy()
    assert fresh.calls == 0 and t.calls == 1 and fresh.sandbox is t.sandbox
    assert fresh.trigger(BLOCK) == "\n<output>\n42\n</output>\n"
    with pytest.raises(ValueError, match="max_calls"):
        CodeTrigger(sandbox, max_calls=0)


def test_base_trigger_is_abstract():
    with pytest.raises(NotImplementedError):
        Trigger().trigger("x")


def test_trigger_env_episode(sandbox, any_tokenizer):
    env = TriggerEnv(CodeTrigger(sandbox), custom_sys_prompt="Use python.", max_turns=4)
    assert env.stop_strings == ["```\n"] and env.tools is None
    replies = [BLOCK, "Now squared:\n```python\nprint(42 ** 2)\n```\n", "\\boxed{1764}"]
    rollout, done = run_scripted(env, "What is 6 * 7, squared?", "1764", replies, any_tokenizer)
    M, T = MessageType.MODEL, MessageType.TOOL
    assert done and [m.type for m in rollout] == [MessageType.SYSTEM, MessageType.MESSAGE, M, T, M, T, M]
    assert [(m.name, m.content) for m in rollout if m.type is T] == [
        ("python", "\n<Code Result>\n42\n</Code Result>\n"), ("python", "\n<Code Result>\n1764\n</Code Result>\n")]
    state = rollout.metadata["env_state"]
    assert (state.turns, state.fired, state.trigger.calls) == (3, 2, 2)
    assert env.trigger.calls == 0  # each episode works on its own copy
    assert rollout.copy().metadata["env_state"].fired == 2  # the state survives Rollout.copy (deepcopy)
    assert_only_model_turns_trained(rollout, any_tokenizer)


def test_trigger_env_max_turns_and_validation(sandbox):
    env = TriggerEnv(CodeTrigger(sandbox), max_turns=1)
    rollout, done = run_scripted(env, "q", None, [BLOCK])
    assert done and rollout[-1].type is MessageType.MODEL and rollout.metadata["env_state"].fired == 0
    with pytest.raises(ValueError, match="Trigger"):
        TriggerEnv(lambda text: None)
    with pytest.raises(ValueError, match="max_turns"):
        TriggerEnv(NoneTrigger(), max_turns=0)


def test_trigger_env_under_collect_rollouts(sandbox, chatml_tokenizer):
    env = TriggerEnv(CodeTrigger(sandbox), max_turns=3)
    gen = ScriptedGenerator({"q": [BLOCK, "\\boxed{42}"]}, chatml_tokenizer)
    rollouts = collect_rollouts(gen, env, ["q"], ["42"], group_size=2)
    assert [len(r) for r in rollouts] == [4, 4]
    assert [r[2].content for r in rollouts] == ["\n<Code Result>\n42\n</Code Result>\n"] * 2
    assert [r.metadata["env_state"].fired for r in rollouts] == [1, 1]
