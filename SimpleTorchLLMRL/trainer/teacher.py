"""Where a distillation teacher's log-probs of the student's sampled tokens come from; each source checked.

Legend: B rollouts, T tokens; every tensor is (B, T), aligned with the student's input_ids, holding the
teacher's log p(input_ids[:, t] | input_ids[:, :t]) on the trained tokens, 0 elsewhere. Sources: an HF
model (`hf_teacher_logprobs`), a vLLM engine (`vllm_teacher_logprobs`: this module imports `vllm` itself,
never the library's generation package), precomputed (`rollout_teacher_logprobs`, written by
`attach_teacher_logprobs`). Every value passes `check_teacher_values`, and the teacher's tokenizer
`check_teacher_tokenizer` (docs/losses.md, "Distillation").
"""

from __future__ import annotations

import torch

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.chat.tokenize import Batch, rollouts_to_batch
from SimpleTorchLLMRL.model.scoring.head import check_vocabulary
from SimpleTorchLLMRL.model.scoring.logprobs import DEFAULT_CHUNK_SIZE, token_logprobs

METADATA_KEY = "teacher_logprobs"
VLLM_HINT = ("a vLLM teacher needs vllm: `pip install 'SimpleTorchLLMRL[vllm]'` (GPU) or the CPU build, "
             "see docs/generation.md")


def check_teacher_values(source: str, values: torch.Tensor, mask: torch.Tensor, message_index=None) -> None:
    """ValueError naming the rollout, message and position of the first trained token whose teacher log-prob
    is NaN, infinite or above 0 (a log-probability is <= 0). values, mask, message_index: (B, T)."""
    bad = mask.bool() & ~(torch.isfinite(values) & (values <= 0))
    if bool(bad.any()):
        i, t = (int(v) for v in bad.nonzero()[0])
        j = None if message_index is None else int(message_index[i, t])
        msg = "" if j is None else f", message {j} (its token {int((message_index[i, :t] == j).sum())})"
        raise ValueError(f"{source} teacher log-prob {float(values[i, t])} at rollout {i}{msg}, token position {t}: "
                         f"a log-probability must be finite and <= 0 ({int(bad.sum())} such tokens)")


def check_teacher_tokenizer(tokenizer, teacher_tokenizer, rollouts: list[Rollout], batch: Batch,
                            max_length: int | None = None, truncate: bool = False) -> None:
    """ValueError unless `teacher_tokenizer` encodes `rollouts` to `batch.input_ids` with the same token strings.

    The same tokenizer object (or None) passes at once. batch: the student's encoding of `rollouts`.
    """
    if teacher_tokenizer is None or teacher_tokenizer is tokenizer:
        return
    mine = batch.input_ids.cpu()
    try:
        theirs = rollouts_to_batch(list(rollouts), teacher_tokenizer, max_length, truncate).input_ids
    except ValueError as e:
        raise ValueError(f"the teacher's tokenizer cannot encode the rollouts as the student's does ({e}); a "
                         "teacher must share the student's tokenizer (docs/losses.md#distillation)") from e
    real = batch.attention_mask.cpu().bool()
    if theirs.shape != mine.shape or not torch.equal(theirs[real], mine[real]):
        row = next((i for i in range(len(mine)) if i >= len(theirs) or theirs[i].shape != mine[i].shape
                    or not torch.equal(theirs[i][real[i]], mine[i][real[i]])), 0)
        raise ValueError(f"the teacher's tokenizer encodes rollout {row} to other token ids than the student's: "
                         "the teacher would score tokens the student never produced. Distillation here needs a "
                         "teacher that shares the student's tokenizer (docs/losses.md#distillation)")
    ids = torch.unique(mine[real]).tolist()
    a, b = tokenizer.convert_ids_to_tokens(ids), teacher_tokenizer.convert_ids_to_tokens(ids)
    differ = [(i, x, y) for i, x, y in zip(ids, a, b, strict=True) if x != y]
    if differ:
        i, x, y = differ[0]
        raise ValueError(f"the teacher's tokenizer maps {len(differ)} of the rollouts' ids to other tokens (id {i}: "
                         f"{x!r} for the student, {y!r} for the teacher); a teacher must share the student's "
                         "tokenizer (docs/losses.md#distillation)")


@torch.no_grad()
def hf_teacher_logprobs(teacher, batch: Batch, mask: torch.Tensor, *, temperature: float = 1.0,
                        chunk_size: int | None = DEFAULT_CHUNK_SIZE, head_impl: str = "auto",
                        tokenizer=None) -> torch.Tensor:
    """(B, T) float32 teacher log-probs of the trained tokens (`mask`), 0 elsewhere, on `mask`'s device.

    The teacher runs on its own device; the batch goes there and the result comes back.
    tokenizer: the ids' tokenizer, to check the teacher scores every id it holds.
    """
    if tokenizer is not None:
        check_vocabulary(teacher, tokenizer)
    device = next(teacher.parameters()).device
    lp = token_logprobs(teacher, batch.to(device), temperature, chunk_size, positions=mask.to(device),
                        head_impl=head_impl).float().to(mask.device)
    check_teacher_values("the HF", lp, mask, batch.message_index)
    return lp


def vllm_teacher_logprobs(llm, batch: Batch, mask: torch.Tensor, *, lora_request=None) -> torch.Tensor:
    """(B, T) float32 log-probs of the trained tokens from a `vllm.LLM` (temperature 1), 0 elsewhere.

    One request per rollout: its ids as the prompt, `SamplingParams(max_tokens=1, prompt_logprobs=0)`;
    vLLM returns, for each prompt token after the first, a {id: Logprob} dict holding that id.
    """
    try:
        import vllm
        from vllm.inputs import TokensPrompt
    except ImportError as e:
        raise ImportError(VLLM_HINT) from e

    lengths = batch.attention_mask.sum(-1).tolist()
    ids = batch.input_ids.cpu()
    requests = [TokensPrompt(prompt_token_ids=ids[i, :n].tolist()) for i, n in enumerate(lengths)]
    params = vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outputs = llm.generate(requests, params, use_tqdm=False, lora_request=lora_request)
    out = torch.zeros(mask.shape, dtype=torch.float32)
    m = mask.cpu().bool()
    for i, o in enumerate(outputs):
        rows = o.prompt_logprobs
        if rows is None or len(rows) != lengths[i]:
            raise RuntimeError(f"vLLM returned {None if rows is None else len(rows)} prompt log-probs for a prompt "
                               f"of {lengths[i]} tokens; SamplingParams(prompt_logprobs=0) was ignored")
        for t in m[i].nonzero().flatten().tolist():
            tok = int(ids[i, t])
            if rows[t] is None or tok not in rows[t]:
                raise RuntimeError(f"vLLM's prompt log-probs of rollout {i} lack token {tok} at position {t}")
            out[i, t] = float(rows[t][tok].logprob)
    check_teacher_values("the vLLM", out, m, batch.message_index)
    return out.to(mask.device)


def rollout_teacher_logprobs(rollouts: list[Rollout], batch: Batch, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) float32 from each rollout's `metadata["teacher_logprobs"]` (one entry per message), 0 elsewhere.

    Needs `batch.message_index` (which message each trained token belongs to); the k-th token of
    message j takes entry [j][k]. ValueError naming the rollout and message when a trained token has none.
    """
    if batch.message_index is None:
        raise ValueError("precomputed teacher log-probs need the batch's message_index (rollouts_to_batch sets it)")
    out = torch.zeros(mask.shape, dtype=torch.float32)
    index, m = batch.message_index.cpu(), mask.cpu().bool()
    for i, r in enumerate(rollouts):
        per_message = r.metadata.get(METADATA_KEY)
        if per_message is None:
            raise ValueError(f"rollout {i} has no metadata[{METADATA_KEY!r}]: score it with a teacher first "
                             "(attach_teacher_logprobs) or pass a teacher model / engine")
        if len(per_message) != len(r):
            raise ValueError(f"rollout {i}: metadata[{METADATA_KEY!r}] has {len(per_message)} entries for "
                             f"{len(r)} messages (one per message: None or a list of log-probs)")
        for j in torch.unique(index[i][m[i]]).tolist():
            where = (index[i] == j).nonzero().flatten()  # every token of message j, in order
            values = per_message[j] if j >= 0 else None
            if values is None or len(values) < len(where):
                raise ValueError(f"rollout {i}, message {j}: metadata[{METADATA_KEY!r}] holds "
                                 f"{0 if values is None else len(values)} teacher log-probs for its {len(where)} "
                                 "tokens")
            tok = r[j].token_ids
            if tok is not None and len(values) > len(tok):
                raise ValueError(f"rollout {i}, message {j}: {len(values)} teacher log-probs for {len(tok)} "
                                 "sampled token_ids")
            out[i, where] = torch.tensor(values[: len(where)], dtype=torch.float32)
    check_teacher_values("the precomputed", out, m, index)
    return torch.where(m, out, 0.0).to(mask.device)


def attach_teacher_logprobs(rollouts: list[Rollout], batch: Batch, teacher_logprobs: torch.Tensor,
                            mask: torch.Tensor) -> None:
    """Write (B, T) teacher log-probs of the trained tokens into each rollout's `metadata["teacher_logprobs"]`.

    The inverse of `rollout_teacher_logprobs` on the trained messages (others get None), in place:
    score once (on another machine, or an engine), train later from the rollouts alone.
    """
    if batch.message_index is None:
        raise ValueError("attach_teacher_logprobs needs the batch's message_index (rollouts_to_batch sets it)")
    index, m, lp = batch.message_index.cpu(), mask.cpu().bool(), teacher_logprobs.detach().float().cpu()
    for i, r in enumerate(rollouts):
        per_message: list = [None] * len(r)
        for j in torch.unique(index[i][m[i]]).tolist():
            if j >= 0:
                where = (index[i] == j).nonzero().flatten()
                per_message[j] = lp[i, where].tolist()
        r.metadata[METADATA_KEY] = per_message
