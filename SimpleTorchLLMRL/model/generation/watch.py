"""`DecodeWatch`: what a decode loop reports while it runs (each row's new ids) and what it asks (which rows
to give up), for streaming replies and cancelling abandoned ones.

Rows are the samples of one generate call, prompt-major: prompt i's j-th sample is row i * n + j.

    watch = DecodeWatch(on_tokens=lambda rows, ids: ..., cancelled=lambda row: ...)
    generator.generate(rollouts, n, watch=watch)

`on_tokens(rows, ids)` is called from the thread that generates, with `ids[k]` the ids row `rows[k]`
sampled since the last call: every step on the HF `generate` loop (which syncs with the host every step
anyway), at each host check on the fast decode (`fast_decode.STREAM_EVERY` steps), as the engine steps on
vLLM. The ids are raw: a row that ended keeps receiving ids (padding, or what it samples past its EOS or
stop string), which the caller cuts as `sampling.cut_sample` does. It must be quick and must not raise;
hand the ids to another thread (e.g. `loop.call_soon_threadsafe`) rather than work on them there.

`cancelled(row)` is read at those same points: a row it says True for stops decoding (the HF loops treat it
as ended; vLLM aborts it); the other rows sample exactly the ids they would have sampled without it. A
cancelled row's message holds what it sampled until it stopped (finish_reason "length" unless it had
already ended).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

TokensFn = Callable[[Sequence[int], list[list[int]]], None]


class DecodeWatch:
    """Callbacks for the rows of one generate call (see the module docstring)."""

    def __init__(self, on_tokens: TokensFn | None = None, cancelled: Callable[[int], bool] | None = None):
        self._on_tokens, self._cancelled = on_tokens, cancelled
        self.streams = on_tokens is not None  # the fast decode checks more often for a watch that streams
        self._stopped_at: dict[int, int] = {}  # cancelled row -> ids it had sampled when the loop gave it up

    def tokens(self, rows: Sequence[int], ids: list[list[int]]) -> None:
        if self._on_tokens is not None and rows:
            self._on_tokens(rows, ids)

    def is_cancelled(self, row: int) -> bool:
        return self._cancelled is not None and bool(self._cancelled(row))

    def give_up(self, row: int, sampled: int) -> None:
        """The loop stopped decoding `row` (cancelled) after it had sampled `sampled` ids."""
        self._stopped_at.setdefault(row, sampled)

    def given_up_at(self, row: int) -> int | None:
        """How many ids `row` had sampled when the loop gave it up; None when it ran to its end."""
        return self._stopped_at.get(row)

    def select(self, rows: Sequence[int]) -> DecodeWatch:
        """This watch for a sub-call that generates only `rows` (its row r is this call's rows[r])."""
        return _Selected(self, list(rows))


class _Selected(DecodeWatch):
    def __init__(self, parent: DecodeWatch, rows: list[int]):
        super().__init__()
        self.parent, self.rows, self.streams = parent, rows, parent.streams

    def tokens(self, rows: Sequence[int], ids: list[list[int]]) -> None:
        self.parent.tokens([self.rows[r] for r in rows], ids)

    def is_cancelled(self, row: int) -> bool:
        return self.parent.is_cancelled(self.rows[row])

    def give_up(self, row: int, sampled: int) -> None:
        self.parent.give_up(self.rows[row], sampled)

    def given_up_at(self, row: int) -> int | None:
        return self.parent.given_up_at(self.rows[row])
