"""AR -> diffusion conversion (models/a2d.py) on tiny random Llama / Qwen2 / Qwen3 checkpoints: the shifted
full-attention variant reproduces the AR model's logits on a causal layout, the block variant loads, samples and
trains, the mask token is new, the chat template survives, and bad input is one line; a Llama written as a GGUF file
(tests/gguf_file.py: transformers reads GGUF but cannot write it) converts to the same model as its safetensors."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.files import RunDirError
from models.a2d import ConversionError, convert
from models.common import AttentionLayout
from models.registry import load_model

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, rms_norm_eps=1e-6)


def _ar_checkpoint(path, kind: str, tokenizer, tied: bool = False, positions: int = SHAPE["max_position_embeddings"],
                   padded_vocab: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    extra = {"head_dim": 16} if kind == "qwen3" else {}  # Qwen3's head_dim need not be hidden / heads
    config = classes[kind][0](vocab_size=len(tokenizer) + padded_vocab, tie_word_embeddings=tied,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                              **{**SHAPE, "max_position_embeddings": positions}, **extra)
    torch.manual_seed(0)
    model = classes[kind][1](config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # Qwen2's q/k/v biases: non-zero, so that dropping them would show
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ar_tokenizer(demo_tokenizer):
    return demo_tokenizer


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_shifted_variant_reproduces_the_ar_logits_on_a_causal_layout(tmp_path, ar_tokenizer, kind, tied):
    src = _ar_checkpoint(tmp_path / "ar", kind, ar_tokenizer, tied)
    out = convert(src, "dream", tmp_path / "dream")
    ar = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ours = load_model({"pretrained_model": str(out), "model_base": "dream", "dtype": "float32"})
    ids = torch.randint(0, len(ar_tokenizer), (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24).expand(2, 24)
    with torch.no_grad():
        want = ar(ids).logits
        got = ours.forward(ids, pos, AttentionLayout.causal(torch.ones(2, 24, dtype=torch.bool)))
    assert got.shape[-1] == len(ar_tokenizer) + 1  # one new row: the mask token
    torch.testing.assert_close(got[..., :want.shape[-1]], want, atol=1e-5, rtol=0)
    assert ours.shift_logits and ours.mask_id == len(ar_tokenizer)
    assert ours.mask_id not in {ar_tokenizer.eos_token_id, ar_tokenizer.pad_token_id}
    assert (out / "model.safetensors").is_file() and type(AutoModelForCausalLM.from_pretrained(str(out))).__name__ \
        == "DreamModel"
    config = json.loads((out / "config.json").read_text())
    assert config["a2d"]["source_model_type"] == kind and config["a2d"]["shifted_logits"] is True
    assert config["tie_word_embeddings"] is tied and config["qk_norm"] is (kind == "qwen3")


def test_mask_row_chat_template_and_tokenizer_survive(tmp_path, ar_tokenizer):
    src = _ar_checkpoint(tmp_path / "ar", "llama", ar_tokenizer)
    out = convert(src, "dream", tmp_path / "dream")
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template == ar_tokenizer.chat_template and tok.chat_template
    assert tok.mask_token == "<|mask|>" and tok.mask_token_id == len(ar_tokenizer)
    text = "What is 23 + 19?"
    assert tok.encode(text) == ar_tokenizer.encode(text)  # every old id unchanged
    ours = load_model({"pretrained_model": str(out), "model_base": "dream", "dtype": "float32"}).model
    emb = ours.get_input_embeddings().weight
    torch.testing.assert_close(emb[-1], emb[:-1].mean(0), atol=1e-6, rtol=0)  # the mask row: the mean row


@pytest.mark.parametrize("tied", [False, True])
def test_a_padded_vocabulary_gives_the_mask_the_mean_row_not_a_padding_row(tmp_path, ar_tokenizer, tied):
    """Qwen2.5 / Qwen3 hold unused rows after their tokens (vocab_size 151,936 for ~151,665 tokens): the new mask
    id lands on one of them, the matrices do not grow, and the row must still become the mean of the real ones."""
    src = _ar_checkpoint(tmp_path / "ar", "qwen2", ar_tokenizer, tied, padded_vocab=8)
    out = convert(src, "sdar", tmp_path / "sdar")
    ar = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    ours = load_model({"pretrained_model": str(out), "model_base": "sdar", "dtype": "float32"})
    mask, n = ours.mask_id, len(ar_tokenizer)
    assert mask == n and ours.model.get_input_embeddings().weight.shape[0] == n + 8  # inside the padding
    for mine, theirs in ((ours.model.get_input_embeddings(), ar.get_input_embeddings()),
                         (ours.model.get_output_embeddings(), ar.get_output_embeddings())):
        torch.testing.assert_close(mine.weight[mask], theirs.weight[:n].mean(0), atol=1e-6, rtol=0)
        assert torch.equal(mine.weight[:n], theirs.weight[:n])  # every token's row as it was
        assert torch.equal(mine.weight[n + 1:], theirs.weight[n + 1:])  # the rest of the padding untouched


@pytest.mark.parametrize("tied", [False, True])
def test_a_gguf_file_converts_to_the_model_its_weights_hold(tmp_path, ar_tokenizer, tied):
    """The GGUF path end to end: a tiny random Llama written as a GGUF file in llama.cpp's layout (its q / k rows
    regrouped for llama.cpp's rotary convention) converts, read through transformers, to a shifted model whose
    logits on a causal layout are the AR model's, with the AR tokenizer's ids, its chat template and the
    conversion recorded."""
    from tests.gguf_file import write_llama_gguf

    src = _ar_checkpoint(tmp_path / "ar", "llama", ar_tokenizer, tied)
    ar = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    (tmp_path / "gguf").mkdir()
    write_llama_gguf(ar, ar_tokenizer, tmp_path / "gguf" / "tiny.gguf")
    out = convert(tmp_path / "gguf", "dream", tmp_path / "dream", gguf_file="tiny.gguf")
    ours = load_model({"pretrained_model": str(out), "model_base": "dream", "dtype": "float32"})
    ids = torch.randint(0, len(ar_tokenizer), (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ar(ids).logits
        got = ours.forward(ids, torch.arange(24).expand(2, 24), AttentionLayout.causal(torch.ones(2, 24, dtype=bool)))
    torch.testing.assert_close(got[..., :want.shape[-1]], want, atol=1e-5, rtol=0)
    assert ours.mask_id == len(ar_tokenizer) and ours.model.config.tie_word_embeddings is tied
    text = "<|im_start|>user\nWhat is 23 + 19?<|im_end|>\n<think>"
    assert ours.tokenizer.encode(text) == ar_tokenizer.encode(text)
    assert ours.tokenizer.chat_template == ar_tokenizer.chat_template
    assert json.loads((out / "config.json").read_text())["a2d"]["gguf_file"] == "tiny.gguf"


def test_block_variant_loads_samples_and_trains(tmp_path, ar_tokenizer):
    from sample.generate import generate
    from sample.params import SamplingParams
    from tests.test_train_trainer import fake_batch, make_trainer

    src = _ar_checkpoint(tmp_path / "ar", "qwen3", ar_tokenizer)
    out = convert(src, "sdar", tmp_path / "sdar", block_size=4)
    ar = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ours = load_model({"pretrained_model": str(out), "model_base": "sdar", "dtype": "float32"})
    assert ours.block_size == 4 and not ours.shift_logits
    ids = torch.randint(0, len(ar_tokenizer), (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # the same weights: on a causal layout the forward is the AR model's
        got = ours.forward(ids, torch.arange(12)[None], AttentionLayout.causal(torch.ones(1, 12, dtype=torch.bool)))
        torch.testing.assert_close(got[..., :len(ar_tokenizer)], ar(ids).logits, atol=1e-5, rtol=0)
    rollout = generate(ours, ["What is 2 + 3?"], SamplingParams(max_tokens=8, temperature=0.0), progress=False)
    assert len(rollout[0].response_ids) > 0 and ours.mask_id not in rollout[0].response_ids
    trainer = make_trainer(ours, learning_rate=1e-3)
    trajs = fake_batch(ours, n=2)
    before = {k: v.clone() for k, v in ours.model.state_dict().items()}
    trainer.train_step(trajs, {t.sample_id: 1.0 for t in trajs})
    assert any(not torch.equal(before[k], v) for k, v in ours.model.state_dict().items())


def test_bad_input_is_one_line(tmp_path, ar_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(ar_tokenizer), n_embd=32, n_layer=1, n_head=4)).save_pretrained(gpt2)
    ar_tokenizer.save_pretrained(gpt2)
    with pytest.raises(ConversionError, match=r"^unsupported architecture 'gpt2'"):
        convert(gpt2, "dream", tmp_path / "x")
    src = _ar_checkpoint(tmp_path / "ar", "llama", ar_tokenizer)
    with pytest.raises(ConversionError, match=r"--block-size 5 does not divide the model's 128 positions"):
        convert(src, "sdar", tmp_path / "y", block_size=5)
    with pytest.raises(ConversionError, match=r"is already a token of this tokenizer"):
        convert(src, "dream", tmp_path / "z", mask_token=ar_tokenizer.eos_token)
    with pytest.raises(ConversionError, match=r"not a folder"):
        convert(tmp_path / "missing", "dream", tmp_path / "w")
    with pytest.raises(ConversionError, match=r"^--block-size 4 has no effect with --to dream"):
        convert(src, "dream", tmp_path / "w", block_size=4)
    with pytest.raises(ConversionError, match=r"^--block-size must be at least 1, got 0"):
        convert(src, "sdar", tmp_path / "w", block_size=0)
    with pytest.raises(ConversionError, match=f"^--gguf-file model.gguf: no such file in {src} \\(GGUF files there: "
                                              "none\\)$"):
        convert(src, "sdar", tmp_path / "w", gguf_file="model.gguf")
    with pytest.raises(ConversionError, match=r"^--mask-token '': give the new token some text"):
        convert(src, "sdar", tmp_path / "w", mask_token="")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match=f"^--out {tmp_path / 'full'} is a folder that holds files: choose "
                                          "another, or pass --overwrite"):
        convert(src, "dream", tmp_path / "full")
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"
    with pytest.raises(RunDirError, match=f"^--out {tmp_path / 'full' / 'notes.txt'} is a file: name a folder$"):
        convert(src, "dream", tmp_path / "full" / "notes.txt", overwrite=True)
    out = convert(src, "sdar", tmp_path / "sdar_once", block_size=4)
    with pytest.raises(ConversionError, match=r"already a diffusion checkpoint \(model_type 'sdar', model_base .*sdar"):
        convert(out, "sdar", tmp_path / "twice")  # transformers does not know the family: said in our words
    (out / "model-00002-of-00002.safetensors").write_text("stale")  # a shard of a larger earlier conversion
    with pytest.raises(RunDirError, match="is \\(or holds\\) an input of this command"):
        convert(src, "sdar", src, overwrite=True)
    assert convert(src, "sdar", out, block_size=2, overwrite=True) == out
    assert not (out / "model-00002-of-00002.safetensors").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no hidden partial or old folder
    assert json.loads((out / "config.json").read_text())["block_size"] == 2
    import shutil

    for what, pattern in (("weights", "model.safetensors"), ("tokenizer", "tokenizer*")):
        broken = tmp_path / f"no_{what}"
        shutil.copytree(src, broken)
        for f in broken.glob(pattern):
            f.unlink()
        with pytest.raises(ConversionError, match=f"^--source {broken}: cannot load its {what} "):
            convert(broken, "dream", tmp_path / f"out_{what}")


def test_a_conversion_that_runs_out_of_space_keeps_the_one_it_would_replace(tmp_path, ar_tokenizer, monkeypatch):
    """--overwrite writes the new conversion beside the old one and swaps them when it is whole: a full disk leaves
    the old one as it was and no partial folder."""
    import errno

    import core.files

    src = _ar_checkpoint(tmp_path / "ar", "llama", ar_tokenizer)
    out = convert(src, "sdar", tmp_path / "sdar", block_size=4)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(core.files, "fsync_tree", full_disk)
    with pytest.raises(RunDirError, match=f"^no space left on the device while writing {out} \\(.* MB free\\); "
                                          "nothing was written and the folder there is unchanged$"):
        convert(src, "sdar", out, block_size=2, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ar", "sdar"]


def test_every_eos_id_of_the_ar_config_stops_the_converted_model(tmp_path, ar_tokenizer):
    """Llama 3.1's config lists three EOS ids where its tokenizer names one: the converted model keeps them all."""
    src = _ar_checkpoint(tmp_path / "ar", "llama", ar_tokenizer)
    extra = ar_tokenizer.convert_tokens_to_ids("<|im_start|>") if "<|im_start|>" in ar_tokenizer.get_vocab() else 7
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"eos_token_id": [ar_tokenizer.eos_token_id, extra]}))
    out = convert(src, "sdar", tmp_path / "sdar", block_size=4)
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == sorted({ar_tokenizer.eos_token_id, extra})
    adapter = load_model({"pretrained_model": str(out), "model_base": "sdar", "dtype": "float32"})
    assert extra in adapter.eos_ids and extra in adapter.stop_ids


def test_distilled_rows_are_the_ar_models_own_greedy_answers_and_train_the_converted_model(tmp_path, ar_tokenizer):
    from jobs.config import load_config
    from jobs.sft import run_sft
    from models.a2d import load_ar
    from tools.distill import main as distill_main
    from tools.distill import scored_rows

    src = _ar_checkpoint(tmp_path / "ar", "llama", ar_tokenizer)
    model, tok = load_ar(src)
    rows = scored_rows(model, tok, 4, seed=0, difficulty=1, max_new_tokens=5, progress=False)
    assert [r["prompt"] for r in rows][0].startswith("Compute ") and all(r["correct"] is False for r in rows)
    chat = tok.apply_chat_template([{"role": "user", "content": rows[0]["prompt"]}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(chat, return_tensors="pt", add_special_tokens=False)
    greedy = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert rows[0]["response"] == tok.decode(greedy[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    data = tmp_path / "distill.jsonl"
    assert distill_main(["--source", str(src), "--out", str(data), "--n", "4", "--all", "--eval-n", "0",
                         "--max-new-tokens", "5"]) == 0
    assert len(data.read_text().splitlines()) == 4
    # no answer right and no --all: nothing is written (an empty file SFT would refuse later); bad arguments are
    # refused before the model answers
    assert distill_main(["--source", str(src), "--out", str(tmp_path / "none.jsonl"), "--n", "4", "--eval-n", "0",
                         "--max-new-tokens", "5"]) == 2
    assert not (tmp_path / "none.jsonl").exists()
    for bad in (["--out", str(tmp_path)], ["--out", str(data), "--eval-n", "-1"], ["--out", str(data), "--n", "0"]):
        with pytest.raises(SystemExit, match="2"):
            distill_main(["--source", str(tmp_path / "not_loaded"), *bad])
    # the adaptation: diffusion SFT of the converted (shifted, full-attention) model on those rows
    out = convert(src, "dream", tmp_path / "dream")
    cfg = load_config(["config=configs/demo/sft_demo.yaml", f"model.pretrained_model={out}", "model.model_base=dream",
                       "model.init_tiny_if_missing=false", f"dataset.optimization_data={data}",
                       f"experiment.output_dir={tmp_path}", "experiment.project=adapt", "training.max_steps=2",
                       "training.method=random_masking", "training.samples_per_step=4", "training.batch_size_lm=4"],
                      "sft")
    final = run_sft(cfg, progress=False)
    before = load_model({"pretrained_model": str(out), "model_base": "dream", "dtype": "float32"}).model.state_dict()
    after = load_model({"pretrained_model": str(final), "model_base": "dream", "dtype": "float32"}).model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
