"""Config loading: every shipped YAML validates, overrides are typed, user errors are one clear line."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from core.config import (
    SCHEMAS,
    ConfigError,
    cfg_to_dict,
    dump_config,
    eval_settings,
    infer_kind,
    load_config,
    load_config_or_exit,
    main,
)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "configs" / "demo").glob("*.yaml"))
MINIMAL_RL = "model:\n  pretrained_model: some/model\n  model_base: trado\ndataset:\n  train_dataset: MATH_train\n"


def _write(tmp_path: Path, text: str, name: str = "rl_job.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _error(argv: list[str], kind: str = "rl") -> str:
    with pytest.raises(ConfigError) as info:
        load_config(argv, kind)
    message = str(info.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------------ shipped files


def test_all_expected_configs_are_shipped():
    names = {p.name for p in SHIPPED}
    for family in ("trado", "sdar", "dream", "llada", "mmada"):
        assert f"rl_{family}.yaml" in names and f"sft_{family}.yaml" in names
    for family in ("trado", "sdar", "dream", "llada"):
        assert f"{family}_eval.yaml" in names
    assert {"rl_trado_with_value.yaml", "multinode_rl_trado.yaml"} <= names
    assert {"rl_demo.yaml", "eval_demo.yaml", "sft_demo.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_validates_and_round_trips(path, tmp_path):
    kind = infer_kind(path)
    cfg = load_config([f"config={path}"], kind)
    assert cfg.experiment.project == path.stem
    assert set(cfg) == {f.name for f in SCHEMAS[kind].__dataclass_fields__.values()}
    dumped = dump_config(cfg, tmp_path / "step_1" / "config.yaml")
    again = load_config([f"config={dumped}"], kind)
    assert cfg_to_dict(again) == cfg_to_dict(cfg)


def test_infer_kind():
    assert infer_kind("configs/multinode_rl_trado.yaml") == "rl"
    assert infer_kind("configs/rl_dream.yaml") == "rl"
    assert infer_kind("configs/llada_eval.yaml") == "eval"
    assert infer_kind("configs/demo/eval_demo.yaml") == "eval"
    assert infer_kind("configs/sft_mmada.yaml") == "sft"
    with pytest.raises(ConfigError, match="cannot infer"):
        infer_kind("configs/whatever.yaml")


def test_reference_defaults_of_rl_trado():
    cfg = load_config([f"config={ROOT / 'configs/rl_trado.yaml'}"], "rl")
    assert cfg.rollout.num_response_per_task == 16 and cfg.rollout.block_size == 4
    assert cfg.training.gradient_accumulation_steps == 32 and cfg.training.max_prompt_len == 784
    assert cfg.optimizer.params.learning_rate == 1e-6 and cfg.lr_scheduler.params.learning_rate == 1e-6
    assert cfg.reward.truncation_margin == 5 and (cfg.reward.acc_low, cfg.reward.acc_high) == (0.2, 0.8)
    assert (cfg.training.packed, cfg.training.loss_norm, cfg.training.old_logp) == (True, "padded_length",
                                                                                   "recompute")
    assert cfg.training.random_mask_mode == "per_sequence" and cfg.training.ref_beta == 0.0


def test_schema_defaults_of_each_kind(tmp_path):
    sft_text = "model: {pretrained_model: m, model_base: sdar}\ndataset: {optimization_data: d}\n"
    sft = load_config([f"config={_write(tmp_path, sft_text)}"], "sft")
    assert sft.training.method == "semi-ar" and sft.training.gradient_accumulation_steps == 16
    assert sft.optimizer.params.learning_rate == 1e-5
    ev_text = "model: {pretrained_model: m, model_base: dream}\ndataset: {eval_dataset: MATH500}\n"
    ev = load_config([f"config={_write(tmp_path, ev_text)}"], "eval")
    assert ev.rollout.num_response_per_task == 3 and ev.rollout.output_unmasking_history is True
    assert ev.model.attn_backend == "sdpa" and ev.model.dtype == "bfloat16" and ev.experiment.output_dir == "runs"


# ------------------------------------------------------------------------------------------ overrides


def test_overrides_are_typed_and_applied_in_order(tmp_path):
    path = _write(tmp_path, MINIMAL_RL)
    cfg = load_config([f"config={path}", "training.batch_size_lm=4", "optimizer.params.learning_rate=1e-5",
                       "rollout.temperature=1", "dataset.train_dataset=500", "training.packed=false",
                       "experiment.deepspeed_file=null", "rollout.top_k=5", "rollout.top_k=7",
                       "rollout.stop_token_list=[<|im_end|>]", "training.mixed_precision=no"], "rl")
    assert cfg.training.batch_size_lm == 4 and isinstance(cfg.training.batch_size_lm, int)
    assert cfg.optimizer.params.learning_rate == 1e-5
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.dataset.train_dataset == "500"
    assert cfg.training.packed is False and cfg.experiment.deepspeed_file is None
    assert cfg.rollout.top_k == 7
    assert list(cfg.rollout.stop_token_list) == ["<|im_end|>"]
    assert cfg.training.mixed_precision == "no"
    assert cfg.experiment.project == "rl_job"  # defaults to the file stem


def test_override_replaces_a_whole_list(tmp_path):
    path = ROOT / "configs/rl_trado.yaml"
    cfg = load_config([f"config={path}", "evaluation.top_k=[0]", "evaluation.remasking_strategy=[sequential]"],
                      "rl")
    assert [(s["top_k"], s["remasking_strategy"]) for s in eval_settings(cfg.evaluation)] == [(0, "sequential")]


def test_struct_mode_rejects_unknown_attributes(tmp_path):
    cfg = load_config([f"config={_write(tmp_path, MINIMAL_RL)}"], "rl")
    with pytest.raises(Exception, match="batch_size"):
        _ = cfg.training.batch_size


# ------------------------------------------------------------------------------------------ interpolation


def test_interpolation_follows_overrides():
    path = ROOT / "configs/rl_dream.yaml"
    cfg = load_config([f"config={path}", "rollout.max_gen_length=512"], "rl")
    assert cfg.training.max_gen_length == 512 and cfg.rollout.max_token == 512
    assert OmegaConf.is_interpolation(cfg.training, "max_gen_length")
    assert cfg_to_dict(cfg)["training"]["max_gen_length"] == 512
    assert cfg_to_dict(cfg, resolve=False)["training"]["max_gen_length"] == "${rollout.max_gen_length}"


def test_interpolation_in_override_and_broken_interpolation(tmp_path):
    path = _write(tmp_path, MINIMAL_RL)
    cfg = load_config([f"config={path}", "training.max_gen_length=${rollout.max_token}", "rollout.max_token=64"],
                      "rl")
    assert cfg.training.max_gen_length == 64
    msg = _error([f"config={path}", "training.max_gen_length=${rollout.nope}"])
    assert "'training.max_gen_length'" in msg and "rollout.nope" in msg and path in msg


def test_interpolated_value_is_type_checked(tmp_path):
    path = _write(tmp_path, MINIMAL_RL + "training:\n  batch_size_lm: ${dataset.train_dataset}\n")
    msg = _error([f"config={path}"])
    assert "'training.batch_size_lm' expects an int, got 'MATH_train'" in msg and path in msg


def test_null_placeholders_follow_rollout(tmp_path):
    path = _write(tmp_path, MINIMAL_RL + "rollout:\n  max_token: 100\n")
    cfg = load_config([f"config={path}"], "rl")
    assert (cfg.rollout.max_gen_length, cfg.rollout.steps) == (100, 100)
    assert cfg.evaluation.further_horizon == cfg.rollout.further_horizon == 32
    assert cfg.evaluation.block_size == 4 and cfg.evaluation.top_k == 0
    assert (cfg.rollout.use_cache, cfg.rollout.cache) == (True, "prefix")
    assert cfg.optimizer.params.policy_learning_rate == cfg.optimizer.params.learning_rate
    assert cfg.optimizer.params.value_learning_rate == 5e-6
    cfg = load_config([f"config={path}", "rollout.cache=none", "evaluation.cache=dual"], "rl")
    assert (cfg.rollout.use_cache, cfg.evaluation.use_cache, cfg.evaluation.cache) == (False, True, "dual")


def test_reference_eval_form_is_rewritten(tmp_path):
    text = "model: Gen-Verse/TraDo-4B-Instruct\nmodel_base: trado\ndataset:\n  eval_dataset: MATH500\n"
    cfg = load_config([f"config={_write(tmp_path, text, 'trado_eval.yaml')}"], "eval")
    assert cfg.model.pretrained_model == "Gen-Verse/TraDo-4B-Instruct" and cfg.model.model_base == "trado"
    cfg = load_config([f"config={_write(tmp_path, text, 'trado_eval.yaml')}", "model=other/path"], "eval")
    assert cfg.model.pretrained_model == "other/path"


def test_eval_settings_pairs_lists():
    cfg = load_config([f"config={ROOT / 'configs/rl_trado.yaml'}"], "rl")
    runs = eval_settings(cfg.evaluation)
    assert [(r["top_k"], r["remasking_strategy"], r["block_size"]) for r in runs] == [
        (0, "low_confidence_dynamic", 4), (1, "low_confidence_static", 4)]
    assert all(r["max_active"] == 16 for r in runs)


# ------------------------------------------------------------------------------------------ errors


def test_unknown_key_in_yaml_names_file_key_and_closest(tmp_path):
    path = _write(tmp_path, MINIMAL_RL + "training:\n  batch_sise_lm: 2\n")
    msg = _error([f"config={path}"])
    assert msg == f"{path}: unknown key 'training.batch_sise_lm' (closest valid key: 'training.batch_size_lm')"


def test_unknown_key_in_override(tmp_path):
    path = _write(tmp_path, MINIMAL_RL)
    msg = _error([f"config={path}", "rollout.remasking=sequential"])
    assert msg.startswith(f"{path} (override 'rollout.remasking=sequential'): unknown key 'rollout.remasking'")
    assert "closest valid key: 'rollout.remasking_strategy'" in msg
    assert "closest valid key: 'training'" in _error([f"config={path}", "trainig.seed=1"])
    assert "closest valid key: 'rollout.block_size'" in _error([f"config={path}", "rollout.block_length=8"])
    # a key placed in the wrong section points at the section that has it
    assert "closest valid key: 'training.shrink'" in _error([f"config={path}", "experiment.shrink=2"])


def test_kind_specific_keys(tmp_path):
    sft = _write(tmp_path, "model: {pretrained_model: m, model_base: sdar}\ndataset: {optimization_data: d}\n")
    msg = _error([f"config={sft}", "training.eps=0.1"], "sft")
    assert "unknown key 'training.eps'" in msg
    assert "must be one of {semi-ar, trace, ar, random_masking}, got 'TraceRL'" in _error(
        [f"config={sft}", "training.method=TraceRL"], "sft")
    rl = _write(tmp_path, MINIMAL_RL)
    assert "must be one of {TraceRL, random_masking, coupled}, got 'semi-ar'" in _error(
        [f"config={rl}", "training.method=semi-ar"])


def test_missing_required_key(tmp_path):
    path = _write(tmp_path, "model:\n  model_base: trado\ndataset:\n  train_dataset: MATH_train\n")
    msg = _error([f"config={path}"])
    assert msg.startswith(f"{path}: missing required key 'model.pretrained_model'")
    path = _write(tmp_path, "model: {pretrained_model: m, model_base: sdar}\n", "sft_job.yaml")
    assert "missing required key 'dataset.optimization_data'" in _error([f"config={path}"], "sft")


def test_wrong_type(tmp_path):
    path = _write(tmp_path, MINIMAL_RL)
    msg = _error([f"config={path}", "training.batch_size_lm=abc"])
    assert msg == (f"{path} (override 'training.batch_size_lm=abc'): key 'training.batch_size_lm' expects an int, "
                   "got 'abc' (str)")
    assert "expects a bool, got 3" in _error([f"config={path}", "training.packed=3"])
    assert "'rollout.top_k' expects an int, got 1.5" in _error([f"config={path}", "rollout.top_k=1.5"])
    assert "key 'training' is a section" in _error([f"config={path}", "training=3"])
    bad = _write(tmp_path, MINIMAL_RL + "rollout:\n  stop_token_list: {a: 1}\n")
    assert f"{bad}: key 'rollout.stop_token_list' expects a list of string, got a mapping" == _error(
        [f"config={bad}"])


def test_value_outside_allowed_set(tmp_path):
    path = _write(tmp_path, MINIMAL_RL)
    msg = _error([f"config={path}", "rollout.remasking_strategy=low_confidense_static"])
    assert "key 'rollout.remasking_strategy' must be one of {low_confidence_static, low_confidence_dynamic, " \
           "sequential, entropy_bounded}, got 'low_confidense_static' (closest: 'low_confidence_static')" in msg
    assert "(closest: 'dream')" in _error([f"config={path}", "model.model_base=Dream"])
    assert "list element must be one of" in _error([f"config={path}", "evaluation.remasking_strategy=[foo]"])
    for key in ("model.attn_backend=xformers", "model.dtype=fp8", "lr_scheduler.scheduler=cosine_with_restarts",
                "rollout.cache=full", "rollout.target=entropy", "training.loss_norm=sum", "dataset.data_type=text"):
        assert f"key '{key.split('=')[0]}' must be one of" in _error([f"config={path}", key])


def test_range_and_cross_key_errors(tmp_path):
    path = _write(tmp_path, MINIMAL_RL)
    assert "key 'training.batch_size_lm' must be >= 1, got 0" in _error([f"config={path}", "training.batch_size_lm=0"])
    assert "key 'training.lower_p' must be in [0.0, 1.0], got 1.5" in _error([f"config={path}", "training.lower_p=1.5"])
    assert "'training.lower_p' (0.8) exceeds training.upper_p (0.5)" in _error(
        [f"config={path}", "training.lower_p=0.8", "training.upper_p=0.5"])
    assert "'rollout.cache' is 'dual' but rollout.use_cache is false" in _error(
        [f"config={path}", "rollout.use_cache=false", "rollout.cache=dual"])
    msg = _error([f"config={path}", "evaluation.top_k=[0,1]", "evaluation.remasking_strategy=[sequential]"])
    assert "paired evaluation lists differ in length" in msg and "evaluation.top_k has 2" in msg


def test_unsupported_reference_key(tmp_path):
    path = _write(tmp_path, MINIMAL_RL)
    msg = _error([f"config={path}", "model.process_reward_model=judge"])
    assert "unsupported key 'model.process_reward_model'" in msg and "not implemented" in msg


def test_argument_errors(tmp_path):
    assert _error([]).startswith("missing 'config=<file.yaml>' argument")
    assert _error(["training.seed=1"]).startswith("missing 'config=<file.yaml>' argument")
    missing = tmp_path / "nope.yaml"
    assert _error([f"config={missing}"]).startswith(f"config={missing}: file not found")
    path = _write(tmp_path, MINIMAL_RL)
    assert "is not of the form key=value" in _error([f"config={path}", "training.seed"])
    assert "config= given twice" in _error([f"config={path}", f"config={path}"])
    with pytest.raises(ConfigError, match="unknown job kind"):
        load_config([f"config={path}"], "train")


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = _write(tmp_path, "model:\n  pretrained_model: m\n  model_base: [trado\n")
    msg = _error([f"config={path}"])
    assert msg.startswith(f"{path} line ") and "invalid YAML" in msg
    listing = _write(tmp_path, "- a\n- b\n")
    assert "top level must be a mapping" in _error([f"config={listing}"])


def test_config_error_is_value_error_with_key_and_source(tmp_path):
    path = _write(tmp_path, MINIMAL_RL)
    with pytest.raises(ValueError) as info:
        load_config([f"config={path}", "rollout.top_k=x"], "rl")
    assert info.value.key == "rollout.top_k" and info.value.source.startswith(path)


def test_load_config_or_exit_prints_one_line(tmp_path, capsys):
    path = _write(tmp_path, MINIMAL_RL)
    with pytest.raises(SystemExit) as info:
        load_config_or_exit("rl", [f"config={path}", "training.nope=1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("config error: ") and "training.nope" in err


def test_cli_checks_files(tmp_path, capsys):
    assert main([str(p) for p in SHIPPED]) == 0
    bad = _write(tmp_path, MINIMAL_RL + "rollout:\n  top_k: x\n")
    assert main([bad]) == 1
    assert "rollout.top_k" in capsys.readouterr().out
