"""End to end: sample with top-k / top-p / min-p (HF default loop, fast decode), encode, score with the trainer:
on-policy ratios exp(trainer - recorded) are 1 (float32, 1e-5) on every head kernel that runs on a CPU,
for GRPO and PPO, in batches that mix truncated and untruncated turns; and loss + backward still wait
for nothing (the kept set's ops are sync-free)."""

import copy

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import rollouts_to_batch
from SimpleTorchLLMRL.model.scoring.logprobs import token_logprobs
from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer
from SimpleTorchLLMRL.trainer.grpo import GRPO
from SimpleTorchLLMRL.trainer.ppo import PPO
from tests.support.generation_helpers import make_generator, peaked
from tests.trainer.test_host_syncs import SyncCounter, assert_no_sync

RATIO_TOL = 1e-5
T = 0.8
QUESTIONS = ["What is 12 + 35?", "hi there", "The quick fox"]


@pytest.fixture(scope="module")
def setup():
    tok = tiny_tokenizer("chatml")
    model = peaked(tiny_model("qwen2", tok), std=0.08).eval()
    return model, tok


def sampled(model, tok, decode: str, **sampling) -> list[Rollout]:
    """3 prompts x 2 samples, each rollout its prompt plus the sampled MODEL turn."""
    gen = make_generator(model, tok, max_new_tokens=14, temperature=T, seed=3, decode=decode, **sampling)
    prompts = [Rollout([Message("You are a helpful assistant.", MessageType.SYSTEM), Message(q)]) for q in QUESTIONS]
    return [p.copy().add_messages(m) for p, group in zip(prompts, gen.generate(prompts, n=2), strict=True)
            for m in group]


def ratio_gap(trainer_lp: torch.Tensor, batch) -> float:
    known = ~torch.isnan(batch.sampler_logprobs) & batch.loss_mask.bool()
    known[:, 0] = False
    assert int(known.sum()) > 20
    return float((trainer_lp - batch.sampler_logprobs)[known].abs().max())


@pytest.mark.parametrize("decode", ["default", "fast"])
@pytest.mark.parametrize("sampling", [dict(top_k=20), dict(top_p=0.8), dict(top_k=20, top_p=0.8), dict(min_p=0.1),
                                      dict(top_p=0.8, min_p=0.1)])
def test_on_policy_ratios_are_one_under_truncation(setup, decode, sampling):
    model, tok = setup
    rollouts = sampled(model, tok, decode, **sampling) + sampled(model, tok, decode)  # truncated + plain turns
    assert rollouts[0][-1].sampling == sampling and rollouts[-1][-1].sampling is None
    batch = rollouts_to_batch(rollouts, tok)
    cut = batch.truncation
    assert cut is not None and int((cut.top_k > 0).sum() + (cut.top_p < 1).sum() + (cut.min_p > 0).sum()) > 0
    rewards = [1.0, 0.0] * (len(rollouts) // 2)
    for impl in ["cpu", "gpu"]:
        grpo = GRPO(model, tok, group_size=2, head_impl=impl, chunk_size=16)
        out = grpo.compute(grpo.prepare(rollouts, rewards))
        assert ratio_gap(out.token_logprobs, batch) <= RATIO_TOL, impl
        assert abs(grpo.metrics["ratio_max"] - 1) <= RATIO_TOL and abs(grpo.metrics["ratio_min"] - 1) <= RATIO_TOL
    ppo = PPO(model, tok, head_impl="gpu", chunk_size=16)
    ppo.compute(ppo.prepare(rollouts, rewards))
    assert ratio_gap(torch.nan_to_num(ppo.token_logprobs), batch) <= RATIO_TOL
    # the test can fail: scored under the full softmax, the truncated turns' ratios are far from 1
    with torch.no_grad():
        full = token_logprobs(model, batch, T, positions=batch.loss_mask)
    assert ratio_gap(full, batch) > 1e-2


def test_truncated_loss_and_backward_wait_for_nothing(setup):
    model, tok = setup
    rollouts = sampled(model, tok, "default", top_k=20, top_p=0.8) + sampled(model, tok, "default", top_p=0.8)
    rewards = [1.0, 0.0] * (len(rollouts) // 2)
    for impl in ["cpu", "gpu"]:
        for fused in [True, False]:
            grpo = GRPO(model, tok, group_size=2, head_impl=impl, fused=fused, chunk_size=8)
            ppo = PPO(model, tok, head_impl=impl, chunk_size=8)
            prepared, ppo_prepared = grpo.prepare(rollouts, rewards), ppo.prepare(rollouts, rewards)
            grpo.calculate_loss(prepared).backward()  # the once-per-model checks run here
            model.zero_grad()
            with SyncCounter() as counter:
                grpo.calculate_loss(prepared).backward()
                ppo.calculate_loss(ppo_prepared).backward()
            assert_no_sync(counter)
            model.zero_grad()


def test_sft_and_dpo_score_the_full_softmax_at_temperature_1(setup):
    """SFT and DPO train the data's likelihood: neither the sampler's temperature nor its kept set applies."""
    from SimpleTorchLLMRL.trainer.dpo import DPO
    from SimpleTorchLLMRL.trainer.sft import SFT

    model, tok = setup
    rollouts = sampled(model, tok, "default", top_k=20)
    batch = rollouts_to_batch(rollouts, tok)
    with torch.no_grad():
        full = token_logprobs(model, batch, 1.0, positions=batch.loss_mask)  # (B, T) full softmax, T = 1
        sft_front = SFT(model, tok)
        sft = sft_front.compute(sft_front.prepare(rollouts)).token_logprobs
        dpo_front = DPO(model, tok, ref_model=copy.deepcopy(model))
        dpo = dpo_front.compute(dpo_front.prepare(rollouts[0::2], rollouts[1::2])).token_logprobs  # rows in order
    m = ~torch.isnan(sft)
    torch.testing.assert_close(sft[m], full[m], rtol=0, atol=1e-5)
    torch.testing.assert_close(dpo[m], full[m], rtol=0, atol=1e-5)
