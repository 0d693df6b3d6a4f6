"""Self-contained HTML trace viewer: replay how a dLLM unmasked each response token, step by step.

The page (template: ``trace_viewer_template.html`` next to this file) colours every response token by the denoising
step that revealed it and replays decoding over ``t = 0..T``. It needs no network: data, script and styles are inline.

Command line: ``python -m tools.trace_viewer`` (a thin script over this module).

A URL fragment selects the state on load, e.g. ``trace.html#i=2&t=17`` (trajectory 2, step 17; ``t=max`` for the end).
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sample.trajectory import Trajectory

TEMPLATE_PATH = Path(__file__).with_name("trace_viewer_template.html")
_DATA_MARKER = "__TRACE_DATA_JSON__"
_TITLE_MARKER = "__TRACE_TITLE__"
_MAX_PENDING = 8  # a UTF-8 character spans at most 4 byte tokens


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    # Special/added tokens stay visible (``<think>`` shows as itself); no " ." -> "." clean-up, so pieces add up.
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def token_pieces(ids: Sequence[int], tokenizer: Any) -> list[str]:
    """The text each token adds to the decoded string; ``"".join(pieces) == decode(ids)``.

    Equivalent to decoding every prefix ``ids[:i+1]`` and diffing, but in O(N): each token is decoded together with
    the previously emitted token(s), so decoders that strip a leading space (SentencePiece) or need several byte
    tokens for one character (byte-level BPE) still give the right piece. A token that completes no character yet
    gets ``""``; the character goes to the token that completes it. Invalid byte runs (a broken model) are
    flushed every ``_MAX_PENDING`` tokens so the cost stays linear.
    """
    ids = list(ids)
    pieces = [""] * len(ids)
    prefix_off = read_off = 0  # ids[prefix_off:read_off]: the context already emitted; ids[read_off:]: pending
    prefix_text = ""
    for i in range(len(ids)):
        text = _decode(tokenizer, ids[prefix_off : i + 1])
        flush = i + 1 - read_off >= _MAX_PENDING
        if not flush and (text.endswith("\ufffd") or not text.startswith(prefix_text) or text == prefix_text):
            continue  # no complete new character yet
        pieces[i] = text[len(os.path.commonprefix([text, prefix_text])) :]
        prefix_off, read_off = read_off, i + 1
        prefix_text = _decode(tokenizer, ids[prefix_off:read_off])
    if read_off < len(ids):  # undecodable end (e.g. a cut multi-byte character): give it to the last token
        text = _decode(tokenizer, ids[prefix_off:])
        pieces[-1] = text[len(os.path.commonprefix([text, prefix_text])) :]
    return pieces


def _special_ids(tokenizer: Any) -> set[int]:
    return {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}


def _round(xs: Sequence[float], nd: int = 4) -> list[float | None]:
    # NaN/inf are not JSON; they become null and show as "n/a".
    return [round(float(x), nd) if x == x and abs(x) != float("inf") else None for x in xs]


def trajectory_view(traj: Trajectory, tokenizer: Any, index: int = 0) -> dict:
    """The JSON-able per-trajectory record the page renders (response tokens first, then the cut tail)."""
    ids = [int(x) for x in traj.response_ids] + [int(x) for x in traj.tail_ids]
    pieces = token_pieces(ids, tokenizer)
    special = _special_ids(tokenizer)
    return {
        "index": index,
        "sample_id": traj.sample_id,
        "group_id": traj.group_id,
        "finish_reason": traj.finish_reason,
        "block_size": traj.block_size,
        "n": len(traj.response_ids),  # tokens beyond n are the tail
        "ids": ids,
        "pieces": pieces,
        "steps": [int(s) for s in traj.step_map] + [int(s) for s in traj.tail_steps],
        "special": [i for i, t in enumerate(ids) if t in special],
        "logprobs": _round(traj.logprobs),
        "confidences": _round(traj.confidences),
        "prompt": _decode(tokenizer, traj.prompt_ids),
        "prompt_len": len(traj.prompt_ids),
    }


def _json_for_script(obj: Any) -> str:
    """JSON safe to inline in a <script> element: no '<', '>' or '&' can end it or open a comment."""
    s = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        s = s.replace(ch, esc)
    return s


def build_trace_html(trajectories: list[Trajectory], tokenizer: Any, *, title: str = "dLLM decoding trace") -> str:
    """One self-contained HTML page replaying the decoding of ``trajectories`` (a selector switches between them)."""
    if not trajectories:
        raise ValueError("build_trace_html: no trajectories to show")
    data = {"trajectories": [trajectory_view(t, tokenizer, i) for i, t in enumerate(trajectories)]}
    head, sep, tail = TEMPLATE_PATH.read_text(encoding="utf-8").partition(_DATA_MARKER)
    if not sep:
        raise RuntimeError(f"{TEMPLATE_PATH}: data marker {_DATA_MARKER} missing")
    return head.replace(_TITLE_MARKER, html.escape(title)) + _json_for_script(data) + tail
