"""GRPO with a calculator tool, end to end, in one loop you can read top to bottom.

    uv run python main.py                                  # embedded tiny model, synthetic arithmetic, CPU
    uv run python main.py --steps 100 --output-dir runs/a  # longer
    uv run python main.py --output-dir runs/a --resume     # continue from the latest complete checkpoint
    uv run python main.py --output-dir runs/a --restart    # start that run over from step 0
    uv run python main.py --model Qwen/Qwen2.5-0.5B-Instruct --lora --dataset my.jsonl

Each step: take `--batch-size` questions -> `--group-size` multi-turn rollouts each (the model
may call the calculator; the env answers) -> reward 1 for a correct \\boxed{} answer ->
GRPO loss -> optimizer step. Held-out greedy accuracy and pass@k are measured before
training and every `--eval-every` steps. Everything lands in `--output-dir`:
metrics.jsonl, curves.png, samples.txt, summary.md, final/ (save_pretrained), checkpoints/.

Exit status: 0 done; 2 bad input (one line on stderr, nothing written); 3 a non-finite update
(nothing saved); 128 + N stopped by signal N: the first SIGTERM (143) or SIGINT (130) ends the
step in progress, saves a checkpoint and exits (continue with --resume); a second one stops at once.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from SimpleTorchLLMRL.env.async_rollouts import AsyncProducer, RolloutQueue
from SimpleTorchLLMRL.env.rollouts import collect_rollouts
from SimpleTorchLLMRL.env.ToolQASolve import ToolUseEnv
from SimpleTorchLLMRL.model.dropout import disable_dropout
from SimpleTorchLLMRL.recipes.calculator.arithmetic import SYSTEM_PROMPT
from SimpleTorchLLMRL.recipes.calculator.cli import UsageError, check_args, fail, load_policy, parse_args
from SimpleTorchLLMRL.recipes.calculator.data import DatasetError, batch_at, check_context, load_data
from SimpleTorchLLMRL.recipes.calculator.evaluate import (
    accuracy_change,
    episode_stats,
    evaluate,
    render_rollouts,
    summary_table,
)
from SimpleTorchLLMRL.recipes.calculator.plots import plot_curves
from SimpleTorchLLMRL.recipes.calculator.resume import checkpoint_state, resume_point, start_over
from SimpleTorchLLMRL.recipes.calculator.train_loop import (
    EVAL_STREAM,
    BackgroundEval,
    Sampler,
    StopOnSignal,
    step_seed,
    trim_metrics,
    write_atomic,
)
from SimpleTorchLLMRL.reward.boxed import BoxedReward
from SimpleTorchLLMRL.tools.calculator import calculator
from SimpleTorchLLMRL.trainer.drift import logprob_drift
from SimpleTorchLLMRL.trainer.GRPO import GRPO
from SimpleTorchLLMRL.utils.checkpoint import (
    load_checkpoint,
    save_checkpoint,
    save_pretrained_atomic,
)
from SimpleTorchLLMRL.utils.metrics import MetricsLogger, read_metrics
from SimpleTorchLLMRL.utils.training import NonFiniteError, clipped_step, seed_everything, warmup_constant


def main(argv: list[str] | None = None) -> int:
    # ---- 1. check every input before anything is written
    args = parse_args(argv)
    try:
        check_args(args)
        train_rows, held_out = load_data(args.dataset, args.eval_size, args.seed)
        model, tokenizer = load_policy(args)
        disable_dropout(model)  # on-policy ratios exactly 1 (a model with dropout trains a random sub-network)
        env = ToolUseEnv([calculator], custom_sys_prompt=SYSTEM_PROMPT, max_turns=args.max_turns)
        check_context(train_rows + held_out, env, tokenizer, model, args.max_new_tokens, args.dataset)
        out = Path(args.output_dir)
        ckpt, saved = resume_point(out, args, model)  # every setting compared before any weight is loaded
    except (UsageError, DatasetError) as e:
        return fail(e)
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)

    # ---- 2. the pieces: env (calculator tool), reward, loss, optimizer
    reward_fn = BoxedReward()  # 1.0 when the last \boxed{} equals the answer
    grpo = GRPO(model, tokenizer, group_size=args.group_size, temperature=args.temperature, beta=0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_constant(args.warmup_steps))
    sampler = Sampler(model, tokenizer, stop_strings=env.stop_strings, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, backend=args.backend, model_name=args.model,
                      adapter=args.qlora)

    # ---- 3. resume: model, optimizer, scheduler, RNG and step from the checkpoint checked in part 1
    start = 0
    if ckpt is not None:
        load_checkpoint(ckpt, model, optimizer, scheduler)
        start = saved["step"]
        sampler.sync(model)
        tqdm.write(f"resumed from {ckpt} (step {start}, data position {saved['data_position']})")
    elif args.resume:
        tqdm.write(f"--resume: no checkpoint in {out / 'checkpoints'}; starting from step 0")
    if args.restart:
        start_over(out)  # the old checkpoints and final model go; metrics.jsonl is rewritten
    out.mkdir(parents=True, exist_ok=True)
    trim_metrics(out / "metrics.jsonl", start)  # a resumed run rewrites what followed its checkpoint
    logger = MetricsLogger(out, use_wandb=args.wandb, config=vars(args), append=start > 0, console=False,
                           run_id=(saved or {}).get("wandb_run_id"))  # a resumed run continues its W&B run

    def evaluate_at(step: int, policy, full: bool = True) -> tuple[dict, list]:
        return evaluate(policy, tokenizer, env, reward_fn, held_out, k=args.pass_k,
                        k_problems=min(args.pass_k_size, len(held_out)) if full else 0,
                        seed=step_seed(args.seed, step, EVAL_STREAM), temperature=args.temperature,
                        max_new_tokens=args.max_new_tokens, engine=sampler.engine)

    def log_eval(step: int, report: dict) -> None:
        logger.log(step, report, prefix="eval/")
        tqdm.write(f"[step {step}] held-out greedy accuracy {report['accuracy']:.3f}  "
                   f"pass@{args.pass_k} {report.get(f'pass@{args.pass_k}', float('nan')):.3f}  "
                   f"greedy tool use {report['greedy_tool_rate']:.2f}")

    def run_eval(step: int, log: bool = True) -> tuple[dict, list]:
        report, rollouts = evaluate_at(step, model, full=log)
        if log:
            log_eval(step, report)
        return report, rollouts

    n_train = sum(p.numel() for p in params)
    tqdm.write(f"{args.model}: {n_train / 1e6:.2f}M trainable parameters; {len(train_rows)} training rows, "
               f"{len(held_out)} held out; output in {out}")
    eval_rollouts = run_eval(0)[1] if start == 0 else None  # the warm start
    train_samples = None

    def rollouts_for(step: int, version: int, weights=None) -> list:
        """The step's episodes: its rows, its seed, sampled by `weights` (default: the training model)."""
        rows = batch_at(train_rows, (step - 1) * args.batch_size, args.batch_size, args.seed)
        generator = sampler.generator(seed=step_seed(args.seed, step), policy_version=version, model=weights)
        return collect_rollouts(generator, env, [r["question"] for r in rows], [r["answer"] for r in rows],
                                group_size=args.group_size)  # (batch_size * group_size,) group-major

    producer = queue = background = None
    if args.async_staleness is not None:  # generation in a thread, on a copy of the weights, K versions behind
        weights = copy.deepcopy(model).eval()
        queue = RolloutQueue(max_staleness=args.async_staleness)
        producer = AsyncProducer(lambda step, version: rollouts_for(step, version, weights), queue,
                                 steps=range(start + 1, args.steps + 1), apply=weights.load_state_dict,
                                 version=start).start()
        background = BackgroundEval(model, evaluate_at)  # held-out evaluations on a third copy, in a thread

    # ---- 4. the loop
    t_start, stopping = time.time(), False
    bar = tqdm(range(start + 1, args.steps + 1), initial=start, total=args.steps, desc="GRPO", unit="step",
               dynamic_ncols=True)
    with StopOnSignal() as stop:  # SIGTERM/SIGINT: end this step, save a checkpoint, exit 128 + signal
        for step in bar:
            t0 = time.time()
            rollouts = queue.get(current_version=step - 1) if queue is not None else rollouts_for(step, step - 1)
            rewards = reward_fn(rollouts, [r.metadata["answer"] for r in rollouts])  # (B,)
            t_gen = time.time() - t0

            model.train()
            grpo.policy_version = step - 1  # optimizer steps taken: staleness = this - the sampling version
            prepared = grpo.prepare(rollouts, rewards)  # advantages; the sampled log-probs are the old policy
            drift_parts = []  # (micro-batch, the trainer's log-probs of its sampled tokens) for the drift report
            for micro in prepared.split(args.micro_batch_size):  # each micro-batch keeps the full normalizer
                grpo.calculate_loss(micro).backward()
                drift_parts.append((micro.batch, grpo.token_logprobs))
            try:
                grad_norm = clipped_step(optimizer, max_grad_norm=1.0)  # refuses NaN/inf before anything is saved
            except NonFiniteError as e:
                logger.close()
                return fail(UsageError(f"step {step}: {e}; the last checkpoint in {out / 'checkpoints'} is intact"),
                            code=3)
            scheduler.step()
            sampler.sync(model)  # vLLM: push the new weights; HF: nothing to do
            if producer is not None:
                producer.publish(model.state_dict(), version=step)  # the producer samples with them next

            stats = episode_stats(rollouts, rewards)
            logger.log(step, {"reward": rewards.mean(), "tool_rate": stats["tool_rate"], "tokens": stats["tokens"],
                              "loss": grpo.metrics["loss"], "entropy": grpo.metrics["entropy"],
                              "clip_frac": grpo.metrics["clip_frac"],
                              "frac_zero_advantage": grpo.metrics["frac_zero_advantage"], "grad_norm": grad_norm,
                              "staleness": grpo.metrics.get("staleness_mean", 0.0),
                              "lr": scheduler.get_last_lr()[0], "gen_seconds": t_gen, "step_seconds": time.time() - t0,
                              # sampled vs recomputed log-probs, per role / agent and the worst message
                              **{f"drift/{k}": v for k, v in logprob_drift(rollouts, drift_parts).summary().items()}},
                       prefix="train/")
            bar.set_postfix(reward=f"{rewards.mean():.2f}", tools=f"{stats['tool_rate']:.2f}")

            train_samples = (rollouts[: args.group_size], rewards[: args.group_size].tolist())
            stopping = stop.requested  # a signal that comes later in this step is seen at the next boundary
            if step == args.steps or (args.eval_every and step % args.eval_every == 0):
                if background is not None:
                    background.submit(step, model)
                else:
                    eval_rollouts = run_eval(step)[1]
            for eval_step, report, held_out_rollouts in (background.finished(wait=step == args.steps or stopping)
                                                         if background else []):
                log_eval(eval_step, report)
                eval_rollouts = held_out_rollouts
            if step == args.steps or stopping or (args.checkpoint_every and step % args.checkpoint_every == 0):
                save_checkpoint(out / "checkpoints", step, model, optimizer, scheduler,
                                state=checkpoint_state(args, model, step, logger.wandb_run_id))
            if stopping:
                break
    bar.close()
    if producer is not None:
        producer.stop()
        background.close()
    if stopping:
        logger.close()
        tqdm.write(f"stopped after step {step} of {args.steps}: checkpoint saved in {out / 'checkpoints'}; "
                   "continue with --resume")
        return stop.exit_status

    # ---- 5. outputs: final model, curves, sample rollouts, summary table
    if eval_rollouts is None:  # resumed a finished run: greedy rollouts for samples.txt, not logged
        eval_rollouts = run_eval(args.steps, log=False)[1]
    logger.close()
    kind = save_pretrained_atomic(model, tokenizer, out / "final")
    rows = read_metrics(out / "metrics.jsonl")
    change = accuracy_change(rows, args.steps)  # None when metrics.jsonl holds no evaluation (deleted)
    if change is not None:
        plot_curves(rows, out / "curves.png", k=args.pass_k,
                    title=f"GRPO on {args.dataset or 'synthetic arithmetic'}")
    shown = eval_rollouts[:8]
    samples = render_rollouts(shown, reward_fn(shown, [r.metadata["answer"] for r in shown]).tolist(),
                              title=f"held-out problems after step {args.steps}, greedy")
    if train_samples is not None:
        samples += "\n" + render_rollouts(*train_samples, title=f"training rollouts of step {args.steps} (one group)")
    write_atomic(out / "samples.txt", samples)
    if change is None:
        print(f"\n{out / 'metrics.jsonl'} holds no evaluation (was it deleted?): curves.png and summary.md "
              f"are left as they were.\nfinal {kind} model: {out / 'final'}", flush=True)
        return 0
    summary = (f"{summary_table(rows, args.pass_k)}\n\n{change}; this session trained "
               f"{time.time() - t_start:.0f} s.\nfinal {kind} model: {out / 'final'}\n")
    write_atomic(out / "summary.md", summary)
    print("\n" + summary, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
