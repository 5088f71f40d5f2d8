"""share_prefix: a group's shared prompt runs once, and every row's hidden states and gradients equal the plain forward's.

References: the plain HF forward over each whole sequence, on five decoder families (full
attention with RoPE, learned absolute positions, and two sliding-window caches), in float64.
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, MistralConfig

from SimpleTorchLLMRL.model.scoring import shared_prefix
from SimpleTorchLLMRL.model.scoring.head import final_hidden_states
from SimpleTorchLLMRL.model.scoring.logprobs import token_logprobs
from SimpleTorchLLMRL.model.scoring.shared_prefix import first_positions, prefix_groups, shared_hidden_states
from SimpleTorchLLMRL.testing.tiny import tiny_model
from SimpleTorchLLMRL.trainer.grpo import GRPO
from tests.support.losses_helpers import (
    assert_grads_close,
    grads,
    make_rollouts,
    multi_turn_rollout,
    with_sampled_logprobs,
)

V = 300


def _model(arch: str):
    if arch == "gemma3":  # sliding window 4 on two of three layers: the prefixes below are longer than it
        cfg = Gemma3TextConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                               layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                               max_position_embeddings=256)
    elif arch == "mistral":  # one sliding window (5) on every layer
        cfg = MistralConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, sliding_window=5, max_position_embeddings=256)
    else:
        return tiny_model(arch, vocab_size=V)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def _no_dropout(model):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


# rows 0, 1, 2, 6 share 6 tokens, rows 3, 4 share 9, row 5 is alone; lengths vary (right padding)
STARTS = [6, 6, 6, 9, 9, 4, 6]
LENGTHS = [20, 15, 18, 12, 20, 10, 9]


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T = len(STARTS), max(LENGTHS)
    ids = torch.randint(1, V, (B, T), generator=g)
    for r in (1, 2, 6):
        ids[r, :6] = ids[0, :6]
    ids[4, :9] = ids[3, :9]
    am = (torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]).long()
    positions = torch.zeros(B, T, dtype=torch.long)
    for r, (s, n) in enumerate(zip(STARTS, LENGTHS, strict=True)):
        positions[r, s + 1: n] = 1  # scored tokens: the first one is predicted from position s
    return ids * am, am, positions


def test_first_positions_and_groups_are_exact():
    ids, am, positions = _batch()
    start = first_positions(positions)
    assert start.tolist() == STARTS
    group, owner = prefix_groups(ids, start)
    assert group.tolist() == [0, 0, 0, 1, 1, 2, 0] and owner == [0, 3, 5]
    assert prefix_groups(ids[[0, 3, 5]], start[[0, 3, 5]]) is None  # nothing shared: no saving
    assert prefix_groups(ids, torch.tensor([0, 6, 6, 9, 9, 4, 6])) is None  # a row with an empty prefix


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gpt2", "gemma3", "mistral"])
def test_hidden_states_and_gradients_equal_the_plain_forward(arch):
    model = _no_dropout(_model(arch)).double().train()
    ids, am, positions = _batch()
    start = first_positions(positions)
    H = model.get_output_embeddings().weight.shape[1]
    w = torch.randn(*ids.shape, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    needed = ((torch.arange(ids.shape[1])[None] >= start[:, None]) & am.bool())[..., None]  # (B, T, 1)
    out = []
    for s in (None, start):
        model.zero_grad(set_to_none=True)
        h = shared_hidden_states(model, ids, am, start=s)
        (h * w * needed).sum().backward()
        out.append((h.detach() * needed, grads(model)))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=0, atol=1e-10)
    # HF's RMSNorm computes in float32 even in a float64 model: those gradients agree to float32 rounding
    # (relative to each parameter's largest entry); GPT-2 (LayerNorm, learned positions) to float64's
    tol = 1e-12 if arch == "gpt2" else 1e-6
    for name, g in out[0][1].items():
        err = (out[1][1][name] - g).abs().max()
        assert err <= tol * g.abs().max(), (name, float(err), float(g.abs().max()))
    h = shared_hidden_states(model, ids, am, start=start).detach()
    before = torch.arange(ids.shape[1])[None] < start[:, None]
    assert (h[before] == 0).all()  # positions a row does not need are not computed


def test_the_prefix_runs_once_per_group():
    model = tiny_model("qwen2", vocab_size=V).train()
    ids, am, positions = _batch()
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    shared_hidden_states(model, ids, am, start=first_positions(positions), verify=False)
    hook.remove()
    B, T = ids.shape
    P, S = max(STARTS[i] for i in (0, 3, 5)), max(n - s for s, n in zip(STARTS, LENGTHS, strict=True))
    assert seen == [(3, P), (B, S)]  # 3 distinct prefixes, then every row's suffix only
    assert 3 * P + B * S < B * T


def test_a_model_that_ignores_positions_is_refused_loudly():
    # learned absolute positions (RoPE would not notice: a row's positions all shift alike)
    model = tiny_model("gpt2", vocab_size=V).eval()
    inner = model.transformer.forward

    def forward(*a, position_ids=None, **k):  # counts positions from the cache's first slot instead
        return inner(*a, **k)

    model.transformer.forward = forward
    ids, am, positions = _batch()
    with pytest.raises(ValueError, match="share_prefix gives other hidden states than the plain forward"):
        shared_hidden_states(model, ids, am, start=first_positions(positions))


def test_falls_back_to_the_plain_forward_when_nothing_is_shared_or_the_cache_is_off():
    model = tiny_model("qwen2", vocab_size=V).train()
    ids, am, positions = _batch()
    distinct = [0, 3, 5]
    start = first_positions(positions)
    plain = final_hidden_states(model, ids[distinct], am[distinct])
    torch.testing.assert_close(shared_hidden_states(model, ids[distinct], am[distinct], start=start[distinct]), plain)
    left = torch.flip(am, [1])  # a left-padded mask: the shared layout assumes right padding
    torch.testing.assert_close(shared_hidden_states(model, ids, left, start=start), final_hidden_states(model, ids, left))
    model.gradient_checkpointing_enable()
    full = final_hidden_states(model, ids, am)
    torch.testing.assert_close(shared_hidden_states(model, ids, am, start=start), full)


def _grpo_step(model, tok, rollouts, rewards, **kw):
    model.zero_grad(set_to_none=True)
    grpo = GRPO(model, tok, group_size=3, **kw)
    loss = grpo.calculate_loss(rollouts, rewards)
    loss.backward()
    return loss.detach(), grads(model), grpo


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_and_gradients_match_without_sharing(qwen2_model, chatml_tokenizer, beta):
    from peft import LoraConfig, get_peft_model

    model = qwen2_model.train()
    if beta:  # the reference is the same model with its adapter off: a peft model
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1)
    rollouts = with_sampled_logprobs(make_rollouts(2, 3), model, chatml_tokenizer, 1.0, shift=0.05)
    rollouts[4].add_messages(*list(multi_turn_rollout())[2:])  # one multi-turn row: two trained turns
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.3, 2.0])
    loss0, g0, plain = _grpo_step(model, chatml_tokenizer, rollouts, rewards, beta=beta)
    loss1, g1, shared = _grpo_step(model, chatml_tokenizer, rollouts, rewards, beta=beta, share_prefix=True)
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-7)
    assert_grads_close(g1, g0, rtol=1e-4, atol=1e-6)
    for key in ("entropy", "ratio_mean", "clip_frac", "kl" if beta else "num_tokens"):
        assert shared.metrics[key] == pytest.approx(plain.metrics[key], rel=1e-4, abs=1e-6)


def test_grpo_micro_batches_with_sharing_equal_one_batch(qwen2_model, chatml_tokenizer):
    model = qwen2_model.train()
    rollouts = with_sampled_logprobs(make_rollouts(2, 3), model, chatml_tokenizer, 1.0, shift=0.1)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.3, 2.0])
    _, whole, _ = _grpo_step(model, chatml_tokenizer, rollouts, rewards, share_prefix=True)
    model.zero_grad(set_to_none=True)
    grpo = GRPO(model, chatml_tokenizer, group_size=3, share_prefix=True)
    tb = grpo.prepare(rollouts, rewards)
    for mb in tb.split(3):  # one group per micro-batch
        grpo.calculate_loss(mb).backward()
    assert_grads_close(grads(model), whole, rtol=1e-4, atol=1e-6)


def test_no_grad_logprob_pass_shares_too(qwen2_model, chatml_tokenizer):
    model = copy.deepcopy(qwen2_model).eval()
    from SimpleTorchLLMRL.chat.tokenize import rollouts_to_batch

    batch = rollouts_to_batch(make_rollouts(2, 3), chatml_tokenizer)
    mask = batch.loss_mask
    calls = []
    original = shared_prefix.shared_prefix_hidden_states

    def spy(*a, **k):
        calls.append(1)
        return original(*a, **k)

    shared_prefix.shared_prefix_hidden_states = spy
    try:
        with torch.no_grad():
            a = token_logprobs(model, batch, positions=mask)
            b = token_logprobs(model, batch, positions=mask, share_prefix=True)
    finally:
        shared_prefix.shared_prefix_hidden_states = original
    assert calls  # the shared path ran
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- generation: one prefill per prompt


@pytest.mark.parametrize("style", ["chatml", "llama3", "plain"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_group_generation_with_a_shared_prefill_samples_what_the_plain_prefill_does(style, temperature):
    from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
    from SimpleTorchLLMRL.chat.tokenize import encode_prompt
    from SimpleTorchLLMRL.model.generation.generator import ModelGenerate, extend_groups
    from SimpleTorchLLMRL.testing.tiny import tiny_tokenizer
    from tests.support.generation_helpers import peaked, reference_logprobs

    tok = tiny_tokenizer(style)
    model = peaked(tiny_model({"chatml": "qwen2", "llama3": "llama", "plain": "gpt2"}[style], tok))
    prompts = [Rollout([Message("You are a helpful assistant.", MessageType.SYSTEM), Message(t)])
               for t in ["What is 12 + 35?", "hi", "def f(x):\n    return x"]]  # three lengths: left padding
    rows = []
    embed = model.get_input_embeddings()
    hook = embed.register_forward_hook(lambda m, i, o: rows.append(tuple(i[0].shape)))
    runs = []
    for share in (False, True):
        gen = ModelGenerate(model, tok, max_new_tokens=10, temperature=temperature, seed=7)
        gen.backend.share_prefill = share
        rows.clear()
        runs.append(extend_groups(prompts, gen.generate(prompts, n=4)))
        runs[-1] = (runs[-1], list(rows))
    hook.remove()
    (plain, plain_calls), (shared, shared_calls) = runs
    L = plain_calls[0][1]
    assert plain_calls[0] == (12, L) and shared_calls[:2] == [(3, L - 1), (12, 1)]  # 3 prompts prefilled once
    for i, (a, b) in enumerate(zip(plain, shared, strict=True)):
        assert b[-1].token_ids == a[-1].token_ids
        torch.testing.assert_close(torch.tensor(b[-1].logprobs), torch.tensor(a[-1].logprobs), atol=1e-5, rtol=0)
        ref = reference_logprobs(model, encode_prompt(prompts[i // 4], tok), b[-1].token_ids, temperature or 1.0)
        torch.testing.assert_close(torch.tensor(b[-1].logprobs, dtype=torch.float64), ref, atol=1e-3, rtol=0)


def test_a_fresh_model_can_start_with_the_shared_forward():
    """The head check of `shared_hidden_states` reads the suffix forward's own last position."""
    model = tiny_model("qwen2", vocab_size=V).train()
    ids, am, positions = _batch()
    hidden = shared_hidden_states(model, ids, am, start=first_positions(positions))  # the model's first forward
    assert hidden.shape == (*ids.shape, 64)
