"""Scoring under the truncated distribution the sampler drew from (top-k / top-p / min-p): every head
kernel against a float64 reference written from HF's warpers, values and gradients; the kept set's edge
cases (ties at the k-th value, the scored token's guard); the rule that decides which turns truncate."""


import pytest
import torch
from torch import nn

from SimpleTorchLLMRL.chat.truncation import Truncation, truncation_settings
from SimpleTorchLLMRL.model.scoring import head_triton
from SimpleTorchLLMRL.model.scoring.logprobs import fused_token_loss, logprobs_from_hidden
from SimpleTorchLLMRL.model.scoring.truncation import keep_threshold, row_truncation

TRITON = ["triton"] if head_triton.interpreting() else []
KERNELS = ["cpu", "gpu", "generic"] + TRITON
# (top_k, top_p, min_p) per token; "mixed": one batch whose tokens carry different settings, some none
SETTINGS = {"top_k20": [(20, 1.0, 0.0)], "top_p0.8": [(0, 0.8, 0.0)], "both": [(20, 0.8, 0.0)],
            "min_p": [(0, 1.0, 0.05)],
            "mixed": [(20, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.0), (5, 0.5, 0.0), (20, 0.8, 0.1)]}


def reference_keep(z: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """(V,) bool, written from the samplers: min-p on softmax(z) (vLLM's order), HF's TopKLogitsWarper, then
    HF's TopPLogitsWarper on the top-k-renormalized distribution (sorted ascending, drop cum <= 1 - top_p)."""
    keep = torch.ones_like(z, dtype=torch.bool)
    if min_p:
        p = torch.softmax(z, -1)
        keep &= p >= min_p * p.max()
    if top_k:
        keep &= z >= torch.topk(z, top_k).values[-1]
    if top_p < 1:
        p = torch.softmax(z.masked_fill(~keep, float("-inf")), -1)
        order = torch.argsort(p)  # ascending
        drop = torch.cumsum(p[order], 0) <= 1 - top_p
        drop[-1] = False
        keep[order[drop]] = False
    return keep


def reference_logprobs(h, W, b, y, temperature, settings):
    """float64 log p_trunc(y) and the truncated distribution's entropy, with autograd through h, W, b."""
    z = (h @ W.T + (0 if b is None else b)) / temperature  # (N, V)
    lp, ent = [], []
    for i, (k, p, m) in enumerate(settings):
        keep = reference_keep(z[i].detach(), k, p, m)
        logsm = torch.log_softmax(z[i].masked_fill(~keep, float("-inf")), -1)
        lp.append(logsm[y[i]])
        ent.append(-(logsm.exp()[keep] * logsm[keep]).sum())
    return torch.stack(lp), torch.stack(ent)


def as_truncation(settings) -> Truncation:
    k, p, m = (torch.tensor(x) for x in zip(*settings, strict=True))
    return Truncation(k.long(), p.float(), m.float(), max_k=max(s[0] for s in settings),
                      full_sort=any(s[1] < 1 and not s[0] for s in settings),
                      any_top_p=any(s[1] < 1 for s in settings), any_min_p=any(s[2] > 0 for s in settings))


def case(name, N=13, H=16, V=97, temperature=0.7, bias=True, seed=0):
    """A head, hidden states and targets sampled from each token's truncated distribution (as a sampler would)."""
    torch.manual_seed(seed)
    head = nn.Linear(H, V, bias=bias)
    nn.init.normal_(head.weight, std=0.6)
    h = torch.randn(N, H)
    settings = (SETTINGS[name] * N)[:N]
    with torch.no_grad():
        z = head(h).double() / temperature
    y = torch.stack([torch.multinomial(torch.softmax(z[i].masked_fill(~reference_keep(z[i], *s), float("-inf")), -1),
                                       1)[0] for i, s in enumerate(settings)])
    return head, h, y, settings, temperature


def run_kernel(kernel, head, h, y, trunc, temperature, fused):
    if kernel == "generic":  # any head but a plain Linear: checkpointed chunks with autograd
        return logprobs_from_hidden(h, nn.Sequential(head), y, temperature=temperature, chunk_size=4, truncation=trunc)
    return logprobs_from_hidden(h, head, y, temperature=temperature, chunk_size=4, fused=fused, head_impl=kernel,
                                truncation=trunc)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("kernel", KERNELS)
def test_truncated_logprobs_match_float64(kernel, name, fused):
    head, h, y, settings, T = case(name)
    h = h.requires_grad_()
    g, g_ent = torch.randn(len(y)), torch.randn(len(y))
    lp, ent = run_kernel(kernel, head, h, y, as_truncation(settings), T, fused)
    (lp * g + ent * g_ent).sum().backward()
    h64 = h.detach().double().requires_grad_()
    W64, b64 = (p.detach().double().requires_grad_() for p in (head.weight, head.bias))
    lp_ref, ent_ref = reference_logprobs(h64, W64, b64, y, T, settings)
    (lp_ref * g.double() + ent_ref * g_ent.double()).sum().backward()
    full = torch.log_softmax((h64 @ W64.T + b64) / T, -1).gather(1, y[:, None]).squeeze(1)
    assert (lp_ref - full).abs().max() > 0.05  # truncation changes these log-probs: the test can fail
    torch.testing.assert_close(lp.double(), lp_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(head.weight.grad.double(), W64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(head.bias.grad.double(), b64.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kernel", ["cpu", "gpu"] + TRITON)
def test_fused_token_loss_under_truncation(kernel):
    head, h, y, settings, T = case("mixed")
    h = h.requires_grad_()
    adv = torch.randn(len(y))
    loss, lp, _ = fused_token_loss(h, head, y, lambda lp, sl: -adv[sl] * lp, temperature=T, chunk_size=4,
                                   head_impl=kernel, truncation=as_truncation(settings))
    loss.backward()
    h64 = h.detach().double().requires_grad_()
    W64, b64 = (p.detach().double().requires_grad_() for p in (head.weight, head.bias))
    lp_ref, _ = reference_logprobs(h64, W64, b64, y, T, settings)
    (-adv.double() * lp_ref).sum().backward()
    torch.testing.assert_close(lp.double(), lp_ref.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(head.weight.grad.double(), W64.grad, rtol=1e-4, atol=1e-6)


def test_no_truncation_is_the_full_softmax():
    head, h, y, _, T = case("top_k20")
    off = as_truncation([(0, 1.0, 0.0)] * len(y))
    for kernel in ["cpu", "gpu"]:
        a, ea = logprobs_from_hidden(h, head, y, temperature=T, head_impl=kernel)
        b, eb = logprobs_from_hidden(h, head, y, temperature=T, head_impl=kernel, truncation=off)
        assert torch.equal(a, b) and torch.equal(ea, eb)


def test_ties_at_the_kth_value_are_all_kept():
    z = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    cut = keep_threshold(z, row_truncation(1, 2, 1.0, 0.0, "cpu"))
    assert cut.tolist() == [2.0]  # top-2 keeps 3 and every 2 (HF: scores < the k-th value are removed)
    # top-p: 0.5 of the mass is above the 2s, so all three 2s stay (HF / vLLM keep a sort-order subset)
    p = torch.softmax(z, -1)[0]
    cut = keep_threshold(z, row_truncation(1, 0, float(p[0]) + 1e-3, 0.0, "cpu"))
    assert cut.tolist() == [2.0]
    cut = keep_threshold(z, row_truncation(1, 0, float(p[0]) - 1e-3, 0.0, "cpu"))
    assert cut.tolist() == [3.0]


def test_the_scored_token_is_always_kept():
    z = torch.tensor([[5.0, 4.0, 1.0, 0.5]])
    t = row_truncation(1, 2, 1.0, 0.0, "cpu")
    assert keep_threshold(z, t).tolist() == [4.0]
    assert keep_threshold(z, t, torch.tensor([3])).tolist() == [0.5]  # a rounding error away: not log 0


def test_which_turns_truncate():
    assert truncation_settings(None) is None and truncation_settings({}) is None
    assert truncation_settings({"top_k": 20}) == (20, 1.0, 0.0)
    assert truncation_settings({"top_p": 0.8, "min_p": 0.1}) == (0, 0.8, 0.1)
    # the trainer cannot replay a bias, penalties or a grammar: those turns keep the full distribution
    for extra in ({"logit_bias": {"3": 1.0}}, {"frequency_penalty": 0.5}, {"grammar": "root ::= \"a\""}):
        assert truncation_settings({"top_k": 20, **extra}) is None
    with pytest.raises(ValueError, match="top_p"):
        truncation_settings({"top_p": 1.5})
