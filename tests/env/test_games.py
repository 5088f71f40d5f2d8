"""Turn-based games: one rollout per move, each player's own observation and adapter, the game's outcome (or
its per-move rewards) on each move; a broken game ends alone, unscored. Then real textarena games, and GRPO
steps on them."""

from __future__ import annotations

import sys

import pytest

from SimpleTorchLLMRL.chat.message import Message, MessageType
from SimpleTorchLLMRL.env import Game, collect_game_rollouts, episode_rewards
from SimpleTorchLLMRL.integrations.textarena import TextArenaGame


class HighCard:
    """Two players each see only their own card and say "hold" or "fold", twice; the higher held card wins.
    `per_move`: pay each move its own reward (1 for a hold with the winning card) instead of the outcome."""

    def __init__(self, per_move: bool = False, fail: str | None = None):
        self.per_move, self.fail = per_move, fail

    def reset(self, seed):
        self.cards = {"north": 3 + seed, "south": 5}
        self.said: list[tuple[str, str]] = []

    def turn(self):
        player = ["north", "south"][len(self.said) % 2]
        if self.fail == "turn" and len(self.said) == 1:
            raise RuntimeError("lost the deck")
        return player, f"You are {player}; your card is {self.cards[player]}. Hold or fold?"

    def step(self, text):
        if self.fail == "step" and len(self.said) == 2:
            raise RuntimeError("table flipped")
        player = ["north", "south"][len(self.said) % 2]
        self.said.append((player, text.strip()))
        return len(self.said) == 4

    def rewards(self):
        if self.fail == "rewards":
            return {"north": 1.0}
        held = {p: self.cards[p] for p, t in self.said if t == "hold"}
        winner = max(held, key=held.get) if held else None
        if self.per_move:
            return {p: [float(t == "hold" and p == winner) for q, t in self.said if q == p] for p in self.cards}
        return {p: (1.0 if p == winner else -1.0) for p in self.cards}


class Scripted:
    """Say "hold" with a card above 4, else "fold"; records every batch and the adapters it was given."""

    def __init__(self):
        self.batches: list[list[str]] = []
        self.adapters: list = []

    def batch_rollout_generate_response(self, rollouts, adapter=None):
        self.batches.append([r[-1].content for r in rollouts])
        self.adapters.append(adapter)
        for r in rollouts:
            card = int(r[-1].content.split("card is ")[1].split(".")[0])
            r.add_messages(Message("hold" if card > 4 else "fold", MessageType.MODEL))


def test_each_move_is_a_rollout_of_its_players_view_paid_the_outcome():
    gen = Scripted()
    moves = collect_game_rollouts(gen, HighCard, seeds=[0, 2])
    assert isinstance(HighCard(), Game)
    assert sorted(moves) == ["north", "south"] and len(moves["north"]) == len(moves["south"]) == 4
    assert len(gen.batches) == 4 and [len(b) for b in gen.batches] == [2, 2, 2, 2]  # both games each round
    north = moves["north"][0]
    assert [m.type for m in north] == [MessageType.MESSAGE, MessageType.MODEL]
    assert north[0].content == "You are north; your card is 3. Hold or fold?" and north[1].content == "fold"
    assert all("south" not in m[0].content for m in moves["north"])  # only its own observation
    meta = [(m.metadata["game"], m.metadata["seed"], m.metadata["move"], m.metadata["group_id"])
            for m in moves["south"]]
    assert meta == [(0, 0, 0, "0:south"), (0, 0, 1, "0:south"), (1, 2, 0, "2:south"), (1, 2, 1, "2:south")]
    # seed 0: north 3 folds, south 5 holds and wins; seed 2: north 5 and south 5 both hold, the first max wins
    assert episode_rewards(moves["north"]).tolist() == [-1.0, -1.0, 1.0, 1.0]
    assert episode_rewards(moves["south"]).tolist() == [1.0, 1.0, -1.0, -1.0]
    assert {m.metadata["done_reason"] for ms in moves.values() for m in ms} == {"game"}


def test_per_move_rewards_and_each_players_adapter():
    gen = Scripted()
    moves = collect_game_rollouts(gen, lambda: HighCard(per_move=True), seeds=[0],
                                  adapters={"north": "north_lora"}, system_prompt="Play well.")
    assert gen.adapters == [["north_lora"], [None], ["north_lora"], [None]]
    assert [m.type for m in moves["north"][0]] == [MessageType.SYSTEM, MessageType.MESSAGE, MessageType.MODEL]
    assert episode_rewards(moves["south"]).tolist() == [1.0, 1.0]
    assert episode_rewards(moves["north"]).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("fail,why", [("turn", "turn: RuntimeError: lost the deck"),
                                      ("step", "step: RuntimeError: table flipped"),
                                      ("rewards", "rewards: KeyError")])
def test_a_broken_game_ends_alone_and_is_never_scored(fail, why):
    games = iter([HighCard(fail=fail), HighCard()])
    moves = collect_game_rollouts(Scripted(), lambda: next(games), seeds=[0, 0])
    broken = [m for ms in moves.values() for m in ms if m.metadata["game"] == 0]
    fine = [m for ms in moves.values() for m in ms if m.metadata["game"] == 1]
    assert broken and all(m.metadata["done_reason"] == "game_error" and "reward" not in m.metadata for m in broken)
    assert all(m.metadata["game_error"].startswith(why) for m in broken)
    assert len(fine) == 4 and all("reward" in m.metadata for m in fine)
    with pytest.raises(ValueError, match="carry no metadata"):
        episode_rewards(broken)


def test_max_moves_stops_a_game_and_bad_arguments_are_named():
    moves = collect_game_rollouts(Scripted(), HighCard, seeds=[0], max_moves=3)
    assert [m.metadata["done_reason"] for m in moves["north"] + moves["south"]] == ["max_moves"] * 3
    with pytest.raises(ValueError, match="max_moves"):
        collect_game_rollouts(Scripted(), HighCard, seeds=[0], max_moves=0)
    with pytest.raises(TypeError, match="adapters"):
        collect_game_rollouts(Scripted(), HighCard, seeds=[0], adapters=["a"])


# ----------------------------------------------------------------------------- textarena


class Moves:
    """Plays fixed moves: player -> the texts it writes, in order."""

    def __init__(self, script):
        self.script = {p: iter(t) for p, t in script.items()}

    def batch_rollout_generate_response(self, rollouts):
        for r in rollouts:
            r.add_messages(Message(next(self.script[r.metadata["player"]]), MessageType.MODEL))


def test_textarena_tictactoe_through_collect_game_rollouts():
    script = {0: ["[0]", "[1]", "[2]"], 1: ["[4]", "[8]"]}  # player 0 completes the top row
    moves = collect_game_rollouts(Moves(script), lambda: TextArenaGame("TicTacToe-v0-train"), seeds=[7])
    assert [m[-1].content for m in moves[0]] == ["[0]", "[1]", "[2]"] and len(moves[1]) == 2
    assert episode_rewards(moves[0]).tolist() == [1.0] * 3 and episode_rewards(moves[1]).tolist() == [-1.0] * 2
    assert moves[0][0][0].content.startswith("You are Player 0 in Tic Tac Toe.")
    last = moves[1][-1][0].content  # player 1's own view: its rules and the board it moved on
    assert last.startswith("You are Player 1 in Tic Tac Toe.") and " O | O | 2 " in last and "Player 0" in last


def test_textarena_invalid_moves_lose_and_an_unfinished_game_pays_nothing():
    moves = collect_game_rollouts(Moves({0: ["pass", "pass"], 1: ["[4]"]}),
                                  lambda: TextArenaGame("TicTacToe-v0-train"), seeds=[0])
    assert episode_rewards(moves[0]).tolist() == [-1.0] * len(moves[0])
    stopped = collect_game_rollouts(Moves({0: ["[0]"], 1: ["[4]"]}), lambda: TextArenaGame("TicTacToe-v0"),
                                    seeds=[0], max_moves=2)
    assert {m.metadata["done_reason"] for ms in stopped.values() for m in ms} == {"game_error"}
    assert "unfinished game" in stopped[0][0].metadata["game_error"]


def test_textarena_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)
    with pytest.raises(ImportError, match="'textarena' extra"):
        TextArenaGame("TicTacToe-v0")
    with pytest.raises(TypeError, match="textarena env"):
        TextArenaGame(object())


def test_grpo_steps_on_textarena_moves():
    """The embedded model plays TicTacToe (its moves constrained to the '[cell]' format by a grammar); each
    player's moves are trained on the game's outcome, with a non-zero gradient."""
    from SimpleTorchLLMRL import ModelGenerate
    from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig
    from tests.support.grpo_steps import grpo_steps, tiny_policy

    model, tok, _ = tiny_policy()
    move = SamplingConfig(max_new_tokens=4, temperature=1.0, grammar='root ::= "[" [0-8] "]"')
    gen = ModelGenerate(model, tok, sampling=move, seed=2)
    played = []

    def collect():
        moves = collect_game_rollouts(gen, lambda: TextArenaGame("TicTacToe-v0-train"), seeds=[0] * 4)
        both = moves[0] + moves[1]
        played.append(len(both))
        return both, episode_rewards(both)

    grpo_steps(model, tok, collect, steps=2)
    assert all(n >= 4 * 3 for n in played)  # each game has at least three moves
