"""Serving throughput and latency: 1, 8 and 32 concurrent streaming clients vs offline batched ``generate``.

    python -m bench.serve                              # tiny SDAR model on CPU (hidden 128, 4 layers, demo vocab)
    python -m bench.serve --preset cpu --max-tokens 128
    python -m bench.serve --device cuda --preset 1.7b --prompts 64 --clients 1,8,32,64

Prints the hardware first. The same ``--prompts`` chat prompts are sampled (1) offline by one ``generate`` call
(batch = all prompts) and one prompt at a time, and (2) through ``serve.py``'s app on 127.0.0.1 by C concurrent
clients, each sending streaming chat requests (raw SSE over HTTP/1.1 on asyncio's streams) for the next prompt until
all are answered.
Responses have a fixed length (no stop tokens) so every variant generates the same number of tokens; greedy.
Per level: tokens/s over the level's wall time, and per request p50 / p95 of the time to the first streamed text
and to the end (of the round with the best throughput; ``--rounds`` interleaved rounds, best of each variant).
Then the ratios against offline batch and against one client, and the CPU the client process took (percent of one
core over the level's wall time: what clients elsewhere would leave to the server).

Three processes, as in use: the server (the engine driven on its main thread, HTTP on another, as serve.py runs
them), the clients (``bench.serve_client``, no torch: one event loop; their HTTP and JSON work never holds the
server's interpreter lock) and this one, which runs the offline baseline with no server inside it (an idle engine
thread in the same process made offline ``generate`` up to 1.5x slower on 2 cores: see jobs/serve_engine.py on
OpenMP teams). On a small machine the clients still share the server's cores (clients elsewhere would not).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import hardware_line
from bench.sampler import PRESETS
from bench.sampler import build_adapter as build_random_adapter
from jobs.serve import build_app, serve_until_closed
from jobs.serve_engine import ServeEngine
from sample.generate import generate
from sample.params import SamplingParams

REPO = Path(__file__).resolve().parents[1]


def build_adapter(preset: str, device: str, dtype: torch.dtype, block_size: int):
    """The preset's random SDAR model with its LM head's rows past the demo tokenizer's vocabulary zeroed.

    The larger presets keep their real vocabulary (151,936 at ``1.7b``: the head's cost is part of what is served),
    but a random head would mostly pick ids the demo tokenizer has no text for, and a response whose text stays
    empty until its end has no time to the first streamed text. With those rows at 0 their logits are 0 and greedy
    decoding picks a decodable id (some of the others are positive); the head's shape and cost are unchanged."""
    adapter = build_random_adapter(preset, device, dtype, block_size)
    with torch.no_grad():
        adapter.model.get_output_embeddings().weight[len(adapter.tokenizer):] = 0
    return adapter


def prompts_for(n: int) -> list[str]:
    return [f"Compute {a} + {b} and explain each step." for a, b in ((i // 10, i % 10) for i in range(n))]


def offline(adapter, prompts: list[str], params: SamplingParams, batch: int) -> float:
    """Tokens/s of ``generate`` over ``prompts``, ``batch`` prompts per call."""
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        tokens += sum(len(t.response_ids) for t in generate(adapter, prompts[i:i + batch], params, progress=False))
    return tokens / (time.perf_counter() - start)


def served(url: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    """One concurrency level: ``clients`` clients in another process (as real clients are: their HTTP and JSON work
    does not hold the server's interpreter lock) share the prompts; throughput and latency percentiles. The clients'
    process is ``bench.serve_client``: it imports no torch, so it starts in a fraction of a second."""
    job = json.dumps({"url": url, "prompts": prompts, "clients": clients, "max_tokens": max_tokens})
    done = subprocess.run([sys.executable, "-m", "bench.serve_client"], input=job, capture_output=True, text=True,
                          cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"the client process failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    results, wall, client_cpu = json.loads(done.stdout)
    ttft, total = sorted(r[0] for r in results), sorted(r[1] for r in results)
    return {"clients": clients, "tok_s": sum(r[2] for r in results) / wall, "ttft_p50": _pct(ttft, 50),
            "ttft_p95": _pct(ttft, 95), "end_p50": _pct(total, 50), "end_p95": _pct(total, 95),
            "client_cpu": client_cpu / wall}


def _server_process(args, params: SamplingParams, max_batch: int, conn) -> None:
    """The server: the bench model behind serve.py's app; the engine runs on this process's main thread until the
    parent sends anything (or goes away)."""
    import threading

    if args.threads:
        torch.set_num_threads(args.threads)
    adapter = build_adapter(args.preset, args.device, getattr(torch, args.dtype), args.block_size)
    engine = ServeEngine(adapter, params, max_batch=max_batch, max_queue=4 * max_batch, driver_thread=False)

    def stop_when_told() -> None:
        with contextlib.suppress(EOFError):
            conn.recv()
        engine.close()

    def ready(url: str) -> None:
        conn.send(url)
        threading.Thread(target=stop_when_told, daemon=True).start()

    serve_until_closed(engine, build_app(engine, "bench"), on_ready=ready)


@contextlib.contextmanager
def server_process(args, params: SamplingParams, max_batch: int):
    """A server process for the bench model; yields its base URL."""
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_server_process, args=(args, params, max_batch, theirs), daemon=True)
    proc.start()
    try:
        try:
            if not mine.poll(300):
                raise EOFError
            url = mine.recv()
        except EOFError:
            raise RuntimeError(f"the server process did not start (exit {proc.exitcode})") from None
        yield url
    finally:
        with contextlib.suppress(OSError):
            mine.send("stop")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each variant is shown")
    ap.add_argument("--json", default=None, help="also write the figures here (bench.gpu's serve section reads it)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(hardware_line(args.device))
    adapter = build_adapter(args.preset, args.device, getattr(torch, args.dtype), args.block_size)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, block_size=args.block_size,
                            denoising_steps=args.block_size, ignore_eos=True, stop_token_ids=[],
                            max_active=args.prompts)
    prompts = prompts_for(args.prompts)
    levels = [int(c) for c in args.clients.split(",")]
    batch_runs, loop_runs, level_runs = [], [], {c: [] for c in levels}
    with server_process(args, params, max(levels + [args.prompts])) as url:
        offline(adapter, prompts, params, len(prompts))  # warm-up: every batch shape once
        served(url, prompts, max(levels), args.max_tokens)
        for _ in range(args.rounds):  # interleaved rounds, best of each: the machine's load drifts
            batch_runs.append(offline(adapter, prompts, params, len(prompts)))
            loop_runs.append(offline(adapter, prompts, params, 1))
            for c in levels:
                level_runs[c].append(served(url, prompts, c, args.max_tokens))
    batch_tok_s, loop_tok_s = max(batch_runs), max(loop_runs)
    rows = [max(level_runs[c], key=lambda r: r["tok_s"]) for c in levels]
    print(f"\n{args.prompts} prompts x {args.max_tokens} tokens, {args.preset}, block {args.block_size}, "
          f"{args.block_size} steps per block, greedy")
    print(f"offline generate, batch {args.prompts}: {batch_tok_s:9.1f} tok/s")
    print(f"offline generate, one at a time: {loop_tok_s:9.1f} tok/s\n")
    print(f"{'clients':>8}{'tok/s':>10}{'first p50':>11}{'first p95':>11}{'end p50':>10}{'end p95':>10}"
          f"{'vs batch':>10}{'vs 1 client':>13}{'client CPU':>12}")
    one = next((r["tok_s"] for r in rows if r["clients"] == 1), rows[0]["tok_s"])
    for r in rows:
        r.update(vs_batch=r["tok_s"] / batch_tok_s, vs_one_client=r["tok_s"] / one)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"preset": args.preset, "device": args.device, "dtype": args.dtype, "prompts": args.prompts,
                       "max_tokens": args.max_tokens, "offline_batch_tok_s": batch_tok_s,
                       "offline_one_at_a_time_tok_s": loop_tok_s, "levels": rows}, out, indent=1)
    for r in rows:
        print(f"{r['clients']:>8}{r['tok_s']:>10.1f}{r['ttft_p50']:>10.3f}s{r['ttft_p95']:>10.3f}s"
              f"{r['end_p50']:>9.3f}s{r['end_p95']:>9.3f}s{r['vs_batch']:>9.2f}x{r['vs_one_client']:>12.2f}x"
              f"{100 * r['client_cpu']:>11.0f}%")


if __name__ == "__main__":
    main()
