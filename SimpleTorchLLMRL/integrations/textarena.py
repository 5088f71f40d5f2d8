"""textarena games as `Game`s for `collect_game_rollouts` (the `textarena` extra).

    from SimpleTorchLLMRL.env import collect_game_rollouts
    from SimpleTorchLLMRL.integrations.textarena import TextArenaGame

    moves = collect_game_rollouts(generator, lambda: TextArenaGame("TicTacToe-v0"), seeds=[0, 1, 2, 3])

Each player's observation is what textarena shows that player (its wrappers decide how much of the game's
history: the `-train` variants of an id show the rules and the current board). The rewards are the ones
textarena's `close()` pays each player (a win, a loss, an invalid move's penalty); a game stopped before
its end (`max_moves`) is paid nothing, and its moves carry no reward.
"""

from __future__ import annotations

from collections.abc import Hashable

from SimpleTorchLLMRL.integrations._extras import require


class TextArenaGame:
    """A textarena env (an id for `textarena.make`, or an env object) as a `Game` of `num_players`."""

    def __init__(self, env, num_players: int = 2):
        if isinstance(num_players, bool) or not isinstance(num_players, int) or num_players < 1:
            raise ValueError(f"num_players must be a positive int, got {num_players!r}")
        if isinstance(env, str):
            env = require("textarena", "textarena").make(env)
        for method in ("reset", "get_observation", "step", "close"):
            if not callable(getattr(env, method, None)):
                raise TypeError(f"TextArenaGame needs a textarena env (or its id), got {type(env).__name__} "
                                f"without {method}()")
        self.env, self.num_players = env, num_players
        self.outcome: dict | None = None
        self.info: dict | None = None

    def reset(self, seed: int) -> None:
        self.env.reset(num_players=self.num_players, seed=seed)
        self.outcome = self.info = None

    def turn(self) -> tuple[Hashable, str]:
        player, observation = self.env.get_observation()
        if not isinstance(observation, str):
            raise TypeError(f"textarena gave player {player} a {type(observation).__name__} observation, not text: "
                            "make the env with an LLM observation wrapper (textarena.make applies one by default)")
        return player, observation

    def step(self, text: str) -> bool:
        done, _ = self.env.step(text)
        if done:
            self.outcome, self.info = self.env.close()
        return bool(done)

    def rewards(self) -> dict[Hashable, float]:
        if self.outcome is None:  # stopped before its end (max_moves): textarena pays nothing then
            raise ValueError("the game was stopped before its end; textarena pays no reward for an unfinished game")
        return {player: float(r) for player, r in self.outcome.items()}
