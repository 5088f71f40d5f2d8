"""Chunked log-probs against a full-vocab float64 log-softmax: values, entropy, gradients, memory."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from SimpleTorchLLMRL.model.scoring import head_triton
from SimpleTorchLLMRL.model.scoring.logprobs import fused_token_loss, logprobs_from_hidden, token_logprobs
from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer
from tests.support.losses_helpers import batch_of, make_rollouts, multi_turn_rollout, naive_logprobs


def naive_from_hidden(h, W, b, y, temperature):
    z = (h.double() @ W.double().T + (0 if b is None else b.double())) / temperature
    lp_all = torch.log_softmax(z, -1)
    return lp_all.gather(1, y[:, None]).squeeze(1), -(lp_all.exp() * lp_all).sum(-1)


def small_scratch(monkeypatch, V, rows):
    """Row blocks of `rows` rows inside each chunk (the default scratch holds a whole small chunk)."""
    if rows:
        monkeypatch.setattr("SimpleTorchLLMRL.model.scoring.head_kernels.SCRATCH_BYTES", 4 * V * rows)


# (head_impl, scratch rows of the cpu kernel); "triton" runs on CPU only in Triton's interpreter, i.e. when
# test_gpu_path.py runs these tests again in a process started with TRITON_INTERPRET=1
TRITON = ["triton"] if head_triton.interpreting() else []
KERNELS = [("cpu", None), ("cpu", 3), ("gpu", None)] + [(k, None) for k in TRITON]


@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("w_trainable", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("impl,scratch_rows", KERNELS)
def test_from_hidden_matches_float64(fused, w_trainable, bias, impl, scratch_rows, entropy_grad, monkeypatch):
    torch.manual_seed(0)
    N, H, V, temp = 11, 16, 53, 0.7
    small_scratch(monkeypatch, V, scratch_rows)
    head = nn.Linear(H, V, bias=bias)
    head.weight.requires_grad_(w_trainable)
    h = torch.randn(N, H, requires_grad=True)
    y = torch.randint(0, V, (N,))
    g, g_ent = torch.randn(N), torch.randn(N) * entropy_grad  # arbitrary upstream gradients of logp and entropy
    lp, ent = logprobs_from_hidden(h, head, y, temperature=temp, chunk_size=4, fused=fused, head_impl=impl)
    loss = (lp * g + ent * g_ent).sum() if entropy_grad else (lp * g).sum()  # without: no entropy gradient
    loss.backward()  # the two-pass head: dL/dlogp and dL/dentropy per token, one backward
    h_ref = h.detach().double().requires_grad_()
    W_ref = head.weight.detach().double().requires_grad_()
    b_ref = None if not bias else head.bias.detach().double().requires_grad_()
    lp_ref, ent_ref = naive_from_hidden(h_ref, W_ref, b_ref, y, temp)
    (lp_ref * g.double() + ent_ref * g_ent.double()).sum().backward()
    torch.testing.assert_close(lp.double(), lp_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=1e-4, atol=1e-6)
    if w_trainable:
        torch.testing.assert_close(head.weight.grad.double(), W_ref.grad, rtol=1e-4, atol=1e-6)
    else:
        assert head.weight.grad is None
    if bias:
        torch.testing.assert_close(head.bias.grad.double(), b_ref.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("w_trainable", [True, False])
@pytest.mark.parametrize("impl,scratch_rows", KERNELS)
def test_fused_token_loss_matches_float64(w_trainable, impl, scratch_rows, monkeypatch):
    """A nonlinear per-token loss of logp (clipped ratio times advantage): value and all gradients."""
    torch.manual_seed(2)
    N, H, V, temp = 13, 16, 61, 0.9
    small_scratch(monkeypatch, V, scratch_rows)
    head = nn.Linear(H, V, bias=True)
    head.weight.requires_grad_(w_trainable)
    h = torch.randn(N, H, requires_grad=True)
    y = torch.randint(0, V, (N,))
    old, adv = -torch.rand(N) * 4, torch.randn(N)

    def token_loss(lp, sl):
        r = torch.exp(lp - old[sl].to(lp.dtype))
        return -torch.minimum(r * adv[sl], r.clamp(0.8, 1.2) * adv[sl]) / N

    loss, lp, ent = fused_token_loss(h, head, y, token_loss, temperature=temp, chunk_size=4, head_impl=impl)
    (3.0 * loss).backward()  # a non-unit upstream gradient
    h_ref = h.detach().double().requires_grad_()
    W_ref = head.weight.detach().double().requires_grad_()
    b_ref = head.bias.detach().double().requires_grad_()
    lp_ref, ent_ref = naive_from_hidden(h_ref, W_ref, b_ref, y, temp)
    ref = token_loss(lp_ref, slice(None)).sum()
    (3.0 * ref).backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp.double(), lp_ref.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent_ref.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(head.bias.grad.double(), b_ref.grad, rtol=1e-4, atol=1e-6)
    if w_trainable:
        torch.testing.assert_close(head.weight.grad.double(), W_ref.grad, rtol=1e-4, atol=1e-6)
    else:
        assert head.weight.grad is None
    with pytest.raises(ValueError, match="nn.Linear"):
        fused_token_loss(h, nn.Sequential(head), y, token_loss)


BF16_LOGP_ATOL = 0.03  # bf16 weights and hidden states, |logits| up to 5.2: measured max 0.0083 (entropy 0.0073)
BF16_GRAD_RTOL = 0.02  # relative to the largest gradient entry: measured max 0.0055 (cpu and gpu kernels, CPU)


@pytest.mark.parametrize("impl", ["cpu", "gpu", *TRITON])
@pytest.mark.parametrize("fused", [True, False])
def test_bfloat16_head_within_the_stated_bound(impl, fused):
    """A bf16 model's head (the GPU path's dtype): log-probs, entropy and gradients vs float64 on the same
    bf16 weights, within BF16_LOGP_ATOL / BF16_GRAD_RTOL. On CUDA the logits GEMM keeps a float32 output and
    is closer still; on CPU they are rounded to bf16 first (the bound covers that)."""
    torch.manual_seed(3)
    N, H, V = 37, 64, 301
    head = nn.Linear(H, V, bias=False).to(torch.bfloat16)
    h = (torch.randn(N, H) * 2.0).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (N,))
    adv = torch.randn(N)
    if fused:
        loss, lp, ent = fused_token_loss(h, head, y, lambda lp, sl: -adv[sl] * lp, chunk_size=8, head_impl=impl)
    else:
        lp, ent = logprobs_from_hidden(h, head, y, chunk_size=8, head_impl=impl)
        loss = (-adv * lp).sum()
    loss.backward()
    assert lp.dtype == ent.dtype == torch.float32 and h.grad.dtype == head.weight.grad.dtype == torch.bfloat16
    h_ref = h.detach().double().requires_grad_()
    W_ref = head.weight.detach().double().requires_grad_()
    lp_ref, ent_ref = naive_from_hidden(h_ref, W_ref, None, y, 1.0)
    (-adv.double() * lp_ref).sum().backward()
    assert (lp.double() - lp_ref).abs().max() < BF16_LOGP_ATOL
    assert (ent.double() - ent_ref).abs().max() < BF16_LOGP_ATOL
    for got, want in ((h.grad, h_ref.grad), (head.weight.grad, W_ref.grad)):
        assert (got.double() - want).abs().max() < BF16_GRAD_RTOL * want.abs().max()


def test_head_impl_is_checked_and_auto_follows_the_device():
    import SimpleTorchLLMRL.model.scoring.logprobs as L

    head = nn.Linear(8, 20)
    h, y = torch.randn(5, 8), torch.randint(0, 20, (5,))
    with pytest.raises(ValueError, match="head_impl"):
        logprobs_from_hidden(h, head, y, head_impl="tpu")
    assert L._kernel("auto", torch.device("cpu")) is L._LinearChunks
    on_cuda = L._TritonChunks if head_triton.available() else L._DeviceChunks
    assert L._kernel("auto", torch.device("cuda")) is on_cuda
    assert L._kernel("gpu", torch.device("cpu")) is L._DeviceChunks
    # chunk sizes: the caller's, else 512 tokens on cpu, GPU_CHUNK_BYTES of float32 logits on gpu
    assert L._chunk_tokens(L._LinearChunks, None, 151_936) == 512
    assert L._chunk_tokens(L._DeviceChunks, None, 151_936) * 4 * 151_936 <= L.GPU_CHUNK_BYTES
    assert L._chunk_tokens(L._DeviceChunks, 7, 151_936) == 7
    assert L._chunk_tokens(L._TritonChunks, None, 151_936) == L._chunk_tokens(L._DeviceChunks, None, 151_936)
    if not head_triton.interpreting():  # a CPU tensor cannot reach a compiled Triton kernel: one clear error
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            logprobs_from_hidden(h, head, y, head_impl="triton")


def test_upcast_and_bfloat16_weight():
    torch.manual_seed(1)
    head = nn.Linear(16, 40, bias=False).to(torch.bfloat16)
    h = torch.randn(7, 16, dtype=torch.bfloat16)
    y = torch.randint(0, 40, (7,))
    lp, _ = logprobs_from_hidden(h, head, y, upcast=True)
    ref, _ = naive_from_hidden(h.float(), head.weight.float(), None, y, 1.0)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch,style", [("qwen2", "chatml"), ("gpt2", "plain"), ("llama", "llama3")])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_match_naive(arch, style, temperature):
    tok = tiny_tokenizer(style)
    model = tiny_model(arch, tok)
    batch = batch_of(make_rollouts(2, 2) + [multi_turn_rollout()], tok)  # padded rows
    out = token_logprobs(model, batch, temperature=temperature, chunk_size=7, return_entropy=True)
    ref, ref_ent = naive_logprobs(model, batch, temperature, entropy=True)
    am = batch.attention_mask.clone()
    am[:, 0] = 0
    torch.testing.assert_close(out.logprobs.double(), ref * am, rtol=0, atol=2e-5)
    torch.testing.assert_close(out.entropy.double(), ref_ent * am, rtol=0, atol=2e-5)
    assert out.logprobs.shape == batch.input_ids.shape
    assert torch.all(out.logprobs[:, 0] == 0)
    assert torch.all(out.logprobs[batch.attention_mask == 0] == 0)


def test_positions_and_param_gradients_match_naive(qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    batch = batch_of(make_rollouts(1, 2) + [multi_turn_rollout()], tok)
    mask = batch.loss_mask.clone()
    mask[:, 0] = 0
    weights = torch.randn(batch.input_ids.shape)
    lp = token_logprobs(model, batch, temperature=0.8, chunk_size=5, positions=mask)
    assert torch.all(lp[mask == 0] == 0)
    (lp * weights).sum().backward()
    mine = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = naive_logprobs(model, batch, 0.8)
    (ref * mask * weights.double()).sum().backward()
    torch.testing.assert_close(lp.double(), ref * mask, rtol=0, atol=2e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(mine[n], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_peft_model_and_lora_on_lm_head(chatml_tokenizer):
    peft = pytest.importorskip("peft")
    tok = chatml_tokenizer
    model = tiny_model("qwen2", tok, seed=3)
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.0, init_lora_weights=False)
    pm = peft.get_peft_model(model, cfg)
    batch = batch_of(make_rollouts(1, 2), tok)
    lp = token_logprobs(pm, batch, chunk_size=4)  # lm_head is a LoRA module: checkpointed generic path
    ref = naive_logprobs(pm, batch)
    am = batch.attention_mask.clone()
    am[:, 0] = 0
    torch.testing.assert_close(lp.double(), ref * am, rtol=0, atol=2e-5)
    lp.sum().backward()
    lora_grads = [p.grad for n, p in pm.named_parameters() if "lora_" in n]
    assert lora_grads and all(g is not None and torch.isfinite(g).all() for g in lora_grads)
    assert any(g.abs().sum() > 0 for g in lora_grads)
    with pm.disable_adapter():
        base = token_logprobs(pm, batch)
    assert not torch.allclose(base, lp.detach())


class _MaxVocabTensor(TorchDispatchMode):
    """Records the largest freshly allocated tensor (not a view) whose last dimension is the vocabulary."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # e.g. the (H, V) transpose of the head's weight: no allocation
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab:
                self.largest = max(self.largest, t.numel())
        return out


def test_never_materializes_full_vocab_tensor(qwen2_model, chatml_tokenizer):
    """Forward + backward: no tensor with a vocab-sized last dim exceeds one chunk (naive would be B*T*V)."""
    model, tok = qwen2_model, chatml_tokenizer
    batch = batch_of(make_rollouts(2, 2), tok)
    B, T = batch.input_ids.shape
    V = model.get_output_embeddings().weight.shape[0]
    chunk = 8
    assert B * T > 4 * chunk
    with _MaxVocabTensor(V) as probe:
        token_logprobs(model, batch, chunk_size=chunk).sum().backward()
    assert 0 < probe.largest <= max(chunk, B) * V < B * T * V
    naive = _MaxVocabTensor(V)
    with naive:
        naive_logprobs(model, batch).sum().backward()
    assert naive.largest >= B * (T - 1) * V  # the probe does see the naive full tensor


def test_rejects_bad_arguments(qwen2_model, chatml_tokenizer):
    batch = batch_of(make_rollouts(1, 1), chatml_tokenizer)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(qwen2_model, batch, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(qwen2_model, batch, chunk_size=0)
    with pytest.raises(ValueError, match="positions"):
        token_logprobs(qwen2_model, batch, positions=batch.loss_mask[:, :-1])
