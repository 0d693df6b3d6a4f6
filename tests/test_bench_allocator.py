"""bench.allocator: a child process measures RL-shaped steps; the comparison refuses settings it cannot compare."""

from __future__ import annotations

import pytest

from bench import allocator as bench_allocator


def test_a_child_times_sampling_and_training_of_every_step():
    args = bench_allocator.parse(["--preset", "cpu-small", "--prompts", "2", "--group", "2", "--prompt-len", "12",
                                  "--response-len", "8", "--steps", "2", "--warm", "1", "--child", "default"])
    result = bench_allocator.run_child(args)
    assert result["applied"] is False  # the baseline leaves glibc as it is
    assert len(result["steps"]) == 2
    assert all(s["sample"] > 0 and s["train"] > 0 and s["faults"] >= 0 for s in result["steps"])


@pytest.mark.parametrize("argv", [["--steps", "2", "--warm", "2"], ["--rounds", "0"], ["--group", "0"]])
def test_settings_that_measure_nothing_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        bench_allocator.parse(argv)
    assert "--steps must exceed --warm" in capsys.readouterr().err
