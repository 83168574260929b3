"""The ``--out`` folder of an ``envhub eval`` run, and how a run starts, resumes or replaces it.

A run folder holds:

``eval.json``
    The run's settings (``settings``: what changes how an episode plays: env kwargs,
    ``max_turns``, and for a model its name, sampling and tools mode) and what was asked for
    (envs, agents, episodes, samples, first seed); written before the first episode.
``episodes.jsonl``
    One line per finished episode, appended and flushed as it finishes (a killed run loses
    none; the torn last line of one is cut before appending). A resumed run appends the
    episodes it plays again after their failed lines, and the newest line of an episode
    wins; once it ends, ``compact`` leaves one line per episode.
``summary.json``, ``trajectories/envhub-eval-000000000.parquet``
    Written at the end: one row per (env, agent), and every episode for ``envhub view``. A
    resumed run removes them as it starts, so a resume that is interrupted leaves no summary
    of the earlier run beside episodes it no longer describes.

``.eval.lock``
    Locked by the run playing into the folder, from ``open_run`` to ``EpisodeWriter.close``: a
    POSIX record lock (``lockf``), which is the process's own, so a child an env forks, sharing
    the file until it closes it, never holds the folder (a ``flock`` would be that child's too,
    until it closed its copy); the system lets go of it when the process dies. Runs of one
    process are told apart by the folders it holds (a record lock does not). Left in place. On
    a filesystem without locks (``lockf`` fails other than "held": NFS without lockd, some FUSE
    or SMB mounts) the run plays into the folder with only this process's runs kept out, and a
    warning that runs of other processes are then not.

``open_run`` guarantees that one folder never mixes runs: one run at a time plays into it (a
second, even with ``resume`` or ``overwrite``, fails at once rather than interleave its lines
or remove the first run's files; where the filesystem has locks), and a folder holding
episodes is played into again only with ``resume`` (and then only with the same settings) or
``overwrite`` (which first removes the old run's files, and only those). Every problem with
the folder is an ``EvalOutputError`` naming the folder and the option that fixes it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
from pathlib import Path
from typing import IO, Any

from envhub.errors import EvalOutputError
from envhub.parsing import LONE_SURROGATE

__all__ = [
    "EpisodeWriter",
    "EvalOutputError",
    "compact",
    "dumps",
    "json_safe",
    "open_run",
    "store",
]

_log = logging.getLogger(__name__)
_RUN_FILES = ("episodes.jsonl", "summary.json", "eval.json")
LOCK_FILE = ".eval.lock"
_held: set[str] = set()
"""The folders (real paths) this process's runs play into."""
_guard = threading.Lock()


def dumps(value: Any) -> bytes:
    """One JSON line of env data, whatever the env or the model put in it: keys that are not
    strings and values JSON has no type for (numpy arrays, ints past 64 bits, objects) are
    stringified, and lone surrogates in text (which a model's JSON reply can carry, and UTF-8
    cannot) become U+FFFD, as ``envhub.runs.store`` writes them: the episode is kept, the run
    goes on."""
    import orjson

    options = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
    try:
        return orjson.dumps(value, default=str, option=options)
    except TypeError:  # an int past 64 bits, a tuple key, nesting too deep, a lone surrogate
        return orjson.dumps(_plain(value, depth=0), option=options)


def json_safe(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` as it reads back from its JSON line (see ``dumps``)."""
    import orjson

    loaded: dict[str, Any] = orjson.loads(dumps(value))
    return loaded


def _plain(value: Any, depth: int) -> Any:
    if depth > 64:
        return LONE_SURROGATE.sub("\ufffd", str(value))
    if isinstance(value, str):
        return LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_plain(str(k), depth): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 1 << 63:
        return str(value)
    if value is None or isinstance(value, int | float):
        return value
    return LONE_SURROGATE.sub("\ufffd", str(value))


def open_run(
    out: Path, run: dict[str, Any], *, resume: bool = False, overwrite: bool = False
) -> EpisodeWriter:
    """Lock ``out`` for the run described by ``run`` (``eval.json``'s content), make it ready
    and open its ``episodes.jsonl`` for appending; ``EvalOutputError`` if it cannot take the
    run. The lock is held until the writer is closed."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = _lock(out)
        try:
            _start_run(out, run, resume=resume, overwrite=overwrite)
            return EpisodeWriter(out / "episodes.jsonl", lock)
        except BaseException:
            lock.release()  # (the run did not start: the folder is free again)
            raise
    except OSError as error:
        raise EvalOutputError(
            f"cannot write the run to --out {out}: {error.strerror or error}; "
            "choose a folder you can create and write"
        ) from None


def _lock(out: Path) -> _FolderLock:
    """``out`` locked for this run; ``EvalOutputError`` if a run holds it (in this process or
    another). Where the filesystem has no locks, only this process's runs are kept out, with a
    warning."""
    key = os.path.realpath(out)
    with _guard:  # a run of this process: known here (a record lock is the process's own)
        if key in _held:
            raise _in_use(out)
        _held.add(key)
    try:
        lock = open(out / LOCK_FILE, "ab")  # noqa: SIM115 - held until the run's writer closes
    except BaseException:
        _release(key)
        raise
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: another process holds it
        lock.close()
        _release(key)
        raise _in_use(out) from None
    except OSError as error:  # ENOLCK, EOPNOTSUPP, ENOSYS: the filesystem has no locks
        lock.close()
        _log.warning(
            "--out %s: cannot lock %s (%s), so this run plays into it unlocked: two envhub eval "
            "processes running into this folder at once are not prevented (their lines would "
            "mix); start one at a time, or use an --out on a filesystem with locks (a local disk)",
            out,
            out / LOCK_FILE,
            error.strerror or error,
        )
        return _FolderLock(key, None)
    return _FolderLock(key, lock)


class _FolderLock:
    """A run's hold on its folder: this process's mark (``_held``) and the locked file."""

    def __init__(self, key: str, file: IO[bytes] | None) -> None:
        self.key, self.file = key, file

    def release(self) -> None:
        if self.file is not None:
            self.file.close()  # (closing it lets go of the record lock)
            self.file = None
        _release(self.key)


def _release(key: str) -> None:
    with _guard:
        _held.discard(key)


def _in_use(out: Path) -> EvalOutputError:
    return EvalOutputError(
        f"--out {out} is in use by another envhub eval run (it holds {out / LOCK_FILE}); "
        "wait for it to end (then --resume plays what it left), or use another --out"
    )


def _start_run(out: Path, run: dict[str, Any], *, resume: bool, overwrite: bool) -> None:
    if (out / "episodes.jsonl").exists() and not (resume or overwrite):
        raise EvalOutputError(
            f"--out {out} already holds an eval run (episodes.jsonl); pass --resume to "
            "play only what it is missing, or --overwrite to replace it"
        )
    if overwrite:
        _remove_run(out)
    elif resume:
        _check_same_settings(out, run["settings"])
        _remove_results(out)  # stale until the run ends: episodes.jsonl is read meanwhile
    (out / "eval.json").write_text(json.dumps(run, indent=2, default=str) + "\n")


def _remove_run(out: Path) -> None:
    for name in _RUN_FILES:
        (out / name).unlink(missing_ok=True)
    _remove_results(out)


def _remove_results(out: Path) -> None:
    """What the end of an earlier run wrote: ``summary.json`` and the store's parts (``store``
    writes them again as the run ends)."""
    (out / "summary.json").unlink(missing_ok=True)
    for part in (out / "trajectories").glob("envhub-eval-*.parquet"):
        part.unlink()


def _check_same_settings(out: Path, settings: dict[str, Any]) -> None:
    path = out / "eval.json"
    if not path.exists():  # a run from before eval.json: nothing to compare
        return
    try:
        before = json.loads(path.read_text())["settings"]
    except (ValueError, KeyError, TypeError):
        raise EvalOutputError(
            f"{path} is not an eval run's settings file; pass --overwrite to start the run "
            "again, or use another --out"
        ) from None
    now = json.loads(json.dumps(settings, default=str))  # as it reads back from eval.json
    differ = [
        f"{key} {before.get(key)!r} (now {now.get(key)!r})"
        for key in sorted({*before, *now})
        if before.get(key) != now.get(key)
    ]
    if differ:
        raise EvalOutputError(
            f"--out {out} was played with other settings: {', '.join(differ)}; resume with the "
            "options it was started with, or pass --overwrite (or another --out) to start again"
        )


class EpisodeWriter:
    """Appends one JSONL line per episode and flushes it, so a killed run loses none; ``close``
    lets go of the folder's lock too (``lock``: the locked ``LOCK_FILE``, from ``open_run``;
    None where the run plays unlocked)."""

    def __init__(self, path: Path, lock: _FolderLock | None = None) -> None:
        self.file = open(path, "ab")  # noqa: SIM115 - closed by close()
        self.lock = lock
        _drop_torn_tail(path)

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(dumps(record) + b"\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
        if self.lock is not None:
            self.lock.release()


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line without its newline (a run killed mid-write), so the next line appended
    starts a line of its own instead of being glued to the fragment."""
    with open(path, "rb+") as f:
        size = f.seek(0, 2)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        start = max(0, size - (1 << 20))  # a line is far shorter than this
        f.seek(start)
        cut = f.read().rfind(b"\n")
        if cut >= 0 or start == 0:
            f.truncate(start + cut + 1)
        else:
            f.write(b"\n")


def compact(path: Path) -> None:
    """Rewrite ``episodes.jsonl`` with the newest line of each episode only (env, agent, seed,
    sample), in the order of those lines, dropping lines that hold no episode; replaced in one
    rename, so a kill leaves the old file or the new one, never half of one."""
    import orjson

    newest: dict[Any, bytes] = {}
    with open(path, "rb") as lines:
        for line in lines:
            try:
                record = orjson.loads(line)
                key = tuple(record[k] for k in ("env_id", "agent", "seed", "sample"))
                hash(key)
            except (orjson.JSONDecodeError, TypeError, KeyError):
                continue
            newest.pop(key, None)  # (re-inserted last: the order of the newest lines)
            newest[key] = line if line.endswith(b"\n") else line + b"\n"
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(b"".join(newest.values()))
    os.replace(temporary, path)


def store(out: Path, summaries: list[dict[str, Any]], records: list[dict[str, Any]]) -> None:
    """Write ``summary.json`` and, when pyarrow is installed (``envhub[view]``), every episode
    as the run's trajectory-store part (``envhub view`` reads it; else ``episodes.jsonl``)."""
    (out / "summary.json").write_text(json.dumps(summaries, indent=2))
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return
    from envhub.runs.reader import eval_record
    from envhub.runs.store import write_part

    rows = [eval_record(record, i) for i, record in enumerate(records)]
    write_part(out / "trajectories", "envhub-eval", 0, rows)
