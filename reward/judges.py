"""Judges for the process reward: chat conversations in, one completion each out (``reward.process.Judge``).

* :class:`EndpointJudge`: any OpenAI-compatible server (vLLM, SGLang, this project's ``serve.py``) through
  ``/v1/chat/completions``; requests run concurrently, each retried with exponential backoff; a request that keeps
  failing stops the run with one line (a judge that is down must never become silent zero rewards).
* :class:`LocalJudge`: a Hugging Face causal LM loaded in this process (any AR checkpoint transformers reads), in
  batches, with the model's own chat template.

Both sample with the configured temperature and top-p (0.95 by default, as the reference's judge) and stop at the
reference's stop strings.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from core.errors import UserError
from reward.process import ProcessRewardConfig

STOP = ["</answer>", "User:", "Human:", "Assistant:"]  # the reference judge's stop strings (special tokens aside)


class JudgeError(UserError):
    """The judge cannot be reached, keeps failing, or cannot take a prompt."""


def build_judge(model: str, cfg: ProcessRewardConfig, seed: int = 0) -> Any:
    """The judge for ``model.process_reward_model``: an endpoint when ``base_url`` is set, else a local model."""
    if cfg.base_url:
        return EndpointJudge(cfg.base_url, model, cfg, api_key=os.environ.get(cfg.api_key_env))
    return LocalJudge(model, cfg, seed=seed)


class EndpointJudge:
    def __init__(self, base_url: str, model: str, cfg: ProcessRewardConfig, api_key: str | None = None,
                 sleep=time.sleep):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.cfg, self.api_key, self.sleep = model, cfg, api_key, sleep
        self.failures = 0  # failed attempts that a retry recovered from

    def __call__(self, chats: Sequence[list[dict]], seed: int | None = None) -> list[str]:
        with ThreadPoolExecutor(max_workers=self.cfg.concurrency) as pool:  # the server samples: no seed here
            return list(pool.map(self._one, chats))

    def _one(self, chat: list[dict]) -> str:
        body = {"model": self.model, "messages": chat, "temperature": self.cfg.temperature,
                "top_p": self.cfg.top_p, "max_tokens": self.cfg.max_new_tokens, "stop": STOP}
        last = ""
        for attempt in range(self.cfg.retries + 1):
            try:
                return self._post(body)
            except JudgeError:
                raise
            except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError, KeyError, IndexError,
                    TypeError) as err:  # unreachable, cut off or a malformed reply: retried, then one line
                last = _describe(err)
                if attempt < self.cfg.retries:
                    self.failures += 1
                    self.sleep(min(2.0 ** attempt, 30.0))
        raise JudgeError(f"the process-reward judge at {self.url} failed {self.cfg.retries + 1} times in a row "
                         f"(last: {last}); check process_reward.base_url and that the server serves {self.model!r}")

    def _post(self, body: dict) -> str:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.timeout) as resp:
                reply = json.loads(resp.read())
        except urllib.error.HTTPError as err:
            if err.code in (400, 401, 403, 404, 422):  # the request itself is wrong: retrying cannot help
                detail = err.read().decode(errors="replace")[:300]
                raise JudgeError(f"the process-reward judge at {self.url} refused a request: HTTP {err.code} "
                                 f"{' '.join(detail.split())}") from None
            raise
        return str(reply["choices"][0]["message"]["content"] or "")


def _describe(err: BaseException) -> str:
    if isinstance(err, urllib.error.HTTPError):
        return f"HTTP {err.code}"
    if isinstance(err, urllib.error.URLError):
        return f"{type(err.reason).__name__}: {err.reason}"
    return f"{type(err).__name__}: {err}"


class LocalJudge:
    """A causal LM run in this process, ``concurrency`` prompts per batch (left-padded)."""

    def __init__(self, path: str, cfg: ProcessRewardConfig, seed: int = 0, device: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not os.path.isdir(path):
            raise JudgeError(f"model.process_reward_model {path!r} is not a local folder (set "
                             "process_reward.base_url to use a judge served elsewhere)")
        self.cfg, self.seed = cfg, seed
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()

    def __call__(self, chats: Sequence[list[dict]], seed: int | None = None) -> list[str]:
        """The judge's answers; sampling is seeded by ``seed`` (default: the run seed) and leaves the caller's
        random state as it was."""
        import torch

        devices = [torch.device(self.device)] if str(self.device).startswith("cuda") else []
        with torch.random.fork_rng(devices=devices):
            return self._answers(chats, self.seed if seed is None else seed)

    def _answers(self, chats: Sequence[list[dict]], generator_seed: int) -> list[str]:
        import torch

        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
        out: list[str] = []
        for i in range(0, len(prompts), self.cfg.concurrency):
            batch = self.tokenizer(prompts[i:i + self.cfg.concurrency], return_tensors="pt", padding=True,
                                   add_special_tokens=False).to(self.device)
            width = batch["input_ids"].shape[1]
            if width + self.cfg.max_new_tokens > self.cfg.max_model_len:
                raise JudgeError(f"a judge prompt has {width} tokens, over process_reward.max_model_len "
                                 f"({self.cfg.max_model_len}) minus max_new_tokens ({self.cfg.max_new_tokens})")
            torch.manual_seed(generator_seed + i)  # judgments are reproducible for a given seed
            sampled = self.cfg.temperature > 0
            with torch.no_grad():
                ids = self.model.generate(**batch, max_new_tokens=self.cfg.max_new_tokens, do_sample=sampled,
                                          temperature=self.cfg.temperature if sampled else None,
                                          top_p=self.cfg.top_p if sampled else None,
                                          stop_strings=STOP, tokenizer=self.tokenizer,
                                          pad_token_id=self.tokenizer.pad_token_id)
            out += self.tokenizer.batch_decode(ids[:, width:], skip_special_tokens=True)
        return out
