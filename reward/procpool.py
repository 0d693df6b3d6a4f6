"""A tiny process pool with a hard per-item timeout.

``concurrent.futures.ProcessPoolExecutor`` cannot kill one stuck task; here a worker whose item exceeds the
deadline (or that crashes) is killed and replaced, and the item gets a default value. Used for symbolic math
checks, where sympy can hang on pathological LaTeX.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["TimeoutPool"]


START_TIMEOUT_S = 300.0  # a worker's start (a spawned interpreter importing ``fn``'s module) on a loaded machine


def _worker_loop(fn: Callable[..., Any], conn: Connection, warmup: Callable[[], Any] | None = None) -> None:
    """Say ready (``fn`` unpickled: its module imported; ``warmup`` run: the imports ``fn`` makes on first use), then
    apply ``fn`` to each received argument tuple until the parent closes the pipe."""
    if warmup is not None:
        warmup()
    conn.send((True, "ready"))
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send((True, fn(*args)))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which uses the default
            conn.send((False, repr(exc)))


class _Worker:
    """One worker process and the end of its pipe; ``started`` is set while an item is in flight."""

    def __init__(self, ctx: Any, fn: Callable[..., Any], warmup: Callable[[], Any] | None = None) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_loop, args=(fn, child, warmup), daemon=True)
        self.proc.start()
        child.close()
        self.item: int | None = None
        self.started = 0.0

    def wait_ready(self) -> None:
        """Block until the worker has started: an item's timeout then counts its work, not the interpreter's start
        (seconds for a spawned one importing sympy, more on a loaded machine)."""
        try:
            if self.conn.poll(START_TIMEOUT_S) and self.conn.recv() == (True, "ready"):
                return
        except (EOFError, OSError):
            pass
        self.kill()
        raise RuntimeError(f"a pool worker did not start within {START_TIMEOUT_S:g} s (exit code {self.proc.exitcode})")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class TimeoutPool:
    """Run a picklable top-level ``fn(*args)`` over many argument tuples, each with a hard timeout (``warmup``, a
    top-level function too, runs in each worker before it counts as started)."""

    def __init__(self, fn: Callable[..., Any], workers: int = 2, timeout_s: float = 5.0, context: str = "spawn",
                 warmup: Callable[[], Any] | None = None):
        self.fn, self.warmup = fn, warmup
        self.n_workers = max(1, workers)
        self.timeout_s = timeout_s
        self.ctx = mp.get_context(context)
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()  # one map() at a time: workers hold per-call state
        atexit.register(self.close)

    def _spawn(self) -> _Worker:
        """A started worker process (not yet known to be ready)."""
        return _Worker(self.ctx, self.fn, self.warmup)

    def _ensure_workers(self, n: int) -> None:
        self.workers = [w for w in self.workers if w.proc.is_alive()]
        fresh = [self._spawn() for _ in range(min(n, self.n_workers) - len(self.workers))]
        try:
            for w in fresh:  # started together, waited for together
                w.wait_ready()
        except BaseException:
            for w in fresh:
                w.kill()
            raise
        self.workers += fresh

    def map(self, items: Sequence[tuple], default: Any = None) -> list[Any]:
        """Results in input order; ``default`` for items that time out, raise, or kill their worker."""
        with self.lock:
            try:
                return self._map(list(items), default)
            except BaseException:  # a worker that would not start, an interrupt: no worker keeps a half-done item
                self._stop_all()
                raise

    def _map(self, items: list[tuple], default: Any) -> list[Any]:
        results = [default] * len(items)
        todo = list(range(len(items)))[::-1]
        self._ensure_workers(len(items))
        busy: dict[Connection, _Worker] = {}
        while todo or busy:
            for w in self.workers:
                if w.item is None and todo:
                    w.item, w.started = todo.pop(), time.monotonic()
                    try:
                        w.conn.send(items[w.item])
                    except OSError:  # worker died while idle: retry the item on a fresh one
                        todo.append(w.item)
                        self._replace(w)
                        continue
                    busy[w.conn] = w
            if not busy:  # every send failed: the fresh workers take the items on the next pass
                continue
            now = time.monotonic()
            next_deadline = min(w.started + self.timeout_s for w in busy.values())
            for conn in wait(list(busy), timeout=max(0.0, next_deadline - now)):
                w = busy.pop(conn)
                try:
                    ok, value = conn.recv()
                    results[w.item] = value if ok else default
                    w.item = None
                except (EOFError, OSError):  # worker died: replace it
                    self._replace(w)
            now = time.monotonic()
            for conn, w in list(busy.items()):
                if now - w.started >= self.timeout_s:
                    del busy[conn]
                    self._replace(w)
        return results

    def _replace(self, w: _Worker) -> None:
        w.kill()
        fresh = self._spawn()
        fresh.wait_ready()
        self.workers[self.workers.index(w)] = fresh

    def _stop_all(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []

    def close(self) -> None:
        """Stop all workers (idempotent)."""
        for w in self.workers:
            try:
                w.conn.close()
                w.proc.join(timeout=1)
                if w.proc.is_alive():
                    w.proc.kill()
            except (OSError, ValueError, AssertionError):
                pass
        self.workers = []
