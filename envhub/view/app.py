"""``envhub view RUN_DIR ...``: a local, read-only web page over run folders.

The server is a small Starlette app (the ASGI toolkit FastAPI is built on, already installed
with the server extra) with a JSON API over ``envhub.runs``; the page is one static HTML file
with plain JavaScript and SVG (``static/``): no build step, no CDN, no front-end package to pin,
so it works offline and loads in milliseconds. Every text from a run (env messages, model
output, tokens) reaches the page as JSON and is put in the DOM with ``textContent``, never as
HTML: an env that prints ``<script>`` shows that text.

API (all ``GET``; ``run`` is the index of a run folder on the command line)::

    /api/runs                         the runs: name, path, kinds, problems
    /api/metrics?run=&after=&file=    metrics.jsonl rows (numbers, and NaN/inf as gaps), their
                                      keys, and which file they came from; with ``after`` and
                                      the ``file`` of the last answer, only the rows after
                                      that step (all of them, ``full``, if the file changed)
    /api/episodes?run=&kind=&step=&env_id=&env=&seed=&agent=&success=&failed=&failure=
                 &min_return=&max_return=&min_tokens=&max_tokens=&sort=&desc=&offset=&limit=
                                      a page of the table, its ``version`` (changes with the
                                      store's parts: what a poll compares) and the env ids
                                      and agents to choose from
    /api/episode?run=&key=            one episode: messages, tokens (text, policy or not,
                                      log-prob, advantage) and the replay command
    /api/summary?run=                 an ``envhub eval`` run's summary table

Bound to ``127.0.0.1`` by default; another host needs ``--token``, which every request then
carries (``?token=`` or ``Authorization: Bearer``; the page passes on its own). What the app
protects against (DNS rebinding, framing, ...) is listed in ``envhub.view.security``.

JSON has no NaN or infinity. Where the page shows a value as text (the episode table, an
episode's return and rewards, the eval summary, metric gaps) they are sent as the strings
``"NaN"``, ``"inf"`` and ``"-inf"``, so a diverged value is seen, not blank; elsewhere (log-probs,
advantages per token, env info) as ``null``. A bad parameter is a 400 naming it, an absent run
or episode a 404, and anything else a 500 whose JSON says what failed: never a bare error page.
Handlers are plain functions, which Starlette runs in its thread pool: a slow read of a large
run does not hold up the page's other requests.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import shlex
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envhub.runs.query import whole
from envhub.runs.reader import Run, find_runs, open_run
from envhub.runs.store import LIGHT_COLUMNS
from envhub.view.security import SecurityHeaders, allowed_hosts

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = ["Viewer", "create_app"]

STATIC = Path(__file__).parent / "static"
_log = logging.getLogger(__name__)
_MAX_PAGE = 500


class Viewer:
    """The runs a page shows, and what the API reads from them."""

    def __init__(self, paths: Sequence[str | Path]) -> None:
        # a folder of runs (runs/) stands for its runs; NotARunError: neither a run nor that
        self.runs: list[Run] = [open_run(run) for p in paths for run in find_runs(p)]
        self._tokenizers: dict[int, Any] = {}
        self._tokenizer_lock = threading.Lock()

    def index(self, given: str | None) -> int:
        """The run index a request names (``run=``; 0 when absent).

        ValueError (400) for what is no index (text, a negative number), LookupError (404)
        for an index past the last run; both name the valid range."""
        valid = f"runs are 0..{len(self.runs) - 1}"
        try:
            index = int(given or 0)
        except ValueError:
            raise ValueError(f"run={given!r} is not a run index; {valid}") from None
        if index < 0:
            raise ValueError(f"run={index} is not a run index; {valid}")
        if index >= len(self.runs):
            raise LookupError(f"no run {index}; {valid}")
        return index

    def run(self, given: str | None) -> Run:
        return self.runs[self.index(given)]

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "id": i,
                "name": run.name,
                "path": str(run.path),
                "kinds": run.kinds,
                "problems": run.problems,
            }
            for i, run in enumerate(self.runs)
        ]

    def metrics(
        self, run: Run, after: int | None = None, file: str | None = None
    ) -> dict[str, Any]:
        """The run's metrics rows: numbers, and a value that is no number (NaN or infinity,
        null in ``metrics.jsonl``) as ``"NaN"``/``"inf"``/``"-inf"``/null, a gap the chart
        marks. With ``after`` and the ``file`` of an earlier answer, only the rows after step
        ``after`` (a poll); all of them, with ``full``, when the file is another one (a
        resumed run rewrote it)."""
        current = run.metrics_file()
        full = after is None or file != current
        rows = []
        keys: set[str] = set()
        for row in run.metrics():
            step = row.get("step")
            newer = isinstance(step, int | float) and after is not None and step > after
            if not full and not newer:
                continue
            values = {k: v for k, v in row.items() if _plottable(v)}
            values.update({k: _text(v) for k, v in row.items() if _gap(v)})
            keys.update(values)
            rows.append(values)
        return {
            "rows": rows,
            "keys": sorted(keys - {"step", "time_s"}),
            "file": current,
            "full": full,
        }

    def tokenizer(self, index: int) -> Any:
        """The run's tokenizer (its final or initial policy folder), or None."""
        with self._tokenizer_lock:
            if index not in self._tokenizers:
                self._tokenizers[index] = self._load_tokenizer(index)
            return self._tokenizers[index]

    def _load_tokenizer(self, index: int) -> Any:
        for name in ("final_policy", "initial_policy"):
            folder = self.runs[index].path / name
            if (folder / "tokenizer_config.json").is_file():
                try:
                    from transformers import AutoTokenizer

                    return AutoTokenizer.from_pretrained(str(folder))
                except Exception as error:  # noqa: BLE001 - no tokenizer: token ids only
                    _log.warning("envhub view: no tokenizer in %s (%s)", folder, error)
        return None

    def episode(self, index: int, key: str) -> dict[str, Any]:
        run = self.runs[index]
        record = run.episode(key)
        ids = record.pop("token_ids") or []
        mask = record.pop("response_mask") or []
        logprobs = record.pop("logprobs") or []
        advantages = record.pop("advantages") or []
        for name in (*LIGHT_COLUMNS, "turn_rewards"):  # what the page shows as text
            record[name] = shown(record.get(name))
        tokenizer = self.tokenizer(index)
        # each token decoded on its own: " up" and "\n" rather than BPE's "Ġup" and "Ċ"
        texts = tokenizer.batch_decode([[i] for i in ids]) if tokenizer is not None else None
        policy = [bool(mask[i]) if i < len(mask) else False for i in range(len(ids))]
        record["tokens"] = [
            {
                "id": token,
                "text": (texts[i] if texts is not None else f"[{token}]"),
                "policy": policy[i],
                "logprob": logprobs[i] if i < len(logprobs) and policy[i] else None,
                "advantage": advantages[i] if i < len(advantages) and policy[i] else None,
            }
            for i, token in enumerate(ids)
        ]
        record["replay"] = self.replay_command(run, record)
        return record

    @staticmethod
    def replay_command(run: Run, record: dict[str, Any]) -> str:
        """``envhub play`` replaying the episode's actions, with the run's env kwargs."""
        kwargs = run.env_kwargs(str(record["env_id"]))
        parts = ["envhub", "play", str(record["env_id"])]
        if record.get("seed") is not None:  # (else play takes the stored episode's own)
            parts += ["--seed", str(record["seed"])]
        for name, value in kwargs.items():
            parts += ["-k", f"{name}={json.dumps(value) if not isinstance(value, str) else value}"]
        parts += ["--replay", str(run.path), "--episode", str(record["key"])]
        return shlex.join(parts)


def _flag(value: str | None, name: str) -> bool | None:
    if value in (None, ""):
        return None
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"{name}={value!r} is not true or false")


def _whole(params: Any, name: str) -> int | None:
    """Parameter ``name`` as an int64 (None when absent); ValueError naming it otherwise."""
    value = params.get(name)
    return None if value in (None, "") else whole(name, value.strip())


def _real(params: Any, name: str) -> float | None:
    """Parameter ``name`` as a number (None when absent); ValueError naming it otherwise."""
    value = params.get(name)
    if value in (None, ""):
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None


def _count(params: Any, name: str, default: int) -> int:
    """A page parameter (``offset``, ``limit``): a whole number >= 0."""
    number = _whole(params, name)
    if number is None:
        return default
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {number}")
    return number


def _plottable(value: Any) -> bool:
    """Whether a metrics value is a number a chart can draw (finite, within float range)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past float's range (400 digits in metrics.jsonl)
        return False


def _gap(value: Any) -> bool:
    """Whether a metrics value stands for a number that is none (NaN or infinity; the
    trainer writes them as null)."""
    return value is None or (isinstance(value, float) and not math.isfinite(value))


def _text(value: Any) -> Any:
    """A non-finite float as the text the page shows (``NaN``, ``inf``, ``-inf``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def shown(value: Any) -> Any:
    """``value`` with every NaN and infinity (in dicts and lists, at any depth) as the text
    ``"NaN"``, ``"inf"`` or ``"-inf"``: for what the page shows as text."""
    if isinstance(value, dict):
        return {key: shown(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [shown(item) for item in value]
    return _text(value)


def finite(value: Any) -> Any:
    """``value`` with every NaN and infinity (in dicts and lists, at any depth) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def create_app(
    paths: Sequence[str | Path], token: str | None = None, *, host: str = "127.0.0.1"
) -> Starlette:
    """The viewer's ASGI app over the run folders ``paths`` (see the module docstring).

    ``host`` is the interface the server binds: bound to loopback, only requests that name a
    loopback host (or ``host``) are answered (``envhub.view.security``)."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.requests import Request
    from starlette.responses import FileResponse, JSONResponse, Response
    from starlette.routing import Route

    class FiniteJSON(JSONResponse):
        """JSON with NaN and infinity as null (JSON has neither), and text that cannot be
        UTF-8 (lone surrogates) with ``?`` in its place: a run's odd values never fail a page."""

        def render(self, content: Any) -> bytes:
            text = json.dumps(
                finite(content), ensure_ascii=False, allow_nan=False, separators=(",", ":")
            )
            return text.encode("utf-8", errors="replace")

    viewer = Viewer(paths)

    def allowed(request: Request) -> bool:
        if token is None:
            return True
        given = request.query_params.get("token") or ""
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            given = header[7:]
        return secrets.compare_digest(given.encode(), token.encode())

    def api(handler: Any) -> Any:
        def endpoint(request: Request) -> Response:  # plain def: run in the thread pool
            if not allowed(request):
                needed = {"error": "a token is needed: open the URL envhub view printed"}
                return FiniteJSON(needed, 401)
            try:
                return FiniteJSON(handler(request))
            except (LookupError, ValueError) as error:
                status = 404 if isinstance(error, LookupError) else 400
                text = error.args[0] if isinstance(error, KeyError) and error.args else error
                return FiniteJSON({"error": str(text)}, status)
            except Exception as error:  # noqa: BLE001 - the page shows why, not a bare 500
                _log.exception("envhub view: %s failed", request.url.path)
                return FiniteJSON({"error": f"{type(error).__name__}: {error}"}, 500)

        return endpoint

    def runs(_: Request) -> Any:
        return viewer.describe()

    def metrics(request: Request) -> Any:
        q = request.query_params
        run = viewer.run(q.get("run"))
        return viewer.metrics(run, after=_whole(q, "after"), file=q.get("file") or None)

    def episodes(request: Request) -> Any:
        q = request.query_params
        run = viewer.run(q.get("run"))
        version = run.version()  # before the read: a change during it shows at the next poll
        page = run.episodes(
            kind=q.get("kind") or None,
            step=_whole(q, "step"),
            env_id=q.get("env_id") or None,
            env_contains=q.get("env") or None,
            seed=_whole(q, "seed"),
            agent=q.get("agent") or None,
            success=_flag(q.get("success"), "success"),
            failed=_flag(q.get("failed"), "failed"),
            failure=q.get("failure") or None,
            min_return=_real(q, "min_return"),
            max_return=_real(q, "max_return"),
            min_tokens=_whole(q, "min_tokens"),
            max_tokens=_whole(q, "max_tokens"),
            sort=q.get("sort") or "step",
            descending=_flag(q.get("desc"), "desc") or False,
            offset=_count(q, "offset", 0),
            limit=min(_count(q, "limit", 50), _MAX_PAGE),
        )
        return {
            "total": page.total,
            "rows": shown(page.rows),
            "problems": run.problems,
            "version": version,
            "choices": {name: run.values(name, version=version) for name in ("agent", "env_id")},
        }

    def episode(request: Request) -> Any:
        index = viewer.index(request.query_params.get("run"))
        return viewer.episode(index, request.query_params.get("key") or "")

    def summary(request: Request) -> Any:
        return shown(viewer.run(request.query_params.get("run")).summary())

    def page(request: Request) -> Response:
        if not allowed(request):
            return Response("a token is needed: open the URL envhub view printed", 401)
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    def static(request: Request) -> Response:
        name = request.path_params["name"]
        path = STATIC / name
        if path.parent != STATIC or not path.is_file():
            return Response("not found", 404)
        return FileResponse(path)

    return Starlette(
        routes=[
            Route("/", page),
            Route("/static/{name}", static),
            Route("/api/runs", api(runs)),
            Route("/api/metrics", api(metrics)),
            Route("/api/episodes", api(episodes)),
            Route("/api/episode", api(episode)),
            Route("/api/summary", api(summary)),
        ],
        middleware=[  # the first is the outermost: a refused host gets the headers too
            Middleware(SecurityHeaders),
            Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(host)),
        ],
    )
