"""PPO: value head alignment, GAE targets, the value head actually trains."""


import pytest
import torch

from SimpleTorchLLMRL.testing.tiny import tiny_model
from SimpleTorchLLMRL.trainer.grpo import whiten
from SimpleTorchLLMRL.trainer.ppo import PPO, gae, terminal_token_rewards
from tests.support.losses_helpers import (
    assert_grads_close,
    batch_of,
    grads,
    make_rollouts,
    multi_turn_rollout,
    naive_logprobs,
    perturbed_copy,
    trained_positions,
)

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 2.0])


def _hidden(model, batch):
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
    return out.hidden_states[-1]


def test_value_loss_decreases_on_a_fixed_batch(qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    ppo = PPO(model, tok, vf_coef=1.0, cliprange_value=None)
    prepared = ppo.prepare(make_rollouts(2, 3), REWARDS)
    opt = torch.optim.Adam(ppo.value_parameters(), lr=0.003)  # only the value head: the policy stays fixed
    losses = []
    for _ in range(8):
        ppo.calculate_loss(prepared).backward()
        losses.append(ppo.metrics["value_loss"])
        opt.step()
        opt.zero_grad()
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses


def test_prepared_targets_match_naive_gae_and_values_align(qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    ref_model = perturbed_copy(model)
    rollouts = [*make_rollouts(1, 2), multi_turn_rollout()]
    r = torch.tensor([1.0, -1.0, 0.5])
    ppo = PPO(model, tok, beta=0.1, ref_model=ref_model, gamma=0.9, lam=0.8, whiten_advantages=False)
    prepared = ppo.prepare(rollouts, r)
    batch = batch_of(rollouts, tok)
    m = trained_positions(batch)
    with torch.no_grad():
        h = _hidden(model, batch)
        v = torch.cat([torch.zeros(3, 1), ppo.value_head(h[:, :-1]).squeeze(-1)], 1) * m  # value of the state emitting t
        lp, ref_lp = naive_logprobs(model, batch) * m, naive_logprobs(ref_model, batch) * m
    torch.testing.assert_close(prepared.old_values, v, rtol=1e-5, atol=1e-6)
    token_r = terminal_token_rewards(r.double(), m) - 0.1 * (lp - ref_lp) * m
    adv, ret = gae(token_r, v.double(), m, 0.9, 0.8)
    torch.testing.assert_close(prepared.advantages.double(), adv, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(prepared.returns.double(), ret, rtol=1e-4, atol=1e-5)


def test_loss_and_gradient_match_naive(qwen2_model, chatml_tokenizer):
    """One step on-policy: grad of pg + vf_coef * vf equals the naive float64 composition."""
    model, tok = qwen2_model, chatml_tokenizer
    rollouts = make_rollouts(2, 2)
    r = torch.tensor([1.0, 0.0, 0.0, 2.0])
    ppo = PPO(model, tok, vf_coef=0.5, gamma=1.0, lam=0.95)
    loss = ppo.calculate_loss(rollouts, r)
    loss.backward()
    mine, head_grad = grads(model), ppo.value_head.weight.grad.clone()
    model.zero_grad()
    ppo.value_head.zero_grad()
    batch = batch_of(rollouts, tok)
    m = trained_positions(batch).double()
    lp = naive_logprobs(model, batch)
    h = _hidden(model, batch).double()
    W, b = ppo.value_head.weight.double(), ppo.value_head.bias.double()
    v = torch.cat([torch.zeros(4, 1, dtype=torch.float64), (h[:, :-1] @ W.T + b).squeeze(-1)], 1) * m
    adv, ret = gae(terminal_token_rewards(r.double(), m), v.detach(), m, 1.0, 0.95)
    adv = whiten(adv, m)
    pg = -(torch.exp(lp - lp.detach()) * adv * m).sum() / m.sum()
    vf = (0.5 * (v - ret) ** 2 * m).sum() / m.sum()
    naive = pg + 0.5 * vf
    naive.backward()
    torch.testing.assert_close(loss.double(), naive, rtol=1e-4, atol=1e-6)
    assert_grads_close(mine, grads(model))
    torch.testing.assert_close(head_grad.double(), ppo.value_head.weight.grad.double(), rtol=1e-4, atol=1e-6)
    assert head_grad.abs().sum() > 0


def test_separate_critic_and_micro_batches(chatml_tokenizer):
    tok = chatml_tokenizer
    policy, critic = tiny_model("qwen2", tok, seed=1), tiny_model("qwen2", tok, seed=2, hidden_size=32)
    ppo = PPO(policy, tok, critic=critic)
    assert ppo.value_head.in_features == 32
    assert {id(p) for p in critic.parameters()} <= {id(p) for p in ppo.value_parameters()}
    prepared = ppo.prepare(make_rollouts(2, 2), REWARDS[:4])
    full = ppo.calculate_loss(prepared)
    full.backward()
    g_full = {**grads(policy), **{"critic." + k: v for k, v in grads(critic).items()}}
    policy.zero_grad()
    critic.zero_grad()
    for mb in prepared.split(3):
        ppo.calculate_loss(mb).backward()
    g_mb = {**grads(policy), **{"critic." + k: v for k, v in grads(critic).items()}}
    assert_grads_close(g_mb, g_full, rtol=1e-4, atol=1e-7)
    assert critic.model.embed_tokens.weight.grad.abs().sum() > 0


def test_bad_inputs(qwen2_model, chatml_tokenizer):
    ppo = PPO(qwen2_model, chatml_tokenizer)
    with pytest.raises(ValueError, match="rollouts"):
        ppo.calculate_loss(make_rollouts(1, 2), [1.0])
    with pytest.raises(ValueError, match="finite"):
        ppo.calculate_loss(make_rollouts(1, 2), [1.0, float("nan")])
    for kwargs, name in [({"gamma": 2.0}, "gamma"), ({"lam": -1}, "lam"), ({"vf_coef": -1}, "vf_coef"),
                         ({"cliprange_value": 0}, "cliprange_value"), ({"beta": 0.1}, "reference"),
                         ({"eps": 1.0}, "eps")]:
        with pytest.raises(ValueError, match=name):
            PPO(qwen2_model, chatml_tokenizer, **kwargs)
    with pytest.raises(TypeError, match="foo"):  # options are keyword arguments of the signature
        PPO(qwen2_model, chatml_tokenizer, foo=1)
