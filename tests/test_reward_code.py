"""Sandboxed code execution: correct scoring, containment of hostile programs, and a pool that survives them."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

from reward.sandbox import (
    CodeJob,
    SandboxConfig,
    code_from_response,
    extract_code,
    run_many,
    run_program,
    sandbox_capabilities,
)

CFG = SandboxConfig(memory_mb=256, max_output_bytes=1 << 16)
CAPS = sandbox_capabilities()
REPO = Path(__file__).resolve().parent.parent
TESTS = ["assert f(1) == 2", "assert f(5) == 6"]
GOOD = CodeJob("def f(x):\n    return x + 1\n", "function", TESTS, time_limit=2)
GOOD_STDIO = CodeJob("a, b = map(int, input().split())\nprint(a + b)\n", "stdio",
                     test_input=["1 2\n", "10 -3\n"], test_output=["3\n", "7"], time_limit=2)
# What each check needs (see reward/sandbox.py for the modes); the full set holds when run as root.
needs_uid_drop = pytest.mark.skipif(not CAPS["uid_drop"], reason=f"mode {CAPS['mode']}: program runs as our uid")
needs_private_proc = pytest.mark.skipif(not (CAPS["uid_drop"] or CAPS["mount_ns"]),
                                        reason=f"mode {CAPS['mode']}: /proc of our processes is readable")
needs_signal_isolation = pytest.mark.skipif(not (CAPS["uid_drop"] or CAPS["pid_ns"]),
                                            reason=f"mode {CAPS['mode']}: kill(-1) would reach our processes")


def run_then_good(job: CodeJob, stdio: bool = False):
    """Run a hostile job, then correct ones in the same pool; the correct ones must still pass."""
    bad, *good = run_many([job, GOOD, GOOD_STDIO] if stdio else [job, GOOD], max_workers=1, config=CFG)
    assert all(g.all_passed and g.reason == "ok" for g in good), good
    return bad


def fn_job(code: str, tests: list[str] = TESTS, time_limit: float = 2.0) -> CodeJob:
    """Function-test job; generous default limit so a loaded CI machine does not time out correct code."""
    return CodeJob(code, "function", tests, time_limit=time_limit)


# ----------------------------------------------------------------------------------------------- extraction
def test_extract_code_takes_last_python_block():
    text = "first\n```python\nx = 1\n```\nthen\n```python\ndef f(x):\n    return x\n```\n```\nnot python\n```"
    assert extract_code(text) == "def f(x):\n    return x"
    assert extract_code("```py\nprint(1)\n```") == "print(1)"
    assert extract_code("no code") is None
    assert extract_code("```python\n\n```") is None


def test_code_from_response_with_prefix():
    assert code_from_response("    return x * 2\n```\nDone.", "def f(x):\n") == "def f(x):\n    return x * 2"
    assert code_from_response("```python\ndef f(x):\n    return 1\n```", "") == "def f(x):\n    return 1"
    assert code_from_response("    return 3\n```", "```python\ndef f(x):\n") == "def f(x):\n    return 3"
    assert code_from_response("just words", "") is None


# ----------------------------------------------------------------------------------------- correct scoring
def test_correct_function_and_stdio_solutions_pass():
    fn, stdio = run_many([GOOD, GOOD_STDIO], max_workers=2, config=CFG)
    assert (fn.pass_fraction, fn.reason, fn.passed, fn.total) == (1.0, "ok", 2, 2)
    assert (stdio.pass_fraction, stdio.reason) == (1.0, "ok")


def test_each_test_is_judged_separately():
    job = fn_job("def f(x):\n    while x == 3:\n        pass\n    return x + 1\n",
                 ["assert f(1) == 2", "assert f(3) == 4", "assert f(2) == 4", "assert f(9) == 10"], time_limit=1)
    res = run_program(job, CFG)
    assert [t.passed for t in res.tests] == [True, False, False, True]
    assert [t.reason for t in res.tests] == ["ok", "timeout", "wrong_answer", "ok"]
    assert res.pass_fraction == 0.5 and res.reason == "timeout"


def test_tests_do_not_share_state():
    job = fn_job("seen = []\ndef f(x):\n    seen.append(x)\n    return len(seen)\n",
                 ["assert f(0) == 1", "assert f(0) == 1"])
    assert run_program(job, CFG).all_passed


def test_stdio_wrong_answer_runtime_error_and_whitespace():
    jobs = [
        CodeJob("print(' 3 \\n')", "stdio", test_input=[""], test_output=["3"]),
        CodeJob("print(4)", "stdio", test_input=[""], test_output=["3"]),
        CodeJob("print(3)\nraise ValueError('late')", "stdio", test_input=[""], test_output=["3"]),
        CodeJob("import sys\nprint(sum(int(v) for v in sys.stdin.read().split()))", "stdio",
                test_input=["1 " * 200_000], test_output=["200000"]),
    ]
    res = run_many(jobs, max_workers=2, config=CFG)
    assert [r.reason for r in res] == ["ok", "wrong_answer", "runtime_error", "ok"]


def test_syntax_error_no_code_and_stdin_in_function_tests():
    syntax, no_code, reads = run_many([fn_job("def f(x) return x"), fn_job(""), fn_job("def f(x):\n"
                                       "    return int(input())")], config=CFG)
    assert syntax.reason == "syntax_error" and syntax.pass_fraction == 0
    assert no_code.reason == "no_code" and no_code.total == 2
    assert reads.reason == "runtime_error" and "EOFError" in reads.tests[0].detail


def test_from_task_uses_dataset_fields():
    task = {"test_method": "stdio", "test_input": ["2\n"], "test_output": ["4\n"], "test_time_limit": 2}
    job = CodeJob.from_task(task, "print(int(input()) * 2)")
    assert job.time_limit == 2.0 and run_program(job, CFG).all_passed
    with pytest.raises(ValueError, match="1 test inputs but 0 outputs"):
        CodeJob("print(1)", "stdio", test_input=["1"], test_output=[]).tests()


# ----------------------------------------------------------------------------------------- early exits
@pytest.mark.parametrize(
    "exit_code",
    ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit", "raise SystemExit(0)",
     "exit()", "import os, sys\nsys.stdout.flush()\nos.kill(os.getpid(), 9)"],
)
def test_exiting_early_passes_nothing(exit_code):
    """Gen-Verse/dLLM-RL reward/rl_execute.py: exiting at import time used to pass every test."""
    bad = run_then_good(fn_job("def f(x):\n    return x + 1\n" + exit_code))
    assert bad.pass_fraction == 0.0 and bad.passed == 0
    assert bad.reason in ("exited", "killed")


def test_exit_inside_a_test_fails_that_test():
    res = run_program(fn_job("import sys\ndef f(x):\n    if x == 5:\n        sys.exit(0)\n    return x + 1\n"), CFG)
    assert [t.reason for t in res.tests] == ["ok", "exited"]


def test_stdio_exit_before_output_fails():
    job = CodeJob("import sys\nsys.exit(0)\nprint(3)", "stdio", test_input=[""], test_output=["3"])
    assert run_program(job, CFG).reason == "wrong_answer"


def test_forged_result_record_is_ignored():
    forged = ('import os\nfor fd in range(3, 20):\n    try:\n        os.write(fd, b\'{"ok": true, "phase": "test", '
              '"nonce": "0"}\\n\')\n    except OSError:\n        pass\nos._exit(0)\n')
    bad = run_then_good(fn_job(forged))
    assert bad.pass_fraction == 0.0 and bad.reason == "exited"


# ----------------------------------------------------------------------------------------- resource limits
@pytest.mark.parametrize(
    ("code", "reasons", "time_limit"),
    [
        ("while True:\n    pass", {"timeout"}, 0.5),
        ("import time\ntime.sleep(100)", {"timeout"}, 0.5),
        ("x = bytearray(2 * 1024 ** 3)", {"memory"}, 3),
        ("a = []\nwhile True:\n    a.append(bytearray(10 ** 7))", {"memory", "killed"}, 3),
        ("while True:\n    print('x' * 1000)", {"output_limit"}, 3),
        ("import sys\nwhile True:\n    sys.stderr.write('y' * 1000)", {"output_limit"}, 3),
        ("open('big.bin', 'wb').write(b'0' * (64 << 20))", {"output_limit"}, 3),
    ],
    ids=["busy-loop", "sleep", "big-alloc", "growing-alloc", "stdout-flood", "stderr-flood", "big-file"],
)
def test_resource_limits(code, reasons, time_limit):
    bad = run_then_good(fn_job(code + "\ndef f(x):\n    return x + 1\n", time_limit=time_limit))
    assert bad.pass_fraction == 0.0
    assert bad.reason in reasons, bad.tests[0]


def _sandbox_uid_processes() -> list[str]:
    """Host processes still running under a sandbox uid (there must be none after a job)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        if uid >= CFG.uid_base and uid != 65534:
            found.append(entry)
    return found


@pytest.mark.parametrize(
    "code",
    ["import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
     "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(100)\n"],
    ids=["fork-bomb", "escaping-daemon"],
)
def test_process_explosions_are_contained_and_cleaned_up(code):
    bad = run_then_good(fn_job(code + "\ndef f(x):\n    return 0\n", time_limit=0.5))
    assert bad.pass_fraction == 0.0
    if CAPS["uid_drop"]:
        assert _sandbox_uid_processes() == []


# ------------------------------------------------------------------------------------------ isolation
@pytest.mark.parametrize(
    "where",
    [pytest.param("/tmp", marks=pytest.mark.skipif(not CAPS["mount_ns"], reason="no private /tmp")),
     pytest.param("/var/tmp", marks=pytest.mark.skipif(not CAPS["mount_ns"], reason="no private /var/tmp")),
     pytest.param(str(REPO), marks=needs_uid_drop)],
    ids=["tmp", "var-tmp", "repo"],
)
def test_writes_outside_the_workdir_do_not_reach_the_host(where):
    target = f"{where}/sandbox_probe_{uuid.uuid4().hex}"
    code = (f"import os\ntry:\n    open({target!r}, 'w').write('x')\nexcept OSError:\n    pass\n"
            "open('inside.txt', 'w').write('fine')\ndef f(x):\n    return x + 1 if open('inside.txt').read() == 'fine'"
            " else 0\n")
    try:
        res = run_then_good(fn_job(code))
        assert res.all_passed  # writing its own working directory is allowed
        assert not os.path.exists(target)
    finally:
        Path(target).unlink(missing_ok=True)


@needs_uid_drop
def test_deleting_host_files_is_contained(tmp_path):
    victims = [tmp_path / "keep.txt", REPO / f".sandbox-victim-{uuid.uuid4().hex}" / "keep.txt"]
    try:
        for victim in victims:
            victim.parent.mkdir(exist_ok=True)
            victim.parent.chmod(0o755)
            victim.write_text("precious")
            victim.chmod(0o644)
        code = (f"import os, shutil\nfor p in {[str(v) for v in victims]!r}:\n    try:\n        os.remove(p)\n"
                "    except OSError:\n        pass\n    shutil.rmtree(os.path.dirname(p), ignore_errors=True)\n"
                "def f(x):\n    return x + 1\n")
        run_then_good(fn_job(code))
        assert [v.read_text() for v in victims] == ["precious", "precious"]
    finally:
        victims[1].unlink(missing_ok=True)
        victims[1].parent.rmdir()


def test_environment_secrets_do_not_leak(monkeypatch):
    monkeypatch.setenv("MY_SECRET", "hunter2-value")
    code = "import os\ndef f(x):\n    return x + 1 if os.environ.get('MY_SECRET') == 'hunter2-value' else 0\n"
    bad = run_then_good(fn_job(code))
    assert bad.pass_fraction == 0.0 and bad.reason == "wrong_answer"


@needs_private_proc
def test_other_processes_environments_are_not_readable(monkeypatch):
    monkeypatch.setenv("MY_SECRET", "hunter2-value")
    code = ("import os\ndef f(x):\n    for p in os.listdir('/proc'):\n        try:\n"
            "            if b'hunter2-value' in open(f'/proc/{p}/environ', 'rb').read():\n"
            "                return x + 1\n        except OSError:\n            pass\n    return 0\n")
    bad = run_then_good(fn_job(code))
    assert bad.pass_fraction == 0.0


def test_network_is_unreachable():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        assert_never_connects(server, f"import socket\ndef f(x):\n    socket.create_connection(('127.0.0.1', {port}), "
                                      "timeout=1).close()\n    return x + 1\n")
    finally:
        server.close()


def assert_never_connects(server: socket.socket, code: str) -> None:
    """The program's connection attempt fails (a runtime error, no pass) and never reaches ``server``."""
    server.listen(5)
    server.settimeout(0.3)
    bad = run_then_good(fn_job(code))
    assert bad.pass_fraction == 0.0 and bad.reason == "runtime_error"
    with pytest.raises(TimeoutError):
        server.accept()


@pytest.mark.parametrize(
    "code",
    ["import os\nos.killpg(0, 9)", "import os\nos.kill(os.getppid(), 9)", "import os, signal\n"
     "os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
     pytest.param("import os\nos.kill(-1, 9)", marks=needs_signal_isolation)],
    ids=["killpg-self", "kill-parent", "killpg-parent", "kill-all"],
)
def test_programs_killing_their_parents_do_not_hurt_the_pool(code):
    bad = run_then_good(fn_job(code + "\ndef f(x):\n    return x + 1\n"), stdio=True)
    if "killpg(0" in code:
        assert bad.pass_fraction == 0.0
    assert run_program(GOOD, CFG).all_passed


def test_fallback_mode_still_scores_correctly():
    """Without namespaces (isolation="none") verdicts are the same; only containment is weaker."""
    cfg = SandboxConfig(isolation="none", memory_mb=256)
    good, exits, wrong = run_many([GOOD, fn_job("def f(x):\n    return x + 1\nimport sys\nsys.exit(0)"),
                                   fn_job("def f(x):\n    return x")], config=cfg)
    assert good.all_passed and exits.pass_fraction == 0.0 and wrong.reason == "wrong_answer"


def test_run_many_keeps_input_order():
    jobs = [fn_job(f"def f(x):\n    return x + {k % 2}\n") for k in range(6)]
    assert [r.pass_fraction for r in run_many(jobs, max_workers=3, config=CFG)] == [0.0, 1.0] * 3


def test_infrastructure_failures_are_flagged_not_scored_as_wrong(monkeypatch, caplog):
    from reward import sandbox

    original = sandbox._spec
    monkeypatch.setattr(sandbox, "_spec", lambda *args: {**original(*args), "time_limit": "not-a-number"})
    res = run_program(GOOD, CFG)
    assert res.reason == "sandbox_error" and res.pass_fraction == 0.0
    assert "sandbox infrastructure failure" in caplog.text


needs_ipc_ns = pytest.mark.skipif(not CAPS.get("ipc_ns"), reason=f"mode {CAPS['mode']}: no IPC namespace")


@needs_ipc_ns
def test_ipc_objects_do_not_outlive_the_job():
    """SysV shared memory and message queues created by a program die with its IPC namespace."""
    import ctypes

    key = 0x5EED0000 + (os.getpid() % 0xFFFF)
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"shm = libc.shmget({key}, 1 << 20, 0o1000 | 0o600)\nmsq = libc.msgget({key}, 0o1000 | 0o600)\n"
            "def f(x):\n    return x + 1 if shm >= 0 and msq >= 0 else -1\n")
    res = run_then_good(fn_job(code))
    assert res.all_passed  # the program could create both objects inside its namespace
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.shmget(key, 0, 0) == -1 and libc.msgget(key, 0) == -1  # ... and none reached the host


def test_describe_sandbox_names_the_mode_and_its_gaps():
    from reward.sandbox import describe_sandbox

    line = describe_sandbox()
    assert f"mode {CAPS['mode']!r}" in line and "known gaps" in line and "\n" not in line
    if not CAPS.get("ipc_ns"):
        assert "no IPC namespace" in line


# ------------------------------------------------------------------ verdicts no program can forge (issue classes)
needs_minimal_root = pytest.mark.skipif(not CAPS["minimal_root"], reason=f"mode {CAPS['mode']}: host files visible")
needs_seccomp = pytest.mark.skipif(not CAPS["seccomp"], reason="no seccomp filter on this machine")
ALWAYS_EQUAL = "class Yes:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"


@pytest.mark.parametrize("test", ["assert add(1, 2) == 3", "assert 3 == add(1, 2)", "assert add(1, 2) == 1 + 2",
                                  "assert add(1, 2) in [3]", "r = add(1, 2)\nassert r == 3",
                                  "assert math.isclose(add(1, 2), 3.0)", "assert not add(1, 2) != 3"])
def test_an_object_equal_to_everything_passes_nothing(test):
    code = ALWAYS_EQUAL + "import math\ndef add(a, b):\n    return Yes()\n"
    bad = run_then_good(fn_job(code, [test]))
    assert bad.pass_fraction == 0.0 and bad.reason == "wrong_answer", bad.tests[0]


def test_subclasses_of_builtins_with_their_own_equality_pass_nothing():
    code = "class Int(int):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Int(0)\n"
    bad = run_then_good(fn_job(code, ["assert add(1, 2) == 3", "assert [add(1, 2)] == [3]"]))
    assert bad.pass_fraction == 0.0 and bad.reason == "wrong_answer"


LIAR = ("class Liar:\n    def __lt__(self, other):\n        return True\n"
        "    __le__ = __gt__ = __ge__ = __eq__ = __lt__\n"
        "    def __abs__(self):\n        return self\n    __sub__ = __rsub__ = lambda self, other: self\n"
        "    __hash__ = object.__hash__\ndef f(*args):\n    return Liar()\n")


@pytest.mark.parametrize("test", ["assert f(1) > 100", "assert f(1) >= 7", "assert 7 <= f(1)",
                                  "assert abs(3.5 - f(1)) < 1e-6", "assert abs(f(1) - 3.5) < 1e-6",
                                  "assert 0 < f(1) < 10", "assert f(1) == 5 == 5", "assert f(1) <= -5 and f(2) == 3",
                                  "assert abs(f(1) - f(2)) < 1e-6"])
def test_an_object_ordered_before_everything_passes_nothing(test):
    bad = run_then_good(fn_job(LIAR, [test]))
    assert bad.pass_fraction == 0.0, bad.tests[0]


def test_walking_frames_and_objects_finds_no_answer_to_forge():
    """The program searches its frames and every object of its process for the expected answer (and the nonce) and
    writes a forged success record with what it found: the answer never entered the process."""
    code = (
        "import gc, json, os, sys\n"
        "def add(a, b):\n"
        "    nonce, found = None, []\n"
        "    frame = sys._getframe()\n"
        "    while frame is not None:\n"
        "        for v in list(frame.f_locals.values()):\n"
        "            if isinstance(v, str) and len(v) == 32:\n"
        "                nonce = v\n"
        "        frame = frame.f_back\n"
        "    for obj in gc.get_objects():\n"
        "        text = obj if isinstance(obj, str) else repr(obj) if isinstance(obj, (dict, list, tuple)) else ''\n"
        "        if '918273' in text and 'add(' not in text:\n"
        "            found.append(text)\n"
        "    if nonce:\n"
        "        value = found[0] if found else '0'\n"
        "        os.write(3, (json.dumps({'nonce': nonce, 'ok': True, 'phase': 'test',\n"
        "                                 'value': ['i', value]}) + '\\n').encode())\n"
        "        os._exit(0)\n"
        "    return 0\n"
    )
    bad = run_then_good(fn_job(code, ["assert add(1, 2) == 918273645"]))
    assert bad.pass_fraction == 0.0 and bad.reason == "wrong_answer", bad.tests[0]


def test_stdio_expected_output_never_reaches_the_program():
    code = ("import gc\nseen = any('secret-answer-77' in o for o in gc.get_objects() if isinstance(o, str))\n"
            "print('secret-answer-77' if seen else 'nothing')\n")
    job = CodeJob(code, "stdio", test_input=["x\n"], test_output=["secret-answer-77\n"], time_limit=2)
    bad = run_then_good(job, stdio=True)
    assert bad.pass_fraction == 0.0 and bad.reason == "wrong_answer"


def test_memory_spread_over_processes_counts_against_the_job():
    """Four processes of 120 MB each stay under the per-process limit (256 MB) but not under the job's."""
    code = ("import os, time\nkids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
            "        block = b'x' * (120 << 20)\n        time.sleep(10)\n        os._exit(0)\n    kids.append(pid)\n"
            "for pid in kids:\n    os.waitpid(pid, 0)\ndef f(x):\n    return x + 1\n")
    bad = run_then_good(fn_job(code, time_limit=5.0))
    assert bad.pass_fraction == 0.0 and bad.reason == "memory", bad.tests[0]
    if CAPS["uid_drop"]:
        assert _sandbox_uid_processes() == []


@needs_minimal_root
def test_the_checkout_and_host_files_are_not_readable():
    code = (f"import os\nrepo = {str(REPO)!r}\nleaks = []\n"
            "for path in [repo + '/README.md', '/etc/hostname', '/etc/passwd', '/run', '/home', '/work', '/sys']:\n"
            "    try:\n        leaks.append(open(path).read()[:10] if os.path.isfile(path) else os.listdir(path))\n"
            "    except OSError:\n        pass\n"
            "for pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
            "    try:\n        if repo.encode() in open(f'/proc/{pid}/cmdline', 'rb').read():\n"
            "            leaks.append(pid)\n    except OSError:\n        pass\n"
            "def f(x):\n    return x + 1 if leaks else -1\n")
    bad = run_then_good(fn_job(code))
    assert bad.pass_fraction == 0.0 and bad.reason == "wrong_answer", bad.tests[0]
    # ... while the runtime still works: stdlib imports, its own files, /dev/null, subprocesses of python3
    ok = ("import fractions, json, os, subprocess, sys\nopen('mine.txt', 'w').write('1')\n"
          "open('/dev/null', 'w').write('x')\n"
          "out = subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True).stdout\n"
          "def f(x):\n    return x + 1 if open('mine.txt').read() == '1' and out.strip() == '42' else -1\n")
    assert run_program(fn_job(ok), CFG).all_passed


@needs_minimal_root
def test_unix_sockets_created_outside_are_unreachable(tmp_path_factory):
    sock_dir = REPO / f".sock-{uuid.uuid4().hex[:8]}"
    sock_dir.mkdir()
    path = str(sock_dir / "s")
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(path)
        os.chmod(sock_dir, 0o777)
        os.chmod(path, 0o777)
        assert_never_connects(server, f"import socket\ndef f(x):\n    s = socket.socket(socket.AF_UNIX)\n"
                                      f"    s.connect({path!r})\n    return x + 1\n")
    finally:
        server.close()
        Path(path).unlink(missing_ok=True)
        sock_dir.rmdir()


@needs_seccomp
def test_keyrings_and_new_namespaces_are_refused():
    import platform

    add_key = {"x86_64": 248, "aarch64": 217}[platform.machine()]
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"key = libc.syscall({add_key}, b'user', b'dllm-probe', b'secret', 6, -4)\n"
            "userns = libc.unshare(0x10000000)\n"
            "def f(x):\n    return x + 1 if key >= 0 or userns == 0 else -1\n")
    bad = run_then_good(fn_job(code))
    assert bad.pass_fraction == 0.0 and bad.reason == "wrong_answer", bad.tests[0]


@pytest.mark.parametrize(("code", "tests"), [
    ("def f(x):\n    print('working', x)\n    return x * 2\n", ["assert f(2) == 4", "assert f(-1) == -2"]),
    ("def f(s):\n    return s.upper()\n", ["assert f('ab') == 'AB'", "assert f('') == ''"]),
    ("def f(n):\n    return list(range(n))\n", ["assert f(3) == [0, 1, 2]", "assert f(0) == []"]),
    ("def f(n):\n    return (n, {'k': [n]}, {n}, None, True)\n", ["assert f(1) == (1, {'k': [1]}, {1}, None, True)"]),
    ("def f(x):\n    return x / 3\n", ["assert f(1.5) == 0.5", "assert math.isclose(f(1), 0.33333333, rel_tol=1e-6)",
                                      "assert abs(f(1) - 0.3333) < 1e-3", "assert f(3) == 1"]),
    ("from collections import defaultdict, Counter\ndef f(s):\n    d = defaultdict(int)\n    for c in s:\n"
     "        d[c] += 1\n    return d\ndef g(s):\n    return Counter(s)\n",
     ["assert f('aab') == {'a': 2, 'b': 1}", "assert g('ab') == {'a': 1, 'b': 1}"]),
    ("def is_even(n):\n    return n % 2 == 0\n", ["assert is_even(4)", "assert not is_even(3)",
                                                   "assert is_even(2) is True", "assert is_even(2) == True"]),
    ("class Solution:\n    def twice(self, x):\n        return 2 * x\n",
     ["s = Solution()\nassert s.twice(4) == 8", "assert Solution().twice(2) == 2 + 2",
      "for k in range(3):\n    assert Solution().twice(k) == 2 * k"]),
    ("def f(n):\n    return 2 ** n\n", ["assert f(200) == " + str(2 ** 200)]),
    ("def f(b):\n    return b[::-1]\n", ["assert f(b'ab') == b'ba'", "assert f('x') in ['x', 'y']"]),
    ("def f(n):\n    return 10 ** n\n", ["assert f(5000) == 10 ** 5000", "assert f(5000)", "assert f(5000) > 0"]),
    ("def f(x):\n    return x + 1\n", ["assert f(1) > 1", "assert 0 < f(1) < 3", "assert f(1) == 2 == 2",
                                     "assert [f(k) for k in range(3)] > [0]"]),
    ("import collections, enum\nP = collections.namedtuple('P', 'x y')\nclass E(enum.IntEnum):\n    A = 1\n"
     "def f():\n    return P(1, 2)\ndef g():\n    return E.A\n",
     ["assert f() == (1, 2)", "assert g() == 1", "assert [g()] == [1]"]),
    ("import pickle\ndef sq(x):\n    return x * x\nclass A:\n    pass\n"
     "def f():\n    return pickle.loads(pickle.dumps(sq))(3), type(pickle.loads(pickle.dumps(A()))).__name__\n",
     ["assert f() == (9, 'A')"]),  # a real __main__ module: pickle (multiprocessing) finds the program's names
])
def test_plain_answers_still_pass(code, tests):
    res = run_program(fn_job("import math\n" + code, tests), CFG)
    assert res.all_passed, res.tests


def test_numpy_results_count_as_their_values():
    pytest.importorskip("numpy")
    code = "import numpy as np\ndef f(xs):\n    return np.sum(xs)\ndef g(xs):\n    return np.mean(xs)\n"
    res = run_program(fn_job(code, ["assert f([1, 2]) == 3", "assert g([1, 2]) == 1.5", "assert f([1]) > 0",
                                    "assert f([1, 2]) == 4"], time_limit=10), CFG)
    assert [t.passed for t in res.tests] == [True, True, True, False], res.tests


@needs_minimal_root
def test_project_dirs_inside_runtime_dirs_are_hidden(monkeypatch):
    """A project living under a runtime directory (e.g. /usr/src/app in a container) is covered, not exposed."""
    from reward import sandbox

    if not os.listdir("/usr/share"):
        pytest.skip("/usr/share is empty here")
    code = "import os\ndef f(x):\n    return x + 1 if os.listdir('/usr/share') else -1\n"
    assert run_program(fn_job(code), CFG).all_passed  # visible by default: part of the runtime's /usr
    monkeypatch.setattr(sandbox, "_private_dirs", lambda: ["/usr/share"])
    hidden = run_program(fn_job(code), CFG)
    assert hidden.pass_fraction == 0.0 and hidden.reason == "runtime_error"  # PermissionError: nothing to list
    assert run_program(GOOD, CFG).all_passed  # the runtime itself still works
