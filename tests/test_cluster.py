"""Multi-node launch from the environment, and evaluation / RL across processes (two "nodes" on loopback)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from safetensors.torch import load_file

from jobs.cluster import ClusterError, first_slurm_host, launch_command, node_env
from models.tiny import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = {"NODE_RANK": "1", "NNODES": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29501"}


@pytest.mark.parametrize("env,want", [
    ({"MLP_ROLE_INDEX": "0", "MLP_WORKER_NUM": "4", "MLP_WORKER_0_HOST": "h0", "MLP_WORKER_0_PORT": "8888"},
     (0, 4, "h0", 8888, "MLP_*")),
    (TORCHRUN, (1, 2, "10.0.0.5", 29501, "torchrun")),
    ({"SLURM_NODEID": "2", "SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "gpu[07-09]"}, (2, 3, "gpu07", 29500, "SLURM")),
    ({"SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[03-04]", "MASTER_PORT": "12345",
      "MASTER_ADDR": "gpu03-ib"}, (1, 2, "gpu03-ib", 12345, "SLURM")),  # what SLURM scripts export: not torchrun's
    ({"SLURM_NODEID": "0", "SLURM_NNODES": "2", "MASTER_ADDR": "10.1.0.1"}, (0, 2, "10.1.0.1", 29500, "SLURM")),
])
def test_node_env_from_each_scheme(env, want):
    n = node_env(env)
    assert (n.node_rank, n.num_nodes, n.master_addr, n.master_port, n.source) == want


@pytest.mark.parametrize("env,msg", [
    ({}, "no multi-node environment"),
    ({"NODE_RANK": "0", "NNODES": "2"}, "MASTER_ADDR, MASTER_PORT missing"),
    ({**TORCHRUN, "NODE_RANK": "2"}, "node rank 2 is outside [0, 2)"),
    ({**TORCHRUN, "NNODES": "two"}, "NNODES='two' is not an integer"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, "master port 70000"),
    ({"SLURM_NODEID": "0", "SLURM_NNODES": "2"}, "SLURM_JOB_NODELIST (or MASTER_ADDR) missing"),
])
def test_bad_environments_are_one_line_errors(env, msg):
    with pytest.raises(ClusterError, match=msg.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        node_env(env)


def test_slurm_host_lists():
    assert first_slurm_host("gpu[03-05,07],cpu1") == "gpu03" and first_slurm_host("nodeA,nodeB") == "nodeA"


def test_launch_command_is_the_same_on_every_node_but_the_rank():
    cmds = [launch_command("rl.py", ["config=x.yaml"], node_env({**TORCHRUN, "NODE_RANK": str(r)}),
                           "2_node_8_gpus_deepspeed_zero3", 2) for r in (0, 1)]
    assert cmds[0][cmds[0].index("--machine_rank") + 1] == "0" and cmds[1][cmds[1].index("--machine_rank") + 1] == "1"
    strip = [[a for i, a in enumerate(c) if c[i - 1] != "--machine_rank"] for c in cmds]
    assert strip[0] == strip[1]
    c = cmds[0]
    assert c[c.index("--num_processes") + 1] == "16" and c[c.index("--main_process_ip") + 1] == "10.0.0.5"
    with pytest.raises(ClusterError, match="experiment.num_node is 4"):
        launch_command("rl.py", [], node_env(TORCHRUN), None, 4)
    for bad in ("8x", "0"):
        with pytest.raises(ClusterError, match="NPROC_PER_NODE"):
            launch_command("rl.py", [], node_env(TORCHRUN), None, 2, env={"NPROC_PER_NODE": bad})


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACCELERATE_", "RL_HARNESS")) and k not in ("NODE_RANK", "NNODES", "MASTER_ADDR",
                                                                            "MASTER_PORT", "SLURM_NODEID")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)
    return env


def test_multinode_entry_reports_a_bad_environment_in_one_line():
    proc = subprocess.run([sys.executable, "multinode_eval.py", "config=configs/demo/eval_demo.yaml",
                           "experiment.num_node=2"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=_env(NODE_RANK="0", NNODES="2"))
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "MASTER_ADDR" in lines[0]


def _two_nodes(script_args: list[str], script: str | None = None, **extra: str) -> list[subprocess.Popen]:
    from tests.test_train_distributed import _free_port

    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = _env(NODE_RANK=str(rank), NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NPROC_PER_NODE="1",
                   **extra)
        if script is None:
            cmd = [sys.executable, "multinode_eval.py", *script_args]
        else:  # the RL harness, launched exactly as multinode_rl.py launches rl.py
            from jobs.cluster import launch_command

            cmd = launch_command(script, script_args, node_env(env), "cpu_ddp_2proc", 2, env)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs


def _wait(procs) -> None:
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-2000:] + err[-4000:]


@pytest.mark.slow
def test_two_node_eval_equals_single_process(tmp_path, demo_tokenizer):
    model = save_tiny_checkpoint(tmp_path / "m", "sdar", demo_tokenizer, size="test")
    common = ["config=configs/demo/eval_demo.yaml", f"model.pretrained_model={model}", "rollout.temperature=0",
              "rollout.max_token=8", "rollout.num_response_per_task=2", f"experiment.output_dir={tmp_path}"]
    single = subprocess.run([sys.executable, "eval.py", *common, "experiment.project=one"], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    _wait(_two_nodes([*common, "experiment.project=two", "experiment.num_node=2",
                      "experiment.deepspeed_file=cpu_ddp_2proc"]))
    name = "trajectories-builtin_arithmetic.jsonl"
    one = [json.loads(x) for x in (tmp_path / "one" / name).read_text().splitlines()]
    two = [json.loads(x) for x in (tmp_path / "two" / name).read_text().splitlines()]
    key = ("sample_id", "task_index", "response_ids", "step_map", "score")
    assert len(one) == 128 and [[t[k] for k in key] for t in one] == [[t[k] for k in key] for t in two]
    r1 = json.loads((tmp_path / "one" / "results.jsonl").read_text())
    r2 = json.loads((tmp_path / "two" / "results.jsonl").read_text())
    assert (r1["acc"], r1["responses"], r1["avg_length"]) == (r2["acc"], r2["responses"], r2["avg_length"])


@pytest.mark.slow
def test_two_node_rl_keeps_both_nodes_identical(tmp_path, demo_tokenizer):
    from tests.test_rl import demo_args

    model = save_tiny_checkpoint(tmp_path / "m", "sdar", demo_tokenizer, size="test")
    args = demo_args(tmp_path, model, **{"experiment.total_step": 2, "experiment.save_every": 2,
                                         "experiment.num_node": 2, "rollout.num_task_per_step": 4})
    _wait(_two_nodes(args, script="tests/rl_harness.py", RL_HARNESS_DUMP=str(tmp_path / "w")))
    ranks = [json.loads((tmp_path / f"w.{r}.json").read_text()) for r in (0, 1)]
    assert all(r["num_processes"] == 2 for r in ranks) and ranks[0]["digest"] == ranks[1]["digest"]
    start = load_file(str(model / "model.safetensors"))
    end = load_file(str(tmp_path / "run" / "step_2" / "ckpt" / "policy" / "model.safetensors"))
    assert max(float((start[k] - end[k]).abs().max()) for k in start) > 1e-4
    rollouts = [json.loads(x) for x in (tmp_path / "run" / "step_2" / "rollouts.jsonl").read_text().splitlines()]
    assert len({r["sample_id"] for r in rollouts}) == 16


@pytest.mark.parametrize("file,error", [
    ("2_node_8_gpus_ddp", "2_node_8_gpus_ddp.yaml launches 2 machines but experiment.num_node is 1"),
    ("no_such_file", "does not exist (choose a file of"),
])
def test_a_single_node_relaunch_refuses_a_file_it_cannot_run(file, error):
    """A 2-machine accelerate file on one node would wait for the second machine for ever."""
    from core.loader import ConfigError
    from jobs.cluster import relaunch_if_requested
    from jobs.config import load_config

    cfg = load_config(["config=configs/demo/eval_demo.yaml", f"experiment.deepspeed_file={file}"], "eval")
    with pytest.raises(ConfigError, match=re.escape(error)):
        relaunch_if_requested(cfg, "eval.py", [])


@pytest.mark.parametrize("script,kind,config", [("rl.py", "rl", "configs/demo/rl_demo.yaml"),
                                                ("eval.py", "eval", "configs/demo/eval_demo.yaml")])
def test_a_missing_model_folder_is_refused_before_any_process_is_launched(tmp_path, script, kind, config):
    """A mistyped path under a DeepSpeed file: one line from this process, not one from each launched rank."""
    from jobs.cluster import relaunch_if_requested
    from jobs.config import load_config
    from models.errors import ModelLoadError

    missing = tmp_path / "TraDo-4B-Instruct"
    cfg = load_config([f"config={config}", f"model.pretrained_model={missing}", "model.init_tiny_if_missing=false",
                       "experiment.deepspeed_file=1_node_8_gpus_deepspeed_zero3"], kind, stream=io.StringIO())
    with pytest.raises(ModelLoadError, match=f"model.pretrained_model '{missing}' is not a folder with a config.json"):
        relaunch_if_requested(cfg, script, [])
    if kind == "rl":  # a resumed run loads its own checkpoint: the folder it started from may be gone
        cfg.experiment.start_from_scratch = False
        with pytest.raises(SystemExit, match="execv"), mock.patch("os.execv", side_effect=SystemExit("execv")):
            relaunch_if_requested(cfg, script, [])
    cfg = load_config([f"config={config}", "experiment.deepspeed_file=1_node_8_gpus_deepspeed_zero3"], kind,
                      stream=io.StringIO())
    if kind == "rl":  # the value model started from the demo policy's folder, which the job builds first
        cfg.model.value_base_model = cfg.model.pretrained_model
    with pytest.raises(SystemExit, match="execv"), mock.patch("os.execv", side_effect=SystemExit("execv")):
        relaunch_if_requested(cfg, script, [])  # a demo path: built on demand by the launched job
    if kind == "eval":
        cfg.model.adapter = str(tmp_path)
        with pytest.raises(ModelLoadError, match=f"model.adapter: {tmp_path} is not a LoRA adapter folder"):
            relaunch_if_requested(cfg, script, [])


def test_model_folders_are_checked_where_the_job_reads_them(tmp_path, monkeypatch):
    """A relative model path is read from system.base_dir (the job moves there first): the check looks there too, so
    the shipped multinode configs (base_dir /shared/dLLM-RL, model JetLM/SDAR-4B-Chat) pass from any directory."""
    from jobs.cluster import check_model_folders
    from jobs.config import load_config
    from models.errors import ModelLoadError

    base = tmp_path / "shared"
    (base / "ckpt" / "policy").mkdir(parents=True)
    (base / "ckpt" / "policy" / "config.json").write_text("{}")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cfg = load_config(["config=configs/demo/rl_demo.yaml", "model.pretrained_model=ckpt/policy",
                       "model.init_tiny_if_missing=false", f"system.base_dir={base}"], "rl", stream=io.StringIO())
    monkeypatch.chdir(elsewhere)
    check_model_folders(cfg)  # ckpt/policy under base_dir: found, though not under the current directory
    cfg.model.value_base_model = "ckpt/value"
    with pytest.raises(ModelLoadError, match=re.escape(f"model.value_base_model '{base / 'ckpt' / 'value'}' is not a")):
        check_model_folders(cfg)
