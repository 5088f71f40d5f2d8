"""The paths CUDA takes (`head_impl="gpu"` and `"triton"`), run on CPU: every loss variant against float64,
micro-batches, LoRA and full, PPO, and a bf16 model within a stated bound.

The "triton" kernels run on a CPU only in Triton's interpreter, which is chosen when Triton is first
imported; `test_the_triton_kernels_in_the_interpreter` runs this file and test_logprobs.py again in a
process started with TRITON_INTERPRET=1, where the cases named "triton" run instead of being left out.
"""

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from SimpleTorchLLMRL.model.scoring import head_triton
from SimpleTorchLLMRL.trainer.grpo import GRPO
from SimpleTorchLLMRL.trainer.ppo import PPO
from tests.support.losses_helpers import (
    assert_grads_close,
    batch_of,
    grads,
    make_rollouts,
    naive_logprobs,
    perturbed_copy,
    trained_positions,
    with_sampled_logprobs,
)
from tests.trainer.test_grpo import REWARDS, _naive_adv, _naive_loss

BF16_LOSS_ATOL = 1e-3  # measured 1.4e-5 (loss 0.054) on the tiny Qwen2 in bf16 against its float64 copy
BF16_GRAD_RTOL = 0.03  # of each tensor's largest gradient entry; measured 0.0097
DEVICE_KERNELS = ["gpu"] + (["triton"] if head_triton.interpreting() else [])


def _naive(model, ref_model, rollouts, tok, loss_type):
    batch = batch_of(rollouts, tok)
    with torch.no_grad():
        ref_lp = naive_logprobs(ref_model, batch)
    lp = naive_logprobs(model, batch)
    hi = 0.28 if loss_type == "dapo" else 0.2
    return _naive_loss(lp, batch.sampler_logprobs, _naive_adv(REWARDS, 3), trained_positions(batch), loss_type,
                       hi=hi, beta=0.1, ref=ref_lp, max_tokens=40)


@pytest.mark.parametrize("impl", DEVICE_KERNELS)
@pytest.mark.parametrize("micro", [None, 2])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_every_variant_on_the_gpu_kernel_matches_float64(loss_type, fused, micro, impl, qwen2_model,
                                                         chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    ref_model = perturbed_copy(model)
    rollouts = with_sampled_logprobs(make_rollouts(2, 3), model, tok, temperature=1.0, shift=0.3)
    grpo = GRPO(model, tok, beta=0.1, ref_model=ref_model, loss_type=loss_type, group_size=3, max_tokens=40,
                fused=fused, head_impl=impl, chunk_size=5)
    prepared = grpo.prepare(rollouts, REWARDS)
    if micro is None:
        loss = grpo.calculate_loss(prepared)
        loss.backward()
    else:
        loss = sum(grpo.compute(mb).loss for mb in prepared.split(micro))
        loss.backward()
    mine = grads(model)
    model.zero_grad()
    naive = _naive(model, ref_model, rollouts, tok, loss_type)
    naive.backward()
    torch.testing.assert_close(loss.double(), naive, rtol=1e-4, atol=1e-6)
    assert_grads_close(mine, grads(model))
    model.zero_grad()


@pytest.mark.parametrize("impl", DEVICE_KERNELS)
def test_lora_on_the_gpu_kernel_matches_the_cpu_kernel_and_float64(impl, qwen2_model, chatml_tokenizer):
    from SimpleTorchLLMRL.model.lora import apply_lora

    tok = chatml_tokenizer
    model = apply_lora(copy.deepcopy(qwen2_model), r=4, alpha=8, init_lora_weights=False)  # frozen head
    rollouts = with_sampled_logprobs(make_rollouts(2, 3), model, tok, temperature=1.0, shift=0.3)
    out = {}
    for kernel in ("cpu", impl):
        grpo = GRPO(model, tok, beta=0.1, group_size=3, head_impl=kernel, fused=False)  # reference: adapter off
        loss = grpo.calculate_loss(rollouts, REWARDS)
        loss.backward()
        out[kernel] = (loss.detach(), grads(model))
        model.zero_grad()
    torch.testing.assert_close(out[impl][0], out["cpu"][0], rtol=1e-5, atol=1e-7)
    assert_grads_close(out[impl][1], out["cpu"][1], rtol=1e-5, atol=1e-7)
    batch = batch_of(rollouts, tok)
    with torch.no_grad(), model.disable_adapter():
        ref_lp = naive_logprobs(model, batch)
    naive = _naive_loss(naive_logprobs(model, batch), batch.sampler_logprobs, _naive_adv(REWARDS, 3),
                        trained_positions(batch), "grpo", beta=0.1, ref=ref_lp)
    torch.testing.assert_close(out[impl][0].double(), naive, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("impl", DEVICE_KERNELS)
def test_ppo_on_the_gpu_kernel_matches_the_cpu_kernel(impl, qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    rollouts = with_sampled_logprobs(make_rollouts(2, 3), model, tok, temperature=1.0, shift=0.3)
    out = {}
    for kernel in ("cpu", impl):
        torch.manual_seed(0)
        ppo = PPO(model, tok, beta=0.05, ref_model=perturbed_copy(model), head_impl=kernel)
        loss = sum(ppo.compute(mb).loss for mb in ppo.prepare(rollouts, REWARDS).split(4))
        loss.backward()
        out[kernel] = (loss.detach(), grads(model))
        model.zero_grad()
    torch.testing.assert_close(out[impl][0], out["cpu"][0], rtol=1e-5, atol=1e-7)
    assert_grads_close(out[impl][1], out["cpu"][1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("impl", DEVICE_KERNELS)
def test_a_bf16_model_on_the_gpu_kernel_is_within_the_stated_bound(impl, qwen2_model, chatml_tokenizer):
    """The GPU setting: the whole model in bf16. Against a float64 copy of the same bf16 weights."""
    tok = chatml_tokenizer
    low = copy.deepcopy(qwen2_model).to(torch.bfloat16)
    high = copy.deepcopy(low).to(torch.float64)
    rollouts = with_sampled_logprobs(make_rollouts(2, 3), copy.deepcopy(low).float(), tok, temperature=1.0,
                                     shift=0.3)
    grpo = GRPO(low, tok, group_size=3, head_impl=impl)
    loss = grpo.calculate_loss(rollouts, REWARDS)
    loss.backward()
    mine = {k: v.double() for k, v in grads(low).items()}
    batch = batch_of(rollouts, tok)
    naive = _naive_loss(naive_logprobs(high, batch), batch.sampler_logprobs, _naive_adv(REWARDS, 3),
                        trained_positions(batch), "grpo")
    naive.backward()
    want = grads(high)
    assert abs(float(loss) - float(naive)) <= BF16_LOSS_ATOL
    for name, g in want.items():
        assert (mine[name] - g).abs().max() <= BF16_GRAD_RTOL * g.abs().max() + 1e-6, name


@pytest.mark.skipif(head_triton.interpreting() or not head_triton.available(),
                    reason="runs the interpreted cases in a child process; needs triton, and not from inside one")
def test_the_triton_kernels_in_the_interpreter():
    """The "triton" cases of this file, test_logprobs.py and test_truncation.py, in a process where Triton
    interprets on CPU."""
    tests = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    files = [tests / "model" / "test_logprobs.py", Path(__file__).resolve(), tests / "model" / "test_truncation.py"]
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton and not interpreter",
                        *map(str, files)], capture_output=True, text=True, env=env, cwd=tests.parent, timeout=900)
    tail = p.stdout[-3000:] + p.stderr[-2000:]
    assert p.returncode == 0, tail
    passed = re.search(r"(\d+) passed", p.stdout)
    # every loss variant, LoRA, PPO, bf16, the head itself (39); truncated scoring on every Triton path (11)
    assert passed and int(passed.group(1)) >= 39 + 11, tail
    assert "skipped" not in p.stdout.splitlines()[-1], tail
