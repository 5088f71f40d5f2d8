"""The OpenAI Agents SDK with nothing but `base_url` set, producing training rollouts (CPU, seconds).

The agent is plain `agents` code on the SDK's default model, `OpenAIResponsesModel`, which calls
the Responses API (`POST /v1/responses`). The one line for training points the SDK's default client
at the gateway. Three episodes run at once under one API key; the gateway tells them apart by
their conversations and records each as one `Rollout` carrying the exact sampled ids, ready for
GRPO as in `examples/gateway_agent.py`. (`examples/gateway_agents_sdk.py`: the same agent through
Chat Completions, one API key per episode.)

    uv run python examples/gateway_agents_sdk_responses.py
"""

from __future__ import annotations

import asyncio

from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from SimpleTorchLLMRL import ModelGenerate, encode_rollout
from SimpleTorchLLMRL.gateway import Gateway
from SimpleTorchLLMRL.recipes.calculator.arithmetic import SYSTEM_PROMPT
from SimpleTorchLLMRL.testing.tiny import TINY_CALC
from SimpleTorchLLMRL.tools import CalculatorError, evaluate

QUESTIONS = ["What is 645 * 49?", "What is 312 * 17?", "What is 905 - 78?"]


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses."""
    try:
        return str(evaluate(expression))
    except CalculatorError as e:
        return f"Error: {e}"


agent = Agent(name="solver", instructions=SYSTEM_PROMPT, tools=[calculator], model="policy")


async def run_episode(question: str) -> str:
    try:
        result = await Runner.run(agent, question, max_turns=3)
        return str(result.final_output)
    except Exception as e:  # noqa: BLE001  (a tiny model may run out of turns: the episode is still recorded)
        return f"<{type(e).__name__}>"


def main() -> list:
    set_tracing_disabled(True)  # nothing leaves this machine
    model = AutoModelForCausalLM.from_pretrained(TINY_CALC).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY_CALC, padding_side="left")
    generator = ModelGenerate(model, tokenizer, max_new_tokens=40, temperature=1.0,
                              tool_call_stop=["</tool_call>"], seed=0)
    gateway = Gateway(generator)
    with gateway.serve() as url:
        async def all_episodes():
            set_default_openai_client(AsyncOpenAI(base_url=url, api_key="agents"))  # the only change
            return await asyncio.gather(*(run_episode(q) for q in QUESTIONS))

        answers = asyncio.run(all_episodes())
    rollouts = gateway.rollouts("agents")  # every episode under the key, one rollout each
    for q, answer in zip(QUESTIONS, answers, strict=True):
        for r in rollouts:
            if r[1].content == q:
                enc = encode_rollout(r, tokenizer)
                turns = [m for m in r if m.token_ids is not None]
                print(f"{q} -> {answer!r}: {len(r)} messages, {len(turns)} sampled turns, "
                      f"{sum(enc.loss_mask)} trained tokens of {len(enc.input_ids)}")
    return rollouts


if __name__ == "__main__":
    main()
