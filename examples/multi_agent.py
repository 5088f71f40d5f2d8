"""A two-agent debate on CPU where only agent A is trained.

Agents A and B (the same tiny policy, self-play) take turns on a question.
Each turn is sampled from the speaker's own view of the debate (its turns as
`assistant`, the other's as `user` messages "[B]: ..."), with the sampled ids
and log-probs kept. We then encode A's view, check that the loss mask covers
exactly A's sampled tokens (none of B's), check that the recomputed log-probs
match the sampled ones, and take one REINFORCE step written inline.

    uv run python examples/multi_agent.py [--num-debates 4 --rounds 2 --max-new-tokens 12]

Legend: B batch (debates), T tokens, V vocab.
"""

from __future__ import annotations

import argparse
import time

import torch

from SimpleTorchLLMRL import BoxedReward, Message, MessageType, Rollout, rollouts_to_batch
from SimpleTorchLLMRL.chat.tokenize import encode_prompt
from SimpleTorchLLMRL.env.multiagent import agent_turns, set_trainable_agents, take_turn, view_for_agent
from SimpleTorchLLMRL.model.dropout import disable_dropout
from SimpleTorchLLMRL.reward import CombinedReward, LengthPenalty
from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer

SYSTEM = "You are in a debate. Argue step by step and give the final answer in \\boxed{}."


def make_sampler(model, tokenizer, max_new_tokens: int, temperature: float):
    """respond(view) -> MODEL Message with the sampled ids and their log-probs (at `temperature`)."""

    @torch.no_grad()
    def respond(view: Rollout) -> Message:
        prompt = torch.tensor([encode_prompt(view, tokenizer)])  # (1, P)
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=temperature, top_k=0,
            max_new_tokens=max_new_tokens, return_dict_in_generate=True, output_logits=True,
        )
        new = out.sequences[0, prompt.shape[1]:]  # (N,)
        logits = torch.stack(out.logits, dim=1)[0].float() / temperature  # (N, V)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new[:, None])[:, 0]  # (N,)
        stopped = bool(len(new)) and int(new[-1]) == tokenizer.eos_token_id
        return Message(tokenizer.decode(new, skip_special_tokens=True), MessageType.MODEL,
                       token_ids=new.tolist(), logprobs=logprobs.tolist(), temperature=temperature,
                       finish_reason="stop" if stopped else "length")

    return respond


def token_logprobs(model, batch, temperature: float) -> torch.Tensor:
    """logp[:, t] = log p(input_ids[:, t] | input_ids[:, :t]) at `temperature`; column 0 is 0. (B, T)"""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()  # (B, T, V)
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)  # (B, T-1, V)
    taken = logp.gather(-1, batch.input_ids[:, 1:, None])[..., 0]  # (B, T-1)
    return torch.nn.functional.pad(taken, (1, 0))  # (B, T)


def main(num_debates: int = 4, rounds: int = 2, max_new_tokens: int = 12, temperature: float = 1.0,
         lr: float = 1e-2, seed: int = 0) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model gains nothing from threads; they only contend
    try:
        return _run(num_debates, rounds, max_new_tokens, temperature, lr, seed)
    finally:
        torch.set_num_threads(threads)


def _run(num_debates, rounds, max_new_tokens, temperature, lr, seed) -> dict:
    torch.manual_seed(seed)
    tok = tiny_tokenizer("chatml")
    model = disable_dropout(tiny_model("qwen2", tok, seed=seed))
    respond = make_sampler(model, tok, max_new_tokens, temperature)

    # 1. Debates: A, B, A, B, ... each sampled from the speaker's own view.
    debates = []
    for i in range(num_debates):
        d = Rollout([Message(SYSTEM, MessageType.SYSTEM), Message(f"Is {91 + 2 * i} a prime number?")],
                    metadata={"answer": "no"})
        for _ in range(rounds):
            take_turn(d, "A", respond)
            take_turn(d, "B", respond)
        debates.append(d)

    # 2. Shared transcript: mark only A's turns trainable; the mask holds exactly A's sampled ids.
    shared = [set_trainable_agents(d.copy(), {"A"}) for d in debates]
    batch_shared = rollouts_to_batch(shared, tok)
    for row, d in enumerate(shared):
        masked = batch_shared.input_ids[row][batch_shared.loss_mask[row].bool()].tolist()
        assert masked == [t for m in agent_turns(d, "A") for t in m.token_ids], "mask != A's sampled tokens"

    # 3. A's view (the context A was sampled under): train on it.
    views = [view_for_agent(d, "A") for d in debates]
    batch = rollouts_to_batch(views, tok)
    a_tokens = int(batch.loss_mask.sum())
    b_tokens = sum(len(m.token_ids) for d in debates for m in agent_turns(d, "B"))
    for row, d in enumerate(debates):
        masked = batch.input_ids[row][batch.loss_mask[row].bool()].tolist()
        assert masked == [t for m in agent_turns(d, "A") for t in m.token_ids]

    # 4. Rewards on A's final turn, REINFORCE with a mean baseline, one optimizer step.
    reward_fn = CombinedReward([(BoxedReward(), 1.0), (LengthPenalty(max_length=60, unit="chars"), 0.5)])
    rewards = reward_fn([Rollout(agent_turns(d, "A")) for d in debates], [d.metadata["answer"] for d in debates])
    advantages = rewards - rewards.mean()  # (B,)

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    mask = batch.loss_mask.float()  # (B, T)
    logp = token_logprobs(model, batch, temperature)  # (B, T)
    sampled = torch.nan_to_num(batch.sampler_logprobs, nan=0.0)  # (B, T)
    max_logprob_diff = float(((logp.detach() - sampled) * mask).abs().max())
    loss = -(advantages[:, None] * logp * mask).sum() / mask.sum()
    optimizer.zero_grad()
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    optimizer.step()
    with torch.no_grad():
        logp_after = token_logprobs(model, batch, temperature)
    # first-order check: the step raised the log-likelihood of A's tokens with positive advantage
    change = float(((logp_after - logp.detach()) * mask * advantages[:, None]).sum())

    return {
        "debates": num_debates, "a_tokens_in_mask": a_tokens, "b_tokens_sampled": b_tokens,
        "rewards": [round(x, 4) for x in rewards.tolist()], "components": {
            k: [round(x, 4) for x in v.tolist()] for k, v in reward_fn.last_components.items()},
        "loss": loss.item(), "grad_norm": grad_norm, "max_logprob_diff": max_logprob_diff,
        "advantage_weighted_logp_change": change,
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-debates", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=12)
    args = p.parse_args()
    t0 = time.perf_counter()
    out = main(args.num_debates, args.rounds, args.max_new_tokens)
    for k, v in out.items():
        print(f"{k:>32}: {v}")
    print(f"{'seconds':>32}: {time.perf_counter() - t0:.1f}")
