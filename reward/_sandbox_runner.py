"""Sandbox supervisor, started by ``reward.sandbox`` as ``python -I _sandbox_runner.py`` (stdlib only).

It reads a JSON job from stdin, optionally sets up private mounts, then runs every test in a fresh forked
child that applies resource limits, drops privileges and only then executes the untrusted code. The
supervisor itself never executes user code: it alone decides each verdict (stdio: by comparing the captured
output; function tests: from a per-test record carrying a per-test nonce) and streams one line per test to its
own stdout, which no child can reach. A test without a valid record fails.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import io
import json
import os
import resource
import secrets
import selectors
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MNT_DETACH = 1, 32, 4096, 16384, 2
STATUS_FD = 3
READ_CHUNK = 65536
STATUS_CAP = 65536
ERR_TAIL = 2000

_libc = ctypes.CDLL(None, use_errno=True)


# ------------------------------------------------------------------------------------------ supervisor side
class Emitter:
    """Writes nonce-tagged JSON lines to the supervisor's private stdout."""

    def __init__(self, nonce: str) -> None:
        self.nonce = nonce
        self.out = os.fdopen(os.dup(1), "w", encoding="utf-8")

    def __call__(self, **record) -> None:
        self.out.write(f"{self.nonce} {json.dumps(record)}\n")
        self.out.flush()


def _mount(source: str, target: str, fstype: str, data: str = "", flags: int = 0) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode() or None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} on {target}: {os.strerror(err)}")


def _bind(source: str, target: str, readonly: bool = True) -> None:
    _mount(source, target, "none", "", MS_BIND | MS_REC)
    if readonly:
        _mount("none", target, "none", "", MS_BIND | MS_REMOUNT | MS_RDONLY)


def expose(pairs: list[list[str]]) -> None:
    """Make each ``path`` reachable for the sandbox uid although its ``ancestor`` is private (e.g. a Python
    installed under /root): cover the ancestor with an empty tmpfs and bind the path back, read-only."""
    by_ancestor: dict[str, list[str]] = {}
    for path, ancestor in pairs:
        by_ancestor.setdefault(ancestor, []).append(path)
    for n, (ancestor, paths) in enumerate(sorted(by_ancestor.items())):
        staged = []
        for k, path in enumerate(paths):
            stage = f"/tmp/.expose-{n}-{k}"
            os.mkdir(stage, 0o700)
            _bind(path, stage, readonly=False)
            staged.append((stage, path))
        _mount("tmpfs", ancestor, "tmpfs", "size=1m,mode=0755")
        for stage, path in staged:
            os.makedirs(path, 0o755, exist_ok=True)
            _bind(stage, path)
            _libc.umount2(stage.encode(), MNT_DETACH)
            os.rmdir(stage)


def setup_mounts(spec: dict) -> str:
    """Private tmpfs over the world-writable dirs and a fresh /proc (only inside a new mount+pid ns)."""
    size = f"size={int(spec['tmpfs_mb'])}m,mode=1777"
    for target in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        if os.path.isdir(target):
            _mount("tmpfs", target, "tmpfs", size)
    if os.getpid() == 1:
        _mount("proc", "/proc", "proc")
    expose(spec.get("expose") or [])
    work = "/tmp/work"
    os.mkdir(work, 0o700)
    return work


def prepare_workdir(spec: dict) -> str:
    workdir = setup_mounts(spec) if spec["mount_ns"] else spec["workdir"]
    if spec["uid"] is not None:
        os.chown(workdir, spec["uid"], spec["uid"])
    return workdir


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` from /proc (empty if unsupported)."""
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return kids


def kill_everything_else() -> None:
    """Kill every process this supervisor started (and their escaped descendants), then reap them."""
    for _ in range(5):
        if os.getpid() == 1:  # init of a private pid namespace: -1 means exactly our sandbox
            with contextlib.suppress(ProcessLookupError):
                os.kill(-1, signal.SIGKILL)
        else:  # subreaper: orphans are re-parented to us, so walking /proc finds them all
            stack, seen = _children(os.getpid()), set()
            while stack:
                pid = stack.pop()
                if pid not in seen:
                    seen.add(pid)
                    stack += _children(pid)
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
        if not _reap_all(1.0):
            return


def _reap_all(budget_s: float) -> bool:
    """Reap children until none is left; True if some are still alive after ``budget_s``."""
    end = time.monotonic() + budget_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            if time.monotonic() > end:
                return True
            time.sleep(0.005)


class Watch:
    """Collects one test child's output, enforces its wall deadline and output cap."""

    def __init__(self, pid: int, fds: dict, stdin_data: bytes, spec: dict) -> None:
        self.pid, self.spec = pid, spec
        self.out, self.err, self.status = bytearray(), bytearray(), bytearray()
        self.n_output = 0
        self.killed_for: str | None = None
        self.wait_status: int | None = None
        self.stdin_data, self.stdin_pos = stdin_data, 0
        self.sel = selectors.DefaultSelector()
        self.open_fds = [fds[name] for name in ("in", "out", "err", "status")]
        for name in ("out", "err", "status"):
            self.sel.register(fds[name], selectors.EVENT_READ, name)
        os.set_blocking(fds["in"], False)
        self.in_fd = fds["in"]
        if stdin_data:
            self.sel.register(self.in_fd, selectors.EVENT_WRITE, "in")
        else:
            self.close_stdin()
        self.pidfd = None
        try:
            self.pidfd = os.pidfd_open(pid)
            self.open_fds.append(self.pidfd)
            self.sel.register(self.pidfd, selectors.EVENT_READ, "pid")
        except (AttributeError, OSError):
            pass

    def run(self) -> None:
        deadline = time.monotonic() + float(self.spec["time_limit"])
        while self.wait_status is None:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill("timeout")
                break
            events = self.sel.select(left if self.pidfd is not None else min(left, 0.01))
            for key, _ in events:
                self.handle(key)
            if self.killed_for:
                break
            if self.pidfd is None:
                self.poll_exit()
        self.drain()
        self.close()

    def handle(self, key: selectors.SelectorKey) -> None:
        if key.data == "pid":
            self.poll_exit()
        elif key.data == "in":
            self.feed()
        else:
            self.read(key)

    def poll_exit(self) -> None:
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid:
            self.wait_status = status

    def feed(self) -> None:
        try:
            self.stdin_pos += os.write(self.in_fd, self.stdin_data[self.stdin_pos : self.stdin_pos + READ_CHUNK])
        except BlockingIOError:
            return
        except OSError:  # the program closed its stdin: stop feeding
            self.stdin_pos = len(self.stdin_data)
        if self.stdin_pos >= len(self.stdin_data):
            self.sel.unregister(self.in_fd)
            self.close_stdin()

    def close_stdin(self) -> None:
        """EOF for the program's stdin."""
        os.close(self.in_fd)
        self.open_fds.remove(self.in_fd)
        self.in_fd = None

    def read(self, key: selectors.SelectorKey) -> None:
        data = os.read(key.fd, READ_CHUNK)
        if not data:
            self.sel.unregister(key.fd)
            return
        if key.data == "status":
            if len(self.status) < STATUS_CAP:
                self.status += data
            return
        self.n_output += len(data)
        if key.data == "out":
            self.out += data
        else:
            self.err = (self.err + data)[-ERR_TAIL:]
        if self.n_output > int(self.spec["max_output_bytes"]):
            self.kill("output_limit")

    def drain(self) -> None:
        """Read what is already buffered in the pipes (descendants may keep them open: do not wait)."""
        for _ in range(64):
            events = [e for e in self.sel.select(0) if e[0].data in ("out", "err", "status")]
            if not events or self.killed_for == "output_limit":
                return
            for key, _ in events:
                self.read(key)

    def kill(self, reason: str) -> None:
        self.killed_for = self.killed_for or reason
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(self.pid, signal.SIGKILL)
        if self.wait_status is None:
            _, self.wait_status = os.waitpid(self.pid, 0)

    def close(self) -> None:
        self.sel.close()
        for fd in self.open_fds:
            os.close(fd)
        self.open_fds = []

    def records(self, nonce: str) -> list[dict]:
        """Status records of the child that carry the right nonce."""
        found = []
        for line in bytes(self.status).decode("utf-8", "replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("nonce") == nonce:
                found.append(rec)
        return found


def _signal_reason(sig: int) -> str:
    if sig in (signal.SIGXCPU,):
        return "timeout"
    if sig == signal.SIGXFSZ:
        return "output_limit"
    return "killed" if sig == signal.SIGKILL else "runtime_error"


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def _exc_reason(rec: dict) -> str:
    exc = rec.get("exc") or ""
    if exc == "MemoryError":
        return "memory"
    if "[Errno 27]" in str(rec.get("msg")):  # EFBIG: RLIMIT_FSIZE reached (Python ignores SIGXFSZ)
        return "output_limit"
    if exc in ("SyntaxError", "IndentationError", "TabError"):
        return "syntax_error"
    if exc == "SystemExit":
        return "exited"
    if exc == "AssertionError" and rec.get("phase") == "test":
        return "wrong_answer"
    return "runtime_error"


def _norm_output(text: str) -> str:
    return " ".join(text.split())


def verdict(watch: Watch, nonce: str, expected: str | None) -> tuple[bool, str, str]:
    """(passed, reason, detail) of one finished test child."""
    recs = watch.records(nonce)
    rec = recs[-1] if recs else None
    err = bytes(watch.err).decode("utf-8", "replace")[-500:]
    if watch.killed_for:
        return False, watch.killed_for, err
    status = watch.wait_status or 0
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return False, _signal_reason(sig), f"killed by signal {_signal_name(sig)}; {err}"
    if rec is not None and not rec.get("ok"):
        return False, _exc_reason(rec), f"{rec.get('exc')}: {rec.get('msg', '')}"[:500]
    code = os.WEXITSTATUS(status)
    if expected is None:  # function test: only an explicit record counts
        if rec is None:
            return False, "exited", f"no result record (exit code {code}); {err}"
        return True, "ok", ""
    if code != 0:
        return False, "runtime_error", f"exit code {code}; {err}"
    got = bytes(watch.out).decode("utf-8", "replace")
    if _norm_output(got) == _norm_output(expected):
        return True, "ok", ""
    return False, "wrong_answer", f"expected {_norm_output(expected)[:200]!r}, got {_norm_output(got)[:200]!r}"


def run_test(spec: dict, index: int, workdir: str, emit: Emitter) -> None:
    """Fork a child for test ``index``, supervise it, emit its verdict, clean up all processes."""
    stdio = spec["method"] == "stdio"
    test = spec["tests"][index]
    stdin_data = test["input"].encode() if stdio else b""
    test_nonce = secrets.token_hex(16)
    pipes = {name: os.pipe() for name in ("in", "out", "err", "status")}
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            child_main(spec, index, workdir, pipes, test_nonce)
        finally:
            os._exit(121)
    with contextlib.suppress(OSError):  # also from this side: a group kill can never miss the child
        os.setpgid(pid, pid)
    emit(event="start", test=index, pgid=pid)
    mine = {"in": pipes["in"][1], "out": pipes["out"][0], "err": pipes["err"][0], "status": pipes["status"][0]}
    for name, (r, w) in pipes.items():
        os.close(r if name == "in" else w)
    watch = Watch(pid, mine, stdin_data, spec)
    start = time.monotonic()
    watch.run()
    passed, reason, detail = verdict(watch, test_nonce, test["output"] if stdio else None)
    emit(event="result", test=index, passed=passed, reason=reason, detail=detail,
         seconds=round(time.monotonic() - start, 4))
    kill_everything_else()


# ----------------------------------------------------------------------------------------------- child side
def _apply_limits(spec: dict) -> None:
    cpu = int(float(spec["time_limit"])) + 1
    mem = int(spec["memory_mb"]) << 20
    limits = {
        resource.RLIMIT_CPU: (cpu, cpu + 1),
        resource.RLIMIT_AS: (mem, mem),
        resource.RLIMIT_FSIZE: (int(spec["max_file_bytes"]), int(spec["max_file_bytes"])),
        resource.RLIMIT_NPROC: (int(spec["nproc"]), int(spec["nproc"])),
        resource.RLIMIT_CORE: (0, 0),
        resource.RLIMIT_NOFILE: (256, 256),
    }
    for what, value in limits.items():
        resource.setrlimit(what, value)


def _drop_privileges(uid: int | None) -> None:
    if uid is None:
        return
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise RuntimeError("failed to drop privileges")


def _block_network() -> None:
    """Best effort when no network namespace is available: refuse to create sockets from Python.

    Subclasses (not plain functions) replace the socket types so modules that subclass them still import.
    """
    import _socket
    import socket

    def refusing(base: type) -> type:
        class NoSocket(base):
            def __init__(self, *_args, **_kwargs) -> None:
                raise PermissionError("network access is disabled in the sandbox")

        return NoSocket

    socket.socket = refusing(socket.socket)
    _socket.socket = refusing(_socket.socket)
    socket.SocketType = socket.socket


def _fresh_stdio() -> None:
    """New text streams over fds 0-2 (the supervisor's buffered stream objects must not leak)."""
    sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
    sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        open(2, "wb", buffering=0, closefd=False), encoding="utf-8", errors="replace", write_through=True  # noqa: SIM115
    )
    sys.argv = ["solution.py"]


def child_main(spec: dict, index: int, workdir: str, pipes: dict, nonce: str) -> None:
    """Isolate this forked child, then run the user code (and, for function tests, one test statement)."""
    os.setpgid(0, 0)
    os.dup2(pipes["in"][0], 0)
    os.dup2(pipes["out"][1], 1)
    os.dup2(pipes["err"][1], 2)
    os.dup2(pipes["status"][1], STATUS_FD)
    os.closerange(STATUS_FD + 1, 4096)
    _apply_limits(spec)
    os.chdir(workdir)
    os.environ["HOME"] = workdir
    os.umask(0o077)
    _drop_privileges(spec["uid"])
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if not spec["net_ns"]:
        _block_network()
    code, method = spec["code"], spec["method"]
    test = spec["tests"][index]["statement"] if method == "function" else None
    spec.clear()
    _fresh_stdio()
    execute(code, test, nonce)


def execute(code: str, test: str | None, nonce: str) -> None:
    """Run ``code`` (then ``test``) and write one status record; os._exit so nothing else runs after."""
    write, dumps, flush_out = os.write, json.dumps, sys.stdout.flush
    phase = "load" if test is not None else "run"
    record = {"nonce": nonce, "ok": True, "phase": phase}
    fallback = {  # pre-encoded: encoding may fail later when the program has used up all memory
        True: (dumps({**record, "phase": "run" if test is None else "test"}) + "\n").encode(),
        False: (dumps({**record, "ok": False, "exc": "MemoryError"}) + "\n").encode(),
    }
    try:
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        exec(compile(code, "solution.py", "exec"), namespace)
        if test is not None:
            record["phase"] = "test"
            exec(compile(test, "test", "exec"), namespace)
    except SystemExit as exc:
        if test is not None or exc.code not in (None, 0):
            record.update(ok=False, exc="SystemExit", msg=str(exc.code))
    except BaseException as exc:  # noqa: BLE001 - everything the program raises is a failed test
        record.update(ok=False, exc=type(exc).__name__, msg=_safe_str(exc))
    try:
        flush_out()
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001
        pass
    try:
        payload = (dumps(record) + "\n").encode()
    except BaseException:  # noqa: BLE001 - e.g. no memory left to encode the record
        payload = fallback[bool(record["ok"])]
    write(STATUS_FD, payload)
    os._exit(0)


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)[:300]
    except BaseException:  # noqa: BLE001
        return ""


# ------------------------------------------------------------------------------------------------------ main
def main() -> None:
    spec = json.loads(sys.stdin.buffer.read())
    emit = Emitter(spec.pop("nonce"))
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    try:
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        workdir = prepare_workdir(spec)
    except Exception as exc:  # noqa: BLE001 - reported to the parent as an infrastructure failure
        emit(event="setup_error", msg=f"{type(exc).__name__}: {exc}")
        return
    try:
        for index in range(len(spec["tests"])):
            run_test(spec, index, workdir, emit)
    except Exception as exc:  # noqa: BLE001 - a bug of ours: reported as an infrastructure failure
        emit(event="setup_error", msg=f"runner failed: {type(exc).__name__}: {exc}")
        raise
    emit(event="done")


if __name__ == "__main__":
    main()
