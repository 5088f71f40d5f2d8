"""A watched call on the vLLM backend: the engine stepped request by request, each row's new ids handed to a
`DecodeWatch` as they are sampled, the rows it gives up aborted in the engine. The requests are
`LLM.generate`'s (vLLM 0.32) with `CUMULATIVE` outputs, so the engine samples the same ids.

Legend: R requests, k samples per request (vLLM's `n`), R * k rows (row i * k + j: request i's j-th sample).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass


@dataclass
class RowResult:
    """One row's last `CompletionOutput` (cumulative) and, for a row given up, how many ids it had then."""

    output: object
    given_up_at: int | None = None


def step_watched(llm, prompts: list, params: list, lora, per_request: int, watch) -> list[RowResult]:
    """Run `prompts` (R `TokensPrompt`s) with `params` (R `SamplingParams` of n = `per_request`) and `lora`
    (None, one `LoRARequest`, or R of them) on `llm`'s engine, reporting to `watch`; R * k `RowResult`s."""
    from vllm.sampling_params import RequestOutputKind

    engine, rows = llm.llm_engine, len(prompts) * per_request
    loras = lora if isinstance(lora, list) else [lora] * len(prompts)
    request_of: dict[str, int] = {}  # external request id -> request index
    internal: list[str] = []  # request index -> the engine's internal id
    last: list = [None] * rows  # row -> its latest CompletionOutput
    sent, done = [0] * rows, [False] * rows  # ids handed to the watch; finished or given up
    given_up: dict[int, int] = {}
    try:
        for i, (rendered, sp) in enumerate(zip(llm._preprocess_cmpl(prompts), params, strict=True)):
            sp.output_kind = RequestOutputKind.CUMULATIVE
            external = str(next(llm.request_counter))
            request_of[external] = i
            internal.append(engine.add_request(external, rendered, sp, lora_request=loras[i]))
        while not all(done):
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"the vLLM engine has no requests left, yet rows "
                                   f"{[r for r in range(rows) if not done[r]]} never finished")
            new_rows, new_ids = [], []
            for out in engine.step():
                i = request_of.get(out.request_id)
                if i is None:
                    continue  # not this call's
                for c in out.outputs:
                    r = i * per_request + c.index
                    if done[r]:
                        continue
                    last[r] = c
                    ids = c.token_ids  # every id so far (CUMULATIVE)
                    if len(ids) > sent[r]:
                        new_rows.append(r)
                        new_ids.append([int(t) for t in ids[sent[r]:]])
                        sent[r] = len(ids)
                    done[r] = c.finish_reason is not None
            watch.tokens(new_rows, new_ids)
            gone = [r for r in range(rows) if not done[r] and watch.is_cancelled(r)]
            if gone:
                engine.abort_request([_internal_id(internal[r // per_request], r % per_request, per_request)
                                      for r in gone], internal=True)
                for r in gone:
                    done[r], given_up[r] = True, sent[r]
                    watch.give_up(r, sent[r])
    except BaseException:
        with contextlib.suppress(Exception):  # leave no request of this call in the engine; raise the first error
            engine.abort_request(list(request_of))
        raise
    return [RowResult(last[r], given_up.get(r)) for r in range(rows)]


def _internal_id(request: str, j: int, per_request: int) -> str:
    """The engine's id of request `request`'s j-th sample (its own id when it samples one)."""
    return request if per_request == 1 else f"{j}_{request}"
