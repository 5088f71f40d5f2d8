"""Router-R1 configuration: six small dataclasses mirroring the original recipe's Hydra config, field names
and train.sh defaults included (docs/recipes.md, "Configuration"). Each checks itself (ValueError naming
the field).

    cfg = RouterTrainingConfig.from_overrides(["data.train_batch_size=8", "reward.cost_coefficient=0.5"])
"""

from __future__ import annotations

import ast
import math
from dataclasses import asdict, dataclass, field, fields

ROUTER_PROMPT = (
    "Answer the given question. Every time you receive new information, first reason inside "
    "<think> ... </think>. If you lack some knowledge, you can ask a specialized LLM by writing "
    "<search> MODEL_NAME: your question </search>, where MODEL_NAME is one of [{models}]. Its reply comes "
    "back between <information> and </information>. When no further information is needed, give the final "
    "answer inside <answer> ... </answer> without extra explanation.\n\n"
    "The candidate LLMs:\n{descriptions}\n\nQuestion: {question}\n"
)

AGENT_PROMPT = (
    "You are a helpful assistant in a multi-agent reasoning process: a base model delegates sub-questions "
    "to you. Either answer the question directly with a brief explanation, or give relevant context that "
    "helps answer it. If you cannot help at all, say so and suggest consulting another model. Keep the reply "
    "concise and on topic.\n\nThe sub-question: {query}\n"
)

INFORMATION_TEMPLATE = "\n\n<information>{}</information>\n\n"

REWARD_METRICS = ("em", "f1", "math")
ADV_ESTIMATORS = ("gae", "grpo")
LOGGERS = ("console", "wandb")
WANDB_MODES = ("offline", "online", "disabled")
KL_PENALTIES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}  # verl name -> trainer.losses estimator
CRITIC_KINDS = ("head", "model")


def _fail(owner: str, name: str, value, allowed: str):
    raise ValueError(f"{owner}.{name}={value!r} is invalid; expected {allowed}")


def _int(owner, name, value, low=1, allow_none=False, allow=()):
    if value is None and allow_none or value in allow and not isinstance(value, bool):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        extra = " or None" if allow_none else ""
        extra += "".join(f" or {a}" for a in allow)
        _fail(owner, name, value, f"an int >= {low}{extra}")


def _num(owner, name, value, low=-math.inf, high=math.inf, low_open=False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        _fail(owner, name, value, f"a finite number in {'(' if low_open else '['}{low}, {high}]")


def _bool(owner, name, value):
    if not isinstance(value, bool):
        _fail(owner, name, value, "True or False")


def _choice(owner, name, value, allowed):
    if value not in allowed:
        _fail(owner, name, value, f"one of {tuple(allowed)}")


def _paths(owner, name, value) -> tuple[str, ...]:
    value = (value,) if isinstance(value, str) else tuple(value or ())
    if any(not isinstance(p, str) or not p for p in value):
        _fail(owner, name, value, "a path or a list of paths (jsonl / json)")
    return value


@dataclass
class RouterDataConfig:
    """`data.*`: where questions come from, how many per step, and token budgets. max_start_length: longest
    opening prompt (longer rows are dropped with a warning). max_prompt_length: longest context a turn may be
    generated from (the episode ends otherwise). max_response_length: new tokens per MODEL turn.
    max_obs_length: tokens of a routed reply kept inside <information> (longer replies are cut).
    """

    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()
    train_data_num: int | None = None
    val_data_num: int | None = None
    prompt_key: str = "question"
    answer_key: str = "golden_answers"
    prompt_template: str = ROUTER_PROMPT
    train_batch_size: int = 64
    val_batch_size: int = 64
    max_prompt_length: int = 4096
    max_response_length: int = 1024
    max_start_length: int = 2048
    max_obs_length: int = 600
    shuffle_train_dataloader: bool = True

    def __post_init__(self):
        o = "data"
        self.train_files = _paths(o, "train_files", self.train_files)
        self.val_files = _paths(o, "val_files", self.val_files)
        _int(o, "train_data_num", self.train_data_num, allow_none=True)
        _int(o, "val_data_num", self.val_data_num, allow_none=True)
        for name in ("prompt_key", "answer_key"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                _fail(o, name, getattr(self, name), "a non-empty string (a field of the dataset rows)")
        if not isinstance(self.prompt_template, str) or "{question}" not in self.prompt_template:
            _fail(o, "prompt_template", self.prompt_template, "a string with a {question} placeholder")
        for name in ("train_batch_size", "val_batch_size", "max_prompt_length", "max_response_length",
                     "max_start_length", "max_obs_length"):
            _int(o, name, getattr(self, name))
        if self.max_start_length > self.max_prompt_length:
            _fail(o, "max_start_length", self.max_start_length, f"<= max_prompt_length={self.max_prompt_length}")
        _bool(o, "shuffle_train_dataloader", self.shuffle_train_dataloader)


@dataclass
class RouterGenerationConfig:
    """`actor_rollout_ref.rollout.*` and `max_turns` / `do_route`: how the policy samples and routes.

    max_turns: routing rounds; one final turn with routing off follows (at most max_turns + 1 MODEL
    turns). max_routing_calls: routed calls per episode (None: no limit but max_turns); a search past it
    marks the episode over budget. n_agent: samples per question (the group size; > 1 for GRPO). top_k: -1
    or 0 disables. do_route: False answers every search with no information (the no-routing ablation).
    """

    max_turns: int = 4
    max_routing_calls: int | None = None
    do_route: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    n_agent: int = 1

    def __post_init__(self):
        o = "generation"
        _int(o, "max_turns", self.max_turns, low=0)
        _int(o, "max_routing_calls", self.max_routing_calls, low=0, allow_none=True)
        _bool(o, "do_route", self.do_route)
        _num(o, "temperature", self.temperature, low=0, low_open=True)
        _num(o, "top_p", self.top_p, low=0, high=1, low_open=True)
        _int(o, "top_k", self.top_k, low=0, allow=(-1,))
        _bool(o, "do_sample", self.do_sample)
        _int(o, "n_agent", self.n_agent)


@dataclass
class RouterToolConfig:
    """The routing pool's calls (`api_base`, `api_key` of the original, and route_service.py's constants).
    api_key_env: NAME of the environment variable holding the key (None: send no key). agent_prompt: what a
    routed model is asked, with a {query} placeholder. information_template: how a routed reply is shown to
    the policy, with one {} placeholder.
    """

    api_base: str | None = None
    api_key_env: str | None = "ROUTER_API_KEY"
    request_timeout: float = 60.0
    max_retries: int = 2
    max_workers: int = 10
    routed_max_tokens: int = 512
    routed_temperature: float = 0.0
    agent_prompt: str = AGENT_PROMPT
    information_template: str = INFORMATION_TEMPLATE

    def __post_init__(self):
        o = "tool"
        if self.api_base is not None and not (isinstance(self.api_base, str) and
                                              self.api_base.startswith(("http://", "https://"))):
            _fail(o, "api_base", self.api_base, "None or an http(s):// URL of an OpenAI-compatible server")
        if self.api_key_env is not None and (not isinstance(self.api_key_env, str) or not self.api_key_env
                                             or self.api_key_env.startswith(("sk-", "Bearer"))):
            _fail(o, "api_key_env", "<hidden>", "None or the NAME of an environment variable (never the key)")
        _num(o, "request_timeout", self.request_timeout, low=0, low_open=True)
        _int(o, "max_retries", self.max_retries, low=0)
        _int(o, "max_workers", self.max_workers)
        _int(o, "routed_max_tokens", self.routed_max_tokens)
        _num(o, "routed_temperature", self.routed_temperature, low=0)
        if not isinstance(self.agent_prompt, str) or "{query}" not in self.agent_prompt:
            _fail(o, "agent_prompt", self.agent_prompt, "a string with a {query} placeholder")
        if not isinstance(self.information_template, str) or self.information_template.count("{}") != 1:
            _fail(o, "information_template", self.information_template, "a string with exactly one {} placeholder")


@dataclass
class RouterRewardConfig:
    """`reward_metric`, `cost_coe` and the format penalties of the original `format_reward` (docs/recipes.md,
    "Reward"). reward_metric: "em" | "f1" (SQuAD normalization, signs and decimal points kept when
    keep_numbers) | "math" (`reward.math.math_equal`). require_think: the first MODEL turn must open with
    <think> (else malformed).
    """

    reward_metric: str = "em"
    cost_coefficient: float = 0.0
    correct_score: float = 1.0
    keep_numbers: bool = True
    missing_answer_penalty: float = -1.0
    malformed_penalty: float = -1.0
    unknown_model_penalty: float = -1.0
    over_budget_penalty: float = -1.0
    require_think: bool = True

    def __post_init__(self):
        o = "reward"
        _choice(o, "reward_metric", self.reward_metric, REWARD_METRICS)
        _num(o, "cost_coefficient", self.cost_coefficient, low=0)
        _num(o, "correct_score", self.correct_score)
        _bool(o, "keep_numbers", self.keep_numbers)
        for name in ("missing_answer_penalty", "malformed_penalty", "unknown_model_penalty", "over_budget_penalty"):
            _num(o, name, getattr(self, name), high=0)
        _bool(o, "require_think", self.require_think)


@dataclass
class RouterTrainerConfig:
    """`trainer.*`, `algorithm.*`, actor / critic optimizer options.

    adv_estimator: "gae" (PPO, the critic trains) or "grpo" (groups of n_agent samples).
    critic: "head" (a value head on the policy's hidden states) or "model" (a separate copy
    of the policy as critic, as in the original). kl_coef with kl_penalty: KL to the initial
    policy (0 skips the reference model). save_freq / total_training_steps: -1 / None disable.
    """

    adv_estimator: str = "gae"
    total_epochs: int = 100
    total_training_steps: int | None = 225
    project_name: str = "Router-R1"
    experiment_name: str = "router-r1-ppo"
    logger: tuple[str, ...] = ("console",)
    wandb_mode: str = "offline"
    save_freq: int = 15
    default_local_dir: str = "checkpoints/router_r1"
    critic_warmup: int = 0
    critic: str = "head"
    actor_lr: float = 1e-6
    critic_lr: float = 1e-5
    lr_warmup_steps_ratio: float = 0.0
    ppo_mini_batch_size: int = 32
    ppo_micro_batch_size: int = 8
    ppo_epochs: int = 1
    clip_ratio: float = 0.2
    grad_clip: float = 1.0
    kl_coef: float = 0.001
    kl_penalty: str = "kl"
    gamma: float = 1.0
    lam: float = 1.0
    cliprange_value: float = 0.5
    vf_coef: float = 1.0
    seed: int = 42

    def __post_init__(self):
        o = "trainer"
        _choice(o, "adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        _int(o, "total_epochs", self.total_epochs)
        _int(o, "total_training_steps", self.total_training_steps, allow_none=True)
        for name in ("project_name", "experiment_name", "default_local_dir"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                _fail(o, name, getattr(self, name), "a non-empty string")
        self.logger = (self.logger,) if isinstance(self.logger, str) else tuple(self.logger)
        for lg in self.logger:
            _choice(o, "logger", lg, LOGGERS)
        _choice(o, "wandb_mode", self.wandb_mode, WANDB_MODES)
        _int(o, "save_freq", self.save_freq, allow=(-1,))
        _int(o, "critic_warmup", self.critic_warmup, low=0)
        _choice(o, "critic", self.critic, CRITIC_KINDS)
        _num(o, "actor_lr", self.actor_lr, low=0)
        _num(o, "critic_lr", self.critic_lr, low=0)
        _num(o, "lr_warmup_steps_ratio", self.lr_warmup_steps_ratio, low=0, high=1)
        for name in ("ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_epochs"):
            _int(o, name, getattr(self, name))
        if self.ppo_micro_batch_size > self.ppo_mini_batch_size:
            _fail(o, "ppo_micro_batch_size", self.ppo_micro_batch_size,
                  f"<= ppo_mini_batch_size={self.ppo_mini_batch_size}")
        _num(o, "clip_ratio", self.clip_ratio, low=0, high=1, low_open=True)
        _num(o, "grad_clip", self.grad_clip, low=0, low_open=True)
        _num(o, "kl_coef", self.kl_coef, low=0)
        _choice(o, "kl_penalty", self.kl_penalty, tuple(KL_PENALTIES))
        _num(o, "gamma", self.gamma, low=0, high=1)
        _num(o, "lam", self.lam, low=0, high=1)
        _num(o, "cliprange_value", self.cliprange_value, low=0, low_open=True)
        _num(o, "vf_coef", self.vf_coef, low=0)
        _int(o, "seed", self.seed, low=0)


@dataclass
class RouterValidationConfig:
    """Validation (`trainer.test_freq`, `+trainer.val_before_train`, `+trainer.val_only`): greedy unless
    do_sample; num_examine rollouts are printed."""

    test_freq: int = 15
    val_before_train: bool = False
    val_only: bool = False
    do_sample: bool = False
    temperature: float = 1.0
    num_examine: int = 1

    def __post_init__(self):
        o = "validation"
        _int(o, "test_freq", self.test_freq, allow=(-1,))
        _bool(o, "val_before_train", self.val_before_train)
        _bool(o, "val_only", self.val_only)
        _bool(o, "do_sample", self.do_sample)
        _num(o, "temperature", self.temperature, low=0, low_open=True)
        _int(o, "num_examine", self.num_examine, low=0)


_SECTIONS = {"data": RouterDataConfig, "generation": RouterGenerationConfig, "tool": RouterToolConfig,
             "reward": RouterRewardConfig, "trainer": RouterTrainerConfig, "validation": RouterValidationConfig}


@dataclass
class RouterTrainingConfig:
    """The six sections together, with the cross-section checks."""

    data: RouterDataConfig = field(default_factory=RouterDataConfig)
    generation: RouterGenerationConfig = field(default_factory=RouterGenerationConfig)
    tool: RouterToolConfig = field(default_factory=RouterToolConfig)
    reward: RouterRewardConfig = field(default_factory=RouterRewardConfig)
    trainer: RouterTrainerConfig = field(default_factory=RouterTrainerConfig)
    validation: RouterValidationConfig = field(default_factory=RouterValidationConfig)

    def __post_init__(self):
        for name, cls in _SECTIONS.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, _build(cls, value, name))
            elif not isinstance(value, cls):
                _fail("config", name, value, f"a {cls.__name__} or a dict of its fields")
        if self.trainer.adv_estimator == "grpo" and self.generation.n_agent < 2:
            _fail("generation", "n_agent", self.generation.n_agent,
                  ">= 2 with trainer.adv_estimator='grpo' (a group needs several samples)")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RouterTrainingConfig:
        unknown = sorted(set(d) - set(_SECTIONS))
        if unknown:
            raise ValueError(f"unknown config sections {unknown}; expected some of {sorted(_SECTIONS)}")
        return cls(**{k: dict(v) for k, v in d.items()})

    @classmethod
    def from_overrides(cls, overrides, base: RouterTrainingConfig | None = None) -> RouterTrainingConfig:
        """Hydra-style `section.field=value` overrides (values parsed as Python literals, else strings)."""
        d = (base or cls()).to_dict()
        for item in overrides:
            key, sep, raw = item.partition("=")
            section, _, name = key.strip().partition(".")
            if not sep or section not in _SECTIONS or name not in d[section]:
                raise ValueError(f"override {item!r} must be section.field=value with a known field; "
                                 f"sections: {sorted(_SECTIONS)}")
            d[section][name] = _literal(raw.strip())
        return cls.from_dict(d)


def _build(cls, values: dict, section: str):
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{section} has unknown fields {unknown}; allowed: {sorted(names)}")
    return cls(**values)


def _literal(raw: str):
    if raw in ("null", "None", "~"):
        return None
    if raw in ("true", "True", "false", "False"):
        return raw.lower() == "true"
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw
