"""Shared fixtures: the offline demo tokenizer and tiny random models of every family."""

from __future__ import annotations

import json
import sys
import threading
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from core.allocator import keep_freed_memory
from models.tiny import build_tiny
from models.tokenizers import build_demo_tokenizer

warnings.filterwarnings("ignore", message=".*rope_scaling.*")
# Tiny models are overhead-bound: one thread is several times faster than two on a busy 2-core machine.
torch.set_num_threads(1)
# A job run in this process raises glibc's malloc thresholds for good (system.keep_freed_memory, on by default):
# raised from the start, no test's allocator state depends on which job test ran before it.
keep_freed_memory()

MODEL_BASES = ("sdar", "dream", "llada", "mmada")


def reset_accelerate_state() -> None:
    """accelerate keeps process-wide singletons; reset them so the next accelerator picks its own settings."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Every test starts without an earlier test's accelerator: accelerate refuses a second Accelerator whose mixed
    precision differs from the first in the process, so one test's bf16 trainer would fail the next fp32 one."""
    if "accelerate.state" in sys.modules:
        reset_accelerate_state()


@pytest.fixture
def bf16_products(monkeypatch):
    """bf16 CPU products forced wherever oneDNN runs them at all (``DLLM_CPU_BF16=1``, which child processes inherit):
    the bf16 paths (packed bf16 copies, bf16 autocast) run on tiny models whatever this CPU's speed at them."""
    from models.layers import native_cpu_bf16

    if not onednn_runs_bf16():
        pytest.skip("oneDNN runs no bf16 products on this CPU")
    monkeypatch.setenv("DLLM_CPU_BF16", "1")
    native_cpu_bf16.cache_clear()
    yield
    native_cpu_bf16.cache_clear()  # the next test decides again, under its own environment


def onednn_runs_bf16() -> bool:
    """Whether oneDNN runs bf16 products on this CPU at all (natively or by conversion)."""
    return bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())


@pytest.fixture(scope="session")
def demo_tokenizer():
    return build_demo_tokenizer()


@pytest.fixture
def tiny(demo_tokenizer):
    """Factory: ``tiny("sdar", seed=1, block_size=4)`` -> Adapter of a tiny fp32 model in eval mode."""

    def make(model_base: str, **kw):
        return build_tiny(model_base, demo_tokenizer, **kw)

    return make


class LoopbackJudge(BaseHTTPRequestHandler):
    """An OpenAI-compatible /v1/chat/completions that grades an excerpt by the parity of its length; it fails the
    first ``fail_first`` requests with HTTP 500 (``-1``: always)."""

    fail_first = 0
    requests: list = []

    def do_POST(self):  # noqa: N802 - the http.server hook name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        cls.requests.append((self.path, self.headers.get("Authorization"), body))
        if cls.fail_first < 0 or len(cls.requests) <= cls.fail_first:
            self.send_response(500)
            self.end_headers()
            return
        excerpt = body["messages"][-1]["content"].split("Excerpt to grade:\n")[1]
        grade = "\\boxed{1}" if len(excerpt) % 2 == 0 else "\\boxed{-1}"
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": grade}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge_endpoint():
    """Factory: ``judge_endpoint(fail_first=0)`` -> (base URL, handler class recording its requests)."""

    def start(fail_first: int = 0):
        handler = type("Judge", (LoopbackJudge,), {"fail_first": fail_first, "requests": []})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/v1", handler

    servers: list = []
    yield start
    for s in servers:
        s.shutdown()
        s.server_close()
