"""bench.gpu's own code on the CPU (``--quick``): a GPU session should find its measuring code working, not debug it
on the clock. The smoke section (processes of the real entry points) is left to the GPU run."""

from __future__ import annotations

import json

import pytest

from bench import gpu


def test_quick_cpu_run_measures_every_section_but_the_smoke_runs(tmp_path):
    out = tmp_path / "bench_gpu.json"
    rc = gpu.main(["--quick", "--device", "cpu", "--sections", "sampler,fuse,training,moe,attention",
                   "--batches", "1,3", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    sampler = result["sampler"]
    assert {(r["strategy"], r["batch"]) for r in sampler} == {(s, b) for s in ("static", "dynamic") for b in (1, 3)}
    assert all(r["tok_s"] > 0 and r["cold_tok_s"] > 0 and 0 < r["forwards_per_token"] <= 2 for r in sampler)
    assert all(r["graphs_tok_s"] > 0 and "graphs_error" not in r for r in sampler)  # the static path, eager on CPU
    assert [r["batch"] for r in result["fuse"]] == [1, 3]
    assert all(r["fused_over_separate"] == pytest.approx(r["fused_tok_s"] / r["separate_tok_s"])
               for r in result["fuse"])
    assert [r["attention"] for r in result["training"]] == ["sdpa"] and "error" not in result["training"][0]
    moe = result["moe"]
    assert [r["tokens"] for r in moe] == [4, 128, 512]
    assert all(r["max_diff"] < 1e-4 and r["host_syncs_per_forward"] is None for r in moe)  # fp32 on CPU
    attention = result["attention"]
    assert [(r["batch"], r["keys"]) for r in attention] == [(3, 32), (3, 64)]
    # the folded heads (what attend runs on CPU and CUDA) give the enable_gqa path's values (fp32)
    assert all(r["max_diff"] < 1e-5 and min(r["gqa_ms"], r["folded_ms"], r["no_mask_ms"]) > 0 for r in attention)
    assert "smoke" not in result


def test_an_unknown_section_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--quick", "--device", "cpu", "--sections", "sampler,warp"])
    assert "unknown section(s) ['warp']" in capsys.readouterr().err


def test_the_profile_section_writes_where_the_time_goes(tmp_path):
    out = tmp_path / "bench_gpu.json"
    assert gpu.main(["--quick", "--device", "cpu", "--sections", "profile", "--batches", "1,3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["profile"]
    assert [(r["mode"], r["batch"]) for r in rows] == [("eager", 3), ("graphs", 3)]
    assert all(r["tokens"] == 3 * 16 and r["wall_s"] > 0 and r["top_ms"] for r in rows)
    assert all(r["device_busy_s"] is None and r["host_syncs"] is None for r in rows)  # CUDA-only figures
    for mode in ("eager", "graphs"):
        assert "Self CPU" in (tmp_path / f"bench_gpu.profile_{mode}.txt").read_text()


def test_the_serve_section_reads_bench_serve_figures(tmp_path):
    out = tmp_path / "bench_gpu.json"
    assert gpu.main(["--quick", "--device", "cpu", "--sections", "serve", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["serve"]
    assert [r["clients"] for r in rows] == [1, 2]
    assert all(r["tok_s"] > 0 and r["offline_batch_tok_s"] > 0 for r in rows)
    assert all(r["vs_batch"] == pytest.approx(r["tok_s"] / r["offline_batch_tok_s"]) for r in rows)
    assert rows[0]["vs_one_client"] == 1.0


def test_a_hung_run_is_a_failed_row_not_the_end_of_the_acceptance_run():
    import sys

    proc = gpu._run([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"], timeout=2)
    assert proc.returncode != 0 and proc.stderr == "timed out after 2 s" and "started" in proc.stdout


@pytest.mark.parametrize("choice", ["off", "on"])
def test_fold_query_heads_switches_the_decode_attention_of_the_sampler_rows(choice, tmp_path, monkeypatch):
    from models import common

    monkeypatch.setitem(common.FOLD_QUERY_HEADS, "cpu", choice == "off")  # start from the other setting
    folded = []
    fold = common._grouped_query_attention
    monkeypatch.setattr(common, "_grouped_query_attention", lambda *a: folded.append(1) or fold(*a))
    out = tmp_path / "bench_gpu.json"
    assert gpu.main(["--quick", "--device", "cpu", "--sections", "sampler", "--batches", "3",
                     "--fold-query-heads", choice, "--out", str(out)]) == 0
    assert json.loads(out.read_text())["fold_query_heads"] is (choice == "on")
    assert common.FOLD_QUERY_HEADS["cpu"] is (choice == "on")
    assert bool(folded) is (choice == "on")  # the tiny shape has 2 query heads per K/V head
