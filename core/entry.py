"""What every entry script does around its job: user errors as one line (exit 2), interrupts as one line."""

from __future__ import annotations

import errno
import signal
import sys
from collections.abc import Callable

from core.files import DISK_FULL

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


_MACHINE_ERRNOS = {*DISK_FULL, errno.EROFS, errno.EACCES}  # full disk or quota, read-only, permission


def run_job(job: Callable[[], object]) -> int:
    """Run ``job``; a user error, or a write the machine refuses (a full disk, a read-only or forbidden path),
    prints ``error: <one line>`` and returns 2; an interrupt prints one line."""
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
            where = err.filename2 or err.filename  # a rename's target, else the file
            print(f"error: {err.strerror}{f': {where}' if where else ''}", file=sys.stderr)
            return EXIT_USER_ERROR
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
