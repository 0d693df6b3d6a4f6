"""Real checkpoint folders load as they are: remote-code tokenizers (auto_map) load without prompting or running code.

The public Dream-v0-Instruct-7B tokenizer_config.json names ``DreamTokenizer`` through ``auto_map``; transformers'
auto path would ask "Do you wish to run the custom code? [y/N]" and then refuse. ``load_tokenizer`` loads the
equivalent standard tokenizer from the same files instead (identical ids), or fails at once with one line.
"""

from __future__ import annotations

import builtins
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from models.registry import ModelLoadError, family_spec, load_tokenizer
from models.tokenizers import build_demo_tokenizer

DREAM_AUTO_MAP = {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]}
TEXT = "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n<think>7</think><|MASK|>"


@pytest.fixture(autouse=True)
def no_prompt(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("the loader asked an interactive question")
    monkeypatch.setattr(builtins, "input", refuse)


def _remote_code_folder(tmp_path, keep_tokenizer_json: bool = True):
    """The demo tokenizer's folder, its tokenizer_config rewritten as Dream's: a custom class through auto_map."""
    folder = tmp_path / "tok"
    reference = build_demo_tokenizer(str(folder))
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(tokenizer_class="DreamTokenizer", auto_map=DREAM_AUTO_MAP)
    cfg_file.write_text(json.dumps(cfg))
    # The custom module would fail loudly if anything imported it.
    (folder / "tokenization_dream.py").write_text("raise RuntimeError('remote code was executed')\n")
    if not keep_tokenizer_json:
        (folder / "tokenizer.json").unlink()
    return folder, reference


def test_remote_code_tokenizer_loads_as_the_standard_one_with_identical_ids(tmp_path):
    folder, reference = _remote_code_folder(tmp_path)
    tok = load_tokenizer(folder)
    assert type(tok).__module__.startswith("transformers.")
    assert tok(TEXT)["input_ids"] == reference(TEXT)["input_ids"]
    assert len(tok) == len(reference) == 512
    assert (tok.mask_token, tok.mask_token_id) == ("<|MASK|>", 509)
    assert (tok.eos_token_id, tok.pad_token_id) == (506, 506)
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_remote_code_tokenizer_without_standard_files_fails_in_one_line(tmp_path):
    folder, _ = _remote_code_folder(tmp_path, keep_tokenizer_json=False)
    with pytest.raises(ModelLoadError, match="'DreamTokenizer' is remote code") as err:
        load_tokenizer(folder)
    assert "\n" not in str(err.value)


def test_plain_folder_still_loads_through_the_auto_path(tmp_path):
    reference = build_demo_tokenizer(str(tmp_path / "plain"))
    assert load_tokenizer(tmp_path / "plain")(TEXT)["input_ids"] == reference(TEXT)["input_ids"]


# ----------------------------------------------------------------------------------------------------------
# Public checkpoints' metadata (tests/fixtures/checkpoints/*, sources in its README.md)
# ----------------------------------------------------------------------------------------------------------

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"


def _meta_model(folder: Path, model_base: str):
    spec = family_spec(model_base)
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    assert type(config) is spec.model_class.config_class  # our class reads it, despite the config's auto_map
    with torch.device("meta"):
        return config, spec.model_class(config)


@pytest.mark.parametrize("name,layers,hidden", [("SDAR-4B-Chat", 36, 2560), ("SDAR-8B-Chat", 36, 4096)])
def test_sdar_config_and_parameter_names_match_the_checkpoint(name, layers, hidden):
    folder = FIXTURES / name
    config, model = _meta_model(folder, "sdar")
    assert (config.num_hidden_layers, config.hidden_size, config.mask_token_id) == (layers, hidden, 151669)
    assert config.tie_word_embeddings is False
    keys = json.loads((folder / "weight_map_keys.json").read_text())
    assert sorted(n for n, _ in model.named_parameters()) == keys


@pytest.mark.parametrize("name", ["SDAR-4B-Chat", "SDAR-8B-Chat"])
def test_sdar_tokenizer_config_ids_and_template(name):
    cfg = json.loads((FIXTURES / name / "tokenizer_config.json").read_text())
    ids = {t["content"]: int(i) for i, t in cfg["added_tokens_decoder"].items()}
    assert (ids[cfg["mask_token"]], ids[cfg["eos_token"]], ids[cfg["pad_token"]]) == (151669, 151643, 151643)
    config = json.loads((FIXTURES / name / "config.json").read_text())
    assert (config["mask_token_id"], config["eos_token_id"]) == (151669, 151643)
    # Our offline rebuild of the SDAR tokenizer has exactly the checkpoint's added tokens at the same ids.
    from models.tokenizers import _FAMILIES, QWEN_BASE_VOCAB
    ours = {c: QWEN_BASE_VOCAB + i for i, (c, _) in enumerate(_FAMILIES["sdar"][0])}
    assert ours == ids


@pytest.mark.parametrize("name,model_base,layers,width", [
    ("Dream-v0-Instruct-7B", "dream", 28, 3584), ("LLaDA-8B-Instruct", "llada", 32, 4096)])
def test_dream_llada_config_and_parameter_names_match_the_checkpoint(name, model_base, layers, width):
    folder = FIXTURES / name
    config, model = _meta_model(folder, model_base)
    got = (getattr(config, "num_hidden_layers", None) or config.n_layers,
           getattr(config, "hidden_size", None) or config.d_model)
    assert got == (layers, width)
    keys = json.loads((folder / "weight_map_keys.json").read_text())
    assert sorted(n for n, _ in model.named_parameters()) == keys


def test_dream_tokenizer_config_ids_match_our_offline_rebuild():
    cfg = json.loads((FIXTURES / "Dream-v0-Instruct-7B" / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "DreamTokenizer" and "auto_map" in cfg  # the remote-code case above
    ids = {t["content"]: int(i) for i, t in cfg["added_tokens_decoder"].items()}
    assert (ids[cfg["mask_token"]], ids[cfg["eos_token"]], ids[cfg["pad_token"]]) == (151666, 151643, 151643)
    config = json.loads((FIXTURES / "Dream-v0-Instruct-7B" / "config.json").read_text())
    assert (config["mask_token_id"], config["pad_token_id"]) == (151666, 151643)
    from models.tokenizers import _FAMILIES, QWEN_BASE_VOCAB
    ours = {c: QWEN_BASE_VOCAB + i for i, (c, _) in enumerate(_FAMILIES["dream"][0])}
    assert ours == ids


def state_dict_patterns(model) -> dict[str, int]:
    """State-dict names with layer and expert indices folded ({N}, {E}), and how many names each stands for."""
    from collections import Counter

    fold = lambda k: re.sub(r"\.experts\.\d+\.", ".experts.{E}.", re.sub(r"\.layers\.\d+\.", ".layers.{N}.", k))  # noqa: E731
    return dict(Counter(fold(k) for k in on_disk_names(model)))


def on_disk_names(model) -> list[str]:
    """The names ``save_pretrained`` writes: a MoE family's fused experts split back per expert (transformers'
    weight conversions, models/moe.py ``register_fused_experts``)."""
    from transformers.core_model_loading import revert_weight_conversion

    return list(revert_weight_conversion(model, model.state_dict()))


@pytest.mark.parametrize("name", ["LLaDA2.0-mini", "LLaDA2.1-mini"])
def test_llada2_config_and_state_dict_names_match_the_checkpoint(name):
    folder = FIXTURES / name
    config, model = _meta_model(folder, "llada2")
    assert (config.num_hidden_layers, config.hidden_size, config.num_experts, config.rotary_dim) == (20, 2048, 256, 64)
    assert (config.n_group, config.topk_group, config.routed_scaling_factor, config.first_k_dense_replace) == \
        (8, 4, 2.5, 1)
    assert (config.mask_token_id, config.pad_token_id, config.block_size) == (156895, 156892, 32)  # ours: 2 fields
    # 14,813 names (weights and the expert_bias buffers), 256 experts per sparse layer, layer 0 dense
    assert state_dict_patterns(model) == json.loads((folder / "weight_map_patterns.json").read_text())
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    assert (tok["mask_token"], tok["eos_token"], tok["pad_token"]) == ("<|mask|>", "<|endoftext|>", "<|endoftext|>")
    assert family_spec("llada2").turn_end in tok["chat_template"]  # <|role_end|> closes every turn


def test_sdar_30b_a3b_config_and_state_dict_names_match_the_checkpoint():
    folder = FIXTURES / "SDAR-30B-A3B-Chat"
    config, model = _meta_model(folder, "sdar_moe")
    assert (config.num_hidden_layers, config.hidden_size, config.num_experts, config.num_experts_per_tok) == \
        (48, 2048, 128, 8)
    assert config.norm_topk_prob is True and config.mlp_only_layers == []
    assert state_dict_patterns(model) == json.loads((folder / "weight_map_patterns.json").read_text())
    added = json.loads((folder / "added_tokens.json").read_text())
    assert added["<|MASK|>"] == 151669 and added["<|im_end|>"] == 151645


def test_llada_tokenizer_config_special_ids():
    cfg = json.loads((FIXTURES / "LLaDA-8B-Instruct" / "tokenizer_config.json").read_text())
    ids = {t["content"]: int(i) for i, t in cfg["added_tokens_decoder"].items()}
    config = json.loads((FIXTURES / "LLaDA-8B-Instruct" / "config.json").read_text())
    assert ids[cfg["eos_token"]] == ids[cfg["pad_token"]] == config["eos_token_id"] == 126081
    assert ids["<|mdm_mask|>"] == config["mask_token_id"] == 126336
    assert ids["<|eot_id|>"] == 126348  # the end-of-turn token our llada adapter stops on


@pytest.mark.parametrize("name,family", [("SDAR-4B-Chat", "sdar"), ("SDAR-8B-Chat", "sdar"),
                                         ("SDAR-1dot7B-Chat", "sdar"), ("Dream-v0-Instruct-7B", "dream")])
@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What is 3 + 4?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 + 4?"}]])
def test_our_chat_template_renders_prompts_as_the_checkpoint_does(name, family, messages):
    from models.tokenizers import _FAMILIES
    real = json.loads((FIXTURES / name / "tokenizer_config.json").read_text())["chat_template"]
    tok = build_demo_tokenizer()
    render = lambda template: tok.apply_chat_template(messages, chat_template=template, tokenize=False,  # noqa: E731
                                                      add_generation_prompt=True)
    assert render(_FAMILIES[family][2]) == render(real)


def test_real_dream_tokenizer_folder_loads_with_the_qwen_ids(tmp_path):
    """Dream's real tokenizer files (its tokenizer_config, special tokens, added tokens; vocab.json + merges.txt from
    our offline Qwen2 rebuild, whose ids equal the official ones) load with no custom code and the Qwen ids."""
    import shutil

    from models.tokenizers import build_qwen_tokenizer
    qwen = build_qwen_tokenizer("dream", cache_dir=str(tmp_path / "cache"))
    folder = tmp_path / "dream"
    folder.mkdir()
    qwen.backend_tokenizer.model.save(str(folder))  # vocab.json + merges.txt
    for f in ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"):
        shutil.copy(FIXTURES / "Dream-v0-Instruct-7B" / f, folder / f)
    (folder / "tokenization_dream.py").write_text("raise RuntimeError('remote code was executed')\n")
    tok = load_tokenizer(folder)
    assert type(tok).__name__ == "Qwen2Tokenizer"
    text = "<|im_start|>user\nHello, what is 12 * 7?<|im_end|>\n<|im_start|>assistant\n<|mask|><|mask|>"
    assert tok(text)["input_ids"] == qwen(text)["input_ids"]
    assert tok("Hello")["input_ids"] == [9707]
    assert (tok.mask_token_id, tok.eos_token_id, tok.pad_token_id, len(tok)) == (151666, 151643, 151643, 151667)


@pytest.mark.parametrize("base", ["sdar", "llada2"])
def test_a_checkpoint_missing_weights_is_refused_and_extra_ones_are_named(tmp_path, capsys, base):
    from safetensors.torch import load_file, save_file

    from models.registry import load_model
    from models.tiny import save_tiny_checkpoint

    folder = save_tiny_checkpoint(tmp_path / base, base, build_demo_tokenizer(), size="test")
    weights = load_file(str(folder / "model.safetensors"))
    cfg = {"pretrained_model": str(folder), "model_base": base, "dtype": "float32"}
    load_model(cfg)  # the whole checkpoint loads
    assert "note:" not in capsys.readouterr().err
    gone = sorted(k for k in weights if k.endswith("layers.0.post_attention_layernorm.weight"))
    assert gone
    extra = {**{k: v for k, v in weights.items() if k not in gone}, "mtp.head.weight": torch.zeros(2)}
    save_file(extra, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=rf"1 missing weight\(s\), e\.g\. {re.escape(gone[0])}"):
        load_model(cfg)
    save_file({**weights, "mtp.head.weight": torch.zeros(2)}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    load_model(cfg)  # an unused extra head: loaded without it, and said
    assert "1 weight(s) of the checkpoint have no place in" in capsys.readouterr().err


@pytest.mark.parametrize("family,options", [
    ("dream", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}), ("dream", {"use_sliding_window": True}),
    ("sdar", {"use_sliding_window": True})])
def test_config_options_we_do_not_implement_are_refused(family, options):
    from models.dream.configuration_dream import DreamConfig
    from models.sdar.configuration_sdar import SDARConfig

    config_class = {"dream": DreamConfig, "sdar": SDARConfig}[family]
    config_class(use_sliding_window=False, rope_scaling=None)  # the hub configs' inert values load
    with pytest.raises(ValueError, match="is not supported"):
        config_class(**options)
