"""system.keep_freed_memory: glibc keeps a freed large buffer in the process (core/allocator.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.allocator import _glibc, user_chose_malloc_settings
from jobs.config import SystemConfig

ROOT = Path(__file__).resolve().parents[1]

# A fresh interpreter mallocs 64 MiB, touches every page, frees it, and reports how much of it is still resident.
PROBE = """
import ctypes, ctypes.util, json, os, sys
sys.path.insert(0, sys.argv[1])
from core.allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[2] == "keep" else False
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
size = 64 << 20
before = rss()
buf = libc.malloc(size)
ctypes.memset(buf, 1, size)
touched = rss()
libc.free(buf)
print(json.dumps({"applied": applied, "touched": touched - before, "kept": rss() - before}))
"""


def _probe(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not user_chose_malloc_settings({k: v})}
    out = subprocess.run([sys.executable, "-c", PROBE, str(ROOT), mode], env={**clean, **env}, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


glibc_only = pytest.mark.skipif(_glibc() is None, reason="glibc's mallopt only")


@glibc_only
def test_a_freed_buffer_stays_resident_when_kept():
    kept, default = _probe("keep"), _probe("default")
    assert kept["applied"] and not default["applied"]
    assert kept["touched"] >= 60 << 20 and default["touched"] >= 60 << 20
    assert kept["kept"] >= 60 << 20  # on the heap, reused by the next buffer of its size
    assert default["kept"] < 8 << 20  # its own mapping, unmapped by free: the next one faults in afresh


@glibc_only
def test_the_users_own_malloc_settings_win():
    chosen = _probe("keep", MALLOC_MMAP_THRESHOLD_="65536")
    assert not chosen["applied"] and chosen["kept"] < 8 << 20
    assert not _probe("keep", GLIBC_TUNABLES="glibc.malloc.trim_threshold=0")["applied"]


def test_which_environments_count_as_the_users_choice():
    assert user_chose_malloc_settings({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert user_chose_malloc_settings({"GLIBC_TUNABLES": "glibc.elision.enable=1:glibc.malloc.mmap_threshold=1"})
    assert not user_chose_malloc_settings({"GLIBC_TUNABLES": "glibc.elision.enable=1", "MALLOC_ARENA": "x"})


def test_the_setting_decides_whether_a_job_keeps_freed_memory(monkeypatch):
    calls = []
    monkeypatch.setattr("jobs.config.keep_freed_memory", lambda: calls.append(1))
    SystemConfig().apply()
    SystemConfig(keep_freed_memory=False).apply()
    assert calls == [1]


def test_malloc_settings_in_system_env_reach_child_processes_only(monkeypatch, capsys):
    """glibc read its settings when this process started: a MALLOC_*_ in system.env is noted as reaching children
    only, and this process's choice is made on the environment it was launched with."""
    decided_on = []
    monkeypatch.setattr("jobs.config.keep_freed_memory", lambda: decided_on.append(user_chose_malloc_settings()))
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "0")  # restored afterwards: apply() writes os.environ
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"):
        monkeypatch.delenv(name, raising=False)
    system = SystemConfig(env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert "reach the job's child processes only" in capsys.readouterr().err
    system.apply()
    assert decided_on == [False] and os.environ["MALLOC_MMAP_THRESHOLD_"] == "65536"
    SystemConfig(env={"OTHER": "1"})
    assert "malloc" not in capsys.readouterr().err
