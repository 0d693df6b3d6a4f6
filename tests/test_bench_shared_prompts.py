"""bench.shared_prompts: its records decode like the sampler's, and its three sides really differ in what they share."""

from __future__ import annotations

import argparse

from bench import shared_prompts as bench_shared


def test_records_are_groups_of_one_prompt_decoded_block_by_block():
    args = argparse.Namespace(prompts=2, group=3, prompt_len=10, response_len=9, block=4)
    trajs = bench_shared.trajectories(args, vocab=512)
    assert [t.group_id for t in trajs] == ["0"] * 3 + ["1"] * 3
    assert all(t.prompt_ids == trajs[0].prompt_ids for t in trajs[:3]) and trajs[0].prompt_ids != trajs[3].prompt_ids
    for t in trajs:
        assert len(t.response_ids) == 9 and len(t.prompt_ids) + 9 + len(t.tail_ids) == 20  # ends on a block edge
        steps = t.step_map + t.tail_steps
        # blocks at absolute positions: 2 response tokens finish the prompt's block, then blocks of 4
        blocks = [steps[:2], steps[2:6], steps[6:10]]
        assert all(1 <= len(set(b)) <= len(b) for b in blocks)
        assert all(max(a) < min(b) for a, b in zip(blocks, blocks[1:]))  # a block starts after the last one ended
        assert sorted(set(steps)) == list(range(1, len(set(steps)) + 1))  # global steps, none skipped


def test_the_shared_side_forwards_each_prompt_once(monkeypatch, capsys):
    import train.trainer
    calls: list[int] = []
    hidden = train.trainer.shared_prefix_hidden
    monkeypatch.setattr(train.trainer, "shared_prefix_hidden",
                        lambda model, plan, n: calls.append(len(plan.prefix_ids)) or hidden(model, plan, n))
    bench_shared.main(["--preset", "cpu-small", "--prompts", "2", "--group", "4", "--prompt-len", "20",
                       "--response-len", "8", "--rounds", "1", "--mixed-precision", "no", "--micro", "4"])
    # 8 rows in micro-batches of 4: the log-probs of the first micro-batch (one prompt), then a step with the rows
    # shuffled over both prompts (each micro-batch forwards both), then one a prompt at a time (one each); the
    # unshared side forwards no prefix
    assert calls == [1, 2, 2, 1, 1]
    out = capsys.readouterr().out
    diff = float(out.split("max |difference| ")[1].split()[0])
    assert diff < 1e-4  # fp32: the two paths agree to rounding
    assert "shared prompts vs every row its own:" in out
