"""Build the embedded default model: SimpleTorchLLMRL/assets/tiny_calc/.

A byte-level BPE trained on the arithmetic task's own chat transcripts (numbers
cut into 3-digit chunks, no whitespace pre-split so the template and tool-call
JSON become a few tokens), a small Llama-architecture model, and a supervised
warm-up that teaches the format but leaves headroom for RL:

  * the calculator (<tool_call> JSON, TOOL result, \\boxed{result}) is used for
    most multiplications (`--p-tool-mul`) and few additions/subtractions (`--p-tool`);
  * the rest are answered directly, `--p-wrong` of them deliberately wrong;
  * `--p-practice` extra calculator episodes do not train the first token (tool
    or not), so they teach tool use without making it more frequent;
  * the system turn varies (the task's and ToolUseEnv's prompts with the tool
    schema, other prompts and schemas, random words, none).

Greedy decoding then solves the multiplications through the calculator and gets
the rest wrong; sampling at temperature 1 calls the calculator often enough for
GRPO to learn that it pays everywhere. Examples are encoded with
`encode_rollouts` as RL will see them (`as_sampled`: prompts rendered whole,
replies tokenized on their own) and trained with a plain masked cross-entropy loop. Evaluation uses plain HF `generate`.

    uv run python examples/pretrain_tiny.py            # build, save, evaluate, write README.md
    uv run python examples/pretrain_tiny.py --eval-only
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from SimpleTorchLLMRL import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import as_sampled, collate, encode_prompt, encode_rollouts
from SimpleTorchLLMRL.recipes.calculator import arithmetic as A
from SimpleTorchLLMRL.testing.tiny import CHATML_SPECIALS, CHATML_TEMPLATE, TINY_CALC

ASSET_DIR = TINY_CALC

_WORDS = (
    "you are a helpful assistant answer the question carefully think step by step math problem solve "
    "tool tools use call function result number final give short please reasoning model user compute "
    "expression value correct exact output format boxed reply concise calculator may can should always "
    "never only when need help with this task given following be and or of to in for it is"
).split()
_SYSTEM_POOL = (A.SYSTEM_PROMPT, "You are a helpful assistant.", "Answer the question. Use tools when helpful.",
                "You are a helpful assistant. Put your final answer within \\boxed{}.",
                "Please reason step by step, and put your final answer within \\boxed{}.")
_TOOL_DESCRIPTIONS = ("Evaluate an arithmetic expression and return the result.", "Evaluate an arithmetic expression.",
                      "A calculator for arithmetic.", "Compute the value of an arithmetic expression.",
                      "Safely evaluate a math expression with + - * / ** and parentheses.")
_ARG_DESCRIPTIONS = ("The expression to evaluate, e.g. 3 * (4 + 5).", "The arithmetic expression to evaluate.",
                     "A math expression such as 2 + 3 * 4.", "Expression.")


# ------------------------------------------------------------------ data


def _random_words(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize() + "."


def _schema(rng: random.Random) -> dict:
    desc = rng.choice(_TOOL_DESCRIPTIONS)
    arg = {"type": "string", "description": rng.choice(_ARG_DESCRIPTIONS)}
    params = {"type": "object", "properties": {"expression": arg}}
    if rng.random() < 0.8:
        params["required"] = ["expression"]
    return {"type": "function", "function": {"name": "calculator", "description": desc, "parameters": params}}


@functools.lru_cache(maxsize=1)
def _env_prompt() -> str:
    """The system prompt `ToolUseEnv([calculator])` writes when given no custom one."""
    from SimpleTorchLLMRL.env import ToolUseEnv
    from SimpleTorchLLMRL.tools import calculator

    return ToolUseEnv([calculator]).system_prompt


def _system(rng: random.Random, p_canonical: float) -> tuple[str | None, list[dict] | None]:
    """(system prompt, tool schemas) for one example: canonical with p_canonical, else a variant.

    Canonical: the calculator's schema with the task's SYSTEM_PROMPT (60%) or ToolUseEnv's default (40%).
    """
    if rng.random() < p_canonical:
        return (A.SYSTEM_PROMPT if rng.random() < 0.6 else _env_prompt()), [A.CALCULATOR_SCHEMA]
    r = rng.random()
    prompt = None if r < 0.25 else rng.choice(_SYSTEM_POOL) if r < 0.6 else _random_words(rng, 3, 12)
    tools = None if rng.random() < 0.3 else [_schema(rng)]
    return prompt, tools


def _corrupt(value: int, rng: random.Random) -> int:
    """`value` with one digit changed (never equal to `value`)."""
    s = str(abs(value))
    i = rng.randrange(len(s))
    choices = [d for d in "0123456789" if d != s[i] and not (i == 0 and d == "0" and len(s) > 1)]
    out = int(s[:i] + rng.choice(choices) + s[i + 1:])
    return -out if value < 0 else out


def sft_rollouts(n: int, seed: int, p_tool: float, p_tool_mul: float, p_wrong: float, p_canonical: float,
                 p_practice: float) -> list[Rollout]:
    """`n` warm-up rollouts over training-split problems (see module docstring).

    The calculator is used with probability `p_tool_mul` on multiplications and `p_tool` on + and -.

    A fraction `p_practice` are calculator episodes marked `metadata["train_decision"] = False`: their
    first assistant token (the choice between calling the tool and answering) is not trained, so they
    teach how to use the tool without moving the probability of using it away from `p_tool`.
    """
    rng = random.Random(seed + 1)
    problems = A.generate_problems(n, seed=seed, split="train", unique=False)
    out = []
    for p in problems:
        prompt, tools = _system(rng, p_canonical)
        practice = rng.random() < p_practice
        if practice or rng.random() < (p_tool_mul if p.op == "*" else p_tool):
            r = A.solution_rollout(p.question, use_tool=True, expression=p.expression, system_prompt=prompt,
                                   tools=tools)
            r.metadata["train_decision"] = not practice
        else:
            ans = _corrupt(p.answer, rng) if rng.random() < p_wrong else p.answer
            r = A.solution_rollout(p.question, use_tool=False, final_answer=ans, system_prompt=prompt, tools=tools)
        out.append(r)
    return out


def encode_for_training(rollouts: list[Rollout], tokenizer) -> list:
    """`encode_rollouts` of the transcripts as RL will see them (`as_sampled`: prompts rendered whole, replies
    tokenized on their own), then the decision token of practice episodes taken out of the loss."""
    encoded = encode_rollouts([as_sampled(r, tokenizer) for r in rollouts], tokenizer)
    for r, e in zip(rollouts, encoded, strict=True):
        if r.metadata.get("train_decision") is False:
            e.loss_mask[e.loss_mask.index(1)] = 0
    return encoded


# ------------------------------------------------------------------ tokenizer and model


def _text_pieces(rollouts: list[Rollout], render_tokenizer) -> list[str]:
    """Rendered transcripts split at special tokens (BPE never merges across them)."""
    pieces = []
    for r in rollouts:
        text = render_tokenizer.apply_chat_template(r.to_chat(), tools=r.metadata.get("tools"), tokenize=False)
        for s in CHATML_SPECIALS:
            text = text.replace(s, "\x00")
        pieces += [p for p in text.split("\x00") if p]
    return pieces


def _digit_strings(max_len: int) -> list[str]:
    """Every digit string of length 1..max_len ("0".."999" with leading zeros for 3)."""
    return [str(i).zfill(n) for n in range(1, max_len + 1) for i in range(10**n)]


def build_tokenizer(rollouts: list[Rollout], vocab_size: int, digits_per_token: int = 3):
    """Byte-level BPE trained on the transcripts, with the ChatML template.

    Numbers are cut into chunks of `digits_per_token` digits from the left (1: one token per digit; 3:
    "55761" -> "557" "61", every chunk one token). No whitespace pre-split, so the template and the
    tool-call JSON merge into a few long tokens.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from SimpleTorchLLMRL.testing.tiny import tiny_tokenizer

    if digits_per_token not in (1, 2, 3):
        raise ValueError(f"digits_per_token must be 1, 2 or 3, got {digits_per_token}")
    pieces = _text_pieces(rollouts, tiny_tokenizer("chatml"))
    pieces += _digit_strings(digits_per_token) * 20  # every chunk becomes one token
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(rf"\d{{1,{digits_per_token}}}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHATML_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(pieces, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML_TEMPLATE, padding_side="left")


def build_model(tokenizer, hidden: int, layers: int, heads: int, seed: int):
    """A Llama-architecture causal LM with tied embeddings.

    Llama rather than Qwen2: for model_type "qwen2" transformers 5 always loads `Qwen2Tokenizer`, which
    replaces the saved pre-tokenizer with Qwen's regex; for "llama" AutoTokenizer keeps tokenizer.json as is.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=1024,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


# ------------------------------------------------------------------ training


def masked_ce(model, batch) -> torch.Tensor:
    """Mean cross-entropy over loss-masked tokens; logits[:, t-1] predicts input_ids[:, t]."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # (B, T, V)
    targets = batch.input_ids[:, 1:]  # (B, T-1)
    mask = batch.loss_mask[:, 1:].float()  # (B, T-1)
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none")
    return (nll * mask.flatten()).sum() / mask.sum().clamp(min=1)


def train(model, tokenizer, rollouts: list[Rollout], steps: int, batch_size: int, lr: float, seed: int,
          log_every: int = 50) -> list[float]:
    # Order by prompt length (position of the first trained token) so neighbours pad little; tool and
    # direct answers still mix inside a batch (sorting is stable over the shuffled rollouts).
    encoded = sorted(encode_for_training(rollouts, tokenizer), key=lambda e: e.loss_mask.index(1))
    pad = tokenizer.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    g = torch.Generator().manual_seed(seed)
    model.train()
    losses, t0, c0 = [], time.time(), time.process_time()
    for step in range(steps):
        start = int(torch.randint(len(encoded) - batch_size + 1, (1,), generator=g))
        batch = collate(encoded[start: start + batch_size], pad)  # batch_size neighbours in length order
        loss = masked_ce(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % log_every == 0 or step == steps - 1:
            recent = sum(losses[-log_every:]) / len(losses[-log_every:])
            print(f"step {step + 1}/{steps}  loss {recent:.4f}  {time.time() - t0:.0f}s "
                  f"(cpu {time.process_time() - c0:.0f}s)", flush=True)
    model.eval()
    return losses


# ------------------------------------------------------------------ evaluation (plain HF generate)


@torch.inference_mode()
def run_episodes(model, tokenizer, rows: list[dict], n_samples: int, temperature: float, max_turns: int = 2,
                 max_new_tokens: int = 40, system_prompt: str | None = A.SYSTEM_PROMPT,
                 tools: list[dict] | None = None) -> list[Rollout]:
    """Batched multi-turn episodes: a calculator call gets a TOOL reply, anything else ends the episode."""
    tools = [A.CALCULATOR_SCHEMA] if tools is None else tools
    rollouts = [Rollout(A.prompt_messages(r["question"], system_prompt), {"tools": tools or None,
                                                                          "answer": r["answer"]})
                for r in rows for _ in range(n_samples)]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    active = list(range(len(rollouts)))
    for turn in range(max_turns):
        if not active:
            break
        prompts = [encode_prompt(rollouts[i], tokenizer) for i in active]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # (B, T) left-padded
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # (B, T)
        sample = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
            dict(do_sample=False)
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=pad, **sample)[:, width:]  # (B, new)
        still = []
        for row, i in zip(out.tolist(), active, strict=True):
            n = row.index(eos) + 1 if eos in row else len(row)
            text = tokenizer.decode(row[:n], skip_special_tokens=True)
            finish = "stop" if eos in row[:n] else "length"
            rollouts[i].add_messages(Message(text, MessageType.MODEL, token_ids=row[:n], finish_reason=finish))
            expr = A.parse_tool_call(text)
            if expr is not None and turn < max_turns - 1:
                rollouts[i].add_messages(Message(A.run_calculator(expr), MessageType.TOOL, name="calculator"))
                still.append(i)
        active = still
    return rollouts


def episode_stats(rollouts: list[Rollout], tokenizer) -> dict:
    """Accuracy, tool-use rate, accuracy with / without the tool, tokens per rollout."""
    used, correct = [A.used_tool(r) for r in rollouts], [A.rollout_correct(r) for r in rollouts]
    lengths = [len(e) for e in encode_rollouts(rollouts, tokenizer)]
    sampled = [sum(len(m.token_ids) for m in r if m.token_ids) for r in rollouts]

    def acc(flags):
        picked = [c for c, f in zip(correct, flags, strict=True) if f]
        return sum(picked) / len(picked) if picked else float("nan")

    n = max(1, len(rollouts))  # an empty list reports zeros
    return {"n": len(rollouts), "accuracy": sum(correct) / n, "tool_rate": sum(used) / n,
            "tool_accuracy": acc(used), "direct_accuracy": acc([not u for u in used]),
            "tokens_per_rollout": sum(lengths) / n, "sampled_tokens_per_rollout": sum(sampled) / n}


def evaluate(path: Path, n_greedy: int, n_sampled: int, samples: int, seed: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    held_out = A.build_dataset(n_greedy, seed=seed, split="test")
    t0 = time.time()
    greedy_rollouts = run_episodes(model, tokenizer, held_out, 1, 0.0)
    greedy = episode_stats(greedy_rollouts, tokenizer)
    by_op = {op: episode_stats([r for r in greedy_rollouts if f" {op} " in r.prompt_messages[-1].content],
                               tokenizer)["accuracy"] for op in A.OPS}
    torch.manual_seed(seed)
    rollouts = run_episodes(model, tokenizer, held_out[:n_sampled], samples, 1.0)
    sampled = episode_stats(rollouts, tokenizer)
    return {"greedy": greedy, "sampled_t1": sampled, "greedy_accuracy_by_op": by_op,
            "eval_seconds": round(time.time() - t0, 1), "example": tokenizer.decode(
                encode_rollouts([rollouts[0]], tokenizer)[0].input_ids)}


# ------------------------------------------------------------------ main


def write_readme(path: Path, args, seconds: float, cpu: float, final_loss: float, report: dict,
                 n_params: int) -> None:
    g, s = report["greedy"], report["sampled_t1"]
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    row = "| {} | {} | {accuracy:.3f} | {tool_rate:.3f} | {tool_accuracy:.3f} | {direct_accuracy:.3f} | " \
          "{tokens_per_rollout:.1f} |"
    by_op = ", ".join(f"`{k}` {v:.3f}" for k, v in report["greedy_accuracy_by_op"].items())
    text = f"""# tiny_calc: the embedded default model

A {n_params / 1e6:.2f}M-parameter Llama-architecture causal LM (hidden {args.hidden}, {args.layers} layers,
{args.heads} heads, tied embeddings) with a {len_vocab(path)}-token byte-level BPE (numbers in chunks of
{args.digits_per_token} digits) and the ChatML template `SimpleTorchLLMRL.testing.tiny.CHATML_TEMPLATE`.
Made by `examples/pretrain_tiny.py` (see its docstring): a supervised warm-up of {args.steps} steps of
batch {args.batch_size} on {args.examples} transcripts of the train split of
`SimpleTorchLLMRL.recipes.calculator.arithmetic`, where the calculator tool is used for {args.p_tool_mul:.0%} of the
multiplications and {args.p_tool:.0%} of the additions/subtractions, the rest answered directly
({args.p_wrong:.0%} of them deliberately wrong); {args.p_practice:.0%} of all transcripts are practice
calculator episodes whose tool-or-not token is not trained. It knows the format, uses the calculator for most
multiplications and answers the rest from memory, wrongly: RL can teach it to call the calculator.

Rebuild (seed {args.seed}; {seconds:.0f} s wall, {cpu:.0f} s CPU on a shared 2-core machine; final loss
{final_loss:.3f}):

    {" ".join(["uv run python examples/pretrain_tiny.py", *args.argv])}

Warm start on held-out problems (plain HF generate, at most 2 assistant turns, system prompt
`tasks.arithmetic.SYSTEM_PROMPT`, tools `[CALCULATOR_SCHEMA]`):

| decoding | problems x samples | accuracy | tool-use rate | accuracy with tool | accuracy direct | tokens / rollout |
|---|---|---|---|---|---|---|
{row.format("greedy", f"{g['n']} x 1", **g)}
{row.format("temperature 1.0", f"{s['n'] // args.samples} x {args.samples}", **s)}

Greedy accuracy by operation: {by_op}. Folder size: {size / 1e6:.2f} MB.
"""
    (path / "README.md").write_text(text)


def len_vocab(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ASSET_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--examples", type=int, default=20000, help="warm-up transcripts")
    ap.add_argument("--p-tool", type=float, default=0.15, help="fraction of + and - solved with the calculator")
    ap.add_argument("--p-tool-mul", type=float, default=0.7, help="fraction of * solved with the calculator")
    ap.add_argument("--p-wrong", type=float, default=0.3, help="fraction of direct answers made wrong")
    ap.add_argument("--p-practice", type=float, default=0.6,
                    help="fraction of calculator episodes whose tool-or-not decision is not trained")
    ap.add_argument("--p-canonical", type=float, default=0.5, help="fraction with the canonical system turn")
    ap.add_argument("--vocab-size", type=int, default=2304)
    ap.add_argument("--digits-per-token", type=int, default=3, choices=(1, 2, 3))
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for this size)")
    ap.add_argument("--eval-problems", type=int, default=300, help="held-out problems, greedy")
    ap.add_argument("--eval-sampled", type=int, default=64, help="held-out problems sampled at temperature 1")
    ap.add_argument("--samples", type=int, default=8, help="samples per problem at temperature 1")
    ap.add_argument("--eval-only", action="store_true", help="evaluate the model already in --out")
    args = ap.parse_args(argv)
    for name in ("p_tool", "p_tool_mul", "p_wrong", "p_canonical", "p_practice"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            ap.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    args.argv = argv if argv is not None else __import__("sys").argv[1:]
    torch.set_num_threads(args.threads)

    if not args.eval_only:
        random.seed(args.seed)
        t0, c0 = time.time(), time.process_time()
        rollouts = sft_rollouts(args.examples, args.seed, args.p_tool, args.p_tool_mul, args.p_wrong,
                                args.p_canonical, args.p_practice)
        tokenizer = build_tokenizer(rollouts[:4000], args.vocab_size, args.digits_per_token)
        model = build_model(tokenizer, args.hidden, args.layers, args.heads, args.seed)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{len(rollouts)} transcripts, vocab {len(tokenizer)}, {n_params / 1e6:.2f}M params "
              f"({time.time() - t0:.0f}s)", flush=True)
        losses = train(model, tokenizer, rollouts, args.steps, args.batch_size, args.lr, args.seed)
        seconds, cpu = time.time() - t0, time.process_time() - c0
        args.out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(args.out)
        tokenizer.save_pretrained(args.out)
        print(f"saved to {args.out} after {seconds:.0f}s", flush=True)

    report = evaluate(args.out, args.eval_problems, args.eval_sampled, args.samples, args.seed)
    print(json.dumps(report, indent=1))
    if not args.eval_only:
        write_readme(args.out, args, seconds, cpu, sum(losses[-50:]) / len(losses[-50:]), report, n_params)


if __name__ == "__main__":
    main()
