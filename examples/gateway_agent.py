"""GRPO on an agent written only against the OpenAI SDK, through the recording gateway (CPU, about a minute).

The agent (`solve`) knows nothing of this library: it calls `client.chat.completions.create`
with a calculator tool, runs the tool calls it gets back, and stops at a final answer. The
gateway serves the embedded tiny model behind the OpenAI API and records each episode (one
API key per episode) as a `Rollout` with the exact ids and log-probs it sampled; GRPO then
trains on those. The HF backend samples with the live model, so each step's episodes come
from the weights the previous step left.

    uv run python examples/gateway_agent.py                 # 20 steps of 8 questions x 4 episodes
    uv run python examples/gateway_agent.py --steps 3       # a quick look
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor

import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from SimpleTorchLLMRL import GRPO, BoxedReward, ModelGenerate
from SimpleTorchLLMRL.gateway import Gateway
from SimpleTorchLLMRL.recipes.calculator.arithmetic import CALCULATOR_SCHEMA, SYSTEM_PROMPT, build_dataset
from SimpleTorchLLMRL.testing.tiny import TINY_CALC
from SimpleTorchLLMRL.tools import CalculatorError, evaluate

# ----------------------------------------------------------------------------- the agent: OpenAI SDK only


def calculator(expression: str) -> str:
    try:
        return str(evaluate(expression))
    except CalculatorError as e:
        return f"Error: {e}"


def solve(base_url: str, episode: str, question: str, max_turns: int = 2) -> str:
    """An ordinary tool-calling agent loop; returns its final answer text."""
    client = OpenAI(base_url=base_url, api_key=episode)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_SCHEMA],
                                               max_tokens=40, temperature=1.0).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return reply.content or ""
        for call in reply.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculator(str(args.get("expression", "")))})
    return messages[-1].get("content") or ""


# ----------------------------------------------------------------------------- training through the gateway


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--questions", type=int, default=8, help="questions per step")
    ap.add_argument("--group-size", type=int, default=4, help="episodes per question (one GRPO group)")
    ap.add_argument("--lr", type=float, default=3e-4)
    a = ap.parse_args()

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY_CALC)
    tokenizer = AutoTokenizer.from_pretrained(TINY_CALC, padding_side="left")
    generator = ModelGenerate(model, tokenizer, max_new_tokens=40, temperature=1.0,
                              tool_call_stop=["</tool_call>"], seed=0)
    gateway = Gateway(generator, window=0.05)
    grpo = GRPO(model, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr)
    reward_fn = BoxedReward()
    rows = build_dataset(a.steps * a.questions, seed=1)
    history = []

    with gateway.serve() as url, ThreadPoolExecutor(a.questions * a.group_size) as pool:
        for step in range(a.steps):
            batch = rows[step * a.questions: (step + 1) * a.questions]
            episodes = [(f"step{step}-q{q}-e{e}", q) for q in range(len(batch)) for e in range(a.group_size)]
            model.eval()
            asked = [batch[q]["question"] for _, q in episodes]
            list(pool.map(solve, [url] * len(episodes), [name for name, _ in episodes], asked))
            rollouts, answers = [], []
            for name, q in episodes:  # one reward per episode, given to each of its rollouts
                for r in gateway.clear(name):
                    r.metadata["group_id"] = q
                    rollouts.append(r)
                    answers.append(batch[q]["answer"])
            rewards = reward_fn(rollouts, answers)  # the final MODEL turn's \boxed{} answer
            model.train()
            loss = grpo.calculate_loss(rollouts, rewards)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            generator.policy_version += 1  # the next episodes come from the updated weights
            turns = sum(m.token_ids is not None for r in rollouts for m in r) / len(rollouts)
            print(f"step {step}: reward {rewards.mean():.3f} over {len(rollouts)} rollouts, "
                  f"{turns:.2f} sampled turns each, batches {list(gateway.batcher.batches)[-4:]}", flush=True)
            gateway.batcher.batches.clear()
            history.append(float(rewards.mean()))
    k = max(1, min(4, len(history) // 2))
    print(f"mean reward: first {k} steps {sum(history[:k]) / k:.3f}, last {k} steps {sum(history[-k:]) / k:.3f}")


if __name__ == "__main__":
    main()
