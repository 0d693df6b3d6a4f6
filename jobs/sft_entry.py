"""What every ``train/sft_<family>.py`` script runs: load the config (before torch), check the family, run SFT."""

from __future__ import annotations

import sys

from core.entry import run_job
from core.loader import ConfigError
from jobs.cluster import check_single_node, relaunch_if_requested
from jobs.config import FAMILY_BASES, load_config_or_exit, script_family


def main(family: str, argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = load_config_or_exit("sft", argv)

    def job() -> None:
        if cfg.model.model_base not in FAMILY_BASES[family]:
            raise ConfigError(f"key 'model.model_base' is {cfg.model.model_base!r} but this is train/sft_{family}.py "
                              f"(use train/sft_{script_family(cfg.model.model_base)}.py)", "model.model_base")
        launcher = "accelerate_configs/<nodes>_node_8_gpus_deepspeed_zero3.yaml"
        check_single_node(cfg, f"accelerate launch --config_file {launcher} --machine_rank <node index> "
                               f"--main_process_ip <node 0> train/sft_{family}.py config=...")
        relaunch_if_requested(cfg, f"train/sft_{family}.py", argv)
        from jobs.sft import run_sft

        out = run_sft(cfg)
        print(f"model: {out}")

    return run_job(job)
