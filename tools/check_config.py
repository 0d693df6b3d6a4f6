"""Validate config files without running anything: each is loaded as its job would load it.

    python -m tools.check_config configs/*.yaml
    python -m tools.check_config --kind rl my_experiment.yaml

The job kind comes from the file name (rl_*, multinode_rl_*, *_eval, eval_*, multinode_eval_*, sft_*, serve_*,
*_serve) unless ``--kind`` names it.
Prints ``ok`` or the one-line error per file; the exit status is 1 if any file failed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Sequence
from pathlib import Path

from jobs.config import SCHEMAS, ConfigError, job_kind, load_config


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.check_config", description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", metavar="CONFIG.yaml")
    parser.add_argument("--kind", choices=sorted(SCHEMAS), help="the job kind of every file (default: from its name)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    status = 0
    for path in args.configs:
        try:
            if not Path(path).is_file():
                raise ConfigError(f"{path}: file not found", source=path)
            notes = io.StringIO()
            load_config([f"config={path}"], args.kind or job_kind(path), stream=notes)
            print(f"ok     {path}")
            print(notes.getvalue(), end="")  # a setting that loads but does nothing, under its file
        except ConfigError as err:
            print(f"error  {err}")
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
