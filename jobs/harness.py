"""The lm-eval-harness model ``dllm_rl``: our adapters, sampler and chat templates behind lm-eval's ``LM`` API.

Run it with ``python -m lm_eval_dllm <lm_eval arguments>`` (see lm_eval_dllm.py): lm-eval 0.4.13 finds models
only in its own registry, so this module must be imported before lm-eval's CLI parses ``--model dllm_rl``.

* ``generate_until``: requests are grouped by their generation settings and each group is one ``generate`` call
  (the batched sampler of eval.py). A context is rendered as eval.py renders a prompt: one user turn through the
  model's chat template (``data.prompts.chat_ids``), or raw text with ``chat=false``. The sampler stops at the
  adapter's stop tokens (EOS, turn end) as in eval.py; lm-eval's ``until`` strings then cut the text.
* ``loglikelihood``: the continuation's ELBO (train/likelihood.py: Monte-Carlo for full-attention models, exact
  block-causal factorisation with a per-block ELBO for block models), every request with the same seed (common
  random numbers: the choices of a multiple-choice question are compared on the same masks). ``is_greedy``: the
  greedy sampler, one token per step, reproduces the continuation exactly.
* ``loglikelihood_rolling`` is refused: a diffusion model gives only a bound on a text's log-likelihood.
* A context too long for the model's positions loses its oldest tokens (logged), as in lm-eval's own models.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from typing import Any

import lm_eval.models  # noqa: F401 - lm-eval imports its own models only while its registry is empty
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from core.errors import UserError
from core.loader import coerce
from core.schema import SettingError, config_fields, replace
from data.prompts import MATH, MATH_THINK, chat_ids, prompt_messages
from jobs.config import ExperimentConfig
from jobs.dist import default_device
from jobs.rollout import check_for_model
from models.registry import load_model
from reward.math import score_math
from sample.generate import generate
from sample.params import SamplingParams
from train.likelihood import continuation_elbo

MODEL_NAME = "dllm_rl"
DEFAULT_SEED = ExperimentConfig.__dataclass_fields__["seed"].default  # eval.py's seed: both sample alike
CHAT_TAG = "\ue001dllm-chat:"  # marks a context that lm-eval's --apply_chat_template turned into messages
ROLLING_REFUSAL = ("loglikelihood_rolling is not supported: a diffusion LM gives only a lower bound (ELBO) on a "
                   "text's log-likelihood, not the exact value perplexity needs")
_GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k"}
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's own models' answer budget when a task gives no max_gen_toks
log = logging.getLogger(__name__)


@register_model(MODEL_NAME)
class DiffusionLM(LM):
    """``--model_args pretrained=<folder>,model_base=<trado|sdar|dream|llada|mmada>[,key=value...]``.

    Keys: ``tokenizer`` (folder), ``dtype``, ``attn_backend``, ``device``; ``chat`` (render contexts through the
    chat template, default true), ``start_with_think``; ``mc_num`` (ELBO draws per request, default 128),
    ``mc_batch_size`` (rows per forward), ``greedy_check`` (compute ``is_greedy``, default true); ``seed``;
    any ``SamplingParams`` field (``block_size``, ``denoising_steps``, ``steps``, ``remasking_strategy``, ``cache``,
    ``max_tokens``, ``max_active``...). Task ``gen_kwargs`` override ``max_tokens`` (max_gen_toks),
    ``temperature`` (do_sample=false -> greedy), ``top_p``, ``top_k``. lm-eval's ``batch_size`` is ignored: the
    sampler keeps ``max_active`` rows in flight.
    """

    def __init__(self, pretrained: str, model_base: str, tokenizer: str | None = None, dtype: str = "float32",
                 attn_backend: str = "sdpa", device: str | None = None, chat: bool = True,
                 start_with_think: bool = False, mc_num: int = 128, mc_batch_size: int = 32,
                 greedy_check: bool = True, seed: int = DEFAULT_SEED, batch_size: Any = None,
                 max_batch_size: Any = None, **sampling: Any):
        super().__init__()
        model_cfg = {"pretrained_model": pretrained, "model_base": model_base, "tokenizer": tokenizer,
                     "dtype": dtype, "attn_backend": attn_backend}
        # every model_arg is checked before the (slow) load: a typo fails at once
        self.chat, self.start_with_think, self.greedy_check = (
            _model_arg(name, value, bool) for name, value in
            (("chat", chat), ("start_with_think", start_with_think), ("greedy_check", greedy_check)))
        self.seed = _model_arg("seed", seed, int)
        self.mc_num, self.mc_batch_size = (_model_arg(name, value, int, least=1) for name, value in
                                           (("mc_num", mc_num), ("mc_batch_size", mc_batch_size)))
        self.params = base_params(sampling, self.seed)
        self.adapter = load_model(model_cfg, device=_device(device))
        self.adapter.model.eval()
        check_for_model("model_args", self.params, self.adapter)
        self.pretrained = str(pretrained)

    # ------------------------------------------------------------ generation

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        contexts = [r.args[0] for r in requests]
        settings = [r.args[1] for r in requests]
        out: list[str] = [""] * len(requests)
        for indices in _groups(settings).values():
            params, until = self._params_for(settings[indices[0]])
            room = params.max_tokens + params.block_for(self.adapter.attention, self.adapter.block_size)
            prompts = [self._left_truncated(self.context_ids(contexts[i]), room) for i in indices]
            rollout = generate(self.adapter, prompts, params, progress=not disable_tqdm)
            for i, traj in zip(indices, rollout, strict=True):
                out[i] = cut_at(traj.text, until)  # the text leaves the stop token out
                self.cache_hook.add_partial("generate_until", (contexts[i], settings[i]), out[i])
        return out

    def _params_for(self, gen_kwargs: dict) -> tuple[SamplingParams, list[str]]:
        """Sampler settings of one task's ``gen_kwargs`` and its ``until`` strings."""
        unknown = set(gen_kwargs) - _GEN_KWARGS
        if unknown:
            raise HarnessArgError(f"{MODEL_NAME}: unsupported gen_kwargs {sorted(unknown)}; supported: "
                             f"{sorted(_GEN_KWARGS)}")
        changes: dict[str, Any] = {}
        if "max_gen_toks" in gen_kwargs:
            changes["max_tokens"] = int(gen_kwargs["max_gen_toks"])
        for key, kind in (("temperature", float), ("top_p", float), ("top_k", int)):
            if key in gen_kwargs:
                changes[key] = kind(gen_kwargs[key])
        if gen_kwargs.get("do_sample") is False:
            changes["temperature"] = 0.0
        elif gen_kwargs.get("do_sample") is True and "temperature" not in changes and not self.params.temperature:
            changes["temperature"] = 1.0  # sampling asked for, no temperature given: transformers' default
        params = replace(self.params, **changes)
        check_for_model("gen_kwargs", params, self.adapter)
        until = gen_kwargs.get("until") or []
        return params, [until] if isinstance(until, str) else list(until)

    # ------------------------------------------------------------ likelihood

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [(self._left_truncated(ctx, len(cont) + self._block_room()), cont)
                 for ctx, cont in (self.encode_pair(*r.args) for r in requests)]
        greedy = self._greedy_matches(pairs) if self.greedy_check else [False] * len(pairs)
        out = []
        for r, (context, continuation), is_greedy in zip(requests, pairs, greedy, strict=True):
            gen = torch.Generator().manual_seed(self.seed)  # same draws for every request (common random numbers)
            score = continuation_elbo(self.adapter, context, continuation, self.mc_num, gen, self.mc_batch_size)
            out.append((score, is_greedy))
            self.cache_hook.add_partial("loglikelihood", r.args, out[-1])
        return out

    def _block_room(self) -> int:
        """Positions a block model's last, partial block may need beyond the continuation (0: full attention)."""
        return self.adapter.block_size if self.adapter.attention == "block" else 0

    def _left_truncated(self, ids: list[int], room: int) -> list[int]:
        """``ids`` without its oldest tokens where it and ``room`` more positions exceed the model's position
        limit (lm-eval's own models cut a long context from the left alike); each cut is logged."""
        limit = self.adapter.position_limit
        if limit is None or len(ids) + room <= limit:
            return ids
        keep = max(limit - room, 1)
        log.warning("%s: a context of %d tokens is cut to its last %d (max_position_embeddings %d, %d positions "
                    "kept for the answer)", MODEL_NAME, len(ids), keep, limit, room)
        return ids[-keep:]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        raise UnsupportedRequestError(f"{MODEL_NAME}: {ROLLING_REFUSAL}")

    def _greedy_matches(self, pairs: list[tuple[list[int], list[int]]]) -> list[bool]:
        """Whether greedy decoding (one token per step, no stops) of each context gives its continuation."""
        by_length: dict[int, list[int]] = defaultdict(list)
        for i, (_, continuation) in enumerate(pairs):
            by_length[len(continuation)].append(i)
        out = [False] * len(pairs)
        for n, indices in by_length.items():
            rollout = generate(self.adapter, [pairs[i][0] for i in indices], self._greedy_params(n), progress=False)
            for i, traj in zip(indices, rollout, strict=True):
                out[i] = traj.response_ids[:n] == pairs[i][1]
        return out

    def _greedy_params(self, n: int) -> SamplingParams:
        """Greedy, one token per step, no stops, ``n`` tokens. Full attention: one block of exactly the
        continuation (as its ELBO sees it: no masked positions after it); block models: their own blocks."""
        greedy = replace(self.params, temperature=0.0, top_k=0, top_p=1.0, max_tokens=n, ignore_eos=True,
                         stop_token_ids=[], stop=[], alg_temp=0.0)
        if self.adapter.attention == "full":  # no cache: the prefix cache is an approximation there
            return replace(greedy, block_size=n, steps=None, cache="none")
        return replace(greedy, block_size=self.adapter.block_size, denoising_steps=self.adapter.block_size)

    # ------------------------------------------------------------ prompts

    def context_ids(self, context: str) -> list[int]:
        """Ids of a context: messages from --apply_chat_template, one user turn (chat=true) or raw text."""
        if context.startswith(CHAT_TAG):
            return self._messages_ids(**json.loads(context[len(CHAT_TAG):]))
        if self.chat:
            return self._messages_ids([{"role": "user", "content": context}], add_generation_prompt=True)
        return self.adapter.encode_text(context)

    def _messages_ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        # lm-eval ends the messages with an assistant turn holding a task's answer prefix ("gen_prefix") and asks
        # for no generation prompt: the prefix opens the assistant's answer, which the model then continues.
        messages = [{**m, "content": _think_form(m["content"], self.start_with_think)} if m["role"] == "user" else m
                    for m in messages]
        if not add_generation_prompt and messages and messages[-1]["role"] == "assistant":
            return (chat_ids(self.adapter, messages[:-1], self.start_with_think)
                    + self.adapter.encode_text(messages[-1]["content"]))
        return chat_ids(self.adapter, messages, self.start_with_think, add_generation_prompt)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids). After a chat template the continuation starts a new assistant turn and
        is tokenised alone. Raw text, as lm-eval's own models split it: the context's trailing whitespace moves to
        the continuation (a BPE tokenizer joins a space to the word after it: "is " + "the" is "is" + " the"), the
        whole text is tokenised and cut after the context's tokens; should that cut leave the continuation no
        token (the context's last token swallowed it), both sides are tokenised alone, so it is still scored."""
        if self.chat or context.startswith(CHAT_TAG):
            return self.context_ids(context), self.adapter.encode_text(continuation)
        stripped = context.rstrip()
        context, continuation = stripped, context[len(stripped):] + continuation
        whole = self.adapter.encode_text(context + continuation)
        n = len(self.adapter.encode_text(context))
        if n >= len(whole):
            return self.adapter.encode_text(context), self.adapter.encode_text(continuation)
        return whole[:n], whole[n:]

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        # Messages travel as data, not as rendered text: re-tokenising a rendered template would turn
        # special-token strings inside message contents into special tokens (encode_chat never does).
        return CHAT_TAG + json.dumps({"messages": chat_history, "add_generation_prompt": add_generation_prompt})

    @property
    def tokenizer_name(self) -> str:
        return self.pretrained

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.adapter.tokenizer, "chat_template", None) or ""


class HarnessArgError(UserError, ValueError):
    """A model_args or gen_kwargs value lm-eval passed that our model cannot take (one line at the command line)."""


class UnsupportedRequestError(UserError, NotImplementedError):
    """A kind of lm-eval request our model cannot answer (perplexity tasks): one line at the command line."""


def _model_arg(name: str, value: Any, tp: type, least: int | None = None) -> Any:
    """A model_arg of ``tp`` (lm-eval passes only true/false/numbers typed: "no" or 2.9 is refused, not bool()'d)."""
    try:
        typed = coerce(value, tp)
    except Exception as err:  # noqa: BLE001 - the loader's type mismatch, as one line naming the key
        raise HarnessArgError(f"{MODEL_NAME}: model_args {name} {getattr(err, 'detail', err)}") from None
    if least is not None and typed < least:
        raise HarnessArgError(f"{MODEL_NAME}: model_args {name} must be >= {least}, got {typed}")
    return typed


def _device(requested: str | None) -> str:
    """The device to load on: lm-eval's CLI passes "cuda" unless told otherwise, so a CPU-only machine falls back
    to the CPU (with a warning) as lm-eval's own HF model does."""
    if requested and requested.startswith("cuda") and not torch.cuda.is_available():
        log.warning("%s: device %r is not available, using the CPU", MODEL_NAME, requested)
        return "cpu"
    return requested or default_device()


def base_params(sampling: dict[str, Any], seed: int) -> SamplingParams:
    """SamplingParams from model_args (greedy unless asked otherwise: lm-eval tasks assume it; lm-eval's
    256-token answer budget unless ``max_tokens`` is given)."""
    fields = config_fields(SamplingParams)
    unknown = set(sampling) - set(fields)
    if unknown:
        raise HarnessArgError(f"{MODEL_NAME}: unknown model_args {sorted(unknown)}; sampler keys are {sorted(fields)}")
    # lm-eval reads `temperature=1` as an int: each takes its field's type
    typed = {key: _model_arg(key, value, fields[key][0]) for key, value in sampling.items()}
    try:
        return SamplingParams(**{"temperature": 0.0, "max_tokens": DEFAULT_MAX_GEN_TOKS, "seed": seed, **typed})
    except SettingError as err:
        raise HarnessArgError(f"{MODEL_NAME}: model_args {err.field}: {err}") from None


def cut_at(text: str, until: list[str]) -> str:
    """``text`` up to the first occurrence of any of the ``until`` strings."""
    for stop in until:
        if stop:
            text = text.split(stop, 1)[0]
    return text


_MATH_SUFFIX = MATH.format(question="")


def _think_form(context: str, start_with_think: bool) -> str:
    """eval.py's math prompt with ``start_with_think`` is another text (MATH_THINK): a task's ``math_prompt`` (which
    cannot see model_args) is rewritten to it, so that both score the same prompt. The text itself is matched, not
    a tagged row: lm-eval joins few-shot examples and logs contexts as plain text."""
    if start_with_think and context.endswith(_MATH_SUFFIX):
        return MATH_THINK.format(question=context[:-len(_MATH_SUFFIX)])
    return context


def math_prompt(doc: dict) -> str:
    """eval.py's math prompt text for a dataset row (the model renders it as one user turn of its chat template;
    under ``start_with_think=true`` as eval.py's thinking form); used by the task files in lm_eval_tasks/."""
    messages, _ = prompt_messages(doc, "math")
    return messages[0]["content"]


def math_score(doc: dict, results: list[str]) -> dict[str, float]:
    """eval.py's math scoring of one response: the boxed answer (else "The answer is ..."), checked for
    equivalence with the row's ground truth by reward.math."""
    return {"exact_match": score_math(results[0], str(doc["ground_truth_answer"]))}


def _groups(settings: list[dict]) -> dict[str, list[int]]:
    """Request indices grouped by identical generation settings (one sampler call each)."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, gen_kwargs in enumerate(settings):
        groups[json.dumps(gen_kwargs, sort_keys=True, default=str)].append(i)
    return groups
