"""reasoning-gym: rows and a strict reward from a task's own checker (its partial credit pays 0 unless asked for),
GRPO steps on the embedded model, and main.py --dataset rg:NAME --reward score_answer | MODULE:CALLABLE."""

from __future__ import annotations

import json
import sys

import pytest
import reasoning_gym as rg

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.integrations import reasoning_gym
from tests.recipes.test_main import MODEL, load_main, needs_asset, read_metrics


def answered(row: dict, reply: str) -> Rollout:
    return Rollout([Message(row["question"]), Message(reply, MessageType.MODEL)], {"question": row["question"]})


@pytest.fixture(scope="module")
def arithmetic():
    rows, reward = reasoning_gym.task("basic_arithmetic", size=40, seed=3)
    row = next(r for r in rows if r["answer"].isdigit() and len(r["answer"]) == 2)  # e.g. "28"
    return rows, reward, row


def test_rows_are_the_tasks_entries(arithmetic):
    rows, reward, _ = arithmetic
    dataset = rg.create_dataset("basic_arithmetic", size=40, seed=3)
    assert rows == [{"question": e["question"], "answer": e["answer"]} for e in dataset]
    assert reward.name == "rg:basic_arithmetic" and reward.needs_ground_truth


def test_partial_credit_pays_zero_by_default(arithmetic):
    rows, reward, row = arithmetic
    checker = rg.create_dataset("basic_arithmetic", size=40, seed=3)
    entry = next(e for e in checker if e["question"] == row["question"])
    assert checker.score_answer("-" + row["answer"], entry) == pytest.approx(2 / 3)  # the checker's partial credit
    replies = [f"\\boxed{{{row['answer']}}}", f"\\boxed{{-{row['answer']}}}", f"\\boxed{{ {row['answer']} }}",
               row["answer"], "\\boxed{}", f"\\boxed{{{row['answer']}}} or \\boxed{{1}}"]
    rollouts = [answered(row, text) for text in replies]
    assert reward(rollouts, [row["answer"]] * 6).tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    _, partial = reasoning_gym.task("basic_arithmetic", size=40, seed=3, partial=True)
    assert partial(rollouts[:2], [row["answer"]] * 2).tolist() == pytest.approx([1.0, 2 / 3])
    _, tagged = reasoning_gym.task("basic_arithmetic", size=40, seed=3, extract=r"<answer>(.*?)</answer>")
    assert tagged([answered(row, f"<answer>{row['answer']}</answer>")], [row["answer"]]).tolist() == [1.0]


def test_a_rollout_of_another_task_or_answer_is_refused(arithmetic):
    rows, reward, row = arithmetic
    with pytest.raises(ValueError, match="its own task's rows"):
        reward([answered({"question": "What is 1 + 1?"}, "\\boxed{2}")], ["2"])
    with pytest.raises(ValueError, match="is not the rg:basic_arithmetic answer"):
        reward([answered(row, "\\boxed{2}")], ["99999"])
    with pytest.raises(ValueError, match="ground truth"):
        reward([answered(row, "\\boxed{2}")], [None])


def test_bad_task_arguments_and_a_missing_extra(monkeypatch):
    with pytest.raises(ValueError, match="'no_such_task'"):
        reasoning_gym.task("no_such_task", size=4)
    with pytest.raises(ValueError, match="size"):
        reasoning_gym.task("basic_arithmetic", size=0)
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(ImportError, match="'reasoning-gym' extra"):
        reasoning_gym.task("basic_arithmetic", size=4)


def test_grpo_steps_on_a_reasoning_gym_task():
    """The embedded calculator model (with its calculator tool) on two-term sums, the shape it was trained on
    (on rg's default mix of operators and signs it is almost never right): its \\boxed{} answers, scored
    strictly by the task's checker, differ within groups, so the GRPO steps have a non-zero gradient."""
    from SimpleTorchLLMRL import collect_rollouts
    from SimpleTorchLLMRL.env import ToolUseEnv
    from SimpleTorchLLMRL.recipes.calculator.arithmetic import SYSTEM_PROMPT
    from SimpleTorchLLMRL.tools import calculator
    from tests.support.grpo_steps import grpo_steps, tiny_policy

    rows, reward = reasoning_gym.task("basic_arithmetic", size=4, seed=0, min_terms=2, max_terms=2,
                                      min_digits=2, max_digits=2, operators=("+",), allow_negation=False,
                                      allow_parentheses=False)
    model, tok, gen = tiny_policy(max_new_tokens=40, seed=2, tool_call_stop=["</tool_call>"])
    env = ToolUseEnv([calculator], custom_sys_prompt=SYSTEM_PROMPT, max_turns=2)
    seen = []

    def collect():
        rollouts = collect_rollouts(gen, env, [r["question"] for r in rows], [r["answer"] for r in rows],
                                    group_size=4)
        rewards = reward(rollouts, [r.metadata["answer"] for r in rollouts])
        seen.append(rewards)
        return rollouts, rewards

    grpo_steps(model, tok, collect, steps=2, group_size=4)
    assert all(0 < float(r.mean()) < 1 for r in seen)


# ----------------------------------------------------------------------------- main.py

TINY = ["--model", str(MODEL), "--steps", "1", "--batch-size", "2", "--group-size", "2", "--eval-size", "4",
        "--pass-k", "1", "--pass-k-size", "2", "--max-new-tokens", "24", "--threads", "1", "--eval-every", "0"]


@needs_asset
def test_main_trains_on_a_reasoning_gym_task_with_its_checker(tmp_path):
    code = load_main().main([*TINY, "--dataset", "rg:basic_arithmetic", "--reward", "score_answer",
                             "--output-dir", str(tmp_path / "run")])
    assert code == 0
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if "train/reward" in r] == [1]
    state = json.loads(next((tmp_path / "run" / "checkpoints").iterdir()).joinpath("state.json").read_text())
    assert state["args"]["reward"] == "score_answer" and state["args"]["dataset"] == "rg:basic_arithmetic"


@needs_asset
def test_main_takes_a_reward_by_module_and_name(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "import torch\n"
        "CALLS = []\n"
        "class Length:\n"
        "    def __call__(self, rollouts, answers):\n"
        "        CALLS.append(len(rollouts))\n"
        "        return torch.tensor([len(r.messages[-1].content) % 3 / 2 for r in rollouts])\n")
    monkeypatch.chdir(tmp_path)  # MODULE is found in the directory the run starts in
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    code = load_main().main([*TINY, "--reward", "my_rewards:Length", "--output-dir", str(tmp_path / "run")])
    assert code == 0 and 4 in sys.modules["my_rewards"].CALLS  # step 1's batch: 2 questions x 2
    [train] = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/reward" in r]
    assert train["train/reward"] in {k / 8 for k in range(9)}  # four rewards from {0, 1/2, 1}


@needs_asset
@pytest.mark.parametrize("argv,expected", [
    (["--reward", "score_answer"], "--reward score_answer is a reasoning-gym task's checker"),
    (["--reward", "exact"], "--reward exact: expected boxed or score_answer or MODULE:CALLABLE"),
    (["--reward", "no_such_module_x:f"], "--reward no_such_module_x:f: cannot import it"),
    (["--reward", "json:nothing_here"], "--reward json:nothing_here: cannot import it"),
    (["--reward", "json:__doc__"], "str is not callable"),
    (["--dataset", "rg:no_such_task"], "--dataset rg:no_such_task: reasoning-gym task 'no_such_task'"),
])
def test_bad_reward_and_rg_flags_are_one_line_exit_2(tmp_path, capfd, argv, expected):
    out = tmp_path / "out"
    code = load_main().main([*TINY, *argv, "--output-dir", str(out)])
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and expected in lines[0], lines
    assert not out.exists()
