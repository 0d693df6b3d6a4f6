"""The serving engine: one driver steps the samplers; HTTP handlers submit and cancel requests between steps.

Threads. HTTP handlers run on the server's event loop; they call :meth:`ServeEngine.submit` and
:meth:`ServeEngine.cancel`, which only touch queues under a lock. One driver thread owns the models' work: between
two steps it moves submitted sequences into their engine's waiting queue (``sample.engine.Engine``: admitted
while the batch has room) and removes cancelled ones; then it runs one step of every busy engine and posts
what became final to each request's ``asyncio.Queue`` (one ``loop.call_soon_threadsafe`` per step carries all
of the step's events). A disconnected client cancels its request, so its rows leave the batch before the next
step.

On CPU the driver belongs on the process's main thread, where the model was loaded (``run``; serve.py does
this and runs the HTTP server on a thread): torch's ops run on OpenMP thread teams, one per thread that calls
them, and once the process manages more OpenMP threads than it has cores, libgomp cuts its workers' spin-wait
short, so every parallel op wakes them from sleep. On 2 cores a second team made small ops back to back 1.1-2.5x
slower than on the main thread (``python -m bench.cpu_kernels``). Tests and benchmarks that need the calling
thread keep the default: a driver thread.

Per-request settings. A sampler runs one ``SamplingParams`` for its whole batch (one temperature, block size,
strategy, seed, stop set), so requests are grouped by their settings: each group is one sampler + engine and the
driver steps the busy groups in turn (one batched forward per group and round). On block models ``max_tokens``
is not part of a group's settings: it is each sequence's own budget, so requests that differ only in length share
a batch; full-attention models size the canvas by ``max_tokens`` and group by it too. A request with a ``seed`` is
a group of its own (its choices together) with a fresh generator, so it gets the tokens of ``generate`` with that
seed whatever else runs; a group whose last sequence leaves is dropped.

Text. Stops of the sampler are eval.py's (``SamplingParams.stop_ids``: EOS and the chat turn end; the token is
not part of the returned text). A request's ``stop`` strings are matched in the decoded text, so they may span
tokens: the text is cut before the first match and the sequence is cancelled. What is final: a block model
commits a whole block at a time and never changes it (``committed()`` after every step); the text of the
committed prefix is final except a trailing partial UTF-8 character and a tail that could be the start of a stop
string, which are held back until the next block or the end. A full-attention model decodes anywhere inside its
current block but in block order, so its complete blocks are final too and stream the same way (one block of
``block_size`` tokens at a time; nothing before the end when one block spans the whole answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import threading
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from core.errors import UserError
from core.schema import SettingError, replace
from models.layers import packed_projections
from sample.engine import Engine, Finished, Sequence
from sample.full_sampler import FullSampler
from sample.generate import compute_precision, make_sampler, seeded_generator
from sample.params import SamplingParams

if TYPE_CHECKING:
    from models.registry import Adapter

UNBOUNDED = 2**31 - 1  # a block group's sampler budget: each sequence carries its own max_tokens


class RequestError(UserError):
    """A request the server refuses: HTTP ``status``, the offending ``param`` (for the error body)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class ChoiceResult:
    """A finished choice: its text, why it ended, tokens generated and (block models) the decoding order."""

    text: str
    finish_reason: str  # stop | length (OpenAI's names; EOS and stop tokens are "stop")
    completion_tokens: int
    token_ids: list[int] | None = None
    step_map: list[int] | None = None
    logprobs: list[tuple[int, float]] | None = None  # (token id, log-prob) of each token of ``text``


class TextStream:
    """Final text of a growing, final token prefix: deltas that are never taken back; stop strings cut it."""

    def __init__(self, tokenizer: Any, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.sent = 0  # characters already handed out
        self.seen = -1  # token count of the last update (decode only when it grows)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def find_stop(self, text: str) -> tuple[int, int] | None:
        """(start, end) of the earliest stop string in ``text``."""
        hits = [(i, i + len(s)) for s in self.stops if (i := text.find(s)) >= 0]
        return min(hits) if hits else None

    def update(self, ids: list[int]) -> tuple[str, tuple[int, int] | None]:
        """The new final text after the prefix grew to ``ids``; the stop match if one appeared."""
        self.seen = len(ids)
        text = self.decode(ids)
        hit = self.find_stop(text)
        safe = hit[0] if hit else len(text) - self._held_back(text)
        delta = text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return delta, hit

    def _held_back(self, text: str) -> int:
        """Trailing characters that may still change: a partial UTF-8 character, a possible stop-string start."""
        hold = len(text) - len(text.rstrip("\ufffd"))
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return hold

    def finish(self, ids: list[int]) -> tuple[str, str, tuple[int, int] | None]:
        """(whole final text, the delta not handed out yet, stop match) once no more tokens come."""
        text = self.decode(ids)
        hit = self.find_stop(text)
        if hit:
            text = text[:hit[0]]
        delta = text[self.sent:]
        self.sent = len(text)
        return text, delta, hit

    def tokens_through(self, ids: list[int], end: int) -> int:
        """The fewest leading tokens of ``ids`` whose text reaches character ``end`` (usage of a stop-string cut)."""
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.decode(ids[:mid])) >= end:
                hi = mid
            else:
                lo = mid + 1
        return hi


@dataclass
class Choice:
    """One sequence of a request (prompt p, sample j): engine sequence ``seq_id``."""

    request: Request
    index: int
    seq_id: int
    prompt: list[int]
    stream: TextStream
    done: bool = False


@dataclass
class Request:
    """A submitted request: its sequences and the queue its events go to (on the handler's event loop).

    Events: ``("text", choice_index, delta)``, ``("done", choice_index, ChoiceResult)``, ``("error", None, msg)``.
    """

    id: str
    prompts: list[list[int]]
    n: int
    params: SamplingParams
    stream: bool
    step_map: bool
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    choices: list[Choice] = field(default_factory=list)
    logprobs: bool = False  # report each token's log-prob (ChoiceResult.logprobs)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclass
class _Group:
    """The sequences of one settings group: a sampler, its engine, and what waits to join it."""

    key: tuple
    params: SamplingParams
    engine: Engine
    pending: list[Sequence] = field(default_factory=list)

    @property
    def busy(self) -> bool:
        return bool(self.pending) or self.engine.busy


class ServeEngine:
    """Runs requests on one adapter with one driver: its own thread, or (``driver_thread=False``) whichever thread
    calls ``run``; see the module docstring."""

    def __init__(self, adapter: Adapter, defaults: SamplingParams, max_batch: int = 32, max_queue: int = 256,
                 max_prompt_tokens: int | None = None, driver_thread: bool = True):
        self.adapter, self.defaults = adapter, defaults
        self.max_batch, self.max_queue, self.max_prompt_tokens = max_batch, max_queue, max_prompt_tokens
        self.limit = adapter.position_limit
        self._cond = threading.Condition()
        self._groups: dict[tuple, _Group] = {}
        self._choices: dict[int, Choice] = {}  # live sequences by engine sequence id
        self._cancels: list[int] = []
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, tuple]]] = {}  # events to hand over
        self._ids = itertools.count()
        self._closed = False
        self._thread: threading.Thread | None = None
        if driver_thread:  # else the owner calls run() on the thread it wants driving
            self._thread = threading.Thread(target=self.run, name="serve-driver", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ handler side (any thread)

    def request_params(self, overrides: dict[str, Any]) -> SamplingParams:
        """The defaults with a request's settings (None = default); a bad value raises RequestError naming it."""
        changes = {k: v for k, v in overrides.items() if v is not None}
        try:
            params = replace(self.defaults, **changes)
            params.check_for(self.adapter)
        except SettingError as err:
            raise RequestError(400, str(err), err.field) from None
        except TypeError as err:
            raise RequestError(400, str(err)) from None
        if self.adapter.attention == "full" and self.limit is not None:
            # a full-attention group sizes its canvas (whole blocks) by max_tokens: refuse before building one
            block, canvas = params.block_for("full", None), FullSampler.canvas(params)
            if canvas > self.limit:
                rounded = f" (whole blocks of {block}: {canvas})" if canvas != params.max_tokens else ""
                raise RequestError(400, f"max_tokens {params.max_tokens}{rounded} is more than the model's "
                                        f"{self.limit} positions", "max_tokens")
        return params

    def submit(self, request_id: str, prompts: list[list[int]], n: int, params: SamplingParams, stops: list[str],
               stream: bool, step_map: bool, loop: asyncio.AbstractEventLoop, logprobs: bool = False) -> Request:
        """Queue ``n`` sequences per prompt; raises RequestError (400 prompt too long, 503 queue full)."""
        req = Request(request_id, prompts, n, params, stream, step_map, loop, asyncio.Queue(), logprobs=logprobs)
        key, group_params = self._group_key(params)
        if params.seed is not None:  # its own batch and generator: the tokens of generate() with that seed
            key += (("request", request_id),)
        with self._cond:
            if self._closed:  # no driver would ever step it: the request would wait forever
                raise RequestError(503, "the server is shutting down")
            group = self._groups.get(key) or self._new_group(key, group_params)
            budgets = [self._budget(group, p, params.max_tokens) for p in prompts]
            wanted = len(prompts) * n
            if wanted > self.max_batch + self.max_queue:
                raise RequestError(400, f"the request asks for {wanted} sequences (prompts x n); this server runs "
                                        f"at most {self.max_batch + self.max_queue} at a time", "n")
            if len(self._choices) + wanted > self.max_batch + self.max_queue:
                raise RequestError(503, f"the server is at capacity ({len(self._choices)} sequences running or "
                                        f"waiting, at most {self.max_batch + self.max_queue}); retry later")
            self._groups[key] = group
            for p, (prompt, budget) in enumerate(zip(prompts, budgets)):
                for j in range(n):
                    seq_id = next(self._ids)
                    choice = Choice(req, p * n + j, seq_id, prompt, TextStream(self.adapter.tokenizer, stops))
                    req.choices.append(choice)
                    self._choices[seq_id] = choice
                    group.pending.append(Sequence(seq_id, prompt, budget))
            self._cond.notify()
        return req

    def cancel(self, req: Request) -> None:
        """Drop the request's unfinished sequences (at the next step)."""
        with self._cond:
            self._cancels.extend(c.seq_id for c in req.choices if not c.done)
            self._cond.notify()

    def load(self) -> dict[str, int]:
        """Sequences running, waiting and settings groups (for /health)."""
        with self._cond:
            running = sum(len(g.engine.sampler.running) for g in self._groups.values())
            return {"running": running, "waiting": len(self._choices) - running, "groups": len(self._groups),
                    "closed": self._closed}

    def close(self) -> None:
        """Stop driving; requests still running or waiting end with an error event (their streams close)."""
        with self._cond:
            self._closed = True
            for choice in self._choices.values():
                choice.done = True
                self._post(choice.request, "error", choice.index, "the server is shutting down")
            self._choices.clear()
            self._flush()
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def _group_key(self, params: SamplingParams) -> tuple[tuple, SamplingParams]:
        """Settings that must be equal within a batch, and the group sampler's params."""
        group_params = params
        if self.adapter.attention == "block":
            group_params = replace(params, max_tokens=UNBOUNDED)
        key = tuple((f.name, _hashable(getattr(group_params, f.name))) for f in dataclasses.fields(group_params))
        return key, group_params

    def _new_group(self, key: tuple, params: SamplingParams) -> _Group:
        stop_ids = params.stop_ids(self.adapter.tokenizer, tuple(self.adapter.eos_ids), tuple(self.adapter.stop_ids))
        generator = seeded_generator(self.adapter, params.seed)
        sampler = make_sampler(self.adapter, params, stop_ids, self.limit, generator)
        return _Group(key, params, Engine(sampler, self.max_batch))

    def _budget(self, group: _Group, prompt: list[int], max_tokens: int) -> int:
        if self.max_prompt_tokens is not None and len(prompt) > self.max_prompt_tokens:
            raise RequestError(400, f"the prompt has {len(prompt)} tokens, more than this server's limit of "
                                    f"{self.max_prompt_tokens} (server.max_prompt_tokens)", "prompt")
        try:
            room = group.engine.sampler.check_prompt(0, prompt)
        except ValueError as err:
            raise RequestError(400, f"prompt too long: {str(err).replace('prompt 0 has', 'the prompt has')}",
                               "prompt") from None
        return min(room, max_tokens)

    # ------------------------------------------------------------ driver thread

    def run(self) -> None:
        """Drive the engine on the calling thread until ``close``."""
        with compute_precision(self.adapter, self.defaults), torch.inference_mode(), \
                packed_projections(self.adapter.model):
            while True:
                with self._cond:
                    while not self._closed and not self._cancels and not any(g.busy for g in self._groups.values()):
                        self._cond.wait()
                    if self._closed:
                        return
                    busy = self._between_steps()
                for group in busy:
                    self._step(group)

    def _between_steps(self) -> list[_Group]:
        """(Lock held.) Apply cancels, move pending sequences into their engine, drop idle groups."""
        for seq_id in self._cancels:
            choice = self._choices.pop(seq_id, None)
            if choice is not None:
                choice.done = True
                self._remove(seq_id)
        self._cancels.clear()
        for group in self._groups.values():
            for seq in group.pending:
                group.engine.add(seq)
            group.pending.clear()
        for key in [k for k, g in self._groups.items() if not g.busy]:
            del self._groups[key]
        return list(self._groups.values())

    def _remove(self, seq_id: int) -> None:
        for group in self._groups.values():
            if group.engine.cancel(seq_id):
                return
            group.pending[:] = [s for s in group.pending if s.index != seq_id]

    def _step(self, group: _Group) -> None:
        try:
            finished = group.engine.step()
        except Exception as err:  # noqa: BLE001 - a failing batch fails its requests, never the server
            traceback.print_exc()
            message = f"sampling failed: {type(err).__name__}: {err}"
            if group.engine.failed_admission:  # the running batch is intact: only the newcomers fail
                self._fail_admission(group, message)
            else:
                self._fail(group, message)
            return
        with self._cond:
            for done in finished:
                choice = self._choices.pop(done.seq.index, None)
                if choice is not None:
                    self._finish(choice, done)
            stopped = self._stream_committed(group)
            self._flush()
        for seq_id in stopped:
            group.engine.cancel(seq_id)

    def _stream_committed(self, group: _Group) -> list[int]:
        """(Lock held.) Post the new final text of running sequences; the ids of those a stop string ended."""
        stopped = []
        for seq_id, ids in group.engine.sampler.committed().items():
            choice = self._choices.get(seq_id)
            if choice is None or len(ids) == choice.stream.seen or not (choice.request.stream or choice.stream.stops):
                continue
            delta, hit = choice.stream.update(ids)
            if delta and choice.request.stream:
                self._post(choice.request, "text", choice.index, delta)
            if hit:
                self._choices.pop(seq_id)
                row = next(r for r in group.engine.sampler.running if r.seq.index == seq_id)
                self._finish_at_stop(choice, ids, row.logprobs, row.steps, hit)
                stopped.append(seq_id)
        return stopped

    def _finish(self, choice: Choice, done: Finished) -> None:
        ends_with_stop = done.reason in ("eos", "stop")
        ids = done.response[:-1] if ends_with_stop else done.response
        text, delta, hit = choice.stream.finish(ids)
        if hit:
            self._finish_at_stop(choice, ids, done.logprobs, done.steps, hit, text, delta)
            return
        req = choice.request
        if delta and req.stream:
            self._post(req, "text", choice.index, delta)
        result = ChoiceResult(text, "stop" if ends_with_stop else "length", len(done.response))
        if req.step_map:
            result.token_ids, result.step_map = list(done.response), list(done.steps)
        if req.logprobs:
            result.logprobs = list(zip(ids, done.logprobs, strict=False))
        choice.done = True
        self._post(req, "done", choice.index, result)

    def _finish_at_stop(self, choice: Choice, ids: list[int], logps: list[float], steps: list[int],
                        hit: tuple[int, int], text: str | None = None, delta: str = "") -> None:
        """A stop string matched: the text before it is the answer; usage, token ids and step map count the tokens
        through the stop, the log-probs cover the tokens that make up the answer (the last may run into the stop
        string)."""
        if text is None:
            text, delta, _ = choice.stream.finish(ids)
        req = choice.request
        if delta and req.stream:
            self._post(req, "text", choice.index, delta)
        through = choice.stream.tokens_through(ids, hit[1])
        result = ChoiceResult(text, "stop", through)
        if req.step_map:
            result.token_ids, result.step_map = list(ids[:through]), list(steps[:through])
        if req.logprobs:
            kept = choice.stream.tokens_through(ids, len(text)) if text else 0
            result.logprobs = list(zip(ids[:kept], logps, strict=False))
        choice.done = True
        self._post(req, "done", choice.index, result)

    def _post(self, req: Request, kind: str, index: int | None, payload: Any) -> None:
        """(Lock held.) Queue an event for the request's handler; ``_flush`` hands the step's events over."""
        self._outbox.setdefault(req.loop, []).append((req.queue, (kind, index, payload)))

    def _flush(self) -> None:
        """(Lock held.) Hand the queued events to their event loops: one wake-up per loop and step, not one per
        event (each wakes the HTTP thread, which then competes with the driver for the interpreter lock)."""
        for loop, events in self._outbox.items():
            with contextlib.suppress(RuntimeError):  # the handler's loop is closed (shutting down): nobody listens
                loop.call_soon_threadsafe(_deliver, events)
        self._outbox = {}

    def _fail_admission(self, group: _Group, message: str) -> None:
        """The sequences a step failed to admit get an error and leave the queue; the running ones go on."""
        failed = {seq.index for seq in group.engine.failed_admission}
        with self._cond:
            group.engine.waiting = type(group.engine.waiting)(s for s in group.engine.waiting if s.index not in failed)
            for seq_id in failed:
                choice = self._choices.pop(seq_id, None)
                if choice is not None:
                    choice.done = True
                    self._post(choice.request, "error", choice.index, message)
            self._flush()

    def _fail(self, group: _Group, message: str) -> None:
        """Every sequence of a group whose step raised gets an error; the group is rebuilt on the next request."""
        with self._cond:
            for seq in [*group.engine.waiting, *(r.seq for r in group.engine.sampler.running)]:
                choice = self._choices.pop(seq.index, None)
                if choice is not None:
                    choice.done = True
                    self._post(choice.request, "error", choice.index, message)
            self._flush()
            if self._groups.get(group.key) is group:
                group.engine = self._new_group(group.key, group.params).engine


def _deliver(events: list[tuple[asyncio.Queue, tuple]]) -> None:
    """(On the handlers' event loop.) Put each event into its request's queue."""
    for queue, event in events:
        queue.put_nowait(event)


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value
