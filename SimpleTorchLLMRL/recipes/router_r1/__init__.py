"""Router-R1: train a policy LLM to think, route sub-questions to a pool of LLMs, and answer
(docs/recipes.md, "Router-R1"): `config`, `pool`, `generation` (episodes), `reward`, `trainer`."""

from SimpleTorchLLMRL.recipes.router_r1.config import (
    AGENT_PROMPT,
    ROUTER_PROMPT,
    RouterDataConfig,
    RouterGenerationConfig,
    RouterRewardConfig,
    RouterToolConfig,
    RouterTrainerConfig,
    RouterTrainingConfig,
    RouterValidationConfig,
)
from SimpleTorchLLMRL.recipes.router_r1.data import load_rows, prepare_rows
from SimpleTorchLLMRL.recipes.router_r1.generation import (
    RouteCall,
    RouterEnv,
    RouterGenerationManager,
    RouterState,
    make_policy_generator,
)
from SimpleTorchLLMRL.recipes.router_r1.pool import (
    CallableModel,
    HFModel,
    LocalGenerator,
    OpenAIModel,
    RoutedModel,
    RouteResult,
    RoutingPool,
)
from SimpleTorchLLMRL.recipes.router_r1.reward import RouterReward, RouterRewardOutput
from SimpleTorchLLMRL.recipes.router_r1.tags import Action, final_answer, format_problems, parse_action
from SimpleTorchLLMRL.recipes.router_r1.trainer import RouterR1Trainer

__all__ = [
    "AGENT_PROMPT",
    "ROUTER_PROMPT",
    "Action",
    "CallableModel",
    "HFModel",
    "LocalGenerator",
    "OpenAIModel",
    "RouteCall",
    "RouteResult",
    "RoutedModel",
    "RouterDataConfig",
    "RouterEnv",
    "RouterGenerationConfig",
    "RouterGenerationManager",
    "RouterR1Trainer",
    "RouterReward",
    "RouterRewardConfig",
    "RouterRewardOutput",
    "RouterState",
    "RouterToolConfig",
    "RouterTrainerConfig",
    "RouterTrainingConfig",
    "RouterValidationConfig",
    "RoutingPool",
    "final_answer",
    "format_problems",
    "load_rows",
    "make_policy_generator",
    "parse_action",
    "prepare_rows",
]
