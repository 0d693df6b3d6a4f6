"""Entry scripts run in processes forked from a warm interpreter, for the tests that start them again and again.

A fresh ``python eval.py`` spends ~10 s of a 2-core CPU importing torch, transformers and accelerate before it
reads its config, and the tests that run rl.py or eval.py many times (bad inputs, SIGKILL and resume, the
real-weights bench) spent most of their time there. Here one server process imports those modules once and forks
a child per run. Every run is still a process of its own: its own pid and exit code (-9 when SIGKILLed), its own
stdout and stderr, the script run as ``__main__`` (or ``-m module``) with the given arguments, working directory
and environment, and the atexit handlers at the end. What a fresh interpreter reads from the environment at
start-up (``PYTHONWARNINGS``, ``OMP_NUM_THREADS``) is applied in the child.

``run`` mirrors ``subprocess.run([sys.executable, *argv], capture_output=True, text=True)``; ``call`` mirrors
``subprocess.call`` with stdout and stderr going to one open file. Children of one server share its hash seed and
its unseeded random state; runs compared for independence (an interrupted run against an uninterrupted one) are
started from different servers. A server starts on first use, with the environment of that moment (variables that
libraries read at import, such as ``HF_HOME``, come from there), and ends with the tests, killing any child left.

    python tests/warm.py    # the server: requests on stdin, replies on stdout (one JSON object per line)
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what the entry scripts import on their way to their work (jobs.rl and jobs.sft pull in models, sample, train;
# transformers imports deepspeed when it saves a model)
PRELOAD = ("torch", "transformers", "accelerate", "deepspeed", "matplotlib", "jobs.rl", "jobs.evaluate", "jobs.sft",
           "models.a2d", "tests.rl_harness")


# ------------------------------------------------------------------------------------------ the server side

def _exit_code(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)  # sys.exit("message"), as the interpreter reports it
    return 1


def _become(req: dict) -> None:
    """In the forked child: take the request's files, directory and environment, run its script, exit."""
    code = 1
    try:
        code = _run_script(req)
    except BaseException:  # noqa: BLE001 - e.g. a missing working directory: reported, never back into the server
        traceback.print_exc()
    finally:
        os._exit(code)


def _run_script(req: dict) -> int:
    os.close(_REPLIES[0])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, req["out"]), (2, req["err"])):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(handle, fd)
        os.close(handle)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    if req["env"].get("PYTHONWARNINGS"):
        warnings._processoptions(req["env"]["PYTHONWARNINGS"].split(","))  # as the interpreter reads it
    if req["env"].get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(req["env"]["OMP_NUM_THREADS"]))
    argv, code = req["argv"], 0
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], req["cwd"]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:  # the interpreter ends by SIGINT then: exit code -2
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter does: print the traceback, exit 1
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined] - the interpreter joins non-daemon threads before atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        os.kill(pid, signal.SIGKILL)


_REPLIES: list[int] = []  # the server's reply pipe, moved off fd 1 so that nothing printed can corrupt it


def _reply(**msg) -> None:
    os.write(_REPLIES[0], (json.dumps(msg) + "\n").encode())


def serve() -> None:
    """Import ``PRELOAD``, then fork one child per request line; report each child's pid and exit code."""
    _REPLIES.append(os.dup(1))
    os.dup2(2, 1)
    for name in PRELOAD:
        __import__(name)
    import torch

    if torch.cuda.is_initialized():  # a forked child could not use CUDA then
        raise RuntimeError("a preloaded module initialised CUDA in the warm test server")
    _reply(ready=True)
    pending, alive = b"", set()
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the tests are done, or were stopped: no run outlives them
                for pid in alive:
                    _kill(pid)
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                req = json.loads(line)
                sys.stdout.flush()  # nothing of the server's buffered output may reach the child's files
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _become(req)
                alive.add(pid)
                _reply(id=req["id"], pid=pid)
        while alive:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            alive.discard(pid)
            _reply(pid=pid, code=os.waitstatus_to_exitcode(status))


# ------------------------------------------------------------------------------------------ the test side

class _Server:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        if json.loads(self.proc.stdout.readline() or "{}") != {"ready": True}:
            raise RuntimeError("the warm test server did not start")
        self.next_id, self.dead = 0, False
        self.pids: dict[int, int] = {}
        self.codes: dict[int, int] = {}
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.proc.stdin.close)

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.changed:
                if "id" in msg:
                    self.pids[msg["id"]] = msg["pid"]
                else:
                    self.codes[msg["pid"]] = msg["code"]
                self.changed.notify_all()
        with self.changed:  # the server is gone: nobody waits for ever
            self.dead = True
            self.changed.notify_all()

    def _alive(self) -> None:
        if self.dead:
            raise RuntimeError(f"the warm test server died (exit {self.proc.poll()})")

    def start(self, argv: list[str], cwd: Path | str, env: dict, out: Path, err: Path) -> int:
        with self.changed:
            self._alive()
            self.next_id += 1
            rid = self.next_id
            self.proc.stdin.write((json.dumps({"id": rid, "argv": list(argv), "cwd": str(cwd), "env": env,
                                               "out": str(out), "err": str(err)}) + "\n").encode())
            self.proc.stdin.flush()
            self.changed.wait_for(lambda: rid in self.pids or self.dead)
            self._alive()
            return self.pids.pop(rid)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self.changed:
            self.changed.wait_for(lambda: pid in self.codes or self.dead, timeout)
            if pid not in self.codes:
                self._alive()
            return self.codes.pop(pid, None)


_SERVERS: dict[str, _Server] = {}
_SERVERS_LOCK = threading.Lock()


def _server(name: str) -> _Server:
    with _SERVERS_LOCK:
        if name not in _SERVERS:
            _SERVERS[name] = _Server()
        return _SERVERS[name]


def _run_to_end(argv: list[str], cwd: Path | str, env: dict | None, out: Path, err: Path,
                timeout: float | None, server: str) -> int:
    if sys.platform != "linux":  # fork after importing torch is only safe on Linux (macOS: the ObjC runtime): fresh
        with open(out, "ab") as stdout, open(err, "ab") if err != out else contextlib.nullcontext(stdout) as stderr:
            return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, stdout=stdout, stderr=stderr,
                                  timeout=timeout).returncode
    warm = _server(server)
    pid = warm.start(argv, cwd, dict(os.environ if env is None else env), out, err)
    try:
        code = warm.wait(pid, timeout)
    except BaseException:  # e.g. the test was interrupted: as subprocess.run, leave no child running
        _kill(pid)
        raise
    if code is None:
        _kill(pid)
        warm.wait(pid, None)
        raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
    return code


def run(argv: list[str], cwd: Path | str, env: dict | None = None, timeout: float | None = None,
        server: str = "main") -> subprocess.CompletedProcess:
    """``argv`` (a script and its arguments, or ``-m module ...``) in a warm child of the server named ``server``;
    output captured as text. Children of one server share its hash seed and its unseeded random state: runs that
    a test compares for independence belong to different servers (fresh interpreters, seeds of their own)."""
    with tempfile.TemporaryDirectory(prefix="warm-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        code = _run_to_end(argv, cwd, env, out, err, timeout, server)
        text = [p.read_text(errors="replace") if p.exists() else "" for p in (out, err)]
    return subprocess.CompletedProcess([sys.executable, *argv], code, *text)


def call(cmd: list[str], cwd: Path | str, stdout, stderr=None, env: dict | None = None,
         timeout: float | None = None, server: str = "main") -> int:
    """``subprocess.call([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT)`` in a warm child."""
    if stderr is not subprocess.STDOUT:
        raise ValueError("warm.call sends stderr to stdout's file (stderr=subprocess.STDOUT)")
    argv = cmd[1:] if cmd[:1] == [sys.executable] else cmd
    stdout.flush()
    return _run_to_end(argv, cwd, env, Path(stdout.name), Path(stdout.name), timeout, server)


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # the checkout, as for `python eval.py`, not tests/
    serve()
