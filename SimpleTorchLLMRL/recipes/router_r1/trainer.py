"""`RouterR1Trainer`: PPO (critic trains) or GRPO over multi-round routing episodes.

Legend: B rollouts (questions x n_agent).

    trainer = RouterR1Trainer(config, policy, tokenizer, pool, train_rows, val_rows)
    trainer.fit()              # rollouts -> RouterReward -> PPO / GRPO updates; validation every test_freq
    trainer.validate()         # greedy episodes on the validation rows: EM, F1, cost, routing calls

Checkpoints (`utils.checkpoint`): default_local_dir/checkpoints/step-N/ and the policy in .../final/.
"""

from __future__ import annotations

import copy
import math
import random
import time
from pathlib import Path

import torch

from SimpleTorchLLMRL.chat.message import MessageType
from SimpleTorchLLMRL.model.lora import is_peft_model
from SimpleTorchLLMRL.recipes.router_r1.config import KL_PENALTIES, RouterTrainingConfig
from SimpleTorchLLMRL.recipes.router_r1.data import batches, load_rows, prepare_rows
from SimpleTorchLLMRL.recipes.router_r1.generation import (
    RouterEnv,
    RouterGenerationManager,
    make_policy_generator,
)
from SimpleTorchLLMRL.recipes.router_r1.pool import RoutingPool
from SimpleTorchLLMRL.recipes.router_r1.reward import RouterReward, RouterRewardOutput
from SimpleTorchLLMRL.trainer.losses import combine_metrics, normalizer
from SimpleTorchLLMRL.utils.checkpoint import save_checkpoint, save_pretrained_atomic
from SimpleTorchLLMRL.utils.metrics import MetricsLogger
from SimpleTorchLLMRL.utils.training import clipped_step, seed_everything, warmup_constant

CONSOLE_KEYS = ("reward", "em", "f1", "routing_cost", "routed_calls", "well_formed", "loss", "value_loss", "kl",
                "seconds")


def metrics_logger(config: RouterTrainingConfig, print_fn=print) -> MetricsLogger:
    """The library's logger: chosen keys on the console, W&B when "wandb" is in trainer.logger."""
    t = config.trainer
    use_wandb = "wandb" in t.logger and t.wandb_mode != "disabled"
    return MetricsLogger(t.default_local_dir if use_wandb else None, use_wandb=use_wandb, project=t.project_name,
                         run_name=t.experiment_name, config=config.to_dict(), console="console" in t.logger,
                         console_keys=CONSOLE_KEYS, console_prefix="[router-r1] ", print_fn=print_fn,
                         wandb_mode=t.wandb_mode)


def _mean(t: torch.Tensor) -> float:
    return float(t.float().mean()) if t.numel() else float("nan")


class RouterR1Trainer:
    """Trains `policy` to route; `pool` answers its searches. Rows: dicts with data.prompt_key / answer_key
    (None: read from data.train_files / data.val_files). `reward` defaults to `RouterReward(config.reward, pool)`."""

    def __init__(self, config: RouterTrainingConfig, policy, tokenizer, pool: RoutingPool, train_rows=None,
                 val_rows=None, *, reward=None, print_fn=print):
        if not isinstance(config, RouterTrainingConfig):
            raise TypeError(f"config must be a RouterTrainingConfig, got {type(config).__name__}")
        self.config, self.policy, self.tokenizer, self.pool = config, policy, tokenizer, pool
        d, t = config.data, config.trainer
        seed_everything(t.seed)
        self.rng = random.Random(t.seed)
        self.env = RouterEnv(pool, tokenizer, config)
        self.train_rows = prepare_rows(load_rows(d.train_files) if train_rows is None else train_rows, d,
                                       d.train_data_num, t.seed, self.env, tokenizer, "train")
        self.val_rows = prepare_rows(load_rows(d.val_files) if val_rows is None else val_rows, d,
                                     d.val_data_num, t.seed, self.env, tokenizer, "val")
        self.manager = RouterGenerationManager(make_policy_generator(policy, tokenizer, config, seed=t.seed), self.env)
        self.val_manager = RouterGenerationManager(
            make_policy_generator(policy, tokenizer, config, validation=True, seed=t.seed), self.env)
        self.reward = reward if reward is not None else RouterReward(config.reward, pool)
        self.algo = self._algorithm()
        actor_params = [p for p in policy.parameters() if p.requires_grad]
        self.actor_opt = torch.optim.AdamW(actor_params, lr=t.actor_lr)
        self.critic_opt = (torch.optim.AdamW(self.algo.value_parameters(), lr=t.critic_lr)
                           if t.adv_estimator == "gae" else None)
        self.global_step = 0
        self.total_steps = self._total_steps()
        schedule = warmup_constant(int(t.lr_warmup_steps_ratio * self.total_steps))
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in (self.actor_opt, self.critic_opt)
                           if o is not None]
        self.logger = metrics_logger(config, print_fn)
        self.print_fn = print_fn

    def _algorithm(self):
        from SimpleTorchLLMRL.trainer.grpo import GRPO
        from SimpleTorchLLMRL.trainer.ppo import PPO

        t, g = self.config.trainer, self.config.generation
        ref = None
        if t.kl_coef > 0 and not is_peft_model(self.policy):  # a peft policy's reference is itself with the adapter off
            ref = copy.deepcopy(self.policy).eval().requires_grad_(False)
        common = dict(eps=t.clip_ratio, beta=t.kl_coef, kl_estimator=KL_PENALTIES[t.kl_penalty],
                      temperature=g.temperature, ref_model=ref)
        if t.adv_estimator == "grpo":
            return GRPO(self.policy, self.tokenizer, **common)
        critic = copy.deepcopy(self.policy).train() if t.critic == "model" else None
        return PPO(self.policy, self.tokenizer, critic=critic, gamma=t.gamma, lam=t.lam,
                   cliprange_value=t.cliprange_value, vf_coef=t.vf_coef, **common)

    def _total_steps(self) -> int:
        t = self.config.trainer
        per_epoch = len(batches(len(self.train_rows), self.config.data.train_batch_size, False, self.rng))
        if per_epoch == 0 and not self.config.validation.val_only:
            raise ValueError(f"data.train_batch_size={self.config.data.train_batch_size} is more than the "
                             f"{len(self.train_rows)} usable training rows; lower it or add data")
        total = per_epoch * t.total_epochs
        return min(total, t.total_training_steps) if t.total_training_steps is not None else total

    def train_step(self, rows) -> dict[str, float]:
        start = time.perf_counter()
        questions, answers = [r.question for r in rows], [r.answer for r in rows]
        rollouts = self.manager.run(questions, answers, n=self.config.generation.n_agent)
        out = self._score(rollouts)
        gen_seconds = time.perf_counter() - start
        keep = [i for i, r in enumerate(rollouts) if r.last(MessageType.MODEL) is not None]
        metrics = {"train/reward": _mean(out.total), "train/seconds_rollout": gen_seconds,
                   "train/turns": sum(r.metadata["turns"] for r in rollouts) / len(rollouts)}
        metrics.update({f"train/{k}": _mean(v) for k, v in {**out.components, **out.metrics}.items()})
        if keep:
            metrics.update({f"train/{k}": v for k, v in
                            self._update([rollouts[i] for i in keep], out.total[keep]).items()})
        metrics["train/seconds"] = time.perf_counter() - start
        return metrics

    def _score(self, rollouts) -> RouterRewardOutput:
        """RouterReward's breakdown, or any protocol reward `fn(rollouts, golds) -> (B,)` as a bare total."""
        if hasattr(self.reward, "compute"):
            return self.reward.compute(rollouts)
        total = torch.as_tensor(self.reward(rollouts, [r.metadata["answer"] for r in rollouts]), dtype=torch.float32)
        return RouterRewardOutput(total, {}, {})

    def _normalizer(self, tb) -> float:
        if self.config.trainer.adv_estimator == "gae":
            return float(tb.mask.sum())
        cfg = self.algo.config
        return normalizer(cfg.spec.aggregate, tb.mask, cfg.max_tokens)

    def _update(self, rollouts, rewards: torch.Tensor) -> dict[str, float]:
        t = self.config.trainer
        prepared = self.algo.prepare(rollouts, rewards)
        actor_on = self.global_step >= t.critic_warmup or self.critic_opt is None
        sums: dict[str, float] = {}
        n = 0
        for _ in range(t.ppo_epochs):
            for mini in prepared.split(t.ppo_mini_batch_size):  # one optimizer step each
                norm = self._normalizer(mini)
                parts = []
                for micro in mini.split(t.ppo_micro_batch_size):
                    out = self.algo.compute(micro, normalizer=norm)
                    out.loss.backward()
                    parts.append(out.metrics)
                for k, v in combine_metrics(parts).items():  # the mini-batch's, whatever the micro-batch size
                    if isinstance(v, (int, float)) and math.isfinite(v):
                        sums[k] = sums.get(k, 0.0) + float(v)
                n += 1
                self._optimizer_step(actor_on)
        metrics = {k: v / n for k, v in sums.items()}  # mean over the optimizer steps
        metrics["actor_updated"] = float(actor_on)
        return metrics

    def _optimizer_step(self, actor_on: bool) -> None:
        grad_clip = self.config.trainer.grad_clip
        if self.critic_opt is not None:
            clipped_step(self.critic_opt, grad_clip)
        if actor_on:
            clipped_step(self.actor_opt, grad_clip)
        self.actor_opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Episodes on the validation rows (greedy unless validation.do_sample): mean reward, EM, F1, cost."""
        if not self.val_rows:
            return {}
        start = time.perf_counter()
        parts, examples = [], []
        for idx in batches(len(self.val_rows), self.config.data.val_batch_size, False, self.rng, drop_last=False):
            rows = [self.val_rows[i] for i in idx]
            rollouts = self.val_manager.run([r.question for r in rows], [r.answer for r in rows], n=1)
            parts.append(self._score(rollouts))
            examples += rollouts[: max(0, self.config.validation.num_examine - len(examples))]
        metrics = {"val/reward": _mean(torch.cat([p.total for p in parts]))}
        for key in [*parts[0].components, *parts[0].metrics]:
            vals = [p.components.get(key, p.metrics.get(key)) for p in parts]
            metrics[f"val/{key}"] = _mean(torch.cat(vals))
        metrics["val/seconds"] = time.perf_counter() - start
        for r in examples:
            self.print_fn("[router-r1] validation example:\n" + "\n".join(
                f"  {m.role}: {m.content.strip()}" for m in r.messages[1:]) + f"\n  gold: {r.metadata['answer']}")
        return metrics

    def fit(self) -> dict[str, dict[str, float]]:
        """Train for min(total_epochs x batches per epoch, total_training_steps) steps. Returns the last metrics."""
        v, t = self.config.validation, self.config.trainer
        last = {"train": {}, "val": {}}
        if v.val_before_train or v.val_only:
            last["val"] = self.validate()
            self.logger.log(self.global_step, last["val"])
            if v.val_only:
                self.logger.close()
                return last
        try:
            for _ in range(t.total_epochs):
                for idx in batches(len(self.train_rows), self.config.data.train_batch_size,
                                   self.config.data.shuffle_train_dataloader, self.rng):
                    if self.global_step >= self.total_steps:
                        break
                    metrics = self.train_step([self.train_rows[i] for i in idx])
                    self.global_step += 1
                    for s in self.schedulers:
                        s.step()
                    metrics["train/lr"] = self.actor_opt.param_groups[0]["lr"]
                    final = self.global_step >= self.total_steps
                    if v.test_freq > 0 and (self.global_step % v.test_freq == 0 or final):
                        last["val"] = self.validate()
                        metrics.update(last["val"])
                    last["train"] = metrics
                    self.logger.log(self.global_step, metrics)
                    if t.save_freq > 0 and (self.global_step % t.save_freq == 0 or final):
                        self.save_checkpoint()
        finally:
            self.logger.close()
        return last

    def save_checkpoint(self, directory: str | None = None) -> Path:
        """Atomically, a resumable checkpoint (utils.checkpoint) in directory/step-N (default: default_local_dir/
        checkpoints: the policy's trainable weights, the actor optimizer and scheduler, the value head /
        critic and its optimizer, RNG, the config) and the policy `save_pretrained` in default_local_dir/final."""
        t = self.config.trainer
        extra = {}
        if self.critic_opt is not None:
            extra.update(value_head=self.algo.value_head.state_dict(), critic_opt=self.critic_opt.state_dict())
            if self.algo.critic is not None:
                extra["critic"] = self.algo.critic.state_dict()
        path = save_checkpoint(directory or Path(t.default_local_dir) / "checkpoints", self.global_step, self.policy,
                               self.actor_opt, self.schedulers[0], extra=extra,
                               state={"global_step": self.global_step, "config": self.config.to_dict()})
        save_pretrained_atomic(self.policy, self.tokenizer, Path(t.default_local_dir) / "final")
        return path
