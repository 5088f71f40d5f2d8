"""The trainer core as a flat pipeline: pure loss units, metrics returned and combined over micro-batches."""

import pytest
import torch

from SimpleTorchLLMRL.model.scoring.logprobs import ComputeOptions, score
from SimpleTorchLLMRL.trainer import pipeline
from SimpleTorchLLMRL.trainer.grpo import GRPO, GRPOConfig, grpo_loss
from SimpleTorchLLMRL.trainer.losses import MAX, MIN, SUM, TOKEN_MEAN, LazyMetrics, combine_metrics
from SimpleTorchLLMRL.trainer.ppo import PPO
from tests.support.losses_helpers import make_rollouts, perturbed_copy, with_sampled_logprobs

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 2.0, 1.0, 0.0])
KEYS = ("loss", "entropy", "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max",
        "num_tokens", "num_sequences")


def _off_policy(model, tok):
    """Rollouts sampled by a perturbed copy: ratios away from 1, so clipping bites on some tokens."""
    return with_sampled_logprobs(make_rollouts(2, 4), perturbed_copy(model, 0.3), tok, temperature=1.0)


def _grads(model):
    return torch.cat([p.grad.flatten().clone() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("trainer", ["grpo", "dapo", "gspo", "ppo"])
def test_micro_batch_metrics_combine_to_the_full_batch(trainer, qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    rollouts = _off_policy(model, tok)
    if trainer == "ppo":
        algo = PPO(model, tok, beta=0.1, ref_model=perturbed_copy(model, 0.1))
    else:
        algo = GRPO(model, tok, loss_type=trainer, group_size=4, beta=0.1, ref_model=perturbed_copy(model, 0.1))
    prepared = algo.prepare(rollouts, REWARDS)
    full = algo.compute(prepared)
    full.loss.backward()
    g_full = _grads(model)
    model.zero_grad()
    parts = []
    for micro in prepared.split(3):  # 3 + 3 + 2 rows
        out = algo.compute(micro)
        out.loss.backward()
        parts.append(out.metrics)
    combined = combine_metrics(parts)
    assert full.metrics["clip_frac"] > 0, "the test needs clipped tokens"
    for key in (*KEYS, "kl"):
        assert combined[key] == pytest.approx(full.metrics[key], rel=1e-5, abs=1e-7), key
    assert combined["reward_mean"] == full.metrics["reward_mean"]
    torch.testing.assert_close(_grads(model), g_full, rtol=1e-4, atol=1e-6)
    model.zero_grad()
    # the last micro-batch alone is NOT the batch: what logging `algo.metrics` after the loop reported
    assert algo.metrics["num_sequences"] == 2 and algo.metrics["loss"] != pytest.approx(full.metrics["loss"])


def test_the_loss_unit_is_pure(qwen2_model, chatml_tokenizer):
    """grpo_loss reads only its inputs: same inputs, same (loss, metrics), no state on any object; the fused
    head (gradient formed chunk by chunk) and the two-pass head give the same loss and metrics."""
    model, tok = qwen2_model, chatml_tokenizer
    grpo = GRPO(model, tok, group_size=4)
    tb = grpo.prepare(_off_policy(model, tok), REWARDS)
    cfg = GRPOConfig(group_size=4)
    outs = []
    for compute in (ComputeOptions(chunk_size=7, fused=True), ComputeOptions(chunk_size=64, fused=False)):
        s = score(model, tb, compute, temperature=1.0)
        x = pipeline.loss_inputs(tb, logprobs=s.logprobs, entropy=s.entropy)
        outs.append((grpo_loss(x, cfg), pipeline.run_unit(grpo_loss, cfg, model, tb, compute)))
    (a, fused), (b, two_pass) = outs
    assert a.loss.item() == pytest.approx(b.loss.item(), rel=1e-5, abs=1e-7)
    assert a.metrics.keys() == b.metrics.keys()
    for key in KEYS:
        assert a.metrics[key] == pytest.approx(b.metrics[key], rel=1e-5, abs=1e-7), key
        assert fused.metrics[key] == pytest.approx(two_pass.metrics[key], rel=1e-5, abs=1e-7), key
        assert fused.metrics[key] == pytest.approx(a.metrics[key], rel=1e-5, abs=1e-7), key
    assert grpo.metrics == {} and grpo.token_logprobs is None  # the front records only its own calls


def test_combine_metrics_rules():
    """Each metric combines by the reduction it carries: no list of names (an unknown one: kept once)."""
    def part(loss, entropy, n, lo, hi):
        m = LazyMetrics.of(loss=(loss, SUM), entropy=(entropy, TOKEN_MEAN), num_tokens=(n, SUM), ratio_min=(lo, MIN),
                           ratio_max=(hi, MAX), my_new_loss_term=(loss, SUM))
        return LazyMetrics.merged({"reward_mean": 0.3}, m)

    out = combine_metrics([part(0.5, 1.0, 1, 0.9, 1.1), part(0.25, 4.0, 3, 0.8, 1.0)])
    assert out == dict(reward_mean=0.3, loss=0.75, entropy=3.25, num_tokens=4, ratio_min=0.8, ratio_max=1.1,
                       my_new_loss_term=0.75)
    with pytest.raises(ValueError, match="at least one"):
        combine_metrics([])
    with pytest.raises(ValueError, match="num_tokens"):
        combine_metrics([LazyMetrics.of(entropy=(1.0, TOKEN_MEAN))])
    with pytest.raises(TypeError, match="carry no reductions"):
        combine_metrics([dict(loss=1.0)])
