"""The ``env`` and ``rollout`` sections of the trainer config: what is played, and how.

``env`` names the environments (one id, or a mix of ``{id, kwargs, weight}`` entries), where
they run (in process, a worker pool or a remote hub) and the batch shape (groups x episodes);
``rollout`` says how episodes are generated: turn and token limits, sampling, the inference
engine, the scheduler mode, native tool calling and what one training sample is. They are
parts of the tree in ``trainer.config``; build the whole config with
``trainer.config.load_config``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from trainer.config_section import Section
from trainer.errors import ConfigError, Problem
from trainer.strategies.registry import engine_spec

__all__ = ["AgentConfig", "EnvConfig", "EnvEntry", "EnvEval", "RewardConfig", "RolloutConfig"]

HUB_SCHEMES = ("ws://", "wss://", "http://", "https://")
"""What ``envhub.client.RemoteEnv`` connects to (an http(s) address is read as ws(s))."""


class EnvEval(Section):
    """How one env of a mix is evaluated (its held-out set)."""

    episodes: int | None = Field(default=None, ge=0)
    """Episodes of this env in each evaluation; None: a share of ``eval.episodes`` (spread over
    the envs without a count of their own); 0: not evaluated."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Constructor kwargs of the evaluated env over the entry's own, e.g. ``{split: test}`` for a
    dataset env (evaluation seeds are always disjoint from training's)."""


class EnvEntry(Section):
    """One env of a mix (``env.id: [{id, kwargs, weight, group_size, eval}, ...]``, or ``env:`` as
    that list)."""

    id: str
    """Registered env id."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Constructor kwargs for this env, over ``env.kwargs``."""
    weight: float = Field(default=1.0, gt=0)
    """Share of each step's trained groups (partitioned by weight; equal weights alternate),
    however fast its episodes end, with ``rollout.redundancy`` and dynamic sampling too."""
    group_size: int | None = Field(default=None, gt=0)
    """Episodes per group of this env (a harder env may want more tries per task); None:
    ``env.group_size``."""
    eval: EnvEval | bool = True
    """Its evaluation: ``false`` skips it, ``{episodes, kwargs}`` sets its held-out set."""


class RewardConfig(Section):
    """One reward function of the ``reward`` role (an entry of ``env.rewards``): what scores an
    episode, which envs it applies to, and how its score meets the env's own reward
    (``trainer.workers.reward``; defaults are the reward workers' own)."""

    kind: Literal["exact", "numeric", "function", "judge"]
    """``exact``/``numeric``: the final answer against the env's ``target`` (reset info);
    ``function``: a user function; ``judge``: a chat model grades the transcript."""
    domain: str = "*"
    """The envs it scores: ``*`` (all), a namespace (``games``), an env id, or a glob
    (``games/soko*``); it must match one of the run's envs."""
    weight: float = 1.0
    """Factor on its score."""
    mode: Literal["add", "replace"] = "add"
    """Add the score to the env's return, or replace the return with it."""
    target: str = "answer"
    """``exact``/``numeric``: the key of the env's reset info that holds the right answer."""
    rel_tol: float = Field(default=1e-6, ge=0)
    """``numeric``: relative tolerance of the comparison."""
    function: str | None = None
    """``function``: ``"package.module:function"``, called with the episode; returns a number."""
    model_path: str | None = None
    """``judge``: a local chat model folder that grades the transcript."""
    prompt: str | None = None
    """``judge``: the grading prompt (``{env_id}``, ``{transcript}``); None:
    ``trainer.rewards.judge.DEFAULT_PROMPT``."""
    max_new_tokens: int = Field(default=8, gt=0)
    """``judge``: most tokens of the grade."""

    @model_validator(mode="after")
    def _kind_has_its_source(self) -> RewardConfig:
        if self.kind == "function" and not self.function:
            raise ValueError("kind function needs function: 'package.module:function'")
        if self.kind == "judge" and not self.model_path:
            raise ValueError("kind judge needs model_path: a local chat model folder")
        return self


class EnvConfig(Section):
    """Which environments to train on, where they run, and how episodes are grouped."""

    id: str | list[str | EnvEntry] = "games/frozen-lake-v0"
    """Registered env id, or a mix: a list of ids and/or ``{id, kwargs, weight}`` entries
    (each step's groups are partitioned by weight; ``train/<env id>/success`` and
    ``eval/<env id>/success`` are logged beside the pooled figures)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra constructor kwargs passed to ``envhub.make`` for every env (an entry's own
    ``kwargs`` override them)."""
    hub: str | None = None
    """Address of a remote ``envhub serve`` (``ws://host:port`` or ``wss://...``); None runs an
    in-process pool."""
    token: str | None = None
    """Auth token for ``hub``; None reads the ``ENVHUB_TOKEN`` environment variable."""
    group_size: int = Field(default=8, gt=0)
    """Episodes per group: the same task/seed played this many times (GRPO/RLOO baselines)."""
    num_groups: int = Field(default=4, gt=0)
    """Groups per training step; the step's batch is ``group_size * num_groups`` episodes."""
    pool_workers: int = Field(default=0, ge=0)
    """0 runs envs in this process (``envhub.make``); N > 0 runs them in an
    ``envhub.pool.EnvPool`` of N worker processes (a crashed or hung env is replaced, its
    episode retried)."""
    rewards: list[dict[str, Any]] = Field(default_factory=list)
    """Reward functions the ``reward`` role adds to finished episodes, routed by env domain, e.g.
    ``{kind: exact, domain: "games", target: answer}``: each entry is a :class:`RewardConfig`
    (checked key by key), kept as the dict the reward workers read (``trainer.rewards``).
    Empty: the envs' own rewards only."""

    @field_validator("id", mode="before")
    @classmethod
    def _id_is_an_id_or_a_list(cls, value: Any) -> Any:
        if isinstance(value, dict):  # one entry written without its list dash
            got = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise ValueError(  # noqa: TRY004 - pydantic reports a ValueError at env.id
                "takes an env id or a list of env ids and/or entries, not a mapping; write the "
                "entry as a list item (`- id: ...` on the line under `id:`, or "
                f"env.id=[{{id: ...}}] as an override) (got {got})"
            )
        if isinstance(value, list) and not value:
            raise ValueError(
                "is an empty list; give at least one env id (env.id: games/frozen-lake-v0), or "
                "remove env.id for the default"
            )
        return value

    @field_validator("hub")
    @classmethod
    def _hub_address(cls, hub: str | None) -> str | None:
        if hub is not None and (
            not hub.startswith(HUB_SCHEMES) or not hub.partition("://")[2].strip("/")
        ):
            raise ValueError(
                f"{hub!r} is not a ws:// or wss:// address; set env.hub to where `envhub serve` "
                "listens, like ws://127.0.0.1:8000, or remove it to run the envs here"
            )
        return hub

    @field_validator("rewards")
    @classmethod
    def _rewards_are_reward_configs(cls, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from trainer._config_io import validation_problems

        checked, problems = [], []
        for i, spec in enumerate(specs):
            try:
                reward = RewardConfig.model_validate(spec)
            except ValidationError as err:
                for problem in validation_problems(err, RewardConfig, spec):
                    path = f"env.rewards[{i}]" + (f".{problem.path}" if problem.path else "")
                    problems.append(Problem(path, problem.message))
                continue
            checked.append(reward.model_dump(exclude_none=True))
        if problems:
            raise ConfigError(problems)
        return checked

    @property
    def entries(self) -> list[EnvEntry]:
        """Every env of the run as an entry (a plain id is weight 1, no kwargs of its own)."""
        items = [self.id] if isinstance(self.id, str) else list(self.id)
        return [EnvEntry(id=item) if isinstance(item, str) else item for item in items]

    @property
    def ids(self) -> list[str]:
        """The env ids as a list, whether one or several were given."""
        return [entry.id for entry in self.entries]

    @property
    def weights(self) -> list[float]:
        """Each env's share of a step's groups, in ``ids`` order."""
        return [entry.weight for entry in self.entries]

    def kwargs_for(self, env_id: str) -> dict[str, Any]:
        """The constructor kwargs of ``env_id``: ``env.kwargs`` updated by its entry's."""
        own = next((e.kwargs for e in self.entries if e.id == env_id), {})
        return {**self.kwargs, **own}

    @property
    def group_sizes(self) -> list[int]:
        """Each env's episodes per group, in ``ids`` order."""
        return [entry.group_size or self.group_size for entry in self.entries]

    def eval_counts(self) -> dict[str, int]:
        """Envs with an evaluation size of their own (0: not evaluated); the others share
        ``eval.episodes``."""
        counts = {}
        for entry in self.entries:
            if entry.eval is False:
                counts[entry.id] = 0
            elif isinstance(entry.eval, EnvEval) and entry.eval.episodes is not None:
                counts[entry.id] = entry.eval.episodes
        return counts

    def eval_kwargs(self) -> dict[str, dict[str, Any]]:
        """Per env with held-out settings: its evaluation kwargs over its training kwargs."""
        return {
            entry.id: {**entry.kwargs, **entry.eval.kwargs}
            for entry in self.entries
            if isinstance(entry.eval, EnvEval) and entry.eval.kwargs
        }

    @model_validator(mode="after")
    def _ids_unique(self) -> EnvConfig:
        ids = self.ids
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise ValueError(
                f"env {repeated[0]!r} is listed twice; give it one entry (raise its weight for "
                "a larger share)"
            )
        return self


class ServerLimits(Section):
    """What one client may hold of the agent proxy's server (``rollout.agent.limits``). An
    agent is anyone's code (and the port anyone's on the host), so every connection and body
    is bounded in size and time."""

    max_body_bytes: int = Field(default=32 * 2**20, gt=0)
    """A larger body is refused (413) from its ``Content-Length``, or once that much arrived."""
    body_timeout_s: float = Field(default=60.0, gt=0)
    """A body that has not fully arrived this long after its headers is answered 408."""
    header_timeout_s: float = Field(default=30.0, gt=0)
    """A connection that has not sent a request's headers this long after it opened (or after
    the first byte of its next request) is closed."""
    keep_alive_s: int = Field(default=120, gt=0)
    """An idle kept-alive connection is closed after this (an agent may think between calls;
    the ``openai`` SDK reconnects on its own)."""
    shutdown_timeout_s: float = Field(default=5.0, gt=0)
    """Closing the proxy cancels requests still running this long after it began."""
    max_connections: int = Field(default=4096, gt=0)
    """A request arriving while this many connections are open is answered 503."""


class AgentConfig(Section):
    """A black-box agent that plays every episode through the trainer's OpenAI-compatible proxy
    (``trainer.rollout.proxy``); exactly one of ``callable`` and ``command``."""

    callable: str | None = None
    """``"package.module:function"``, called once per episode (in a thread of its own) with a
    ``trainer.rollout.agents.AgentEpisode``: ``base_url``, ``api_key`` and ``model`` for the
    ``openai`` SDK, the env's first ``messages`` and ``tools``, and ``env`` (``step(action)``).
    It returns None when it stepped the env itself, or its final answer (a string), which
    then is the episode's last action. An ``async def`` function is run to completion on an
    event loop of its own in that thread (``openai.AsyncOpenAI`` agents)."""
    command: str | list[str] | None = None
    """A command line run once per episode (a string is split like a shell would), with
    ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and ``ENVHUB_AGENT_MODEL`` set; it reads the episode
    with ``AgentEpisode.from_environ()``. A non-zero exit fails the episode (stderr's tail is the
    reason)."""
    timeout_s: float = Field(default=300.0, gt=0)
    """An agent that has not returned after this many seconds fails its episode (it is
    abandoned: its later calls get an "episode ended" error)."""
    model_name: str = "policy"
    """The model name the proxy serves (``/v1/models``); requests for another are refused."""
    host: str = "127.0.0.1"
    """Where the proxy listens; loopback by default (agents run on the driver's machine)."""
    port: int = Field(default=0, ge=0, le=65535)
    """The proxy's port; 0 picks a free one."""
    limits: ServerLimits = Field(default_factory=ServerLimits)
    """What one client may hold of the proxy's server: body size, header / body / idle
    timeouts, open connections."""

    @model_validator(mode="after")
    def _one_agent(self) -> AgentConfig:
        if (self.callable is None) == (self.command is None):
            raise ValueError(
                "rollout.agent needs exactly one of callable: 'package.module:function' or "
                "command: 'python my_agent.py'"
            )
        if self.callable is not None and ":" not in self.callable:
            raise ValueError(
                f"rollout.agent.callable {self.callable!r} names no function; write "
                "'package.module:function'"
            )
        if self.command is not None and not self.command:
            raise ValueError("rollout.agent.command is empty; give the command line to run")
        return self


class RolloutConfig(Section):
    """How episodes are generated: turn and token limits, sampling, the inference engine."""

    max_turns: int = Field(default=8, gt=0)
    """Most policy turns per episode; the episode is truncated after that."""
    max_new_tokens: int = Field(default=32, gt=0)
    """Most tokens the policy may generate in one turn."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts, > 0. The trainer takes its log-probs (the
    actor's old and new, the reference's) and entropy under ``softmax(logits / temperature)``,
    so the policy trained is the one sampled. Greedy (0) tokens cannot be trained on-policy:
    use ``eval.temperature: 0`` for greedy evaluation."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass. Below 1 the loss still uses full-vocabulary log-probs at
    ``temperature`` (tokens outside the nucleus are never sampled, so never credited), and the
    actor recomputes the old log-probs every step (vLLM reports them renormalised over the
    nucleus); in ``async`` mode the importance weights and PPO's bound around the sampling
    policy are then off."""
    engine: str = "hf"
    """Inference engine for ``actor_infer`` (``trainer.strategies.registry.INFERENCE_ENGINES``):
    ``hf`` (embedded torch generation) or ``vllm``."""
    batches_in_flight: int | None = Field(default=None, gt=0)
    """Batches each inference rank runs at once for the driver's episodes (each joins the
    running engine and each request is answered as it ends, so a short turn need not wait for a
    rank's longest; ``trainer.workers.infer.RankEngine``). None: 1 with ``hf``, whose batches
    are then the same in every run, so a run and one resumed after a kill sample the same
    tokens (rows that share a forward pass change the logits' last bits); 16 with ``vllm``,
    whose batches vary with timing anyway. More than 1 with ``hf`` trades that for speed."""
    tool_parser: str = "auto"
    """How a generated turn becomes tool calls (``trainer.rollout.tool_parsers``): ``auto``
    (from the chat template; ``none`` when it renders no tools), ``hermes``, ``llama3_json``,
    ``mistral``, ``pythonic`` or ``none`` (plain text actions, tools only in the env's prompt).
    With a template that renders tools, an env's tool schemas go to ``apply_chat_template(...,
    tools=...)`` and assistant turns are kept as structured ``tool_calls`` messages."""
    sample_unit: Literal["episode", "turn", "auto"] = "auto"
    """What one training sample is. ``episode``: the whole episode as one token sequence (the
    env's replies appended as context); ``turn``: every policy turn its own sample, prompted
    with the template's rendering of the conversation at that turn and credited with the
    episode's return (group baselines count episodes); needed by templates that rewrite
    earlier turns as a conversation grows (Qwen3 drops past thinking). ``auto``: ``turn``
    exactly when the template is not append-only (said once in the log)."""
    context: Literal["full", "last_k_turns", "strip_thinking"] = "full"
    """What a turn sample's prompt holds (``sample_unit: turn``; setting it implies turn
    samples under ``auto``): ``full`` the whole conversation; ``last_k_turns`` the opening
    messages (system, task) and the last ``context_turns`` turns; ``strip_thinking`` every
    earlier assistant turn without its ``<think>...</think>`` block. Bounds long episodes."""
    context_turns: int = Field(default=4, gt=0)
    """``context: last_k_turns``: how many of the latest turns the prompt keeps."""
    max_tool_calls: int = Field(default=16, gt=0)
    """Most tool calls read from one turn; more is a malformed turn (env feedback, penalty)."""
    mode: Literal["batch", "sync", "async"] = "batch"
    """How the rollout scheduler (``trainer.rollout.rollouts``, every mode) plays episodes.
    ``batch``: each step plays its groups together and waits for the last one; ``sync``:
    on-policy, plus redundancy and dynamic sampling; ``async``: rollouts continue while the
    trainer trains, within ``max_staleness`` (``trainer.rollout.scheduler``). A group whose
    episode still fails after its replays is replaced in every mode."""
    max_staleness: int = Field(default=1, ge=0)
    """``async``: most policy versions a trained token may lag the policy being trained (>= 1:
    what is played while the trainer trains is a version behind once trained)."""
    redundancy: float = Field(default=1.0, ge=1.0)
    """Scheduler modes: groups started per group a batch needs; the first of each env to end
    fill its share of the batch (``env.id`` weights), the surplus is aborted. In
    ``async`` a run whose rollouts, not training, are the bound wants some (e.g. 1.25): at 1.0
    each batch waits for its slowest group (``benchmarks/rollout_scale.py``, ``MODE@R``).
    ``train/*`` is then over the first groups to finish (biased toward short episodes);
    ``rollout/played_*`` reports every group played."""
    dynamic_sampling: bool = False
    """Scheduler modes: drop groups whose rewards are all equal and play replacements.
    ``train/*`` is then over the groups let through; ``rollout/played_*`` over every group
    played, the filtered ones included."""
    is_truncation: float | None = Field(default=None, gt=0)
    """``async``: None (default) takes the PPO ratio against the behaviour policy's log-probs, so
    PPO's clip truncates the off-policy importance ratio; a number switches to the decoupled
    form: ratio against the recomputed current policy, each token's loss weighted by
    ``min(pi_prox / pi_behaviour, is_truncation)`` (stalled on the quickstart; see
    ``trainer.rollout.rollouts``)."""
    agent: AgentConfig | None = None
    """A black-box agent (``callable`` or ``command``) that plays the episodes through an
    OpenAI-compatible endpoint the trainer serves on loopback (``trainer.rollout.proxy``); the
    proxy records the exact tokens of every call. None: the built-in env manager plays."""
    env_timeout_s: float | None = Field(default=None, gt=0)
    """Fail an episode whose env does not answer a reset/step within this many seconds (it is
    recorded as failed and replayed on a fresh env, then replaced); None waits as long as it
    takes. Setting it runs local envs' calls in threads, so even an env whose ``step`` blocks
    is bounded (in every rollout mode); a pool (``env.pool_workers``) also kills such a worker."""
    env_workers: int = Field(default=0, ge=0)
    """Play training episodes in this many worker processes (``trainer.rollout.env_workers``:
    each runs its own env manager, chat template, tokenizer and envs; the driver keeps the
    scheduler and the engine router and only forwards each turn's generation). For runs whose
    driver cannot keep up with its engines (thousands of episodes in flight). 0: episodes play
    in the driver's rollout thread. With ``env.pool_workers`` each env worker has a pool of its
    own; evaluation episodes play in the driver."""
    route_in_workers: bool = False
    """With ``env_workers``: each env worker routes its own episodes' turns straight to the
    ``actor_infer`` Ray actors (``trainer.rollout.worker_routing``: its own router, least
    loaded and sticky per episode), so the driver handles only episodes starting and ending
    and the weight updates' pause and resume, not every turn. Needs ``cluster.backend: ray``.
    For runs whose driver cannot keep up even with ``env_workers`` (benchmarks/README.md,
    ``rollout_scale``)."""
    pause_timeout_s: float = Field(default=120.0, gt=0)
    """How long a weight update waits for the engines to answer its aborts: an engine still
    busy after it is hung (it ignores aborts), its turns fail (their episodes are replayed
    elsewhere) and the weights load. With ``route_in_workers`` also how long it waits for each
    env worker to pause its router; a worker that does not answer in time (its event loop is
    blocked, e.g. by a slow env call) is killed and its episodes fail. Raise it for envs whose
    calls block longer, or take such calls off the loop (``env_timeout_s`` runs them in
    threads, ``env.pool_workers`` in processes)."""
    generate_timeout_s: float | None = Field(default=None, gt=0)
    """Fail an episode whose turn is not generated within this many seconds, queueing in the
    engine included (the request is aborted in the engine; the episode is replayed, then its
    group replaced, as for an env failure), so a hung inference worker cannot hang the run;
    the router then sends new episodes to the engines that still answer (and a trial episode
    every 32 to one that did not). Set it well above the slowest turn under load. None waits
    as long as it takes, unless a weight update gives up on the engine first
    (``pause_timeout_s``)."""

    def rank_batches(self) -> int:
        """``batches_in_flight`` as the run uses it (its engine's default when None)."""
        from trainer.workers.infer import BATCHES_IN_FLIGHT

        if self.batches_in_flight is not None:
            return self.batches_in_flight
        return 1 if self.engine == "hf" else BATCHES_IN_FLIGHT

    @model_validator(mode="after")
    def _context_needs_turn_samples(self) -> RolloutConfig:
        if self.context != "full" and self.sample_unit == "episode":
            raise ValueError(
                f"rollout.context: {self.context} shortens each turn's prompt, which one appended "
                "sequence per episode cannot do; set rollout.sample_unit: turn (or auto)"
            )
        return self

    @field_validator("temperature")
    @classmethod
    def _trainable_temperature(cls, value: float) -> float:
        if not value > 0 or value == float("inf"):  # NaN too
            raise ValueError(
                f"must be > 0 and finite, got {value}: the trainer takes log-probs under "
                "softmax(logits / temperature), and greedy tokens (0) have none to train "
                "on-policy; set rollout.temperature > 0 (1 samples the policy itself) and use "
                "eval.temperature: 0 for greedy evaluation"
            )
        return value

    @field_validator("tool_parser")
    @classmethod
    def _known_tool_parser(cls, name: str) -> str:
        from trainer.rollout.tool_parsers import TOOL_PARSERS, make_tool_parser

        if name != "auto" and name not in TOOL_PARSERS:
            make_tool_parser(name)  # ValueError: the parsers that exist, and "did you mean"
        return name

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        engine_spec(name)  # ValueError: the engines that exist, and "did you mean"
        return name

    @model_validator(mode="after")
    def _workers_route(self) -> RolloutConfig:
        if self.route_in_workers and not self.env_workers:
            raise ValueError(
                "rollout.route_in_workers routes each env worker's turns in that worker; set "
                "rollout.env_workers >= 1 (or rollout.route_in_workers: false)"
            )
        return self

    @model_validator(mode="after")
    def _env_workers_play_the_env_manager(self) -> RolloutConfig:
        if self.env_workers and self.agent is not None:
            raise ValueError(
                "rollout.env_workers plays episodes with the built-in env manager, and "
                "rollout.agent plays them through the trainer's proxy in the driver; unset one"
            )
        return self

    @model_validator(mode="after")
    def _async_may_lag(self) -> RolloutConfig:
        if self.mode == "async" and self.max_staleness == 0:
            message = (
                "rollout.mode: async plays episodes while the trainer trains, and with "
                "max_staleness 0 every one of them is a version behind by its batch and thrown "
                "away; set rollout.mode: sync for on-policy training, or rollout.max_staleness >= 1"
            )
            raise ConfigError([Problem("rollout.max_staleness", message)])
        return self

    @model_validator(mode="after")
    def _scheduler_options_need_the_scheduler(self) -> RolloutConfig:
        if self.mode == "batch" and (self.redundancy > 1.0 or self.dynamic_sampling):
            raise ValueError(
                "redundancy and dynamic_sampling need the rollout scheduler; set rollout.mode: "
                "sync (on-policy) or async"
            )
        return self
