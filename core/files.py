"""Files written so that a reader never sees half of them, and run directories that never disagree with themselves."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

PARTIAL_SUFFIX = ".partial"
INTERRUPTED_MARK = "INTERRUPTED"


class RunDirError(ValueError):
    """A user-facing problem with an output directory."""


def write_atomic(path: str | os.PathLike[str], text: str | bytes) -> Path:
    """Write `text` to `path` through a temp file in the same folder and a rename."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(text.encode("utf-8") if isinstance(text, str) else text)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


class StagedRun:
    """An output directory filled in ``<dir>.partial`` and moved into place only when the run completes.

    A run that stops early leaves ``<dir>.partial`` with an ``INTERRUPTED`` file naming why; ``<dir>`` itself only
    ever holds a complete run (its config and results written together). A non-empty ``<dir>`` is refused unless
    ``overwrite`` is set.
    """

    def __init__(self, final: str | os.PathLike[str], overwrite: bool = False):
        self.final = Path(final)
        self.partial = self.final.with_name(self.final.name + PARTIAL_SUFFIX)
        if self.final.exists() and not self.final.is_dir():
            raise RunDirError(f"output path {self.final} exists and is not a directory")
        if self.final.is_dir() and any(self.final.iterdir()) and not overwrite:
            raise RunDirError(f"output directory {self.final} is not empty (a previous run); pass "
                              "experiment.overwrite=true to replace it, or choose another experiment.project / "
                              "experiment.output_dir")
        self.overwrite = overwrite
        if self.partial.exists():
            shutil.rmtree(self.partial)
        self.partial.mkdir(parents=True)

    @property
    def dir(self) -> Path:
        """Where the running job writes."""
        return self.partial

    def commit(self) -> Path:
        """Move the finished run into place (replacing a previous run when allowed)."""
        if self.final.exists():
            shutil.rmtree(self.final)
        os.replace(self.partial, self.final)
        return self.final

    def abandon(self, reason: str) -> Path:
        """Mark the partial run as interrupted; returns its folder."""
        write_atomic(self.partial / INTERRUPTED_MARK, reason + "\n")
        return self.partial
