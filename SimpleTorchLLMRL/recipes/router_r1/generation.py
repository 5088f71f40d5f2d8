"""Router-R1 episodes: the policy thinks, routes sub-questions to pool models, reads, answers.

    env = RouterEnv(pool, tokenizer, config)                        # config: RouterTrainingConfig
    gen = make_policy_generator(policy, tokenizer, config)          # ModelGenerate, stops at </search>, </answer>
    rollouts = RouterGenerationManager(gen, env).run(questions, answers, n=4)   # routing batched per round
    rollouts = collect_rollouts(gen, env, questions, answers, group_size=4)     # the generic loop works too

Every search is recorded in the episode's `RouterState`, which the reward reads for cost; how each is
answered: docs/recipes.md, "Episodes".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_prompt
from SimpleTorchLLMRL.env.base import Env
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig
from SimpleTorchLLMRL.recipes.router_r1.config import RouterTrainingConfig
from SimpleTorchLLMRL.recipes.router_r1.pool import RouteResult, RoutingPool
from SimpleTorchLLMRL.recipes.router_r1.tags import Action, parse_action

SEARCH_STOP, ANSWER_STOP = "</search>", "</answer>"
CALL_STATUSES = ("ok", "error", "unknown_model", "over_budget", "not_routed")


@dataclass
class RouteCall:
    """One search the policy wrote, and what became of it (status in CALL_STATUSES)."""

    name: str
    query: str
    status: str
    cost: float = 0.0
    completion_tokens: int = 0


@dataclass
class RouterState:
    """Per-episode record: the gold answer, MODEL turns seen and every search."""

    answer: Any = None
    turns: int = 0
    calls: list[RouteCall] = field(default_factory=list)

    @property
    def routed(self) -> int:
        """Calls that reached a pool model (successful or not)."""
        return sum(c.status in ("ok", "error") for c in self.calls)

    @property
    def cost(self) -> float:
        return sum(c.cost for c in self.calls)

    def has(self, status: str) -> bool:
        return any(c.status == status for c in self.calls)


@dataclass
class Decision:
    """What the env will do about a MODEL turn: route `request`, reply `reply`, and/or finish."""

    action: Action
    done: bool = False
    request: tuple[str, str] | None = None
    reply: str | None = None
    call: RouteCall | None = None


def make_policy_generator(model, tokenizer, config: RouterTrainingConfig, validation: bool = False, seed=None):
    """A `ModelGenerate` with Router-R1's stops and the config's sampling (greedy-by-default validation)."""
    from SimpleTorchLLMRL.model.generation.generator import ModelGenerate

    g, v = config.generation, config.validation
    do_sample, temperature = (v.do_sample, v.temperature) if validation else (g.do_sample, g.temperature)
    return ModelGenerate(model, tokenizer, seed=seed,
                         sampling=SamplingConfig(max_new_tokens=config.data.max_response_length,
                                                 temperature=temperature, do_sample=do_sample,
                                                 top_p=None if g.top_p >= 1 else g.top_p,
                                                 top_k=None if g.top_k <= 0 else g.top_k, stop=[ANSWER_STOP],
                                                 tool_call_stop=[SEARCH_STOP]))


class RouterEnv(Env):
    """The Router-R1 environment over a `RoutingPool`; `tokenizer` (the policy's) cuts long replies."""

    def __init__(self, pool: RoutingPool, tokenizer=None, config: RouterTrainingConfig | None = None):
        if not isinstance(pool, RoutingPool):
            raise TypeError(f"RouterEnv needs a RoutingPool, got {type(pool).__name__}")
        if len(pool) == 0:
            raise ValueError("RouterEnv needs a pool with at least one model")
        self.pool, self.tokenizer = pool, tokenizer
        self.config = config or RouterTrainingConfig()
        self.max_turns = self.config.generation.max_turns + 1  # MODEL turns, the final no-routing one included

    # -- Env protocol
    def prompt(self, question: Any) -> str:
        return self.config.data.prompt_template.format(question=question, models=", ".join(self.pool.names),
                                                       descriptions=self.pool.describe())

    def setup(self, question, answer=None):
        return [Message(self.prompt(question), MessageType.MESSAGE)], RouterState(answer=answer)

    def step(self, rollout: Rollout, state: RouterState):
        d = self.decide(rollout, state)
        result = self.pool.route([d.request])[0] if d.request is not None else None
        return self.respond(state, d, result)

    # -- the two halves of a step (the manager batches the routing in between)
    def decide(self, rollout: Rollout, state: RouterState) -> Decision:
        state.turns += 1
        last = rollout.last(MessageType.MODEL)
        action = parse_action(last.content if last is not None else "")
        final = state.turns >= self.max_turns
        g = self.config.generation
        if action.kind == "answer":
            return Decision(action, done=True)
        if action.kind == "route":
            call = RouteCall(action.name, action.query, "not_routed")
            if final:
                return Decision(action, done=True, call=call)
            if not g.do_route:
                return Decision(action, reply="None", call=call)
            if g.max_routing_calls is not None and state.routed >= g.max_routing_calls:
                call.status = "over_budget"
                return Decision(action, call=call, reply=f"routing budget exhausted ({g.max_routing_calls} calls); "
                                                         "answer with what you know")
            return Decision(action, request=(action.name, action.query), call=call)
        if final:
            return Decision(action, done=True)
        if action.kind == "malformed_route":
            return Decision(action, reply="malformed search: write <search>MODEL_NAME: your question</search> "
                                          f"with MODEL_NAME one of {', '.join(self.pool.names)}")
        return Decision(action)  # no action: the policy simply continues in a new turn (as in the original)

    def respond(self, state: RouterState, d: Decision, result: RouteResult | None = None):
        reply = d.reply
        if result is not None:
            d.call.status, d.call.cost, d.call.completion_tokens = result.status, result.cost, result.completion_tokens
            d.call.name = result.name if result.status != "unknown_model" else d.call.name
            reply = result.text
        if d.call is not None:
            state.calls.append(d.call)
        if reply is None:
            return [], d.done
        text = self.config.tool.information_template.format(self.truncate(reply.strip()))
        return [Message(text, MessageType.TOOL, name=d.call.name if d.call is not None else None)], d.done

    def truncate(self, text: str) -> str:
        """At most `data.max_obs_length` tokens of the policy's tokenizer (no cut without a tokenizer)."""
        limit = self.config.data.max_obs_length
        if self.tokenizer is None:
            return text
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return text if len(ids) <= limit else self.tokenizer.decode(ids[:limit], skip_special_tokens=True)


class RouterGenerationManager:
    """The batched multi-round loop: generate for all open episodes, route all searches at once, repeat.

    generator: anything with `batch_rollout_generate_response(rollouts)` and a `tokenizer` (a
    `ModelGenerate`); with `fits(prompt_ids)` it is asked whether the next prompt fits. Metadata per
    rollout as `collect_rollouts` writes it ("done_reason": "env" | "context").
    """

    def __init__(self, generator, env: RouterEnv):
        if not hasattr(generator, "batch_rollout_generate_response"):
            raise TypeError("the generator needs batch_rollout_generate_response(rollouts), e.g. a ModelGenerate")
        self.generator, self.env = generator, env

    def _fits(self, rollout: Rollout) -> bool:
        tok = getattr(self.generator, "tokenizer", None) or self.env.tokenizer
        limit = self.env.config.data.max_prompt_length
        ids = encode_prompt(rollout, tok) if tok is not None else None
        if ids is not None and len(ids) > limit:
            return False
        return ids is None or not hasattr(self.generator, "fits") or self.generator.fits(ids)

    def run(self, questions: Sequence[Any], answers: Sequence[Any] | None = None, n: int = 1) -> list[Rollout]:
        """n episodes per question, group-major (question 0's n samples first)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        answers = [None] * len(questions) if answers is None else list(answers)
        if len(answers) != len(questions):
            raise ValueError(f"questions and answers differ in length: {len(questions)} vs {len(answers)}")
        rollouts = []
        for gi, (q, a) in enumerate(zip(questions, answers, strict=True)):
            for _ in range(n):
                msgs, state = self.env.setup(q, a)
                rollouts.append(Rollout(msgs, {"group_id": gi, "question": q, "answer": a, "env_state": state,
                                               "turns": 0}))
        active = list(range(len(rollouts)))
        while active:
            for i in [i for i in active if not self._fits(rollouts[i])]:
                rollouts[i].metadata["done_reason"] = "context"
            active = [i for i in active if "done_reason" not in rollouts[i].metadata]
            if not active:
                break
            self.generator.batch_rollout_generate_response([rollouts[i] for i in active])
            decisions = []
            for i in active:
                rollouts[i].metadata["turns"] += 1
                decisions.append(self.env.decide(rollouts[i], rollouts[i].metadata["env_state"]))
            asks = [k for k, d in enumerate(decisions) if d.request is not None]
            results = dict(zip(asks, self.env.pool.route([decisions[k].request for k in asks]), strict=True))
            still = []
            for k, (i, d) in enumerate(zip(active, decisions, strict=True)):
                msgs, done = self.env.respond(rollouts[i].metadata["env_state"], d, results.get(k))
                rollouts[i].add_messages(*msgs)
                if done:
                    rollouts[i].metadata["done_reason"] = "env"
                else:
                    still.append(i)
            active = still
        return rollouts
