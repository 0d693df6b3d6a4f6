"""serve.py's HTTP layer: OpenAI-compatible routes over one :class:`ServeEngine` (jobs/serve_engine.py).

Routes: ``GET /health``, ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions`` (raw prompt text
or token ids), ``POST /v1/chat/completions`` (messages rendered with the model's chat template, as eval.py renders
prompts).
Request fields: OpenAI's ``model, max_tokens (max_completion_tokens), temperature, top_p, n, stop, seed, stream,
stream_options``, plus ``top_k`` and the dLLM settings (the openai client sends them with ``extra_body``):
``block_size`` (alias ``block_length``), ``denoising_steps``, ``remasking_strategy``, ``dynamic_threshold``
(aliases ``threshold``, ``confidence_threshold``), ``steps`` (full-attention models), and ``return_step_map``
(each choice also carries ``token_ids`` and ``step_map``: the step at which each token was committed, to replay
the decoding order). Unset fields take the server's ``rollout`` settings. Errors have OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``: 400 for a bad field (named in ``param`` and the message),
401 without the API key, 404 for an unknown model or route, 503 when the queue is full or the server is shutting
down, 500 when sampling failed (type ``server_error`` for 5xx, ``invalid_request_error`` for the rest).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import AliasChoices, BaseModel, ConfigDict, Field
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.errors import UserError
from jobs.serve_engine import ChoiceResult, RequestError, ServeEngine
from jobs.serve_engine import Request as EngineRequest
from sample.trace_viewer import token_pieces

if TYPE_CHECKING:
    from models.registry import Adapter

DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks whether its client is still there
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "block_size", "denoising_steps",
                   "remasking_strategy", "dynamic_threshold", "steps")


class _Body(BaseModel):
    """Fields shared by both generation routes (unknown fields are refused by name)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    block_size: int | None = Field(None, validation_alias=AliasChoices("block_size", "block_length"))
    denoising_steps: int | None = None
    remasking_strategy: str | None = None
    dynamic_threshold: float | None = Field(
        None, validation_alias=AliasChoices("dynamic_threshold", "threshold", "confidence_threshold"))
    steps: int | None = None
    return_step_map: bool = False
    # OpenAI fields with no effect here, accepted so that ordinary clients work
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False  # refused when true


class ChatBody(_Body):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def build_app(engine: ServeEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI application serving ``engine`` as model ``model_name``."""
    app = FastAPI(title="dllm-rl serve", docs_url=None, redoc_url=None)
    adapter = engine.adapter
    created = int(time.time())

    if api_key is not None:
        app.add_middleware(_RequireKey, api_key=api_key)

    def check_model(body: _Body) -> None:
        if body.model != model_name:
            raise RequestError(404, f"model {body.model!r} does not exist; this server serves {model_name!r}",
                               "model")

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, err: RequestError) -> JSONResponse:
        return _error(err.status, str(err), err.param)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(err.errors())
        return _error(400, message, param)

    @app.exception_handler(Exception)
    async def on_crash(_: Request, err: Exception) -> JSONResponse:
        return _error(500, f"internal error: {type(err).__name__}: {err}", None, "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:  # unknown route, 405, ...
        response = _error(err.status_code, str(err.detail), None)
        response.headers.update(err.headers or {})  # a 405's Allow
        return response

    @app.get("/health")
    async def health() -> JSONResponse:
        load = engine.load()
        closed = load.pop("closed")
        return JSONResponse({"status": "shutting down" if closed else "ok", **load}, status_code=503 if closed else 200)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "dllm-rl",
                "max_model_len": engine.limit}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != model_name:
            raise RequestError(404, f"model {model_id!r} does not exist; this server serves {model_name!r}", "model")
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        check_model(body)
        _check_logprobs(body.logprobs or 0, "logprobs")
        if body.echo:  # echo with log-probs asks for the prompt's: a diffusion model scores no prompt token
            raise RequestError(400, "echo is not supported: send the prompt text yourself", "echo")
        prompts = _completion_prompts(adapter, body.prompt)
        return await _serve(engine, request, body, prompts, "text_completion", model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        check_model(body)
        _check_logprobs(body.top_logprobs or 0, "top_logprobs")
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        prompts = [_chat_prompt(adapter, body.messages)]
        return await _serve(engine, request, body, prompts, "chat.completion", model_name)

    return app


class _RequireKey:
    """ASGI middleware: /v1/ routes need ``Authorization: Bearer <key>``, checked before the body is read or
    validated (a caller without the key learns nothing about its request); a plain ASGI layer, so streams and
    client disconnects pass through untouched."""

    def __init__(self, app: Any, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}"

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and \
                Headers(scope=scope).get("authorization", "") != self.expected:
            denied = _error(401, "missing or wrong API key (send 'Authorization: Bearer <key>')", None)
            await denied(scope, receive, send)
            return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------- prompts


def _completion_prompts(adapter: Adapter, prompt: Any) -> list[list[int]]:
    """Token ids of each prompt: text is tokenized as it is (special-token strings count), ids pass through."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise RequestError(400, "prompt must not be empty", "prompt")
    vocab = len(adapter.tokenizer)
    out = []
    for p in prompt:
        ids = list(adapter.tokenizer.encode(p, add_special_tokens=False)) if isinstance(p, str) else list(p)
        if not ids:  # nothing to condition on: a model answers no question it was not asked
            raise RequestError(400, f"prompt {len(out)} is empty" if len(prompt) > 1 else "prompt must not be empty",
                               "prompt")
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
        out.append(ids)
    return out


def _chat_prompt(adapter: Adapter, messages: list[dict[str, Any]]) -> list[int]:
    """The model's chat template over the messages (``adapter.encode_chat``, as eval.py renders prompts)."""
    if not messages:
        raise RequestError(400, "messages must not be empty", "messages")
    plain = []
    for i, m in enumerate(messages):
        if m.get("role") not in ("system", "developer", "user", "assistant"):
            raise RequestError(400, f"messages[{i}].role must be system, developer, user or assistant, got "
                                    f"{m.get('role')!r}", "messages")
        role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name of the system turn
        plain.append({"role": role, "content": _content_text(m.get("content"), i)})
    return adapter.encode_chat(plain)


def _content_text(content: Any, i: int) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise RequestError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")


def _check_logprobs(alternatives: int, field: str) -> None:
    """Log-probs of the chosen tokens are served; alternatives are not (a diffusion sampler draws each token from
    the distribution of the step that wrote it and keeps only the drawn token's log-prob)."""
    if alternatives:
        raise RequestError(400, f"{field}={alternatives}: only the chosen tokens' log-probs are available (ask for "
                                f"{'logprobs=0' if field == 'logprobs' else 'logprobs=true without top_logprobs'})",
                           field)


# ---------------------------------------------------------------- running a request


async def _serve(engine: ServeEngine, http: Request, body: _Body, prompts: list[list[int]], kind: str,
                 model_name: str):
    if body.n < 1:
        raise RequestError(400, f"n must be >= 1, got {body.n}", "n")
    if body.stream_options is not None and not body.stream:
        raise RequestError(400, "stream_options is only allowed with stream true", "stream_options")
    params = engine.request_params({name: getattr(body, name) for name in SAMPLING_FIELDS})
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    wants_logprobs = body.logprobs is not None and body.logprobs is not False  # completions: 0 asks for them
    req = engine.submit(f"{prefix}-{uuid.uuid4().hex[:24]}", prompts, body.n, params, stops, body.stream,
                        body.return_step_map, asyncio.get_running_loop(), logprobs=wants_logprobs)
    head = {"id": req.id, "created": int(time.time()), "model": model_name}
    if body.stream:
        usage = bool((body.stream_options or {}).get("include_usage"))
        return _EngineStream(engine, req, _stream(engine, http, req, kind, head, usage))
    try:
        results = await _collect(http, req)
    finally:
        engine.cancel(req)
    if results is None:  # the client left; nobody reads this
        return JSONResponse({}, status_code=499)
    choices = [_choice(kind, i, results[i], engine.adapter.tokenizer) for i in range(len(results))]
    return {**head, "object": kind, "choices": choices, "usage": _usage(req, results.values())}


async def _events(http: Request, req: EngineRequest) -> AsyncIterator[tuple[str, int | None, Any]]:
    """The request's events until all its choices are done; stops early when the client disconnects."""
    remaining = len(req.choices)
    getter: asyncio.Future | None = None
    try:
        while remaining:
            getter = getter or asyncio.ensure_future(req.queue.get())
            done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
            if not done:
                if await http.is_disconnected():
                    return
                continue
            event, getter = getter.result(), None
            if event[0] == "error":
                raise RequestError(500, event[2])
            remaining -= event[0] == "done"
            yield event
    finally:
        if getter is not None:
            getter.cancel()


async def _collect(http: Request, req: EngineRequest) -> dict[int, ChoiceResult] | None:
    results: dict[int, ChoiceResult] = {}
    async for kind, index, payload in _events(http, req):
        if kind == "done":
            results[index] = payload
    return results if len(results) == len(req.choices) else None


async def _stream(engine: ServeEngine, http: Request, req: EngineRequest, kind: str, head: dict,
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format; ``data: [DONE]`` at the end."""
    obj = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
    results: dict[int, ChoiceResult] = {}
    try:
        if kind == "chat.completion":
            for c in req.choices:
                yield _sse({**head, "object": obj, "choices": [_delta(kind, c.index, {"role": "assistant",
                                                                                       "content": ""})]})
        async for event, index, payload in _events(http, req):
            if event == "text":
                yield _sse({**head, "object": obj, "choices": [_delta(kind, index, {"content": payload})]})
            else:
                results[index] = payload
                yield _sse({**head, "object": obj, "choices": [_delta(kind, index, {}, payload,
                                                                          engine.adapter.tokenizer)]})
        if include_usage and len(results) == len(req.choices):
            yield _sse({**head, "object": obj, "choices": [], "usage": _usage(req, results.values())})
        yield "data: [DONE]\n\n"
    except RequestError as err:
        yield _sse({"error": {"message": str(err), "type": "server_error", "param": None, "code": None}})


class _EngineStream(StreamingResponse):
    """An SSE response that cancels its engine request when the response ends, however it ends. The event generator
    cannot do it alone: a client gone before the first send (the send fails) leaves it unstarted, and an unstarted
    generator runs no cleanup."""

    def __init__(self, engine: ServeEngine, req: EngineRequest, events: AsyncIterator[str]):
        super().__init__(events, media_type="text/event-stream")
        self._engine, self._req = engine, req

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._engine.cancel(self._req)


def _delta(kind: str, index: int, delta: dict, result: ChoiceResult | None = None, tokenizer: Any = None) -> dict:
    """One choice of a stream chunk: new text, or (with ``result``) the finish reason."""
    if kind == "chat.completion":
        out: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": None, "logprobs": None}
    else:
        out = {"index": index, "text": delta.get("content", ""), "finish_reason": None, "logprobs": None}
    if result is not None:  # the last chunk of a choice carries the log-probs of its whole text
        out["finish_reason"] = result.finish_reason
        out["logprobs"] = _logprobs(kind, result, tokenizer)
        out.update(_replay(result))
    return out


def _choice(kind: str, index: int, result: ChoiceResult, tokenizer: Any) -> dict:
    if kind == "chat.completion":
        out = {"index": index, "message": {"role": "assistant", "content": result.text},
               "finish_reason": result.finish_reason}
    else:
        out = {"index": index, "text": result.text, "finish_reason": result.finish_reason}
    return out | {"logprobs": _logprobs(kind, result, tokenizer)} | _replay(result)


def _logprobs(kind: str, result: ChoiceResult, tokenizer: Any) -> dict | None:
    """OpenAI's log-probs object for the tokens of the choice's text: each token's log-prob under the model's
    distribution at the denoising step that wrote it (temperature 1, before any top-k / top-p filter: the value
    the sampler records and TraceRL trains on)."""
    if result.logprobs is None:
        return None
    ids = [t for t, _ in result.logprobs]
    pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    if kind == "chat.completion":
        return {"content": [{"token": piece, "logprob": lp, "bytes": raw, "top_logprobs": []}
                            for piece, raw, (_, lp) in zip(pieces, token_bytes(tokenizer, ids), result.logprobs,
                                                           strict=True)]}
    # where each token's text starts: the running length of the text the tokens before it add (sample.trace_viewer
    # token_pieces: linear in the tokens, where decoding every prefix was quadratic)
    offsets = list(itertools.accumulate((len(piece) for piece in token_pieces(ids, tokenizer)[:-1]), initial=0))
    return {"tokens": pieces, "token_logprobs": [lp for _, lp in result.logprobs], "top_logprobs": None,
            "text_offset": offsets[:len(ids)]}


def token_bytes(tokenizer: Any, ids: list[int]) -> list[list[int]]:
    """Each token's own bytes (OpenAI's ``bytes``: a client joins them to rebuild characters that span tokens). A
    byte-level BPE token (GPT-2, Qwen, Llama 3, SmolLM2) spells its bytes one character each, through GPT-2's
    byte-to-character table, so a token holding part of a UTF-8 character gives those bytes, where decoding it
    alone gives U+FFFD; special tokens and other tokenizers give the UTF-8 of the decoded token."""
    def text_bytes(t: int) -> list[int]:
        return list(tokenizer.decode([t], skip_special_tokens=False).encode())

    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if type(decoder).__name__ != "ByteLevel":
        return [text_bytes(t) for t in ids]
    special, table = set(getattr(tokenizer, "all_special_ids", ())), _byte_of_char()
    return [text_bytes(t) if t in special or spelled is None or any(c not in table for c in spelled)  # added token
            else [table[c] for c in spelled] for t, spelled in zip(ids, tokenizer.convert_ids_to_tokens(ids),
                                                                   strict=True)]


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable Latin-1 bytes ('!'..'~', '\xa1'..'\xac', '\xae'..'\xff')
    stand for themselves, every other byte for chr(256 + its rank among those others)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in set(printable)]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


def _replay(result: ChoiceResult) -> dict:
    return {} if result.step_map is None else {"token_ids": result.token_ids, "step_map": result.step_map}


def _usage(req: EngineRequest, results: Any) -> dict:
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": req.prompt_tokens, "completion_tokens": completion,
            "total_tokens": req.prompt_tokens + completion}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _error(status: int, message: str, param: str | None, kind: str | None = None) -> JSONResponse:
    """OpenAI's error body: a client's mistake is an invalid_request_error, the server's (5xx) a server_error."""
    kind = kind or ("server_error" if status >= 500 else "invalid_request_error")
    code = {401: "invalid_api_key", 503: "server_busy"}.get(status)
    if status == 404 and param == "model":
        code = "model_not_found"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One line naming the first invalid field of a request body (FastAPI's validation errors)."""
    err = errors[0]
    loc = [str(part) for part in err.get("loc", ()) if part != "body"]
    if err.get("type") == "json_invalid":
        return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    if not loc and err.get("type") in ("model_attributes_type", "dict_type"):  # a list, a string, or not JSON
        return "the request body must be a JSON object (sent with Content-Type: application/json)", None
    field = loc[0] if loc else None
    path = ".".join(loc) or "body"
    if err.get("type") == "extra_forbidden":
        return f"unknown field {path!r}", field
    if err.get("type") == "missing":
        return f"field {path!r} is required", field
    return f"field {path!r}: {err.get('msg')}", field


# ---------------------------------------------------------------- running the server


@contextmanager
def background_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                      sock: socket.socket | None = None) -> Iterator[str]:
    """Run ``app`` with uvicorn in a thread on ``sock`` (default: a new one on host:port); yields its base URL,
    stops on exit (connections still open get up to 10 s)."""
    import uvicorn

    sock = sock or bind(host, port)
    host = sock.getsockname()[0]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server thread stopped during start-up")
        time.sleep(0.01)
    try:
        yield f"http://{f'[{host}]' if ':' in host else host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free port), bound before uvicorn starts so the address is known."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({err.strerror}); set server.host / server.port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve_until_closed(engine: ServeEngine, app: FastAPI, sock: socket.socket | None = None,
                       on_ready: Callable[[str], None] | None = None) -> None:
    """Serve ``app`` on a thread (``background_server``; ``on_ready`` gets its URL) and drive ``engine`` on this one
    until it is closed or interrupted; then open requests end with an error event, so the HTTP server can stop."""
    with background_server(app, sock=sock) as url:
        if on_ready is not None:
            on_ready(url)
        try:
            engine.run()
        finally:
            engine.close()


def check_prompt_limit(max_prompt_tokens: int | None, position_limit: int | None) -> None:
    """Refuse a ``server.max_prompt_tokens`` that no request could use: a prompt filling the model's positions leaves
    no room for a generated token. (Below that, how long a prompt fits depends on each request's block size and
    max_tokens; the request gets its own 400.)"""
    from core.loader import ConfigError

    if max_prompt_tokens is not None and position_limit is not None and max_prompt_tokens >= position_limit:
        raise ConfigError(f"key 'server.max_prompt_tokens': {max_prompt_tokens} leaves no room for a generated token "
                          f"below the model's {position_limit} positions; lower it or leave it null",
                          "server.max_prompt_tokens")


def run_serve(cfg: Any) -> None:
    """serve.py: load the model, print the address, serve until interrupted. The engine runs on this (the main)
    thread, the HTTP server on another (see jobs/serve_engine.py on OpenMP teams)."""
    from jobs.demo import ensure_demo_model
    from jobs.dist import default_device
    from jobs.rollout import check_for_model
    from models.registry import load_model

    cfg.system.apply()
    ensure_demo_model(cfg.model)
    adapter = load_model(cfg.model, device=default_device())
    check_for_model("rollout", cfg.rollout, adapter)
    check_prompt_limit(cfg.server.max_prompt_tokens, adapter.position_limit)
    name = cfg.server.model_name or _folder_name(cfg.model.pretrained_model)
    engine = ServeEngine(adapter, cfg.rollout, cfg.server.max_batch, cfg.server.max_queue,
                         cfg.server.max_prompt_tokens, driver_thread=False)
    sock = bind(cfg.server.host, cfg.server.port)
    def announce(url: str) -> None:
        print(f"serving {name!r} ({adapter.model_base}, {adapter.attention} attention) at {url}/v1 "
              f"(max_batch {cfg.server.max_batch}, max_queue {cfg.server.max_queue}"
              f"{', API key required' if cfg.server.api_key else ''}); Ctrl-C stops", flush=True)

    try:
        # until Ctrl-C / SIGTERM (run_job's handler) interrupts it
        serve_until_closed(engine, build_app(engine, name, cfg.server.api_key), sock, announce)
    except KeyboardInterrupt as err:
        err.detail = "the server stopped; requests still open got an error event"
        raise
    finally:
        sock.close()


def _folder_name(path: str) -> str:
    from pathlib import Path

    return Path(path).name or str(path)
