"""bench.serve end to end on a tiny run: its three processes (server, clients, offline baseline) and its table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_tiny_run_serves_every_request_and_prints_both_ratios():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "bench.serve", "--prompts", "4", "--clients", "1,2",
                           "--max-tokens", "8", "--rounds", "1"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("offline generate, batch 4:") for line in lines)
    rows = {int(cols[0]): cols for line in lines if (cols := line.split()) and cols[0] in ("1", "2")}
    assert set(rows) == {1, 2}
    for cols in rows.values():
        # tok/s > 0 (every request answered with its 8 tokens), the ratios vs offline batch and vs one client, the
        # client process's CPU
        assert float(cols[1]) > 0 and cols[-3].endswith("x") and cols[-2].endswith("x") and cols[-1].endswith("%")
    assert rows[1][-2] == "1.00x"


def test_the_serving_bench_model_writes_only_ids_its_tokenizer_can_decode():
    """Above the demo tokenizer's vocabulary a random head picks ids with no text (no time to the first streamed
    text could be measured); the serving bench's model zeroes those rows and keeps the head's shape."""
    import torch

    from bench.sampler import build_adapter as random_adapter
    from bench.serve import build_adapter
    from sample.generate import generate
    from sample.params import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, block_size=4, denoising_steps=4, ignore_eos=True,
                            stop_token_ids=[])
    prompts = [[5, 17, 33, 40, 2], [9, 8, 7]]
    served = build_adapter("cpu-4096", "cpu", torch.float32, 4)
    n = len(served.tokenizer)
    head = served.model.get_output_embeddings().weight
    assert head.shape[0] == 4096 > n and not head[n:].any() and head[:n].abs().min() > 0
    ids = [t for r in generate(served, prompts, params, progress=False) for t in r.response_ids]
    assert len(ids) == 32 and max(ids) < n
    plain = [t for r in generate(random_adapter("cpu-4096", "cpu", torch.float32, 4), prompts, params,
                                 progress=False) for t in r.response_ids]
    assert max(plain) >= n  # the plain random head does pick ids past the tokenizer
