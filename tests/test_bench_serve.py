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
