"""TextArena games as envhub envs: ``textarena/<Game>[-<variant>]-v<N>``.

TextArena's id ``Sudoku-v0-hard`` becomes ``textarena/Sudoku-hard-v0``; its ``-raw`` and
``-train`` copies (the same game under other observation wrappers) are left out, because the
adapter renders observations itself. Single-player games (1 player in TextArena) and
two-player games are registered; games for three or more players are not, nor the games in
``LEFT_OUT`` (Bandit scores the wrong button; Sokoban-medium's reset takes tens of seconds).

Each reset builds a new game without TextArena's wrappers (games keep their board and deck
in the game object, so a reused one carries the last episode into the next) and shows the
agent only what is new since its last move (the game's prompt and board, the other player's
moves), as one user message. In a two-player game the agent is ``agent_player`` (0, 1 or
``"random"``) and the other seat is played by ``opponent`` (``envhub.adapters.opponents``:
random, a script, or a model at an OpenAI-compatible URL); a ``step`` applies the agent's move
and then the opponent's, so each step returns at the agent's next turn or at the end. The
random opponent reads only the game's own messages (TextArena shows both players each move as
written, in which an agent could list the moves it wants played) and plays a *legal* move of
its seat: its candidates (``RandomOpponent.candidates``) are tried on a copy of the game and
the first the game accepts is played. (It used to play the first listed move it read, which
in Alquerque, Breakthrough, LinesOfAction, MemoryGame, Nim and UltimateTicTacToe was the
rules' format example or the agent's piece: refused twice, it forfeited after one agent move.)

Mapping to the TextEnv contract: the reward is the game's final reward for the agent (given on
the last step; 0 before): a single-player game's score in [0, 1], a two-player game's +1 win /
0 draw / -1 loss; ``success`` is a score of 1 or a win. A move the game refuses is
``invalid_action`` (TextArena allows one retry, then the player loses, and that loss is the
episode's end). So is a move the game cannot even read (a number over Python's 4300 digits, on
which games raise ``ValueError``). A game the agent ends with invalid moves scores -1,
TextArena's invalid-move loss, whatever the game pays: many single-player games pay their
progress score there (RushHour paid 0.5 for two junk moves at the start), and Countdown,
Cryptarithm, Slitherlink and ThreeCardMonte pass ``set_invalid_move`` its arguments swapped and
report a text as the reward. This is a deliberate difference from TextArena: a single-player
game's reward here spans [-1, 1], not TextArena's [0, 1], and on episodes that end by invalid
moves envhub's numbers do not match TextArena's own (which pays the game's score, e.g.
Minesweeper 0.08 where envhub pays -1). A game the *opponent* loses by invalid moves (any
opponent; the random one only when no candidate was accepted) is no win: it ends with reward 0,
``success`` False and ``info["opponent_forfeit"] = True`` (``terminated``: the game is over).
Anything else the game raises is ``SourceError``. A move is at most ``action_max_length``
characters (8,000 unless given: some games match moves with patterns quadratic in the text, 5 s
a step at 100,000). ``max_turns`` (200 unless given) bounds games without their own limit.

Determinism: each reset draws a seed from the env's RNG and passes it to TextArena, which
seeds Python's global ``random`` with it (some games draw from ``numpy.random`` too). Each env
keeps its own copy of both global streams (``envhub.adapters.global_rng``): every call into
TextArena holds one process-wide lock and runs on that env's streams, and the caller's are
restored after. So an episode is fixed by the reset seed even when other TextArena or GEM envs
play in the same process, in the same thread or others (the trainer's ``LocalEnvSource``); a
model opponent's request runs outside the lock. Games that ask a hosted model (TwentyQuestions,
GuessWho) or download NLTK corpora fail offline and are not in the checked sample (see the
README).
"""

from __future__ import annotations

import copy
import random
import re
import sys
from pathlib import Path
from typing import Any, Literal

import numpy as np

from envhub.adapters import did_you_mean, require
from envhub.adapters.catalog import register_source
from envhub.adapters.global_rng import GlobalRNG
from envhub.adapters.opponents import (
    OPPONENT_RETRIES,
    OPPONENT_TIMEOUT_S,
    Opponent,
    RandomOpponent,
    listed_moves,
    make_opponent,
    move_shapes,
    random_move,
)
from envhub.core import TextEnv, Turn
from envhub.errors import SourceConfigError, SourceError
from envhub.registry import import_target

__all__ = ["LEFT_OUT", "TextArenaEnv", "envhub_id", "register"]

SOURCE = "textarena"
_GAME_ID = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9_.]*)-v(?P<version>\d+)(?P<suffix>-.+)?$")
_STATES = {"SinglePlayerState": 1, "TwoPlayerState": 2}
_PLAYER_ACTION = 2  # textarena.core.ObservationType.PLAYER_ACTION
_GAME_ADMIN = 6  # textarena.core.ObservationType.GAME_ADMIN (invalid-move notices)
_REDEALS = 10
_MAX_OPPONENT_MOVES = 500
_MAX_TRIALS = 2_000  # candidate moves the random opponent tries on copies of the game, per move
_INVALID_MOVE_LOSS = -1.0  # what TextArena's set_invalid_move pays a player who loses by it
_UNREADABLE_NUMBER = "integer string conversion"  # in Python's ValueError past 4300 digits

_WRONG_BUTTON = (
    "pays the wrong choice: TextArena 0.7.4 compares the chosen button's name with the "
    "ground-truth dict, so the best button scores 0 and the worst the most"
)
LEFT_OUT = {
    "Bandit-v0": _WRONG_BUTTON,
    "Bandit-v0-hard": _WRONG_BUTTON,
    "Sokoban-v0-medium": (
        "searches for a solvable room in its reset for tens of seconds (36 s at one seed), "
        "past a pool's 30 s reset timeout"
    ),
}
"""TextArena games not registered (nor built), each with what is wrong with it."""


def envhub_id(game: str) -> str | None:
    """``Sudoku-v0-hard`` -> ``textarena/Sudoku-hard-v0`` (``None`` for ids of another shape)."""
    match = _GAME_ID.match(game)
    if match is None:
        return None
    suffix = match["suffix"] or ""
    return f"textarena/{match['name']}{suffix}-v{match['version']}"


class TextArenaEnv(TextEnv):
    """One TextArena game, with the opponent seat played for the agent (module docstring).

    A model opponent (``opponent="http://host:port/v1"``, ``opponent_model=``,
    ``opponent_api_key=``) waits at most ``opponent_timeout_s`` per request, tried
    ``opponent_retries`` more times; then the step fails as "the opponent model failed"
    (``SourceError``). A pool or hub kills a worker whose step outlasts its step timeout, so
    serve such a game with a ``--step-timeout`` (an ``EnvPool``'s ``step_timeout_s``) above
    ``opponent_timeout_s x (opponent_retries + 1)`` plus the game's own time; the defaults
    (12 s x 2) fit under an ``EnvPool``'s 30 s and a hub's 60 s.
    """

    def __init__(
        self,
        *,
        game: str,
        players: int = 1,
        opponent: Any = "random",
        opponent_model: str | None = None,
        opponent_api_key: str = "EMPTY",
        opponent_timeout_s: float = OPPONENT_TIMEOUT_S,
        opponent_retries: int = OPPONENT_RETRIES,
        agent_player: int | Literal["random"] = 0,
        game_kwargs: dict[str, Any] | None = None,
        invalid_action_penalty: float = 0.0,
        max_turns: int | None = 200,
        action_max_length: int = 8_000,
        render_mode: Any = None,
    ) -> None:
        super().__init__(
            max_turns=max_turns, render_mode=render_mode, action_max_length=action_max_length
        )
        registry = require(SOURCE, "textarena.envs.registration").ENV_REGISTRY
        if game not in registry:
            raise SourceConfigError(
                f"TextArena has no game {game!r}.{did_you_mean(game, registry)} "
                "`envhub list --source textarena` lists them"
            )
        if game in LEFT_OUT:
            raise SourceConfigError(
                f"TextArena {game} is left out of envhub: it {LEFT_OUT[game]}; pick another "
                "game (`envhub list --source textarena` lists them)"
            )
        if players not in (1, 2):
            raise SourceConfigError(f"players must be 1 or 2, got {players!r}")
        if (
            isinstance(opponent_timeout_s, bool)
            or not isinstance(opponent_timeout_s, int | float)
            or not 0 < opponent_timeout_s < float("inf")
        ):
            raise SourceConfigError(
                f"opponent_timeout_s must be a positive number of seconds, got "
                f"{opponent_timeout_s!r}"
            )
        if isinstance(opponent_retries, bool) or not isinstance(opponent_retries, int):
            raise SourceConfigError(
                f"opponent_retries must be an int >= 0, got {opponent_retries!r}"
            )
        if opponent_retries < 0:
            raise SourceConfigError(
                f"opponent_retries must be an int >= 0, got {opponent_retries!r}"
            )
        if agent_player not in (0, 1, "random") or (players == 1 and agent_player not in (0,)):
            raise SourceConfigError(
                f"agent_player must be 0, 1 or 'random' (0 in a 1-player game), got "
                f"{agent_player!r}"
            )
        self.game, self.players = game, players
        self.opponent_spec = opponent
        self.opponent_model, self.opponent_api_key = opponent_model, opponent_api_key
        self.opponent_timeout_s, self.opponent_retries = float(opponent_timeout_s), opponent_retries
        self.agent_player = agent_player
        self.game_kwargs = dict(game_kwargs or {})
        self.invalid_action_penalty = invalid_action_penalty
        self._source: Any = None
        self._opponent: Opponent | None = None
        self._rng = np.random.default_rng(0)
        self._me = 0
        self._listing = ""  # the game's latest message that showed the opponent moves
        self._shapes: list[str] = []  # the move examples the game showed the opponent
        self._board = ""  # the game's latest message to the opponent
        self._globals = GlobalRNG()  # TextArena's draws from random, this env's own (docstring)
        with self._globals.active():
            self._build()  # a bad game_kwargs fails here, not at the first reset
        if players == 2:
            self._opponent = self._make_opponent()

    # ----------------------------------------------------------------- TextEnv
    def on_reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        seed = int(self.np_random.integers(2**31))
        self._rng = np.random.default_rng(seed)
        if self.agent_player == "random":
            self._me = int(self._rng.integers(2))
        else:
            self._me = int(self.agent_player)
        if self.players == 2 and self._opponent is None:
            self._opponent = self._make_opponent()
        for _ in range(_REDEALS):  # a game the opponent loses before the agent moves is re-dealt
            if self._opponent is not None:
                self._opponent.reset()
            self._globals.seed(seed)
            try:
                with self._globals.active():
                    self._build()  # a new game: a reused one keeps the last episode's board
                    self._source.reset(num_players=self.players, seed=seed)
            except SourceError:
                raise
            except Exception as error:
                raise SourceError(
                    f"TextArena {self.game} raised {type(error).__name__} in its reset: {error}; "
                    "a bug in the game, which cannot start this episode (try another seed)"
                ) from error
            self._done, self._listing, self._shapes, self._board = False, "", [], ""
            self._play_opponent()
            if not self._done:
                return self._news(), {"game": self.game, "player": self._me}
            seed = int(self._rng.integers(2**31))
        raise SourceError(
            f"TextArena {self.game} ended before the agent's first move in {_REDEALS} deals "
            f"(opponent={self.opponent_spec!r}); try another opponent"
        )

    def on_step(self, action: str) -> Turn:
        state = self._source.state
        errors_before = int(getattr(state, "error_count", 0) or 0)
        try:
            with self._globals.active():
                self._done, _ = self._source.step(action=action)
        except ValueError as error:
            if _UNREADABLE_NUMBER not in str(error):
                raise self._failure(error, "the agent's move", action) from error
            state.set_invalid_move(  # the agent's malformed move, as the game refuses one
                reason=f"The move holds a number of more than {sys.get_int_max_str_digits()} "
                "digits, which the game cannot read. Write the move as the rules show."
            )
            with self._globals.active():
                self._done, _ = state.step()
        except Exception as error:
            raise self._failure(error, "the agent's move", action) from error
        invalid = int(getattr(state, "error_count", 0) or 0) > errors_before
        if not self._done:
            self._play_opponent()
        if not self._done:
            return Turn(
                self._news(),
                reward=self.invalid_action_penalty if invalid else 0.0,
                invalid_action=invalid,
            )
        with self._globals.active():
            rewards, game_info = self._source.close()
        game_info = game_info if isinstance(game_info, dict) else {}
        mine = game_info.get(self._me, {})
        reward = (rewards or {}).get(self._me, 0.0)
        invalid = invalid or bool(mine.get("invalid_move"))
        lost = self.players == 2 and bool(game_info.get(1 - self._me, {}).get("invalid_move"))
        forfeit = lost and not invalid
        if invalid:  # whatever the game pays for it (module docstring)
            reward = _INVALID_MOVE_LOSS
        elif forfeit:
            reward = 0.0
        if not isinstance(reward, (int, float)):
            raise SourceError(
                f"TextArena {self.game} ended with a reward that is not a number ({reward!r:.80}); "
                "a bug in the game, which envhub cannot score"
            )
        success = reward >= 1.0 if self.players == 1 else reward > 0
        return Turn(
            self._news(),
            reward=reward,
            terminated=True,
            success=success,
            invalid_action=invalid,
            info={"reason": str(mine.get("reason", "")), "opponent_forfeit": forfeit},
        )

    def sample_action(self, np_random: np.random.Generator) -> str:
        roll = np_random.random()
        if roll < 0.15:
            return "I am not sure what to do."
        if self.messages:
            return random_move(str(self.messages[-1]["content"]), np_random)
        return "[0]"

    def on_close(self) -> None:
        self._source = None

    def __getstate__(self) -> dict[str, Any]:
        # the game and a model opponent's client are rebuilt after unpickling (at reset)
        return {**self.__dict__, "_source": None, "_opponent": None}

    # ----------------------------------------------------------------- helpers
    def _build(self) -> None:
        spec = require(SOURCE, "textarena.envs.registration").ENV_REGISTRY[self.game]
        target = spec.entry_point
        if isinstance(target, str):
            try:
                target = import_target(target)
            except (ImportError, AttributeError, SyntaxError, LookupError) as error:
                raise SourceError(
                    f"TextArena {self.game}'s module {target.partition(':')[0]} does not import "
                    f"({type(error).__name__}: {str(error).strip().splitlines()[0]})"
                ) from error
        try:
            self._source = target(**{**spec.kwargs, **self.game_kwargs})
        except TypeError as error:
            raise SourceConfigError(
                f"TextArena {self.game} refused game_kwargs={self.game_kwargs} ({error})"
            ) from error
        except Exception as error:  # the game's own failure, reported as the source's
            first = str(error).strip().splitlines()[0:3]
            raise SourceError(
                f"TextArena {self.game} cannot be built here ({type(error).__name__}: "
                f"{' '.join(line.strip() for line in first)}); games that download NLTK corpora "
                "or call a hosted model need network access"
            ) from error

    def _make_opponent(self) -> Opponent:
        return make_opponent(
            self.opponent_spec,
            model=self.opponent_model,
            api_key=self.opponent_api_key,
            timeout_s=self.opponent_timeout_s,
            retries=self.opponent_retries,
        )

    def _play_opponent(self) -> None:
        """Let the opponent move until it is the agent's turn or the game is over."""
        state, moves = self._source.state, 0
        while not self._done and state.current_player_id != self._me:
            moves += 1
            if moves > _MAX_OPPONENT_MOVES:
                raise SourceError(
                    f"TextArena {self.game}: the opponent moved {_MAX_OPPONENT_MOVES} times "
                    "without the turn coming back to the agent; the game seems stuck"
                )
            if self._opponent is None:
                raise SourceError(f"TextArena {self.game} gave the turn to another player")
            with self._globals.active():
                player, observation = self._source.get_observation()
            try:
                if isinstance(self._opponent, RandomOpponent):
                    with self._globals.active():
                        move = self._random_move(self._opponent, observation, player)
                else:  # (a model's request: outside the lock, other envs go on meanwhile)
                    move = self._opponent.act(_render(observation, player), self._rng)
            except SourceError:
                raise
            except Exception as error:
                raise SourceError(
                    f"the opponent {self.opponent_spec!r} of TextArena {self.game} raised "
                    f"{type(error).__name__}: {error}; fix the opponent's script"
                ) from error
            try:
                with self._globals.active():
                    self._done, _ = self._source.step(action=move)
            except Exception as error:
                raise self._failure(error, "the opponent's move", move) from error

    def _random_move(self, opponent: RandomOpponent, observation: list[Any], player: int) -> str:
        """The random opponent's move: the first of its candidates that the game accepts on a
        copy of itself (at most ``_MAX_TRIALS`` tried), else its first candidate, which the
        game will refuse. It reads only the game's own messages (TextArena shows both players
        each move as written, in which the agent could list any move): its listed moves come
        from the latest message that listed some (a board, this turn or before; an
        invalid-move notice does not count), its move shapes from all of them."""
        from_game = [(str(text), kind) for sender, text, kind in observation if _from_game(sender)]
        for text, kind in from_game:
            if getattr(kind, "value", kind) != _GAME_ADMIN:
                self._shapes = move_shapes(" ".join([*self._shapes, text]))
                self._board = text
                if listed_moves(text):
                    self._listing = text
        listing = self._listing or "\n\n".join(text for text, _ in from_game)
        candidates = opponent.candidates(listing, self._shapes, self._board, self._rng) or ["[0]"]
        state = random.getstate()  # trials must not move the episode's random stream
        try:
            accepted = (m for m in candidates[:_MAX_TRIALS] if self._accepts(m, player))
            return next(accepted, candidates[0])
        finally:
            random.setstate(state)

    def _accepts(self, move: str, player: int) -> bool:
        """Whether the game accepts ``move`` from ``player`` now, tried on a copy of it (its
        message history is left out of the copy: trials cost the same all game long)."""
        state = self._source.state
        memo = {
            id(state.observations): {pid: [] for pid in state.observations},
            id(state.logs): [],
        }
        try:
            trial = copy.deepcopy(self._source, memo)
            errors = trial.state.error_count
            trial.step(action=move)
        except Exception:  # noqa: BLE001 - a move the game cannot take is not accepted
            return False
        refused = trial.state.game_info.get(player, {}).get("invalid_move")
        return trial.state.error_count <= errors and not refused

    def _failure(self, error: Exception, whose: str, move: str) -> SourceError:
        """The ``SourceError`` for ``error``, which the game raised on a move."""
        return SourceError(
            f"TextArena {self.game} raised {type(error).__name__} on {whose} {move[:60]!r}: "
            f"{error}; the episode cannot go on (reset to start another)"
        )

    def _news(self) -> str:
        """Everything the agent has not seen yet, as text (its own moves left out)."""
        pending = self._source.state.observations
        messages, pending[self._me] = pending.get(self._me, []), []
        return _render(messages, self._me) or "(no news from the game)"


def _from_game(sender: Any) -> bool:
    """Whether a message's ``from_id`` is the game's (TextArena's -1), not a player's."""
    return not isinstance(sender, int) or sender < 0  # not an int: arguments out of order


def _render(messages: list[Any], me: int) -> str:
    """TextArena's ``(from_id, text, type)`` messages as the text player ``me`` reads."""
    lines = []
    for sender, text, kind in messages:
        if not isinstance(sender, int):  # some games pass add_observation's arguments out of order
            sender, text = -1, f"{text}"
        if sender == me and getattr(kind, "value", kind) == _PLAYER_ACTION:
            continue  # the player's own move, which it knows
        lines.append(str(text) if sender < 0 else f"[Player {sender}] {text}")
    return "\n\n".join(lines)


def _catalog() -> list[dict[str, Any]]:
    registry = require(SOURCE, "textarena.envs.registration").ENV_REGISTRY
    entries = []
    for game, spec in registry.items():
        if game.endswith(("-raw", "-train")) or game in LEFT_OUT:
            continue
        env_id, players = envhub_id(game), _players(spec.entry_point)
        if env_id is None or players is None:
            continue
        who = (
            "1 player; a game ended by invalid moves pays -1, not the game's own score"
            if players == 1
            else "2 players; opponent= plays the other seat"
        )
        entries.append(
            {
                "id": env_id,
                "kwargs": {"game": game, "players": players},
                "max_turns": 200,
                "description": f"TextArena {game} ({who}).",
            }
        )
    return sorted(entries, key=lambda entry: entry["id"])


def _players(entry_point: Any) -> int | None:
    """1 or 2 from the game's source (which State class it builds), without importing it."""
    if not isinstance(entry_point, str):
        return None
    module_name = entry_point.partition(":")[0]
    root = Path(require(SOURCE).__file__ or "").parent.parent
    try:
        text = (root / (module_name.replace(".", "/") + ".py")).read_text(encoding="utf-8")
    except OSError:
        return None
    found = {count for name, count in _STATES.items() if f"{name}(" in text}
    return found.pop() if len(found) == 1 else None


def register() -> None:
    """The ``envhub.envs`` entry point: one id per 1- or 2-player TextArena game."""
    register_source(SOURCE, "envhub.adapters.textarena:TextArenaEnv", _catalog)
