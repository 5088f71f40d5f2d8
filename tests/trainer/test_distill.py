"""On-policy distillation: the loss units against float64 references written from their formulas, the
teacher sources (HF model, vLLM engine, precomputed on the rollout), the tokenizer rule and micro-batching."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.chat.tokenize import rollouts_to_batch
from SimpleTorchLLMRL.testing.tiny import TINY_CALC, tiny_tokenizer
from SimpleTorchLLMRL.trainer.distill import Distill, DistillConfig, distill_loss, generalized_jsd, jsd_loss
from SimpleTorchLLMRL.trainer.losses import LossInputs, combine_metrics
from SimpleTorchLLMRL.trainer.teacher import attach_teacher_logprobs, hf_teacher_logprobs
from tests.support.losses_helpers import (
    assert_grads_close,
    grads,
    make_rollouts,
    naive_logprobs,
    perturbed_copy,
    trained_positions,
    with_sampled_logprobs,
)


@pytest.fixture
def student():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(TINY_CALC, dtype=torch.float32)


@pytest.fixture
def teacher(student):
    torch.manual_seed(1)
    return perturbed_copy(student, 0.05).eval()


def _tokens(seed=0, B=3, T=6, V=7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(V, (B, T), generator=g)
    teacher = torch.log_softmax(torch.randn(B, T, V, generator=g, dtype=torch.float64), -1).gather(-1, y[..., None])[..., 0]
    mask = (torch.rand(B, T, generator=g) < 0.7).long()
    mask[:, 0] = 0
    mask[:, 1] = 1
    return logits, y, teacher, mask


# ---------------------------------------------------------------- the reverse-KL unit


@pytest.mark.parametrize("clip, rl, aggregate", [(None, False, "token_mean"), (0.2, True, "token_mean"),
                                                 (None, True, "sequence_mean_token_mean")])
def test_distill_loss_matches_float64_reference(clip, rl, aggregate):
    logits, y, teacher, mask = _tokens()
    lp = torch.log_softmax(logits, -1).gather(-1, y[..., None])[..., 0]  # (B, T) float64
    old = (lp.detach() + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(4),
                                           dtype=torch.float64)).clamp(max=0)
    adv_rl = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64) if rl else None
    out = distill_loss(LossInputs.from_tokens(mask, logprobs=lp, teacher_logprobs=teacher, old_logprobs=old,
                                              advantages=adv_rl),
                       DistillConfig(kl_coef=0.7, eps=clip, aggregate=aggregate))
    (g,) = torch.autograd.grad(out.loss, logits)

    # reference: A_t = -kl_coef (log p_old - log p_teacher) + A_rl; loss = -A r (or PPO-clip), aggregated
    ref_loss = torch.zeros((), dtype=torch.float64)
    lp2 = torch.log_softmax(logits, -1).gather(-1, y[..., None])[..., 0]
    rows = []
    for b in range(3):
        terms = []
        for t in range(6):
            if not mask[b, t]:
                continue
            a = -0.7 * (old[b, t] - teacher[b, t]) + (adv_rl[b] if rl else 0.0)
            r = torch.exp(lp2[b, t] - old[b, t])
            term = -a * r if clip is None else -torch.minimum(r * a, torch.clamp(r, 0.8, 1.2) * a)
            terms.append(term)
        rows.append(terms)
    if aggregate == "token_mean":
        ref_loss = sum(t for row in rows for t in row) / sum(len(row) for row in rows)
    else:
        ref_loss = sum(sum(row) / len(row) for row in rows) / len(rows)
    (g_ref,) = torch.autograd.grad(ref_loss, logits)
    # float32 aggregation weights (1 / count) are the only rounding
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-9)
    m = mask.bool()
    assert float(out.metrics["reverse_kl"]) == pytest.approx(float((old - teacher)[m].mean()), rel=1e-6)
    assert int(out.metrics["num_tokens"]) == int(m.sum())


def test_expected_gradient_is_the_gradient_of_the_reverse_kl():
    """Summed over every token y with weight p_student(y), the unit's loss is KL(p_s || p_t) and its gradient
    is d KL(p_s || p_t) / d logits, computed from the full distributions: the on-policy distillation objective."""
    g = torch.Generator().manual_seed(0)
    V = 6
    z = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True)
    zt = torch.randn(V, generator=g, dtype=torch.float64)
    ps, lt = torch.softmax(z, 0), torch.log_softmax(zt, 0)
    exact = (ps * (torch.log_softmax(z, 0) - lt)).sum()
    (g_exact,) = torch.autograd.grad(exact, z)
    value, grad = 0.0, torch.zeros(V, dtype=torch.float64)
    for y in range(V):
        lp = torch.log_softmax(z, 0)[y].view(1, 1)  # one sampled token, on-policy
        mask = torch.tensor([[0, 1]])  # token 1, predicted from position 0
        out = distill_loss(LossInputs.from_tokens(mask, logprobs=torch.cat([lp.detach(), lp], 1),
                                                  teacher_logprobs=lt[y].view(1, 1).expand(1, 2)), DistillConfig())
        (gy,) = torch.autograd.grad(out.loss, z)
        w = float(ps[y].detach())
        value, grad = value + w * float(out.loss), grad + w * gy
    assert value == pytest.approx(float(exact), rel=1e-12)
    torch.testing.assert_close(grad, g_exact, rtol=1e-10, atol=1e-12)


def test_teacher_nan_on_a_trained_token_is_refused():
    lp = torch.zeros(1, 3)
    x = lambda teacher, mask: LossInputs.from_tokens(torch.tensor(mask), logprobs=lp, teacher_logprobs=teacher)  # noqa: E731
    with pytest.raises(ValueError, match="NaN on a trained token"):
        distill_loss(x(torch.tensor([[0.0, math.nan, -1.0]]), [[1, 1, 1]]), DistillConfig())
    out = distill_loss(x(torch.tensor([[-1.0, math.nan, -1.0]]), [[0, 0, 1]]), DistillConfig())
    assert torch.isfinite(out.loss)


# ---------------------------------------------------------------- generalized JSD


def _kl(p_log, q_log):
    return (p_log.exp() * (p_log - q_log)).sum(-1)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalized_jsd_matches_its_definition(beta):
    g = torch.Generator().manual_seed(2)
    zs, zt = torch.randn(5, 9, generator=g, dtype=torch.float64), torch.randn(5, 9, generator=g, dtype=torch.float64)
    s, t = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    if beta == 0.0:
        ref = _kl(t, s)  # forward KL(teacher || student)
    elif beta == 1.0:
        ref = _kl(s, t)  # reverse KL(student || teacher)
    else:
        m = torch.log(beta * t.exp() + (1 - beta) * s.exp())
        ref = beta * _kl(t, m) + (1 - beta) * _kl(s, m)
    torch.testing.assert_close(generalized_jsd(zs, zt, beta), ref, rtol=1e-12, atol=1e-14)
    assert (generalized_jsd(zs, zs, beta).abs() < 1e-12).all()


def test_jsd_loss_chunked_matches_float64_reference():
    g = torch.Generator().manual_seed(3)
    N, H, V = 7, 5, 11
    head = torch.nn.Linear(H, V, bias=False)
    teacher_head = torch.nn.Linear(H + 1, V, bias=False)
    h = torch.randn(N, H, generator=g, requires_grad=True)
    ht = torch.randn(N, H + 1, generator=g)
    y = torch.randint(V, (N,), generator=g)
    row = torch.tensor([0, 0, 0, 1, 1, 2, 2])  # 3 rollouts: the sequence-mean-of-token-means weights
    w = torch.tensor([1 / 3, 1 / 3, 1 / 3, 1 / 2, 1 / 2, 1 / 2, 1 / 2]) / 3
    extra = dict(hidden=h, head=head, teacher_hidden=ht, teacher_head=teacher_head, targets=y, chunk_size=3)
    inputs = LossInputs(None, row, 3, torch.bincount(row).float()[row], temperature=0.7, extra=extra)
    out = jsd_loss(inputs, DistillConfig(divergence="jsd", jsd_beta=0.3, aggregate="sequence_mean_token_mean"))
    out.loss.backward()
    h64, W64 = h.detach().double().requires_grad_(), head.weight.detach().double().requires_grad_()
    zs, zt = h64 @ W64.T / 0.7, ht.double() @ teacher_head.weight.detach().double().T / 0.7
    s, t = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    m = torch.log(0.3 * t.exp() + 0.7 * s.exp())
    ref = ((0.3 * _kl(t, m) + 0.7 * _kl(s, m)) * w.double()).sum()
    ref.backward()
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(head.weight.grad.double(), W64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.token_logprobs.double(), s.gather(1, y[:, None])[:, 0], rtol=1e-5, atol=1e-6)
    assert teacher_head.weight.grad is None


# ---------------------------------------------------------------- the front on the tiny model


def _reference(student, teacher, batch, mask, old=None, adv=None, kl_coef=1.0):
    """float64 copies: loss = sum over trained tokens of -A r / count; A = -kl_coef (log p_old - log p_t) + adv."""
    s64, t64 = copy.deepcopy(student).double(), copy.deepcopy(teacher).double()
    lp = naive_logprobs(s64, batch)
    with torch.no_grad():
        lt = naive_logprobs(t64, batch)
    o = lp.detach() if old is None else torch.where(torch.isnan(old), lp.detach(), old.double())
    a = -kl_coef * (o - lt) + (0 if adv is None else adv.double()[:, None])
    m = mask.bool()
    loss = (-a * torch.exp(lp - o))[m].sum() / m.sum()
    loss.backward()
    return loss, {n: p.grad for n, p in s64.named_parameters()}


@pytest.mark.parametrize("sampled", [False, True])
def test_distill_front_matches_float64_reference(student, teacher, calc_tok, sampled):
    rollouts = make_rollouts(2, 2)
    if sampled:
        rollouts = with_sampled_logprobs(rollouts, perturbed_copy(student, 0.02), calc_tok, 1.0)  # off-policy a little
    distill = Distill(student, calc_tok, teacher=teacher, kl_coef=0.5)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    loss = distill.calculate_loss(rollouts, rewards)
    loss.backward()
    batch = rollouts_to_batch(rollouts, calc_tok)
    mask = trained_positions(batch)
    std = float(torch.tensor([1.0, 0.0], dtype=torch.float64).std())  # each group of 2 holds rewards {1, 0}
    adv = torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=torch.float64) / (std + 1e-4)  # GRPO: (r - mean) / (std + eps)
    ref, g_ref = _reference(student, teacher, batch, mask, batch.sampler_logprobs, adv, kl_coef=0.5)
    assert float(loss) == pytest.approx(float(ref), rel=1e-4, abs=1e-5)
    assert_grads_close(grads(student), g_ref, rtol=1e-3, atol=1e-5)


def test_distill_micro_batches_sum_to_the_full_batch(student, teacher, calc_tok):
    rollouts = make_rollouts(2, 3)
    distill = Distill(student, calc_tok, teacher=teacher)
    prepared = distill.prepare(rollouts)
    full = distill.compute(prepared)
    full.loss.backward()
    g_full = grads(student)
    student.zero_grad()
    parts = []
    for mb in prepared.split(4):
        out = distill.compute(mb)
        out.loss.backward()
        parts.append(out.metrics)
    assert_grads_close(grads(student), g_full, rtol=1e-4, atol=1e-6)
    combined = combine_metrics(parts)
    for key in ("loss", "reverse_kl", "entropy", "advantage_mean", "num_tokens", "ratio_min"):
        assert float(combined[key]) == pytest.approx(float(full.metrics[key]), rel=1e-5, abs=1e-6), key


def test_jsd_front_matches_float64_reference_and_micro_batches(student, teacher, calc_tok):
    rollouts = make_rollouts(2, 2)
    distill = Distill(student, calc_tok, teacher=teacher, divergence="jsd", jsd_beta=0.5, chunk_size=5)
    prepared = distill.prepare(rollouts)
    distill.compute(prepared).loss.backward()
    g_full = grads(student)
    s64, t64 = copy.deepcopy(student).double(), copy.deepcopy(teacher).double()
    batch = prepared.batch
    zs = s64(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    with torch.no_grad():
        zt = t64(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    sel = prepared.mask[:, 1:].bool()
    s, t = torch.log_softmax(zs[sel], -1), torch.log_softmax(zt[sel], -1)
    m = torch.log(0.5 * t.exp() + 0.5 * s.exp())
    ref = (0.5 * _kl(t, m) + 0.5 * _kl(s, m)).mean()
    ref.backward()
    assert float(distill.metrics["loss"]) == pytest.approx(float(ref), rel=1e-4)
    assert_grads_close(g_full, {n: p.grad for n, p in s64.named_parameters()}, rtol=1e-3, atol=1e-6)
    student.zero_grad()
    for mb in prepared.split(2):
        distill.compute(mb).loss.backward()
    assert_grads_close(grads(student), g_full, rtol=1e-4, atol=1e-7)


def test_teacher_equal_to_student_gives_zero_reverse_kl(student, calc_tok):
    distill = Distill(student, calc_tok, teacher=copy.deepcopy(student))
    loss = distill.calculate_loss(make_rollouts(2, 2))
    loss.backward()
    assert abs(float(distill.metrics["reverse_kl"])) < 1e-6 and abs(float(loss)) < 1e-6
    assert max(float(p.grad.abs().max()) for p in student.parameters() if p.grad is not None) < 1e-6
    jsd = Distill(student, calc_tok, teacher=copy.deepcopy(student), divergence="jsd")
    assert abs(float(jsd.calculate_loss(make_rollouts(1, 2)))) < 1e-6


def test_a_teacher_with_another_tokenizer_is_refused(student, calc_tok):
    other = tiny_tokenizer("chatml")  # another vocabulary, the same template
    distill = Distill(student, calc_tok, teacher=copy.deepcopy(student), teacher_tokenizer=other)
    with pytest.raises(ValueError, match="teacher's tokenizer"):
        distill.calculate_loss(make_rollouts(1, 2))
    same = Distill(student, calc_tok, teacher=copy.deepcopy(student),
                   teacher_tokenizer=AutoTokenizer.from_pretrained(TINY_CALC))
    assert torch.isfinite(same.calculate_loss(make_rollouts(1, 2)))  # the same tokenizer loaded again passes


def test_precomputed_teacher_logprobs_on_the_rollouts(student, teacher, calc_tok):
    rollouts = with_sampled_logprobs(make_rollouts(2, 2), student, calc_tok, 1.0)
    batch = rollouts_to_batch(rollouts, calc_tok)
    mask = trained_positions(batch)
    scored = hf_teacher_logprobs(teacher, batch, mask)
    attach_teacher_logprobs(rollouts, batch, scored, mask)
    stored = [Rollout.from_dict(r.to_dict()) for r in rollouts]  # survives a rollout file (plain JSON)
    assert stored[0].metadata["teacher_logprobs"][0] is None  # the system message
    from_rollouts = Distill(student, calc_tok, teacher="rollouts").prepare(stored)
    from_model = Distill(student, calc_tok, teacher=teacher).prepare(rollouts)
    assert torch.equal(from_rollouts.teacher_logprobs, from_model.teacher_logprobs)
    bare = make_rollouts(1, 1)
    with pytest.raises(ValueError, match="no metadata\\['teacher_logprobs'\\]"):
        Distill(student, calc_tok, teacher="rollouts").prepare(bare)


def test_fake_vllm_teacher_matches_the_hf_teacher(student, calc_tok, monkeypatch):
    from tests.support.fake_vllm import install_fake_vllm

    vllm = install_fake_vllm(monkeypatch)
    llm = vllm.LLM(str(TINY_CALC))  # the same weights as a fresh student
    rollouts = with_sampled_logprobs(make_rollouts(2, 2), student, calc_tok, 1.0)
    from_engine = Distill(student, calc_tok, teacher=llm).prepare(rollouts)
    from_hf = Distill(student, calc_tok, teacher=copy.deepcopy(student)).prepare(rollouts)
    m = from_hf.mask.bool()
    assert (from_engine.teacher_logprobs[~m] == 0).all()
    torch.testing.assert_close(from_engine.teacher_logprobs[m], from_hf.teacher_logprobs[m], rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="temperature 1"):
        Distill(student, calc_tok, teacher=llm).prepare(with_sampled_logprobs(make_rollouts(1, 2), student, calc_tok, 0.7))


def test_bad_options_are_named(student, calc_tok, teacher):
    with pytest.raises(ValueError, match="divergence"):
        Distill(student, calc_tok, teacher=teacher, divergence="kl")
    with pytest.raises(ValueError, match="unknown options"):
        Distill(student, calc_tok, teacher=teacher, beta=0.1)
    with pytest.raises(ValueError, match="full distribution"):
        Distill(student, calc_tok, teacher="rollouts", divergence="jsd")
    with pytest.raises(ValueError, match="student itself"):
        Distill(student, calc_tok, teacher=student)
    with pytest.raises(ValueError, match="teacher="):
        Distill(student, calc_tok, teacher=3)


def test_share_prefix_gives_the_same_loss_and_gradients(student, teacher, calc_tok):
    from SimpleTorchLLMRL.trainer.dpo import DPO

    rollouts = make_rollouts(2, 3)
    results = []
    for share in (False, True):
        student.zero_grad()
        loss = Distill(student, calc_tok, teacher=teacher, share_prefix=share).calculate_loss(rollouts)
        loss = loss + DPO(student, calc_tok, ref_model=teacher, share_prefix=share).calculate_loss(rollouts[:2],
                                                                                              rollouts[1:3])
        loss.backward()
        results.append((float(loss), grads(student)))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5, abs=1e-6)
    for n, g in results[0][1].items():  # float32 summation order: within 1e-4 of each tensor's largest entry
        torch.testing.assert_close(results[1][1][n], g, rtol=1e-4, atol=1e-4 * float(g.abs().max()) + 1e-12)


# ---------------------------------------------------------------- hostile teachers (issue 43): refused, named


@pytest.mark.parametrize("bad", [-math.inf, math.nan, 50.0])
def test_precomputed_teacher_logprobs_must_be_finite_and_at_most_0(student, teacher, calc_tok, bad):
    """-inf trained to loss inf and +50 to loss -51.5 before: now a ValueError naming rollout, message, position."""
    rollouts = with_sampled_logprobs(make_rollouts(1, 2), student, calc_tok, 1.0)
    batch = rollouts_to_batch(rollouts, calc_tok)
    mask = trained_positions(batch)
    attach_teacher_logprobs(rollouts, batch, hf_teacher_logprobs(teacher, batch, mask), mask)
    j = next(i for i, m in enumerate(rollouts[1]) if m.token_ids is not None)  # the MODEL message
    rollouts[1].metadata["teacher_logprobs"][j][2] = bad
    t = int((batch.message_index[1] == j).nonzero()[2])
    with pytest.raises(ValueError, match=rf"precomputed teacher log-prob {bad} at rollout 1, message {j} "
                                         rf"\(its token 2\), token position {t}"):
        Distill(student, calc_tok, teacher="rollouts").calculate_loss(rollouts)


def test_an_hf_teacher_that_gives_nan_is_refused(student, teacher, calc_tok):
    Distill(student, calc_tok, teacher=teacher).prepare(make_rollouts(1, 2))  # a sound teacher, then its weights break
    with torch.no_grad():
        teacher.get_output_embeddings().weight[5, 0] = math.nan  # every logit row holds a NaN
    with pytest.raises(ValueError, match=r"the HF teacher log-prob nan at rollout 0, message \d+ \(its token 0\)"):
        Distill(student, calc_tok, teacher=teacher).calculate_loss(make_rollouts(1, 2))


def test_a_vllm_teacher_above_0_is_refused(student, calc_tok, monkeypatch):
    from tests.support.fake_vllm import Logprob, install_fake_vllm

    vllm = install_fake_vllm(monkeypatch)
    llm = vllm.LLM(str(TINY_CALC))
    rollouts = with_sampled_logprobs(make_rollouts(1, 2), student, calc_tok, 1.0)
    at = int(trained_positions(rollouts_to_batch(rollouts, calc_tok))[0].nonzero()[2])  # a trained token of rollout 0
    honest = llm._prompt_logprobs
    monkeypatch.setattr(llm, "_prompt_logprobs", lambda model, ids: [
        row if row is None or t != at else {k: Logprob(0.5, 1) for k in row}
        for t, row in enumerate(honest(model, ids))])
    with pytest.raises(ValueError, match=rf"the vLLM teacher log-prob 0.5 at rollout 0, message \d+ \(its token 2\), "
                                         rf"token position {at}"):
        Distill(student, calc_tok, teacher=llm).prepare(rollouts)


def test_a_teacher_with_a_smaller_vocabulary_is_refused_before_any_forward(student, calc_tok):
    """An id the teacher cannot read raised IndexError from its embedding (a device-side assert on CUDA)."""
    from SimpleTorchLLMRL.testing.tiny import tiny_model

    small = tiny_model("qwen2", calc_tok, vocab_size=len(calc_tok) - 100)
    with pytest.raises(ValueError, match="one vocabulary"):  # JSD compares full distributions: refused when built
        Distill(student, calc_tok, teacher=small, divergence="jsd")
    rollouts = make_rollouts(1, 2)
    high = len(calc_tok) - 50  # an id the student reads and the teacher does not
    rollouts[1][-1].token_ids = calc_tok(rollouts[1][-1].content, add_special_tokens=False)["input_ids"] + [high]
    with pytest.raises(ValueError, match=rf"rollout 1 holds token id {high} at position \d+, outside the teacher's "
                                         rf"vocabulary of {len(calc_tok) - 100} ids"):
        Distill(student, calc_tok, teacher=small).prepare(rollouts)
