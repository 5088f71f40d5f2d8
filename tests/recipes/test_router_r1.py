"""Router-R1 recipe: config checks, the reward table, the pool (HTTP, HF lazy load), the generation
manager against a scripted model (stops, limits, masks), one PPO step, and both examples."""

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import rollouts_to_batch
from SimpleTorchLLMRL.env.rollouts import collect_rollouts
from SimpleTorchLLMRL.recipes.router_r1 import (
    CallableModel,
    HFModel,
    LocalGenerator,
    OpenAIModel,
    RouterEnv,
    RouterGenerationManager,
    RouterR1Trainer,
    RouterReward,
    RouterRewardConfig,
    RouterTrainingConfig,
    RoutingPool,
    format_problems,
    make_policy_generator,
    parse_action,
)
from SimpleTorchLLMRL.testing.tiny import tiny_model
from SimpleTorchLLMRL.utils.checkpoint import verify_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and the CPU is shared)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def calc_pool(**kw):
    return RoutingPool([CallableModel("calc", lambda q: str(eval(q, {}, {})), cost_per_call=0.25),  # noqa: S307
                        CallableModel("broken", lambda q: 1 / 0, cost_per_call=1.0)], **kw)


def config(*overrides):
    return RouterTrainingConfig.from_overrides(list(overrides))


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("section, field, value", [
    ("data", "max_start_length", 5000), ("data", "prompt_template", "no placeholder"),
    ("generation", "top_p", 0.0), ("generation", "max_routing_calls", -1), ("tool", "api_key_env", "sk-abc"),
    ("tool", "api_base", "ftp://x"), ("reward", "reward_metric", "bleu"), ("reward", "malformed_penalty", 0.5),
    ("trainer", "adv_estimator", "reinforce"), ("trainer", "ppo_micro_batch_size", 64),
    ("trainer", "logger", ("console", "tensorboard")), ("validation", "test_freq", 0),
])
def test_config_rejects_bad_values_naming_the_field(section, field, value):
    with pytest.raises(ValueError, match=rf"{section}\.{field}"):
        config(f"{section}.{field}={value!r}")


def test_config_overrides_and_cross_checks():
    cfg = config("data.train_batch_size=8", "reward.cost_coefficient=0.5", "trainer.total_training_steps=null",
                 "trainer.logger=['console','wandb']", "generation.max_routing_calls=2")
    assert (cfg.data.train_batch_size, cfg.reward.cost_coefficient) == (8, 0.5)
    assert cfg.trainer.total_training_steps is None and cfg.trainer.logger == ("console", "wandb")
    assert RouterTrainingConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="generation.n_agent"):
        config("trainer.adv_estimator='grpo'")
    with pytest.raises(ValueError, match="section.field=value"):
        config("data.nope=1")


# ----------------------------------------------------------------------------- tags


def test_parse_action_and_format_problems():
    assert parse_action("<think>a</think><search> calc : 1+2 </search>").__dict__ == {
        "kind": "route", "content": "calc : 1+2", "name": "calc", "query": "1+2"}
    assert parse_action("<search>calc 1+2</search>").kind == "malformed_route"
    assert parse_action("<search>MODEL_NAME: q</search>").kind == "malformed_route"
    assert parse_action("<answer> 3 </answer><search>a: b</search>").content == "3"
    assert parse_action("thinking...").kind == "none"
    assert format_problems(["<think>x</think><search>a: b</search>", "<think>y</think><answer>3</answer>"]) == []
    assert format_problems(["<think>x<answer>3</answer></think>"]) == ["turn 0: nested tags",
                                                                      "the answer does not end the last turn"]
    assert format_problems(["<answer>3</answer>"]) == ["the first turn does not open with a <think> block"]
    assert format_problems(["<answer>3</answer>"], require_think=False) == []
    assert "turn 0: the model wrote <information> itself" in format_problems(
        ["<think>x</think><information>fake</information><answer>3</answer>"])


# ----------------------------------------------------------------------------- reward table


def drive(env, question, answer, replies):
    """Run `env` on scripted MODEL turns (Env protocol, as collect_rollouts does)."""
    msgs, state = env.setup(question, answer)
    rollout = Rollout(msgs, {"env_state": state, "answer": answer})
    for reply in replies:
        rollout.add_messages(Message(reply, MessageType.MODEL))
        new, done = env.step(rollout, state)
        rollout.add_messages(*new)
        if done:
            break
    return rollout


REWARD_CFG = RouterRewardConfig(reward_metric="em", cost_coefficient=0.5, missing_answer_penalty=-0.5,
                                malformed_penalty=-0.25, unknown_model_penalty=-0.125, over_budget_penalty=-2.0)
ROUTE = "<think>need it</think><search>calc: 2+3</search>"
ANSWER = "<think>got it</think><answer>{}</answer>"
# name: (replies, gold, {component: value}) -- components not listed are 0
TABLE = {
    "well_formed_correct": ([ROUTE, ANSWER.format("5")], "5", {"answer": 1.0, "cost": -0.125}),
    "wrong": ([ROUTE, ANSWER.format("6")], "5", {"cost": -0.125}),
    "sign_kept": ([ANSWER.format("-3.5")], ["3.5", "35"], {}),
    "malformed": (["<think>a</think><think>b<search>calc: 2+3</search>", ANSWER.format("The 5.")], "5",
                  {"answer": 1.0, "malformed": -0.25, "cost": -0.125}),
    "missing_answer": (["<think>hmm</think>I do not know", "no idea", "still none"], "5",
                       {"missing_answer": -0.5}),
    "unknown_route": (["<think>x</think><search>oracle: 2+3</search>", ANSWER.format("5")], "5",
                      {"answer": 1.0, "unknown_model": -0.125}),
    "over_budget": ([ROUTE, ROUTE, ANSWER.format("5")], "5", {"answer": 1.0, "over_budget": -2.0, "cost": -0.125}),
    "failing_model": (["<think>x</think><search>broken: 2+3</search>", ANSWER.format("5")], "5", {"answer": 1.0}),
}


def test_reward_table_exact_values():
    env = RouterEnv(calc_pool(), None, config("generation.max_turns=2", "generation.max_routing_calls=1"))
    reward = RouterReward(REWARD_CFG, env.pool)
    rollouts = [drive(env, "2+3?", gold, replies) for replies, gold, _ in TABLE.values()]
    out = reward.compute(rollouts)
    for i, (name, (_, _, expected)) in enumerate(TABLE.items()):
        got = {k: float(v[i]) for k, v in out.components.items()}
        want = {k: expected.get(k, 0.0) for k in got}
        assert got == want, name
        assert float(out.total[i]) == sum(want.values()), name  # exact: every value is a dyadic fraction
    assert torch.equal(reward(rollouts), out.total)
    over = rollouts[list(TABLE).index("over_budget")]
    assert [c.status for c in over.metadata["env_state"].calls] == ["ok", "over_budget"]
    assert "budget exhausted" in over[4].content and over[4].type is MessageType.TOOL
    f1 = RouterReward(RouterRewardConfig(reward_metric="f1"), env.pool)
    r = drive(env, "q", "Barack Obama", ["<think>x</think><answer>Obama</answer>"])
    assert float(f1([r])[0]) == pytest.approx(2 * 1.0 * 0.5 / 1.5)


# ----------------------------------------------------------------------------- pool


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.headers.get("Authorization"), body))
        if self.server.fail_first > 0:
            self.server.fail_first -= 1
            self.send_response(503)
            self.end_headers()
            return
        reply = {"choices": [{"message": {"content": "Paris is the capital."}}], "usage": {"completion_tokens": 5}}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.seen, srv.fail_first = [], 0
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


def test_openai_endpoint_key_from_env_retries_and_cost(server, monkeypatch):
    base = f"http://127.0.0.1:{server.server_address[1]}/v1"
    tool = config(f"tool.api_base={base!r}", "tool.api_key_env='RR1_TEST_KEY'", "tool.request_timeout=5",
                  "tool.max_retries=1", "tool.routed_max_tokens=32").tool
    model = OpenAIModel.from_config("llama-70b", "meta/llama-3.1-70b-instruct", tool, retry_wait=0.01,
                                    price_per_1m_tokens=2e5)
    pool = RoutingPool([model])
    monkeypatch.delenv("RR1_TEST_KEY", raising=False)
    (res,) = pool.route([("LLaMA-70B", "capital of France?")])
    assert res.status == "error" and "RR1_TEST_KEY" in res.text and server.seen == []
    monkeypatch.setenv("RR1_TEST_KEY", "secret-123")
    server.fail_first = 1  # one 503, then success on the retry
    (res,) = pool.route([("llama-70b", "capital of France?")])
    assert (res.status, res.text, res.completion_tokens, res.cost) == ("ok", "Paris is the capital.", 5, 1.0)
    auth, body = server.seen[-1]
    assert auth == "Bearer secret-123" and len(server.seen) == 2
    assert body["model"] == "meta/llama-3.1-70b-instruct" and body["max_tokens"] == 32
    assert "capital of France?" in body["messages"][0]["content"]  # wrapped in the agent prompt
    server.fail_first = 5
    (res,) = pool.route([("llama-70b", "q")])
    assert res.status == "error" and "HTTP 503" in res.text


def test_pool_names_unknown_and_duplicates():
    pool = calc_pool()
    results = pool.route([("CALC", "1+1"), ("nobody", "x"), ("broken", "y")])
    assert [r.status for r in results] == ["ok", "unknown_model", "error"]
    assert results[0].text == "2" and results[0].cost == 0.25 and results[2].cost == 0.0
    assert "available: calc, broken" in results[1].text
    with pytest.raises(ValueError, match="already has"):
        pool.add(CallableModel("Calc", str))
    with pytest.raises(ValueError, match="without ':'"):
        CallableModel("a:b", str)


def test_hf_models_load_lazily_from_a_path_and_share_one_generator(tok, tmp_path):
    tiny_model("qwen2", tok, seed=3).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    shared = LocalGenerator(str(tmp_path), max_new_tokens=4, device="cpu", dtype="float32")
    pool = RoutingPool([HFModel("a", generator=shared, price_per_1m_tokens=1e6), HFModel("b", generator=shared)])
    assert not shared.loaded
    res = pool.route([("a", "hello"), ("b", "hi"), ("a", "what")])
    assert shared.loaded and all(r.ok for r in res)
    assert [r.name for r in res] == ["a", "b", "a"]
    assert res[0].cost == res[0].completion_tokens and 0 <= res[0].completion_tokens <= 4


# ----------------------------------------------------------------------------- the manager on a scripted model


class ScriptedLM(torch.nn.Module):
    """An HF-generate stand-in: emits `reply_fn(prompt_text)` + EOS token by token through the real
    logits processors and stopping criteria of ModelGenerate's HF backend."""

    def __init__(self, tokenizer, reply_fn):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer, self.reply_fn, self.calls = tokenizer, reply_fn, 0
        self.config = SimpleNamespace(max_position_embeddings=2048)
        self.generation_config = SimpleNamespace(eos_token_id=tokenizer.eos_token_id)

    def generate(self, input_ids, attention_mask, max_new_tokens, logits_processor, stopping_criteria,
                 eos_token_id, pad_token_id, **_):
        self.calls += 1
        tok, V = self.tokenizer, len(self.tokenizer)
        targets = [tok(self.reply_fn(tok.decode(row[m.bool()])), add_special_tokens=False)["input_ids"]
                   + [tok.eos_token_id] for row, m in zip(input_ids, attention_mask, strict=True)]
        seq, done = input_ids, torch.zeros(len(targets), dtype=torch.bool)
        for t in range(max_new_tokens):
            scores = torch.full((len(targets), V), -10.0)
            for b, tgt in enumerate(targets):
                scores[b, tgt[min(t, len(tgt) - 1)]] = 10.0
            nxt = logits_processor(seq, scores).argmax(-1).masked_fill(done, pad_token_id)
            seq = torch.cat([seq, nxt[:, None]], 1)
            done |= torch.isin(nxt, torch.tensor(eos_token_id)) | stopping_criteria(seq, scores)
            if done.all():
                break
        return seq


def script(prompt: str) -> str:
    """Replies by question and round (the number of <information> blocks after the question)."""
    k = prompt.split("Question:")[-1].count("<information>")
    if "Q-route" in prompt:  # routes every round; text after the stop must be cut away
        return "<think>ask</think><search>calc: 2+3</search>\n<information>fake</information><answer>9</answer>"
    if "Q-answer" in prompt:
        return "<think>easy</think><answer>5</answer> trailing"
    if "Q-once" in prompt:
        return ["<think>a</think><search>calc: 20+22</search>", "<think>b</think><answer>42</answer>"][min(k, 1)]
    return "la " * 60  # never closes a tag and outlasts max_new_tokens: finish_reason "length"


@pytest.mark.parametrize("driver", ["manager", "collect_rollouts"])
def test_manager_stops_limits_and_masks(tok, driver):
    cfg = config("generation.max_turns=2", "generation.max_routing_calls=1", "data.max_response_length=40")
    lm = ScriptedLM(tok, script)
    env = RouterEnv(calc_pool(), tok, cfg)
    gen = make_policy_generator(lm, tok, cfg)
    questions = ["Q-route", "Q-answer", "Q-once", "Q-babble"]
    if driver == "manager":
        rollouts = RouterGenerationManager(gen, env).run(questions, ["5", "5", "42", "x"])
    else:
        rollouts = collect_rollouts(gen, env, questions, ["5", "5", "42", "x"])
    route, answer, once, babble = rollouts
    model = lambda r: [m for m in r if m.type is MessageType.MODEL]  # noqa: E731
    # stops: a turn ends right after </search> (tool_call) or </answer> (stop); nothing after the stop is kept
    assert [m.content for m in model(route)] == ["<think>ask</think><search>calc: 2+3</search>"] * 3
    assert [m.finish_reason for m in model(route)] == ["tool_call"] * 3
    assert model(answer)[0].content == "<think>easy</think><answer>5</answer>"
    assert model(answer)[0].finish_reason == "stop" and len(answer) == 2
    # limits: max_turns=2 routing rounds + one final turn; max_routing_calls=1
    assert [c.status for c in route.metadata["env_state"].calls] == ["ok", "over_budget", "not_routed"]
    assert [m.content.strip() for m in route if m.type is MessageType.TOOL] == [
        "<information>5</information>", "<information>routing budget exhausted (1 calls); answer with what you "
        "know</information>"]
    assert [m.finish_reason for m in model(babble)] == ["length"] * 3 and len(babble) == 4
    assert [m.content.strip() for m in once][2:] == ["<information>42</information>",
                                                     "<think>b</think><answer>42</answer>"]
    assert [r.metadata["turns"] for r in rollouts] == [3, 1, 2, 3]
    # masks: exactly the sampled MODEL tokens are trained; TOOL replies never are
    batch = rollouts_to_batch(rollouts, tok)
    for i, r in enumerate(rollouts):
        trained = batch.input_ids[i][batch.loss_mask[i].bool()].tolist()
        assert trained == [t for m in model(r) for t in m.token_ids]
        assert all(m.trainable is None and not m.is_trainable for m in r if m.type is MessageType.TOOL)
        assert all(max(m.logprobs) <= 0 and min(m.logprobs) > -1e-3 for m in model(r))
    rewards = RouterReward(RouterRewardConfig(), env.pool)(rollouts)
    assert rewards.tolist() == [-2.0, 1.0, 1.0, -2.0]  # over budget + no answer; ok; ok; no think + no answer


def test_manager_ends_episodes_over_max_prompt_length(tok):
    cfg = config("generation.max_turns=3", "data.max_response_length=40", "data.max_prompt_length=140",
                 "data.max_start_length=120", "data.prompt_template='{question}'")
    env = RouterEnv(calc_pool(), tok, cfg)
    rollouts = RouterGenerationManager(make_policy_generator(ScriptedLM(tok, script), tok, cfg), env).run(
        ["Q-route"], ["5"])
    assert rollouts[0].metadata["done_reason"] == "context" and 1 <= rollouts[0].metadata["turns"] < 4


# ----------------------------------------------------------------------------- one PPO step on the toy


def toy_trainer(tok, *overrides, reward=None):
    cfg = config("data.prompt_template='Models: {models}\\nQ: {question}\\n'", "data.train_batch_size=2",
                 "data.max_response_length=8", "data.max_prompt_length=200", "data.max_start_length=64",
                 "generation.max_turns=1", "generation.n_agent=2", "trainer.ppo_mini_batch_size=4",
                 "trainer.ppo_micro_batch_size=2", "trainer.kl_coef=0.01", "trainer.actor_lr=1e-3",
                 "trainer.critic_lr=1e-2", "trainer.logger=[]", "trainer.total_training_steps=1",
                 "trainer.save_freq=-1", "validation.test_freq=-1", *overrides)
    rows = [{"question": "1 + 2", "golden_answers": ["3"]}, {"question": "2 + 2", "golden_answers": "4"}]
    return RouterR1Trainer(cfg, tiny_model("qwen2", tok, seed=0), tok, calc_pool(), rows, [], reward=reward)


def snapshot(params):
    return [p.detach().clone() for p in params]


def changed(before, params):
    return any(not torch.equal(a, b) for a, b in zip(before, params, strict=True))


def test_one_ppo_step_trains_actor_and_critic(tok):
    trainer = toy_trainer(tok)
    head, actor = snapshot(trainer.algo.value_head.parameters()), snapshot(trainer.policy.parameters())
    assert {id(p) for p in trainer.algo.value_head.parameters()} <= {
        id(p) for g in trainer.critic_opt.param_groups for p in g["params"]}
    metrics = trainer.train_step(trainer.train_rows)
    # 4 rollouts in micro-batches of 2: the logged metrics are the whole mini-batch's (combine_metrics)
    assert metrics["train/num_sequences"] == 4 and metrics["train/actor_updated"] == 1.0
    assert all(v == v for v in metrics.values())  # no NaN
    assert changed(head, trainer.algo.value_head.parameters()) and changed(actor, trainer.policy.parameters())
    assert "train/kl" in metrics and "train/value_loss" in metrics


def test_critic_warmup_freezes_the_actor_and_grpo_steps(tok):
    trainer = toy_trainer(tok, "trainer.critic_warmup=1", "trainer.critic='model'", "trainer.kl_coef=0.0")
    head, actor = snapshot(trainer.algo.value_parameters()), snapshot(trainer.policy.parameters())
    assert trainer.train_step(trainer.train_rows)["train/actor_updated"] == 0.0
    assert changed(head, trainer.algo.value_parameters()) and not changed(actor, trainer.policy.parameters())
    by_index = lambda rollouts, golds: torch.arange(len(rollouts), dtype=torch.float32)  # noqa: E731
    grpo = toy_trainer(tok, "trainer.adv_estimator='grpo'", reward=by_index)
    actor = snapshot(grpo.policy.parameters())
    metrics = grpo.train_step(grpo.train_rows)
    assert grpo.critic_opt is None and metrics["train/reward"] == 1.5 and changed(actor, grpo.policy.parameters())


# ----------------------------------------------------------------------------- the examples


def _run(args, timeout=240):
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_toy_example_runs(tmp_path):
    out = _run(["examples/router_r1_training.py", "--steps", "1", "--warmup-steps", "5", "--save",
                "--output-dir", str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[toy] after RL" in out.stdout and "[router-r1] [step 1]" in out.stdout
    checkpoint = tmp_path / "checkpoints" / "step-000001"
    assert verify_checkpoint(checkpoint) is None and (checkpoint / "extra.pt").is_file()  # critic and its optimizer
    assert (tmp_path / "final" / "config.json").is_file()


@pytest.mark.slow
def test_math_example_dry_run():
    out = _run(["examples/router_r1_math_qwen.py", "--dry-run"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dry run ok" in out.stdout


@pytest.mark.parametrize("missing", [None, float("nan"), "", [], ["Paris", float("nan")]])
def test_router_r1_reward_refuses_a_missing_gold_answer(missing):
    from SimpleTorchLLMRL.recipes.router_r1.reward import golds_of

    with pytest.raises(ValueError, match="gold answer"):  # `nan` used to be a gold the model could write
        golds_of(missing)
    assert golds_of({"target": ["Paris", "paris"]}) == ["Paris", "paris"] and golds_of(3) == ["3"]
