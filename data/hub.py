"""Evaluation / RL datasets on the Hugging Face Hub: the catalog, and a download stored validated as data/NAME.json.

Command line: ``python -m tools.download_data --dataset MATH500 [--out data/]``.

Source: dataset repo ``Gen-Verse/NAME``, file ``{split}/NAME.json`` (split ``train`` for the RL training sets,
``test`` otherwise; as Gen-Verse/dLLM-RL data/download_data.py). When a few seconds' probe cannot reach the hub, only
the local cache is read (a file missing there is a one-line error), instead of retrying the network for minutes.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from core.files import write_atomic
from data.formats import DataFormatError, validate_rows

# name -> (split, kind)
DATASETS: dict[str, tuple[str, str]] = {
    "MATH500": ("test", "math"),
    "MATH_train": ("train", "math"),
    "GSM8K": ("test", "math"),
    "AIME2024": ("test", "math"),
    "AIME2025": ("test", "math"),
    "LiveCodeBench": ("test", "code"),
    "MBPP": ("test", "code"),
    "HumanEval": ("test", "code"),
    "PrimeIntellect": ("train", "code"),
}
REPO_OWNER = "Gen-Verse"
CONNECT_TIMEOUT_S = 4.0


class DownloadError(RuntimeError):
    """Download or conversion failed; the message is meant to be shown as is."""


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def _offline_env() -> bool:
    """Offline mode set in the environment, as huggingface_hub and datasets read it."""
    return any(os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"))


def _probe_target() -> tuple[str, int]:
    """Host and port a first TCP connection must reach: the HTTPS proxy if one is set, else the hub."""
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlparse(proxy if proxy else _endpoint())
    return url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)


def check_reachable(timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise DownloadError unless a TCP connection to the hub (or proxy) opens within ``timeout_s``.

    Runs in a daemon thread because name resolution itself can block far longer than any socket timeout.
    """
    host, port = _probe_target()
    outcome: list[BaseException | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    worker.join(timeout_s + 0.5)
    if not outcome:
        raise DownloadError(f"cannot reach {host}:{port} within {timeout_s:.0f} s (no network?)")
    if outcome[0] is not None:
        raise DownloadError(f"cannot reach {host}:{port}: {outcome[0]} (no network?)")


@contextlib.contextmanager
def cache_only() -> Iterator[None]:
    """Within it, huggingface_hub and datasets read their local caches only, as under HF_HUB_OFFLINE=1 (both read
    that variable once, at import, so their flags are set here)."""
    import datasets.config
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def unreachable_hub() -> str | None:
    """Why the hub cannot be reached (one line), or None when it can or offline mode is set (then nothing is
    asked of the network)."""
    if _offline_env():
        return None
    try:
        check_reachable()
    except DownloadError as exc:
        return str(exc)
    return None


def fetch(name: str) -> Path:
    """Local path of ``{split}/{name}.json`` from the hub, or from the local cache when offline mode is set or the
    hub cannot be reached (then a note on stderr says so: the copy may be older than the hub's)."""
    split, _ = DATASETS[name]
    from huggingface_hub import hf_hub_download

    offline = _offline_env()
    unreachable = unreachable_hub()
    try:
        path = hf_hub_download(f"{REPO_OWNER}/{name}", f"{split}/{name}.json", repo_type="dataset",
                               etag_timeout=CONNECT_TIMEOUT_S, local_files_only=offline or bool(unreachable))
    except Exception as exc:  # noqa: BLE001 - hub errors are many; one clear line is what the user needs
        hint = (" (HF_HUB_OFFLINE is set and the file is not in the local cache)" if offline else
                f" ({unreachable}, and the file is not in the local cache)" if unreachable else "")
        raise DownloadError(f"download of {REPO_OWNER}/{name} failed{hint}: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    if unreachable:
        print(f"note: {unreachable}; {REPO_OWNER}/{name} read from the local cache", file=sys.stderr)
    return Path(path)


def convert(rows: list, kind: str, where: str) -> list[dict]:
    """Bring upstream rows to our format (string answers, default time limit) and validate them."""
    if not isinstance(rows, list):
        raise DownloadError(f"{where}: expected a JSON list of rows, got {type(rows).__name__}")
    out = []
    for row in rows:
        row = dict(row) if isinstance(row, dict) else row
        if isinstance(row, dict) and kind == "math" and isinstance(row.get("ground_truth_answer"), int | float):
            row["ground_truth_answer"] = str(row["ground_truth_answer"])
        out.append(row)
    try:
        return validate_rows(out, kind, where)
    except DataFormatError as exc:
        raise DownloadError(str(exc)) from None


def download(name: str, out_dir: str | Path = "data") -> Path:
    """Download, convert and validate dataset ``name``; returns the written ``out_dir/name.json``."""
    if name not in DATASETS:
        raise DownloadError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    source = fetch(name)
    rows = convert(json.loads(source.read_text(encoding="utf-8")), DATASETS[name][1], f"{REPO_OWNER}/{name}")
    return write_atomic(Path(out_dir) / f"{name}.json", json.dumps(rows, ensure_ascii=False, indent=1))
