"""Turn-based games for two or more players: one rollout per move, each player seeing its own view.

Legend: N games (one per seed), P players, M moves.

    games = collect_game_rollouts(generator, lambda: TicTacToe(), seeds=[0, 0, 1, 1],
                                  adapters={0: "x_player", 1: "o_player"})
    moves = games[0]                                   # player 0's moves, each a Rollout
    loss = grpo.calculate_loss(moves, episode_rewards(moves))

A move's metadata: "game", "seed", "player", "move", "group_id" ("SEED:PLAYER"), "reward", "done_reason"
("game", "max_moves", or "game_error": no move of that game is paid).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol, runtime_checkable

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout

DEFAULT_MAX_MOVES = 100


@runtime_checkable
class Game(Protocol):
    """A turn-based game for `collect_game_rollouts` (the textarena adapter is one)."""

    def reset(self, seed: int) -> None:
        """Start a new game from `seed`."""

    def turn(self) -> tuple[Hashable, str]:
        """(the player to move, what that player observes now)."""

    def step(self, text: str) -> bool:
        """Play the move the player wrote; whether the game is over."""

    def rewards(self) -> dict[Hashable, float | Sequence[float]]:
        """When over: each player's outcome, or one reward per move that player made."""


class _Match:
    """One game in flight: its moves so far and how it ended."""

    def __init__(self, index: int, seed: int, game: Game):
        self.index, self.seed, self.game = index, seed, game
        self.moves: list[Rollout] = []
        self.ended: str | None = None
        self.error: str | None = None

    def next_move(self, system_prompt: str | None) -> Rollout | None:
        """The rollout of the next move, prompted by the mover's own observation (None: turn() raised)."""
        try:
            player, observation = self.game.turn()
        except Exception as e:  # noqa: BLE001  (a broken game ends itself, not the batch)
            self.fail("turn", e)
            return None
        if not isinstance(observation, str):
            self.fail("turn", TypeError(f"an observation must be a str, got {type(observation).__name__}"))
            return None
        msgs = [Message(system_prompt, MessageType.SYSTEM)] if system_prompt else []
        number = sum(m.metadata["player"] == player for m in self.moves)
        return Rollout(msgs + [Message(observation)], {
            "game": self.index, "seed": self.seed, "player": player, "move": number,
            "group_id": f"{self.seed}:{player}"})

    def play(self, move: Rollout) -> None:
        self.moves.append(move)
        try:
            if self.game.step(move.last(MessageType.MODEL).content):
                self.ended = "game"
        except Exception as e:  # noqa: BLE001
            self.fail("step", e)

    def fail(self, call: str, e: Exception) -> None:
        self.ended, self.error = "game_error", f"{call}: {type(e).__name__}: {e}"

    def settle(self) -> None:
        """Each move's reward from the game's outcome, all or none (a game that pays wrongly is an error)."""
        paid = {}
        if self.ended != "game_error":
            try:
                outcome = self.game.rewards()
                for player in dict.fromkeys(m.metadata["player"] for m in self.moves):
                    paid.update(self._pay(player, outcome))
            except Exception as e:  # noqa: BLE001
                self.fail("rewards", e)
        for move in self.moves:
            move.metadata["done_reason"] = self.ended
            if self.ended == "game_error":
                move.metadata["game_error"] = self.error
            else:
                move.metadata["reward"] = paid[id(move)]

    def _pay(self, player: Hashable, outcome: dict) -> dict[int, float]:
        """{id(move): reward} for `player`'s moves."""
        mine = [m for m in self.moves if m.metadata["player"] == player]
        if player not in outcome:
            raise KeyError(f"the game paid no reward to player {player!r} (it paid {sorted(map(str, outcome))})")
        value = outcome[player]
        values = list(value) if isinstance(value, (list, tuple)) else [value] * len(mine)
        if len(values) != len(mine):
            raise ValueError(f"player {player!r} made {len(mine)} moves but the game gave {len(values)} rewards")
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)]
        if bad:
            raise ValueError(f"player {player!r}'s rewards must be finite numbers, got {bad[0]!r}")
        return {id(m): float(v) for m, v in zip(mine, values, strict=True)}


def collect_game_rollouts(generator, game_factory: Callable[[], Game], seeds: Sequence[int], *,
                          adapters: dict[Hashable, str] | None = None, system_prompt: str | None = None,
                          max_moves: int = DEFAULT_MAX_MOVES) -> dict[Hashable, list[Rollout]]:
    """Play one game per seed, all at once, and return each player's moves: {player: [Rollout, ...]}.

    generator: `batch_rollout_generate_response(rollouts, adapter=...)` (ModelGenerate): each round, the
    next move of every unfinished game is sampled in one batch. adapters: {player: LoRA adapter name}:
    each player moves with its own policy (`model/adapters.py`; a player not named uses the base).
    game_factory: a new `Game` per seed. max_moves: moves per game before it is stopped ("max_moves";
    the game still settles its rewards). A game whose call raises ends alone ("game_error").
    """
    seeds = list(seeds)
    if isinstance(max_moves, bool) or not isinstance(max_moves, int) or max_moves < 1:
        raise ValueError(f"max_moves must be a positive int, got {max_moves!r}")
    if adapters is not None and not isinstance(adapters, dict):
        raise TypeError(f"adapters must be a dict {{player: adapter name}}, got {type(adapters).__name__}")
    matches = []
    for i, seed in enumerate(seeds):
        game = game_factory()
        game.reset(seed)
        matches.append(_Match(i, seed, game))
    for _ in range(max_moves):
        pending = [(m, m.next_move(system_prompt)) for m in matches if m.ended is None]
        pending = [(m, move) for m, move in pending if move is not None]
        if not pending:
            break
        _generate(generator, [move for _, move in pending], adapters)
        for match, move in pending:
            match.play(move)
    by_player: dict[Hashable, list[Rollout]] = {}
    for match in matches:
        match.ended = match.ended or "max_moves"
        match.settle()
        for move in match.moves:
            by_player.setdefault(move.metadata["player"], []).append(move)
    return by_player


def _generate(generator, moves: list[Rollout], adapters: dict | None) -> None:
    """One batch of moves, each with its player's adapter (no adapter argument when none is asked for)."""
    if not adapters:
        generator.batch_rollout_generate_response(moves)
        return
    names = [adapters.get(m.metadata["player"]) for m in moves]
    generator.batch_rollout_generate_response(moves, adapter=names)
