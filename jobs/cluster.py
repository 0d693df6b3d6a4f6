"""How a job is launched under ``accelerate launch``: on one node (``relaunch_if_requested``: a config with
``experiment.deepspeed_file`` re-executes its script under the launcher), or on many (``multinode_main``).

Multi-node: every node runs the same command; its rank, the node count and the master address come from the
environment, and the job runs under ``accelerate launch`` with the matching multi-machine settings.

Recognised environments (first complete one wins, checked in this order):
* the reference's platform: ``MLP_ROLE_INDEX``, ``MLP_WORKER_NUM``, ``MLP_WORKER_0_HOST``, ``MLP_WORKER_0_PORT``;
* torchrun style: ``NODE_RANK``, ``NNODES``, ``MASTER_ADDR``, ``MASTER_PORT``;
* SLURM: ``SLURM_NODEID``, ``SLURM_NNODES``, ``MASTER_ADDR`` or the first host of ``SLURM_JOB_NODELIST``,
  ``MASTER_PORT`` or 29500 (a scheme is recognised by its rank and count variables, so SLURM scripts may export
  ``MASTER_ADDR`` / ``MASTER_PORT``).
Processes per node: ``NPROC_PER_NODE`` (default: the accelerate config's processes / machines). No ssh, no root.
Torch-free, so a bad environment is reported at once.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from core.entry import launched
from core.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PORT = 29500


class ClusterError(UserError, ValueError):
    """The environment does not describe a consistent multi-node launch."""


def check_single_node(cfg, command: str) -> None:
    """A multi-node config must be started on every node by its launcher (``command``, said in the error)."""
    from core.loader import ConfigError

    if cfg.experiment.num_node > 1 and not launched():
        raise ConfigError(f"key 'experiment.num_node' is {cfg.experiment.num_node}: start multi-node runs with "
                          f"`{command}` on every node", "experiment.num_node")


def relaunch_if_requested(cfg, script: str, argv: list[str]) -> None:
    """Every entry's last step before its job: refuse a mistyped model folder (one line naming its key, before any
    loading or launching; a launched process checks again, at the cost of a few file lookups); then, with
    ``experiment.deepspeed_file`` set and no launcher around us, exec ``accelerate launch`` of ``script``."""
    check_model_folders(cfg)
    if not cfg.experiment.deepspeed_file or launched():
        return
    from core.loader import ConfigError

    config = ROOT / "accelerate_configs" / f"{cfg.experiment.deepspeed_file}.yaml"
    if not config.is_file():
        raise ConfigError(f"key 'experiment.deepspeed_file': {config} does not exist (choose a file of "
                          f"{ROOT / 'accelerate_configs'})", "experiment.deepspeed_file")
    machines = accelerate_config_size(config)[1]
    if machines != cfg.experiment.num_node:  # accelerate would wait for the other machines for ever
        raise ConfigError(f"key 'experiment.deepspeed_file': {config.name} launches {machines} machines but "
                          f"experiment.num_node is {cfg.experiment.num_node}; choose a 1-node file, or start a "
                          "multi-node run with multinode_*.py on every node", "experiment.deepspeed_file")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(ROOT / script),
           *argv]
    print("launching: " + " ".join(cmd), flush=True)
    os.execv(cmd[0], cmd)


def check_model_folders(cfg) -> None:
    """Refuse a model folder a fresh run would load that holds no ``config.json`` (the check ``load_model`` makes,
    made before any process is launched). A resumed run loads its own checkpoint; a demo path is built on demand."""
    from jobs.config import is_demo_model_dir
    from models.errors import ModelLoadError, not_a_model_folder, not_an_adapter_folder

    if not getattr(cfg.experiment, "start_from_scratch", True):
        return
    model = cfg.model
    built = {model.pretrained_model} if model.init_tiny_if_missing else set()  # a demo path: built by the job
    for key in ("pretrained_model", "value_base_model", "adapter"):
        path = getattr(model, key, None)
        if not path or (path in built and is_demo_model_dir(path)):
            continue
        folder = cfg.system.resolve(path)  # relative paths are read from system.base_dir, where the job runs
        if key == "adapter" and not (folder / "adapter_config.json").is_file():
            raise ModelLoadError(f"model.adapter: {not_an_adapter_folder(folder)}")
        if key != "adapter" and not (folder / "config.json").is_file():
            raise ModelLoadError(not_a_model_folder(folder, f"model.{key}"))


def accelerate_config_size(path) -> tuple[int, int]:
    """(num_processes, num_machines) of an accelerate config file (1 where a key is absent)."""
    text = Path(path).read_text()
    procs = re.search(r"^num_processes:\s*(\d+)", text, re.M)
    machines = re.search(r"^num_machines:\s*(\d+)", text, re.M)
    return (int(procs.group(1)) if procs else 1), (int(machines.group(1)) if machines else 1)


@dataclass(frozen=True)
class NodeEnv:
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    source: str  # which variables described it


_SCHEMES = (
    ("MLP_*", ("MLP_ROLE_INDEX", "MLP_WORKER_NUM", "MLP_WORKER_0_HOST", "MLP_WORKER_0_PORT")),
    ("torchrun", ("NODE_RANK", "NNODES", "MASTER_ADDR", "MASTER_PORT")),
)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[03-05,07],cpu1`` -> ``gpu03``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m or not m.group(1):
        raise ClusterError(f"cannot read SLURM_JOB_NODELIST={nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _int(env: dict[str, str], key: str, source: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ClusterError(f"{source}: {key}={env[key]!r} is not an integer") from None


def node_env(env: dict[str, str] | None = None) -> NodeEnv:
    """This node's place in the cluster, from the environment; a one-line ClusterError when incomplete."""
    env = dict(os.environ if env is None else env)
    for name, keys in _SCHEMES:
        present = [k for k in keys if env.get(k)]
        if not any(env.get(k) for k in keys[:2]):  # a scheme is its rank and count: a lone MASTER_PORT is SLURM's too
            continue
        if len(present) < len(keys):
            missing = [k for k in keys if not env.get(k)]
            raise ClusterError(f"incomplete {name} environment: {', '.join(present)} set but {', '.join(missing)} "
                               "missing")
        rank, n = _int(env, keys[0], name), _int(env, keys[1], name)
        return _checked(NodeEnv(rank, n, env[keys[2]], _int(env, keys[3], name), name))
    if env.get("SLURM_NODEID") is not None and env.get("SLURM_NNODES"):
        if not env.get("SLURM_JOB_NODELIST") and not env.get("MASTER_ADDR"):
            raise ClusterError("incomplete SLURM environment: SLURM_JOB_NODELIST (or MASTER_ADDR) missing")
        port = _int(env, "MASTER_PORT", "SLURM") if env.get("MASTER_PORT") else DEFAULT_PORT
        return _checked(NodeEnv(_int(env, "SLURM_NODEID", "SLURM"), _int(env, "SLURM_NNODES", "SLURM"),
                                env.get("MASTER_ADDR") or first_slurm_host(env["SLURM_JOB_NODELIST"]), port, "SLURM"))
    raise ClusterError("no multi-node environment: set MLP_ROLE_INDEX/MLP_WORKER_NUM/MLP_WORKER_0_HOST/"
                       "MLP_WORKER_0_PORT, or NODE_RANK/NNODES/MASTER_ADDR/MASTER_PORT, or run under SLURM")


def _checked(n: NodeEnv) -> NodeEnv:
    if n.num_nodes < 1:
        raise ClusterError(f"{n.source}: the node count must be >= 1, got {n.num_nodes}")
    if not 0 <= n.node_rank < n.num_nodes:
        raise ClusterError(f"{n.source}: node rank {n.node_rank} is outside [0, {n.num_nodes})")
    if not 0 < n.master_port < 65536:
        raise ClusterError(f"{n.source}: master port {n.master_port} is not a TCP port")
    return n


def accelerate_config_for(deepspeed_file: str | None, num_nodes: int) -> Path:
    """The accelerate config: ``accelerate_configs/<deepspeed_file>.yaml``, else ZeRO-3 for that many nodes."""
    name = deepspeed_file or f"{num_nodes}_node_8_gpus_deepspeed_zero3"
    path = ROOT / "accelerate_configs" / f"{name}.yaml"
    if not path.is_file():
        raise ClusterError(f"accelerate config {path} does not exist (experiment.deepspeed_file)")
    return path


def launch_command(script: str, argv: list[str], node: NodeEnv, deepspeed_file: str | None,
                   num_node: int, env: dict[str, str] | None = None) -> list[str]:
    """``accelerate launch`` of ``script`` on this node (every node builds the same command but its rank)."""
    env = dict(os.environ if env is None else env)
    if num_node != node.num_nodes:
        raise ClusterError(f"experiment.num_node is {num_node} but the environment ({node.source}) describes "
                           f"{node.num_nodes} node(s)")
    config = accelerate_config_for(deepspeed_file, node.num_nodes)
    procs, machines = accelerate_config_size(config)
    per_node = _int(env, "NPROC_PER_NODE", "NPROC_PER_NODE") if env.get("NPROC_PER_NODE") else \
        max(procs // max(machines, 1), 1)
    if per_node < 1:
        raise ClusterError(f"NPROC_PER_NODE must be >= 1, got {per_node}")
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
            "--num_machines", str(node.num_nodes), "--machine_rank", str(node.node_rank),
            "--num_processes", str(per_node * node.num_nodes), "--main_process_ip", node.master_addr,
            "--main_process_port", str(node.master_port), str(ROOT / script), *argv]


def multinode_main(kind: str, script: str, argv: list[str] | None = None) -> int:
    """``multinode_<kind>.py``: load the config (before torch), then exec this node's ``accelerate launch``."""
    from core.entry import run_job
    from jobs.config import load_config_or_exit

    argv = sys.argv[1:] if argv is None else argv
    cfg = load_config_or_exit(kind, argv)

    def job() -> None:
        check_model_folders(cfg)  # one line on each node, before its processes start
        cmd = launch_command(script, argv, node_env(), cfg.experiment.deepspeed_file, cfg.experiment.num_node)
        print("launching: " + " ".join(cmd), flush=True)
        os.execv(cmd[0], cmd)

    return run_job(job)
