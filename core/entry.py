"""What every entry script does around its job: user errors as one line (exit 2), interrupts as one line."""

from __future__ import annotations

import errno
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


def _on_sigterm(signum, frame):  # noqa: ARG001
    raise Terminated()


_MACHINE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES}  # full disk, quota, read-only, permission


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
        if isinstance(err, OSError) and err.errno in _MACHINE_ERRNOS:  # the machine's, not the program's
            print(f"error: {err.strerror}{f': {err.filename}' if err.filename else ''}", file=sys.stderr)
            return EXIT_USER_ERROR
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
