"""bench.sampler --group: the RL-shaped comparison really measures shared against per-copy prefills."""

from __future__ import annotations

import argparse

from bench import sampler as bench_sampler


def test_group_comparison_prefills_each_prompt_once_against_every_copy(monkeypatch, capsys):
    from sample.block_runners import CachedRunner

    prefilled: list[int] = []
    prefill = CachedRunner._prefill
    monkeypatch.setattr(CachedRunner, "_prefill",
                        lambda self, chunk: prefilled.append(len(chunk)) or prefill(self, chunk))
    args = argparse.Namespace(device="cpu", preset="cpu-small", dtype=None, block_size=4, steps=2, batch=8, group=4,
                              max_tokens=8, max_active=None, rounds=1)
    bench_sampler.compare_group_prefill(args)
    # warm-up (shared), then one round: per-copy first, shared second; 2 prompts x 4 copies, all admitted at once
    assert prefilled == [2, 8, 2]
    out = capsys.readouterr().out
    assert "2 prompts x 4 samples" in out and "shared / every copy:" in out
    forwards = [line.split()[-3] for line in out.splitlines() if line.startswith(("every copy", "shared by"))]
    assert len(forwards) == 2 and forwards[0] == forwards[1]  # the same forwards: only the prefill differs


def test_the_hardware_line_says_which_way_cpu_bf16_goes(monkeypatch):
    from bench import hardware_line

    for native, says in ((True, ", native bf16 products"),
                         (False, ", no native bf16 products (bf16 autocast runs fp32)")):
        monkeypatch.setattr("models.layers.native_cpu_bf16", lambda native=native: native)
        assert hardware_line("cpu").endswith(says)
