"""Sandbox supervisor (stdlib only), started by ``reward.sandbox`` as ``python -I -c <bootstrap>`` with this source
on stdin (so no path of the project appears on any command line), followed by the JSON job.

It optionally sets up private mounts (a minimal read-only root: the Python runtime, a private /tmp holding the
working directory, a few device nodes, a fresh /proc), then runs every test in a fresh forked child that applies
resource limits, drops privileges, installs a seccomp filter and only then executes the untrusted code. The
supervisor never executes user code and never holds an expected answer: it reports what each child did (the strict
encoding of a returned value, normalised stdout, or how it failed; see ``reward/verdicts.py``) on its own stdout,
which no child can reach, and the caller decides the verdict. While a test runs, the resident memory of all the
job's processes together is watched against the job's memory limit.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import io
import json
import operator
import os
import platform
import resource
import secrets
import selectors
import signal
import struct
import sys
import time
import types

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MNT_DETACH = 1, 32, 4096, 16384, 2
STATUS_FD = 3
READ_CHUNK = 65536
STATUS_CAP = 2 << 20
ERR_TAIL = 2000
VALUE_BUDGET = 1 << 20  # characters of a returned value's encoding
MEMORY_POLL_S = 0.02

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
    """Private tmpfs over the world-writable dirs and a fresh /proc (only inside a new mount+pid ns); then, where the
    kernel allows, a minimal read-only root instead of the host's filesystem."""
    size = f"size={int(spec['tmpfs_mb'])}m,mode=1777"
    for target in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        if os.path.isdir(target):
            _mount("tmpfs", target, "tmpfs", size)
    if os.getpid() == 1:
        _mount("proc", "/proc", "proc")
    if spec.get("minimal_root"):
        enter_minimal_root(size, spec.get("hide") or [])
    else:
        expose(spec.get("expose") or [])
    work = "/tmp/work"
    os.mkdir(work, 0o700)
    return work


RUNTIME_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
DEVICES = ("null", "zero", "full", "random", "urandom")
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}


def runtime_paths() -> list[str]:
    """Directories the interpreter needs: the system's and this Python's own prefix (when outside /usr)."""
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(
        sys.executable)))}
    return sorted(p for p in paths if p and not p.startswith("/usr/") and os.path.isdir(p))


def enter_minimal_root(tmp_opts: str, hide: list[str]) -> None:
    """Pivot into a fresh tmpfs root holding only the runtime (read-only), /tmp, /dev/shm, a few device nodes and
    /proc; the host's root is detached, so nothing of the project, data, home directories or /run is reachable.
    ``hide``: directories covered with an empty tmpfs should a runtime directory contain them (a project under
    /usr/src, say), unless the runtime itself lives inside one."""
    syscall_nr = PIVOT_ROOT.get(platform.machine())
    if syscall_nr is None:
        raise OSError(f"pivot_root: unknown syscall number on {platform.machine()}")
    root = "/tmp/.root"
    os.mkdir(root, 0o755)
    _mount("tmpfs", root, "tmpfs", "size=4m,mode=0755")
    for path in RUNTIME_DIRS:
        if os.path.islink(path):
            os.symlink(os.readlink(path), root + path)
        elif os.path.isdir(path):
            os.makedirs(root + path, 0o755)
            _bind(path, root + path)
    runtime = runtime_paths()
    for path in runtime:
        os.makedirs(root + path, 0o755, exist_ok=True)
        _bind(path, root + path)
    for path in hide:
        inside_runtime = any(r == path or r.startswith(path.rstrip("/") + "/") for r in runtime)
        if os.path.isdir(root + path) and not inside_runtime:
            _mount("tmpfs", root + path, "tmpfs", "size=4k,mode=0")
    os.makedirs(root + "/etc", 0o755)
    if os.path.isfile("/etc/ld.so.cache"):  # how the dynamic loader finds libraries (programs may start python3)
        _bind_file("/etc/ld.so.cache", root + "/etc/ld.so.cache")
    os.makedirs(root + "/dev/shm", 0o755)
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            _bind_file(f"/dev/{name}", f"{root}/dev/{name}", readonly=False)
    for name in ("tmp", "dev/shm"):
        os.makedirs(f"{root}/{name}", 0o1777, exist_ok=True)
        _mount("tmpfs", f"{root}/{name}", "tmpfs", tmp_opts)
    os.makedirs(root + "/proc", 0o555)
    _mount("proc", root + "/proc", "proc")
    os.chdir(root)
    if _libc.syscall(syscall_nr, b".", b".") != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pivot_root: {os.strerror(err)}")
    if _libc.umount2(b".", MNT_DETACH) != 0:  # the old root, stacked on top of the new one
        err = ctypes.get_errno()
        raise OSError(err, f"detaching the host root: {os.strerror(err)}")
    os.chdir("/")
    _mount("none", "/", "none", "", MS_REMOUNT | MS_RDONLY)


def _bind_file(source: str, target: str, readonly: bool = True) -> None:
    with open(target, "w"):
        pass
    _bind(source, target, readonly)


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
            for pid in descendants():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        if not _reap_all(1.0):
            return


def job_processes() -> list[int]:
    """Every process of the job but this supervisor (the whole private pid namespace, else our descendants)."""
    if os.getpid() == 1:
        return [int(p) for p in os.listdir("/proc") if p.isdigit() and p != "1"]
    return descendants()


def descendants() -> list[int]:
    """Our descendants, parents before children (walked through /proc/<pid>/task/*/children)."""
    stack, seen, order = _children(os.getpid()), set(), []
    while stack:
        pid = stack.pop()
        if pid not in seen:
            seen.add(pid)
            order.append(pid)
            stack += _children(pid)
    return order


PAGE = os.sysconf("SC_PAGE_SIZE")


def job_resident_bytes() -> int:
    """Resident memory of all the job's processes together (shared pages counted in each: an over-estimate)."""
    total = 0
    for pid in job_processes():
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            continue
    return total


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
        memory = int(self.spec["memory_mb"]) << 20
        wait = MEMORY_POLL_S if memory else 3600.0  # the job's memory is checked between events
        while self.wait_status is None:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill("timeout")
                break
            events = self.sel.select(min(left, wait) if self.pidfd is not None else min(left, 0.01))
            for key, _ in events:
                self.handle(key)
            if self.killed_for:
                break
            if memory and self.wait_status is None and job_resident_bytes() > memory:
                self.kill("memory")
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
    if exc in ("AssertionError", "UnsupportedValue") and rec.get("phase") == "test":
        return "wrong_answer"
    return "runtime_error"


def _norm_output(text: str) -> str:
    return " ".join(text.split())


def outcome(watch: Watch, nonce: str, probe: dict) -> tuple[str, str, dict]:
    """(reason, detail, what came back) of one finished test child; reason "ok" = it ran to completion, and the
    caller then judges what came back (a value's encoding or the normalised stdout)."""
    recs = watch.records(nonce)
    rec = recs[-1] if recs else None
    err = bytes(watch.err).decode("utf-8", "replace")[-300:]
    if watch.killed_for:
        return watch.killed_for, err, {}
    status = watch.wait_status or 0
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return _signal_reason(sig), f"killed by signal {_signal_name(sig)}; {err}", {}
    if rec is not None and not rec.get("ok"):
        return _exc_reason(rec), f"{rec.get('exc')}: {rec.get('msg', '')}"[:300], {}
    code = os.WEXITSTATUS(status)
    if probe["kind"] != "stdio":  # function test: only an explicit record counts
        if rec is None:
            return "exited", f"no result record (exit code {code}); {err}", {}
        return "ok", "", {"value": rec["value"]} if "value" in rec else {}
    if code != 0:
        return "runtime_error", f"exit code {code}; {err}", {}
    got = _norm_output(bytes(watch.out).decode("utf-8", "replace"))
    return "ok", "", {"stdout": got[: int(probe["keep"])]}


def run_test(spec: dict, index: int, workdir: str, emit: Emitter) -> None:
    """Fork a child for test ``index``, supervise it, report what it did, clean up all processes."""
    probe = spec["tests"][index]
    stdin_data = probe["input"].encode() if probe["kind"] == "stdio" else b""
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
    reason, detail, returned = outcome(watch, test_nonce, probe)
    emit(event="result", test=index, reason=reason, detail=detail, seconds=round(time.monotonic() - start, 4),
         **returned)
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


# seccomp: what a test program never needs. Keyrings (shared with the host: not namespaced), new namespaces (a new
# user namespace would hand the program capabilities inside it), mounts, tracing, kernel modules, bpf, perf.
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
DENIED_SYSCALLS = {  # name: (x86_64, aarch64)
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219), "unshare": (272, 97),
    "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "ptrace": (101, 117), "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "kexec_load": (246, 104), "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
}
CLONE = {"x86_64": 56, "aarch64": 220}
CLONE3 = 435  # its flags sit in a struct the filter cannot read: refused with ENOSYS, libc falls back to clone
CLONE_NEW_ANY = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
RET_ALLOW, RET_ERRNO, RET_KILL = 0x7FFF0000, 0x00050000, 0x80000000
EPERM, ENOSYS = 1, 38
LD_W_ABS, JEQ_K, JSET_K, JGE_K, RET_K = 0x20, 0x15, 0x45, 0x35, 0x06
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2


def seccomp_filter() -> bytes | None:
    """The classic-BPF program of the filter for this machine's architecture (None where unknown)."""
    machine = platform.machine()
    if machine not in AUDIT_ARCH:
        return None
    col = 0 if machine == "x86_64" else 1
    denied = [nrs[col] for nrs in DENIED_SYSCALLS.values()]
    prog = [(LD_W_ABS, 0, 0, 4), (JEQ_K, 1, 0, AUDIT_ARCH[machine]), (RET_K, 0, 0, RET_KILL),
            (LD_W_ABS, 0, 0, 0)]
    if machine == "x86_64":  # the x32 ABI (numbers from 0x40000000) is never used by the sandbox's Python
        prog.append((JGE_K, 0, 1, 0x40000000))
        prog.append((RET_K, 0, 0, RET_ERRNO | EPERM))
    for nr in denied:
        prog += [(JEQ_K, 0, 1, nr), (RET_K, 0, 0, RET_ERRNO | EPERM)]
    prog += [(JEQ_K, 0, 1, CLONE3), (RET_K, 0, 0, RET_ERRNO | ENOSYS),
             (JEQ_K, 0, 3, CLONE[machine]), (LD_W_ABS, 0, 0, 16),  # clone's flags (low 32 bits of args[0])
             (JSET_K, 0, 1, CLONE_NEW_ANY), (RET_K, 0, 0, RET_ERRNO | EPERM),
             (RET_K, 0, 0, RET_ALLOW)]
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def install_seccomp() -> None:
    """Load the filter (no_new_privs first, so it needs no privilege); every thread and child inherits it."""
    code = seccomp_filter()
    buf = ctypes.create_string_buffer(code)
    fprog = struct.pack("HxxxxxxP", len(code) // 8, ctypes.addressof(buf))
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    arg = ctypes.create_string_buffer(fprog)
    if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_void_p(ctypes.addressof(arg)), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


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
    code, probe, seccomp = spec["code"], spec["tests"][index], spec.get("seccomp")
    spec.clear()
    if seccomp:
        install_seccomp()
    _fresh_stdio()
    execute(code, probe, nonce)


def execute(code: str, probe: dict, nonce: str) -> None:
    """Run ``code`` then the probe (value: setup + an expression whose value is sent back strictly encoded; stmt: a
    statement with strict comparisons; stdio: nothing more) and write one status record; os._exit so nothing else
    runs after."""
    write, dumps, flush_out = os.write, json.dumps, sys.stdout.flush
    kind = probe["kind"]
    record = {"nonce": nonce, "ok": True, "phase": "run" if kind == "stdio" else "load"}
    fallback = {  # pre-encoded: encoding may fail later when the program has used up all memory
        True: (dumps({**record, "phase": "test" if kind == "stmt" else "run"}) + "\n").encode(),
        False: (dumps({**record, "ok": False, "exc": "MemoryError"}) + "\n").encode(),
    }
    try:
        # a real module: pickle (multiprocessing) finds the program's functions and classes under __main__
        main = types.ModuleType("__main__")
        main.__builtins__ = builtins
        sys.modules["__main__"] = main
        namespace = main.__dict__
        exec(compile(code, "solution.py", "exec"), namespace)
        record["phase"] = "test"
        namespace.update(__strict_compare__=strict_compare)
        if kind == "value":
            exec(compile(probe["setup"], "test", "exec"), namespace)
            record["value"] = encode_value(eval(compile(probe["expr"], "test", "eval"), namespace))
        elif kind == "stmt":
            exec(compile(probe["statement"], "test", "exec"), namespace)
    except SystemExit as exc:
        if kind != "stdio" or exc.code not in (None, 0):
            record.update(ok=False, exc="SystemExit", msg=str(exc.code))
    except BaseException as exc:  # noqa: BLE001 - everything the program raises is a failed test
        record.update(ok=False, exc=_type(exc).__name__, msg=_safe_str(exc))
    try:
        flush_out()
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001
        pass
    try:
        payload = (dumps(record) + "\n").encode()
    except BaseException:  # noqa: BLE001 - e.g. no memory left to encode the record
        payload = fallback[bool(record["ok"])] if "value" not in record else fallback[False]
    write(STATUS_FD, payload)
    os._exit(0)


# --------------------------------------------------------------------------------- strict values (child side)
# Captured before any program runs: a program that rebinds builtins or collections cannot change what these are.
_type, _len, _repr, _isinstance, _issubclass = type, len, repr, isinstance, issubclass
_SEQUENCES = {list: "l", tuple: "t", set: "S", frozenset: "F"}
_SCALARS = (bool, int, float, complex, str, bytes)
# A subclass of a builtin (a namedtuple, an IntEnum, numpy's float64) is read through the builtin's own C slots: the
# copy holds what the object stores, and no method of the subclass (an ``__eq__`` that is always true) runs.
_BASE_READERS = ((int, int.__index__), (float, float.__float__), (complex, complex.__complex__),
                 (str, str.__str__), (bytes, bytes.__bytes__), (tuple, lambda v: tuple(tuple.__iter__(v))),
                 (list, lambda v: list(list.__iter__(v))), (frozenset, lambda v: frozenset(frozenset.__iter__(v))),
                 (set, lambda v: set(set.__iter__(v))))
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: set on every class created by Python code
_ORDERING = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge}


class UnsupportedValue(Exception):
    """A value that is not made of builtin types (an object with an equality of its own)."""


def builtin_copy(value):
    """``value`` when its type is an exact builtin (or a dict, whose items are read with ``dict.items``); the builtin
    part of a subclass of one; a numpy scalar's ``item()``; else UnsupportedValue. Containers' items are not
    converted here: the callers walk them."""
    t = _type(value)
    if value is None or t in _SCALARS or t in _SEQUENCES or _issubclass(t, dict):
        return value
    for base, read in _BASE_READERS:
        if _issubclass(t, base):
            return read(value)
    # numpy's scalars are C types (not heap types, metaclass ``type``), whose attributes no program can replace
    if _type(t) is type and not t.__flags__ & _HEAP_TYPE and t.__module__ == "numpy" and hasattr(t, "item"):
        try:
            out = t.item(value)
        except Exception:  # noqa: BLE001 - e.g. an array of several elements: no single value
            out = None
        if _type(out) in _SCALARS:
            return out
    raise UnsupportedValue(f"returned a {t.__name__}, not a builtin value")


def encode_value(value, depth: int = 0, budget: list | None = None):
    """Tagged JSON-able form of a value made of builtin types (bool, int, float, complex, str, bytes, None, list,
    tuple, set, frozenset, dict; their subclasses and numpy's scalars as the builtin value they hold); anything else
    raises UnsupportedValue: such a value could compare equal to anything."""
    budget = [VALUE_BUDGET] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0 or depth > 100:
        raise UnsupportedValue("the returned value is too large or too deeply nested")
    value = builtin_copy(value)
    t = _type(value)
    if value is None:
        return ["N"]
    if t is bool:
        return ["b", value]
    if t is int:
        text = int.__format__(value, "x")  # hexadecimal: no digit limit (str() refuses ints over 4,300 digits)
    elif t is float:
        text = _repr(value)
    elif t is complex:
        budget[0] -= 64
        return ["c", _repr(value.real), _repr(value.imag)]
    elif t is str:
        text = value
    elif t is bytes:
        text = value.hex()
    elif t in _SEQUENCES:
        return [_SEQUENCES[t], [encode_value(v, depth + 1, budget) for v in value]]
    else:  # a dict
        return ["d", [[encode_value(k, depth + 1, budget), encode_value(v, depth + 1, budget)]
                      for k, v in dict.items(value)]]
    budget[0] -= _len(text)
    if budget[0] < 0:
        raise UnsupportedValue("the returned value is too large")
    tag = {int: "i", float: "f", str: "s", bytes: "y"}[t]
    return [tag, text]


def canonical(value, depth: int = 0):
    """A copy of ``value`` rebuilt from exact builtin types (UnsupportedValue otherwise)."""
    if depth > 100:
        raise UnsupportedValue("too deeply nested")
    value = builtin_copy(value)
    t = _type(value)
    if value is None or t in _SCALARS:
        return value
    if t in _SEQUENCES:
        return t(canonical(v, depth + 1) for v in value)
    return {canonical(k, depth + 1): canonical(v, depth + 1) for k, v in dict.items(value)}


def strict_eq(a, b) -> bool:
    """``a == b`` decided on builtin copies: a custom ``__eq__`` never runs."""
    try:
        return canonical(a) == canonical(b)
    except UnsupportedValue:
        return False


def strict_in(a, b) -> bool:
    try:
        return canonical(a) in canonical(b)
    except (UnsupportedValue, TypeError):
        return False


def strict_compare(operands: list, ops: tuple) -> bool:
    """A comparison (a chain ``a < b < c`` too) decided pair by pair on builtin copies. An ordering of values that
    are not builtin raises (the test fails), as does one of unorderable builtins (TypeError, as Python's)."""
    for a, b, op in zip(operands, operands[1:], ops):
        if op == "is" or op == "is not":
            holds = (a is b) == (op == "is")
        elif op == "eq" or op == "ne":
            holds = strict_eq(a, b) == (op == "eq")
        elif op == "in" or op == "not in":
            holds = strict_in(a, b) == (op == "in")
        else:
            holds = _ORDERING[op](canonical(a), canonical(b))
        if not holds:
            return False
    return True


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
