"""The HF backend's own sampler (inverse CDF in a logits processor): exact distribution, zero mass never drawn.

Chi-square checks use a fixed seed and a threshold ~5 standard deviations above the
statistic's mean (dof + 5 sqrt(2 dof)): a sampler that is off by one entry, ignores
the temperature or the truncation fails them by orders of magnitude.
"""

import math

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_prompt
from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
from SimpleTorchLLMRL.model.generation.picker import BLOCK, inverse_cdf_sample
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig
from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer
from tests.support.generation_helpers import peaked


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> tuple[bool, float, float]:
    """counts (K,) vs probabilities (K,): bins expecting < 5 are pooled. Returns (ok, statistic, threshold)."""
    n = counts.sum().item()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum().item()
    dof = int(keep.sum()) - 1
    threshold = dof + 5 * math.sqrt(2 * dof)
    return stat < threshold, stat, threshold


@pytest.mark.parametrize("V", [50, 4 * BLOCK + 404])  # one cumsum; two-level blocks with a ragged last block
def test_inverse_cdf_matches_the_distribution_and_never_draws_zero_mass(V):
    g = torch.Generator().manual_seed(0)
    support = torch.tensor(sorted({0, 3, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 7, V - 1} | set(
        torch.randint(0, V, (20,), generator=g).tolist())))
    support = support[support < V]
    w = torch.zeros(V)
    w[support] = torch.rand(len(support), generator=g) * 5 + 0.05  # unnormalized, some small
    rows = 4000
    torch.manual_seed(1)
    counts = torch.zeros(V, dtype=torch.long)
    for _ in range(5):
        ids, total = inverse_cdf_sample(w.expand(rows, V).contiguous())
        torch.testing.assert_close(total, w.double().sum().expand(rows), rtol=1e-6, atol=0)
        counts += torch.bincount(ids, minlength=V)
    assert counts[w == 0].sum() == 0
    ok, stat, threshold = chi_square_ok(counts, w / w.sum())
    assert ok, f"chi-square {stat:.1f} >= {threshold:.1f}"


def test_inverse_cdf_survives_extreme_ranges_and_rejects_empty_rows():
    V = 4 * BLOCK + 1
    p = torch.zeros(3, V)
    p[0, V - 1] = 1.0  # all mass on the last entry of a ragged block
    p[1, 0], p[1, 2 * BLOCK] = 1e-30, 1.0  # a tiny entry next to a huge one
    p[2, BLOCK - 1] = 1.0
    torch.manual_seed(0)
    for _ in range(50):
        ids, _ = inverse_cdf_sample(p)
        assert ids[0] == V - 1 and ids[1] in (0, 2 * BLOCK) and ids[2] == BLOCK - 1
    for bad in (torch.zeros(2, V), torch.full((2, 10), float("nan"))):
        with pytest.raises(ValueError, match="cannot sample"):
            inverse_cdf_sample(bad)


@pytest.fixture(scope="module")
def setup():
    tok = tiny_tokenizer("chatml")
    model = peaked(tiny_model("qwen2", tok), std=0.08)
    r = Rollout([Message("What is 12 + 35?")])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([encode_prompt(r, tok)])).logits[0, -1].double()  # (V,)
    return tok, model, r, logits


def truncated_probs(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None):
    """HF's order: temperature, top-k, top-p (keep the smallest top set with mass >= top_p), renormalized."""
    z = logits / temperature
    if top_k:
        z = z.masked_fill(z < torch.topk(z, top_k).values[-1], float("-inf"))
    if top_p is not None:
        p = torch.softmax(z, -1)
        order = torch.argsort(p, descending=True)
        before = torch.cumsum(p[order], 0) - p[order]  # mass strictly above each entry
        drop = order[before >= top_p]
        z = z.clone()
        z[drop] = float("-inf")
    return torch.softmax(z, -1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.6, None, None), (1.3, 8, None),
                                                     (0.9, None, 0.7), (1.0, 20, 0.9)])
def test_first_token_distribution_matches_the_model(setup, temperature, top_k, top_p):
    tok, model, r, logits = setup
    gen = ModelGenerate(model, tok, seed=5,
                        sampling=SamplingConfig(max_new_tokens=1, temperature=temperature, top_k=top_k,
                                                top_p=top_p))
    (msgs,) = gen.generate([r], n=6000)
    ids = torch.tensor([m.token_ids[0] for m in msgs])
    probs = truncated_probs(logits, temperature, top_k, top_p)
    counts = torch.bincount(ids, minlength=len(probs))
    assert counts[probs == 0].sum() == 0, "drew a token that top-k / top-p removed"
    assert (probs > 0).sum() > 5  # a real distribution, not a near-greedy one
    ok, stat, threshold = chi_square_ok(counts, probs)
    assert ok, f"chi-square {stat:.1f} >= {threshold:.1f}"
    # log-probs are of the distribution the token was drawn from: the truncated one where it truncates
    recorded = torch.log(probs) if top_k or top_p is not None else torch.log_softmax(logits / temperature, -1)
    got = torch.tensor([m.logprobs[0] for m in msgs], dtype=torch.float64)
    torch.testing.assert_close(got, recorded[ids], atol=1e-4, rtol=0)
    assert all(m.sampling == ({"top_k": top_k} if top_k else {}) | ({"top_p": top_p} if top_p else {}) or
               (m.sampling is None and not top_k and not top_p) for m in msgs[:3])


def test_the_models_own_sampling_config_is_overridden(setup):
    """A checkpoint's generation_config (do_sample, top_k=3, temperature=0.1) must not leak into sampling."""
    tok, model, r, logits = setup
    cfg = model.generation_config
    saved = (cfg.do_sample, cfg.top_k, cfg.temperature, cfg.top_p)
    cfg.do_sample, cfg.top_k, cfg.temperature, cfg.top_p = True, 3, 0.1, 0.5
    try:
        (msgs,) = ModelGenerate(model, tok, max_new_tokens=1, temperature=1.0, seed=9).generate([r], n=6000)
    finally:
        cfg.do_sample, cfg.top_k, cfg.temperature, cfg.top_p = saved
    ids = torch.tensor([m.token_ids[0] for m in msgs])
    probs = torch.softmax(logits, -1)
    ok, stat, threshold = chi_square_ok(torch.bincount(ids, minlength=len(probs)), probs)
    assert ok, f"chi-square {stat:.1f} >= {threshold:.1f}"
