"""moe-proxy commands run as child processes, their outcome recorded beside their output: a
rerun reuses a run that finished when what made it is the same (what lets an interrupted
`diagnose` or `bisect` resume). A record is written last, so a run cut short has none and runs
again.

What made a run (`Recipe`): its arguments, the package version, and the content of every
input it read (a proxy's manifest sha256, a checkpoint's content key, `content_key`): a proxy
rebuilt at the same path, or another moe-proxy, runs again.

SIGINT and SIGTERM (`signals_interrupt`) stop the children that are running and start no new
one: the command that ran them reports what was interrupted (`Interrupted`). Runs at a time
(`run_each`) raise RunsInterrupted; a caller running one at a time in its main thread (bisect)
gets KeyboardInterrupt once the child is stopped, and the run has no record.

An output directory holds one command's work (`claim_out`): a second command with other
settings is refused, unless it replaces the first."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moe_proxy import __version__
from moe_proxy.errors import DestinationExists, MoeProxyError

STOP_GRACE_S = 5.0  # a stopped child's time to end on SIGTERM before SIGKILL


@dataclass(frozen=True)
class Ran:
    returncode: int
    error: str | None  # the last error line of its output, when it failed
    wall_s: float
    reused: bool = False


@dataclass(frozen=True)
class Recipe:
    """What made a run: a record is reused only when all of it is the same."""

    argv: list[str]
    inputs: dict[str, str] = field(default_factory=dict)  # input location -> its content key
    version: str = __version__


class Stopped(Exception):
    """The run was stopped by an interrupt (or not started after it): it has no record."""


class Cancelled(Exception):
    """The run was stopped (or not started) because its `tag` was cancelled (`cancel`): what it
    would say can no longer change the answer. It has no record."""


def run_recorded(argv: list[str], directory: Path, record: str, log: str, env: dict[str, str] | None = None,
                 done: str | None = None, inputs: dict[str, str] | None = None, tag: str | None = None) -> Ran:
    """`moe-proxy <argv>` with its output in `directory/log`, unless `directory/record` says the
    same recipe (argv, version, `inputs`' content keys) already ran to exit 0 (and `done`, a file
    it writes, is there). Raises Stopped when an interrupt stops it (signals_interrupt), Cancelled
    when its `tag` is cancelled (`cancel`) before or while it runs."""
    recipe = Recipe(list(argv), dict(inputs or {}))
    if (old := reusable(directory, record, recipe, done)) is not None:
        return Ran(0, None, old.get("wall_s", 0.0), reused=True)
    path = directory / record
    directory.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    started = time.monotonic()
    with open(directory / log, "w") as out:
        code = _CHILDREN.run([sys.executable, "-m", "moe_proxy", *argv], out, {**os.environ, **(env or {})}, tag)
    wall = time.monotonic() - started
    error = last_error(directory / log) if code != 0 else None
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**asdict(recipe), "returncode": code, "error": error, "wall_s": wall}))
    tmp.replace(path)
    return Ran(code, error, wall)


def reusable(directory: Path, record: str, recipe: Recipe, done: str | None = None) -> dict | None:
    """The record in `directory` of a run of `recipe` that ran to exit 0 (and wrote `done`), or None."""
    try:
        old = json.loads((directory / record).read_text())
    except (OSError, ValueError):
        return None  # none, or unreadable: run again
    same = all(old.get(k) == v for k, v in asdict(recipe).items())
    finished = old.get("returncode") == 0 and (done is None or (directory / done).exists())
    return old if same and finished else None


def content_key(location: str) -> str:
    """What tells one input's content from another's: a proxy by the sha256 of its manifest
    (which holds every file's sha256), another checkpoint by its source identity (config, tensor
    table and router bytes: its weights are not read), any other directory by its files' sha256
    (calibration statistics), a file by its sha256 (--prompts)."""
    from moe_proxy.checkpoint.reader import MANIFEST, open_checkpoint
    from moe_proxy.storage import open_store, sha256_of

    store = open_store(location)
    if store.exists(MANIFEST):
        return "manifest sha256:" + hashlib.sha256(store.read_bytes(MANIFEST)).hexdigest()
    if store.exists("config.json"):
        from moe_proxy.architectures import detect
        from moe_proxy.checkpoint.layout import find_layout, source_identity

        ckpt = open_checkpoint(store)
        return "source identity:" + source_identity(ckpt, find_layout(ckpt, detect(ckpt.config)))
    if files := store.list():
        listing = "".join(f"{name} {sha256_of(store, name)}\n" for name in files)
        return "files sha256:" + hashlib.sha256(listing.encode()).hexdigest()
    folder, _, name = location.rstrip("/").rpartition("/")
    return "sha256:" + sha256_of(open_store(folder or "."), name)


def last_error(path: Path) -> str:
    """The last line of a log that names an error (else its last line), at most 500 characters,
    cut between words (the whole log stays beside the record)."""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return textwrap.shorten((errors or lines or ["no output"])[-1], 500, placeholder=" ...")


# --- interrupts: stop the children, start no new one ------------------------------------------


class Interrupted(Exception):
    """SIGINT or SIGTERM stopped a command; the message names what was interrupted and what was
    kept. The CLI prints it and exits 128 + the signal's number."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class _Children:
    """The child processes running now. Once stopped, none starts again (until reset)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen] = set()
        self._tags: dict[subprocess.Popen, str | None] = {}  # each running child's tag (cancel)
        self._cancelled: set[str] = set()
        self.signum: int | None = None  # the signal that stopped them

    def run(self, argv: list[str], out, env: dict[str, str], tag: str | None = None) -> int:
        with self._lock:  # a child started here is either seen by stop() or not started at all
            if self.signum is not None:
                raise Stopped()
            if tag is not None and tag in self._cancelled:
                raise Cancelled(tag)
            # its own process group: stop() reaches the ranks it starts too
            child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            self._running.add(child)
            self._tags[child] = tag
        try:
            code = child.wait()
        except KeyboardInterrupt:  # a caller running children one at a time, in the main thread
            self.stop(_signalled())
            raise
        finally:
            with self._lock:
                self._running.discard(child)
                self._tags.pop(child, None)
        if self.signum is not None:
            raise Stopped()
        if tag is not None and tag in self._cancelled:
            raise Cancelled(tag)
        return code

    def cancel(self, tag: str) -> int:
        """Start no child of `tag` from now on and stop those running (SIGTERM to each one's group,
        SIGKILL after STOP_GRACE_S, from a thread of its own: the caller goes on). Returns how
        many were running."""
        with self._lock:
            self._cancelled.add(tag)
            children = [c for c in self._running if self._tags.get(c) == tag]
        for child in children:
            _signal_group(child, signal.SIGTERM)
            threading.Thread(target=_kill_after_grace, args=(child,), daemon=True).start()
        return len(children)

    def stop(self, signum: int) -> None:
        """SIGTERM to every running child's group, SIGKILL to those still there after STOP_GRACE_S."""
        with self._lock:
            self.signum = signum
            children = list(self._running)
        for child in children:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in children:
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(child, signal.SIGKILL)
                child.wait()

    def reset(self) -> None:
        with self._lock:
            self.signum = None


def _kill_after_grace(child: subprocess.Popen) -> None:
    try:
        child.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(child, signal.SIGKILL)


def _signal_group(child: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, sig)


_CHILDREN = _Children()
_SIGNALLED: list[int] = []  # the signal that raised KeyboardInterrupt, for the message


def _interrupt(signum: int, frame) -> None:
    _SIGNALLED.append(signum)
    raise KeyboardInterrupt


def _signalled() -> int:
    """The signal that raised the KeyboardInterrupt (SIGINT where Python's own handler did)."""
    return _SIGNALLED[-1] if _SIGNALLED else signal.SIGINT


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """Within: SIGTERM, like SIGINT, raises KeyboardInterrupt in the main thread (by default it
    would end this process and leave its children running). The caller catches it, calls
    `stop_children()` and reports what it stopped."""
    _CHILDREN.reset()
    _SIGNALLED.clear()
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def cancel(tag: str) -> int:
    """Stop the running children of `tag` and start none after (processes.Cancelled in their
    callers); returns how many were running. Tags are for one command's life: make them unique
    (diagnose's name the diagnosis's directory and the variant)."""
    return _CHILDREN.cancel(tag)


def stop_children() -> int:
    """Stop the running children (no new one starts) after an interrupt; returns its signal number."""
    _CHILDREN.stop(_signalled())
    return _signalled()


# --- runs at a time, each on device slots no other running run holds ---------------------------


class RunsInterrupted(Exception):
    """run_each was interrupted: `stopped` were running (their children stopped), `queued` never
    started; `signum` is the signal."""

    def __init__(self, signum: int, stopped: list, queued: list):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.stopped, self.queued = signum, stopped, queued


def run_each(jobs: list, slots: list[dict[str, str]], run, finished) -> None:
    """`run(job, slot)` for every job, len(slots) at a time, each in a thread with a slot (the
    environment that gives it its devices, device.device_slots) that no running job holds: taken
    when the job starts, given back when it ends. `finished(job, result)` is called here as each
    ends. On an interrupt (KeyboardInterrupt, SIGTERM too within signals_interrupt) no queued job
    starts, the running children are stopped, and RunsInterrupted names both."""
    free: queue.SimpleQueue = queue.SimpleQueue()
    for slot in slots:
        free.put(slot)
    started: set[int] = set()

    def one(i: int):
        slot = free.get()
        started.add(i)
        try:
            return run(jobs[i], slot)
        finally:
            free.put(slot)

    reported: set[int] = set()
    with ThreadPoolExecutor(len(slots), thread_name_prefix="run") as pool:
        futures = {pool.submit(one, i): i for i in range(len(jobs))}
        try:
            for future in as_completed(futures):
                reported.add(futures[future])
                finished(jobs[futures[future]], future.result())
        except KeyboardInterrupt:
            pool.shutdown(wait=False, cancel_futures=True)
            signum = stop_children()
            wait([f for f in futures if not f.cancelled()])  # one cancelled by shutdown never reads as done
            stopped, queued = [], []
            for future, i in futures.items():
                if future.cancelled() or (isinstance(future.exception(), Stopped) and i not in started):
                    queued.append(jobs[i])
                elif isinstance(future.exception(), Stopped):
                    stopped.append(jobs[i])
                elif i not in reported and future.exception() is None:  # ended as the interrupt came
                    finished(jobs[i], future.result())
            raise RunsInterrupted(signum, stopped, queued) from None


# --- output directories: one command's work each ------------------------------------------------

SETTINGS = "moe-proxy-settings.json"  # in an --out: which command made it, with which settings


def claim_out(out: Path, command: str, settings: dict, written: tuple[str, ...], replace: bool = False) -> None:
    """Make `out` hold this `command`'s work with `settings` (JSON): a new one, or one that holds
    the same command and settings (a rerun resumes). One that holds another's (other settings, or
    the `written` names without a settings file) is refused, untouched, unless `replace`: then
    the `written` names go first. Call it after the input is checked, before the work starts."""
    mine = {"command": command, "settings": json.loads(json.dumps(settings))}
    path = out / SETTINGS
    try:
        old = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        old = {}
    if old == mine:
        return
    held = [name for name in written if (out / name).exists()]
    if old is not None or held:
        if not replace:
            what = _difference(old, mine) if old else f"of unknown settings: {', '.join(held)}"
            raise DestinationExists(f"--out {out} holds another moe-proxy {(old or {}).get('command', command)} "
                                    f"({what}): give another --out, or --replace to delete it and start again")
        for name in (*written, SETTINGS):
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            else:
                target.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(mine, indent=2) + "\n")
    tmp.replace(path)


def _difference(old: dict, mine: dict) -> str:
    """The first setting that differs, as 'KEY: OLD there, NEW here'."""
    if old.get("command") != mine["command"]:
        return f"made by moe-proxy {old.get('command')}"
    theirs, ours = old.get("settings") or {}, mine["settings"]
    key = next(k for k in [*ours, *theirs] if theirs.get(k) != ours.get(k))  # in the order the settings give
    return f"{key}: {_short(theirs.get(key))} there, {_short(ours.get(key))} here"


def _short(value) -> str:
    text = " ".join(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."
