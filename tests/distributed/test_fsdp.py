"""FSDP2 on CPU with gloo: a 2-process GRPO step equals one process on the same global batch.

The test launches this file with `torchrun --nproc_per_node=2`; each rank takes
half of the GRPO groups, wraps the model with `wrap_fsdp2`, and rank 0 also runs
the unsharded reference step on the whole batch. Rank 0 saves both results and
the test compares losses and every updated weight. Also: helpers that need no
process group (shard_indices, transformer_blocks, argument checks).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig

GROUP, GROUPS, LR = 2, 4, 0.5  # 8 rollouts in 4 groups of 2; SGD so an update is lr * grad exactly


# ---------------------------------------------------------------- the worker (runs under torchrun)


def make_rollouts(tokenizer, seed: int = 0):
    """GROUPS groups of GROUP rollouts with sampled ids and (off-policy) sampled log-probs, plus rewards."""
    from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout

    g = torch.Generator().manual_seed(seed)
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}  # a decode drops them
    plain = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    rollouts = []
    for k in range(GROUPS):
        for _ in range(GROUP):
            n = int(torch.randint(3, 9, (1,), generator=g))
            ids = plain[torch.randint(len(plain), (n,), generator=g)].tolist()
            lps = (-5.7 - 0.8 * torch.rand(n, generator=g)).tolist()  # ratios around 1, some clipped
            r = Rollout([Message(f"What is {k} + {k}?"),
                         Message(tokenizer.decode(ids), MessageType.MODEL, token_ids=ids, logprobs=lps,
                                 temperature=1.0)], metadata={"group_id": k})
            rollouts.append(r)
    rewards = torch.rand(len(rollouts), generator=g)
    return rollouts, rewards


def grpo_step(model, tokenizer, rollouts, rewards, *, beta: float, loss_type: str, normalizer=None, params=None):
    """One GRPO loss + SGD step; returns the loss (a tensor)."""
    from SimpleTorchLLMRL.trainer.grpo import GRPO

    grpo = GRPO(model, tokenizer, beta=beta, group_size=GROUP, loss_type=loss_type)
    params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR)
    loss = grpo.calculate_loss(rollouts, rewards, normalizer=normalizer)
    loss.backward()
    opt.step()
    return loss.detach()


def generate(model, tokenizer, prompts):
    """Greedy replies: (token ids, log-probs) per prompt."""
    from SimpleTorchLLMRL.model.generation.generator import ModelGenerate

    gen = ModelGenerate(model, tokenizer, sampling=SamplingConfig(max_new_tokens=6, do_sample=False))
    return [(m.token_ids, m.logprobs) for (m,) in gen.generate(prompts)]


def build(variant: str, tokenizer):
    from SimpleTorchLLMRL.model.lora import apply_lora
    from SimpleTorchLLMRL.testing.tiny import tiny_model

    model = tiny_model("qwen2", tokenizer).train()  # tied embeddings: the root group shares one tensor
    if variant == "lora":  # random B so both LoRA halves get gradients in the first step
        model = apply_lora(model, r=4, alpha=8, init_lora_weights=False)
    return model


def _worker(out_path: str) -> None:
    from torch.distributed.tensor import DTensor

    from SimpleTorchLLMRL.chat.message import Message, Rollout
    from SimpleTorchLLMRL.distributed.fsdp import (
        allocate_gather_buffers,
        full_state_dict,
        sharded_parameters,
        wrap_fsdp2,
    )
    from SimpleTorchLLMRL.distributed.launch import (
        all_reduce_sum,
        cleanup,
        data_parallel_normalizer,
        init_distributed,
        shard_indices,
    )
    from SimpleTorchLLMRL.model.generation.weight_sync import adapter_weights, export_adapter, vllm_weights
    from SimpleTorchLLMRL.testing.tiny import tiny_tokenizer
    from SimpleTorchLLMRL.trainer.grpo import GRPO

    torch.set_num_threads(1)
    info = init_distributed(backend="gloo", device="cpu")
    tok = tiny_tokenizer("chatml")
    rollouts, rewards = make_rollouts(tok)
    groups = shard_indices(GROUPS, info.rank, info.world_size)  # whole groups per rank
    rows = range(groups.start * GROUP, groups.stop * GROUP)
    mine, my_rewards = [rollouts[i] for i in rows], rewards[rows.start: rows.stop]
    results = {}
    # full: token-mean loss (ranks hold different token counts, so the normalizer must be global);
    # lora: per-sequence mean with a KL term whose reference is the disabled adapter.
    for variant, beta, loss_type in (("full", 0.0, "bnpo"), ("lora", 0.1, "grpo")):
        model = build(variant, tok)
        init = {k: v.clone() for k, v in model.state_dict().items()}
        prompts = [Rollout([Message(f"Question {info.rank}.{i}")]) for i in range(2 + info.rank)]  # uneven
        if info.is_main:
            ref = copy.deepcopy(model)
            ref_gen = generate(ref, tok, prompts)
            ref_loss = grpo_step(ref, tok, rollouts, rewards, beta=beta, loss_type=loss_type)
        wrap_fsdp2(model)
        allocate_gather_buffers(model)
        fsdp_gen = generate(model, tok, prompts)  # sampling on shards (inference mode), then training
        params = sharded_parameters(model)  # after a forward the root group is gathered: reshard first
        if not all(isinstance(p, DTensor) for p in params):
            raise AssertionError("sharded_parameters returned full tensors")
        local_norm = GRPO(model, tok, group_size=GROUP, loss_type=loss_type).normalizer_for(mine)
        norm = data_parallel_normalizer(local_norm)
        loss = grpo_step(model, tok, mine, my_rewards, beta=beta, loss_type=loss_type, normalizer=norm,
                         params=params)
        global_loss = all_reduce_sum(loss) / info.world_size
        sd = full_state_dict(model)
        pushed = vllm_weights(model)  # collectives: gathered to rank 0
        adapter_dir = os.path.join(os.path.dirname(out_path), "adapter") if variant == "lora" else None
        if adapter_dir:
            export_adapter(model, adapter_dir)
        if info.is_main:
            results[variant] = dict(ref_loss=ref_loss, loss=global_loss, rank_loss=loss, init=init,
                                    ref=copy.deepcopy(ref.state_dict()), fsdp=sd, num_rows=len(mine),
                                    local_norm=local_norm, norm=norm, pushed=pushed,
                                    ref_pushed=vllm_weights(ref), gen=fsdp_gen, ref_gen=ref_gen)
            if adapter_dir:
                results[variant]["adapter_dir"] = adapter_dir
                results[variant]["ref_adapter"] = adapter_weights(ref)
        elif pushed or sd:
            raise AssertionError("non-zero ranks should receive no gathered tensors")
    if info.is_main:
        torch.save(results, out_path)
    cleanup()


# ---------------------------------------------------------------- the tests (pytest process)


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "results.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.abspath(__file__), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("variant", ["full", "lora"])
def test_fsdp2_grpo_step_matches_single_process(two_rank_results, variant):
    r = two_rank_results[variant]
    assert r["num_rows"] == GROUP * GROUPS // 2
    if variant == "full":  # token counts differ between ranks: a rank-local normalizer would be wrong
        assert r["norm"] != r["local_norm"]
    # the global loss is the mean of the rank losses and equals the single-process loss
    assert torch.allclose(r["loss"], r["ref_loss"], atol=1e-6, rtol=1e-5), (r["loss"], r["ref_loss"])
    assert not torch.allclose(r["rank_loss"], r["ref_loss"], atol=1e-4)  # each rank saw only half
    ref, fsdp, init = r["ref"], r["fsdp"], r["init"]
    assert list(fsdp) == list(ref)  # same names (peft prefixes kept), same order
    moved, worst = 0.0, 0.0
    for name, w in ref.items():
        assert fsdp[name].shape == w.shape and fsdp[name].dtype == w.dtype, name
        worst = max(worst, (fsdp[name] - w).abs().max().item())
        moved = max(moved, (w - init[name]).abs().max().item())
    assert moved > 1e-3  # the step really changed weights ...
    assert worst < 1e-6, f"FSDP2 and single-process weights differ by {worst}"  # ... identically
    if variant == "lora":  # only adapters moved, in both runs
        for name, w in fsdp.items():
            if "lora_" not in name:
                assert torch.equal(w, init[name]), name


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("variant", ["full", "lora"])
def test_generation_on_fsdp2_shards_matches_single_process(two_rank_results, variant):
    """HF generation on the sharded model (ranks with different prompt counts stay in step)."""
    r = two_rank_results[variant]
    assert len(r["gen"]) == len(r["ref_gen"]) == 2
    for (ids, lps), (ref_ids, ref_lps) in zip(r["gen"], r["ref_gen"], strict=True):
        assert ids == ref_ids and len(ids) > 0
        assert torch.allclose(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-5)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("variant", ["full", "lora"])
def test_weight_sync_from_fsdp2(two_rank_results, variant, chatml_tokenizer):
    """vllm_weights / export_adapter gather from the shards: base names and shapes, the reference's values."""
    from safetensors.torch import load_file

    from SimpleTorchLLMRL.testing.tiny import tiny_model

    r = two_rank_results[variant]
    base = tiny_model("qwen2", chatml_tokenizer).state_dict()
    pushed, ref_pushed = r["pushed"], r["ref_pushed"]
    assert {k: v.shape for k, v in pushed.items()} == {k: v.shape for k, v in base.items()}
    assert max((pushed[k] - ref_pushed[k]).abs().max().item() for k in base) < 1e-6
    if variant == "lora":
        saved = load_file(os.path.join(r["adapter_dir"], "adapter_model.safetensors"))
        assert sorted(saved) == sorted(r["ref_adapter"])
        assert max((saved[k] - r["ref_adapter"][k]).abs().max().item() for k in saved) < 1e-6


def test_shard_indices_partition():
    from SimpleTorchLLMRL.distributed.launch import shard_indices

    for n in (0, 1, 5, 8, 13):
        for world in (1, 2, 3, 4):
            parts = [shard_indices(n, r, world) for r in range(world)]
            assert [i for p in parts for i in p] == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError, match="rank"):
        shard_indices(4, 2, 2)


def test_single_process_defaults(monkeypatch):
    from SimpleTorchLLMRL.distributed import launch

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    info = launch.init_distributed(device="cpu")
    assert (info.rank, info.world_size, info.local_rank, info.device.type) == (0, 1, 0, "cpu")
    assert launch.data_parallel_normalizer(7.0) == 7.0
    assert launch.all_reduce_sum(3.0).item() == 3.0
    with pytest.raises(ValueError, match="backend"):
        launch.init_distributed(backend="mpi")
    with pytest.raises(ValueError, match="nccl"):
        launch.init_distributed(backend="nccl", device="cpu")


def test_transformer_blocks_and_checks(chatml_tokenizer, plain_tokenizer):
    from SimpleTorchLLMRL.distributed.fsdp import mixed_precision_policy, transformer_blocks, wrap_fsdp2
    from SimpleTorchLLMRL.model.lora import apply_lora
    from SimpleTorchLLMRL.testing.tiny import tiny_model

    qwen = tiny_model("qwen2", chatml_tokenizer, num_layers=3)
    blocks = transformer_blocks(qwen)
    assert blocks == list(qwen.model.layers)
    peft_blocks = transformer_blocks(apply_lora(qwen, r=2))
    assert [type(b).__name__ for b in peft_blocks] == ["Qwen2DecoderLayer"] * 3
    gpt2 = tiny_model("gpt2", plain_tokenizer)
    assert transformer_blocks(gpt2) == list(gpt2.transformer.h)
    assert mixed_precision_policy("bf16").param_dtype == torch.bfloat16
    assert mixed_precision_policy(None) is None
    with pytest.raises(ValueError, match="mixed_precision"):
        mixed_precision_policy("int8")
    with pytest.raises(RuntimeError, match="init_distributed"):
        wrap_fsdp2(tiny_model("qwen2", chatml_tokenizer))


if __name__ == "__main__":
    _worker(sys.argv[1])
