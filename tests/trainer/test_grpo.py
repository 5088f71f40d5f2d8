"""GRPO family end to end on tiny models, against naive float64 references."""

import copy
import warnings

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.testing.tiny import tiny_model
from SimpleTorchLLMRL.trainer.grpo import GRPO
from SimpleTorchLLMRL.trainer.off_policy import OffPolicy
from SimpleTorchLLMRL.trainer.pipeline import TrainBatch
from tests.support.losses_helpers import (
    assert_grads_close,
    batch_of,
    grads,
    make_rollouts,
    multi_turn_rollout,
    naive_logprobs,
    perturbed_copy,
    trained_positions,
    with_sampled_logprobs,
)

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 2.0])


def _naive_adv(rewards, group_size, eps=1e-4, scale=True):
    r = rewards.double().view(-1, group_size)
    c = r - r.mean(1, keepdim=True)
    return (c / (r.std(1, keepdim=True) + eps) if scale else c).flatten()


def _naive_loss(lp, old, A, mask, kind, lo=0.2, hi=0.2, beta=0.0, ref=None, max_tokens=None):
    """Row by row, float64: the textbook formula of each loss type."""
    terms = []
    for i in range(lp.shape[0]):
        idx = mask[i].bool()
        lpi, oldi = lp[i, idx], old[i, idx].double()
        r = torch.exp((lpi - oldi).mean()).expand_as(lpi) if kind == "gspo" else torch.exp(lpi - oldi)
        if kind == "cispo":
            t = -torch.clamp(r, max=1 + hi).detach() * A[i] * lpi
        else:
            t = -torch.minimum(r * A[i], torch.clamp(r, 1 - lo, 1 + hi) * A[i])
        if beta:
            d = ref[i, idx].double() - lpi
            t = t + beta * (torch.exp(d) - d - 1)
        terms.append(t)
    if kind in ("grpo", "gspo"):
        return torch.stack([t.mean() for t in terms]).mean()
    total = torch.cat(terms).sum()
    if kind == "dr_grpo":
        return total / (len(terms) * max_tokens)
    return total / mask.sum()


def test_on_policy_gradient_is_advantage_weighted_logprob_gradient(qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    rollouts = make_rollouts(2, 3)  # two prompts x three replies: grouped by identical prompt
    grpo = GRPO(model, tok)
    loss = grpo.calculate_loss(rollouts, REWARDS)
    loss.backward()
    mine = grads(model)
    model.zero_grad()
    batch, A = batch_of(rollouts, tok), _naive_adv(REWARDS, 3)
    lp, m = naive_logprobs(model, batch), trained_positions(batch).double()
    ref = -(A * (lp * m).sum(1) / m.sum(1)).mean()  # -mean_i A_i mean_t log pi(o_it)
    ref.backward()
    assert_grads_close(mine, grads(model))
    assert grpo.metrics["ratio_min"] == grpo.metrics["ratio_max"] == 1.0
    assert grpo.metrics["clip_frac"] == 0.0 and grpo.metrics["num_sequences"] == 6


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_off_policy_loss_and_gradient_match_naive(loss_type, fused, qwen2_model, chatml_tokenizer):
    """Sampled log-probs shifted by -0.3: ratios exp(0.3) ~ 1.35 so the clips bind."""
    model, tok = qwen2_model, chatml_tokenizer
    ref_model = perturbed_copy(model)
    rollouts = with_sampled_logprobs(make_rollouts(2, 3), model, tok, temperature=1.0, shift=0.3)
    grpo = GRPO(model, tok, beta=0.1, ref_model=ref_model, loss_type=loss_type, group_size=3, max_tokens=40,
                fused=fused)
    loss = grpo.calculate_loss(rollouts, REWARDS)
    loss.backward()
    mine = grads(model)
    model.zero_grad()
    batch = batch_of(rollouts, tok)
    with torch.no_grad():
        ref_lp = naive_logprobs(ref_model, batch)
    lp = naive_logprobs(model, batch)
    hi = 0.28 if loss_type == "dapo" else 0.2
    naive = _naive_loss(lp, batch.sampler_logprobs, _naive_adv(REWARDS, 3), trained_positions(batch), loss_type, hi=hi,
                        beta=0.1, ref=ref_lp, max_tokens=40)
    naive.backward()
    torch.testing.assert_close(loss.double(), naive, rtol=1e-4, atol=1e-6)
    assert_grads_close(mine, grads(model))
    if loss_type != "cispo":
        assert grpo.metrics["clip_frac"] > 0
    assert grpo.metrics["kl"] > 0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batch_accumulation_equals_full_batch(loss_type, qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    rollouts = make_rollouts(2, 3)
    rollouts[4].add_messages(Message("and a longer second reply that pads the batch", MessageType.MODEL))
    grpo = GRPO(model, tok, loss_type=loss_type, group_size=3, max_tokens=40 if loss_type == "dr_grpo" else None)
    prepared = grpo.prepare(rollouts, REWARDS)
    full = grpo.calculate_loss(prepared)
    full.backward()
    g_full = grads(model)
    model.zero_grad()
    total = sum(grpo.calculate_loss(mb).detach() for mb in _backward_each(grpo, prepared.split(2)))
    torch.testing.assert_close(total, full.detach(), rtol=1e-5, atol=1e-7)
    assert_grads_close(grads(model), g_full, rtol=1e-4, atol=1e-7)
    model.zero_grad()  # user-side micro-batches of whole groups with the full batch's normalizer
    norm = grpo.normalizer_for(rollouts)
    for s in (0, 3):
        grpo.calculate_loss(rollouts[s:s + 3], REWARDS[s:s + 3], normalizer=norm).backward()
    assert_grads_close(grads(model), g_full, rtol=1e-4, atol=1e-7)


def _backward_each(grpo, micro_batches):
    for mb in micro_batches:
        grpo.calculate_loss(mb).backward()
        yield mb


def test_zero_gradient_on_untrained_tokens(qwen2_model, chatml_tokenizer):
    """The final hidden state at t-1 only feeds the prediction of token t: its gradient is 0 iff t is untrained."""
    model, tok = qwen2_model, chatml_tokenizer
    rollouts = [multi_turn_rollout(), *make_rollouts(1, 2)]
    captured = {}

    def keep(module, inputs, out):
        out.retain_grad()
        captured["h"] = out

    hook = model.model.norm.register_forward_hook(keep)
    try:
        # the padded layout's (B, T) hidden states; packed rows: tests/model/test_packing.py
        GRPO(model, tok, group_size=3, packed=False).calculate_loss(rollouts, [1.0, 0.0, 0.25]).backward()
    finally:
        hook.remove()
    g = captured["h"].grad.abs().sum(-1)  # (B, T)
    m = trained_positions(batch_of(rollouts, tok))
    assert torch.all(g[:, :-1][m[:, 1:] == 0] == 0)
    assert torch.all(g[:, :-1][m[:, 1:] == 1] > 0)
    assert torch.all(g[:, -1] == 0)


def test_trailing_untrained_message_changes_nothing(qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    base = make_rollouts(2, 2)
    longer = [r.copy() for r in base]
    longer[0].add_messages(Message("thanks, that was a very helpful answer indeed", MessageType.MESSAGE))
    grpo = GRPO(model, tok)
    a = grpo.calculate_loss(base, [1.0, 0.0, 0.0, 1.0])
    b = grpo.calculate_loss(longer, [1.0, 0.0, 0.0, 1.0])
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_all_equal_rewards_give_zero_advantage_finite_loss(qwen2_model, chatml_tokenizer):
    grpo = GRPO(qwen2_model, chatml_tokenizer, group_size=3)
    loss = grpo.calculate_loss(make_rollouts(2, 3), [1.0] * 6)
    loss.backward()
    assert torch.isfinite(loss) and loss.item() == 0.0
    assert all(p.grad is None or torch.all(p.grad == 0) for p in qwen2_model.parameters())
    assert grpo.metrics["frac_zero_advantage"] == 1.0 and grpo.metrics["frac_constant_groups"] == 1.0


def test_bad_inputs_raise_value_errors(qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    grpo = GRPO(model, tok)
    rollouts = make_rollouts(1, 2)
    with pytest.raises(ValueError, match="2 rollouts"):
        grpo.calculate_loss(rollouts, [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="finite"):
        grpo.calculate_loss(rollouts, [1.0, float("nan")])
    with pytest.raises(ValueError, match="finite"):
        grpo.calculate_loss(rollouts, [float("inf"), 0.0])
    no_train = Rollout([Message("hi"), Message("frozen reply", MessageType.MODEL, trainable=False)])
    with pytest.raises(ValueError, match=r"rollouts \[1\] have no trainable token"):
        grpo.calculate_loss([rollouts[0], no_train], [1.0, 0.0])
    with pytest.raises(ValueError, match="group_size"):
        GRPO(model, tok, group_size=4).calculate_loss(make_rollouts(2, 3), REWARDS)
    with pytest.raises(ValueError, match="group_id"):
        rs = make_rollouts(1, 2)
        rs[0].metadata["group_id"] = 0
        grpo.calculate_loss(rs, [1.0, 0.0])
    for kwargs, name in [({"loss_type": "ppo"}, "loss_type"), ({"eps": 1.5}, "eps"), ({"eps_high": -1}, "eps_high"),
                         ({"scale_rewards": "max"}, "scale_rewards"), ({"temperature": 0}, "temperature"),
                         ({"importance_sampling_level": "chunk"}, "importance_sampling_level"),
                         ({"kl_estimator": "k4"}, "kl_estimator"),
                         ({"group_size": 0}, "group_size"), ({"learning_rate": 1}, "unknown options"),
                         ({"beta": 0.1}, "reference")]:
        with pytest.raises(ValueError, match=name):
            GRPO(model, tok, **kwargs)


def test_groups_from_group_id_and_singleton_fallback(qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    rollouts = make_rollouts(2, 2)
    for r, gid in zip(rollouts, ["a", "b", "a", "b"], strict=True):  # group_id wins over identical prompts
        r.metadata["group_id"] = gid
    r = torch.tensor([1.0, 0.0, 3.0, 0.0])
    grpo = GRPO(model, tok)
    assert grpo.group_index(rollouts).tolist() == [0, 1, 0, 1]
    adv = grpo.prepare(rollouts, r, compute_old=False).advantages
    torch.testing.assert_close(adv.double(), _naive_adv(r[[0, 2, 1, 3]], 2)[[0, 2, 1, 3]], rtol=1e-5, atol=1e-6)
    singles = [Rollout([Message(f"question {k}"), Message("reply", MessageType.MODEL)]) for k in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adv = grpo.prepare(singles, r, compute_old=False).advantages
    lonely = [w for w in caught if "alone in their group" in str(w.message)]
    assert len(lonely) == 1
    torch.testing.assert_close(adv.double(), (r.double() - r.double().mean()) / (r.double().std() + 1e-4))


def test_temperature_like_with_like(qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    rollouts = with_sampled_logprobs(make_rollouts(1, 3), model, tok, temperature=0.7)
    with pytest.warns(UserWarning, match=r"temperature=0\.7.*temperature=1\.0"):  # an explicit, different one
        grpo = GRPO(model, tok, temperature=1.0)
        grpo.calculate_loss(rollouts, [1.0, 0.0, 0.5])
    assert grpo.metrics["temperature"] == 0.7
    assert abs(grpo.metrics["ratio_min"] - 1) < 1e-4 and abs(grpo.metrics["ratio_max"] - 1) < 1e-4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPO(model, tok, temperature=0.7).calculate_loss(rollouts, [1.0, 0.0, 0.5])
        GRPO(model, tok).calculate_loss(rollouts, [1.0, 0.0, 0.5])  # the default follows the rollouts


def test_truncated_importance_sampling(qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    rollouts = with_sampled_logprobs(make_rollouts(1, 3), model, tok, temperature=1.0, shift=0.3)
    grpo = GRPO(model, tok, off_policy=OffPolicy.tis(1.2))
    loss = grpo.calculate_loss(rollouts, REWARDS[:3])
    batch = batch_of(rollouts, tok)
    with torch.no_grad():
        lp = naive_logprobs(model, batch)
    m = trained_positions(batch).bool()
    w = torch.where(m, torch.exp(lp - batch.sampler_logprobs.double()).clamp(max=1.2), 0.0)
    A = _naive_adv(REWARDS[:3], 3)
    naive = -(A * (w * m).sum(1) / m.sum(1)).mean()  # ratio is 1 (trainer's own old log-probs), TIS reweights
    torch.testing.assert_close(loss.double(), naive, rtol=1e-4, atol=1e-6)
    assert abs(grpo.metrics["tis_weight_mean"] - float(w[m].mean())) < 1e-5


def test_reference_is_skipped_when_beta_is_zero(qwen2_model, chatml_tokenizer):
    class Boom(torch.nn.Module):
        def forward(self, *a, **k):
            raise AssertionError("reference model must not run when beta == 0")

    grpo = GRPO(qwen2_model, chatml_tokenizer, beta=0.0, ref_model=Boom())
    assert torch.isfinite(grpo.calculate_loss(make_rollouts(1, 2), [1.0, 0.0]))
    assert "kl" not in grpo.metrics


def test_peft_reference_is_the_model_without_adapter(chatml_tokenizer):
    peft = pytest.importorskip("peft")
    tok = chatml_tokenizer
    base = tiny_model("qwen2", tok, seed=5)
    base_copy = copy.deepcopy(base)
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    pm = peft.get_peft_model(base, cfg)
    rollouts = make_rollouts(1, 2)
    grpo = GRPO(pm, tok, beta=0.2)
    prepared = grpo.prepare(rollouts, [1.0, 0.0])
    batch = batch_of(rollouts, tok)
    m = trained_positions(batch)
    with torch.no_grad():
        expect = naive_logprobs(base_copy, batch) * m
        policy = naive_logprobs(pm, batch) * m
    torch.testing.assert_close(prepared.ref_logprobs.double(), expect, rtol=0, atol=2e-5)
    assert (policy - expect).abs().max() > 1e-3  # the adapter does change the policy
    loss = grpo.calculate_loss(prepared)
    loss.backward()
    assert grpo.metrics["kl"] > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in pm.named_parameters() if "lora_" in n)


def test_prepare_keeps_old_logprobs_across_epochs(qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    grpo = GRPO(model, tok, group_size=3)
    prepared = grpo.prepare(make_rollouts(2, 3), REWARDS)
    assert isinstance(prepared, TrainBatch) and prepared.old_logprobs is not None
    old = prepared.old_logprobs.clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        grpo.calculate_loss(prepared).backward()
        opt.step()
        opt.zero_grad()
    grpo.calculate_loss(prepared)
    assert torch.equal(prepared.old_logprobs, old)
    assert grpo.metrics["ratio_max"] > 1.0 + 1e-4 or grpo.metrics["ratio_min"] < 1.0 - 1e-4
    with pytest.raises(ValueError, match="no rewards"):
        grpo.calculate_loss(prepared, REWARDS)


def test_dapo_helpers(qwen2_model, chatml_tokenizer):
    grpo = GRPO(qwen2_model, chatml_tokenizer, loss_type="dapo", group_size=3)
    assert grpo.config.eps_high == 0.28
    rollouts = make_rollouts(2, 3)
    kept, r = grpo.filter_groups(rollouts, [1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    assert kept == rollouts[3:] and r.tolist() == [0.0, 1.0, 0.0]
    pen = grpo.overlong_penalty(rollouts, max_length=10, cache_length=4)
    # the response's generated tokens (what max_new_tokens caps), not the trained ones (+ end-of-turn)
    lengths = torch.tensor([float(len(chatml_tokenizer(r[-1].content, add_special_tokens=False)["input_ids"]))
                            for r in rollouts])
    assert len(set(lengths.tolist())) > 1 and bool(((lengths > 6) & (lengths < 10)).all()), "on the ramp"
    expect = torch.where(lengths <= 6, 0.0, torch.where(lengths <= 10, (6 - lengths) / 4, -1.0))
    torch.testing.assert_close(pen, expect)


def test_gpt2_without_chat_template(gpt2_model, plain_tokenizer):
    rollouts = make_rollouts(2, 2, system=False)
    grpo = GRPO(gpt2_model, plain_tokenizer, loss_type="dr_grpo", scale_rewards=False, max_tokens=16)
    loss = grpo.calculate_loss(rollouts, [1.0, 0.0, 0.0, 1.0])
    loss.backward()
    assert torch.isfinite(loss) and grpo.group_index(rollouts).tolist() == [0, 0, 1, 1]
    assert gpt2_model.transformer.wte.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grpo_on_one_screen_is_the_default_loss(temperature, qwen2_model, chatml_tokenizer):
    """`trainer.reference.grpo_reference`, the readable definition, equals the real path: value and gradients."""
    from SimpleTorchLLMRL.trainer.reference import grpo_reference

    model, tok = qwen2_model, chatml_tokenizer
    rollouts = with_sampled_logprobs(make_rollouts(2, 3), model, tok, temperature=temperature, shift=0.3)
    rollouts[1] = make_rollouts(2, 3)[1]  # one rollout without sampled log-probs: the current policy is its old one
    grpo = GRPO(model, tok)
    loss = grpo.calculate_loss(rollouts, REWARDS)
    loss.backward()
    mine = grads(model)
    model.zero_grad()
    ref = grpo_reference(model, tok, rollouts, REWARDS)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-7)
    assert_grads_close(mine, grads(model))
    assert grpo.metrics["clip_frac"] > 0  # the clip binds on some tokens


def test_a_token_id_outside_the_vocabulary_is_refused_before_any_forward(qwen2_model, chatml_tokenizer):
    """It raised IndexError from the embedding (on CUDA a device-side assert that ends the CUDA context)."""
    class Boom(torch.nn.Module):
        def forward(self, *a, **k):
            raise AssertionError("no forward may run")

    model, tok = qwen2_model, chatml_tokenizer
    rollouts = make_rollouts(1, 3)
    vocab = model.get_input_embeddings().weight.shape[0]
    rollouts[2][-1].token_ids = [5, vocab + 7, 6]
    for algo in (GRPO(model, tok), GRPO(model, tok, beta=0.1, ref_model=Boom())):
        with pytest.raises(ValueError, match=rf"rollout 2 holds token id {vocab + 7} at position \d+, outside the "
                                             rf"model's vocabulary of {vocab} ids"):
            algo.calculate_loss(rollouts, [1.0, 0.0, 0.5])


def test_a_none_reward_is_refused_naming_its_rollout(qwen2_model, chatml_tokenizer):
    """It raised a TypeError naming neither the rewards nor the rollout."""
    grpo = GRPO(qwen2_model, chatml_tokenizer)
    with pytest.raises(ValueError, match=r"rewards of rollouts \[1\] are None"):
        grpo.calculate_loss(make_rollouts(1, 3), [1.0, None, 0.0])
    with pytest.raises(ValueError, match=r"rewards of rollouts \[0, 2\] are None"):
        grpo.prepare(make_rollouts(1, 3), (None, 1.0, None))
