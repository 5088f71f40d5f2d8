"""Agents with their own policies: one LoRA adapter per agent on one base model, trained in a plain loop.

Generation with an agent's adapter equals a copy with only that adapter merged; one agent's loss
reaches only its adapter; the mask holds exactly the chosen agent's sampled ids; every adapter
saves and loads exactly; rollout files keep which adapter sampled a turn; vLLM serves one
LoRARequest per agent (tests/support/fake_vllm.py).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.rollout_io import load_rollouts, save_rollouts
from SimpleTorchLLMRL.chat.tokenize import encode_prompt, encode_rollout, rollouts_to_batch
from SimpleTorchLLMRL.env.multiagent import agent_turns, set_trainable_agents, take_turns, view_for_agent
from SimpleTorchLLMRL.model.adapters import (
    adapter_names,
    adapter_parameters,
    adapter_state_dict,
    add_agent_adapters,
    freeze_adapter,
    load_adapters,
    merged_adapter_model,
    save_adapters,
    use_adapter,
)
from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig
from SimpleTorchLLMRL.testing.tiny import tiny_model
from SimpleTorchLLMRL.trainer.grpo import GRPO
from tests.support.fake_vllm import install_fake_vllm
from tests.support.generation_helpers import peaked

AGENTS = ["A", "B"]


def base_model(tok):
    return peaked(tiny_model("qwen2", tok), seed=0)  # prompt-sensitive: greedy outputs differ per prompt


def two_agents(tok, seed=0):
    """A base model with adapters A and B, both random (init_lora_weights=False): neither is the base."""
    torch.manual_seed(seed)
    return add_agent_adapters(base_model(tok), AGENTS, r=4, alpha=8, init_lora_weights=False)


def prompts():
    texts = ["What is 12 + 35?", "hi", "def f(x):"]
    return [Rollout([Message("Be brief.", MessageType.SYSTEM), Message(t)]) for t in texts]


def ids_of(groups):
    return [[m.token_ids for m in g] for g in groups]


def lora_names(model, agent):
    return {n for n, _ in model.named_parameters() if f".{agent}." in n and "lora_" in n}


# ----------------------------------------------------------------------------- adapters and routing


def test_one_trainable_adapter_per_agent_and_a_frozen_base(tok):
    model = two_agents(tok)
    assert adapter_names(model) == AGENTS
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == lora_names(model, "A") | lora_names(model, "B") and lora_names(model, "A")
    a, b = adapter_parameters(model, "A"), adapter_parameters(model, "B")
    assert {id(p) for p in a}.isdisjoint(id(p) for p in b) and len(a) == len(b) > 0
    with pytest.raises(ValueError, match="already has adapters"):
        add_agent_adapters(model, ["B"])
    with pytest.raises(ValueError, match="distinct"):
        add_agent_adapters(base_model(tok), ["A", "A"])
    with pytest.raises(ValueError, match="no adapter 'C'"):
        adapter_parameters(model, "C")
    add_agent_adapters(model, ["C"], r=2)  # a PeftModel takes more agents
    assert adapter_names(model) == ["A", "B", "C"] and all(p.requires_grad for p in adapter_parameters(model, "C"))


def test_use_adapter_routes_the_forward_pass_and_leaves_requires_grad_alone(tok):
    model, plain = two_agents(tok), base_model(tok)
    ids = torch.tensor([encode_prompt(prompts()[0], tok)])
    freeze_adapter(model, "B")
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad():
        out = {}
        for name in ["A", "B", None]:
            with use_adapter(model, name):
                assert {n: p.requires_grad for n, p in model.named_parameters()} == flags  # B stays frozen inside
                out[name] = model(input_ids=ids).logits
        want_base = plain(input_ids=ids).logits
    assert not torch.allclose(out["A"], out["B"]) and not torch.allclose(out["A"], out[None])
    torch.testing.assert_close(out[None], want_base, rtol=0, atol=1e-6)  # None: the base model itself
    assert model.active_adapter == "A" and {n: p.requires_grad for n, p in model.named_parameters()} == flags
    with pytest.raises(RuntimeError, match="boom"), use_adapter(model, "B"):
        raise RuntimeError("boom")
    assert model.active_adapter == "A"  # restored after an exception too


# ----------------------------------------------------------------------------- generation


@pytest.mark.parametrize("agent", AGENTS)
def test_generation_with_an_agents_adapter_equals_a_copy_with_only_it_merged(tok, agent):
    model = two_agents(tok)
    kw = dict(max_new_tokens=12, temperature=1.0, seed=0)
    got = ModelGenerate(model, tok, **kw).generate(prompts(), n=2, adapter=agent)
    merged = merged_adapter_model(model, agent)
    assert not adapter_names(merged) and adapter_names(model) == AGENTS and model.active_adapter == "A"
    want = ModelGenerate(merged, tok, **kw).generate(prompts(), n=2)
    assert ids_of(got) == ids_of(want)  # same seed, exact token ids
    for g, w in zip(got, want, strict=True):
        for m, ref in zip(g, w, strict=True):
            assert m.adapter == agent and ref.adapter is None
            torch.testing.assert_close(torch.tensor(m.logprobs), torch.tensor(ref.logprobs), rtol=0, atol=1e-4)
    other = "B" if agent == "A" else "A"
    assert ids_of(ModelGenerate(model, tok, **kw).generate(prompts(), n=2, adapter=other)) != ids_of(got)


def test_a_mixed_batch_runs_one_batch_per_adapter(tok):
    model = two_agents(tok)
    kw = dict(max_new_tokens=10, temperature=1.0, seed=3)
    rs = prompts()
    mixed = ModelGenerate(model, tok, **kw).generate(rs, adapter=["A", "B", "A"], seed=[1, 2, 3])
    gen = ModelGenerate(model, tok, **kw)  # each prompt's own seed: the same samples in any batch
    a = gen.generate([rs[0], rs[2]], adapter="A", seed=[1, 3])
    b = gen.generate([rs[1]], adapter="B", seed=2)
    assert ids_of(mixed) == ids_of([a[0], b[0], a[1]])
    assert [g[0].adapter for g in mixed] == ["A", "B", "A"]
    with pytest.raises(ValueError, match="one per prompt"):
        gen.generate(rs, adapter=["A", "B"])
    with pytest.raises(ValueError, match="no adapter 'C'"):
        gen.generate(rs, adapter="C")
    assert model.active_adapter == "A"


def test_an_agent_without_adapter_samples_from_the_base(tok):
    model = two_agents(tok)
    kw = dict(max_new_tokens=10, temperature=1.0, seed=4)
    with use_adapter(model, None):  # e.g. a fixed opponent that is the base model itself
        got = ModelGenerate(model, tok, **kw).generate(prompts())
    assert ids_of(got) == ids_of(ModelGenerate(base_model(tok), tok, **kw).generate(prompts()))
    assert all(g[0].adapter is None for g in got) and model.active_adapter == "A"


# ----------------------------------------------------------------------------- episodes, masks, gradients


def episode_batch(model, tok, groups=2, group_size=2, view=False):
    """Episodes: user, A (adapter A), tool, B (adapter B), A again; sampled in batches, each agent its adapter."""
    gen = ModelGenerate(model, tok, max_new_tokens=8, temperature=1.0, seed=1)
    episodes = [Rollout([Message("Debate.", MessageType.SYSTEM), Message(f"Is {91 + 2 * g} prime?")],
                        {"group_id": g}) for g in range(groups) for _ in range(group_size)]
    prompted = {}

    def respond(agent):
        def call(rs):
            prompted.setdefault(agent, []).append([encode_prompt(r, tok) for r in rs])
            return [m[0] for m in gen.generate(rs, adapter=agent)]
        return call

    for agent in ["A", "B", "A"]:
        take_turns(episodes, agent, respond(agent), view=view)
        if agent == "A" and len(prompted["A"]) == 1:
            for e in episodes:
                e.add_messages(Message("27", MessageType.TOOL))
    return episodes, prompted


@pytest.mark.parametrize("view", [False, True], ids=["shared-transcript", "per-agent-view"])
def test_the_mask_trains_exactly_the_chosen_agents_sampled_ids(view):
    from SimpleTorchLLMRL.testing.tiny import tiny_tokenizer

    for style in ["chatml", "llama3", "plain"]:
        tok = tiny_tokenizer(style)
        torch.manual_seed(0)
        model = add_agent_adapters(tiny_model("qwen2", tok), AGENTS, r=4, alpha=8, init_lora_weights=False)
        episodes, prompted = episode_batch(model, tok, view=view)
        for agent in AGENTS:
            turns = [agent_turns(e, agent) for e in episodes]
            assert all(m.adapter == agent and m.name == agent for ts in turns for m in ts)
            if view:
                train = [view_for_agent(e, agent) for e in episodes]
            else:
                train = [set_trainable_agents(e.copy(), agent) for e in episodes]
            batch = rollouts_to_batch(train, tok)
            for row, ts in enumerate(turns):
                mask = batch.loss_mask[row].bool()
                assert batch.input_ids[row][mask].tolist() == [t for m in ts for t in m.token_ids], style
                sampled = batch.sampler_logprobs[row][mask]
                assert sampled.tolist() == pytest.approx([x for m in ts for x in m.logprobs], abs=1e-6)
            # what the agent was prompted with + what it sampled is a prefix of what it is trained on
            for k, batch_prompts in enumerate(prompted[agent]):
                for row, (prompt, e) in enumerate(zip(batch_prompts, train, strict=True)):
                    ids = encode_rollout(e, tok).input_ids
                    sampled_ids = turns[row][k].token_ids
                    assert ids[: len(prompt) + len(sampled_ids)] == prompt + sampled_ids, (style, agent, k)


def test_one_agents_loss_reaches_only_its_adapter_and_steps_only_it(tok):
    model = two_agents(tok)
    episodes, _ = episode_batch(model, tok)
    rewards = {"A": torch.tensor([1.0, 0.0, 0.0, 1.0]), "B": torch.tensor([0.0, 1.0, 1.0, 0.0])}
    optimizers = {a: torch.optim.SGD(adapter_parameters(model, a), lr=0.5) for a in AGENTS}
    for agent in AGENTS:
        other = "B" if agent == "A" else "A"
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        batch = [set_trainable_agents(e.copy(), agent) for e in episodes]
        with use_adapter(model, agent):
            loss = GRPO(model, tok, beta=0.1, temperature=1.0).calculate_loss(batch, rewards[agent])
            loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert all(grads[n] is None for n in lora_names(model, other))  # B's adapter: never touched
        base = [n for n in grads if "lora_" not in n]
        assert base and all(grads[n] is None for n in base)  # nor the base weights
        assert any(grads[n] is not None and grads[n].abs().sum() > 0 for n in lora_names(model, agent))
        optimizers[agent].step()
        optimizers[agent].zero_grad(set_to_none=True)
        changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        assert changed and changed <= lora_names(model, agent)


def test_the_kl_reference_of_every_agent_is_the_base_model(tok):
    model, plain = two_agents(tok), base_model(tok)
    episodes, _ = episode_batch(model, tok)
    for agent in AGENTS:
        batch = [set_trainable_agents(e.copy(), agent) for e in episodes]
        with use_adapter(model, agent):
            tb = GRPO(model, tok, beta=0.1, temperature=1.0).prepare(batch, torch.arange(4.0))
        with torch.no_grad():
            logits = plain(input_ids=tb.batch.input_ids, attention_mask=tb.batch.attention_mask).logits.double()
        want = torch.log_softmax(logits[:, :-1], -1).gather(-1, tb.batch.input_ids[:, 1:, None])[..., 0]  # (B, T-1)
        m = tb.mask[:, 1:].bool()
        torch.testing.assert_close(tb.ref_logprobs[:, 1:][m].double(), want[m], rtol=0, atol=1e-5)


@pytest.mark.parametrize("frozen", [None, "B"])
def test_the_reference_pass_leaves_every_adapter_trainable(tok, frozen):
    """The KL reference disables the adapters (peft re-freezes inactive ones on exit); afterwards each
    adapter is as trainable (or frozen) as before."""
    model = two_agents(tok)
    if frozen:
        freeze_adapter(model, frozen)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    episodes, _ = episode_batch(model, tok)
    batch = [set_trainable_agents(e.copy(), "A") for e in episodes]
    GRPO(model, tok, beta=0.1, temperature=1.0).prepare(batch, torch.arange(4.0))  # outside use_adapter
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags


# ----------------------------------------------------------------------------- saving


def test_save_and_load_of_all_adapters_round_trips_exactly(tok, tmp_path):
    model = two_agents(tok)
    freeze_adapter(model, "B")  # a fixed agent stays fixed after loading
    dirs = save_adapters(model, tmp_path / "adapters")
    assert sorted(dirs) == AGENTS and all((Path(d) / "adapter_config.json").is_file() for d in dirs.values())
    loaded = load_adapters(base_model(tok), tmp_path / "adapters")
    assert adapter_names(loaded) == AGENTS
    for agent in AGENTS:
        want, got = adapter_state_dict(model, agent), adapter_state_dict(loaded, agent)
        assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
    assert all(p.requires_grad for p in adapter_parameters(loaded, "A"))
    assert not any(p.requires_grad for p in adapter_parameters(loaded, "B"))
    kw = dict(max_new_tokens=8, temperature=1.0, seed=5)
    for agent in AGENTS:
        assert ids_of(ModelGenerate(loaded, tok, **kw).generate(prompts(), adapter=agent)) == \
            ids_of(ModelGenerate(model, tok, **kw).generate(prompts(), adapter=agent))
    frozen = load_adapters(base_model(tok), tmp_path / "adapters", ["B"], is_trainable=False)
    assert adapter_names(frozen) == ["B"] and not any(p.requires_grad for p in frozen.parameters())
    with pytest.raises(ValueError, match="no saved adapter"):
        load_adapters(base_model(tok), tmp_path / "adapters", ["C"])


def test_rollout_files_keep_which_adapter_sampled_each_turn(tok, tmp_path):
    model = two_agents(tok)
    episodes, _ = episode_batch(model, tok, groups=1)
    plain = Rollout([Message("q"), Message("a", MessageType.MODEL, token_ids=[1], logprobs=[-0.5])])
    for suffix in [".jsonl", ".parquet"]:
        back = load_rollouts(save_rollouts(tmp_path / f"r{suffix}", [*episodes, plain]))
        assert [list(r) for r in back] == [list(r) for r in [*episodes, plain]]
        assert [m.adapter for m in back[0] if m.type is MessageType.MODEL] == ["A", "B", "A"]
    record = episodes[0].to_dict()
    assert record["format_version"] == 2 and plain.to_dict()["format_version"] == 1  # old readers read the latter
    with pytest.raises(ValueError, match="unknown fields"):
        Rollout.from_dict({**record, "format_version": 1})
    with pytest.raises(TypeError, match="adapter"):
        Message("x", MessageType.MODEL, adapter="")


# ----------------------------------------------------------------------------- vLLM (fake, CPU)


def test_vllm_serves_one_lora_request_per_agent(monkeypatch, tok, tmp_path):
    vllm = install_fake_vllm(monkeypatch)
    model = two_agents(tok)
    base_model(tok).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    llm = vllm.LLM(str(tmp_path / "base"), enable_lora=True)
    gen = ModelGenerate(llm, tok, sampling=SamplingConfig(max_new_tokens=8, do_sample=False))
    with pytest.raises(ValueError, match="push_weights"):
        gen.generate(prompts(), adapter="A")
    gen.push_weights(model, mode="adapter", adapter=AGENTS)
    assert gen.policy_version == 1 and sorted(gen.backend.lora_requests) == AGENTS
    hf = ModelGenerate(model, tok, sampling=SamplingConfig(max_new_tokens=8, do_sample=False))
    want = {a: ids_of(hf.generate(prompts(), adapter=a)) for a in AGENTS}
    assert want["A"] != want["B"]
    for agent in AGENTS:
        got = gen.generate(prompts(), adapter=agent)
        assert ids_of(got) == want[agent] and all(g[0].adapter == agent for g in got)
    llm.generate_calls.clear()
    mixed = gen.generate(prompts(), adapter=["B", "A", "B"])
    assert ids_of(mixed) == [want["B"][0], want["A"][1], want["B"][2]]
    assert len(llm.generate_calls) == 1  # vLLM: one batch, one LoRARequest per prompt
    ids_before = {a: r.lora_int_id for a, r in gen.backend.lora_requests.items()}
    gen.push_weights(model, mode="adapter", adapter="A")
    assert gen.backend.lora_requests["A"].lora_int_id > max(ids_before.values())  # vLLM caches adapters by id
    assert gen.backend.lora_requests["B"].lora_int_id == ids_before["B"]
    with pytest.raises(ValueError, match="mode='adapter'"):
        gen.push_weights(model, mode="merged", adapter="A")


# ----------------------------------------------------------------------------- the example


def test_example_runs_both_agents_in_one_loop(tmp_path):
    path = Path(__file__).resolve().parents[2] / "examples" / "multi_policy.py"
    spec = importlib.util.spec_from_file_location("multi_policy_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--steps", "2", "--batch-size", "2", "--group-size", "2", "--eval-episodes", "4",
                    "--beta", "0.05", "--out", str(tmp_path)])
    assert set(out["before"]) == set(out["after"]) == {"planner", "finisher"}
    assert len(out["history"]) == 2 and all(math.isfinite(v) for r in out["history"] for v in r.values())
    assert (tmp_path / "rewards.png").stat().st_size > 0
    assert json.loads((tmp_path / "adapters" / "agents.json").read_text())["adapters"] == ["planner", "finisher"]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    mod.main(["--steps", "1", "--batch-size", "2", "--group-size", "2", "--eval-episodes", "2",
              "--frozen", "finisher", "--out", str(tmp_path / "frozen")])
    trainable = json.loads((tmp_path / "frozen" / "adapters" / "agents.json").read_text())["trainable"]
    assert trainable == {"planner": True, "finisher": False}


def test_take_turns_checks_what_respond_returns():
    rs = [Rollout([Message("q")]), Rollout([Message("q")])]
    with pytest.raises(ValueError, match="1 messages for 2 rollouts"):
        take_turns(rs, "A", lambda views: [Message("x", MessageType.MODEL)])
    with pytest.raises(TypeError, match="Message"):
        take_turns(rs, "A", lambda views: ["x", "y"])
    replies = take_turns(rs, "A", lambda views: [Message(f"r{i}", MessageType.MODEL) for i in range(len(views))],
                         view=False)
    assert [r[-1] for r in rs] == replies and all(m.name == "A" for m in replies)
