"""Warm start data: behaviour-cloning trajectories from a scripted expert or a JSONL file.

Demonstrations become ``Trajectory`` objects exactly like RL rollouts (same chat template,
same appended-not-re-tokenised ids, ``response_mask`` on the assistant tokens), so the SFT
stage trains with the same collate, the same strategy and the same checkpoint format.

``expert_trajectories`` plays envs from the hub with their ``expert_action()``, optionally
as a *sloppy* demonstrator: with probability ``noise`` a move is replaced by ``noise_action``
(a habit, e.g. always "down") or, when that is None, by a random move among those the expert
has made so far (epsilon-greedy). Demonstrations that are mostly a habit teach the answer
format and some play while the greedy policy stays as weak as the habit, yet the expert's
moves are in the data often enough for RL to find and amplify them (RL then beats its teacher);
``load_jsonl`` reads one conversation per line, ``{"messages": [{"role": ..., "content":
...}, ...]}`` (extra keys such as ``env_id``, ``seed``, ``success``, ``tools`` are kept when
present); an assistant message's ``tool_calls`` (and an expert's ``<tool_call>`` text) are
trained as the chat template writes the calls when it renders tools natively (Mistral
``[TOOL_CALLS]``, Llama 3 JSON, hermes: the syntax ``rollout.tool_parser`` reads back in RL),
and in envhub's ``<tool_call>`` form for the plain-text protocol (``_answer_ids``);
``write_jsonl`` writes that same format, so collected demonstrations can be reused.
Both kinds are prompted as RL prompts each turn (``rollout.context``: ``last_k_turns`` and
``strip_thinking`` make one sample per turn, as the rollouts do). ``load_demo_file`` reads a
run's ``sft.path`` so, and refuses a file whose longest demonstration the devices cannot train
(the memory check with the tokens counted, before any worker starts).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.errors import ConfigError, TrainerError
from trainer.rollout.env_manager import Context, prompt_context
from trainer.rollout.tool_parsers import (
    CHAT_ROLES,
    ParsedTurn,
    content_text,
    env_action,
    make_tool_parser,
    message_turn,
)
from trainer.rollout.trajectory import ChatRenderer, Trajectory

if TYPE_CHECKING:
    from trainer.config import TrainerConfig

__all__ = [
    "SFT_SEED_BASE",
    "SFTProgress",
    "clone",
    "configured_expert_demos",
    "expert_trajectories",
    "from_messages",
    "load_demo_file",
    "load_jsonl",
    "longest_row",
    "write_jsonl",
]

SFTProgress = Callable[[int, int, float], None]
"""Told after each warm-start batch: ``(batches done, batches in all, that batch's NLL)``."""

SFT_SEED_BASE = 1_500_000_000
"""Seeds of expert demonstrations: disjoint from training (< 1e9) and evaluation (1e9 + i)."""


def expert_trajectories(
    env_ids: Sequence[str],
    env_kwargs: dict[str, Any] | Callable[[str], dict[str, Any]],
    renderer: ChatRenderer,
    *,
    episodes: int,
    max_turns: int,
    seed_offset: int = 0,
    noise: float = 0.0,
    noise_action: str | None = None,
    noise_turns: int | None = None,
    seed: int = 0,
    context: Context = "full",
    context_turns: int = 4,
) -> list[Trajectory]:
    """``episodes`` demonstrations by the envs' scripted experts (round-robin over ``env_ids``).

    With ``noise > 0`` each move (of the first ``noise_turns`` of an episode, if set) is, with
    that probability, ``noise_action`` instead of the expert's (or, if None, a random one of the
    expert's moves seen so far); ``seed`` seeds that choice, so the same config collects the same
    demonstrations.
    """
    import envhub

    if not 0.0 <= noise <= 1.0:
        raise TrainerError(f"sft.expert_noise must be in [0, 1], got {noise!r}")
    rng = random.Random(seed)
    per_turn = not renderer.append_only or context != "full"  # as the rollouts sample
    seen: dict[str, None] = {}  # the expert's moves so far, in first-seen order (an ordered set)
    demos = []
    for i in range(episodes):
        env_id = env_ids[i % len(env_ids)]
        kwargs = env_kwargs(env_id) if callable(env_kwargs) else env_kwargs
        env = envhub.make(env_id, **kwargs)
        try:
            messages, reset_info = env.reset(  # the tools described once, as in RL
                seed=SFT_SEED_BASE + seed_offset + i, options=renderer.reset_options
            )
            tools = reset_info.get("tools") or None  # rendered as in RL (native tool calling)
            trajectory = Trajectory(
                env_id=env_id,
                seed=SFT_SEED_BASE + seed_offset + i,
                info=dict(reset_info),
                messages=list(messages),
            )
            if not per_turn:  # else (history rewritten) one sample per turn, as in RL
                trajectory.append_context(renderer.prompt(messages, tools))
                trajectory.prompt_length = len(trajectory.token_ids)
            for _ in range(max_turns):
                action = env.expert_action()
                if action is None:
                    if trajectory.num_turns == 0:
                        raise TrainerError(
                            f"{env_id} has no expert (its expert_action() returned None); set "
                            "sft.epochs=0 to skip the warm start, or sft.source: file with "
                            "sft.path (a JSONL of demonstrations)"
                        )
                    break
                seen.setdefault(action, None)
                noisy = noise_turns is None or trajectory.num_turns < noise_turns
                if noise and noisy and rng.random() < noise:
                    action = noise_action if noise_action is not None else rng.choice(list(seen))
                turn = _expert_turn(renderer, action, tools)
                tokens, shown = trajectory, trajectory.messages
                if per_turn:
                    shown = prompt_context(trajectory.messages, context, context_turns)
                    tokens = trajectory.turn_sample(renderer.prompt(shown, tools))
                    trajectory.samples.append(tokens)
                if turn.tool_calls:  # as the template writes the calls (native tools)
                    ids = _answer_ids(renderer, shown, turn.message(), tools)
                else:
                    ids = renderer.answer(action)
                tokens.append_policy(ids, [0.0] * len(ids))
                trajectory.messages.append(turn.message())
                messages, reward, terminated, truncated, info = env.step(action)
                trajectory.end_turn(reward)
                if per_turn:
                    tokens.end_turn(reward)
                trajectory.messages.extend(messages)
                trajectory.success = bool(info.get("success"))
                if terminated or truncated:
                    break
                if not per_turn:
                    trajectory.append_context(
                        renderer.continuation(messages, stopped_on_eos=True, tools=tools)
                    )
        finally:
            env.close()
        demos.append(trajectory)
    return demos


def configured_expert_demos(cfg: TrainerConfig, renderer: ChatRenderer) -> list[Trajectory]:
    """``expert_trajectories`` as a run's ``sft`` and ``rollout`` sections ask for them."""
    sft = cfg.sft
    return expert_trajectories(
        cfg.env.ids,
        cfg.env.kwargs_for,
        renderer,
        episodes=sft.episodes,
        max_turns=cfg.rollout.max_turns,
        noise=sft.expert_noise,
        noise_action=sft.noise_action,
        noise_turns=sft.noise_turns,
        seed=cfg.seed,
        context=cfg.rollout.context,
        context_turns=cfg.rollout.context_turns,
    )


def from_messages(
    messages: Sequence[dict[str, Any]],
    renderer: ChatRenderer,
    *,
    context: Context = "full",
    context_turns: int = 4,
    **fields: Any,
) -> Trajectory:
    """A trajectory from a chat transcript: assistant messages are the trained tokens.

    ``tools`` (a record's OpenAI-format schemas) are rendered as in RL; an assistant message's
    ``tool_calls`` are trained as the template writes them (``_answer_ids``: the family's own
    syntax with native tools, else envhub's ``<tool_call>`` form after its content). Each turn is
    prompted with what ``rollout.context`` (``context``, ``context_turns``) shows RL
    (``prompt_context``): one sample per turn unless that is the whole, appended history."""
    tools = fields.pop("tools", None) or None
    per_turn = not renderer.append_only or context != "full"  # as the rollouts sample
    trajectory = Trajectory(
        env_id=str(fields.pop("env_id", "file")),
        seed=int(fields.pop("seed", 0)),
        info={"tools": tools} if tools else {},
        messages=list(messages),
        success=bool(fields.pop("success", False)),
    )
    pending: list[dict[str, Any]] = []
    for at, message in enumerate(messages):
        if message.get("role") != "assistant":
            pending.append(message)
            continue
        tokens, shown = trajectory, list(messages[:at])
        if per_turn:  # history rewritten or shortened: one sample per turn, as in RL
            shown = prompt_context(shown, context, context_turns)
            tokens = trajectory.turn_sample(renderer.prompt(shown, tools))
            trajectory.samples.append(tokens)
        elif trajectory.num_turns == 0:
            trajectory.append_context(renderer.prompt(pending, tools))
            trajectory.prompt_length = len(trajectory.token_ids)
        else:
            trajectory.append_context(
                renderer.continuation(pending, stopped_on_eos=True, tools=tools)
            )
        ids = _answer_ids(renderer, shown, message, tools)
        tokens.append_policy(ids, [0.0] * len(ids))
        trajectory.end_turn(0.0)
        if tokens is not trajectory:
            tokens.end_turn(0.0)
        pending = []
    return trajectory


def _expert_turn(
    renderer: ChatRenderer, action: str, tools: Sequence[dict[str, Any]] | None
) -> ParsedTurn:
    """An expert's action as the assistant message RL would keep: read by the model family's
    parser (``ChatRenderer.parse``); with tools rendered natively and no call found that way,
    by envhub's ``<tool_call>`` parser (the form tool envs' experts write), so its calls become
    structured calls that ``_answer_ids`` trains in the template's own syntax."""
    turn = renderer.parse(action, tools)
    if turn.tool_calls or not (tools and renderer.native_tools):
        return turn
    hermes = make_tool_parser("hermes", prefer_vllm=False, max_calls=renderer.max_tool_calls)
    tagged = hermes.parse(action)
    return tagged if tagged.tool_calls and tagged.error is None else turn


def _answer_ids(
    renderer: ChatRenderer,
    context: Sequence[dict[str, Any]],
    message: dict[str, Any],
    tools: Sequence[dict[str, Any]] | None,
) -> list[int]:
    """The ids SFT trains for the assistant ``message`` after ``context``, up to and with the
    template's end-of-turn token.

    A message with ``tool_calls``, under a template that renders ``tools`` natively: the
    template's rendering of the structured calls, the delta between ``context`` with the
    generation prompt and ``context`` plus ``message`` (the trick ``ChatRenderer.answer`` uses),
    so the trained ids are the family's own call syntax (Mistral ``[TOOL_CALLS]``, Llama 3 JSON,
    hermes ...) and its ``rollout.tool_parser`` reads them back in RL. A template that rewrites
    the context once the turn is added (Mistral moves the system prompt to the last user turn)
    is asked for the turn after a one-message placeholder context instead, as ``answer`` does.
    Otherwise (no calls, no tools, or the plain-text protocol) ``ChatRenderer.answer`` of the
    content followed by each call in envhub's ``<tool_call>`` form, the text tool envs read."""
    text = _assistant_text(message)  # (refuses a call it cannot read, whatever the protocol)
    if not (message.get("tool_calls") and tools and renderer.native_tools):
        return renderer.answer(text)
    ends = [renderer.decode([i], skip_special_tokens=False) for i in renderer.closing_ids]
    for shown in (context, _PLACEHOLDER):
        try:
            head = renderer.render(shown, generation_prompt=True, tools=tools)
            full = renderer.render([*shown, message], generation_prompt=False, tools=tools)
        except Exception:  # the placeholder refused: the error below
            if shown is context:
                raise  # (load_jsonl names the template's refusal and the line)
            continue
        turn = full[len(head) :] if full.startswith(head) else ""
        cut = max((turn.rfind(end) + len(end) for end in ends if end and end in turn), default=0)
        if cut:
            return renderer.encode_delta(turn[:cut])
    raise TrainerError(
        "the chat template does not write an assistant turn with tool calls after its "
        "generation prompt, closed by its end-of-turn token, so the calls cannot be trained "
        "as it writes them; set rollout.tool_parser: none to train them as <tool_call> text"
    )


_PLACEHOLDER = ({"role": "user", "content": "x"},)
"""The context ``_answer_ids`` renders a turn after when the real one is rewritten."""


def _assistant_text(message: dict[str, Any]) -> str:
    """What the policy writes for an assistant message: its content, then its tool calls."""
    try:
        return env_action(message_turn(message))
    except ValueError as error:
        raise TrainerError(f"an assistant message's tool call is unreadable: {error}") from None


def longest_row(trajectory: Trajectory) -> int:
    """The tokens of the longest row ``trajectory`` trains (itself, or its longest turn sample)."""
    return max(len(rows.token_ids) for rows in [trajectory, *trajectory.samples])


def load_demo_file(
    cfg: TrainerConfig, renderer: ChatRenderer, *, max_tokens: int
) -> list[Trajectory]:
    """``sft.path``'s demonstrations as a run trains them: prompted as ``rollout.context`` says,
    each within ``max_tokens`` (the model's context). A file whose longest demonstration the
    devices cannot train is refused (``ConfigError``: the memory check of the ``sft`` phase, now
    with the tokens counted; the config check could only estimate them from the file's bytes)."""
    from trainer.memory import demonstration_problems

    rollout = cfg.rollout
    demos = load_jsonl(
        str(cfg.sft.path),
        renderer,
        max_tokens=max_tokens,
        context=rollout.context,
        context_turns=rollout.context_turns,
    )
    problems = demonstration_problems(cfg, max(longest_row(t) for t in demos))
    if problems:
        raise ConfigError(problems)
    return demos


def load_jsonl(
    path: str | Path,
    renderer: ChatRenderer,
    *,
    max_tokens: int | None = None,
    context: Context = "full",
    context_turns: int = 4,
) -> list[Trajectory]:
    """Trajectories from a JSONL file of ``{"messages": [...]}`` lines (see module docstring),
    each turn prompted with what ``context`` / ``context_turns`` show (``from_messages``).

    A malformed record is refused as ``TrainerError("file:line: what is wrong")``; so is, with
    ``max_tokens`` (the model's context), a record longer than that. It is refused, not
    truncated or dropped (as verl's SFT data does by default, ``truncation: error``): a cut
    transcript would train an answer that stops mid-way, and a silently dropped one shrinks the
    data behind the user's back; the message names the line to shorten or remove."""
    source = Path(path).expanduser()
    if not source.is_file():
        raise TrainerError(
            f"sft.path {str(path)!r} does not exist; point it at a JSONL of "
            '{"messages": [...]} lines'
        )
    trajectories = []
    for number, line in enumerate(source.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            messages, known = _checked_record(json.loads(line))
        except ValueError as error:  # json.JSONDecodeError is one
            raise TrainerError(f"{where}: {error}") from None
        try:
            trajectory = from_messages(
                messages, renderer, context=context, context_turns=context_turns, **known
            )
        except TrainerError as error:
            raise TrainerError(f"{where}: {error}") from None
        except Exception as error:  # noqa: BLE001 - the chat template's own refusal, named
            raise TrainerError(
                f"{where}: the chat template cannot render this conversation "
                f"({type(error).__name__}: {error})"
            ) from None
        if trajectory.num_turns == 0:
            raise TrainerError(f"{where}: the conversation has no assistant message to learn from")
        longest = longest_row(trajectory)
        if max_tokens is not None and longest > max_tokens:
            raise TrainerError(
                f"{where}: the conversation is {longest} tokens, longer than the model's context "
                f"of {max_tokens} tokens (max_position_embeddings); shorten or split it, or "
                "remove the line"
            )
        trajectories.append(trajectory)
    if not trajectories:
        raise TrainerError(f"{source} holds no conversations")
    return trajectories


class _RecordError(ValueError):
    """A JSONL record that is not a conversation ``load_jsonl`` can train."""


def _checked_record(record: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A decoded line's messages (list content as its text: ``content_text``) and the extra keys
    ``from_messages`` takes; ``_RecordError`` says what is wrong, at which key."""
    if not isinstance(record, dict) or "messages" not in record:
        raise _RecordError('each line must be a JSON object with "messages"')
    messages = record["messages"]
    if not isinstance(messages, list):
        raise _RecordError(f'"messages" must be a list of messages, got {type(messages).__name__}')
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _RecordError(
                f'messages[{index}] must be an object with "role" and "content", got '
                f"{type(message).__name__}"
            )
        if not isinstance(message.get("role"), str):
            raise _RecordError(f'messages[{index}] has no "role" (user, assistant, tool, ...)')
        if message["role"] not in CHAT_ROLES:
            raise _RecordError(
                f"messages[{index}].role {message['role']!r} is not a chat role; use one of "
                + ", ".join(CHAT_ROLES)
            )
        try:
            text = content_text(message.get("content"))
        except (TypeError, ValueError) as error:
            raise _RecordError(f"messages[{index}].{error}") from None
        checked.append(
            {**message, "content": text} if isinstance(message.get("content"), list) else message
        )
    known = {k: record[k] for k in ("env_id", "seed", "success", "tools") if k in record}
    _check_declared_calls(checked, known.get("tools"))
    kinds = {
        "env_id": (str, "a string"),
        "success": (bool, "true or false"),
        "tools": (list, "a list of tool schemas"),
    }
    for key, (kind, what) in kinds.items():
        if key in known and known[key] is not None and not isinstance(known[key], kind):
            raise _RecordError(f'"{key}" must be {what}, got {known[key]!r}')
    seed = known.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise _RecordError(f'"seed" must be an integer, got {seed!r}')
    return checked, known


def _check_declared_calls(messages: list[dict[str, Any]], tools: Any) -> None:
    """Every assistant tool call names a tool the record's ``tools`` declares: the policy is
    trained to call only what its prompt shows, as in RL (a call to an undeclared tool would
    teach it to call tools it was never told of)."""
    declared = set()
    for schema in tools if isinstance(tools, list) else []:
        if isinstance(schema, dict):
            function = schema.get("function", schema)
            declared.add(function.get("name") if isinstance(function, dict) else None)
    for index, message in enumerate(messages):
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        for number, call in enumerate(calls if isinstance(calls, list) else []):
            function = call.get("function", call) if isinstance(call, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            if isinstance(name, str) and name not in declared:
                raise _RecordError(
                    f"messages[{index}].tool_calls[{number}] calls {name!r}, which the record's "
                    f'"tools" does not declare; add its schema to "tools" (a list of OpenAI '
                    "function schemas: the prompt shows the tools the policy may call)"
                )


def write_jsonl(trajectories: Iterable[Trajectory], path: str | Path) -> Path:
    """Write transcripts as ``load_jsonl`` reads them (with the tool schemas they were shown)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w") as f:
        for t in trajectories:
            record = {"env_id": t.env_id, "seed": t.seed, "success": t.success}
            if t.info.get("tools"):
                record["tools"] = t.info["tools"]
            f.write(json.dumps({**record, "messages": t.messages}) + "\n")
    return target


def clone(
    data: Sequence[Trajectory],
    train: Callable[[list[Trajectory], int, int], float | Mapping[str, float]],
    *,
    epochs: int,
    batch_size: int,
    seed: int,
    on_step: SFTProgress | None = None,
) -> dict[str, float]:
    """Behaviour cloning: ``epochs`` passes over ``data`` in ``batch_size`` chunks, reshuffled
    each pass (``random.Random(seed)``). ``train(chunk, step, total)`` trains on one chunk
    (1-based ``step`` of ``total`` batches, which the progress and the LR schedule count) and
    returns the worker's metrics: ``sft/nll`` and ``sft/optimizer_steps`` (more than one when
    ``train.grad_accumulation`` cuts the chunk into several optimiser steps), or the NLL alone
    for one step. Returns ``sft/nll`` (the last epoch's mean NLL over its batches: what the warm
    start ends on, not one batch's luck), ``sft/nll_first_epoch`` (where it started) and
    ``sft/steps``, the optimiser steps taken."""
    order, rng = list(range(len(data))), random.Random(seed)
    per_epoch = -(-len(order) // batch_size)
    total = epochs * per_epoch
    epoch_nlls: list[float] = []
    first, steps = 0.0, 0.0
    for epoch in range(epochs):
        rng.shuffle(order)
        epoch_nlls = []
        for batch, start in enumerate(range(0, len(order), batch_size)):
            step = epoch * per_epoch + batch + 1
            metrics = train([data[i] for i in order[start : start + batch_size]], step, total)
            if isinstance(metrics, Mapping):
                epoch_nlls.append(metrics["sft/nll"])
                steps += metrics.get("sft/optimizer_steps", 1.0)
            else:
                epoch_nlls.append(metrics)
                steps += 1.0
            if on_step is not None:
                on_step(step, total, epoch_nlls[-1])
        if epoch == 0:
            first = sum(epoch_nlls) / len(epoch_nlls)
    return {
        "sft/nll": sum(epoch_nlls) / max(len(epoch_nlls), 1),
        "sft/nll_first_epoch": first,
        "sft/steps": steps,
    }
