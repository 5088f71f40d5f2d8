"""The two sides of `grpo_vs_trl.py`: one GRPO step of SimpleTorchLLMRL and of TRL's `GRPOTrainer`, per process.

Legend: V vocab, B = prompts x group sequences, N new tokens.

Each side builds the same random-init model and tokenizer, runs one untimed warm-up step
and then timed steps, and returns seconds per phase (wall and CPU clocks; on CUDA every
clock reading synchronizes the device first), the sequence shape, and memory.

Phases of a step:
    generate      prompts -> sampled completions (tokenize, model.generate, decode)
    old_logprobs  encode/collate, rewards, advantages, and an old-policy log-prob
                  pass if the side needs one (neither does here)
    loss_backward policy log-probs, loss, backward
    optimizer     grad clipping, optimizer.step, zero_grad (TRL: + lr scheduler)
    total         the whole step (TRL: on_step_end to on_step_end, so all its overhead)

Variants: `ours` (the library's defaults plus `GRPO(share_prefix=True)`: each group's prompt is
prefilled once in generation and run once in the training forward), `ours_unshared` (both
off: every row runs its whole sequence, as TRL does), `ours_liger` (`ours` with Liger's Triton kernels for
RMSNorm, SwiGLU and RoPE in the body, `model.scoring.liger.apply_liger_kernels`; CUDA only), `ours_lora` (`ours`
with LoRA r=16 adapters in the base dtype, `model.lora.apply_lora`), `trl`, and
`trl_liger` (TRL with `use_liger_kernel=True`: the same body kernels and Liger's fused GRPO loss; CUDA only).

`GRPO_SIDES_HEAD_IMPL` (environment) sets our side's `head_impl` (default "auto").
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig

CLOCKS = ("wall", "cpu")  # perf_counter and process_time: with 1 thread, CPU seconds do not count waiting for a core
LR = 1e-6
QWEN25_05B = dict(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32_768,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                  use_sliding_window=False, sliding_window=32_768, max_window_layers=24, attention_dropout=0.0,
                  initializer_range=0.02)


@dataclass(frozen=True)
class Shape:
    prompts: int
    group: int
    new_tokens: int
    model: str  # "tiny" (2 layers, hidden 64, V from --vocab) or "qwen2.5-0.5b"
    description: str


SHAPES = {
    "tiny": Shape(16, 4, 64, "tiny", "Qwen2 random init, 2 layers, hidden 64, tied embeddings"),
    "qwen2.5-0.5b": Shape(4, 4, 32, "qwen2.5-0.5b", "Qwen2.5-0.5B config, random init: 24 layers, hidden 896, "
                                                    "14/2 heads, V=151,936, tied embeddings (494M parameters)"),
    # a GPU-sized batch of the same model (the CPU shape above is sized for a 2-core machine)
    "qwen2.5-0.5b-gpu": Shape(16, 8, 256, "qwen2.5-0.5b", "Qwen2.5-0.5B config, random init, bf16 on one GPU"),
}
VARIANTS = ("ours", "ours_unshared", "ours_liger", "ours_lora", "trl", "trl_liger")


@dataclass
class Settings:
    """What one process runs: set once by `configure` before a side is built."""

    shape: Shape = SHAPES["tiny"]
    device: str = "cpu"
    dtype: str = "float32"
    gradient_checkpointing: bool = False


RUN = Settings()


def configure(shape: str, device: str, dtype: str, gradient_checkpointing: bool = False) -> None:
    RUN.shape, RUN.device, RUN.dtype = SHAPES[shape], device, dtype
    RUN.gradient_checkpointing = gradient_checkpointing


def prompts() -> list[str]:
    return [f"What is {i + 12} + {3 * i + 35}? Think, then answer in \\boxed{{}}." for i in range(RUN.shape.prompts)]


def constant_reward(prompts=None, completions=None, **kwargs):
    """TRL's reward-function signature: 1.0 for every completion."""
    return [1.0] * len(completions)


def _clock() -> tuple[float, float]:
    if RUN.device == "cuda":
        import torch

        torch.cuda.synchronize()
    return time.perf_counter(), time.process_time()


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def maxrss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def cuda_mb(peak: bool) -> float | None:
    if RUN.device != "cuda":
        return None
    import torch

    return (torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()) / 2**20


class Profile:
    """cProfile (CPU-time clock) of the last (timed) step when a path is given; a no-op otherwise."""

    def __init__(self, path: str | None, steps: int):
        import cProfile

        self.path, self.last = path, steps - 1
        self.prof = cProfile.Profile(time.process_time) if path else None

    def start(self, step: int) -> None:
        if self.prof is not None and step == self.last:
            self.prof.enable()

    def stop(self, step: int) -> None:
        if self.prof is not None and step == self.last:
            self.prof.disable()
            self.prof.dump_stats(self.path)


_BUILT: dict = {}  # one model per process: a second run (gradient checkpointing on) reuses the first's


def build(vocab: int):
    """(tokenizer, model): the shape's model, random init, on the run's device and dtype, in eval mode;
    built once per process and (vocab, shape, device, dtype)."""
    key = (vocab, RUN.shape.model, RUN.device, RUN.dtype)
    if key not in _BUILT:
        _BUILT[key] = _build(vocab)
    tok, model = _BUILT[key]
    return tok, model.eval()


def _build(vocab: int):
    import torch

    from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer("chatml")
    dtype = getattr(torch, RUN.dtype)
    if RUN.shape.model == "tiny":
        model = tiny_model("qwen2", tok, vocab_size=vocab, hidden_size=64, num_layers=2)
    else:
        from transformers import AutoModelForCausalLM, Qwen2Config

        config = Qwen2Config(**QWEN25_05B, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             bos_token_id=tok.eos_token_id)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
    return tok, model.to(device=RUN.device, dtype=dtype).eval()


class Timers:
    """Accumulated (wall, CPU) seconds of wrapped methods; wraps instance attributes, so only that object."""

    def __init__(self):
        self.acc: dict[str, tuple[float, float]] = {}

    def wrap(self, obj, name: str, key: str | None = None) -> None:
        fn = getattr(obj, name)
        key = key or name

        def timed(*a, **k):
            c0 = _clock()
            try:
                return fn(*a, **k)
            finally:
                c1, acc = _clock(), self.acc.get(key, (0.0, 0.0))
                self.acc[key] = (acc[0] + c1[0] - c0[0], acc[1] + c1[1] - c0[1])

        setattr(obj, name, timed)

    def snapshot(self) -> dict[str, tuple[float, float]]:
        return dict(self.acc)


def _setup_memory() -> dict:
    return {"rss_after_setup_mb": rss_mb(), "maxrss_after_setup_mb": maxrss_mb(), "cuda_after_setup_mb": cuda_mb(False)}


_ADAPTED: dict = {}  # (liger, lora) -> the model with them applied, once per process


def _ours_model(vocab: int, liger: bool, lora: bool):
    tok, model = build(vocab)
    if (liger, lora) not in _ADAPTED:
        if liger:
            from SimpleTorchLLMRL.model.scoring.liger import apply_liger_kernels

            apply_liger_kernels(model)
        if lora:  # r=16 on every linear of the body, adapters in the base dtype (bf16)
            from SimpleTorchLLMRL.model.lora import apply_lora

            model = apply_lora(model, r=16, alpha=32)
        _ADAPTED[(liger, lora)] = model
    return tok, _ADAPTED[(liger, lora)].eval()


def run_ours(vocab: int, steps: int = 2, profile: str | None = None, share: bool = True,
             liger: bool = False, lora: bool = False) -> dict:
    import torch

    from SimpleTorchLLMRL.chat.message import Message, Rollout
    from SimpleTorchLLMRL.model.generation.generator import ModelGenerate, extend_groups
    from SimpleTorchLLMRL.trainer.grpo import GRPO

    tok, model = _ours_model(vocab, liger, lora)
    G = RUN.shape.group
    gen = ModelGenerate(model, tok,
                        sampling=SamplingConfig(max_new_tokens=RUN.shape.new_tokens, temperature=1.0,
                                                eos_token_ids=[vocab + 7]))  # never sampled: every row runs N tokens, like min_new_tokens
    gen.backend.share_prefill = share
    grpo = GRPO(model, tok, beta=0.0, group_size=G, temperature=1.0, share_prefix=share,
                head_impl=os.environ.get("GRPO_SIDES_HEAD_IMPL", "auto"))
    if RUN.gradient_checkpointing:  # active in train mode only: generation (eval mode) keeps its KV cache
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    base = [Rollout([Message(p)]) for p in prompts()]
    timers = Timers()
    timers.wrap(model, "generate", "model_generate")
    setup = _setup_memory()
    steps_out = []
    prof = Profile(profile, steps)
    for step in range(steps):
        torch.manual_seed(step)
        prof.start(step)
        acc0 = timers.snapshot()
        c0 = _clock()
        model.eval()
        rollouts = extend_groups(base, gen.generate(base, n=G))  # B rollouts
        c1 = _clock()
        rewards = torch.tensor(constant_reward(completions=rollouts))
        tb = grpo.prepare(rollouts, rewards)
        c2 = _clock()
        model.train()
        loss = grpo.calculate_loss(tb)
        loss.backward()
        c3 = _clock()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        c4 = _clock()
        prof.stop(step)
        acc1 = timers.snapshot().get("model_generate", (0.0, 0.0))  # the fast decode never calls it
        t = {clock: dict(generate=c1[i] - c0[i], old_logprobs=c2[i] - c1[i], loss_backward=c3[i] - c2[i],
                         optimizer=c4[i] - c3[i], total=c4[i] - c0[i],
                         model_generate=acc1[i] - acc0.get("model_generate", (0.0, 0.0))[i])
             for i, clock in enumerate(CLOCKS)}
        steps_out.append({"times": t, "old_logprob_pass": tb.old_logprobs is not None,
                          "seq_shape": list(tb.batch.input_ids.shape), "trained_tokens": int(tb.mask.sum()),
                          "new_tokens": [len(r[-1].token_ids) for r in rollouts]})
    return {**setup, "steps": steps_out}


def run_trl(vocab: int, steps: int = 2, profile: str | None = None, liger: bool = False) -> dict:
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok, model = build(vocab)
    shape = RUN.shape
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts()]})
    out_dir = tempfile.mkdtemp(prefix="trl_bench_")
    args = GRPOConfig(
        output_dir=out_dir, use_cpu=RUN.device == "cpu", report_to="none", bf16=RUN.dtype == "bfloat16",
        fp16=False, gradient_checkpointing=RUN.gradient_checkpointing, per_device_train_batch_size=shape.prompts * shape.group,
        gradient_accumulation_steps=1, num_generations=shape.group, max_completion_length=shape.new_tokens,
        generation_kwargs={"min_new_tokens": shape.new_tokens}, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, loss_type="grpo", scale_rewards="group", learning_rate=LR, weight_decay=0.0,
        optim="adamw_torch_fused", max_grad_norm=1.0, max_steps=steps, logging_steps=10_000,
        save_strategy="no", seed=0, dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
        use_liger_kernel=liger,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=constant_reward, args=args, train_dataset=data,
                          processing_class=tok)
    timers = Timers()
    timers.wrap(trainer, "_generate", "generate")
    timers.wrap(trainer, "_generate_and_score_completions", "score")
    timers.wrap(trainer, "_prepare_inputs", "prepare_inputs")
    timers.wrap(trainer, "training_step", "training_step")
    timers.wrap(trainer, "_get_per_token_logps_and_entropies", "logps_forward")
    timers.wrap(model, "generate", "model_generate")
    marks: list[dict] = []
    captured: dict = {}
    prof = Profile(profile, steps)

    class Marks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            prof.start(state.global_step)
            marks.append({"event": "begin", "t": _clock(), "acc": timers.snapshot()})

        def on_step_end(self, args, state, control, **kw):
            marks.append({"event": "end", "t": _clock(), "acc": timers.snapshot()})
            prof.stop(state.global_step - 1)

    # training_step's end is the optimizer phase's start: wrap it to stamp that moment
    ts = trainer.training_step

    def training_step(*a, **k):
        r = ts(*a, **k)
        marks.append({"event": "after_training_step", "t": _clock(), "acc": timers.snapshot()})
        return r

    trainer.training_step = training_step
    orig_score = trainer._generate_and_score_completions

    def score(inputs):
        out = orig_score(inputs)
        captured["shape"] = [int(out["prompt_ids"].shape[0]),
                             int(out["prompt_ids"].shape[1] + out["completion_ids"].shape[1])]
        captured["new_tokens"] = out["completion_mask"].sum(-1).tolist()
        captured["old_logprob_pass"] = out.get("old_per_token_logps") is not None
        return out

    trainer._generate_and_score_completions = score
    trainer.add_callback(Marks())
    setup = {**_setup_memory(), "optimizer": None}
    torch.manual_seed(0)
    trainer.train()
    setup["optimizer"] = type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__
    steps_out = []
    ends = [m for m in marks if m["event"] == "end"]
    begins = [m for m in marks if m["event"] == "begin"]
    afters = [m for m in marks if m["event"] == "after_training_step"]
    for k in range(len(ends)):
        b, a, e = begins[k], afters[k], ends[k]
        t = {}
        for i, clock in enumerate(CLOCKS):
            d = lambda key: e["acc"].get(key, (0.0, 0.0))[i] - b["acc"].get(key, (0.0, 0.0))[i]  # noqa: E731, B023
            gen_t, score_t, prep_t, step_t = d("generate"), d("score"), d("prepare_inputs"), d("training_step")
            t[clock] = {"generate": gen_t, "old_logprobs": prep_t - gen_t, "loss_backward": step_t - prep_t,
                        "optimizer": e["t"][i] - a["t"][i], "total": e["t"][i] - (ends[k - 1] if k else b)["t"][i],
                        "model_generate": d("model_generate"), "score": score_t, "logps_forward": d("logps_forward")}
        steps_out.append({"times": t})
    steps_out[-1].update(seq_shape=captured.get("shape"), new_tokens=captured.get("new_tokens"),
                         old_logprob_pass=captured.get("old_logprob_pass"))
    return {**setup, "steps": steps_out}


def run(variant: str, vocab: int, steps: int, profile: str | None) -> dict:
    if variant.startswith("ours"):
        return run_ours(vocab, steps, profile, share=variant != "ours_unshared", liger=variant == "ours_liger",
                        lora=variant == "ours_lora")
    return run_trl(vocab, steps, profile, liger=variant == "trl_liger")


def env() -> None:
    """Offline, quiet: nothing in a benchmark process reaches the network."""
    for key, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                       ("WANDB_MODE", "disabled"), ("TRANSFORMERS_VERBOSITY", "error")):
        os.environ.setdefault(key, value)
