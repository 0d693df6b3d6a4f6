"""The serving bench's clients, a light process of their own (``bench.serve`` starts it once per concurrency level).

It imports no torch: it starts in a fraction of a second, where a process importing the bench module took ~10 s on
2 cores, once per level and round. Reads ``{"url", "prompts", "clients", "max_tokens"}`` as JSON on stdin and writes
``[per-request (seconds to the first text, seconds to the end, tokens), wall seconds, client CPU seconds]`` as JSON.

    echo '{"url": "http://127.0.0.1:8000", "prompts": ["Hi"], "clients": 1, "max_tokens": 8}' \
        | python -m bench.serve_client
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class Connection:
    """One keep-alive HTTP/1.1 connection that posts JSON and reads a chunked SSE answer, on asyncio's streams: a
    load generator as light as it can be, since on a small machine its CPU comes out of the server's cores. For 32
    streamed chat requests of 64 tokens (~640 events) it takes 0.026 s of CPU where httpx's async client took
    0.11 s (2 cores, three rounds each)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_stream(self, path: str, body: dict) -> AsyncIterator[bytes]:
        """The ``data:`` payloads of the server-sent events answering a POST of ``body``."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        payload = json.dumps(body).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json"
                          f"\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status = head.split(" ", 2)[1]
        if status != "200" or "transfer-encoding: chunked" not in head.lower():
            raise RuntimeError(f"the server answered {head.splitlines()[0]!r}, not a chunked 200")
        pending = b""
        while size := int((await self.reader.readuntil(b"\r\n"))[:-2], 16):
            pending += (await self.reader.readexactly(size + 2))[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    yield event[6:]
        await self.reader.readexactly(2)  # the empty chunk's line end

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()


async def one_request(conn: Connection, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first streamed text, seconds to the end, completion tokens) of one streaming chat."""
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    start, first, tokens = time.perf_counter(), None, 0
    async for data in conn.post_stream("/v1/chat/completions", body):
        if data == b"[DONE]":
            continue
        chunk = json.loads(data)
        if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
            first = time.perf_counter() - start
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    return first if first is not None else float("nan"), time.perf_counter() - start, tokens


async def client_load(url: str, prompts: list[str], clients: int, max_tokens: int) -> tuple[list, float, float]:
    """``clients`` concurrent clients (one event loop, a connection each) share the prompts; every request's
    timings, the wall time and the CPU seconds the clients took."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    todo = iter(prompts)
    results: list[tuple[float, float, int]] = []

    async def client_loop() -> None:
        conn = Connection(host, port)
        try:
            for prompt in todo:  # one event loop: no lock needed between the clients
                results.append(await one_request(conn, prompt, max_tokens))
        finally:
            await conn.close()

    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return results, time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    job = json.load(sys.stdin)
    json.dump(asyncio.run(client_load(job["url"], job["prompts"], job["clients"], job["max_tokens"])), sys.stdout)


if __name__ == "__main__":
    main()
