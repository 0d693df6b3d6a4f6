"""What every entry script does around its job: user errors as one line (exit 2), interrupts as one line."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

EXIT_USER_ERROR = 2
EXIT_SIGINT, EXIT_SIGTERM = 130, 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, delivered as an interrupt so the job's cleanup runs."""


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that describe a problem the user can fix (their message is the whole story): every package's
    user errors subclass ``core.errors.UserError``."""
    from core.errors import UserError

    return UserError, FileNotFoundError


def launched() -> bool:
    """True under a multi-process launcher (accelerate launch / torchrun set LOCAL_RANK and WORLD_SIZE)."""
    import os

    return "LOCAL_RANK" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def check_single_node(cfg, command: str) -> None:
    """A multi-node config must be started on every node by its launcher (``command``, said in the error)."""
    from core.loader import ConfigError

    if cfg.experiment.num_node > 1 and not launched():
        raise ConfigError(f"key 'experiment.num_node' is {cfg.experiment.num_node}: start multi-node runs with "
                          f"`{command}` on every node", "experiment.num_node")


def relaunch_if_requested(cfg, script: str, argv: list[str]) -> None:
    """With ``experiment.deepspeed_file`` set and no launcher around us, exec ``accelerate launch`` of ``script``."""
    import os
    from pathlib import Path

    if not cfg.experiment.deepspeed_file or launched():
        return
    check_model_folders(cfg)  # one line here, not the same error from every launched process
    from core.loader import ConfigError

    root = Path(__file__).resolve().parents[1]
    config = root / "accelerate_configs" / f"{cfg.experiment.deepspeed_file}.yaml"
    if not config.is_file():
        raise ConfigError(f"key 'experiment.deepspeed_file': {config} does not exist (choose a file of "
                          f"{root / 'accelerate_configs'})", "experiment.deepspeed_file")
    machines = accelerate_config_size(config)[1]
    if machines != cfg.experiment.num_node:  # accelerate would wait for the other machines for ever
        raise ConfigError(f"key 'experiment.deepspeed_file': {config.name} launches {machines} machines but "
                          f"experiment.num_node is {cfg.experiment.num_node}; choose a 1-node file, or start a "
                          "multi-node run with multinode_*.py on every node", "experiment.deepspeed_file")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(root / script),
           *argv]
    print("launching: " + " ".join(cmd), flush=True)
    os.execv(cmd[0], cmd)


def check_model_folders(cfg) -> None:
    """Refuse a model folder a fresh run would load that holds no ``config.json`` (the check ``load_model`` makes,
    made before any process is launched). A resumed run loads its own checkpoint; a demo path is built on demand."""
    from pathlib import Path

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
        if key == "adapter" and not (Path(path) / "adapter_config.json").is_file():
            raise ModelLoadError(f"model.adapter: {not_an_adapter_folder(path)}")
        if key != "adapter" and not (Path(path) / "config.json").is_file():
            raise ModelLoadError(not_a_model_folder(path, f"model.{key}"))


def accelerate_config_size(path) -> tuple[int, int]:
    """(num_processes, num_machines) of an accelerate config file (1 where a key is absent)."""
    import re
    from pathlib import Path

    text = Path(path).read_text()
    procs = re.search(r"^num_processes:\s*(\d+)", text, re.M)
    machines = re.search(r"^num_machines:\s*(\d+)", text, re.M)
    return (int(procs.group(1)) if procs else 1), (int(machines.group(1)) if machines else 1)


def _on_sigterm(signum, frame):  # noqa: ARG001
    raise Terminated()


def run_job(job: Callable[[], object]) -> int:
    """Run ``job``; a user error prints ``error: <one line>`` and returns 2, an interrupt prints one line."""
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        job()
        return 0
    except KeyboardInterrupt as err:
        terminated = isinstance(err, Terminated)
        detail = getattr(err, "detail", None) or "the partial run is left in its '.partial' folder, marked INTERRUPTED"
        print(f"\n{'terminated' if terminated else 'interrupted'}: {detail}", file=sys.stderr)
        return EXIT_SIGTERM if terminated else EXIT_SIGINT
    except Exception as err:
        if isinstance(err, _user_errors()):
            print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
            return EXIT_USER_ERROR
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
