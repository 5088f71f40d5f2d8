"""GRPO with a calculator tool, end to end, in one loop you can read top to bottom.

    uv run python main.py                                  # embedded tiny model, synthetic arithmetic, CPU
    uv run python main.py --steps 100 --output-dir runs/a  # longer
    uv run python main.py --output-dir runs/a --resume     # continue from the latest complete checkpoint
    uv run python main.py --output-dir runs/a --restart    # start that run over from step 0
    uv run python main.py --model Qwen/Qwen2.5-0.5B-Instruct --lora --dataset my.jsonl
    uv run python main.py --device cuda --gradient-checkpointing   # bf16 on a GPU (--device/--dtype auto)
    uv run python main.py --dataset rg:basic_arithmetic --reward score_answer   # a reasoning-gym task

Each step: take `--batch-size` questions -> `--group-size` multi-turn rollouts each (the model
may call the calculator; the env answers) -> reward (`--reward`; default 1 for a correct \\boxed{} answer) ->
GRPO loss -> optimizer step. Held-out greedy accuracy and pass@k are measured before
training and every `--eval-every` steps. Everything lands in `--output-dir`:
metrics.jsonl, curves.png, samples.txt, summary.md, final/ (save_pretrained), checkpoints/.

Exit status: 0 done; 2 bad input (one line on stderr, nothing written), another run holding
`--output-dir` (one run at a time: it names that run's PID), or no space left writing a checkpoint
(one line, the partial folder removed); 3 a non-finite update (nothing saved); 128 + N stopped by
signal N: the first SIGTERM (143) or SIGINT (130) ends the step in progress, saves a checkpoint and
exits (continue with --resume); a second one stops at once.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from SimpleTorchLLMRL import GRPO, collect_rollouts
from SimpleTorchLLMRL.env import ToolUseEnv
from SimpleTorchLLMRL.env.async_rollouts import AsyncProducer, RolloutQueue, versions_after
from SimpleTorchLLMRL.model.dropout import disable_dropout
from SimpleTorchLLMRL.recipes.calculator.arithmetic import SYSTEM_PROMPT
from SimpleTorchLLMRL.recipes.calculator.cli import (
    UsageError,
    check_args,
    choose_reward,
    fail,
    load_policy,
    parse_args,
)
from SimpleTorchLLMRL.recipes.calculator.data import DatasetError, check_context, load_data
from SimpleTorchLLMRL.recipes.calculator.evaluate import (
    accuracy_change,
    evaluate,
    render_rollouts,
    summary_table,
)
from SimpleTorchLLMRL.recipes.calculator.plots import plot_curves
from SimpleTorchLLMRL.recipes.calculator.resume import checkpoint_state, resume_point, start_over
from SimpleTorchLLMRL.recipes.calculator.train_loop import (
    EVAL_STREAM,
    BackgroundEval,
    RunLock,
    Sampler,
    StopOnSignal,
    batch_at,
    episode_stats,
    step_seed,
    trim_metrics,
    write_atomic,
)
from SimpleTorchLLMRL.tools import calculator
from SimpleTorchLLMRL.trainer.drift import logprob_drift
from SimpleTorchLLMRL.trainer.losses import combine_metrics
from SimpleTorchLLMRL.utils.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
    save_pretrained_atomic,
)
from SimpleTorchLLMRL.utils.metrics import MetricsLogger, read_metrics
from SimpleTorchLLMRL.utils.training import NonFiniteError, clipped_step, seed_everything, warmup_constant


class Run:
    """What the phases share: the checked inputs (from `load`), then the pieces `build` makes."""

    def __init__(self, args, model, tokenizer, env: ToolUseEnv, train_rows: list, held_out: list, reward_fn,
                 out: Path, ckpt: Path | None, saved: dict | None):
        self.args, self.model, self.tokenizer, self.env = args, model, tokenizer, env
        self.train_rows, self.held_out, self.out, self.ckpt, self.saved = train_rows, held_out, out, ckpt, saved
        self.reward_fn = reward_fn  # --reward: fn(rollouts, answers) -> (B,)
        self.grpo: GRPO | None = None
        self.optimizer = self.scheduler = None
        self.sampler: Sampler | None = None
        self.logger: MetricsLogger | None = None
        self.start = 0  # the step to continue after (a checkpoint's)
        self.in_flight: dict = {}  # {version: state_dict} the async producer samples the next steps with


# ---- 1. parse and load: every input is checked before anything is written


def load(argv: list[str] | None, lock: RunLock) -> Run:
    """Flags, data, model and the resume point, with `lock` held; UsageError / DatasetError on bad input."""
    args = parse_args(argv)
    check_args(args)
    out = Path(args.output_dir)
    if out.is_dir():
        lock.acquire(out)  # another run in this output dir: refused before the model loads
    train_rows, held_out = load_data(args.dataset, args.eval_size, args.seed)
    reward_fn = choose_reward(args)
    model, tokenizer = load_policy(args)
    disable_dropout(model)  # on-policy ratios exactly 1 (a model with dropout trains a random sub-network)
    env = ToolUseEnv([calculator], custom_sys_prompt=SYSTEM_PROMPT, max_turns=args.max_turns)
    check_context(train_rows + held_out, env, tokenizer, model, args.max_new_tokens, args.dataset)
    lock.acquire(out)  # a new output dir is created here, once every input is checked
    ckpt, saved = resume_point(out, args, model)  # every setting compared before any weight is loaded
    return Run(args, model, tokenizer, env, train_rows, held_out, reward_fn, out, ckpt, saved)


# ---- 2. the pieces: loss, optimizer, sampler; then resume into them


def build(run: Run) -> None:
    args, model = run.args, run.model
    run.grpo = GRPO(model, run.tokenizer, group_size=args.group_size, temperature=args.temperature, beta=0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    run.optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, warmup_constant(args.warmup_steps))
    run.sampler = Sampler(model, run.tokenizer, stop_strings=run.env.stop_strings,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, backend=args.backend,
                          model_name=args.model, adapter=args.qlora, dtype=args.dtype,
                          engine_kwargs=args.engine_kwargs)


def resume(run: Run) -> None:
    """Model, optimizer, scheduler, RNG and step from the checkpoint checked in `load`; open the log."""
    args, out = run.args, run.out
    if run.ckpt is not None:
        try:
            state = load_checkpoint(run.ckpt, run.model, run.optimizer, run.scheduler)  # onto --device
        except ValueError as e:  # another architecture's weights in its place: nothing is written yet
            raise UsageError(f"--resume: {run.ckpt}: {e}") from e
        run.in_flight = state.get("extra", {}).get("producer_weights", {})  # async: what the producer had
        run.start = run.saved["step"]
        run.sampler.sync(run.model)
        tqdm.write(f"resumed from {run.ckpt} (step {run.start}, data position {run.saved['data_position']})")
    elif args.resume:
        tqdm.write(f"--resume: no checkpoint in {out / 'checkpoints'}; starting from step 0")
    if args.restart:
        start_over(out)  # the old checkpoints and final model go; metrics.jsonl is rewritten
    out.mkdir(parents=True, exist_ok=True)
    trim_metrics(out / "metrics.jsonl", run.start)  # a resumed run rewrites what followed its checkpoint
    run.logger = MetricsLogger(out, use_wandb=args.wandb, config=vars(args), append=run.start > 0, console=False,
                               run_id=(run.saved or {}).get("wandb_run_id"))  # a resumed run continues its W&B run
    n_train = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    tqdm.write(f"{args.model}: {n_train / 1e6:.2f}M trainable parameters; {len(run.train_rows)} training rows, "
               f"{len(run.held_out)} held out; output in {out}")


# ---- 3. data: the episodes of a step


def rollouts_for(run: Run, step: int, version: int, weights=None) -> list:
    """The step's episodes: its rows, its seed, sampled by `weights` (default: the training model)."""
    args = run.args
    rows = batch_at(run.train_rows, (step - 1) * args.batch_size, args.batch_size, args.seed)
    generator = run.sampler.generator(seed=step_seed(args.seed, step), policy_version=version, model=weights)
    return collect_rollouts(generator, run.env, [r["question"] for r in rows], [r["answer"] for r in rows],
                            group_size=args.group_size)  # (batch_size * group_size,) group-major


# ---- 4. the train step


def train_step(run: Run, step: int, rollouts: list, rewards: torch.Tensor) -> dict:
    """GRPO over micro-batches, one optimizer step; the batch's metrics (NonFiniteError on a NaN/inf update)."""
    grpo = run.grpo
    run.model.train()
    grpo.policy_version = step - 1  # optimizer steps taken: staleness = this - the sampling version
    prepared = grpo.prepare(rollouts, rewards)  # advantages; the sampled log-probs are the old policy
    outs = []
    for micro in prepared.split(run.args.micro_batch_size):  # each micro-batch keeps the full normalizer
        out = grpo.compute(micro)
        out.loss.backward()
        outs.append((micro.batch, out))
    metrics = combine_metrics([o.metrics for _, o in outs])  # the same whatever the micro-batch size
    # sampled vs recomputed log-probs, per role / agent and the worst message
    drift = logprob_drift(rollouts, [(b, o.token_logprobs) for b, o in outs]).summary()
    grad_norm = clipped_step(run.optimizer, max_grad_norm=1.0)  # refuses NaN/inf before anything is saved
    run.scheduler.step()
    if run.args.async_staleness is None:  # async: the producer pushes the version it samples with
        run.sampler.sync(run.model)  # vLLM: push the new weights; HF: nothing to do
    stats = episode_stats(rollouts, rewards)
    return {"reward": rewards.mean(), "tool_rate": stats["tool_rate"], "tokens": stats["tokens"],
            "loss": metrics["loss"], "entropy": metrics["entropy"], "clip_frac": metrics["clip_frac"],
            "frac_zero_advantage": metrics["frac_zero_advantage"], "grad_norm": grad_norm,
            "staleness": metrics.get("staleness_mean", 0.0), "lr": run.scheduler.get_last_lr()[0],
            **{f"drift/{k}": v for k, v in drift.items()},
            # sampler vs trainer: KL k1 / k3, chi-square, ESS, perplexity ratio (trainer/off_policy.py)
            **{f"offpolicy/{k[len('offpolicy_'):]}": v for k, v in metrics.items() if k.startswith("offpolicy_")}}


# ---- 5. evaluate


class Evaluator:
    """Held-out greedy accuracy and pass@k, in the loop or (async mode) on a copy in a thread."""

    def __init__(self, run: Run, background: bool):
        self.run = run
        self.background = BackgroundEval(run.model, self.evaluate_at) if background else None
        self.rollouts = None  # the latest held-out rollouts, for samples.txt

    def evaluate_at(self, step: int, policy, full: bool = True) -> tuple[dict, list]:
        run, args = self.run, self.run.args
        # async: the engine holds an older version and belongs to the producer thread; `policy` is this step's
        engine = None if args.async_staleness is not None else run.sampler.engine
        return evaluate(policy, run.tokenizer, run.env, run.reward_fn, run.held_out, k=args.pass_k,
                        k_problems=min(args.pass_k_size, len(run.held_out)) if full else 0,
                        seed=step_seed(args.seed, step, EVAL_STREAM), temperature=args.temperature,
                        max_new_tokens=args.max_new_tokens, engine=engine)

    def log(self, step: int, report: dict, rollouts: list) -> None:
        k = self.run.args.pass_k
        self.run.logger.log(step, report, prefix="eval/")
        self.rollouts = rollouts
        tqdm.write(f"[step {step}] held-out greedy accuracy {report['accuracy']:.3f}  "
                   f"pass@{k} {report.get(f'pass@{k}', float('nan')):.3f}  "
                   f"greedy tool use {report['greedy_tool_rate']:.2f}")

    def now(self, step: int) -> None:
        self.log(step, *self.evaluate_at(step, self.run.model))

    def submit(self, step: int) -> None:
        """Evaluate this step's weights: now, or on the background copy."""
        if self.background is not None:
            self.background.submit(step, self.run.model)
        else:
            self.now(step)

    def collect(self, wait: bool) -> None:
        for step, report, rollouts in self.background.finished(wait=wait) if self.background else []:
            self.log(step, report, rollouts)

    def final_rollouts(self, step: int) -> list:
        """Held-out greedy rollouts for samples.txt (resumed a finished run: evaluated, not logged)."""
        if self.rollouts is None:
            self.rollouts = self.evaluate_at(step, self.run.model, full=False)[1]
        return self.rollouts

    def close(self) -> None:
        if self.background is not None:
            self.background.close()


# ---- 6. the loop: sample, train, evaluate, checkpoint


def producer_history(run: Run) -> dict:
    """The weights the resumed producer's first batches are sampled by: the checkpoint's in-flight versions
    and the current one. A checkpoint without them (saved by a synchronous run) samples with the current
    weights, and says so."""
    history = {v: sd for v, sd in run.in_flight.items()}
    history[run.start] = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    missing = sorted(v for v in versions_after(run.start, run.args.async_staleness) if v not in history)
    if missing:
        tqdm.write(f"--resume: the checkpoint holds no producer weights of versions {missing}; the next batches are "
                   f"sampled by version {run.start} instead (the run is not the uninterrupted one from here)")
        history.update({v: history[run.start] for v in missing})
    return history


def train(run: Run, evaluator: Evaluator) -> tuple[int, list | None]:
    """Steps start+1..steps; returns (exit status, the last step's first group for samples.txt)."""
    args, model = run.args, run.model
    producer = queue = None
    if args.async_staleness is not None:  # generation in a thread, with weights K versions behind
        weights = copy.deepcopy(model).eval()  # HF samples with this copy; vLLM's engine is pushed from it

        def install(state_dict: dict) -> None:  # in the producer thread, between two batches
            weights.load_state_dict(state_dict)
            run.sampler.sync(weights)  # vLLM: the engine now holds this version (checked); HF: nothing to do

        queue = RolloutQueue(max_staleness=args.async_staleness)
        producer = AsyncProducer(lambda step, version: rollouts_for(run, step, version, weights), queue,
                                 steps=range(run.start + 1, args.steps + 1), apply=install,
                                 version=run.start, history=producer_history(run)).start()
    samples, status, failure = None, 0, None  # failure: (error, exit status), reported once the bar is closed
    bar = tqdm(range(run.start + 1, args.steps + 1), initial=run.start, total=args.steps, desc="GRPO", unit="step",
               dynamic_ncols=True)
    with StopOnSignal() as stop:  # SIGTERM/SIGINT: end this step, save a checkpoint, exit 128 + signal
        for step in bar:
            t0 = time.time()
            rollouts = queue.get(current_version=step - 1) if queue is not None else rollouts_for(run, step, step - 1)
            rewards = run.reward_fn(rollouts, [r.metadata["answer"] for r in rollouts])  # (B,)
            t_gen = time.time() - t0
            try:
                metrics = train_step(run, step, rollouts, rewards)
            except NonFiniteError as e:
                failure = (UsageError(f"step {step}: {e}; the last checkpoint in {run.out / 'checkpoints'} is "
                                      "intact"), 3)
                break
            if producer is not None:
                producer.publish(model.state_dict(), version=step)  # the producer samples with them next
            run.logger.log(step, {**metrics, "gen_seconds": t_gen, "step_seconds": time.time() - t0},
                           prefix="train/")
            bar.set_postfix(reward=f"{rewards.mean():.2f}", tools=f"{metrics['tool_rate']:.2f}")
            samples = (rollouts[: args.group_size], rewards[: args.group_size].tolist())
            stopping = stop.requested  # a signal that comes later in this step is seen at the next boundary
            if step == args.steps or (args.eval_every and step % args.eval_every == 0):
                evaluator.submit(step)
            evaluator.collect(wait=step == args.steps or stopping)
            if step == args.steps or stopping or (args.checkpoint_every and step % args.checkpoint_every == 0):
                try:
                    save_checkpoint(run.out / "checkpoints", step, model, run.optimizer, run.scheduler,
                                    state=checkpoint_state(args, model, step, run.logger.wandb_run_id),
                                    extra={"producer_weights": producer.in_flight(step)} if producer else None)
                except CheckpointError as e:  # a full disk: one line, the partial folder removed
                    failure = (e, 2)
                    break
            if stopping:
                status = stop.exit_status
                tqdm.write(f"stopped after step {step} of {args.steps}: checkpoint saved in "
                           f"{run.out / 'checkpoints'}; continue with --resume")
                break
    bar.close()
    if failure is not None:
        status = fail(failure[0], code=failure[1])
    if producer is not None:
        producer.stop()
    return status, samples


# ---- 7. outputs: final model, curves, sample rollouts, summary table


def write_outputs(run: Run, evaluator: Evaluator, train_samples, seconds: float) -> None:
    args, out = run.args, run.out
    eval_rollouts = evaluator.final_rollouts(args.steps)
    kind = save_pretrained_atomic(run.model, run.tokenizer, out / "final")
    rows = read_metrics(out / "metrics.jsonl")
    change = accuracy_change(rows, args.steps)  # None when metrics.jsonl holds no evaluation (deleted)
    if change is not None:
        plot_curves(rows, out / "curves.png", k=args.pass_k,
                    title=f"GRPO on {args.dataset or 'synthetic arithmetic'}")
    shown = eval_rollouts[:8]
    samples = render_rollouts(shown, run.reward_fn(shown, [r.metadata["answer"] for r in shown]).tolist(),
                              title=f"held-out problems after step {args.steps}, greedy")
    if train_samples is not None:
        samples += "\n" + render_rollouts(*train_samples,
                                          title=f"training rollouts of step {args.steps} (one group)")
    write_atomic(out / "samples.txt", samples)
    if change is None:
        print(f"\n{out / 'metrics.jsonl'} holds no evaluation (was it deleted?): curves.png and summary.md "
              f"are left as they were.\nfinal {kind} model: {out / 'final'}", flush=True)
        return
    summary = (f"{summary_table(rows, args.pass_k)}\n\n{change}; this session trained "
               f"{seconds:.0f} s.\nfinal {kind} model: {out / 'final'}\n")
    write_atomic(out / "summary.md", summary)
    print("\n" + summary, flush=True)


def main(argv: list[str] | None = None) -> int:
    with RunLock() as lock:  # one run at a time per --output-dir, held until main returns
        try:
            run = load(argv, lock)
        except (UsageError, DatasetError) as e:
            return fail(e)
        torch.set_num_threads(run.args.threads)
        seed_everything(run.args.seed)
        build(run)
        try:
            resume(run)
        except UsageError as e:
            return fail(e)
        evaluator = Evaluator(run, background=run.args.async_staleness is not None)
        if run.start == 0:
            evaluator.now(0)  # the warm start
        t_start = time.time()
        status, train_samples = train(run, evaluator)
        evaluator.close()
        run.logger.close()
        if status == 0:
            try:
                write_outputs(run, evaluator, train_samples, time.time() - t_start)
            except CheckpointError as e:  # a full disk writing final/
                return fail(e)
        return status


if __name__ == "__main__":
    sys.exit(main())
