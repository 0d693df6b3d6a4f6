"""Run untrusted model-written Python against tests, each program in its own contained process tree.

Per job, one supervisor (``reward/_sandbox_runner.py``) is started in fresh Linux namespaces when available
(``unshare``: private network, pid and mount namespaces; tmpfs over /tmp and a private /proc), with a
from-scratch environment and a fresh working directory. For every test it forks a child that sets
rlimits (CPU, address space, file size, process count), drops to a dedicated unprivileged uid when we are
root, and only then runs the code. Verdicts come from the supervisor, never from the program's exit status:
a program that exits early (``sys.exit``/``os._exit``/``SystemExit`` at import) passes nothing (fixes
Gen-Verse/dLLM-RL reward/rl_execute.py). ``sandbox_capabilities()`` tells which mode the current machine supports.

Containment by mode (``sandbox_capabilities()["mode"]``, weakest first):
- ``none`` (no usable unshare): rlimits, fresh env and workdir, a Python-level socket block (bypassable with
  ctypes), kill of the process tree. Unless we are root (uid drop), the program runs as the caller's user: it
  can write wherever that user can, read /proc/<pid>/environ of the user's processes and signal them.
- ``net_pid``: private network and pid namespaces (no mount namespace: world-writable dirs such as /tmp are
  shared with the host).
- ``userns`` (unprivileged user namespaces): private net/pid/mount namespaces, but no uid drop: the program can
  write files the caller owns.
- ``namespaces`` (root): all namespaces plus a per-worker unprivileged uid; the full containment.
In every mode a function-test verdict is computed inside the program's own process, so a program written to
attack this runner (walking interpreter frames to find the per-test nonce, or returning objects whose
``__eq__`` is always true) can still fake passes; exiting early or writing junk to inherited fds cannot.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from core.errors import UserError
from core.schema import Settings, bounded
from reward.verdicts import Check, judge, plan_tests

__all__ = [
    "SandboxConfig",
    "CodeJob",
    "TestResult",
    "RunResult",
    "extract_code",
    "code_from_response",
    "run_program",
    "run_many",
    "sandbox_capabilities",
    "SandboxFailure",
]

log = logging.getLogger(__name__)
RUNNER = Path(__file__).with_name("_sandbox_runner.py")
# The supervisor's source goes through stdin, so no path of the project is on any command line a program can read.
_BOOT = ("import sys;b=sys.stdin.buffer;n=int(b.readline());"
         "exec(compile(b.read(n),'sandbox-runner','exec'),{'__name__':'__main__'})")
_FENCE_RE = re.compile(r"```(?:python3?|py)\b[^\n]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_RESULT_CAP = 64 << 20


# -------------------------------------------------------------------------------------------- extraction
def extract_code(text: str | None) -> str | None:
    """Content of the last fenced ```python block (Gen-Verse/dLLM-RL sample/trado_rl_rollout.py), stripped; None if
    there is none."""
    if not text:
        return None
    blocks = _FENCE_RE.findall(text)
    if not blocks:
        return None
    code = blocks[-1].strip()
    return code or None


def code_from_response(response: str, prefix: str = "") -> str | None:
    """Program for a response that continues ``prefix`` (function tasks): fenced block of prefix+response,
    else, when the prefix opened no fence (e.g. ``def f(x):``), the text up to the first closing fence."""
    text = prefix + response
    code = extract_code(text)
    if code is None and prefix and "```" not in prefix:
        code = text.split("```", 1)[0].strip() or None
    return code


# ---------------------------------------------------------------------------------------------- records
class SandboxFailure(UserError):
    """The sandbox itself failed on most programs (cannot start, no supervisor): no verdict to score by."""


@dataclass(frozen=True)
class SandboxConfig(Settings):
    """Resource limits and isolation choices shared by all jobs of a run (the ``execute`` section of configs)."""

    num_chunk: int = bounded(128, 1)  # programs run concurrently (worker threads driving sandboxes)
    time_limit: float = bounded(1.0, 0.0, lo_open=True)  # seconds per test when the task sets no test_time_limit
    memory_mb: int = bounded(1024, 0)  # address-space limit per program (0 = unlimited)
    max_procs: int = bounded(32, 1)  # processes/threads a program may add
    max_output_bytes: int = bounded(1 << 20, 1)  # stdout+stderr per test; more -> killed, "output_limit"
    max_file_bytes: int = bounded(16 << 20, 0)  # RLIMIT_FSIZE
    tmpfs_mb: int = bounded(64, 1)  # size of the private /tmp (mount namespace only)
    startup_s: float = bounded(10.0, 0.0)  # slack for interpreter start-up in the whole-job deadline
    per_test_slack_s: float = bounded(1.0, 0.0)  # added per test to the whole-job deadline
    isolation: Literal["auto", "none"] = "auto"  # "auto" (best available) or "none"
    uid_base: int = bounded(200_000, 1)  # sandbox uids are uid_base + 64 * (pid % 1000) + worker slot


@dataclass
class CodeJob:
    """One program and its tests (function: ``test_list`` statements; stdio: input/output pairs)."""

    code: str | None
    test_method: str = "function"
    test_list: list[str] = field(default_factory=list)
    test_input: list[str] = field(default_factory=list)
    test_output: list[str] = field(default_factory=list)
    time_limit: float = 1.0

    @classmethod
    def from_task(cls, task: Mapping, code: str | None, default_time_limit: float = 1.0) -> CodeJob:
        """Job for a dataset row in our code format (data/README.md) and an extracted program."""
        return cls(
            code=code,
            test_method=task["test_method"],
            test_list=list(task.get("test_list") or []),
            test_input=list(task.get("test_input") or []),
            test_output=list(task.get("test_output") or []),
            time_limit=float(task.get("test_time_limit") or default_time_limit),
        )

    def tests(self) -> list[dict]:
        if self.test_method == "function":
            return [{"statement": t} for t in self.test_list]
        if self.test_method == "stdio":
            if len(self.test_input) != len(self.test_output):
                raise ValueError(f"{len(self.test_input)} test inputs but {len(self.test_output)} outputs")
            return [{"input": i, "output": o} for i, o in zip(self.test_input, self.test_output)]
        raise ValueError(f"test_method must be 'function' or 'stdio', got {self.test_method!r}")


@dataclass
class TestResult:
    """Verdict of one test: reason is ok / wrong_answer / runtime_error / timeout / memory / output_limit /
    syntax_error / exited / killed / no_code / sandbox_error."""

    __test__ = False  # not a pytest class

    passed: bool
    reason: str
    detail: str = ""
    seconds: float = 0.0


@dataclass
class RunResult:
    """All verdicts of one job; ``reason`` is "ok" or the reason of the first failed test."""

    tests: list[TestResult]
    reason: str
    wall_s: float = 0.0

    @property
    def passed(self) -> int:
        return sum(t.passed for t in self.tests)

    @property
    def total(self) -> int:
        return len(self.tests)

    @property
    def pass_fraction(self) -> float:
        return self.passed / self.total if self.tests else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.tests) and self.passed == self.total


def _finish(tests: list[TestResult], wall_s: float = 0.0) -> RunResult:
    failed = [t.reason for t in tests if not t.passed]
    return RunResult(tests=tests, reason=failed[0] if failed else ("ok" if tests else "no_tests"), wall_s=wall_s)


# ------------------------------------------------------------------------------------------ capabilities
_MOUNT_PROBE = (
    "import ctypes,os;l=ctypes.CDLL(None,use_errno=True);"
    "assert l.mount(b'tmpfs',b'/tmp',b'tmpfs',0,b'size=1m')==0;"
    "assert l.mount(b'proc',b'/proc',b'proc',0,None)==0;print(os.getpid())"
)
_NS_FLAGS = ["--net", "--pid", "--ipc", "--fork", "--kill-child"]  # --ipc: SysV / POSIX IPC objects die with the job


def _probe(cmd: list[str], expect: str) -> bool:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and done.stdout.strip() == expect


def _uid_mapped(uid: int) -> bool:
    try:
        rows = Path("/proc/self/uid_map").read_text().split("\n")
    except OSError:
        return False
    for row in rows:
        parts = row.split()
        if len(parts) == 3 and int(parts[0]) <= uid < int(parts[0]) + int(parts[2]):
            return True
    return False


_CAPS_LOCK = threading.Lock()


def sandbox_capabilities(isolation: str = "auto") -> dict:
    """What containment this machine gives: mode, net_ns, pid_ns, mount_ns, ipc_ns, uid_drop, minimal_root (a
    read-only root holding only the runtime), seccomp, job_memory (how the memory limit covers a job), the unshare
    prefix. Probed once per process, by running a small job through the real code path."""
    with _CAPS_LOCK:
        return _capabilities(isolation)


@functools.cache
def _capabilities(isolation: str) -> dict:
    caps = _namespaces(isolation)
    features = {"minimal_root": False, "seccomp": False, "job_memory": "resident memory of all the job's processes, "
                "polled every 20 ms"}
    probe = CodeJob("import ctypes, fractions\ndef f(x):\n    return x + 1\n", "function", ["assert f(1) == 2"],
                    time_limit=5.0)
    for minimal_root, seccomp in ((True, True), (True, False), (False, True)):
        if minimal_root and not caps["mount_ns"]:
            continue
        trial = {**caps, "minimal_root": minimal_root, "seccomp": seccomp}
        if _run(probe, SandboxConfig(isolation=isolation), 63, trial).all_passed:
            features.update(minimal_root=minimal_root, seccomp=seccomp)
            break
    return {**caps, **features}


def _namespaces(isolation: str) -> dict:
    unshare = shutil.which("unshare")
    root = os.geteuid() == 0
    caps = {"mode": "none", "net_ns": False, "pid_ns": False, "mount_ns": False, "ipc_ns": False,
            "uid_drop": root, "prefix": []}
    if isolation == "none" or os.environ.get("DLLM_SANDBOX_ISOLATION") == "none" or unshare is None:
        return _with_uid(caps)
    py = [sys.executable, "-I", "-c", _MOUNT_PROBE]
    for flags in (_NS_FLAGS, [f for f in _NS_FLAGS if f != "--ipc"]):  # without an IPC namespace if refused
        ipc = "--ipc" in flags
        variants = [("namespaces", [unshare, "--mount", *flags])] if root else []
        variants.append(("userns", [unshare, "--user", "--map-root-user", "--mount", *flags]))
        for mode, prefix in variants:
            if _probe(prefix + py, "1"):
                return _with_uid({**caps, "mode": mode, "net_ns": True, "pid_ns": True, "mount_ns": True,
                                  "ipc_ns": ipc, "uid_drop": root and mode == "namespaces", "prefix": prefix})
        for prefix in ([unshare, *flags], [unshare, "--user", "--map-root-user", *flags]):
            if _probe(prefix + [sys.executable, "-I", "-c", "print(1)"], "1"):
                return _with_uid({**caps, "mode": "net_pid", "net_ns": True, "pid_ns": True, "ipc_ns": ipc,
                                  "prefix": prefix, "uid_drop": root and "--user" not in prefix})
    return _with_uid(caps)


def describe_sandbox() -> str:
    """One line: the containment of code-reward programs on this machine and its known gaps."""
    caps = sandbox_capabilities()
    gaps = [name for key, name in (("net_ns", "network"), ("pid_ns", "process"), ("mount_ns", "filesystem"),
                                   ("ipc_ns", "IPC")) if not caps[key]]
    gaps = [f"no {name} namespace" for name in gaps]
    if not caps["minimal_root"]:
        gaps.append("host files are readable (no minimal read-only root)")
    if not caps["seccomp"]:
        gaps.append("no seccomp filter (keyrings, new namespaces)")
    if not caps["uid_drop"]:
        gaps.append("programs run as the caller's uid (process limits count the caller's processes)")
    gaps += [f"job memory: {caps['job_memory']}, not a cgroup", "tests that are not assert <expr> == <literal> "
             "(or isclose / truthiness) nor stdio are judged inside the program's process"]
    return f"sandbox mode {caps['mode']!r}; known gaps: {'; '.join(gaps)}"


def _with_uid(caps: dict) -> dict:
    """Decide how a dropped uid reaches the interpreter: re-expose private dirs (mount ns) or do not drop."""
    pairs = _exposure_pairs() if caps["uid_drop"] else []
    if pairs and not caps["mount_ns"]:
        log.warning("sandbox: Python lives under %s, unreadable for an unprivileged uid and no mount namespace "
                    "is available: programs run as the caller's uid", pairs[0][1])
        return {**caps, "uid_drop": False, "expose": []}
    return {**caps, "expose": pairs}


def _blocking_ancestor(path: str) -> str | None:
    """First directory above ``path`` that other users cannot traverse (None if the path is reachable)."""
    parts = Path(path).parts
    for i in range(2, len(parts)):
        ancestor = str(Path(*parts[:i]))
        try:
            if not os.stat(ancestor).st_mode & 0o001:
                return ancestor
        except OSError:
            return None
    return None


def _exposure_pairs() -> list[list[str]]:
    """(path, private ancestor) for the interpreter's own directories that a dropped uid could not read."""
    import site

    candidates = {sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix,
                  os.path.dirname(os.path.realpath(sys.executable)), *site.getsitepackages()}
    real = sorted({os.path.realpath(p) for p in candidates if p and os.path.isdir(p)})
    roots = [p for p in real if not any(p != q and p.startswith(q + os.sep) for q in real)]
    pairs = []
    for path in roots:
        ancestor = _blocking_ancestor(path)
        if ancestor is not None and os.stat(path).st_mode & 0o005 == 0o005:
            pairs.append([path, ancestor])
    return pairs


def _sandbox_uid(cfg: SandboxConfig, slot: int) -> int | None:
    """A uid of our own per (process, worker slot), so process-count limits and kills never cross jobs."""
    uid = cfg.uid_base + 64 * (os.getpid() % 1000) + slot % 64
    if _uid_mapped(uid):
        return uid
    return 65534 if _uid_mapped(65534) else None


def _user_task_count() -> int:
    """Number of tasks (threads) of our uid: RLIMIT_NPROC counts them all, not only the sandbox's."""
    uid, count = os.getuid(), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


# ------------------------------------------------------------------------------------------------ running
class _Slots:
    """Worker slots (0..63) handed to concurrent jobs, each slot mapping to its own sandbox uid."""

    def __init__(self) -> None:
        self.free = list(range(64))
        self.cond = threading.Condition()

    def acquire(self) -> int:
        with self.cond:
            while not self.free:
                self.cond.wait()
            return self.free.pop(0)

    def release(self, slot: int) -> None:
        with self.cond:
            self.free.append(slot)
            self.free.sort()
            self.cond.notify()


_SLOTS = _Slots()


def _spec(job: CodeJob, cfg: SandboxConfig, caps: dict, uid: int | None, workdir: str, nonce: str,
          probes: list[dict]) -> dict:
    nproc = cfg.max_procs if uid is not None else _user_task_count() + cfg.max_procs
    return {
        "nonce": nonce, "code": job.code, "tests": probes,
        "time_limit": job.time_limit, "memory_mb": cfg.memory_mb, "nproc": nproc,
        "max_output_bytes": cfg.max_output_bytes, "max_file_bytes": cfg.max_file_bytes,
        "tmpfs_mb": cfg.tmpfs_mb, "uid": uid, "workdir": workdir,
        "net_ns": caps["net_ns"], "mount_ns": caps["mount_ns"], "expose": caps["expose"],
        "minimal_root": caps["minimal_root"], "seccomp": caps["seccomp"],
        "hide": _private_dirs(),
    }


def _private_dirs() -> list[str]:
    """What a program must not see even where a runtime directory holds it: this project and our working dir."""
    dirs = {str(Path(__file__).resolve().parents[1]), os.path.realpath(os.getcwd()), os.path.expanduser("~")}
    return sorted(d for d in dirs if d not in ("/", ""))


def _clean_env(home: str) -> dict[str, str]:
    """Environment built from scratch: nothing of the caller's (tokens, keys) reaches the program."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": home,
           "TMPDIR": "/tmp"}
    env.update({k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
    return env


def _communicate(proc: subprocess.Popen, payload: bytes, deadline: float) -> tuple[bytes, bytes, bool]:
    """Feed ``payload``, collect stdout/stderr until exit or ``deadline``; True if the deadline hit."""
    sel = selectors.DefaultSelector()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        os.set_blocking(stream.fileno(), False)
    sel.register(proc.stdin, selectors.EVENT_WRITE)
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    out, err, pos, timed_out = bytearray(), bytearray(), 0, False
    while len(sel.get_map()) > 0:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for key, _ in sel.select(left):
            if key.fileobj is proc.stdin:
                try:
                    pos += os.write(key.fd, payload[pos : pos + 65536])
                except BlockingIOError:
                    continue
                except OSError:
                    pos = len(payload)
                if pos >= len(payload):
                    sel.unregister(proc.stdin)
                    proc.stdin.close()
                continue
            data = os.read(key.fd, 65536)
            buf = out if key.fileobj is proc.stdout else err
            if not data:
                sel.unregister(key.fileobj)
            elif len(buf) < _RESULT_CAP:
                buf += data
    sel.close()
    return bytes(out), bytes(err), timed_out


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


def _parse(stdout: bytes, nonce: str) -> list[dict]:
    events = []
    for line in stdout.decode("utf-8", "replace").splitlines():
        tag, _, body = line.partition(" ")
        if tag == nonce:
            try:
                events.append(json.loads(body))
            except ValueError:
                continue
    return events


def _missing_cause(events: list[dict], timed_out: bool, stderr: bytes) -> tuple[str, str]:
    """Why tests have no result: infrastructure failure, whole-job deadline, or a killed supervisor."""
    setup = [ev["msg"] for ev in events if ev.get("event") == "setup_error"]
    if setup or not events:  # the supervisor failed or never started: our fault, not the program's
        detail = setup[0] if setup else stderr.decode("utf-8", "replace")[-500:]
        if not timed_out:
            log.warning("sandbox infrastructure failure: %s", detail)
            return "sandbox_error", detail
    if timed_out:
        return "timeout", "whole-job deadline"
    if any(ev.get("event") == "done" for ev in events):
        return "sandbox_error", "supervisor finished without this result"
    return "killed", "supervisor died"


def _collect(events: list[dict], checks: list[Check], timed_out: bool, stderr: bytes) -> list[TestResult]:
    """Per-test verdicts: what the supervisor reports each child did, judged here against the expected answers
    (which never entered the sandbox); tests without a report fail with a cause."""
    results: dict[int, TestResult] = {}
    n_tests = len(checks)
    for ev in events:
        i = ev.get("test")
        if ev.get("event") != "result" or not isinstance(i, int) or not 0 <= i < n_tests:
            continue
        passed, reason, detail = False, str(ev.get("reason")), str(ev.get("detail", ""))
        if reason == "ok":
            passed, reason, detail = judge(checks[i], ev)
        results[i] = TestResult(passed, reason, detail, float(ev.get("seconds", 0.0)))
    if len(results) == n_tests:
        return [results[i] for i in range(n_tests)]
    reason, detail = _missing_cause(events, timed_out, stderr)
    return [results.get(i, TestResult(False, reason, detail)) for i in range(n_tests)]


def _remove_tree(path: str) -> None:
    def retry(func, p, _exc):  # the program may have made its files read-only
        try:
            os.chmod(os.path.dirname(p), 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=retry)


def run_program(job: CodeJob, config: SandboxConfig | None = None, slot: int | None = None) -> RunResult:
    """Run one program against its tests in a fresh sandbox; never raises for anything the program does."""
    cfg = config or SandboxConfig()
    tests = job.tests()
    if not job.code or not job.code.strip():
        return _finish([TestResult(False, "no_code") for _ in tests])
    if not tests:
        return _finish([])
    own_slot = slot is None
    slot = _SLOTS.acquire() if own_slot else slot
    try:
        return _run(job, cfg, slot)
    finally:
        if own_slot:
            _SLOTS.release(slot)


def _interpreter() -> str:
    """The base interpreter (not a virtualenv's path inside the project): the supervisor needs only the stdlib."""
    base = getattr(sys, "_base_executable", None)
    return base if base and os.path.exists(base) else os.path.realpath(sys.executable)


@functools.cache
def _runner_header() -> bytes:
    """What the bootstrap reads first: the supervisor's source and its length (read once per process)."""
    source = RUNNER.read_bytes()
    return b"%d\n" % len(source) + source


def _run(job: CodeJob, cfg: SandboxConfig, slot: int, caps: dict | None = None) -> RunResult:
    caps = caps or sandbox_capabilities(cfg.isolation)
    uid = _sandbox_uid(cfg, slot) if caps["uid_drop"] else None
    nonce = secrets.token_hex(16)
    probes, checks = zip(*plan_tests(job.tests()))
    n_tests = len(checks)
    workdir = tempfile.mkdtemp(prefix="sandbox-")
    start = time.monotonic()
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        payload = _runner_header() + json.dumps(_spec(job, cfg, caps, uid, workdir, nonce, list(probes))).encode()
        # -I: isolated mode (no site-packages, no script directory on sys.path)
        cmd = [*caps["prefix"], _interpreter(), "-I", "-X", "utf8", "-c", _BOOT]
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    cwd=workdir, env=_clean_env(workdir), start_new_session=True, close_fds=True)
        except OSError as exc:  # e.g. out of processes on the host: an infrastructure failure, not the program's
            log.warning("sandbox could not start: %s", exc)
            return _finish([TestResult(False, "sandbox_error", str(exc)) for _ in range(n_tests)])
        deadline = start + cfg.startup_s + n_tests * (job.time_limit + cfg.per_test_slack_s)
        try:
            out, err, timed_out = _communicate(proc, payload, deadline)
        finally:
            _kill_group(proc.pid)
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                stream.close()
        events = _parse(out, nonce)
        if not caps["pid_ns"]:  # same pid namespace: also kill the last test's group (fallback mode only)
            for ev in events:
                if ev.get("event") == "start" and isinstance(ev.get("pgid"), int) and ev["pgid"] > 1:
                    _kill_group(ev["pgid"])
        tests = _collect(events, list(checks), timed_out, err)
    finally:
        _remove_tree(workdir)
    return _finish(tests, time.monotonic() - start)


def run_many(
    jobs: Sequence[CodeJob], max_workers: int | None = None, config: SandboxConfig | None = None,
    progress: bool = False,
) -> list[RunResult]:
    """Run many jobs concurrently (threads driving sandboxed subprocesses); results in input order.

    ``max_workers`` None = ``config.num_chunk``."""
    cfg = config or SandboxConfig()
    workers = max(1, min(max_workers or cfg.num_chunk, 64, len(jobs) or 1))
    bar = _progress_bar(len(jobs)) if progress else None

    def one(job: CodeJob) -> RunResult:
        slot = _SLOTS.acquire()
        try:
            return run_program(job, cfg, slot=slot)
        finally:
            _SLOTS.release(slot)
            if bar is not None:
                bar.update(1)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(one, jobs))
    if bar is not None:
        bar.close()
    return results


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="sandbox", unit="prog")
