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
from SimpleTorchLLMRL.trainer.GRPO import GRPO, GRPOConfig
from SimpleTorchLLMRL.trainer.grpo_loss import grpo_token_loss
from SimpleTorchLLMRL.trainer.off_policy import OffPolicy
from SimpleTorchLLMRL.trainer.options import ComputeOptions, UnknownOptionError
from SimpleTorchLLMRL.trainer.PPO import PPO, PPOConfig
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
