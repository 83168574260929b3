"""The OpenAI-compatible endpoint black-box agents train through (``rollout.agent``).

With ``rollout.agent`` set, ``envhub train`` serves chat completions on loopback, backed by the
run's ``EngineRouter`` (``actor_infer``), and every episode is played by the user's agent
(``trainer.rollout.agents``) instead of the built-in env manager. The agent talks to the model
with the plain ``openai`` SDK and to the env through two more routes on the same server::

    GET  /v1/models                the one model (``rollout.agent.model_name``)
    POST /v1/chat/completions      a policy turn; ``stream: true`` answers as server-sent events
    GET  /v1/envhub/episode        the episode: env id, seed, first messages, tools
    POST /v1/envhub/step           ``{"action": text | assistant message}`` -> the env's reply,
                                   each tool call answered (``proxy_reply.answered``)

The api key (``Authorization: Bearer``) names the episode; a key the proxy never handed out is
refused (401), one whose episode has ended gets 410, so an abandoned agent cannot write into
another episode.

What is recorded (``proxy_episode.ProxyEpisode``): a call renders its messages (and ``tools``)
with the policy's chat template into prompt ids, the engine generates, and the generated ids
and their log-probs are kept exactly as sampled (never re-tokenised). When a call's messages are
the last call's messages, the reply the proxy gave, and new messages (the usual agent loop), the
call *extends* the sample: only the new messages are rendered, with the env manager's delta
trick, and appended as context, so the sample is the same token sequence the built-in env
manager builds. A call that does not extend the last (the agent rewrote history, dropped the
reply, or changed tools) starts a new sample, prompted with its own rendering; so does every
call when the chat template rewrites history (``ChatRenderer.append_only`` False, e.g. Qwen3
dropping earlier thinking), as the env manager then trains each turn as its own sample. An env
step credits its reward to the last token of the call whose reply it acted on
(``ProxyEpisode.credited``: never a reply the agent discarded). Every call is tagged with the
engine's policy version. ``stop`` strings end the turn where OpenAI would; the tokens after are
neither trained nor returned (``proxy_reply.cut_at_stop``).

Only replies the agent received are trained, each once: nothing is recorded until a call has
its generation and its client is still there (a client that disconnects, a timeout of the
``openai`` SDK say, cancels the call and aborts its generation: ``proxy_http``), and an SDK
retry of a call whose reply went out as its client gave up takes that reply back
(``ProxyEpisode.retract``; a retry of a call abandoned before its reply takes nothing back).
The body is checked first (``proxy_request.chat_request``: a bad field, a non-text content
part, an option that needs guided decoding, a template that refuses the messages is a 400
naming it; a ``developer`` message is a ``system`` one), and a call or step that finishes
after its episode ended (the agent returned, timed out, was cancelled) answers 410 and leaves
the trajectory the scheduler already has untouched; closing the episode aborts its generation
in flight. Once the env has ended the episode, model calls answer 409 (their tokens would
follow the episode's score).

Sampling is the run's (``rollout.temperature``, ``top_p``; a request's own are ignored, said
once in the log) so the recorded log-probs are the policy's; ``max_tokens`` may only lower
``rollout.max_new_tokens``. ``n > 1`` is refused (each call is one sample; make n calls), and
so are ``tool_choice`` that forces a call, ``response_format`` other than text and
``top_logprobs``; ``tool_choice: "none"`` renders the tools and parses no call (as vLLM).
A generation aborted under the agent (its group was cancelled) fails the episode and answers
503; a weight update in ``async`` mode preempts the call and resumes it (the agent only waits).
A call past ``rollout.max_turns``, or one whose prompt leaves no room in the context, ends the
episode as truncated (the env manager's limits), answering 400; a request far larger than the
context holds (16 characters of text a token, a token a message) is refused so before it is
rendered.
Bodies, connections and shutdown are bounded by ``ServerLimits`` (``rollout.agent.limits``).

The HTTP side (routes, error bodies, streaming, the uvicorn server) is
``trainer.rollout.proxy_http``; this module is what the routes do.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trainer.rollout.chat_messages import same_message
from trainer.rollout.env_output import checked_step
from trainer.rollout.proxy_episode import ProxyCall, ProxyEpisode
from trainer.rollout.proxy_http import ServerLimits, listen, proxy_app
from trainer.rollout.proxy_reply import answered, completion_body, cut_at_stop, cut_content
from trainer.rollout.proxy_request import ChatRequest, ProxyError, chat_request
from trainer.rollout.trajectory import ChatRenderer, Trajectory
from trainer.strategies.base import GenerationRequest, GenerationResult

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from trainer.rollout.env_manager import EnvSession, Sampling
    from trainer.rollout.router import RolloutEngine

__all__ = ["AgentProxy"]

_log = logging.getLogger(__name__)


class AgentProxy:
    """The chat-completions server of one training run (see the module docstring).

    ``start()`` binds ``host:port`` (0: a free port) and serves on the running event loop, the
    rollout loop whose engine router it calls; ``open`` registers an episode and returns its
    recording, ``aclose`` stops serving."""

    def __init__(
        self,
        engine: RolloutEngine,
        renderer: ChatRenderer,
        *,
        max_turns: int,
        max_context_tokens: int,
        step_timeout_s: float | None = None,
        model_name: str = "policy",
        host: str = "127.0.0.1",
        port: int = 0,
        limits: ServerLimits | None = None,
    ) -> None:
        self.engine, self.renderer = engine, renderer
        self.max_turns, self.max_context_tokens = max_turns, max_context_tokens
        self.step_timeout_s = step_timeout_s
        self.model_name, self.host, self.port = model_name, host, port
        self.limits = limits or ServerLimits()
        self._episodes: dict[str, ProxyEpisode] = {}
        self._ended: dict[str, str] = {}
        """api key -> episode key of ended episodes (a late call gets 410, not 401)."""
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None
        self._aborts: set[asyncio.Task[None]] = set()
        self._warned_sampling = False
        self._warned_credit = False
        self._token_chars: int | None = None
        """Characters a token is taken to hold (``_chars_per_token``), read once."""
        if not renderer.append_only:
            _log.warning(
                "the chat template rewrites earlier turns as a conversation grows, so every "
                "model call of an agent is trained as its own sample"
            )

    @property
    def base_url(self) -> str:
        """``http://host:port/v1``: what the ``openai`` SDK's ``base_url`` takes."""
        return f"http://{self.host}:{self.port}/v1"

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Bind, listen and serve on the running loop (requests queue until uvicorn accepts)."""
        self._server, self._task, self.port = listen(self.app(), self.host, self.port, self.limits)

    async def aclose(self) -> None:
        """Close every episode and stop serving (requests still running after
        ``limits.shutdown_timeout_s`` are cancelled)."""
        for episode in list(self._episodes.values()):
            self.close(episode)
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
            self._server = self._task = None
        await asyncio.gather(*self._aborts, return_exceptions=True)

    def open(
        self,
        key: str,
        trajectory: Trajectory,
        session: EnvSession,
        sampling: Sampling,
        messages: list[dict[str, Any]],
        info: dict[str, Any],
    ) -> ProxyEpisode:
        """Register an episode whose env has been reset; its api key names it."""
        if self._task is not None and self._task.done():
            error = self._task.exception()
            raise RuntimeError(f"the agent proxy is not serving (it stopped: {error!r})")
        api_key = f"envhub-{key}-{secrets.token_urlsafe(12)}"
        episode = ProxyEpisode(
            key=key,
            api_key=api_key,
            trajectory=trajectory,
            session=session,
            sampling=sampling,
            tools=info.get("tools") or None,
            first_messages=list(messages),
            info=dict(info),
        )
        self._episodes[api_key] = episode
        return episode

    def close(self, episode: ProxyEpisode) -> None:
        """The episode is over: its key answers 410 from now on, and its generation in flight
        is aborted in the engine (its tokens would be recorded nowhere)."""
        episode.end()
        if episode.generating is not None:
            self._abort(episode.generating)
        if self._episodes.pop(episode.api_key, None) is not None:
            self._ended[episode.api_key] = episode.key
            if len(self._ended) > 65_536:  # remember the latest ended keys only
                self._ended.pop(next(iter(self._ended)))

    def _abort(self, request_id: str) -> None:
        """Abort ``request_id`` in the engine, in the background."""
        aborting = asyncio.ensure_future(self.engine.abort(request_id))
        self._aborts.add(aborting)
        aborting.add_done_callback(self._aborted)

    def _aborted(self, task: asyncio.Task[None]) -> None:
        self._aborts.discard(task)
        if not task.cancelled() and task.exception() is not None:
            _log.warning("aborting an abandoned generation failed: %r", task.exception())

    def episode(self, authorization: str | None) -> ProxyEpisode:
        """The open episode an ``Authorization: Bearer KEY`` header names (else a ProxyError)."""
        scheme, _, api_key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not api_key:
            raise ProxyError(
                401, "no api key: pass the episode's api_key (AgentEpisode.api_key)", "no_api_key"
            )
        episode = self._episodes.get(api_key.strip())
        if episode is not None and not episode.ended.is_set():
            return episode
        ended = self._ended.get(api_key.strip()) or (episode.key if episode else None)
        if ended is not None:
            raise ProxyError(
                410,
                f"episode {ended} has ended (finished, failed, timed out or aborted); a new "
                "episode comes with a new api key",
                "episode_ended",
            )
        raise ProxyError(
            401,
            "unknown api key: this proxy serves the keys it hands to running episodes "
            "(AgentEpisode.api_key)",
            "invalid_api_key",
        )

    @staticmethod
    def _check_open(episode: ProxyEpisode, action: str) -> None:
        """410 once the episode has ended (``action`` was not recorded); 409 once the env did."""
        if episode.ended.is_set():
            raise ProxyError(
                410,
                f"episode {episode.key} has ended; this {action} was not recorded",
                "episode_ended",
            )
        if episode.env_done:
            raise ProxyError(
                409,
                f"the env has already ended this episode (terminated or truncated); a {action} "
                "now would not be scored, so it is refused: return from the agent",
                "env_done",
            )

    # ------------------------------------------------------------------ a policy turn
    def request(self, episode: ProxyEpisode, body: Mapping[str, Any]) -> ChatRequest:
        """``body`` checked (``proxy_request.chat_request``). More messages than the context
        has tokens are refused before any is checked, and end the episode as truncated, as a
        prompt too long for the context does (``complete``)."""
        try:
            return chat_request(body, max_messages=self.max_context_tokens)
        except ProxyError as error:
            if error.code == "context_length_exceeded" and not episode.env_done:
                episode.trajectory.truncated = True
                episode.end()
            raise

    async def complete(
        self, episode: ProxyEpisode, request: ChatRequest, retry: bool = False
    ) -> dict[str, Any]:
        """One chat completion for ``episode`` (``request``: the checked body). ``retry``: the
        client says this is a retry (the SDK's ``x-stainless-retry-count``), so a reply to the
        same request that it never received is taken back first (``ProxyEpisode.retract``).
        Recorded only once its generation is back; cancelled before that (the client went
        away), nothing is recorded, the engine's generation is aborted, and the call is noted
        as abandoned (``ProxyEpisode.abandon``: its retry takes no delivered reply back)."""
        if request.model not in (None, self.model_name):
            raise ProxyError(
                404,
                f"model {request.model!r} is not served here; use {self.model_name!r} "
                "(AgentEpisode.model)",
                "model_not_found",
            )
        self._warn_sampling(request.sampling)
        tools = json.dumps(request.tools, sort_keys=True)
        try:
            async with episode.lock:
                return await self._turn(episode, request, tools, retry)
        except asyncio.CancelledError:  # the client went away (or the server is stopping)
            episode.abandon(request.messages, tools)
            raise

    async def _turn(
        self, episode: ProxyEpisode, request: ChatRequest, tools: str, retry: bool
    ) -> dict[str, Any]:
        """``complete``'s work, under the episode's lock."""
        self._check_open(episode, "model call")
        size = request.chars + len(request.messages) * self._chars_per_token()
        if size > self._prompt_chars():
            self._out_of_context(
                episode,
                f"the {len(request.messages)} messages hold {request.chars} characters of "
                f"text, longer than the context of {self.max_context_tokens} tokens can hold",
            )
        if retry:
            episode.retract(request.messages, tools)
        if episode.calls >= self.max_turns:  # truncated, as the env manager ends it ...
            row, context = self._context(episode, request)
            if row is not None:  # ... with the env's last reply appended as context
                row.append_context(context)
            episode.trajectory.truncated = True
            episode.end()
            raise ProxyError(
                400,
                f"the episode has used its {self.max_turns} model calls (rollout.max_turns)",
                "max_turns_exceeded",
            )
        started = time.monotonic()
        row, context = self._context(episode, request)
        prompt = [*(row.token_ids if row is not None else ()), *context]
        result = await self._generate(episode, prompt, request.max_tokens)
        result = cut_at_stop(self.renderer, result, request.stop)
        call = self._record(episode, request, row, context, result, tools)
        episode.record(call, time.monotonic() - started)
        return completion_body(
            self.renderer,
            completion_id=f"chatcmpl-{episode.key}-{episode.calls}",
            model=self.model_name,
            reply=call.seen[-1],
            result=result,
            prompt_tokens=len(prompt),
            logprobs=request.logprobs,
            stops=request.stop,
        )

    def _record(
        self,
        episode: ProxyEpisode,
        request: ChatRequest,
        row: Trajectory | None,
        context: list[int],
        result: GenerationResult,
        tools: str,
    ) -> ProxyCall:
        """Append the call's context and generation to its row (a new one when ``row`` is
        None) and read the reply the agent gets: tool calls parsed unless ``tool_choice`` is
        ``"none"`` (then the text is the content, as vLLM answers), each with an id unique in
        the episode, the content cut before a stop string."""
        from envhub.tool_calls import message_text

        new_row = row is None
        if row is None:  # a sample of its own, recorded now that it has its generation
            row = Trajectory(episode.trajectory.env_id, episode.trajectory.seed)
            row.group_id, row.prompt_length = episode.trajectory.group_id, len(context)
        start = len(row.token_ids)
        row.append_context(context)
        row.append_generation(result)
        versions = len(episode.trajectory.policy_versions)
        episode.trajectory.record_versions(result)
        parsed = request.tools if request.tool_choice != "none" else None
        reply = self.renderer.read_turn(result.token_ids, parsed).message()  # never raises
        if reply.get("tool_calls"):
            reply["tool_calls"] = [{**c, "id": episode.call_id()} for c in reply["tool_calls"]]
        reply = cut_content(reply, request.stop)
        episode.trajectory.messages = [dict(m) for m in request.messages] + [reply]
        return ProxyCall(
            row,
            start,
            len(row.token_ids),
            new_row,
            [*request.messages, reply],
            tools,
            self.renderer.ended(result.token_ids),
            message_text({"content": reply.get("content"), "tool_calls": reply.get("tool_calls")}),
            versions=len(episode.trajectory.policy_versions) - versions,
        )

    def _warn_sampling(self, asked: Mapping[str, float]) -> None:
        if asked and not self._warned_sampling:
            self._warned_sampling = True
            _log.warning(
                "the agent asks for %s; training samples with rollout.temperature/top_p so the "
                "recorded log-probs are the policy's (said once)",
                dict(asked),
            )

    def _chars_per_token(self) -> int:
        """The most characters of text one token is taken to hold: 16 (text averages about 4;
        a run of spaces or dashes reaches 16 only in long runs), or the tokenizer's longest
        token if shorter."""
        if self._token_chars is None:
            vocab = getattr(self.renderer.tokenizer, "get_vocab", None)
            longest = max(map(len, vocab()), default=16) if callable(vocab) else 16
            self._token_chars = min(max(longest, 1), 16)
        return self._token_chars

    def _prompt_chars(self) -> int:
        """The most characters a prompt within the context is taken to hold. A request holding
        more (its text, and a token's worth for each message: every message renders to a
        token at least) is refused before it is rendered and tokenised, which would hold the
        rollout loop for seconds per megabyte."""
        return self._chars_per_token() * self.max_context_tokens

    def _out_of_context(self, episode: ProxyEpisode, why: str) -> None:
        """End the episode as truncated, as the env manager does when the context is full."""
        episode.trajectory.truncated = True
        episode.end()
        raise ProxyError(
            400,
            f"{why}; this model's context length is {self.max_context_tokens} tokens (rollout "
            "context) and leaves no room to generate",
            "context_length_exceeded",
        )

    def _context(
        self, episode: ProxyEpisode, request: ChatRequest
    ) -> tuple[Trajectory | None, list[int]]:
        """The row this call extends (None: a sample of its own) and the ids to append to it;
        a template or tokenizer that refuses the messages is a 400 (nothing recorded)."""
        messages, tools, last = request.messages, request.tools, episode.last
        extends = (
            self.renderer.append_only
            and last is not None
            and len(last.row.token_ids) == last.end
            and len(messages) >= len(last.seen)
            and json.dumps(tools, sort_keys=True) == last.tools
            and all(same_message(a, b) for a, b in zip(messages, last.seen, strict=False))
        )
        try:
            if extends and last is not None:
                new = messages[len(last.seen) :]
                ids = self.renderer.continuation(new, last.stopped_on_eos, tools)
                return last.row, ids
            return None, self.renderer.prompt(messages, tools)
        except Exception as error:  # noqa: BLE001 - a template may raise anything on odd input
            raise ProxyError(
                400,
                f"the chat template cannot render these messages ({type(error).__name__}: "
                f"{error}); send messages the policy's template takes",
                "template_error",
            ) from None

    async def _generate(
        self, episode: ProxyEpisode, prompt: list[int], asked: int | None
    ) -> GenerationResult:
        """The engine's turn after ``prompt``; raises (with the episode ended) for a full
        context, an engine error or an abort, and 410 when the episode ended meanwhile."""
        sampling = episode.sampling
        budget = min(
            sampling.max_new_tokens,
            asked or sampling.max_new_tokens,
            int(episode.info.get("max_new_tokens") or sampling.max_new_tokens),
            self.max_context_tokens - len(prompt),
        )
        if budget <= 0:
            self._out_of_context(episode, f"the prompt is {len(prompt)} tokens")
        request_id = f"{episode.key}/{episode.generations}"  # never reused in the episode
        episode.generations += 1
        request = GenerationRequest(
            request_id,
            prompt,
            budget,
            sampling.temperature,
            sampling.top_p,
            stop_token_ids=self.renderer.stop_token_ids,  # the template's end-of-turn
        )
        episode.generating = request_id
        try:
            result = await self.engine.generate(request)
        except asyncio.CancelledError:  # the client went away: nothing recorded
            self._abort(request_id)
            raise
        except Exception as error:  # noqa: BLE001 - an engine error fails this episode only
            self._check_open(episode, "model call")  # ended meanwhile: 410, the episode as it was
            episode.end(f"engine error {type(error).__name__}: {error}")
            raise ProxyError(502, f"the engine failed: {error}", "engine_error", "server_error")
        finally:
            episode.generating = None
        self._check_open(episode, "model call")
        if result.finish_reason == "abort":
            episode.end("aborted")
            raise ProxyError(
                503,
                "the generation was aborted (the episode was cancelled); retry in a new episode",
                "aborted",
                "server_error",
            )
        return result

    # ------------------------------------------------------------------ the env
    async def step(self, episode: ProxyEpisode, action: str | dict[str, Any]) -> dict[str, Any]:
        """Step the episode's env with ``action`` (text, or an assistant message, checked by
        ``proxy_request.step_action``, whose tool calls become envhub's ``<tool_call>`` text; a
        call without an id gets one); the reward goes to the call whose reply the agent acted
        on (``ProxyEpisode.credited``). The env's reply answers each call (``proxy_reply.
        answered``) and is recorded, as the agent gets it, as soon as the env answers."""
        from envhub.parsing import message_text

        calls: list[dict[str, Any]] = []
        if isinstance(action, dict):
            calls = episode.named_calls(action.get("tool_calls") or [])
            text = message_text({"content": action.get("content"), "tool_calls": calls})
        else:
            text = action
        async with episode.lock:
            self._check_open(episode, "step")
            if episode.last is None:
                raise ProxyError(
                    409,
                    "no model call yet: a step's reward is credited to the model call before "
                    "it, so call the model first",
                    "no_model_call",
                )
            try:
                call = episode.session.step(text)
                if self.step_timeout_s is not None:
                    call = asyncio.wait_for(call, self.step_timeout_s)
                outcome = checked_step(await call, episode.trajectory.env_id)
                messages, reward, terminated, truncated, info = outcome
            except Exception as error:  # noqa: BLE001 - env code may raise anything: data
                self._check_open(episode, "step")  # ended meanwhile: 410, the episode as it was
                reason = (
                    f"no answer within {self.step_timeout_s} s (rollout.env_timeout_s)"
                    if isinstance(error, TimeoutError)
                    else f"{type(error).__name__}: {error}"
                )
                episode.end(f"env step raised {reason}")
                raise ProxyError(502, f"the env failed: {reason}", "env_error", "server_error")
            self._check_open(episode, "step")
            messages = answered(calls, messages, refused=bool(info.get("invalid_action")))
            self._record_step(episode, text, messages, reward, info)
            episode.env_done = bool(terminated or truncated)
            t = episode.trajectory
            t.terminated, t.truncated = bool(terminated), bool(truncated)
        return {
            "messages": messages,
            "reward": reward,
            "terminated": bool(terminated),
            "truncated": bool(truncated),
            "info": json.loads(json.dumps(info, default=repr)),
        }

    def _record_step(
        self,
        episode: ProxyEpisode,
        action: str,
        messages: list[dict[str, Any]],
        reward: float,
        info: dict[str, Any],
    ) -> None:
        t = episode.trajectory
        t.end_turn(reward)
        call = episode.credited(action)
        if call is not None:  # the reward for the turn whose tokens end at the call's end
            call.row.turn_rewards.append(reward)
            call.row.turn_ends.append(call.end - 1)
        elif not self._warned_credit:
            self._warned_credit = True
            _log.warning(
                "a step's action is none of the replies of the model calls made since the last "
                "step, so its reward is credited to none of them (said once); step with the "
                "reply you act on"
            )
        t.messages.extend(messages)
        t.invalid_actions += int(bool(info.get("invalid_action")))
        t.success, t.step_info = bool(info.get("success")), dict(info)
        episode.info = dict(info)

    def describe(self, episode: ProxyEpisode) -> dict[str, Any]:
        """The episode as ``GET /v1/envhub/episode`` returns it."""
        t = episode.trajectory
        return {
            "episode": episode.key,
            "model": self.model_name,
            "env_id": t.env_id,
            "seed": t.seed,
            "messages": episode.first_messages,
            "tools": episode.tools,
            "info": json.loads(json.dumps(t.info, default=repr)),
        }

    # ------------------------------------------------------------------ HTTP
    def app(self) -> Starlette:
        """The ASGI app serving this proxy (``trainer.rollout.proxy_http``)."""
        return proxy_app(self)
