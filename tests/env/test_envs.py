"""QASolverEnv, ToolUseEnv and CodeEnv: scripted multi-turn episodes end to end, with exact masks."""

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import rollouts_to_batch
from SimpleTorchLLMRL.env import CodeEnv, QASolverEnv, ToolEpisode, ToolUseEnv, collect_rollouts, tool_stats
from SimpleTorchLLMRL.tools import PythonSandbox, ToolRegistry, calculator, format_json_call
from tests.support.scripted_agent import ScriptedGenerator, assert_only_model_turns_trained, run_scripted

CALC_27 = "I will compute it.\n" + format_json_call("calculator", {"expression": "3 * 9"})
BAD_TURN = ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
            + format_json_call("nope", {"x": 1}) + format_json_call("calculator", {"expression": 27}))
FINAL = "So the answer is \\boxed{27}."


def roles(rollout):
    return [m.type for m in rollout]


# ---- QASolverEnv -----------------------------------------------------------------------------------------


def test_qa_env_is_single_turn_and_asks_for_boxed():
    env = QASolverEnv()
    msgs, state = env.setup("What is 2 + 2?", "4")
    assert [m.type for m in msgs] == [MessageType.SYSTEM, MessageType.MESSAGE]
    assert "\\boxed{}" in msgs[0].content and msgs[1].content == "What is 2 + 2?"
    assert state == {"answer": "4"} and env.max_turns == 1 and env.tools is None
    rollout, done = run_scripted(env, "What is 2 + 2?", "4", ["\\boxed{4}", "never used"])
    assert done and len(rollout) == 3 and env.reward(rollout, state) is None


def test_qa_env_custom_prompt():
    assert QASolverEnv("Be brief.").setup("q")[0][0].content == "Be brief."
    assert [m.type for m in QASolverEnv("").setup("q")[0]] == [MessageType.MESSAGE]
    with pytest.raises(ValueError, match="custom_sys_prompt"):
        QASolverEnv(3)


# ---- ToolUseEnv ------------------------------------------------------------------------------------------


def test_tool_env_exposes_schemas_prompt_and_stops():
    env = ToolUseEnv([calculator], max_turns=3)
    assert env.tools == [calculator.schema] and env.max_turns == 3
    assert "calculator" in env.system_prompt and "<tool_call>" in env.system_prompt
    assert env.stop_strings == ["</tool_call>"]
    tags = ToolUseEnv(ToolRegistry([calculator], formats=("tags",)), describe_tools=True)
    assert "<calculator>...</calculator>" in tags.system_prompt and '"name": "calculator"' in tags.system_prompt
    assert tags.stop_strings == ["</calculator>"]
    with pytest.raises(ValueError, match="max_turns"):
        ToolUseEnv([calculator], max_turns=0)


def test_scripted_tool_episode_with_bad_calls_continues(any_tokenizer):
    env = ToolUseEnv([calculator], max_turns=5)
    rollout, done = run_scripted(env, "What is 3 * 9?", "27", [CALC_27, BAD_TURN, FINAL], any_tokenizer)
    M, T = MessageType.MODEL, MessageType.TOOL
    assert done
    assert roles(rollout) == [MessageType.SYSTEM, MessageType.MESSAGE, M, T, M, T, T, T, M]
    tool_msgs = [m for m in rollout if m.type is T]
    assert (tool_msgs[0].name, tool_msgs[0].content) == ("calculator", "27")
    assert tool_msgs[1].content.startswith("Error: malformed tool call JSON")
    assert tool_msgs[2].content == "Error: unknown tool 'nope'; available tools: calculator"
    assert tool_msgs[3].content.startswith("Error: invalid arguments for tool 'calculator': argument "
                                           "'expression' must be of type string, got integer 27")
    state = rollout.metadata["env_state"]
    assert isinstance(state, ToolEpisode)
    assert (state.turns, state.tool_calls, state.tool_errors) == (3, {"calculator": 2, "<invalid>": 1, "nope": 1}, 3)
    assert state.num_tool_calls == 4 and state.answer == "27"
    assert_only_model_turns_trained(rollout, any_tokenizer)


def test_tool_episode_stops_at_max_turns_without_running_the_last_calls(chatml_tokenizer):
    env = ToolUseEnv([calculator], max_turns=2)
    rollout, done = run_scripted(env, "q", None, [CALC_27] * 5, chatml_tokenizer)
    assert done and roles(rollout)[2:] == [MessageType.MODEL, MessageType.TOOL, MessageType.MODEL]
    assert rollout.metadata["env_state"].tool_calls == {"calculator": 1}
    assert_only_model_turns_trained(rollout, chatml_tokenizer)


def test_step_without_a_new_model_turn_is_done():
    env = ToolUseEnv([calculator])
    msgs, state = env.setup("q")
    assert env.step(Rollout(msgs), state) == ([], True) and state.turns == 0


# ---- through collect_rollouts --------------------------------------------------------------------------


def test_collect_rollouts_drives_the_tool_env(chatml_tokenizer):
    env = ToolUseEnv([calculator], max_turns=4)
    gen = ScriptedGenerator({"3 * 9?": [CALC_27, FINAL], "quick": ["\\boxed{1}"]}, chatml_tokenizer)
    rollouts = collect_rollouts(gen, env, ["3 * 9?", "quick"], ["27", "1"], group_size=2)
    assert [r.metadata["group_id"] for r in rollouts] == [0, 0, 1, 1]
    assert [len(r) for r in rollouts] == [5, 5, 3, 3]
    assert all(r.metadata["done_reason"] == "env" for r in rollouts)
    assert rollouts[0].metadata["tools"] == [calculator.schema]
    assert rollouts[0][3].content == "27" and rollouts[0].metadata["env_state"].tool_calls == {"calculator": 1}
    assert rollouts[0].metadata["env_state"] is not rollouts[1].metadata["env_state"]
    batch = rollouts_to_batch(rollouts, chatml_tokenizer)
    n_model = [sum(len(m.token_ids) for m in r if m.type is MessageType.MODEL) for r in rollouts]
    assert batch.loss_mask.sum(1).tolist() == n_model
    for r in rollouts:
        assert_only_model_turns_trained(r, chatml_tokenizer)


@pytest.mark.slow
def test_real_generator_smoke(chatml_tokenizer):
    """The real generator conditions on the tool schemas the env exposes (the prompt is ~600 tiny-BPE tokens)."""
    from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
    from SimpleTorchLLMRL.testing.tiny import tiny_model

    env = ToolUseEnv([calculator], max_turns=2)
    model = tiny_model("qwen2", chatml_tokenizer, max_position_embeddings=1024)
    gen = ModelGenerate(model, chatml_tokenizer, max_new_tokens=6, tool_call_stop=env.stop_strings, seed=0)
    rollouts = collect_rollouts(gen, env, ["What is 3 * 9?"], ["27"], group_size=2)
    batch = rollouts_to_batch(rollouts, chatml_tokenizer)
    assert batch.input_ids.shape[0] == 2 and int(batch.loss_mask.sum()) > 0
    assert '"name": "calculator"' in chatml_tokenizer.decode(batch.input_ids[0])
    assert torch.equal(~torch.isnan(batch.sampler_logprobs), batch.loss_mask.bool())


# ---- CodeEnv ----------------------------------------------------------------------------------------------

GOOD = "Here:\n```python\ndef add(a, b):\n    return a + b\nprint(add(2, 3))\n```\n"
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"


@pytest.fixture(scope="module")
def code_env():
    return CodeEnv(PythonSandbox(timeout=5), max_turns=3)


def test_code_env_runs_blocks_and_rewards_with_tests(code_env, chatml_tokenizer):
    assert code_env.tools is None and code_env.stop_strings == ["```\n"]
    rollout, done = run_scripted(code_env, "Write add(a, b).", TESTS, [GOOD, "Done, add works."], chatml_tokenizer)
    assert done
    assert roles(rollout)[2:] == [MessageType.MODEL, MessageType.TOOL, MessageType.MODEL]
    assert (rollout[3].name, rollout[3].content) == ("python", "5")
    state = rollout.metadata["env_state"]
    assert code_env.reward(rollout, state) == 1.0
    assert_only_model_turns_trained(rollout, chatml_tokenizer)


def test_code_env_reward_cases(code_env):
    wrong, _ = run_scripted(code_env, "q", TESTS, [WRONG, "ok"])
    assert code_env.reward(wrong, wrong.metadata["env_state"]) == 0.0
    none, _ = run_scripted(code_env, "q", TESTS, ["no code at all"])
    assert code_env.reward(none, none.metadata["env_state"]) == 0.0
    with pytest.raises(ValueError, match="code tests are missing"):  # no tests, no reward: refused at setup
        run_scripted(code_env, "q", None, [GOOD])
    single = CodeEnv(PythonSandbox(timeout=5), run_code=False)
    rollout, done = run_scripted(single, "q", TESTS, [GOOD])
    assert done and roles(rollout)[-1] is MessageType.MODEL and single.reward(rollout, rollout.metadata["env_state"]) == 1.0


def test_tool_stats_are_per_rollout_means_of_the_episode_states():
    states = [ToolEpisode(tool_calls={"calculator": 2}, tool_errors=1), ToolEpisode(),
              ToolEpisode(tool_calls={"calculator": 1, "search": 1}), ToolEpisode(tool_errors=1)]
    rollouts = [Rollout([Message("q")], metadata={"env_state": s}) for s in states]
    assert tool_stats(rollouts) == {"tool/call_rate": 0.5, "tool/calls": 1.0, "tool/errors": 0.5}
    assert tool_stats([]) == {"tool/call_rate": 0.0, "tool/calls": 0.0, "tool/errors": 0.0}
