"""Validate config files without running anything: each is loaded as its job would load it (kind from the name).

    python -m tools.check_config configs/*.yaml

Prints ``ok`` or the one-line error per file; the exit status is 1 if any file failed, 2 on no arguments.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from jobs.config import ConfigError, job_kind, load_config


def main(argv: Sequence[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m tools.check_config CONFIG.yaml [CONFIG.yaml ...]  (validates each file; the job kind "
              "comes from the file name)", file=sys.stderr)
        return 2
    status = 0
    for path in paths:
        try:
            load_config([f"config={path}"], job_kind(path), stream=sys.stdout)
            print(f"ok     {path}")
        except ConfigError as err:
            print(f"error  {err}")
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
