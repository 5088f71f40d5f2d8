"""An OpenAI Agents SDK agent, unmodified, producing training rollouts through the gateway (CPU, seconds).

The agent is plain `agents` code: an `Agent` with a function tool, run by `Runner`. The only
change for training is where its model lives: an `AsyncOpenAI` client pointed at the gateway,
with the API key naming the episode. The gateway records each episode as `Rollout`s carrying
the exact sampled ids; GRPO could train on them as in `examples/gateway_agent.py`.

    uv run python examples/gateway_agents_sdk.py
"""

from __future__ import annotations

import asyncio

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from SimpleTorchLLMRL import ModelGenerate, encode_rollout
from SimpleTorchLLMRL.gateway import Gateway
from SimpleTorchLLMRL.recipes.calculator.arithmetic import SYSTEM_PROMPT
from SimpleTorchLLMRL.testing.tiny import TINY_CALC
from SimpleTorchLLMRL.tools import CalculatorError, evaluate


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses."""
    try:
        return str(evaluate(expression))
    except CalculatorError as e:
        return f"Error: {e}"


async def run_episode(base_url: str, episode: str, question: str) -> str:
    client = AsyncOpenAI(base_url=base_url, api_key=episode)
    agent = Agent(name="solver", instructions=SYSTEM_PROMPT, tools=[calculator],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    try:
        result = await Runner.run(agent, question, max_turns=3)
        return str(result.final_output)
    except Exception as e:  # noqa: BLE001  (a tiny model may run out of turns: the episode is still recorded)
        return f"<{type(e).__name__}>"
    finally:
        await client.close()


def main() -> list:
    set_tracing_disabled(True)  # nothing leaves this machine
    model = AutoModelForCausalLM.from_pretrained(TINY_CALC).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY_CALC, padding_side="left")
    generator = ModelGenerate(model, tokenizer, max_new_tokens=40, temperature=1.0,
                              tool_call_stop=["</tool_call>"], seed=0)
    gateway = Gateway(generator)
    questions = ["What is 645 * 49?", "What is 312 * 17?", "What is 905 - 78?"]
    with gateway.serve() as url:
        async def all_episodes():
            return await asyncio.gather(*(run_episode(url, f"agents-{i}", q) for i, q in enumerate(questions)))

        answers = asyncio.run(all_episodes())
    rollouts = []
    for i, (q, answer) in enumerate(zip(questions, answers, strict=True)):
        for r in gateway.rollouts(f"agents-{i}"):
            enc = encode_rollout(r, tokenizer)
            turns = [m for m in r if m.token_ids is not None]
            print(f"{q} -> {answer!r}: {len(r)} messages, {len(turns)} sampled turns, "
                  f"{sum(enc.loss_mask)} trained tokens of {len(enc.input_ids)}")
            rollouts.append(r)
    return rollouts


if __name__ == "__main__":
    main()
