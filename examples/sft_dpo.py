"""SFT and DPO from rollouts on the embedded tiny model, on CPU, in two short loops.

SFT: hand-written demonstrations (system, question, a reply that boxes the right answer) are
rollouts; `SFT.calculate_loss` is the cross-entropy of their reply tokens. The held-out NLL of
such replies falls.

DPO: pairs of rollouts that share a question, the chosen reply boxing the right answer and the
rejected one a wrong answer; LoRA adapters train, the reference is the same model with the
adapter off (no second copy). The held-out preference accuracy (the policy's log-ratio to the
reference larger on the chosen reply) rises.

    uv run python examples/sft_dpo.py             # 30 steps each
    uv run python examples/sft_dpo.py --smoke     # 2 steps each (CI)
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from SimpleTorchLLMRL import Message, MessageType, Rollout
from SimpleTorchLLMRL.model.dropout import disable_dropout
from SimpleTorchLLMRL.model.lora import apply_lora
from SimpleTorchLLMRL.recipes.calculator.arithmetic import SYSTEM_PROMPT, build_dataset
from SimpleTorchLLMRL.testing.tiny import TINY_CALC
from SimpleTorchLLMRL.trainer.dpo import DPO
from SimpleTorchLLMRL.trainer.sft import SFT


def episode(row: dict, answer: str) -> Rollout:
    return Rollout([Message(SYSTEM_PROMPT, MessageType.SYSTEM), Message(row["question"]),
                    Message(f"The answer is \\boxed{{{answer}}}.", MessageType.MODEL)])


def wrong(answer: str) -> str:
    return str(int(answer) + 10)


def run_sft(tokenizer, train, held_out, steps: int, batch: int) -> tuple[float, float]:
    model = AutoModelForCausalLM.from_pretrained(TINY_CALC, dtype=torch.float32)
    disable_dropout(model)
    sft = SFT(model, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    demos = [episode(r, r["answer"]) for r in held_out]
    with torch.no_grad():
        before = float(sft.calculate_loss(demos))
    for step in range(steps):
        rows = train[step * batch: (step + 1) * batch]
        loss = sft.calculate_loss([episode(r, r["answer"]) for r in rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        after = float(sft.calculate_loss(demos))
    print(f"SFT: held-out reply NLL per token {before:.3f} -> {after:.3f} after {steps} steps")
    return before, after


def preference_accuracy(dpo: DPO, pairs) -> float:
    with torch.no_grad():
        dpo.calculate_loss(*pairs)
    return float(dpo.metrics["reward_accuracy"])


def run_dpo(tokenizer, train, held_out, steps: int, batch: int) -> tuple[float, float]:
    model = apply_lora(AutoModelForCausalLM.from_pretrained(TINY_CALC, dtype=torch.float32), r=8, alpha=16)
    disable_dropout(model)
    dpo = DPO(model, tokenizer, beta=0.1, variant="sigmoid")  # reference: the adapter turned off
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    test = ([episode(r, r["answer"]) for r in held_out], [episode(r, wrong(r["answer"])) for r in held_out])
    # a fresh adapter is the reference itself: every margin is 0, so accuracy starts at 0
    before = preference_accuracy(dpo, test)
    for step in range(steps):
        rows = train[step * batch: (step + 1) * batch]
        loss = dpo.calculate_loss([episode(r, r["answer"]) for r in rows], [episode(r, wrong(r["answer"])) for r in rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = preference_accuracy(dpo, test)
    print(f"DPO: held-out preference accuracy {before:.3f} -> {after:.3f} after {steps} steps "
          f"(reward margin {float(dpo.metrics['reward_margin']):.3f})")
    return before, after


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eval-size", type=int, default=32)
    p.add_argument("--smoke", action="store_true", help="2 steps of 2, 4 held-out rows")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.batch_size, args.eval_size = 2, 2, 4
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(TINY_CALC)
    train = build_dataset(args.steps * args.batch_size, seed=0, split="train")
    held_out = build_dataset(args.eval_size, seed=1, split="test")
    return {"sft": run_sft(tokenizer, train, held_out, args.steps, args.batch_size),
            "dpo": run_dpo(tokenizer, train, held_out, args.steps, args.batch_size)}


if __name__ == "__main__":
    main()
