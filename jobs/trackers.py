"""Experiment trackers beside ``metrics.jsonl``: Weights & Biases and TensorBoard, each optional, the same scalars.

Every tracker takes ``log(scalars, step)`` and ``finish()``; :func:`start_trackers` builds those the config enables
(main process only) and fails with one line when a tracker's package is missing.
"""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path
from typing import Any

from core.files import RunDirError
from core.schema import to_dict


class Trackers:
    """The enabled trackers, driven together."""

    def __init__(self, trackers: list[Any]):
        self.trackers = trackers

    def log(self, metrics: dict, step: int) -> None:
        scalars = numeric_scalars(metrics)
        for t in self.trackers:
            t.log(scalars, step=step)

    def finish(self) -> None:
        for t in self.trackers:
            t.finish()


def numeric_scalars(metrics: dict) -> dict[str, float]:
    """The top-level numbers of a step's metrics (nested tables and flags left out)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


WANDB_MISSING = "wandb.enabled is true but wandb is not installed (pip install wandb)"
TENSORBOARD_MISSING = ("tensorboard.enabled is true but neither tensorboardX nor tensorboard is installed "
                       "(pip install tensorboardX)")


def check_trackers(cfg: Any) -> None:
    """Refuse an enabled tracker whose package is missing before the job changes anything on disk (an overwritten
    run is emptied only after every setup check)."""
    if cfg.wandb.enabled and not _importable("wandb"):
        raise RunDirError(WANDB_MISSING)
    if cfg.tensorboard.enabled and not any(_importable(m) for m in ("tensorboardX", "tensorboard")):
        raise RunDirError(TENSORBOARD_MISSING)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def start_trackers(cfg: Any, run_dir: Path, first_step: int = 1) -> Trackers:
    """The enabled trackers; ``first_step`` > 1 (a resumed run): TensorBoard hides what an earlier attempt logged
    for the steps about to be redone (a step interrupted after its metrics were logged is logged again); wandb shows
    both attempts (``WandbRun``)."""
    trackers = []
    if cfg.wandb.enabled:
        trackers.append(_wandb_run(cfg, run_dir))
    if cfg.tensorboard.enabled:
        trackers.append(TensorBoard(Path(cfg.tensorboard.log_dir or run_dir / "tensorboard"),
                                    purge_step=first_step if first_step > 1 else None))
    return Trackers(trackers)


def _wandb_run(cfg: Any, run_dir: Path) -> Any:
    try:
        import wandb
    except ImportError:
        raise RunDirError(WANDB_MISSING) from None
    w = cfg.wandb
    return WandbRun(wandb.init(project=cfg.experiment.project, entity=w.entity, resume=w.resume, dir=str(run_dir),
                               config=to_dict(cfg)))


class WandbRun:
    """A wandb run whose x axis is the job's ``step`` metric, not wandb's own step counter: wandb drops a value
    logged with ``step=`` below the run's last step, so a resumed run's redone steps (a step interrupted after its
    metrics were logged is logged again) would be lost; as a metric they are kept, beside the first attempt's."""

    def __init__(self, run: Any):
        self.run = run
        run.define_metric("step")
        run.define_metric("*", step_metric="step")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log({**scalars, "step": step})

    def finish(self) -> None:
        self.run.finish()


class TensorBoard:
    """Scalars as TensorBoard event files (tensorboardX, or torch.utils.tensorboard when tensorboard is installed)."""

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise RunDirError(TENSORBOARD_MISSING) from None
        # The event file is named by the second it opens in and the host: a resumed run that starts within the same
        # second as the attempt before it would write over that attempt's file, so each writer gets its own suffix.
        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step, filename_suffix=f".{uuid.uuid4().hex[:12]}")

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()
