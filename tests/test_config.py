"""Config loading: shipped YAMLs validate, sections are the runtime classes, reference names map, one-line errors."""

import dataclasses
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.schema import to_dict
from jobs.config import SCHEMAS, ConfigError, config_text, job_kind, load_config, load_config_or_exit
from reward.sandbox import SandboxConfig
from sample.params import SamplingParams
from tools.check_config import main
from train.settings import LossConfig, OptimizerParams, RLTrainingConfig, ViewConfig

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "configs" / "demo").glob("*.yaml"))
# Shipped configs of features that are not in the repository yet: they must fail with "not supported yet".
NOT_YET: set[str] = set()
MINIMAL_RL = "model:\n  pretrained_model: some/model\n  model_base: trado\ndataset:\n  train_dataset: MATH_train\n"
MINIMAL_EVAL = "model: {pretrained_model: m, model_base: sdar}\ndataset: {eval_dataset: MATH500}\n"


def _write(tmp_path: Path, text: str, name: str = "rl_job.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _error(argv: list[str], kind: str = "rl") -> str:
    with pytest.raises(ConfigError) as info:
        load_config(argv, kind, stream=io.StringIO())
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


# the one note a shipped config may give: the reference's rows per sample of Dream / LLaDA RL, kept for a run
# switched to random_masking or coupled
SWITCH_NOTE = "training.mask_times_per_sample 35 has no effect with training.method 'TraceRL'"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_validates_and_round_trips(path, tmp_path):
    kind = job_kind(path)
    if path.name in NOT_YET:
        assert "not supported yet" in _error([f"config={path}"], kind)
        return
    notes = io.StringIO()
    cfg = load_config([f"config={path}"], kind, stream=notes)
    # our own files carry no key without effect, but for one kept for a switch of method (SWITCH_NOTE)
    assert all(SWITCH_NOTE in line for line in notes.getvalue().splitlines()), notes.getvalue()
    assert cfg.experiment.project == path.stem
    assert isinstance(cfg, SCHEMAS[kind])
    dumped = tmp_path / "config.yaml"
    dumped.write_text(config_text(cfg))
    again = load_config([f"config={dumped}"], kind)
    assert to_dict(again) == to_dict(cfg)


def test_infer_kind():
    assert job_kind("configs/multinode_rl_trado.yaml") == "rl"
    assert job_kind("configs/rl_dream.yaml") == "rl"
    assert job_kind("configs/llada_eval.yaml") == "eval"
    assert job_kind("configs/demo/eval_demo.yaml") == "eval"
    assert job_kind("configs/sft_mmada.yaml") == "sft"
    with pytest.raises(ConfigError, match="cannot infer"):
        job_kind("configs/whatever.yaml")


# ------------------------------------------------------------------------------------------ one declaration


def test_sections_are_the_runtime_settings_classes(tmp_path):
    cfg = load_config([f"config={_write(tmp_path, MINIMAL_RL)}"], "rl")
    assert isinstance(cfg.rollout, SamplingParams) and isinstance(cfg.evaluation, SamplingParams)
    assert isinstance(cfg.training, RLTrainingConfig)
    assert isinstance(cfg.training, ViewConfig) and isinstance(cfg.training, LossConfig)
    assert isinstance(cfg.optimizer.params, OptimizerParams) and isinstance(cfg.execute, SandboxConfig)


def test_schema_defaults_are_the_runtime_defaults(tmp_path):
    """A key absent from the YAML takes the runtime class's own default: there is no second set of defaults."""
    cfg = load_config([f"config={_write(tmp_path, MINIMAL_RL)}"], "rl")
    for section, cls in ((cfg.rollout, SamplingParams), (cfg.training, ViewConfig), (cfg.training, LossConfig),
                         (cfg.optimizer.params, OptimizerParams), (cfg.execute, SandboxConfig)):
        default = to_dict(cls())
        assert {k: to_dict(section)[k] for k in default} == default, cls.__name__
    assert to_dict(cfg.training) == to_dict(RLTrainingConfig())


def test_reference_defaults_of_rl_trado():
    cfg = load_config([f"config={ROOT / 'configs/rl_trado.yaml'}"], "rl")
    assert cfg.rollout.num_response_per_task == 16 and cfg.rollout.block_size == 4
    assert cfg.rollout.max_tokens == 2000 and cfg.rollout.remasking_strategy == "low_confidence_dynamic"
    assert cfg.training.gradient_accumulation_steps == 32 and cfg.training.max_prompt_len == 784
    assert cfg.optimizer.params.learning_rate == 1e-6
    assert cfg.reward.truncation_margin == 5 and (cfg.reward.acc_low, cfg.reward.acc_high) == (0.2, 0.8)
    assert (cfg.training.layout, cfg.training.loss_norm, cfg.training.old_logp) == ("packed", "padded_length",
                                                                                   "sampler")
    assert cfg.training.method == "tracerl" and cfg.training.beta == 0.01
    runs = cfg.evaluation.runs()
    assert [(r.remasking_strategy, r.top_k) for r in runs] == [("low_confidence_dynamic", 0),
                                                              ("low_confidence_static", 1)]


# ------------------------------------------------------------------------------------------ reference names


def test_reference_names_are_mapped_in_one_table(tmp_path):
    text = MINIMAL_RL + ("rollout:\n  max_token: 77\n  denoising_steps_per_block: 2\n  stop_token_list: ['<x>']\n"
                         "  use_cache: false\n  batch_size: 3\n")
    notes = io.StringIO()
    path = _write(tmp_path, text)
    cfg = load_config([f"config={path}"], "rl", stream=notes)
    r = cfg.rollout
    assert (r.max_tokens, r.denoising_steps, r.stop, r.cache, r.max_active) == (77, 2, ["<x>"], "none", 3)
    # one note per reference spelling, naming the code's
    lines = notes.getvalue().splitlines()
    assert len(lines) == 5 and all(line.startswith(f"note: {path}: 'rollout.") for line in lines)
    assert f"note: {path}: 'rollout.use_cache' is the reference's name of 'rollout.cache' (False -> 'none'); " \
           "write 'cache'" in lines
    quiet = io.StringIO()
    load_config([f"config={path}", "evaluation.max_tokens=5"], "rl", stream=quiet)
    assert len(quiet.getvalue().splitlines()) == 5  # the code's spelling adds no note


def test_shipped_configs_are_written_in_the_codes_words():
    import glob

    from jobs.config import job_kind

    for path in sorted(glob.glob(str(ROOT / "configs" / "**" / "*.yaml"), recursive=True)):
        notes = io.StringIO()
        load_config([f"config={path}"], job_kind(path), stream=notes)
        assert all(SWITCH_NOTE in line for line in notes.getvalue().splitlines()), (path, notes.getvalue())
    coupled = load_config([f"config={ROOT / 'configs' / 'rl_dream.yaml'}", "training.method=coupled"], "rl",
                          stream=io.StringIO())
    assert coupled.training.mask_times_per_sample == 35


def test_reference_dream_generation_length_reaches_the_sampler(tmp_path):
    """The reference's Dream/LLaDA configs size the answer with max_gen_length (no max_token)."""
    text = MINIMAL_EVAL + "rollout:\n  max_gen_length: 1024\n  steps: 512\nevaluation: null\n"
    text = text.replace("evaluation: null\n", "")
    cfg = load_config([f"config={_write(tmp_path, text, 'dream_eval.yaml')}"], "eval")
    assert cfg.rollout.max_tokens == 1024 and cfg.rollout.steps == 512


def test_interpolations_follow_renamed_keys(tmp_path):
    text = MINIMAL_RL + "rollout:\n  max_gen_length: 300\ntraining:\n  max_gen_length: ${rollout.max_gen_length}\n"
    cfg = load_config([f"config={_write(tmp_path, text)}"], "rl")
    assert cfg.rollout.max_tokens == 300 and cfg.training.max_gen_length == 300


def test_reference_and_own_name_disagreeing_is_an_error(tmp_path):
    text = MINIMAL_RL + "rollout:\n  max_token: 10\n  max_tokens: 20\n"
    msg = _error([f"config={_write(tmp_path, text)}"])
    assert "'rollout.max_token' (the reference's name of 'rollout.max_tokens')" in msg


def test_reference_keys_without_effect_load_with_a_notice(tmp_path):
    text = MINIMAL_RL.replace("MATH_train", "MATH_train\n  optimization_data: rl_data")
    text += "experiment: {function: train}\n"
    notes = io.StringIO()
    load_config([f"config={_write(tmp_path, text)}"], "rl", stream=notes)
    assert "'experiment.function' has no effect here" in notes.getvalue()
    assert "'dataset.optimization_data' has no effect here" in notes.getvalue()


def test_reference_eval_form_is_rewritten(tmp_path):
    text = "model: some/ckpt\nmodel_base: sdar\ndataset: {eval_dataset: MATH500}\n"
    cfg = load_config([f"config={_write(tmp_path, text, 'x_eval.yaml')}"], "eval")
    assert (cfg.model.pretrained_model, cfg.model.model_base) == ("some/ckpt", "sdar")


# ------------------------------------------------------------------------------------------ overrides


def test_overrides_are_typed_and_applied_in_order(tmp_path):
    path = _write(tmp_path, MINIMAL_RL)
    cfg = load_config([f"config={path}", "training.batch_size_lm=4", "optimizer.params.learning_rate=1e-5",
                       "rollout.temperature=1", "dataset.train_dataset=500", "training.layout=per_round",
                       "experiment.deepspeed_file=null", "rollout.top_k=5", "rollout.top_k=7",
                       "rollout.stop_token_list=[<|im_end|>]", "training.mixed_precision=no"], "rl")
    assert cfg.training.batch_size_lm == 4 and isinstance(cfg.training.batch_size_lm, int)
    assert cfg.optimizer.params.learning_rate == 1e-5
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.dataset.train_dataset == "500"
    assert cfg.training.layout == "per_round" and cfg.experiment.deepspeed_file is None
    assert cfg.rollout.top_k == 7 and cfg.rollout.stop == ["<|im_end|>"]
    assert cfg.training.mixed_precision == "no"
    assert cfg.experiment.project == "rl_job"  # defaults to the file stem


def test_evaluation_follows_rollout_unless_set(tmp_path):
    text = MINIMAL_RL + "rollout: {temperature: 0.5, max_token: 40}\nevaluation: {max_token: 90}\n"
    cfg = load_config([f"config={_write(tmp_path, text)}", "rollout.top_p=0.9"], "rl")
    assert (cfg.evaluation.temperature, cfg.evaluation.top_p, cfg.evaluation.max_tokens) == (0.5, 0.9, 90)


def test_paired_evaluation_lists(tmp_path):
    cfg = load_config([f"config={ROOT / 'configs/rl_trado.yaml'}", "evaluation.top_k=[0]",
                       "evaluation.remasking_strategy=[sequential]"], "rl")
    assert [(r.top_k, r.remasking_strategy) for r in cfg.evaluation.runs()] == [(0, "sequential")]
    msg = _error([f"config={ROOT / 'configs/rl_trado.yaml'}", "evaluation.top_k=[0,1]",
                  "evaluation.remasking_strategy=[sequential]"])
    assert "key 'evaluation.remasking_strategy'" in msg and "paired lists differ in length" in msg


# ------------------------------------------------------------------------------------------ errors


def test_unknown_key_in_yaml_names_file_key_and_closest(tmp_path):
    path = _write(tmp_path, MINIMAL_RL + "rollout:\n  temprature: 0.5\n")
    msg = _error([f"config={path}"])
    assert path in msg and "unknown key 'rollout.temprature'" in msg and "'rollout.temperature'" in msg


def test_unknown_key_in_override(tmp_path):
    path = _write(tmp_path, MINIMAL_RL)
    msg = _error([f"config={path}", "training.learning_rate=1e-5"])
    assert "override 'training.learning_rate=1e-5'" in msg and "optimizer.params.learning_rate" in msg


def test_missing_required_key(tmp_path):
    path = _write(tmp_path, 'model: {model_base: sdar}')
    msg = _error([f"config={path}"], "eval")
    assert f"{path}: missing required key 'model.pretrained_model'" in msg


def test_required_marker_in_an_override_is_refused(tmp_path):
    msg = _error([f"config={_write(tmp_path, MINIMAL_RL)}", "rollout.temperature=???"])
    assert "key 'rollout.temperature' needs a value" in msg


@pytest.mark.parametrize("override,expect", [
    ("rollout.temperature=hot", "key 'rollout.temperature' expects a number"),
    ("rollout.remasking_strategy=low_confidense_static", "(closest: 'low_confidence_static')"),
    ("rollout.top_p=0", "key 'rollout.top_p': top_p must be in (0.0, 1.0]"),
    ("rollout.max_active=0", "key 'rollout.max_active': max_active must be >= 1"),
    ("training.lower_p=0.95", "key 'training.lower_p': lower_p (0.95) exceeds upper_p"),
    ("reward.acc_low=0.9", "key 'reward.acc_low'"),
    ("training.method=ppo", "key 'training.method'"),
    ("model.process_reward_model=x", "key 'model.process_reward_model': the process reward needs the value model"),
    ("training.gam=1.5", "key 'training.gam': gam must be in [0.0, 1.0]"),
    ("rollout.tensor_parallel_size=2", "tensor parallelism is not supported"),
    ("experiment.current_epoch=3", "key 'experiment.current_epoch' is 3: a run resumes from its directory's"),
    ("dataset.train_dataset=builtin:code", "key 'dataset.data_type'"),
    ("execute.memory_mb=-1", "key 'execute.memory_mb'"),
    ("model.optimized_name=last", "key 'model.optimized_name': optimized_name 'last' must be a plain folder name"),
    ("model.optimized_name=../elsewhere", "key 'model.optimized_name'"),
    ("experiment.project=.", "key 'experiment.project': project '.' must name a folder inside output_dir"),
    ("experiment.project=a/../..", "key 'experiment.project'"),
    ("experiment.project=/tmp/x", "key 'experiment.project'"),
    ("model.optimized_value_name=optimized", "key 'model.optimized_value_name'"),
    ("model.optimized_value_name=last.old", "key 'model.optimized_value_name': optimized_value_name 'last.old'"),
])
def test_bad_values_name_the_key(tmp_path, override, expect):
    assert expect in _error([f"config={_write(tmp_path, MINIMAL_RL)}", override])


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = _write(tmp_path, "model:\n  pretrained_model: \"oops\n  model_base: sdar\n")
    msg = _error([f"config={path}"])
    assert path in msg and "invalid YAML" in msg


def test_a_leading_tilde_in_a_path_is_the_home_folder(tmp_path):
    """YAML files and quoted overrides reach us unexpanded: a path key reads ~ as a shell would."""
    cfg = load_config([f"config={_write(tmp_path, MINIMAL_RL)}", "experiment.output_dir=~/runs",
                       "model.value_base_model=~/ckpt", "dataset.train_dataset=~/data/train.json"], "rl")
    home = os.path.expanduser("~")
    assert cfg.experiment.output_dir == f"{home}/runs" and cfg.model.value_base_model == f"{home}/ckpt"
    assert cfg.dataset.train_dataset == f"{home}/data/train.json"


def test_argument_errors(tmp_path):
    assert "missing 'config=<file.yaml>'" in _error(["rollout.top_k=1"])
    assert "not of the form key=value" in _error([f"config={_write(tmp_path, MINIMAL_RL)}", "verbose"])
    assert "file not found" in _error(["config=/nonexistent/x.yaml"])


def test_load_config_or_exit_prints_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        load_config_or_exit("rl", [f"config={_write(tmp_path, MINIMAL_RL)}", "rollout.top_k=-1"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "rollout.top_k" in err


def test_cli_checks_files(tmp_path, capsys):
    good = _write(tmp_path, MINIMAL_RL, "rl_good.yaml")
    bad = _write(tmp_path, MINIMAL_RL + "rollout: {top_k: -1}\n", "rl_bad.yaml")
    assert main([good, bad]) == 1
    out = capsys.readouterr().out
    assert f"ok     {good}" in out and "error" in out and "rollout.top_k" in out
    mine = _write(tmp_path, MINIMAL_RL, "my_experiment.yaml")  # a name that says no kind: --kind does
    assert main([mine]) == 1 and "cannot infer the kind from the name" in capsys.readouterr().out
    assert main(["--kind", "rl", mine]) == 0 and f"ok     {mine}" in capsys.readouterr().out
    assert main(["--kind", "rl", str(tmp_path / "missing.yaml")]) == 1
    assert capsys.readouterr().out.strip() == f"error  {tmp_path / 'missing.yaml'}: file not found"
    noted = _write(tmp_path, MINIMAL_RL + "training: {lower_p: 0.3}\n", "rl_noted.yaml")
    assert main([noted]) == 0
    assert capsys.readouterr().out.splitlines() == [  # the note under its file's ok line
        f"ok     {noted}", f"note: {noted}: training.lower_p 0.3 has no effect with training.method 'TraceRL': its "
        "rows do not read it (read by random_masking, coupled, coupled-GRPO)"]


def test_config_errors_come_before_heavy_imports(tmp_path):
    """A typo is reported without importing torch, transformers or deepspeed (so in well under a second)."""
    code = ("import sys, eval as e\n"
            "try:\n"
            f"    rc = e.main(['config={ROOT / 'configs/demo/eval_demo.yaml'}', 'rollout.temprature=1'])\n"
            "except SystemExit as exit:\n"
            "    rc = exit.code\n"
            "heavy = [m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules]\n"
            "print(rc, heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "2 []", out.stdout + out.stderr


def test_dataclass_replace_revalidates():
    params = SamplingParams()
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(params, top_p=0.0)


def test_impossible_block_sizes_fail_at_load(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "sdar", "max_position_embeddings": 64}')
    base = MINIMAL_RL.replace("some/model", str(ckpt))
    path = _write(tmp_path, base)
    assert "key 'rollout.block_size'" in _error([f"config={path}", "rollout.block_size=0"])
    assert "key 'rollout.block_size'" in _error([f"config={path}", "rollout.block_size=-8"])
    msg = _error([f"config={path}", "rollout.block_size=128"])
    assert "key 'rollout.block_size': block_size (128) exceeds the 64 positions" in msg
    msg = _error([f"config={path}", "evaluation.block_size=[4,128]", "evaluation.top_k=[0,1]"])
    assert "key 'evaluation.block_size'" in msg
    assert load_config([f"config={path}", "rollout.block_size=8"], "rl").rollout.block_size == 8


def test_reference_keys_at_their_only_value_load_with_a_note(tmp_path):
    notes = io.StringIO()
    path = _write(tmp_path, MINIMAL_RL + "rollout:\n  tensor_parallel_size: 1\n")
    load_config([f"config={path}", "experiment.current_epoch=1"], "rl", stream=notes)
    lines = notes.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"note: {path}: 'rollout.tensor_parallel_size' has no effect here")
    assert "'experiment.current_epoch' has no effect here (the reference's default 1;" in lines[1]


def test_semi_ar_sft_of_a_full_attention_model_needs_a_block_size_at_load(tmp_path):
    path = _write(tmp_path, "model: {pretrained_model: m, model_base: dream}\n"
                            "dataset: {optimization_data: builtin:arithmetic}\n", "sft_job.yaml")
    assert "key 'training.block_size': semi-ar SFT of dream" in _error([f"config={path}"], "sft")
    assert load_config([f"config={path}", "training.block_size=32"], "sft", stream=io.StringIO())
    assert load_config([f"config={path}", "training.method=random_masking"], "sft", stream=io.StringIO())
    assert load_config([f"config={path}", "model.model_base=sdar"], "sft", stream=io.StringIO())  # its own blocks
    assert ("key 'training.block_size': training.block_size 32 has no effect on dream (full attention) with "
            "training.method 'ar'") in _error([f"config={path}", "training.method=ar", "training.block_size=32"], "sft")


def test_sft_builtin_keys_apply_to_the_datasets_that_read_them(tmp_path):
    path = _write(tmp_path, "model: {pretrained_model: m, model_base: sdar}\n"
                            "dataset: {optimization_data: data/mine.jsonl}\n", "sft_job.yaml")
    assert "key 'dataset.builtin_size': builtin_size applies to built-in datasets only, not to" in _error(
        [f"config={path}", "dataset.builtin_size=10"], "sft")
    assert "key 'dataset.builtin_difficulty': builtin_difficulty applies to builtin:arithmetic only, not to " \
           "'builtin:countdown2'" in _error([f"config={path}", "dataset.optimization_data=builtin:countdown2",
                                             "dataset.builtin_difficulty=2"], "sft")
    cfg = load_config([f"config={path}", "dataset.optimization_data=builtin:arithmetic",
                       "dataset.builtin_difficulty=2", "dataset.builtin_size=10"], "sft", stream=io.StringIO())
    assert (cfg.dataset.builtin_size, cfg.dataset.builtin_difficulty) == (10, 2)
    assert "key 'training.post_num': training.post_num trains pad tokens after an RL rollout's stop token" in _error(
        [f"config={path}", "training.post_num=2"], "sft")


def test_view_keys_the_method_never_reads_are_noted(tmp_path):
    sft = _write(tmp_path, "model: {pretrained_model: m, model_base: sdar}\n"
                           "dataset: {optimization_data: builtin:arithmetic}\n", "sft_job.yaml")

    def notes(argv: list[str], kind: str) -> str:
        out = io.StringIO()  # the loader's stream: each note names its file
        load_config(argv, kind, stream=out)
        return out.getvalue().strip()

    assert notes([f"config={sft}", "training.method=trace", "training.lower_p=0.3"], "sft") == (
        f"note: {sft}: training.lower_p 0.3 has no effect with training.method 'trace': its rows do not read it "
        "(read by semi-ar, random_masking)")
    assert notes([f"config={sft}", "training.shrink=2"], "sft") == (  # semi-ar: random masking
        f"note: {sft}: training.shrink 2 has no effect with training.method 'semi-ar': its rows do not read it "
        "(read by trace)")
    rl = _write(tmp_path, MINIMAL_RL)
    assert notes([f"config={rl}", "training.mask_times_per_sample=4"], "rl") == (  # RL methods only (not semi-ar)
        f"note: {rl}: training.mask_times_per_sample 4 has no effect with training.method 'TraceRL': its rows do "
        "not read it (read by random_masking, coupled, coupled-GRPO, SPG, BGPO, ESPO, VRPO, EBPO)")
    assert notes([f"config={rl}", "training.method=bgpo", "training.mask_times_per_sample=4"], "rl") == ""


def test_a_number_given_to_a_text_key_keeps_the_text_as_written(tmp_path):
    path = _write(tmp_path, "model: {pretrained_model: 1.10, model_base: sdar}\ndataset: {eval_dataset: MATH500}\n"
                            "experiment:\n  project: 0755\n", "eval_job.yaml")
    cfg = load_config([f"config={path}"], "eval", stream=io.StringIO())
    assert (cfg.experiment.project, cfg.model.pretrained_model) == ("0755", "1.10")  # not YAML's 493 and 1.1
    cfg = load_config([f"config={path}", "experiment.project=1_000", "dataset.eval_dataset=2e-5",
                       "experiment.seed=0x10"], "eval", stream=io.StringIO())
    assert (cfg.experiment.project, cfg.dataset.eval_dataset) == ("1_000", "2e-5")
    assert cfg.experiment.seed == 16  # a number key still reads the number
    # a mapping override and interpolations resolve as before: the written text is only a number's
    cfg = load_config([f"config={path}", "experiment={project: 12, seed: 3}"], "eval", stream=io.StringIO())
    assert (cfg.experiment.project, cfg.experiment.seed) == ("12", 3)
    cfg = load_config([f"config={path}", "experiment.seed=7", "experiment.project=${experiment.seed}"], "eval",
                      stream=io.StringIO())
    assert cfg.experiment.project == "7"


def test_environment_variables_keep_the_text_as_written(tmp_path):
    path = _write(tmp_path, MINIMAL_EVAL + "system:\n  env: {OMP_NUM_THREADS: 010, T: 1:30, R: 1e-3, F: false}\n",
                  "eval_job.yaml")
    cfg = load_config([f"config={path}", "system.env.FOO=0123", "system.env.B=true"], "eval", stream=io.StringIO())
    assert cfg.system.env == {"OMP_NUM_THREADS": "010", "T": "1:30", "R": "1e-3", "F": "false", "FOO": "0123",
                              "B": "true"}  # not YAML's 8, 90, 0.001, False, 83, True


def test_an_environment_mapping_on_the_command_line_replaces_the_files(tmp_path):
    path = _write(tmp_path, MINIMAL_EVAL + "system:\n  env: {A: '1', B: '2'}\n", "eval_job.yaml")
    assert load_config([f"config={path}", "system.env={}"], "eval", stream=io.StringIO()).system.env == {}
    cfg = load_config([f"config={path}", "system.env={C: '3'}", "system.env.D=4"], "eval", stream=io.StringIO())
    assert cfg.system.env == {"C": "3", "D": "4"}  # replaced, then a later key added to the new mapping
    cfg = load_config([f"config={path}", "system.env.D=4", "system.env={C: '3'}"], "eval", stream=io.StringIO())
    assert cfg.system.env == {"C": "3"}  # the last word wins, as for any key
    cfg = load_config([f"config={path}", "system.env.B=5"], "eval", stream=io.StringIO())
    assert cfg.system.env == {"A": "1", "B": "5"}  # one variable still merges into the file's


@pytest.mark.parametrize("method,override", [("bgpo", "training.loss_norm=token_mean"),
                                             ("espo", "training.ratio_level=sequence"),
                                             ("wd1", "training.ratio_level=sequence")])
def test_a_setting_the_methods_own_loss_does_not_read_is_refused(tmp_path, method, override):
    path = _write(tmp_path, MINIMAL_RL)
    assert f"key 'training.{override.split('.')[1].split('=')[0]}'" in _error(
        [f"config={path}", f"training.method={method}", override])
    load_config([f"config={path}", f"training.method={method}"], "rl", stream=io.StringIO())  # its defaults load
    load_config([f"config={path}", "training.method=wd1", "training.loss_norm=token_mean"], "rl",
                stream=io.StringIO())  # wd1 weighs its tokens: loss_norm applies


@pytest.mark.parametrize("path,kind,entry", [
    ("configs/demo/rl_demo.yaml", "sft", "is not an SFT config's; this is an RL config: python rl.py"),
    ("configs/demo/sft_demo.yaml", "rl", "is not an RL config's; this is an SFT config: python train/sft_sdar.py"),
    ("configs/demo/eval_demo.yaml", "serve", "is not a serve config's; this is an eval config: python eval.py"),
    ("configs/demo/serve_demo.yaml", "eval", "is not an eval config's; this is a serve config: python serve.py"),
])
def test_a_config_handed_to_the_wrong_script_says_which_script_runs_it(path, kind, entry):
    msg = _error([f"config={path}"], kind)
    assert msg.endswith(f"{entry} config={path}") and "closest valid key" not in msg  # the file, not a typo


def test_a_typo_gets_the_closest_key_and_no_other_script():
    typo = _error(["config=configs/demo/rl_demo.yaml", "rollout.temprature=0.5"], "rl")
    assert "closest valid key: 'rollout.temperature'" in typo and "this is" not in typo  # a typo: no other kind fits


@pytest.mark.parametrize("typo,closest", [
    ("training.lerning_rate=1e-5", "optimizer.params.learning_rate"),  # in another section (not training.lower_p)
    ("rollout.learning_rate=1e-5", "optimizer.params.learning_rate"),  # the exact name, in another section
    ("rollout.top_kk=3", "rollout.top_k"),  # a sibling wins a tie
    ("evaluation.temprature=0.5", "evaluation.temperature"),  # a name both sections have: the sibling
    ("model.model_b=sdar", "model.model_base"),  # a cut name: its sibling, not the section 'model'
    ("lora.target_mo=[q_proj]", "lora.target_modules"),  # not rollout.target elsewhere
])
def test_the_closest_key_is_looked_for_in_every_section(typo, closest):
    assert f"closest valid key: '{closest}'" in _error(["config=configs/demo/rl_demo.yaml", typo], "rl")
