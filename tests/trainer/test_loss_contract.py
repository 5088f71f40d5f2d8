"""One contract for every loss unit: `fn(LossInputs, config) -> LossOutput`, metrics as 0-dim tensors that carry
their reduction; one front shape whose options are written once (in the configs); one DAPO overlong penalty."""

import inspect

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.reward.length import OverlongPenalty, overlong_penalty
from SimpleTorchLLMRL.trainer import losses as L
from SimpleTorchLLMRL.trainer import pipeline
from SimpleTorchLLMRL.trainer.distill import DistillConfig, distill_loss, jsd_loss
from SimpleTorchLLMRL.trainer.dpo import DPOConfig, dpo_loss
from SimpleTorchLLMRL.trainer.grpo import GRPO, GRPOConfig, grpo_loss
from SimpleTorchLLMRL.trainer.losses import combine_metrics
from SimpleTorchLLMRL.trainer.off_policy import OffPolicy
from SimpleTorchLLMRL.trainer.options import ComputeOptions, UnknownOptionError
from SimpleTorchLLMRL.trainer.ppo import PPO, PPOConfig, ppo_loss
from SimpleTorchLLMRL.trainer.sft import SFTConfig, sft_loss
from tests.support.losses_helpers import (
    assert_grads_close,
    grads,
    make_rollouts,
    perturbed_copy,
    with_sampled_logprobs,
)

REWARDS = [1.0, 0.0, 0.5, 0.0, 0.0, 2.0]


def _tokens(B=4, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[:, 0] = 0
    mask[:, 1] = 1  # every row trains something
    return logp, old, mask, g


def _units():
    """Each loss unit called as `fn(inputs, config)` on synthetic (B, T) tensors turned into `LossInputs`."""
    logp, old, mask, g = _tokens()
    B, T = mask.shape
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    ref = old - 0.05
    x = lambda **t: L.LossInputs.from_tokens(mask, **t)  # noqa: E731
    yield "grpo_loss", grpo_loss(x(logprobs=logp, advantages=adv, old_logprobs=old, sampler_logprobs=old + 0.02,
                                   ref_logprobs=ref), GRPOConfig(beta=0.1, off_policy=OffPolicy.icepop(0.5, 2.0)))
    v = torch.randn(B, T, generator=g, dtype=torch.float64, requires_grad=True)
    yield "ppo_loss", ppo_loss(x(logprobs=logp, normalizer=float(mask[:, 1:].sum()),
                                 advantages=adv[:, None].expand(B, T).contiguous(), values=v, old_values=v.detach(),
                                 returns=torch.zeros(B, T, dtype=torch.float64), old_logprobs=old,
                                 sampler_logprobs=old + 0.02, ref_logprobs=ref), PPOConfig())
    yield "distill_loss", distill_loss(x(logprobs=logp, teacher_logprobs=ref, old_logprobs=old), DistillConfig())
    yield "sft_loss", sft_loss(x(logprobs=logp), SFTConfig())
    yield "dpo_loss", dpo_loss(x(logprobs=logp, ref_logprobs=ref), DPOConfig(variant="ipo"))
    head, teacher = torch.nn.Linear(5, 11), torch.nn.Linear(5, 11)
    n = int(mask[:, 1:].sum())
    extra = dict(hidden=torch.randn(n, 5, generator=g), head=head, teacher_hidden=torch.randn(n, 5),
                 teacher_head=teacher, targets=torch.randint(0, 11, (n,), generator=g))
    yield "jsd_loss", jsd_loss(x(extra=extra), DistillConfig(divergence="jsd"))


@pytest.mark.parametrize("name, out", list(_units()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_loss_unit_returns_a_loss_output_with_tensor_metrics(name, out):
    assert isinstance(out, L.LossOutput), name
    assert out.loss.dim() == 0 and out.loss.requires_grad
    assert out.metrics and all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in dict.values(out.metrics)), name
    assert set(out.metrics.reductions) == set(dict.keys(out.metrics)), name  # each metric says how it combines
    assert not out.token_logprobs.requires_grad
    assert float(out.metrics["loss"]) == pytest.approx(float(out.loss.detach()), rel=1e-6)
    combine_metrics([out.metrics])  # in combine_metrics' form (a missing count would raise)


def test_every_unit_is_a_function_of_inputs_and_config():
    for unit in (grpo_loss, ppo_loss, distill_loss, jsd_loss, sft_loss, dpo_loss):
        assert list(inspect.signature(unit).parameters) == ["inputs", "config"], unit.__name__


def test_a_new_loss_is_one_function_and_one_config(qwen2_model, chatml_tokenizer):
    """A loss written here, in the test, runs through the shared pipeline on a front's prepared batch, its
    metrics combine over micro-batches by the reductions they carry, and no file of the library names it."""
    from dataclasses import dataclass

    @dataclass
    class ReinforceConfig:
        scale: float = 1.0

    def reinforce_loss(inputs, config):  # -A log pi, token mean over the full batch
        w = L.weights("token_mean", inputs)
        loss = -(config.scale * inputs.advantages * inputs.logprobs * w).sum()
        metrics = L.LazyMetrics.of(loss=(loss.detach(), L.SUM), my_logp=(inputs.logprobs.detach().mean(), L.TOKEN_MEAN),
                                   num_tokens=(L.count(inputs.num_tokens, loss), L.SUM))
        return L.LossOutput(loss, metrics, inputs.logprobs.detach())

    model, tok = qwen2_model, chatml_tokenizer
    grpo = GRPO(model, tok, loss_type="bnpo", group_size=3)
    prepared = grpo.prepare(make_rollouts(2, 3), REWARDS)
    compute = grpo.compute_options
    full = pipeline.run_unit(reinforce_loss, ReinforceConfig(2.0), model, prepared, compute)
    parts = [pipeline.run_unit(reinforce_loss, ReinforceConfig(2.0), model, mb, compute) for mb in prepared.split(4)]
    combined = combine_metrics([p.metrics for p in parts])
    assert combined["loss"] == pytest.approx(full.metrics["loss"], rel=1e-5)
    assert combined["my_logp"] == pytest.approx(full.metrics["my_logp"], rel=1e-5)
    m = prepared.mask.bool()
    naive = -2 * (prepared.advantages[:, None] * full.token_logprobs.nan_to_num())[m].sum() / m.sum()
    assert float(full.loss.detach()) == pytest.approx(float(naive), rel=1e-5)


def test_grpo_loss_on_token_tensors_equals_the_front(qwen2_model, chatml_tokenizer):
    """The unit on (B, T) log-probs of `token_logprobs` gives the front's loss and gradients (fused head path)."""
    from SimpleTorchLLMRL.model.scoring.logprobs import token_logprobs

    model, tok = qwen2_model, chatml_tokenizer
    rollouts = with_sampled_logprobs(make_rollouts(2, 3), perturbed_copy(model, 0.2), tok, temperature=1.0)
    for loss_type in ("grpo", "dapo", "gspo"):
        grpo = GRPO(model, tok, loss_type=loss_type, group_size=3)
        tb = grpo.prepare(rollouts, REWARDS)
        out = grpo.compute(tb)
        out.loss.backward()
        g_front = grads(model)
        model.zero_grad()
        lp = token_logprobs(model, tb.batch, tb.temperature, positions=tb.mask)
        unit = grpo_loss(L.LossInputs.from_tokens(tb.mask, tb.normalizer, logprobs=lp, advantages=tb.advantages,
                                                  old_logprobs=tb.old_logprobs, sampler_logprobs=tb.sampler_logprobs),
                         grpo.config)
        unit.loss.backward()
        assert float(unit.loss.detach()) == pytest.approx(float(out.loss.detach()), rel=1e-5, abs=1e-7), loss_type
        for key in ("ratio_mean", "clip_frac", "num_tokens", "offpolicy_kl_k3"):
            assert unit.metrics[key] == pytest.approx(out.metrics[key], rel=1e-5, abs=1e-7), (loss_type, key)
        assert_grads_close(grads(model), g_front)
        model.zero_grad()


@pytest.mark.parametrize("options", [{"share_prefix": True}, {"fused": True},
                                     {"fused": True, "off_policy": OffPolicy.icepop(0.8, 1.25)},
                                     {"share_prefix": True, "fused": True, "off_policy": OffPolicy.tis(2.0)}])
def test_ppo_share_prefix_and_fused_match_the_plain_path(options, qwen2_model, chatml_tokenizer, monkeypatch):
    from SimpleTorchLLMRL.model.scoring import logprobs

    fused_calls = []
    real = logprobs.fused_token_loss
    monkeypatch.setattr(logprobs, "fused_token_loss", lambda *a, **k: fused_calls.append(1) or real(*a, **k))
    model, tok = qwen2_model, chatml_tokenizer
    rollouts = with_sampled_logprobs(make_rollouts(2, 3), perturbed_copy(model, 0.2), tok, temperature=1.0)
    math = {k: v for k, v in options.items() if k == "off_policy"}
    plain = PPO(model, tok, beta=0.05, ref_model=perturbed_copy(model), fused=False, **math)
    other = PPO(model, tok, beta=0.05, ref_model=plain.ref_model, value_head=plain.value_head,
                **{"fused": False, **options})
    assert other.compute_options.share_prefix == options.get("share_prefix", False)
    outs = []
    for ppo in (plain, other):
        prepared = ppo.prepare(rollouts, REWARDS)
        assert (prepared.prefix_plan is not None) == ppo.compute_options.share_prefix
        fused_calls.clear()
        parts = prepared.split(4)  # micro-batches: the full batch's normalizer
        metrics = []
        for mb in parts:
            out = ppo.compute(mb)
            out.loss.backward()
            metrics.append(out.metrics)
        assert bool(fused_calls) == (ppo is other and options.get("fused", False))  # the path under test runs
        outs.append((combine_metrics(metrics), grads(model), torch.cat([p.grad.flatten() for p in
                                                                       ppo.value_head.parameters()])))
        model.zero_grad()
        ppo.value_head.zero_grad()
    (m1, g1, v1), (m2, g2, v2) = outs
    for key in ("loss", "policy_loss", "value_loss", "entropy", "ratio_mean", "clip_frac", "kl", "num_tokens",
                "offpolicy_kl_k1"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    assert_grads_close(g2, g1)
    torch.testing.assert_close(v2, v1, rtol=1e-4, atol=1e-6)


def test_the_fronts_share_one_shape(qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    for cls, config in ((GRPO, GRPOConfig), (PPO, PPOConfig)):
        params = list(inspect.signature(cls).parameters.values())
        assert [p.name for p in params[:4]] == ["model", "tokenizer", "config", "compute"], cls
        assert not any(p.kind is p.VAR_KEYWORD for p in params)  # every option named
        names = {p.name for p in params}
        assert {f for f in config.__dataclass_fields__} <= names
        assert {"chunk_size", "head_impl", "fused", "share_prefix", "max_length", "truncate"} <= names
        with pytest.raises(TypeError, match=r"unknown options \['epsilon'\]") as err:
            cls(model, tok, epsilon=0.2)
        assert isinstance(err.value, UnknownOptionError) and isinstance(err.value, ValueError)
        with pytest.raises(TypeError, match="config= must be a"):
            cls(model, tok, 0.2)
    grpo = GRPO(model, tok, GRPOConfig(loss_type="dapo", group_size=3, off_policy=OffPolicy.tis(2.0)),
                ComputeOptions(chunk_size=16), eps=0.1, share_prefix=True)
    assert (grpo.config.loss_type, grpo.config.eps, grpo.config.eps_high, grpo.config.group_size) == \
        ("dapo", 0.1, 0.28, 3)
    assert grpo.config.off_policy == OffPolicy.tis(2.0)
    assert (grpo.compute_options.chunk_size, grpo.compute_options.share_prefix) == (16, True)
    assert GRPO(model, tok, eps=0.3).config == GRPOConfig(eps=0.3)  # the seed spelling
    ppo = PPO(model, tok, PPOConfig(vf_coef=0.5), share_prefix=True, fused=True, gamma=0.9)
    assert (ppo.config.vf_coef, ppo.config.gamma, ppo.compute_options.fused) == (0.5, 0.9, True)


def _old_aggregate(aggregate, x, mask, normalizer=None):
    """The aggregators as they were written before the Aggregator classes (float64 reference)."""
    m = mask.to(x.dtype)
    if aggregate == "token_mean":
        n = m.sum() if normalizer is None else normalizer
        return (x * m).sum() / max(float(n), 1.0)
    if aggregate == "sequence_mean_token_mean":
        per_row = (x * m).sum(-1) / m.sum(-1).clamp(min=1)
        return per_row.sum() / max(float(x.shape[0] if normalizer is None else normalizer), 1.0)
    n = x.shape[0] * int(m.sum(-1).max()) if normalizer is None else normalizer
    return (x * m).sum() / max(float(n), 1.0)


def _old_normalizer(aggregate, mask, max_tokens=None):
    if aggregate == "token_mean":
        return float(mask.sum())
    if aggregate == "sequence_mean_token_mean":
        return float(mask.shape[0])
    return float(mask.shape[0] * (max_tokens if max_tokens is not None else int(mask.sum(-1).max())))


@pytest.mark.parametrize("aggregate", L.AGGREGATES)
def test_each_aggregate_gives_the_old_values(aggregate):
    x, _, mask, _ = _tokens(B=5, T=9, seed=3)
    x, mask = x.detach(), mask.clone()
    mask[:, 0] = 0  # the units' tokens: nothing predicts the first one
    for norm in (None, 13.0):
        inputs = L.LossInputs.from_tokens(mask, norm, logprobs=x)
        w = L.weights(aggregate, inputs)
        torch.testing.assert_close((inputs.logprobs * w.double()).sum(), _old_aggregate(aggregate, x, mask, norm))
    for max_tokens in (None, 12):
        assert L.normalizer(aggregate, mask, max_tokens) == _old_normalizer(aggregate, mask, max_tokens)
    with pytest.raises(ValueError, match="aggregate='median'"):
        L.normalizer("median", mask)


def test_one_overlong_penalty():
    lengths = [0, 5, 6, 7, 8, 10, 11, 100]
    expect = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])  # safe up to 6, -1 at 10 (DAPO eq. 13)
    torch.testing.assert_close(overlong_penalty(torch.tensor(lengths), 10, 4), expect)
    rollouts = [Rollout([Message("q"), Message("x" * n, MessageType.MODEL, token_ids=list(range(n)))])
                for n in lengths]
    torch.testing.assert_close(OverlongPenalty(10, 4, penalty=2.0)(rollouts), 2 * expect)
    with pytest.raises(ValueError, match="cache_length"):
        overlong_penalty(torch.tensor([1]), 10, 11)


def test_grpo_overlong_penalty_is_the_rewards(qwen2_model, chatml_tokenizer):
    """GRPO's DAPO helper counts what the reward counts: every MODEL turn's generated tokens."""
    multi = Rollout([Message("q"), Message("a", MessageType.MODEL, token_ids=[5, 6, 7]), Message("t", MessageType.TOOL),
                     Message("b", MessageType.MODEL, token_ids=[8, 9, 10, 11, 12])])
    rollouts = make_rollouts(1, 2) + [multi]
    grpo = GRPO(qwen2_model, chatml_tokenizer)
    pen = grpo.overlong_penalty(rollouts, max_length=10, cache_length=6)
    torch.testing.assert_close(pen, OverlongPenalty(10, 6, scope="all", tokenizer=chatml_tokenizer)(rollouts))
    assert float(pen[2]) == pytest.approx((4 - 8) / 6)  # 3 + 5 generated tokens


@pytest.mark.parametrize("impl", ["cpu", "gpu"])
def test_ppo_fused_and_shared_prefix_wait_for_nothing(impl, qwen2_model, chatml_tokenizer):
    from tests.trainer.test_host_syncs import SyncCounter, assert_no_sync

    model, tok = qwen2_model, chatml_tokenizer
    rollouts = with_sampled_logprobs(make_rollouts(2, 3), perturbed_copy(model, 0.2), tok, temperature=1.0)
    ppo = PPO(model, tok, beta=0.05, ref_model=perturbed_copy(model), off_policy=OffPolicy.tis(2.0), head_impl=impl,
              chunk_size=8, share_prefix=True, fused=True)
    prepared = ppo.prepare(rollouts, REWARDS)
    ppo.calculate_loss(prepared).backward()  # the shared-prefix check runs once per model, before counting
    model.zero_grad()
    parts = prepared.split(3)
    with SyncCounter() as counter:
        for mb in parts:
            ppo.compute(mb).loss.backward()
    assert_no_sync(counter)


# ---------------------------------------------------------------- SFT, DPO and Distill: the same front shape


def _front(cls, model, tok, *args, **options):
    """A front of `cls` with what it needs beside the options (DPO a reference, Distill a teacher)."""
    from SimpleTorchLLMRL.trainer.distill import Distill
    from SimpleTorchLLMRL.trainer.dpo import DPO

    need = {DPO: "ref_model", Distill: "teacher"}.get(cls)
    if need is not None and need not in options:
        options[need] = perturbed_copy(model)
    return cls(model, tok, *args, **options)


def _more_fronts():
    from SimpleTorchLLMRL.trainer.distill import Distill, DistillConfig
    from SimpleTorchLLMRL.trainer.dpo import DPO, DPOConfig
    from SimpleTorchLLMRL.trainer.sft import SFT, SFTConfig

    return [(SFT, SFTConfig), (DPO, DPOConfig), (Distill, DistillConfig)]


@pytest.mark.parametrize("cls, config_cls", _more_fronts(), ids=lambda x: x.__name__)
def test_sft_dpo_and_distill_take_the_fronts_shape(cls, config_cls, qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    params = list(inspect.signature(cls).parameters.values())
    assert [p.name for p in params[:4]] == ["model", "tokenizer", "config", "compute"]
    assert not any(p.kind is p.VAR_KEYWORD for p in params)  # every option named
    names = {p.name for p in params}
    assert set(config_cls.__dataclass_fields__) <= names
    assert {"chunk_size", "head_impl", "fused", "share_prefix", "max_length", "truncate"} <= names
    with pytest.raises(TypeError, match=r"unknown options \['epsilon'\]") as err:
        _front(cls, model, tok, epsilon=0.2)
    assert isinstance(err.value, UnknownOptionError) and isinstance(err.value, ValueError)
    field = {"SFT": ("aggregate", "sequence_mean_token_mean"), "DPO": ("beta", 0.3),
             "Distill": ("kl_coef", 0.5)}[cls.__name__]
    front = _front(cls, model, tok, config_cls(**dict([field])), ComputeOptions(chunk_size=16, truncate=True),
                   chunk_size=8)  # a keyword overrides its field of config= / compute=
    assert getattr(front.config, field[0]) == field[1]
    assert (front.compute_options.chunk_size, front.compute_options.truncate) == (8, True)
    assert _front(cls, model, tok, **dict([field])).config == config_cls(**dict([field]))
    assert _front(cls, model, tok).config == config_cls()  # left out: the dataclass' defaults
    with pytest.raises(ValueError, match=field[0]):  # a bad value is named as before
        _front(cls, model, tok, **{field[0]: "nope" if field[0] == "aggregate" else -1.0})


@pytest.mark.parametrize("name", ["SFT", "DPO", "Distill"])
def test_sft_dpo_and_distill_compute_returns_a_loss_output(name, qwen2_model, chatml_tokenizer):
    from SimpleTorchLLMRL.trainer.losses import LazyMetrics

    model, tok = qwen2_model, chatml_tokenizer
    cls = next(c for c, _ in _more_fronts() if c.__name__ == name)
    front = _front(cls, model, tok)
    rollouts = make_rollouts(2, 2)
    prepared = front.prepare(rollouts[0::2], rollouts[1::2]) if name == "DPO" else front.prepare(rollouts)
    out = front.compute(prepared)
    assert type(out) is L.LossOutput and out.loss.dim() == 0 and out.loss.requires_grad
    assert isinstance(out.metrics, LazyMetrics) and out.metrics is front.metrics
    tensors = {k: v for k, v in dict.items(out.metrics) if isinstance(v, torch.Tensor)}
    assert {"loss", "num_sequences"} <= set(tensors)  # the loss call's own numbers stay tensors until read
    assert all(v.dim() == 0 for v in tensors.values())
    assert tensors["num_sequences"].dtype == torch.long and int(tensors["num_sequences"]) == len(rollouts)
    mask = prepared.mask.bool()
    assert out.token_logprobs is front.token_logprobs and out.token_logprobs.shape == mask.shape
    assert torch.isnan(out.token_logprobs[~mask]).all() and (out.token_logprobs[mask] <= 0).all()
    assert float(out.metrics["loss"]) == pytest.approx(float(out.loss.detach()), rel=1e-6)
    combine_metrics([out.metrics])


def test_the_docs_tables_of_options_are_the_generated_ones():
    """docs/losses.md's options tables are `options_table` of the fronts, generated from the config dataclasses
    (each field's own docstring): an option is written once."""
    from pathlib import Path

    from SimpleTorchLLMRL.trainer.options import options_table

    fronts = [GRPO, PPO] + [cls for cls, _ in _more_fronts()]
    text = (Path(__file__).resolve().parents[2] / "docs" / "losses.md").read_text()
    begin, end = "<!-- options: generated by trainer.options.options_table -->\n", "<!-- options: end -->"
    assert begin in text and end in text
    documented = text.split(begin)[1].split(end)[0]
    generated = options_table(fronts)
    assert documented == generated, "regenerate docs/losses.md's options tables:\n" + generated


def test_every_option_is_documented_once_and_named_in_the_signature():
    from dataclasses import fields

    from SimpleTorchLLMRL.trainer.options import field_docs

    for cls in [GRPO, PPO] + [c for c, _ in _more_fronts()]:
        config = cls.config_class
        docs = {**field_docs(config), **field_docs(ComputeOptions)}
        names = [f.name for f in fields(config) if f.init] + [f.name for f in fields(ComputeOptions)]
        assert all(docs.get(n) for n in names), [n for n in names if not docs.get(n)]
        params = inspect.signature(cls).parameters
        assert all(params[n].kind is params[n].KEYWORD_ONLY for n in names)
        assert "eps" not in names or params["eps"].default == config().eps
