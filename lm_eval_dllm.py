"""lm-eval-harness with our model registered: `python -m lm_eval_dllm --model dllm_rl --model_args ... --tasks ...`.

Takes exactly lm-eval's command-line arguments. lm-eval 0.4.13 looks models up only in its in-process registry (no
entry points), so `python -m lm_eval --model dllm_rl` cannot find ours: this wrapper imports jobs.harness (which
registers `dllm_rl`) and then runs lm-eval's own CLI.
"""

from __future__ import annotations


def main() -> int:
    from lm_eval.__main__ import cli_evaluate

    import jobs.harness  # noqa: F401 - registers the model under its name
    from core.entry import run_job

    return run_job(cli_evaluate)  # a bad model_args value: one line, exit 2


if __name__ == "__main__":
    raise SystemExit(main())
