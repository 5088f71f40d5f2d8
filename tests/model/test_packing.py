"""Padding-free batches (`model.scoring.packing`, `packed=`): packed equals padded in float64 for every front,
loss variant and micro-batching, on the tiny models of three families and both mask attentions; the layout
itself; what cannot pack (refused under True, padded under None); bucketing bounds the shapes a compiled body
sees; flash's varlen path through a stand-in attention."""

from __future__ import annotations

import random

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.model.scoring.logprobs import ComputeOptions, hidden_states
from SimpleTorchLLMRL.model.scoring.packing import bucket, packing_kind, plan_packing
from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer
from SimpleTorchLLMRL.trainer.distill import Distill
from SimpleTorchLLMRL.trainer.dpo import DPO
from SimpleTorchLLMRL.trainer.grpo import GRPO
from SimpleTorchLLMRL.trainer.pipeline import trained_index
from SimpleTorchLLMRL.trainer.ppo import PPO
from SimpleTorchLLMRL.trainer.sft import SFT
from tests.support.losses_helpers import (
    grads,
    make_rollouts,
    multi_turn_rollout,
    perturbed_copy,
    with_sampled_logprobs,
)

FAMILIES = [("qwen2", "chatml", "sdpa"), ("qwen2", "chatml", "eager"), ("llama", "llama3", "sdpa"),
            ("llama", "llama3", "eager"), ("gpt2", "plain", "sdpa"), ("gpt2", "plain", "eager")]
REWARDS = [1.0, 0.0, 0.5, 0.0, 1.0, 0.25, 0.0, 0.75]
KEYS = ("loss", "entropy", "num_tokens")


def _model(arch: str, style: str, impl: str = "sdpa", **config):
    tok = tiny_tokenizer(style)
    model = tiny_model(arch, tok, **config).double()
    model.set_attn_implementation(impl)
    return model, tok


def _ragged(model, tok, shift: float = 0.3) -> list[Rollout]:
    """Rows of very different lengths: three groups' replies, and a multi-turn one with a trailing untrained turn."""
    long = Rollout([Message("What is 12 + 35?"), Message("Let me think. " * 24 + "\\boxed{47}", MessageType.MODEL)])
    rows = with_sampled_logprobs([*make_rollouts(2, 3), long], model, tok, temperature=1.0, shift=shift)
    rows.append(multi_turn_rollout())
    for r, group in zip(rows, [0, 0, 0, 1, 1, 1, 2, 2], strict=True):
        r.metadata["group_id"] = group
    return rows


def _run(front, call, model):
    """(loss, metrics, token_logprobs, grads) of one call and backward, the model's grads reset after."""
    out = call(front)
    out.loss.backward()
    g = grads(model)
    for i, extra in enumerate(getattr(front, "value_parameters", lambda: [])()):
        g[f"value:{i}"] = extra.grad.clone()
    model.zero_grad()
    for extra in getattr(front, "value_parameters", lambda: [])():
        extra.grad = None
    return out.loss.detach(), dict(out.metrics), out.token_logprobs, g


def assert_same(a, b, atol=1e-10):
    (la, ma, ta, ga), (lb, mb, tb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=0, atol=atol)
    assert ma.keys() == mb.keys()
    for k in ma:
        assert ma[k] == pytest.approx(mb[k], rel=1e-9, abs=atol), k
    torch.testing.assert_close(ta, tb, rtol=0, atol=atol, equal_nan=True)
    assert ga.keys() == gb.keys()
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-9 if atol <= 1e-10 else 1e-6, atol=atol,
                                   msg=lambda m, n=n: f"{n}: {m}")


def _both(make, call, model):
    """The same front and call, padded then packed: the packed one really packs."""
    runs = {}
    for packed in (False, True):
        torch.manual_seed(0)  # a value head is drawn when the front is built
        front = make(packed)
        runs[packed] = _run(front, call, model)
        if packed:  # and packs: every row a run of the one packed row
            plan = front.last_pack_plan
            assert plan is not None and len(plan.rows.bounds) - 1 >= front.rows
    return runs[False], runs[True]


class _Recording:
    """Wraps a front so the test sees the prepared batch's pack plan (the front itself keeps none)."""

    def __init__(self, front):
        self.front, self.last_pack_plan, self.rows = front, None, 0

    def prepare(self, *args, **kwargs):
        tb = self.front.prepare(*args, **kwargs)
        self.last_pack_plan, self.rows = tb.pack_plan, len(tb)
        return tb

    def __getattr__(self, name):
        return getattr(self.front, name)


# ---------------------------------------------------------------- every front, packed == padded in float64


@pytest.mark.parametrize("family", FAMILIES, ids=["-".join(f) for f in FAMILIES])
def test_grpo_and_ppo_packed_equal_padded_on_every_family(family):
    model, tok = _model(*family)
    rollouts, ref = _ragged(model, tok), perturbed_copy(model)
    atol = 1e-6 if family[2] == "eager" else 1e-10  # HF's eager attention takes its softmax in float32
    grpo = lambda packed: _Recording(GRPO(model, tok, beta=0.1, ref_model=ref, group_size=None,  # noqa: E731
                                          packed=packed, chunk_size=7))
    assert_same(*_both(grpo, lambda f: f.compute(f.prepare(rollouts, REWARDS)), model), atol)
    ppo = lambda packed: _Recording(PPO(model, tok, beta=0.05, ref_model=ref, packed=packed))  # noqa: E731
    assert_same(*_both(ppo, lambda f: f.compute(f.prepare(rollouts, REWARDS)), model), atol)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_every_grpo_loss_variant_packed_equals_padded(loss_type, fused):
    model, tok = _model("qwen2", "chatml")
    rollouts, ref = _ragged(model, tok), perturbed_copy(model)
    make = lambda packed: _Recording(GRPO(model, tok, beta=0.1, ref_model=ref, loss_type=loss_type,  # noqa: E731
                                          max_tokens=64, fused=fused, packed=packed, chunk_size=5))
    assert_same(*_both(make, lambda f: f.compute(f.prepare(rollouts, REWARDS)), model))


def test_micro_batches_of_a_packed_batch_add_up_to_the_padded_batch():
    """The losses are summed in another order (the head's log-probs are float32): float32 tolerances."""
    model, tok = _model("llama", "llama3")
    rollouts = _ragged(model, tok)
    padded = _run(GRPO(model, tok, packed=False), lambda f: f.compute(f.prepare(rollouts, REWARDS)), model)
    grpo = GRPO(model, tok, packed=True, length_buckets=2)
    parts = grpo.prepare(rollouts, REWARDS).split(3)
    assert all(p.pack_plan is not None for p in parts)
    outs = [grpo.compute(p) for p in parts]
    sum(o.loss for o in outs).backward()
    torch.testing.assert_close(sum(o.loss.detach() for o in outs), padded[0], rtol=1e-5, atol=1e-7)
    g = grads(model)
    for n in g:
        torch.testing.assert_close(g[n], padded[3][n], rtol=1e-4, atol=1e-6)
    model.zero_grad()


def test_ppo_with_a_critic_packed_equals_padded():
    model, tok = _model("qwen2", "chatml")
    critic = perturbed_copy(model)
    rollouts = _ragged(model, tok)
    make = lambda packed: _Recording(PPO(model, tok, critic=critic, packed=packed))  # noqa: E731
    a, b = _both(make, lambda f: f.compute(f.prepare(rollouts, REWARDS)), model)
    assert_same(a, b)
    assert any(k.startswith("value:") for k in a[3])  # the value parameters' gradients are compared too


def test_sft_dpo_and_distill_packed_equal_padded():
    model, tok = _model("qwen2", "chatml")
    rollouts = _ragged(model, tok)
    ref, teacher = perturbed_copy(model), perturbed_copy(model, 0.1)
    sft = lambda packed: _Recording(SFT(model, tok, packed=packed))  # noqa: E731
    assert_same(*_both(sft, lambda f: f.compute(f.prepare(rollouts)), model))
    short = Rollout([Message("What is 12 + 35?"), Message("47", MessageType.MODEL)])  # the long row's prompt
    chosen, rejected = [rollouts[0], rollouts[6], rollouts[3]], [rollouts[1], short, rollouts[5]]
    dpo = lambda packed: _Recording(DPO(model, tok, ref_model=ref, packed=packed))  # noqa: E731
    assert_same(*_both(dpo, lambda f: f.compute(f.prepare(chosen, rejected)), model))
    for divergence, rewards in (("reverse_kl", REWARDS), ("jsd", None)):
        distill = lambda packed, d=divergence: _Recording(  # noqa: E731
            Distill(model, tok, teacher=teacher, divergence=d, packed=packed, chunk_size=6))
        assert_same(*_both(distill, lambda f, r=rewards: f.compute(f.prepare(rollouts, r)), model))


def test_packed_rows_give_zero_gradient_to_the_slots_that_predict_nothing():
    """Each slot's final hidden state only feeds the token it predicts: its gradient is nonzero exactly at the
    plan's index (the trained tokens), zero at untrained tokens and at the slots that round a row up."""
    model, tok = _model("qwen2", "chatml")
    grpo = GRPO(model, tok, packed=True, length_buckets=1)
    rewards = [1.0, 0.0, 0.25, 0.0, 1.0, 0.25, 0.0, 0.75]  # no advantage is 0
    tb = grpo.prepare(_ragged(model, tok, shift=0.0), rewards)  # on-policy: no token is clipped
    captured = {}

    def keep(module, inputs, out):
        if torch.is_grad_enabled():
            out.retain_grad()
            captured["h"] = out

    hook = model.model.norm.register_forward_hook(keep)
    try:
        grpo.compute(tb).loss.backward()
    finally:
        hook.remove()
    g = captured["h"].grad.abs().sum(-1).reshape(-1)  # (L,)
    L = tb.pack_plan.length
    assert captured["h"].shape[:2] == (1, L) and L > tb.pack_plan.index.numel()
    used = torch.zeros(L, dtype=torch.bool)
    used[tb.pack_plan.index] = True
    assert torch.all(g[used] > 0) and torch.all(g[~used] == 0)
    model.zero_grad()


# ---------------------------------------------------------------- share_prefix, and models that cannot pack


def test_share_prefix_runs_padded_under_none_and_is_refused_with_true():
    model, tok = _model("qwen2", "chatml")
    rollouts = _ragged(model, tok)[:6]
    shared = GRPO(model, tok, group_size=3, share_prefix=True)
    tb = shared.prepare(rollouts, REWARDS[:6])
    assert tb.pack_plan is None and tb.prefix_plan is not None and tb.prefix_plan.group is not None
    a = _run(shared, lambda f: f.compute(tb), model)
    b = _run(GRPO(model, tok, group_size=3, packed=True), lambda f: f.compute(f.prepare(rollouts, REWARDS[:6])),
             model)
    assert_same(a, b, atol=1e-9)
    with pytest.raises(ValueError, match="packed=True and share_prefix=True do not combine"):
        GRPO(model, tok, packed=True, share_prefix=True)


def test_a_model_whose_attention_cannot_pack_is_refused_under_true_and_padded_under_none():
    from transformers import AutoModelForCausalLM, Qwen2Config

    tok = tiny_tokenizer("chatml")
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                         max_window_layers=0, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config).double()
    assert packing_kind(model) is None
    rollouts = _ragged(model, tok)
    with pytest.raises(ValueError, match=r"^packed=True: Qwen2ForCausalLM has sliding-window attention layers") as e:
        GRPO(model, tok, packed=True).prepare(rollouts, REWARDS)
    assert "\n" not in str(e.value)  # one line
    tb = GRPO(model, tok).prepare(rollouts, REWARDS)
    assert tb.pack_plan is None
    with pytest.raises(ValueError, match=r"attention 'flex_attention' does not take packed rows"):
        other, _ = _model("llama", "llama3")
        other.config._attn_implementation = "flex_attention"
        GRPO(other, tok, packed=True).prepare(rollouts, REWARDS)


def test_a_model_that_fails_the_packed_check_pads_under_none_and_is_refused_under_true():
    """A model whose body ignores the packed rows' position ids (its learned positions then run 0..C-1 across
    the rows; RoPE's relative angles would not notice) passes the static rule but not the once-per-model check
    against its padded forward."""
    model, tok = _model("gpt2", "plain")
    drop = model.transformer.register_forward_pre_hook(
        lambda m, args, kwargs: (args, {k: v for k, v in kwargs.items() if k != "position_ids"}), with_kwargs=True)
    try:
        rollouts = _ragged(model, tok)
        with pytest.raises(ValueError, match="packed rows give other hidden states than the padded batch"):
            GRPO(model, tok, packed=True).calculate_loss(rollouts, REWARDS)
        with pytest.warns(UserWarning, match="Running it padded"):
            loss = GRPO(model, tok).calculate_loss(rollouts, REWARDS)
        padded = GRPO(model, tok, packed=False).calculate_loss(rollouts, REWARDS)
        torch.testing.assert_close(loss, padded, rtol=0, atol=1e-12)
    finally:
        drop.remove()


def test_a_packed_forward_that_raises_pads_under_none_and_raises_under_true(monkeypatch):
    """A kernel that fails on the device (here: the per-row attention raising) must not end a run that did not ask
    for packing: the check's failure warns and the model pads."""
    from SimpleTorchLLMRL.model.scoring import packing

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(packing, "_each_run", broken)
    model, tok = _model("llama", "llama3")
    rollouts = _ragged(model, tok)
    with pytest.raises(RuntimeError, match="no kernel image"):
        GRPO(model, tok, packed=True).calculate_loss(rollouts, REWARDS)
    with pytest.warns(UserWarning, match=r"packed forward failed its check.*RuntimeError: no kernel image.*padded"):
        loss = GRPO(model, tok).calculate_loss(rollouts, REWARDS)
    torch.testing.assert_close(loss, GRPO(model, tok, packed=False).calculate_loss(rollouts, REWARDS), rtol=0, atol=0)


# ---------------------------------------------------------------- the layout


@pytest.mark.parametrize("buckets", [None, 1, 4])
def test_the_plan_puts_every_needed_token_once_in_a_run_of_its_own(buckets):
    g = torch.Generator().manual_seed(0)
    B, T = 9, 40
    mask = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        start, end = sorted(torch.randint(1, T + 1, (2,), generator=g).tolist())
        mask[b, start:max(end, start + 1)] = 1
    mask[:, 0] = 0
    index = trained_index(mask)
    plan = plan_packing(mask, index, buckets)
    lengths = [int(torch.nonzero(mask[b]).max()) for b in range(B)]  # tokens 0..t-1 predict the last one, t
    L, bounds = plan.length, list(plan.rows.bounds)
    assert L == bucket(sum(lengths), buckets) and plan.position_ids.shape == (1, L)
    assert bounds[:B + 1] == [sum(lengths[:b]) for b in range(B + 1)] and bounds[-1] == L
    assert len(bounds) == B + 2  # the rounding slots: one run of their own (empty without rounding)
    gather, pos = plan.gather.tolist(), plan.position_ids[0].tolist()
    for b in range(B):
        a, e = bounds[b], bounds[b + 1]
        assert gather[a:e] == list(range(b * T, b * T + lengths[b])) and pos[a:e] == list(range(lengths[b]))
    assert pos[bounds[B]:] == list(range(L - sum(lengths)))
    assert [gather[s] for s in plan.index.tolist()] == index.tolist()  # the same tokens, in token_index order
    assert plan.rows.cu_seqlens.dtype == torch.int32 and plan.rows.cu_seqlens.tolist() == bounds
    longest = max(e - a for a, e in zip(bounds, bounds[1:], strict=False))
    assert longest <= plan.rows.max_seqlen == bucket(longest, buckets)


def test_bucket_rounds_up_by_at_most_one_kth_to_k_sizes_per_doubling():
    for k in (1, 2, 4, 8):
        sizes = {bucket(n, k) for n in range(1, 8193)}
        assert all(n <= bucket(n, k) <= n + n / k for n in range(1, 8193))
        assert all(bucket(bucket(n, k), k) == bucket(n, k) for n in range(1, 8193))
        assert len([s for s in sizes if s > k]) <= 13 * k  # k per doubling above k
    assert bucket(1000, None) == 1000 and bucket(1000, 1) == 1024 and bucket(1000, 4) == 1024
    assert bucket(600, 4) == 640 and bucket(5, 8) == 5


def test_bucketing_bounds_the_shapes_a_stream_of_ragged_batches_runs():
    """200 GRPO batches of 16 rows: a ~30-token prompt and 16-512 new tokens each (uniform). Exact lengths give
    a new shape (packed length, longest row: what a compiled varlen attention specializes on) nearly every step;
    4 sizes per doubling, a handful."""
    rng = random.Random(0)
    shapes = {None: set(), 4: set()}
    for _ in range(200):
        lengths = [(p := rng.randint(24, 36), p + rng.randint(16, 512)) for _ in range(16)]
        T = max(end for _, end in lengths)
        mask = torch.zeros(16, T, dtype=torch.long)
        for b, (p, end) in enumerate(lengths):
            mask[b, p:end] = 1
        index = trained_index(mask)
        for buckets, seen in shapes.items():
            plan = plan_packing(mask, index, buckets)
            seen.add((plan.length, plan.rows.max_seqlen))
    assert len(shapes[None]) > 150
    assert len(shapes[4]) <= 24, shapes[4]  # ~5 packed lengths x ~4 longest rows


def test_length_buckets_round_a_padded_batch_up_and_change_nothing():
    model, tok = _model("qwen2", "chatml")
    rollouts = _ragged(model, tok)
    seen = []
    hook = model.model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["input_ids"].shape),
                                                 with_kwargs=True)
    try:
        a = _run(GRPO(model, tok, packed=False), lambda f: f.compute(f.prepare(rollouts, REWARDS)), model)
        b = _run(GRPO(model, tok, packed=False, length_buckets=1),
                 lambda f: f.compute(f.prepare(rollouts, REWARDS)), model)
    finally:
        hook.remove()
    assert_same(a, b, atol=1e-12)
    T = seen[0][1]
    assert seen[-1] == (len(rollouts), bucket(T, 1)) and bucket(T, 1) > T


def test_compute_options_check_the_packing_options():
    with pytest.raises(ValueError, match="packed='yes' is invalid"):
        ComputeOptions(packed="yes")
    with pytest.raises(ValueError, match="length_buckets=0 is invalid"):
        ComputeOptions(length_buckets=0)
    with pytest.raises(ValueError, match="length_buckets=True is invalid"):
        ComputeOptions(length_buckets=True)


# ---------------------------------------------------------------- the varlen kernels (flash's, torch's on CUDA)


def _per_run(q, k, v, bounds, scale):
    """(1, Hq, L, D) -> (1, Hq, L, D): causal attention within each run, in plain torch (the kernels' reference)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scale)
        for a, b in zip(bounds, bounds[1:], strict=False)], dim=2)


@pytest.fixture
def registry(monkeypatch):
    """transformers' attention registry as it was, after the test (`install` wraps what it finds there)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.setattr(AttentionInterface, "_global_mapping", dict(AttentionInterface._global_mapping))
    monkeypatch.setattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", dict(ALL_ATTENTION_FUNCTIONS._local_mapping))
    return AttentionInterface


def test_a_flash_model_gets_its_varlen_kernel_the_rows_boundaries(monkeypatch, registry):
    """A stand-in for flash attention (registered like a hub kernel, recognised as flash): it attends within
    each run that `cu_seq_lens_q` names and checks what flash needs (int32 boundaries, an int maximum at least
    the longest run, one row, no mask). Packed through it equals the padded forward in float64."""
    from transformers.utils import generic

    calls = []

    def flash(module, q, k, v, attention_mask, scaling=None, dropout=0.0, **kw):  # q (B, Hq, L, D)
        assert attention_mask is None  # no mask function is registered for it: HF builds none
        if "cu_seq_lens_q" not in kw:  # the padded forward (right-padded: causality keeps padding out)
            return _per_run(q, k, v, [0, q.shape[2]], scaling).transpose(1, 2), None
        cu, m = kw["cu_seq_lens_q"], kw["max_length_q"]
        bounds = cu.tolist()
        assert q.shape[0] == 1 and cu.dtype == torch.int32 and kw["cu_seq_lens_k"] is cu and kw["max_length_k"] == m
        assert isinstance(m, int) and m >= max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
        calls.append(len(bounds) - 1)
        return _per_run(q, k, v, bounds, scaling).transpose(1, 2), None

    registry.register("test_varlen_kernel", flash)
    model, tok = _model("qwen2", "chatml")
    rollouts = _ragged(model, tok)
    padded = _run(GRPO(model, tok, packed=False), lambda f: f.compute(f.prepare(rollouts, REWARDS)), model)
    model.set_attn_implementation("test_varlen_kernel")
    is_flash = generic.is_flash_attention_requested
    monkeypatch.setattr(generic, "is_flash_attention_requested",
                        lambda config=None, requested_attention_implementation=None, version=None:
                        requested_attention_implementation == "test_varlen_kernel" or is_flash(
                            config, requested_attention_implementation, version))
    assert packing_kind(model) == "flash"
    grpo = GRPO(model, tok, packed=True, length_buckets=4)
    assert_same(padded, _run(grpo, lambda f: f.compute(f.prepare(rollouts, REWARDS)), model))
    assert calls and all(c == len(rollouts) + 1 for c in calls)


def test_on_cuda_in_half_precision_an_sdpa_model_gets_torchs_varlen_kernel(monkeypatch, registry):
    """Torch's flash varlen kernel (`torch.nn.attention.varlen.varlen_attn`) needs CUDA: here a stand-in with its
    signature, switched on as on CUDA in bf16, checks the call (its layout, causal window, GQA, boundaries)."""
    from torch.nn.attention import varlen

    from SimpleTorchLLMRL.model.scoring import packing

    calls = []

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False,
                    **kw):  # q (L, Hq, D)
        assert window_size == (-1, 0) and enable_gqa == (q.shape[1] != k.shape[1]) and cu_q is cu_k
        assert cu_q.dtype == torch.int32 and max_q == max_k
        calls.append(cu_q.numel() - 1)
        t = (x.transpose(0, 1)[None] for x in (q, k, v))
        return _per_run(*t, cu_q.tolist(), scale)[0].transpose(0, 1)

    monkeypatch.setattr(varlen, "varlen_attn", varlen_attn)
    monkeypatch.setattr(packing, "_varlen_available", lambda query: True)
    model, tok = _model("llama", "llama3")
    rollouts = _ragged(model, tok)
    make = lambda packed: _Recording(GRPO(model, tok, packed=packed))  # noqa: E731
    assert_same(*_both(make, lambda f: f.compute(f.prepare(rollouts, REWARDS)), model))
    assert calls and all(c >= len(rollouts) for c in calls)


def test_hidden_states_of_every_layout_agree():
    """`hidden_states` (N, H): packed, padded, shared prompts and bucketed columns give the same rows."""
    model, tok = _model("llama", "llama3")
    rollouts = _ragged(model, tok)[:6]
    out = []
    for compute in (ComputeOptions(packed=False), ComputeOptions(packed=True), ComputeOptions(share_prefix=True),
                    ComputeOptions(packed=False, length_buckets=1), ComputeOptions(packed=True, length_buckets=1)):
        tb = GRPO(model, tok, compute=compute, group_size=3).prepare(rollouts, REWARDS[:6])
        with torch.no_grad():
            out.append(hidden_states(model, tb, compute))
    assert out[0].shape == (int(tb.mask.sum()), model.config.hidden_size)
    for h in out[1:]:
        torch.testing.assert_close(h, out[0], rtol=0, atol=1e-10)
