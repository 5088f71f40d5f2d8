"""GRPO with FSDP2 over N processes (torchrun); each rank samples and trains on its own whole groups.

    # one machine, 2 processes (CPU + gloo here; one GPU per process + nccl when CUDA is available)
    uv run torchrun --nproc_per_node=2 examples/fsdp_grpo.py --steps 3
    uv run torchrun --nproc_per_node=2 examples/fsdp_grpo.py --lora --steps 3

    # two machines with 8 GPUs each: run on every node, NODE_RANK 0 and 1, MASTER_ADDR = node 0
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK \\
        --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 --rdzv_id=grpo \\
        examples/fsdp_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --lora --mixed-precision bf16

Without --model the policy is a random tiny Qwen2 (`SimpleTorchLLMRL.testing.tiny`): it shows
the mechanics (sharded generation, the global normalizer, gathering weights), not
learning. The loop is the plain one from the README; the distributed parts are
`init_distributed`, `wrap_fsdp2`, `data_parallel_normalizer` and `full_state_dict`.

Each rank prints torch's warning "FSDP2-wrapped module (FSDPQwen2ForCausalLM) returned a view
tensor ... wrong gradients" once. It is about `hidden_states[0]`, the embedding output, which
FSDP2 hands back as a view of the all-gathered embedding; the loss reads only the final hidden
state (`hidden_states[-1]`, not a view) and nothing here modifies any output in place, so the
hazard it warns of (an in-place op dropping the pre-backward hook) cannot happen. Gradients are
checked against an unsharded run in tests/distributed/test_fsdp.py.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from SimpleTorchLLMRL import GRPO, BoxedReward, ModelGenerate, collect_rollouts
from SimpleTorchLLMRL.distributed import (
    all_reduce_sum,
    allocate_gather_buffers,
    cleanup,
    data_parallel_normalizer,
    full_state_dict,
    init_distributed,
    shard_indices,
    sharded_parameters,
    wrap_fsdp2,
)
from SimpleTorchLLMRL.env import QASolverEnv
from SimpleTorchLLMRL.model.dropout import disable_dropout
from SimpleTorchLLMRL.model.generation.weight_sync import export_adapter
from SimpleTorchLLMRL.model.lora import apply_lora
from SimpleTorchLLMRL.recipes.calculator.arithmetic import build_dataset
from SimpleTorchLLMRL.reward import CombinedReward, LengthPenalty


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model id or path (default: a random tiny Qwen2)")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (r=16, all linear layers)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--questions", type=int, default=4, help="questions per step, over all ranks")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--mixed-precision", default=None, help="bf16 | fp16 (FSDP2 MixedPrecisionPolicy)")
    p.add_argument("--save", default=None, help="directory for the final weights (adapter with --lora)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_policy(args, device):
    if args.model is None:
        from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer

        tokenizer = tiny_tokenizer("chatml")
        model = tiny_model("qwen2", tokenizer, seed=args.seed)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model = model.to(device).train()
    if args.lora:
        model = apply_lora(model, r=16, alpha=32)
    return model, tokenizer


def main(argv=None) -> None:
    args = parse_args(argv)
    info = init_distributed()
    if args.questions < info.world_size:
        raise ValueError(f"--questions must be >= the number of processes ({info.world_size}): every rank "
                         "needs a group to sample, since generation on sharded weights is collective")
    torch.manual_seed(args.seed)  # every rank builds the same initial weights before sharding
    model, tokenizer = load_policy(args, info.device)
    wrap_fsdp2(model, mixed_precision=args.mixed_precision)
    optimizer = torch.optim.AdamW(sharded_parameters(model), lr=args.lr)  # the DTensor shards
    allocate_gather_buffers(model)  # before sampling under torch.inference_mode (see its docstring)
    generator = ModelGenerate(model, tokenizer, max_new_tokens=args.max_new_tokens, temperature=1.0,
                              seed=args.seed + info.rank)  # different samples on every rank
    disable_dropout(model)  # exact on-policy ratios
    grpo = GRPO(model, tokenizer, group_size=args.group_size)
    # correctness, plus a small length penalty so that even a random policy sees different rewards
    env = QASolverEnv()
    reward_fn = CombinedReward([(BoxedReward(), 1.0),
                                (LengthPenalty(max_length=args.max_new_tokens, penalty=0.2), 1.0)])
    rows = build_dataset(args.questions * args.steps, seed=args.seed, split="train")
    if info.is_main:
        print(f"world_size={info.world_size} device={info.device} lora={args.lora} "
              f"trainable={sum(p.numel() for p in model.parameters() if p.requires_grad)}")

    for step in range(args.steps):
        t0 = time.time()
        batch_rows = rows[step * args.questions: (step + 1) * args.questions]
        mine = [batch_rows[i] for i in shard_indices(len(batch_rows))]  # whole groups stay on one rank
        questions, answers = [r["question"] for r in mine], [r["answer"] for r in mine]
        # sampling on sharded weights: every rank runs the same number of forwards (HF generate syncs
        # the ranks for FSDP-managed modules), so ranks with fewer questions still take part
        rollouts = collect_rollouts(generator, env, questions, answers, group_size=args.group_size)
        rewards = reward_fn(rollouts, [a for a in answers for _ in range(args.group_size)])
        norm = data_parallel_normalizer(grpo.normalizer_for(rollouts))
        loss = grpo.calculate_loss(rollouts, rewards, normalizer=norm)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(optimizer.param_groups[0]["params"], 1.0)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # a DTensor
        optimizer.step()
        optimizer.zero_grad()
        global_loss = all_reduce_sum(loss.detach()) / info.world_size
        mean_reward = all_reduce_sum(rewards.sum()) / all_reduce_sum(float(len(rewards)))
        if info.is_main:
            print(f"step {step}: loss {global_loss.item():+.4f} reward {mean_reward.item():.3f} "
                  f"grad_norm {grad_norm.item():.3f} clip_frac {grpo.metrics.get('clip_frac', 0.0):.3f} ({time.time() - t0:.1f}s)", flush=True)

    if args.save:  # collectives: every rank gathers, rank 0 writes
        if args.lora:
            export_adapter(model, args.save)
        else:
            state = full_state_dict(model)
            if info.is_main:
                model.save_pretrained(args.save, state_dict=state)
        if info.is_main:
            tokenizer.save_pretrained(args.save)
            print(f"saved to {os.path.abspath(args.save)}")
    cleanup()


if __name__ == "__main__":
    main()
