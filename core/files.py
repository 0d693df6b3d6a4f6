"""Files written so that a reader never sees half of them, and run directories that never disagree with themselves."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from core.errors import UserError

PARTIAL_SUFFIX = ".partial"
INTERRUPTED_MARK = "INTERRUPTED"
LOCK_NAME = ".lock"  # inside a run directory: held (flock) by the process that runs it
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class RunDirError(UserError, ValueError):
    """A user-facing problem with an output directory."""


def make_run_dir(root: Path) -> Path:
    """Create ``root`` (and its parents); a path through a regular file is a one-line error, not a traceback."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        culprit = next((p for p in [root, *root.parents] if p.exists() and not p.is_dir()), root)
        raise RunDirError(f"cannot create the run directory {root}: {culprit} is a file, not a directory "
                          "(choose another experiment.output_dir / experiment.project)") from None
    except OSError as err:  # a read-only file system, a full disk, no permission
        raise RunDirError(f"cannot create the run directory {root}: {err.strerror}") from None
    return root


_HELD_LOCKS: set[int] = set()  # descriptors of the locks this process holds


def _drop_inherited_locks() -> None:
    """In a forked child: close the copies of the parent's lock descriptors. A flock belongs to the open file, which
    every copy keeps alive: a child that outlives its parent (a worker pool, a sandbox) would hold the run."""
    for fd in list(_HELD_LOCKS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


class RunLock:
    """An OS lock (``flock``) on ``<run dir>/.lock``, held for the life of the process that runs the directory.

    A second run, a resume or an ``overwrite`` of a live run is refused with the holder's pid; the OS releases the
    lock when its holder dies (SIGKILL included), so a dead holder's lock is simply taken over. Forked children do
    not keep it (see :func:`_drop_inherited_locks`).
    """

    def __init__(self, root: Path):
        import fcntl

        self.path = make_run_dir(root) / LOCK_NAME
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise RunDirError(f"cannot write in the run directory {root}: {err.strerror}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if not isinstance(err, BlockingIOError):  # a file system without flock (Lustre without -o flock, ...)
                os.close(self.fd)
                self.fd = None
                print(f"note: {self.path.parent} cannot be locked ({err.strerror}); running without a lock",
                      flush=True)
                return
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(self.fd)
            raise RunDirError(f"run directory {root} is in use by a live run (pid {holder}); wait for it to end, "
                              "stop it, or choose another experiment.project") from None
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, str(os.getpid()).encode(), 0)
        except OSError as err:  # a full disk
            os.close(self.fd)
            raise RunDirError(f"cannot write in the run directory {root}: {err.strerror}") from None
        _HELD_LOCKS.add(self.fd)

    def release(self) -> None:
        if self.fd is not None and self.fd in _HELD_LOCKS:  # not in a forked child, which dropped its copy
            _HELD_LOCKS.discard(self.fd)
            os.close(self.fd)  # closing the descriptor releases the flock
        self.fd = None


def run_dir_entries(root: Path) -> list[Path]:
    """What a run directory holds, its lock file aside."""
    return [p for p in root.iterdir() if p.name != LOCK_NAME] if root.is_dir() else []


def disk_full(err: BaseException, where: Path | None = None) -> bool:
    """Whether ``err`` means the disk (or quota) is full. Some writers hide ENOSPC (torch.save's zip writer raises
    ``RuntimeError: unexpected pos ...``): with ``where`` given, an OSError or RuntimeError while the device holding
    ``where`` is (nearly) full counts too."""
    chain, e = [], err
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any(isinstance(e, OSError) and e.errno in DISK_FULL for e in chain):
        return True
    if any(m in str(err) for m in ("os error 28", "os error 122", "No space left on device")):  # safetensors' Rust
        return True
    if where is None or not isinstance(err, (OSError, RuntimeError)):
        return False
    probe = next((p for p in [where, *where.parents] if p.exists()), None)
    if probe is None:
        return False
    usage = shutil.disk_usage(probe)
    return usage.free < min(2**20, usage.total * 0.05)


def disk_full_error(where: Path, needed: int | None, removed: bool = True) -> RunDirError:
    """The one line for a write that ran out of space at ``where``; ``needed``: bytes one save takes, if known."""
    probe = next((p for p in [where, *where.parents] if p.exists()), where)
    free = shutil.disk_usage(probe).free
    need = f"; a save of this run needs about {_mb(needed)}" if needed else ""
    done = "the unfinished save was removed: " if removed else ""
    return RunDirError(f"no space left on the device while writing {where} ({_mb(free)} free{need}); {done}free "
                       "space and resume with experiment.start_from_scratch=false")


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 if absent)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) if path.exists() else 0


def write_atomic(path: str | os.PathLike[str], text: str | bytes) -> Path:
    """Write `text` to `path` through a temp file in the same folder, on disk (fsync) before the rename; the file
    gets the mode a plain ``open`` would give it (mkstemp's is 0600: unreadable to the rest of a team)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    with replacing(Path(tmp), out):
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(text.encode("utf-8") if isinstance(text, str) else text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    return out


@contextlib.contextmanager
def replacing(tmp: Path, out: Path) -> Iterator[None]:
    """Around writing ``tmp`` and renaming it to ``out``: any failure removes ``tmp`` (a full disk keeps no half file
    taking the space), and an OSError without a file name (a write, an fsync) is raised again naming ``out``."""
    try:
        yield
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None:
            raise OSError(err.errno, err.strerror, str(out)) from err
        raise


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (else set and restored at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_tree(path: Path) -> None:
    """Flush every file under ``path`` to disk: a marker written after it (a checkpoint's DONE) then never
    outlives its data in a power loss."""
    for p in sorted(path.rglob("*")):
        if p.is_file() and not p.is_symlink():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def check_model_out(out: str | os.PathLike[str], overwrite: bool, *inputs: str | os.PathLike[str]) -> Path:
    """Refuse an ``--out`` that would lose data: a file, one of the tool's own ``inputs`` or a folder holding one,
    or a folder holding files without ``overwrite``. Check it before the work, not after."""
    out = Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file: name a folder")
    if any(Path(p).resolve().is_relative_to(out) for p in inputs):
        raise RunDirError(f"--out {out} is (or holds) an input of this command: write to another folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise RunDirError(f"--out {out} is a folder that holds files: choose another, or pass --overwrite")
    return out


def write_model_folder(out: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Fill a model folder in a new hidden folder beside it and move it into place whole: the folder it replaces
    stays until the new one is complete, and a failed write (a full disk) leaves no half of either."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=PARTIAL_SUFFIX))
    try:
        write(partial)
        fsync_tree(partial)
    except BaseException as err:
        full = disk_full(err, partial)  # judged before the removal frees the space
        shutil.rmtree(partial, ignore_errors=True)
        if full:
            free = shutil.disk_usage(out.parent).free
            raise RunDirError(f"no space left on the device while writing {out} ({_mb(free)} free); nothing was "
                              f"written{' and the folder there is unchanged' if out.exists() else ''}") from None
        raise
    os.chmod(partial, 0o777 & ~_umask())  # mkdtemp's 0700 would hide the model from the rest of a team
    old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old")) if out.exists() else None
    if old is not None:
        out.replace(old)  # onto the empty folder mkdtemp made
    partial.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
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
        self.lock = RunLock(self.partial)  # held in the partial folder, which becomes the run
        # and in the folder it replaces, if any: an RL or SFT run writes there (and holds it) while it lives
        try:
            self.final_lock = RunLock(self.final) if self.final.is_dir() else None
        except RunDirError:
            self.final_lock = None
            self._refuse()
            raise
        if run_dir_entries(self.final) and not overwrite:
            self._refuse()
            raise RunDirError(f"output directory {self.final} is not empty (a previous run); pass "
                              "experiment.overwrite=true to replace it, or choose another experiment.project / "
                              "experiment.output_dir")
        self.overwrite = overwrite
        for p in run_dir_entries(self.partial):  # an earlier attempt's leftovers
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()

    @property
    def dir(self) -> Path:
        """Where the running job writes."""
        return self.partial

    def commit(self) -> Path:
        """Move the finished run into place (replacing a previous run when allowed)."""
        if self.final.exists():
            shutil.rmtree(self.final)
        os.replace(self.partial, self.final)
        self.release()
        return self.final

    def abandon(self, reason: str) -> Path:
        """Mark the partial run as interrupted; returns its folder."""
        with contextlib.suppress(OSError):  # a full disk: the error that stopped the run is the one to see
            write_atomic(self.partial / INTERRUPTED_MARK, reason + "\n")
        self.release()
        return self.partial

    def _refuse(self) -> None:
        """Release the locks of a run refused before it began, and remove its partial folder if it made one."""
        empty = not run_dir_entries(self.partial)  # else an earlier attempt's, which stays
        if empty:
            (self.partial / LOCK_NAME).unlink(missing_ok=True)  # while held: no other run takes it in between
        self.release()
        if empty:
            with contextlib.suppress(OSError):
                self.partial.rmdir()

    def release(self) -> None:
        self.lock.release()
        if self.final_lock is not None:
            self.final_lock.release()
