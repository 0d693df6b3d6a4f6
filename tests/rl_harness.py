"""Runs rl.py in this process with a deterministic stand-in reward, for the RL-loop tests.

Tiny random models never answer arithmetic correctly, so every group would be filtered and nothing trained. The
stand-in scores a response by the parity of its token-id sum: varied within a group, deterministic, and a real
function of what was sampled. ``RL_HARNESS_KILL=stage:step`` SIGKILLs the process inside that stage of that step
(stages: sample, train, save; ``after``: once the step directory is complete, before the run's outputs follow it),
to test resuming. ``RL_HARNESS_HOLD=<file>`` holds the first sampling (see ``hold_in_sampling``).

    python tests/rl_harness.py config=configs/demo/rl_demo.yaml [key=value ...]
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parity_score(rollout, tasks, data_type, **_):
    scores = [float(sum(t.response_ids) % 2) for t in rollout]
    for t, s in zip(rollout, scores, strict=True):
        t.score = s
    return scores


def install(kill: str | None = None, patch=setattr) -> None:
    """Swap in the stand-in reward (``patch`` = pytest's monkeypatch.setattr in-process, so it is undone)."""
    import jobs.evaluate
    import jobs.rl

    patch(jobs.evaluate, "score_rollout", parity_score)
    if not kill:
        return
    stage, step = kill.split(":")
    timed, save, after = jobs.rl.RLJob._timed, jobs.rl.RLJob._save, jobs.rl.RLJob._after_step

    def killing_timed(self, name, fn):
        if name == stage and self.step == int(step):
            os.kill(os.getpid(), signal.SIGKILL)
        return timed(self, name, fn)

    def killing_save(self, ckpt):  # dies after the policy weights are written, before the checkpoint is complete
        if stage == "save" and self.step == int(step):
            acc, model = self.acc, self.trainer.model
            acc.unwrap_model(model).save_pretrained(ckpt / "policy")
            os.kill(os.getpid(), signal.SIGKILL)
        return save(self, ckpt)

    def killing_after(self, metrics):
        if stage == "after" and metrics["step"] == int(step):
            os.kill(os.getpid(), signal.SIGKILL)
        return after(self, metrics)

    jobs.rl.RLJob._timed, jobs.rl.RLJob._save, jobs.rl.RLJob._after_step = killing_timed, killing_save, killing_after


def hold_in_sampling(marker: str) -> None:
    """The first sampling of the run (an evaluation's or a step's) writes ``marker`` and then waits for a signal,
    so a test signals a process that is certainly inside it (a guessed sleep can land before or after)."""
    import time

    import jobs.evaluate

    rollout_tasks = jobs.evaluate.rollout_tasks

    def holding(*args, **kwargs):
        if not Path(marker).exists():
            Path(marker).write_text(str(os.getpid()))
            time.sleep(600)  # the test's signal ends this (as an interrupt, or the job's SIGTERM handler)
        return rollout_tasks(*args, **kwargs)

    jobs.evaluate.rollout_tasks = holding


def wait_for_hold(marker: Path, proc, timeout: float = 300) -> None:
    """(The test's side.) Return once ``proc`` is held in its sampling; fail if it ends or never gets there."""
    import time

    deadline = time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the process ended (exit {proc.returncode}) before its sampling: "
                                 f"{proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the process did not reach its sampling within {timeout} s")
        time.sleep(0.05)


def dump_weights_at_end(path: str) -> None:
    """After the run, every rank writes a digest of its whole weights to ``path.<rank>.json``."""
    import hashlib
    import json

    import jobs.rl

    run_steps = jobs.rl.RLJob.run_steps

    def run_and_dump(self, first):
        out = run_steps(self, first)
        digests = {}
        for key, trainer in (("digest", self.trainer), ("value_digest", self.value)):
            if trainer is None:
                continue
            with jobs.rl.sampling_weights(trainer):  # whole weights under ZeRO-3
                digest = hashlib.sha256()
                for name, p in sorted(trainer.adapter.model.named_parameters()):
                    digest.update(name.encode() + p.detach().float().cpu().numpy().tobytes())
                digests[key] = digest.hexdigest()
        Path(f"{path}.{self.acc.process_index}.json").write_text(json.dumps(
            {**digests, "num_processes": self.acc.num_processes,
             "distributed_type": str(self.acc.distributed_type)}))
        return out

    jobs.rl.RLJob.run_steps = run_and_dump


if __name__ == "__main__":
    install(os.environ.get("RL_HARNESS_KILL"))
    if os.environ.get("RL_HARNESS_HOLD"):
        hold_in_sampling(os.environ["RL_HARNESS_HOLD"])
    if os.environ.get("RL_HARNESS_DUMP"):
        dump_weights_at_end(os.environ["RL_HARNESS_DUMP"])
    import rl

    raise SystemExit(rl.main(sys.argv[1:]))
