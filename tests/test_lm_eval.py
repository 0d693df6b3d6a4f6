"""The lm-eval-harness model `dllm_rl`: the CLI in a fresh process against eval.py, the ELBO log-likelihood against
exact computations, the rolling-likelihood refusal and per-settings batching of generate_until."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import eval as eval_entry
from data.tasks import arithmetic_task
from models.common import AttentionLayout
from models.tiny import save_tiny_checkpoint
from reward.math import extract_answer
from sample.generate import generate
from sample.trajectory import read_jsonl
from train.likelihood import continuation_elbo

REPO = Path(__file__).resolve().parents[1]
SAMPLER = {"max_tokens": 16, "block_size": 4, "denoising_steps": 4, "max_active": 32,
           "remasking_strategy": "low_confidence_static"}
EVAL_KEYS = {"max_tokens": "max_token", "denoising_steps": "denoising_steps_per_block"}  # eval config spellings


def _write_task(tmp_path: Path, rows: list[dict]) -> None:
    """A local JSONL file and a task YAML that reuses the repository's MATH500 task with that file."""
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "tiny_arith.yaml").write_text(
        f"include: {REPO / 'lm_eval_tasks' / 'dllm_math500.yaml'}\ntask: tiny_arith\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n")


def _run_lm_eval(tmp_path: Path, ckpt: Path) -> list[dict]:
    """lm-eval's CLI through our wrapper in a fresh, offline process; its logged samples in doc order."""
    model_args = ",".join([f"pretrained={ckpt}", "model_base=sdar"] + [f"{k}={v}" for k, v in SAMPLER.items()])
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    cmd = [sys.executable, "-m", "lm_eval_dllm", "--model", "dllm_rl", "--model_args", model_args, "--device", "cpu",
           "--include_path", str(tmp_path), "--tasks", "tiny_arith", "--log_samples", "--output_path",
           str(tmp_path / "lm_eval_out")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (samples,) = (tmp_path / "lm_eval_out").rglob("samples_tiny_arith_*.jsonl")
    return sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda s: s["doc_id"])


def _run_eval_py(tmp_path: Path, ckpt: Path) -> list:
    """eval.py on the same file with the same (greedy) sampler settings; its trajectories in task order."""
    out = tmp_path / "runs"
    settings = [f"rollout.{EVAL_KEYS.get(k, k)}={v}" for k, v in SAMPLER.items()]
    rc = eval_entry.main(["config=configs/demo/eval_demo.yaml", f"experiment.output_dir={out}",
                          f"model.pretrained_model={ckpt}", "model.init_tiny_if_missing=false",
                          f"dataset.eval_dataset={tmp_path / 'tasks.jsonl'}", "rollout.temperature=0",
                          "rollout.num_response_per_task=1", "rollout.output_unmasking_history=false", *settings])
    assert rc == 0
    (path,) = (out / "eval_demo").glob("trajectories-*.jsonl")
    return list(read_jsonl(path))


def test_lm_eval_cli_matches_eval_py_sample_by_sample(tmp_path, demo_tokenizer):
    # A seed whose greedy responses differ from prompt to prompt, so equal texts mean equal prompts and settings.
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "sdar", demo_tokenizer, size="demo", seed=0)
    rows = arithmetic_task(6, seed=0)
    _write_task(tmp_path, rows)
    samples = _run_lm_eval(tmp_path, ckpt)
    trajs = _run_eval_py(tmp_path, ckpt)
    assert [s["doc"]["question"] for s in samples] == [r["question"] for r in rows] and len(trajs) == len(rows)
    texts = [t.text for t in trajs]
    assert len(set(texts)) > 1  # the comparison below is not between constant outputs
    for sample, traj in zip(samples, trajs, strict=True):
        generated = sample["resps"][0][0]
        # lm-eval gets the response without its final stop token; eval.py's text keeps it
        assert traj.text.startswith(generated) and len(demo_tokenizer.encode(traj.text[len(generated):])) <= 1
        assert extract_answer(generated) == extract_answer(traj.text)
        assert sample["exact_match"] == traj.score
    accuracy = sum(s["exact_match"] for s in samples) / len(samples)
    assert accuracy == sum(t.correct for t in trajs) / len(trajs)


def test_plain_lm_eval_does_not_know_the_model_without_the_wrapper():
    code = "from lm_eval.api.registry import get_model; get_model('dllm_rl')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "dllm_rl" in proc.stderr


# ------------------------------------------------------------ likelihood


def _logprob(adapter, ids: list[int], column: int, label: int, block: int | None = None) -> float:
    """log p(label) read at ``column`` of one forward of ``ids`` (full attention, or block-causal)."""
    x = torch.tensor([ids])
    pos = torch.arange(len(ids))[None]
    layout = (AttentionLayout.block_causal(pos, block) if block else
              AttentionLayout.full(torch.ones_like(x, dtype=torch.bool)))
    with torch.inference_mode():
        logits = adapter.forward(x, pos, layout)[0, column].float()
    return float(torch.log_softmax(logits, -1)[label])


def _full_logprob(adapter, ids: list[int], index: int) -> float:
    """log p(ids[index]) with that position masked (other masks in ``ids`` stay masked)."""
    noisy = list(ids)
    noisy[index] = adapter.mask_id
    column = index - 1 if adapter.shift_logits else index
    return _logprob(adapter, noisy, column, ids[index])


@pytest.mark.parametrize("model_base", ["llada", "dream"])
def test_one_token_elbo_is_the_exact_logprob(tiny, model_base):
    adapter = tiny(model_base)
    context, continuation = [5, 9, 13, 20], [33]
    got = continuation_elbo(adapter, context, continuation, mc_num=8, generator=torch.Generator().manual_seed(0))
    assert got == pytest.approx(_full_logprob(adapter, context + continuation, 4), abs=1e-5)


def test_two_token_elbo_estimate_is_close_to_the_exact_elbo(tiny):
    adapter = tiny("llada")
    ctx, (a, b) = [5, 9, 13, 20], [33, 40]
    m = adapter.mask_id
    # ELBO for L = 2: l = 1 (weight 2, one of the two masked) and l = 2 (weight 1, both masked), each w.p. 1/2
    one_a, one_b = _full_logprob(adapter, ctx + [a, b], 4), _full_logprob(adapter, ctx + [a, b], 5)
    both = _full_logprob(adapter, ctx + [a, m], 4) + _full_logprob(adapter, ctx + [m, b], 5)
    exact = 0.5 * (one_a + one_b) + 0.5 * both
    draws = 512
    got = continuation_elbo(adapter, ctx, [a, b], mc_num=draws, generator=torch.Generator().manual_seed(0))
    again = continuation_elbo(adapter, ctx, [a, b], mc_num=draws, generator=torch.Generator().manual_seed(0))
    assert got == again  # seeded
    # only the l = 1 half is random: a fair coin between 2 * one_a and 2 * one_b over draws / 2 draws
    std = abs(one_a - one_b) / math.sqrt(draws / 2) / 2
    assert abs(got - exact) <= 5 * std + 1e-5


def test_block_likelihood_is_exact_with_one_continuation_token_per_block(tiny):
    adapter = tiny("sdar", block_size=4)
    m = adapter.mask_id
    ctx, (a, b) = [5, 9, 13, 20, 7, 8, 11], [33, 40]  # a ends block 1, b opens block 2
    got = continuation_elbo(adapter, ctx, [a, b], mc_num=3, generator=torch.Generator().manual_seed(0))
    # block 1 with a masked, then block 2 (b and the rest of the block masked) after clean blocks 0-1
    direct = _logprob(adapter, ctx + [m], 7, a, block=4) + _logprob(adapter, ctx + [a, m, m, m, m], 8, b, block=4)
    assert got == pytest.approx(direct, abs=1e-5)


def test_block_likelihood_inside_one_block_is_its_elbo(tiny):
    adapter = tiny("sdar", block_size=4)
    m = adapter.mask_id
    ctx, (a, b) = [5, 9, 13, 20], [33, 40]  # both in block 1, whose last two positions stay masked
    one_a = _logprob(adapter, ctx + [m, b, m, m], 4, a, block=4)
    one_b = _logprob(adapter, ctx + [a, m, m, m], 5, b, block=4)
    both = _logprob(adapter, ctx + [m, m, m, m], 4, a, block=4) + _logprob(adapter, ctx + [m, m, m, m], 5, b, block=4)
    exact = 0.5 * (one_a + one_b) + 0.5 * both
    draws = 512
    got = continuation_elbo(adapter, ctx, [a, b], mc_num=draws, generator=torch.Generator().manual_seed(1))
    assert abs(got - exact) <= 5 * abs(one_a - one_b) / math.sqrt(draws / 2) / 2 + 1e-5


# ------------------------------------------------------------ the LM object


@pytest.fixture(scope="module")
def harness_lm(tmp_path_factory):
    from jobs.harness import DiffusionLM
    from models.tokenizers import build_demo_tokenizer

    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("lm") / "ckpt", "llada", build_demo_tokenizer(), size="test",
                                seed=1)
    return DiffusionLM(pretrained=str(ckpt), model_base="llada", device="cpu", mc_num=4, max_tokens=8,
                       block_size=4)


def _requests(*args):
    return [SimpleNamespace(args=a) for a in args]


def test_loglikelihood_and_is_greedy(harness_lm):
    context, continuation = "Compute 1 + 2.", " 3"
    ids = harness_lm.context_ids(context)
    greedy = generate(harness_lm.adapter, [ids], harness_lm._greedy_params(3), progress=False)[0].response_ids[:3]
    assert harness_lm._greedy_matches([(ids, greedy), (ids, [t + 1 for t in greedy])]) == [True, False]
    ((score, is_greedy),) = harness_lm.loglikelihood(_requests((context, continuation)))
    ctx_ids, cont_ids = harness_lm.encode_pair(context, continuation)
    assert ctx_ids == ids and cont_ids == harness_lm.adapter.encode_text(continuation)
    gen = torch.Generator().manual_seed(harness_lm.seed)
    assert score == pytest.approx(continuation_elbo(harness_lm.adapter, ids, cont_ids, 4, gen), abs=1e-6)
    assert is_greedy == harness_lm._greedy_matches([(ids, cont_ids)])[0]


def test_loglikelihood_rolling_is_refused(harness_lm):
    from core.errors import UserError
    from jobs.harness import ROLLING_REFUSAL

    with pytest.raises(NotImplementedError, match="lower bound") as err:  # lm-eval's own word for it, and ...
        harness_lm.loglikelihood_rolling(_requests(("some text",)))
    assert isinstance(err.value, UserError)  # ... a user error: `python -m lm_eval_dllm` prints one line, exit 2
    assert "\n" not in ROLLING_REFUSAL


def test_generate_until_one_sampler_call_per_setting(harness_lm, monkeypatch):
    import jobs.harness as harness

    calls = []
    real = harness.generate

    def counting(adapter, prompts, params, progress=True):
        calls.append((len(prompts), params.max_tokens, params.temperature))
        return real(adapter, prompts, params, progress=False)

    monkeypatch.setattr(harness, "generate", counting)
    greedy = {"until": ["\n\n"], "do_sample": False, "max_gen_toks": 4}
    longer = {"until": [], "do_sample": False, "max_gen_toks": 8}
    reqs = _requests(("a", greedy), ("b", longer), ("c", greedy), ("d", greedy))
    out = harness_lm.generate_until(reqs)
    assert sorted(calls) == [(1, 8, 0.0), (3, 4, 0.0)]
    assert len(out) == 4 and all("\n\n" not in text for text in out[::2])
    with pytest.raises(ValueError, match="num_beams"):
        harness_lm.generate_until(_requests(("a", {"num_beams": 2})))


def test_apply_chat_template_contexts_render_like_eval_py(harness_lm):
    from data.prompts import chat_ids

    adapter = harness_lm.adapter
    turn = [{"role": "user", "content": "Compute 1 + 2. <|im_end|>"}]
    assert harness_lm.context_ids(harness_lm.apply_chat_template(turn)) == chat_ids(adapter, turn)
    assert harness_lm.context_ids("Compute 1 + 2. <|im_end|>") == chat_ids(adapter, turn)  # chat=true: one user turn
    prefixed = turn + [{"role": "assistant", "content": "Answer:"}]
    context = harness_lm.apply_chat_template(prefixed, add_generation_prompt=False)
    assert harness_lm.context_ids(context) == chat_ids(adapter, turn) + adapter.encode_text("Answer:")


def test_raw_text_pairs_split_as_lm_eval_splits_them(harness_lm, monkeypatch):
    """chat=false: the context's trailing space moves to the continuation (BPE joins a space to the next word), so
    the continuation keeps every word; a continuation the split would leave empty is still scored."""
    monkeypatch.setattr(harness_lm, "chat", False)
    tok, encode = harness_lm.adapter.tokenizer, harness_lm.adapter.encode_text
    for context, continuation in (("The answer is ", "the cat"), ("Answer: ", "is"), ("Compute 1 + 2.", " 3")):
        ctx, cont = harness_lm.encode_pair(context, continuation)
        assert ctx == encode(context.rstrip()) and ctx + cont == encode(context + continuation)
        assert tok.decode(cont) == context[len(context.rstrip()):] + continuation
    ((score, _),) = harness_lm.loglikelihood(_requests(("Answer: ", "is")))
    assert math.isfinite(score) and score < 0


@pytest.fixture
def short_positions(harness_lm):
    """The harness model with 64 positions (LLaDA's config spells the limit max_sequence_length, an alias)."""
    config = harness_lm.adapter.model.config
    old, config.max_position_embeddings = config.max_position_embeddings, 64
    yield 64
    config.max_position_embeddings = old


def test_a_context_too_long_for_the_model_loses_its_oldest_tokens(harness_lm, short_positions, caplog):
    limit = short_positions
    context = "Compute 1 + 2. " * 40
    assert len(harness_lm.context_ids(context)) > limit
    with caplog.at_level("WARNING", logger="jobs.harness"):
        (text,) = harness_lm.generate_until(_requests((context, {"until": [], "max_gen_toks": 8})))
    assert isinstance(text, str) and "cut to its last" in caplog.text
    ((score, _),) = harness_lm.loglikelihood(_requests((context, " 3")))
    ctx, cont = harness_lm.encode_pair(context, " 3")
    kept = ctx[-(limit - len(cont)):]  # full attention: the continuation needs only its own positions
    gen = torch.Generator().manual_seed(harness_lm.seed)
    assert score == pytest.approx(continuation_elbo(harness_lm.adapter, kept, cont, 4, gen), abs=1e-6)


def test_is_greedy_decodes_without_the_approximate_prefix_cache(harness_lm):
    # full attention: the prefix cache (Fast-dLLM) is an approximation; is_greedy is about the model itself
    assert harness_lm.params.cache == "prefix" and harness_lm._greedy_params(3).cache == "none"


def test_generation_defaults_follow_lm_eval(harness_lm):
    from jobs.harness import base_params

    assert base_params({}, 0).max_tokens == 256 and base_params({"max_tokens": 32}, 0).max_tokens == 32
    assert harness_lm._params_for({"do_sample": True})[0].temperature == 1.0  # sampling asked, no temperature
    assert harness_lm._params_for({"do_sample": True, "temperature": 0.5})[0].temperature == 0.5
    assert harness_lm._params_for({"do_sample": False, "temperature": 0.5})[0].temperature == 0.0
    assert harness_lm._params_for({})[0].temperature == 0.0



def test_int_model_args_keep_a_tasks_fractional_sampling_settings(harness_lm, monkeypatch):
    from jobs.harness import base_params

    # lm-eval parses `--model_args temperature=1,top_p=1` as ints; a task's 0.6 / 0.95 must not become int(0.6) = 0
    params = base_params({"temperature": 1, "top_p": 1, "top_k": 0}, 0)
    assert (params.temperature, params.top_p) == (1.0, 1.0) and isinstance(params.temperature, float)
    monkeypatch.setattr(harness_lm, "params", params)
    task = harness_lm._params_for({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": "20"})[0]
    assert (task.temperature, task.top_p, task.top_k) == (0.6, 0.95, 20)
    with pytest.raises(ValueError, match="model_args temperature expects a number, got 'hot'"):
        base_params({"temperature": "hot"}, 0)


def test_a_bad_model_arg_is_one_line_at_the_command_line(capsys):
    """lm_eval_dllm runs lm-eval's CLI under run_job: our model_args errors are user errors (exit 2, one line)."""
    from core.entry import run_job
    from jobs.harness import base_params

    assert run_job(lambda: base_params({"max_tokenz": 8}, 0)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: dllm_rl: unknown model_args ['max_tokenz']")


def test_a_tasks_math_prompt_under_start_with_think_is_eval_pys_thinking_prompt(harness_lm, monkeypatch):
    from data.prompts import prompt_ids
    from jobs.harness import math_prompt

    doc = {"question": "What is 2+3?\nShow the sum."}
    for think in (False, True):
        monkeypatch.setattr(harness_lm, "start_with_think", think)
        assert harness_lm.context_ids(math_prompt(doc)) == prompt_ids(harness_lm.adapter, doc, "math", think)
        # --apply_chat_template: the prompt arrives as a user message; it is rewritten alike
        chat = harness_lm.apply_chat_template([{"role": "user", "content": math_prompt(doc)}])
        assert harness_lm.context_ids(chat) == prompt_ids(harness_lm.adapter, doc, "math", think)


@pytest.mark.parametrize(("args", "error"), [
    ("chat=no", "model_args chat expects"), ("greedy_check=off", "model_args greedy_check expects"),
    ("mc_num=2.9", "model_args mc_num expects"), ("mc_num=0", "model_args mc_num must be >= 1, got 0"),
    ("mc_batch_size=0", "model_args mc_batch_size must be >= 1"),
    ("denoising_steps=2.5", "model_args denoising_steps expects an int"),
])
def test_model_args_of_the_wrong_type_are_refused_before_the_model_loads(args, error):
    from jobs.harness import DiffusionLM, HarnessArgError

    with pytest.raises(HarnessArgError, match=error):  # the path does not exist: the check comes first
        DiffusionLM.create_from_arg_string(f"pretrained=/nonexistent,model_base=sdar,{args}")
