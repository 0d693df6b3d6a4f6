"""Multi-process training on CPU through `accelerate launch` (DDP and DeepSpeed ZeRO-3), plus the configs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.conftest import onednn_runs_bf16

# training.mixed_precision=bf16 on the CPU: the children run bf16 wherever oneDNN can (DLLM_CPU_BF16=1 below, so the
# bf16 path is tested on CPUs that multiply bf16 by conversion too), else float32 ("no")
CPU_BF16 = "bf16" if onednn_runs_bf16() else "no"

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "accelerate_configs"
SCRIPT = ROOT / "tests" / "dist_step.py"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "DLLM_DS_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["DLLM_CPU_BF16"] = "1" if CPU_BF16 == "bf16" else "0"
    return env


def _run(cmd: list[str], out: Path, label: str) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    print(f"{label}: {time.perf_counter() - t0:.1f} s wall")
    assert proc.returncode == 0, f"{label} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(out.read_text())
    print(f"{label}: {result}")
    return result


def _launch(config: str, tmp_path: Path, world: int = 2) -> dict:
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
           "--main_process_port", str(_free_port()), str(SCRIPT), "--world", str(world), "--out", str(out)]
    return _run(cmd, out, config)


def test_single_process_without_launcher_bf16(tmp_path):
    out = tmp_path / "result.json"
    r = _run([sys.executable, str(SCRIPT), "--world", "1", "--out", str(out), "--mixed_precision", "bf16"],
             out, "no launcher")
    assert r["num_processes"] == 1 and r["distributed_type"] == "DistributedType.NO"
    assert r["mixed_precision"] == CPU_BF16  # float32 where the CPU has no native bf16 products
    assert r["max_update"] > 1e-3 and r["cos_vs_reference"] > 0.95  # bf16 autocast vs an fp32 replay


@pytest.mark.slow
def test_ddp_two_processes_cpu(tmp_path):
    r = _launch("cpu_ddp_2proc.yaml", tmp_path)
    assert r["num_processes"] == 2 and r["distributed_type"] == "DistributedType.MULTI_CPU"
    assert r["losses"][0] != r["losses"][1]  # ranks saw different batches ...
    assert r["identical_across_ranks"] and r["init_matches_seed"]  # ... yet end with the same weights
    assert r["max_update"] > 1e-3
    # The step equals a single-process step on the mean loss (fp32: exact up to float noise).
    assert r["max_diff_vs_reference"] < 1e-5 and r["cos_vs_reference"] > 0.9999


@pytest.mark.slow
def test_deepspeed_zero3_two_processes_cpu(tmp_path):
    r = _launch("cpu_zero3_2proc.yaml", tmp_path)
    assert r["num_processes"] == 2 and r["distributed_type"] == "DistributedType.DEEPSPEED"
    assert r["mixed_precision"] == CPU_BF16
    assert r["losses"][0] != r["losses"][1]
    assert r["identical_across_ranks"] and r["init_matches_seed"]
    assert r["max_update"] > 1e-3
    # bf16 weights vs an fp32 replay: same update direction (unsynchronised ranks would give ~0.5).
    assert r["cos_vs_reference"] > 0.95


def test_accelerate_configs_are_generated_and_valid():
    from accelerate.commands.config.config_args import ClusterConfig

    from tools import accelerate_config

    expected = accelerate_config.configs()
    on_disk = {p.name for p in CONFIGS.glob("*.yaml")}
    assert on_disk == set(expected), "run `python -m tools.accelerate_config`"
    for name, text in expected.items():
        assert (CONFIGS / name).read_text() == text, f"{name} is stale: run python -m tools.accelerate_config"
        cfg = ClusterConfig.from_yaml_file(str(CONFIGS / name))  # accelerate's own loader (rejects bad keys)
        raw = yaml.safe_load(text)
        assert raw["use_cpu"] is False
        if name.startswith("cpu_"):
            assert cfg.num_processes == 2 and cfg.num_machines == 1
            continue
        assert cfg.mixed_precision == "bf16"
        if name.endswith("ddp.yaml"):
            nodes = 1 if name == "ddp.yaml" else int(name.split("_")[0])
            assert cfg.distributed_type.value == "MULTI_GPU"
            assert (cfg.num_machines, cfg.num_processes) == (nodes, 8 * nodes)
            continue
        nodes, stage = int(name.split("_")[0]), int(name.split("zero")[1][0])
        ds = cfg.deepspeed_config
        assert cfg.distributed_type.value == "DEEPSPEED"
        assert (cfg.num_machines, cfg.num_processes) == (nodes, 8 * nodes)
        assert ds["zero_stage"] == stage and ds["gradient_clipping"] == 1.0
        assert "gradient_accumulation_steps" not in ds  # "auto": the training script's value wins
        want = "cpu" if name.endswith("_offload.yaml") else "none"
        assert ds["offload_optimizer_device"] == ds["offload_param_device"] == want
        assert ds.get("zero3_init_flag", False) is (stage == 3)
        assert ds.get("zero3_save_16bit_model", False) is (stage == 3)
    for nodes in accelerate_config.NODES:
        for stage in (2, 3):
            for suffix in ("", "_offload"):
                assert f"{nodes}_node_8_gpus_deepspeed_zero{stage}{suffix}.yaml" in expected


def test_assert_world_size():
    from tests.launched import assert_world_size

    assert_world_size(SimpleNamespace(num_processes=2, distributed_type="MULTI_CPU"), 2)
    with pytest.raises(RuntimeError, match="expected 2 processes but accelerate sees 1"):
        assert_world_size(SimpleNamespace(num_processes=1, distributed_type="NO"), 2)


def test_the_config_writer_takes_no_options_and_refuses_them_before_writing(capsys, monkeypatch, tmp_path):
    """``--nodes 4`` (or any option) must not rewrite the committed configs as if nothing was asked."""
    import tools.accelerate_config as writer

    monkeypatch.setattr(writer, "CONFIG_DIR", tmp_path)
    with pytest.raises(SystemExit) as refused:
        writer.main(["--nodes", "4"])
    assert refused.value.code == 2 and "unrecognized arguments: --nodes 4" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    writer.main([])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(writer.configs())
