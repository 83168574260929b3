"""A multi-turn episode as ONE token sequence, and the chat rendering that builds it.

``Trajectory`` grows turn by turn: the rendered opening prompt (context), the tokens the
policy generated (``response_mask = 1``, with the log-prob each was sampled with), then the
chat-template rendering of the env's reply (context again), and so on. Token ids come from
the engine unchanged and env messages are tokenised on their own and *appended*: nothing is
ever re-tokenised, so the ids trained on are exactly the ids that were sampled.

``ChatRenderer`` turns messages into the token ids to append, for any chat template, with
the usual "delta" trick: render a fixed dummy conversation with and without the new
messages and tokenise only the difference, so templates that add a default system prompt
(Qwen) or a BOS token do not repeat it mid-episode. It runs once per turn of every episode
in the driver, so it skips ``transformers``' per-call wrappers where they add nothing: the
compiled chat template is rendered directly and a fast tokenizer's Rust backend encodes and
decodes, each only after the renderer checked, when it was built, that this gives the
wrapper's exact output (else it keeps the wrapper).

How trajectories become a training batch: ``trainer.rollout.collate``.
"""

from __future__ import annotations

import array
import functools
import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from trainer.rollout.chat_messages import dict_arguments
from trainer.rollout.fast_text import FastText
from trainer.rollout.tool_parsers import (
    TOOL_PARSERS,
    ParsedTurn,
    ToolParser,
    detect_tool_parser,
    env_action,
    make_tool_parser,
)
from trainer.strategies.model_eos import model_eos_ids

if TYPE_CHECKING:
    from trainer.strategies.base import GenerationResult

__all__ = ["ChatRenderer", "Counts", "Trajectory"]

_log = logging.getLogger(__name__)

_ARRAY_CODES = {"token_ids": "q", "response_mask": "b", "logprobs": "d"}
"""The ``array`` type of each per-token list ``collate`` reads (``Trajectory.token_array``)."""

Counts = tuple[int | None, int, int]
"""A row's own oldest policy version, policy tokens and tokens (``Trajectory._counted``)."""

_ALTERNATIVE_TURN_ENDS = ("<|eom_id|>",)
"""Tokens a template may close an assistant turn with in place of its end-of-turn token: Llama
3.1's ``<|eom_id|>`` ends a tool call that waits for its result (ipython mode), and the result's
header follows it directly. Used where the tokenizer has one as a special token and the
template writes it."""


@dataclass
class Trajectory:
    """One episode: tokens, which of them the policy wrote, rewards per turn and in total."""

    env_id: str
    seed: int
    group_id: int = 0
    token_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    """1 where the policy generated the token, 0 for prompt/env/tool/template tokens."""
    logprobs: list[float] = field(default_factory=list)
    """Log-prob each policy token was sampled with (0.0 on context tokens)."""
    turn_rewards: list[float] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    """Index of the last policy token of each turn (where that turn's reward sits)."""
    prompt_length: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    """The env's reset info (task-driven envs put the task / expected answer here)."""
    step_info: dict[str, Any] = field(default_factory=dict)
    """The info of the episode's last step (its outcome: ``success``, scores, stats). The store
    records ``info`` updated by it: the task and how the episode ended, as ``envhub eval``'s
    episodes record their last info."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The transcript (env messages and the decoded actions), for logs, judges and SFT files."""
    success: bool = False
    terminated: bool = False
    truncated: bool = False
    failed: bool = False
    """The env crashed; the episode is dropped or replaced, never trained on."""
    failure: str | None = None
    invalid_actions: int = 0
    final_reward: float = 0.0
    """Reward added at the end by reward workers (verifiers, judges, user functions)."""
    policy_versions: list[int] = field(default_factory=list)
    """Engine weight version of each generation call (one per turn, more when a turn was
    preempted by a weight update and resumed: each part's, oldest first;
    ``record_versions``)."""
    token_versions: list[int] = field(default_factory=list)
    """Per token: the policy version that generated it (-1 on context tokens). With partial
    rollouts one turn can mix versions; staleness is measured from the oldest."""
    samples: list[Trajectory] = field(default_factory=list)
    """``rollout.sample_unit: turn``: one training sample per policy turn (its prompt is the
    template's rendering of the conversation at that turn, then the turn's tokens); an agent
    behind the proxy (``trainer.rollout.proxy``): one per run of calls that extend each other.
    This episode then holds the transcript, rewards and flags, and no tokens of its own."""

    # ------------------------------------------------------------------ building
    def append_context(self, ids: Sequence[int]) -> None:
        """Tokens the policy did not write: the prompt, env replies, template glue."""
        self.token_ids.extend(ids)
        self.response_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.token_versions.extend([-1] * len(ids))

    def append_policy(
        self, ids: Sequence[int], logprobs: Sequence[float], version: int = 0
    ) -> None:
        """Tokens the policy generated this turn, with their sampling log-probs and the
        weight version that sampled them."""
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} generated tokens but {len(logprobs)} log-probs")
        self.token_ids.extend(ids)
        self.response_mask.extend([1] * len(ids))
        self.logprobs.extend(logprobs)
        self.token_versions.extend([int(version)] * len(ids))

    def append_generation(self, result: GenerationResult) -> None:
        """A generation's tokens as policy tokens; a turn that a weight update preempted and
        resumed carries each token's version in ``extra["token_versions"]``."""
        self.append_policy(result.token_ids, result.logprobs, result.policy_version)
        resumed = result.extra.get("token_versions")
        if resumed:
            self.token_versions[len(self.token_versions) - len(resumed) :] = resumed

    def record_versions(self, result: GenerationResult) -> None:
        """Add the versions that generated a turn's ``result`` to ``policy_versions``: its one
        version, or, for a turn preempted by weight updates, the version of each part that
        generated tokens (the trajectory store shows the turn's staleness, not only its end)."""
        resumed = result.extra.get("token_versions")
        self.policy_versions.extend(dict.fromkeys(resumed) if resumed else [result.policy_version])

    def turn_sample(self, prompt_ids: Sequence[int]) -> Trajectory:
        """A per-turn sample of this episode (``samples``) whose prompt is ``prompt_ids``: the
        template's rendering of the conversation so far. Append it to ``samples`` once its turn
        has its tokens and reward."""
        sample = Trajectory(self.env_id, self.seed, self.group_id)
        sample.append_context(prompt_ids)
        sample.prompt_length = len(sample.token_ids)
        if not self.samples:
            self.prompt_length = sample.prompt_length
        return sample

    def end_turn(self, reward: float) -> None:
        """Record the env's reward for the turn whose tokens were appended last."""
        self.turn_rewards.append(float(reward))
        self.turn_ends.append(len(self.token_ids) - 1)

    # ------------------------------------------------------------------ views
    @property
    def num_turns(self) -> int:
        return len(self.turn_rewards)

    @property
    def episode_reward(self) -> float:
        """The return: the sum of turn rewards plus any reward-worker score."""
        return sum(self.turn_rewards) + self.final_reward

    @property
    def rows(self) -> list[Trajectory]:
        """The training samples of this episode: itself, or its per-turn ``samples``."""
        return self.samples or [self]

    @property
    def num_policy_tokens(self) -> int:
        return sum(c[1] if (c := row._counted()) else sum(row.response_mask) for row in self.rows)

    @property
    def num_tokens(self) -> int:
        """Tokens trained on (context included), over every sample of the episode."""
        return sum(c[2] if (c := row._counted()) else len(row.token_ids) for row in self.rows)

    def token_array(self, name: str) -> array.array[Any]:
        """The per-token list ``name`` (``token_ids``, ``response_mask``, ``logprobs``) as a
        machine array, which ``collate`` copies into a tensor in one go. Token ids and the mask
        are integers; one written as a float (``1.0``) is taken as its integer, never rounded."""
        code, values = _ARRAY_CODES[name], getattr(self, name)
        try:
            return array.array(code, values)
        except TypeError:  # floats in an integer list (a hand-built mask: 0.0 / 1.0)
            bad = next((v for v in values if not float(v).is_integer()), None)
            if bad is not None:
                raise ValueError(
                    f"Trajectory.{name} holds {bad}; its values are integers (token ids, a 0/1 "
                    "mask): build rows with append_context / append_policy"
                ) from None
            return array.array(code, map(int, values))

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version among the generated tokens (None before any)."""
        oldest = [version for row in self.rows if (version := row._oldest()) is not None]
        return min(oldest) if oldest else None

    def _oldest(self) -> int | None:
        """This row's own oldest policy version (``trainer.rollout.wire`` sends it along)."""
        if counted := self._counted():
            return counted[0]
        return min(itertools.compress(self.token_versions, self.response_mask), default=None)

    def _counted(self) -> Counts | None:
        """This row's own counts when known without reading its lists (a trajectory from an
        env worker: ``trainer.rollout.wire.PackedTrajectory``), else None."""
        return None

    def as_record(
        self, advantages: Sequence[float] | None = None, time_s: float | None = None
    ) -> dict[str, Any]:
        """The episode as a trajectory-store row (``envhub.runs.store.COLUMNS``): its training
        rows' tokens concatenated (``row_starts``), and ``advantages`` per token if trained."""
        rows = self.rows
        starts, total = [], 0
        for row in rows:
            starts.append(total)
            total += len(row.token_ids)
        mask = [m for row in rows for m in row.response_mask]
        policy = [a for a, m in zip(advantages or [], mask, strict=False) if m]
        return {
            "env_id": self.env_id,
            "seed": self.seed,
            "group_id": self.group_id,
            "success": self.success,
            "failed": self.failed,
            "failure": self.failure,
            "return": self.episode_reward,
            "advantage": sum(policy) / len(policy) if policy else None,
            "turns": self.num_turns,
            "tokens": total,
            "invalid_actions": self.invalid_actions,
            "terminated": self.terminated,
            "truncated": self.truncated,
            "time_s": time_s,
            "policy_versions": list(self.policy_versions),
            "turn_rewards": list(self.turn_rewards),
            "messages": json.dumps(self.messages, default=repr),
            "info": json.dumps({**self.info, **self.step_info}, default=repr),
            "token_ids": [t for row in rows for t in row.token_ids],
            "response_mask": mask,
            "logprobs": [lp for row in rows for lp in row.logprobs],
            "advantages": list(advantages) if advantages is not None else None,
            "row_starts": starts,
        }

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"unknown trajectory field(s) {sorted(unknown)}; expected some of {sorted(known)}"
            )
        samples = [cls.from_dict(sample) for sample in data.get("samples", [])]
        return cls(**{**data, "samples": samples})


class ChatRenderer:
    """Token ids for chat messages under a tokenizer's chat template (see module docstring).

    Native tool calling: ``tools`` (an env's OpenAI-format schemas, from its reset info) go to
    ``apply_chat_template(..., tools=...)`` when the template renders them (``native_tools``),
    so the prompt lists them the way the model saw them in post-training, and ``parse`` reads
    each generated turn with the model family's ``rollout.tool_parser`` into an assistant
    message with structured ``tool_calls``. A template that renders no tools keeps the plain
    text protocol (the env's own prompt describes its tools; ``tool_parser`` ``auto`` then
    means ``none``); asking for a parser by name with such a template is a configuration error
    that names ``model.chat_template``.
    """

    max_tool_sets = 64
    """Tool sets whose base rendering is kept (least recently used go first)."""

    _BASE: ClassVar[tuple[dict[str, str], ...]] = (
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y"},
    )
    """The fixed dummy conversation of the delta trick (module docstring)."""

    def __init__(self, tokenizer: Any, tool_parser: str = "auto", max_tool_calls: int = 16) -> None:
        if tool_parser != "auto" and tool_parser not in TOOL_PARSERS:
            make_tool_parser(tool_parser)  # ValueError: the choices and the closest name
        self.tokenizer = tokenizer
        self.eos_token_id = int(tokenizer.eos_token_id)
        self._fast = FastText(tokenizer, self._BASE)
        self.end_of_turn_id = self._end_of_turn()  # a template that cannot render fails here
        """The token the template closes an assistant turn with: ``<end_of_turn>`` (Gemma),
        ``<|im_end|>`` (ChatML, even where ``eos_token`` is ``<|endoftext|>``); else EOS."""
        self.closing_ids = frozenset({self.end_of_turn_id, *self._alternative_turn_ends()})
        """A turn that ends with one of these is closed as the template closes it (``ended``)."""
        model_eos = model_eos_ids(getattr(tokenizer, "name_or_path", None) or "")
        self.turn_end_ids = frozenset({self.eos_token_id, *self.closing_ids, *model_eos})
        """A turn that ends with one of these was not cut off (it stopped): EOS, the template's
        closing tokens, and the model's generation-config EOS ids (read once here, from the
        tokenizer's folder: ``trainer.strategies.model_eos``; vLLM stops on those anyway)."""
        self.stop_token_ids = tuple(sorted(self.turn_end_ids - {self.eos_token_id}))
        """What generation requests stop on besides EOS (``GenerationRequest.stop_token_ids``):
        so both engines end a turn on the same tokens."""
        self._trailing = frozenset({*self.turn_end_ids, getattr(tokenizer, "pad_token_id", None)})
        """Ids ``parse_text`` strips from a turn's end (read once: tokenizer properties cost)."""
        self._eos_text = tokenizer.eos_token or ""
        self.native_tools = tool_parser != "none" and self._renders_tools()
        """Tools go to the template and turns are parsed (off for ``none`` or a template
        that renders no tools)."""
        if tool_parser not in ("auto", "none") and not self.native_tools:
            raise ValueError(
                f"rollout.tool_parser: {tool_parser} needs a chat template that renders tools "
                "(apply_chat_template(..., tools=...)), and this tokenizer's does not; set "
                "model.chat_template to a template with tool support, or rollout.tool_parser: "
                "none to keep tools in the env's text prompt"
            )
        if tool_parser == "auto":
            tool_parser = detect_tool_parser(getattr(tokenizer, "chat_template", None))
        self.tool_parser_name = tool_parser if self.native_tools else "none"
        """The parser in use: ``none`` when the template renders no tools."""
        self.max_tool_calls = max_tool_calls
        self._parser: ToolParser | None = None
        self._bases: dict[str, tuple[str, str, str]] = {}
        self._base(None)  # a template that cannot render the dummy conversation fails here
        self.append_only = self._appends_only()
        """Growing a conversation only appends to its rendering (the delta trick holds); False
        for templates that rewrite history (Qwen3 drops earlier turns' thinking), which need
        ``rollout.sample_unit: turn``."""
        if self.append_only:
            self._check_appended()

    def _check_appended(self) -> None:
        """Warn when a dummy episode built as the env manager builds it (prompt, answer,
        continuation) is not the template's rendering tokenised whole: then every episode's
        turn boundaries would hold tokens the model never sees served."""
        grown = [*self._BASE, {"role": "user", "content": "z"}]
        try:
            built = self.prompt(grown[:1]) + self.answer("y")
            built += self.continuation(grown[2:], stopped_on_eos=True)
            expected = self.encode(self._render(grown, generation_prompt=True))
        except Exception:  # noqa: BLE001 - a check only: rendering errors surface where used
            return
        if built != expected:
            _log.warning(
                "the chat template and tokenizer do not give the same tokens when an episode is "
                "appended turn by turn as when it is tokenised whole (%s vs %s); consider "
                "rollout.sample_unit: turn",
                self.tokenizer.convert_ids_to_tokens(built),
                self.tokenizer.convert_ids_to_tokens(expected),
            )

    def _end_of_turn(self) -> int:
        """The first token of what the template writes after an assistant turn's content when
        it is a special (added) token, else EOS."""
        base = self._render(self._BASE, generation_prompt=False)
        ids = self.encode(base[base.rindex("y") + 1 :])
        return ids[0] if ids and self._is_special(ids[0]) else self.eos_token_id

    def _alternative_turn_ends(self) -> list[int]:
        """The ids of the ``_ALTERNATIVE_TURN_ENDS`` this template writes and this tokenizer
        has as one special token."""
        template = str(getattr(self.tokenizer, "chat_template", None) or "")
        found = [self.encode(text) for text in _ALTERNATIVE_TURN_ENDS if text in template]
        return [ids[0] for ids in found if len(ids) == 1 and self._is_special(ids[0])]

    def _is_special(self, token_id: int) -> bool:
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        special = getattr(self.tokenizer, "all_special_ids", None) or ()
        return token_id in added or token_id in special

    def _appends_only(self) -> bool:
        """Whether a grown conversation's rendering starts with the shorter one's: probed with
        thinking (Qwen3 drops it from earlier turns), with a system message and, when tools
        are rendered, with tools (Mistral writes both into the *last* user turn)."""
        thought = {"role": "assistant", "content": "<think>\nplan\n</think>\n\ny"}
        system = {"role": "system", "content": "s"}
        tool_sets: list[list[dict[str, Any]] | None] = [None]
        if self.native_tools:
            tool_sets.append(FastText._PROBE_TOOLS)
        for tools in tool_sets:
            for opening in ([], [system]):
                shown = [*opening, self._BASE[0], thought]
                grown = [*shown, {"role": "user", "content": "z"}]
                try:
                    before = self._render(shown, generation_prompt=False, tools=tools)
                    after = self._render(grown, generation_prompt=True, tools=tools)
                except Exception:  # a template refusing system messages (Gemma) or tools
                    if opening or tools:
                        continue  # never renders them: nothing to probe
                    raise
                if not after.startswith(before):
                    return False
        return True

    def _renders_tools(self) -> bool:
        probe = [{"type": "function", "function": {"name": "envhub_probe", "parameters": {}}}]
        try:
            with_tools = self._render(self._BASE, generation_prompt=False, tools=probe)
        except Exception:  # noqa: BLE001 - any template error means "cannot render tools"
            return False
        return "envhub_probe" in with_tools

    @property
    def reset_options(self) -> dict[str, Any] | None:
        """The ``reset`` options of an episode rendered here: with tools rendered natively, the
        template lists them, so tool envs leave their own listing out (``describe_tools``;
        envs without tools ignore it)."""
        return {"describe_tools": False} if self.native_tools else None

    def _tools(self, tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return list(tools) if tools and self.native_tools else None

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        generation_prompt: bool,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """The template's text of ``messages``, ``tools`` rendered as ``prompt`` renders them."""
        return self._render(messages, generation_prompt, tools=self._tools(tools))

    def _render(
        self,
        messages: Sequence[dict[str, Any]],
        generation_prompt: bool,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        messages = [dict_arguments(m) for m in messages]
        fast = self._fast.render(messages, generation_prompt, tools)
        if fast is not None:
            return fast
        extra = {"tools": list(tools)} if tools else {}
        return self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=generation_prompt, tokenize=False, **extra
        )

    def _base(self, tools: list[dict[str, Any]] | None) -> tuple[str, str, str]:
        """(base text, closing after the turn's end-of-turn token, closing without one) for the
        tool set ``tools``."""
        key = json.dumps(tools, sort_keys=True) if tools else ""
        found = self._bases.pop(key, None)  # (re-inserted: the newest used)
        if found is None:
            base = self._render(self._BASE, generation_prompt=False, tools=tools)
            closing = base[base.rindex("y") + 1 :]
            end = self.end_of_turn_text
            after_eos = closing[len(end) :] if end and closing.startswith(end) else closing
            without_eos = closing if closing.startswith(end) else end + closing
            found = (base, after_eos, without_eos)
            while len(self._bases) >= self.max_tool_sets:
                del self._bases[next(iter(self._bases))]
        self._bases[key] = found
        return found

    @functools.cached_property
    def end_of_turn_text(self) -> str:
        """``end_of_turn_id`` as text."""
        return self.decode([self.end_of_turn_id], skip_special_tokens=False)

    @functools.cached_property
    def _answer_head(self) -> str:
        """The rendering an SFT answer follows (a user turn and the generation prompt); "" for a
        template that refuses it (``answer`` then falls back)."""
        try:
            return self._render(self._BASE[:1], generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that refuses the dummy turn: the fallback
            return ""

    def ended(self, ids: Sequence[int]) -> bool:
        """Whether a generated turn ends as the template ends a turn (``closing_ids``: the
        end-of-turn token, or ``<|eom_id|>`` where the template writes it in its place):
        ``continuation``'s ``stopped_on_eos``. A turn cut off, or stopped by a token the template
        does not close a turn with (Gemma's ``<eos>``), has not: the end-of-turn token follows."""
        return bool(ids) and ids[-1] in self.closing_ids

    def encode_delta(self, text: str) -> list[int]:
        """Ids of ``text`` as they are inside a longer rendering: encoded after EOS (a special
        token that splits it off), whose id is then dropped. On its own, a sentencepiece-style
        tokenizer (``Metaspace(prepend_scheme="first")``: Mistral v0.3, Llama 2) would begin
        the text with ``▁``, a token the whole conversation's encoding never has there."""
        prefix = self._eos_text
        ids = self.encode(prefix + text) if prefix else []
        return ids[1:] if ids[:1] == [self.eos_token_id] else self.encode(text)

    def encode(self, text: str) -> list[int]:
        if self._fast.backend is not None:
            return list(self._fast.backend.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        """The opening prompt: all messages (and ``tools``) plus the assistant generation prompt."""
        return self.encode(self._render(messages, generation_prompt=True, tools=self._tools(tools)))

    def continuation(
        self,
        new_messages: Sequence[dict[str, Any]],
        stopped_on_eos: bool,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Ids to append after a policy turn: close the turn, the new messages, the next prompt.
        ``stopped_on_eos``: the turn ends as the template ends a turn (``ended``), so only the
        rest of the template's closing follows; any other turn (cut off, or stopped by EOS where
        EOS is not the end-of-turn token) gets the end-of-turn token first.

        ``tools`` must be the episode's tools as given to ``prompt`` (the base conversation of
        the delta trick is rendered with them, so a tools block is not repeated)."""
        schemas = self._tools(tools)
        base, after_eos, without_eos = self._base(schemas)
        full = self._render([*self._BASE, *new_messages], generation_prompt=True, tools=schemas)
        if not full.startswith(base):
            raise ValueError(
                "the chat template renders a conversation differently when it grows (it "
                "rewrites earlier turns), so episodes cannot be one appended token sequence; set "
                "rollout.sample_unit: turn (or auto) to train each turn as its own sample"
            )
        closing = after_eos if stopped_on_eos else without_eos
        return self.encode_delta(closing + full[len(base) :])

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParsedTurn:
        """One generated turn as an assistant message: tool calls read with ``tool_parser``
        when the episode has tools and the template renders them, else the text as content."""
        if self._tools(tools) is None:
            return ParsedTurn(content=text, raw=text)
        return self.tool_parser.parse(text)

    def read_turn(
        self, token_ids: Sequence[int], tools: Sequence[dict[str, Any]] | None = None
    ) -> ParsedTurn:
        """A generated turn's ids read as an assistant message (``parse`` of their text). Never
        raises: a parser, or the message or env action built from its calls, that fails on the
        model's text (any exception) makes the turn a malformed call, the text as content and
        the error said, so one odd sample is an invalid action, not a crashed episode."""
        text = self.parse_text(token_ids)
        try:
            turn = self.parse(text, tools)
            if turn.tool_calls:  # (text alone cannot fail to serialise)
                turn.message(), env_action(turn)  # both serialise the calls: checked here
        except Exception as error:  # noqa: BLE001 - a model's text may make a parser raise
            why = f"the tool call could not be read ({type(error).__name__}: {error})"[:500]
            return ParsedTurn(content=text, error=why, raw=text)
        return turn

    @property
    def tool_parser(self) -> ToolParser:
        """The model family's parser (built on first use: looking for vLLM's costs an import)."""
        if self._parser is None:
            self._parser = make_tool_parser(
                self.tool_parser_name, self.tokenizer, max_calls=self.max_tool_calls
            )
        return self._parser

    def answer(self, content: str) -> list[int]:
        """Ids of an assistant answer as the template writes it after its generation prompt,
        up to its end-of-turn token (for SFT data): the delta trick, so a leading space
        (Mistral), trimmed content (Llama 3) or an empty think block (Qwen3) is trained as the
        template renders it. A template whose answer does not follow its generation prompt
        gets the content and the end-of-turn token."""
        end, head = self.end_of_turn_text, self._answer_head
        try:
            turn = {"role": "assistant", "content": content}
            full = self._render([self._BASE[0], turn], generation_prompt=False) if head else ""
        except Exception:  # noqa: BLE001 - a template that refuses the dummy turn: the fallback
            full = ""
        cut = full.rfind(end) if end else -1
        if head and full.startswith(head) and cut >= len(head):
            return self.encode_delta(full[len(head) : cut + len(end)])
        return self.encode_delta(content + end)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; special tokens left out by default (for logs and transcripts)."""
        backend = self._fast.backend if self._fast.decodes else None
        if backend is not None:
            return str(backend.decode(list(ids), skip_special_tokens=skip_special_tokens))
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def parse_text(self, ids: Sequence[int]) -> str:
        """The text a generated turn is parsed from: its trailing stop / end-of-turn / pad ids
        removed, every other special token kept. Tool-call tags are special tokens in many
        tokenizers (Mistral's ``[TOOL_CALLS]``, Llama 3.1's ``<|python_tag|>``, Hermes-3's
        ``<tool_call>``); a decode that skips them leaves calls no parser can see."""
        end = len(ids)
        while end and ids[end - 1] in self._trailing:
            end -= 1
        return self.decode(ids[:end], skip_special_tokens=False)
