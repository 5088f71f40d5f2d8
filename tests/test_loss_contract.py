"""One contract for every loss unit: keyword-only token tensors named by source in, `LossOutput` out, metrics
as 0-dim tensors; one front shape for GRPO and PPO; one aggregator per name; one DAPO overlong penalty."""

import inspect
import warnings

import pytest
import torch
from losses_helpers import assert_grads_close, grads, make_rollouts, perturbed_copy, with_sampled_logprobs

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import rollouts_to_batch
from SimpleTorchLLMRL.reward.length import OverlongPenalty, overlong_penalty
from SimpleTorchLLMRL.trainer import advantages as A
from SimpleTorchLLMRL.trainer import losses as L
from SimpleTorchLLMRL.trainer.batch import StepOutput
from SimpleTorchLLMRL.trainer.batch import old_and_tis as old_and_tis_at_old_path
from SimpleTorchLLMRL.trainer.combine import combine_metrics
from SimpleTorchLLMRL.trainer.distill_loss import distill_loss, jsd_loss
from SimpleTorchLLMRL.trainer.dpo import dpo_loss
from SimpleTorchLLMRL.trainer.grpo import GRPO, GRPOConfig
from SimpleTorchLLMRL.trainer.grpo_loss import grpo_token_loss
from SimpleTorchLLMRL.trainer.off_policy import OffPolicy
from SimpleTorchLLMRL.trainer.options import ComputeOptions, UnknownOptionError
from SimpleTorchLLMRL.trainer.ppo import PPO, PPOConfig
from SimpleTorchLLMRL.trainer.ppo_loss import ppo_loss
from SimpleTorchLLMRL.trainer.sft import sft_loss

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
    """Each loss unit called on synthetic (B, T) tensors with keyword-only inputs named by source."""
    logp, old, mask, g = _tokens()
    B, T = mask.shape
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    ref = old - 0.05
    yield "grpo_token_loss", grpo_token_loss(logprobs=logp, advantages=adv, mask=mask, old_logprobs=old,
                                             sampler_logprobs=old + 0.02, ref_logprobs=ref,
                                             config=GRPOConfig(beta=0.1, off_policy=OffPolicy.icepop(0.5, 2.0)))
    v = torch.randn(B, T, generator=g, dtype=torch.float64, requires_grad=True)
    yield "ppo_loss", ppo_loss(logprobs=logp, mask=mask, config=PPOConfig(), normalizer=float(mask.sum()),
                               advantages=adv[:, None].expand(B, T).contiguous(), values=v, old_values=v.detach(),
                               returns=torch.zeros(B, T, dtype=torch.float64), old_logprobs=old,
                               sampler_logprobs=old + 0.02, ref_logprobs=ref)
    yield "distill_loss", distill_loss(logprobs=logp, teacher_logprobs=ref, mask=mask, old_logprobs=old)
    yield "sft_loss", sft_loss(logprobs=logp, mask=mask)
    yield "dpo_loss", dpo_loss(logprobs=logp, ref_logprobs=ref, mask=mask, variant="ipo")
    head, teacher = torch.nn.Linear(5, 11), torch.nn.Linear(5, 11)
    n = int(mask.sum())
    yield "jsd_loss", jsd_loss(hidden=torch.randn(n, 5, generator=g), head=head, teacher_hidden=torch.randn(n, 5),
                               teacher_head=teacher, targets=torch.randint(0, 11, (n,), generator=g),
                               weight=torch.full((n,), 1.0 / n))


@pytest.mark.parametrize("name, out", list(_units()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_loss_unit_returns_a_loss_output_with_tensor_metrics(name, out):
    assert isinstance(out, L.LossOutput), name
    assert out.loss.dim() == 0 and out.loss.requires_grad
    assert out.metrics and all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in dict.values(out.metrics)), name
    assert torch.equal(out.token_logprobs, out.logprobs) and not out.token_logprobs.requires_grad
    assert float(out.metrics["loss"]) == pytest.approx(float(out.loss.detach()), rel=1e-6)
    combine_metrics([dict(out.metrics)])  # in combine_metrics' form (a missing count would raise)


def test_the_units_take_keyword_only_inputs_named_by_source():
    sources = {"logprobs", "sampler_logprobs", "old_logprobs", "ref_logprobs", "teacher_logprobs", "advantages",
               "mask"}
    for unit in (grpo_token_loss, ppo_loss, distill_loss, sft_loss, dpo_loss):
        params = inspect.signature(unit).parameters
        assert all(p.kind is p.KEYWORD_ONLY for p in params.values()), unit.__name__
        assert "logprobs" in params and "mask" in params and set(params) & sources, unit.__name__
    assert StepOutput is L.LossOutput  # the fronts' compute and the units return one type
    assert old_and_tis_at_old_path is L.old_and_tis


def test_grpo_token_loss_equals_the_front(qwen2_model, chatml_tokenizer):
    """The (B, T) unit on reference log-probs gives the front's loss and gradients (fused head path)."""
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
        unit = grpo_token_loss(logprobs=lp, advantages=tb.advantages, mask=tb.mask, config=grpo.config,
                               old_logprobs=tb.old_logprobs, sampler_logprobs=tb.sampler_logprobs,
                               normalizer=tb.normalizer)
        unit.loss.backward()
        assert float(unit.loss.detach()) == pytest.approx(float(out.loss.detach()), rel=1e-5, abs=1e-7), loss_type
        for key in ("ratio_mean", "clip_frac", "num_tokens", "offpolicy_kl_k3"):
            assert unit.metrics[key] == pytest.approx(out.metrics[key], rel=1e-5, abs=1e-7), (loss_type, key)
        assert_grads_close(grads(model), g_front)
        model.zero_grad()


@pytest.mark.parametrize("options", [{"share_prefix": True}, {"fused": True},
                                     {"fused": True, "off_policy": OffPolicy.icepop(0.8, 1.25)},
                                     {"share_prefix": True, "fused": True, "tis_cap": 2.0}])
def test_ppo_share_prefix_and_fused_match_the_plain_path(options, qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    rollouts = with_sampled_logprobs(make_rollouts(2, 3), perturbed_copy(model, 0.2), tok, temperature=1.0)
    math = {k: v for k, v in options.items() if k in ("off_policy", "tis_cap")}
    plain = PPO(model, tok, beta=0.05, ref_model=perturbed_copy(model), **math)
    other = PPO(model, tok, beta=0.05, ref_model=plain.ref_model, value_head=plain.value_head, **options)
    assert other.compute_options.share_prefix == options.get("share_prefix", False)
    outs = []
    for ppo in (plain, other):
        prepared = ppo.prepare(rollouts, REWARDS)
        assert (prepared.prefix_plan is not None) == ppo.compute_options.share_prefix
        assert ppo._fused(prepared) == (ppo is other and options.get("fused", False))  # the path under test runs
        parts = prepared.split(4)  # micro-batches: the full batch's normalizer
        metrics = []
        for mb in parts:
            out = ppo.compute(mb)
            out.loss.backward()
            metrics.append(out.metrics)
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
    grpo = GRPO(model, tok, GRPOConfig(loss_type="dapo", group_size=3, tis_cap=2.0), ComputeOptions(chunk_size=16),
                eps=0.1, share_prefix=True)
    assert (grpo.config.loss_type, grpo.config.eps, grpo.config.eps_high, grpo.config.group_size) == \
        ("dapo", 0.1, 0.28, 3)
    assert grpo.config.off_policy == OffPolicy.tis(2.0)  # a config built from tis_cap passes again
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
    n = x.shape[0] * x.shape[1] if normalizer is None else normalizer
    return (x * m).sum() / max(float(n), 1.0)


def _old_normalizer(aggregate, mask, max_tokens=None):
    if aggregate == "token_mean":
        return float(mask.sum())
    if aggregate == "sequence_mean_token_mean":
        return float(mask.shape[0])
    return float(mask.shape[0] * (max_tokens if max_tokens is not None else int(mask.sum(-1).max())))


@pytest.mark.parametrize("aggregate", ["token_mean", "sequence_mean_token_mean", "token_sum_constant"])
def test_each_aggregator_gives_the_old_values(aggregate):
    x, _, mask, _ = _tokens(B=5, T=9, seed=3)
    x = x.detach()
    agg = L.AGGREGATORS[aggregate]
    assert isinstance(agg, L.Aggregator) and agg.name == aggregate and L.aggregator(aggregate) is agg
    for norm in (None, 13.0):
        torch.testing.assert_close(agg(x, mask, norm), _old_aggregate(aggregate, x, mask, norm))
        torch.testing.assert_close((x * agg.weights(mask, norm).double()).sum(), _old_aggregate(aggregate, x, mask,
                                                                                               norm))
    for max_tokens in (None, 12):
        assert agg.normalizer(mask, max_tokens) == _old_normalizer(aggregate, mask, max_tokens)
        assert L.default_normalizer(aggregate, mask, max_tokens) == _old_normalizer(aggregate, mask, max_tokens)
    spec = next(s for s in L.LOSS_TYPES.values() if s.aggregate == aggregate)
    assert spec.aggregator is agg
    with pytest.raises(ValueError, match="aggregate 'median'"):
        L.aggregator("median")


def test_one_overlong_penalty():
    lengths = [0, 5, 6, 7, 8, 10, 11, 100]
    expect = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])  # safe up to 6, -1 at 10 (DAPO eq. 13)
    assert A.overlong_penalty is overlong_penalty  # the trainer's name is the reward's function
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


def test_the_samplers_logprobs_old_name_warns_once(chatml_tokenizer):
    from SimpleTorchLLMRL.utils import warn

    rollout = Rollout([Message("q"), Message("a", MessageType.MODEL, token_ids=[5, 6], logprobs=[-0.5, -1.0])])
    batch = rollouts_to_batch([rollout], chatml_tokenizer)
    warn.DEPRECATED_SEEN.discard("Batch.old_logprobs")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same = batch.old_logprobs
        batch.old_logprobs  # noqa: B018  (a second read: no second warning)
    assert torch.equal(torch.nan_to_num(same), torch.nan_to_num(batch.sampler_logprobs))
    assert [(w.category, str(w.message).split(";")[0], w.filename) for w in caught] == [
        (DeprecationWarning, "Batch.old_logprobs is deprecated", __file__)]


@pytest.mark.parametrize("impl", ["cpu", "gpu"])
def test_ppo_fused_and_shared_prefix_wait_for_nothing(impl, qwen2_model, chatml_tokenizer):
    from test_host_syncs import SyncCounter, assert_no_sync

    model, tok = qwen2_model, chatml_tokenizer
    rollouts = with_sampled_logprobs(make_rollouts(2, 3), perturbed_copy(model, 0.2), tok, temperature=1.0)
    ppo = PPO(model, tok, beta=0.05, ref_model=perturbed_copy(model), tis_cap=2.0, head_impl=impl, chunk_size=8,
              share_prefix=True, fused=True)
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


def test_the_old_third_positional_arguments_still_work(qwen2_model, chatml_tokenizer):
    """`SFT(m, t, aggregate)`, `DPO(m, t, ref_model)` and `Distill(m, t, teacher)`: the forms before the shared shape."""
    from SimpleTorchLLMRL.trainer.distill import Distill, DistillConfig
    from SimpleTorchLLMRL.trainer.dpo import DPO
    from SimpleTorchLLMRL.trainer.sft import SFT

    model, tok = qwen2_model, chatml_tokenizer
    other = perturbed_copy(model)
    assert SFT(model, tok, "token_sum_constant").config.aggregate == "token_sum_constant"
    assert DPO(model, tok, other, beta=0.2).ref_model is other
    distill = Distill(model, tok, other, ComputeOptions(chunk_size=4), kl_coef=0.5)
    assert (distill.teacher, distill.kind, distill.compute_options.chunk_size, distill.config.kl_coef) == \
        (other, "hf", 4, 0.5)
    assert Distill(model, tok, "rollouts").kind == Distill(model, tok).kind == "rollouts"
    assert Distill(model, tok, DistillConfig(kl_coef=0.5), teacher=other).teacher is other
    for make, what in ((lambda: Distill(model, tok, other, teacher=other), "teacher"),
                       (lambda: DPO(model, tok, other, ref_model=other), "ref_model"),
                       (lambda: SFT(model, tok, "token_mean", aggregate="token_mean"), "aggregate")):
        with pytest.raises(TypeError, match=f"{what} twice"):
            make()
    with pytest.raises(TypeError, match="config= must be a DPOConfig"):
        DPO(model, tok, 0.1, ref_model=other)  # neither a config nor a reference model


@pytest.mark.parametrize("name", ["SFT", "DPO", "Distill"])
def test_sft_dpo_and_distill_compute_returns_a_loss_output(name, qwen2_model, chatml_tokenizer):
    from SimpleTorchLLMRL.trainer.combine import LazyMetrics

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


def test_the_docs_table_of_fronts_names_each_fronts_options():
    """docs/losses.md's table of fronts lists, per front, exactly its config's fields and its other keywords."""
    from dataclasses import fields
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "losses.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`") and "(`trainer/" in cells[0]:
            words = lambda cell: set(cell.replace("`", "").replace(" ", "").split(",")) - {""}  # noqa: E731
            rows[cells[0].split("`")[1]] = (cells[1].strip("`"), words(cells[2]), words(cells[3]))
    fronts = [(GRPO, GRPOConfig), (PPO, PPOConfig)] + _more_fronts()
    assert set(rows) == {cls.__name__ for cls, _ in fronts}
    compute = {f.name for f in fields(ComputeOptions)}
    for cls, config_cls in fronts:
        config_name, math, others = rows[cls.__name__]
        names = set(inspect.signature(cls).parameters) - {"model", "tokenizer", "config", "compute"}
        assert config_name == config_cls.__name__
        assert math == {f.name for f in fields(config_cls) if f.init}, cls.__name__
        assert others == names - math - compute, cls.__name__
