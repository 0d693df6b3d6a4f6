"""Serve a model over an OpenAI-compatible HTTP API: `python serve.py config=configs/demo/serve_demo.yaml [k=v ...]`.

Routes and request fields: jobs/serve.py; threads, batching and streaming: jobs/serve_engine.py. ``--host``,
``--port`` and ``--api-key`` are shorthands for ``server.host=``, ``server.port=``, ``server.api_key=``.
"""

from __future__ import annotations

import sys

from core.entry import run_job
from jobs.config import load_config_or_exit

FLAGS = {"--host": "server.host", "--port": "server.port", "--api-key": "server.api_key"}


def config_argv(argv: list[str]) -> list[str]:
    """``key=value`` arguments, with ``--flag VALUE`` / ``--flag=VALUE`` shorthands rewritten."""
    out, i = [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    print(f"config error: {name} needs a value", file=sys.stderr)
                    raise SystemExit(2)
                i, value = i + 1, argv[i + 1]
            out.append(f"{FLAGS[name]}={value}")
        else:
            out.append(argv[i])
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    argv = config_argv(sys.argv[1:] if argv is None else argv)
    cfg = load_config_or_exit("serve", argv)  # before torch is imported

    def job() -> None:
        from jobs.serve import run_serve

        run_serve(cfg)

    return run_job(job)


if __name__ == "__main__":
    raise SystemExit(main())
