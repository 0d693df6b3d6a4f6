"""Dataset formats and validation, built-in synthetic tasks, and the offline behaviour of download_data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data.formats import DataFormatError, load_dataset_file, row_kind, save_dataset_file, validate_row
from data.tasks import arithmetic_task, code_task, evaluate_expression
from reward.math import score_math
from reward.sandbox import CodeJob, code_from_response, run_many

REPO = Path(__file__).resolve().parent.parent
MATH_ROW = {"question": "1+1?", "ground_truth_answer": "2"}
FN_ROW = {"question": "f", "test_method": "function", "test_list": ["assert f(1) == 1"]}
STDIO_ROW = {"question": "echo", "test_method": "stdio", "test_input": ["1\n"], "test_output": ["1\n"],
             "test_time_limit": 2}


def write(tmp_path: Path, rows, name: str = "d.json") -> Path:
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    else:
        path.write_text(json.dumps(rows))
    return path


# ------------------------------------------------------------------------------------------------- formats
def test_valid_files_load_with_defaults(tmp_path):
    assert load_dataset_file(write(tmp_path, [MATH_ROW]), "math") == [MATH_ROW]
    code = load_dataset_file(write(tmp_path, [FN_ROW, STDIO_ROW], "c.jsonl"), "code")
    assert code[0]["test_time_limit"] == 1.0 and code[0]["prefix"] == ""
    assert code[1]["test_time_limit"] == 2
    sft = load_dataset_file(write(tmp_path, [{"prompt": "p", "response": "r", "extra": 1}]), "sft")
    assert sft[0]["extra"] == 1


@pytest.mark.parametrize(
    ("kind", "rows", "fragment"),
    [
        ("math", [MATH_ROW, {"question": "q"}], "row 1: field 'ground_truth_answer': missing"),
        ("math", [{"question": 3, "ground_truth_answer": "1"}], "row 0: field 'question': expected a string, got int"),
        ("math", [MATH_ROW, MATH_ROW, {**MATH_ROW, "ground_truth_answer": ""}], "row 2: field 'ground_truth_answer'"),
        ("option", [{**MATH_ROW, "ground_truth_answer": "E"}], "row 0: field 'ground_truth_answer': expected one of"),
        ("code", [{**FN_ROW, "test_method": "unit"}], "row 0: field 'test_method'"),
        ("code", [{**FN_ROW, "test_list": "assert 1"}], "field 'test_list': expected a list of strings, got str"),
        ("code", [{**FN_ROW, "test_list": ["ok", 5]}], "field 'test_list': item 1: expected a string, got int"),
        ("code", [{**FN_ROW, "test_time_limit": -1}], "field 'test_time_limit'"),
        ("code", [{**FN_ROW, "prefix": None}], "field 'prefix'"),
        ("code", [STDIO_ROW, {**STDIO_ROW, "test_output": []}], "row 1: field 'test_output': empty list"),
        ("code", [{**STDIO_ROW, "test_output": ["1", "2"]}], "row 0: field 'test_output': 2 outputs for 1 inputs"),
        ("sft", [{"prompt": "p"}], "row 0: field 'response': missing"),
        ("math", ["just a string"], "row 0: expected an object, got str"),
    ],
)
def test_validation_errors_name_file_row_and_field(tmp_path, kind, rows, fragment):
    path = write(tmp_path, rows)
    with pytest.raises(DataFormatError) as err:
        load_dataset_file(path, kind)
    assert fragment in str(err.value)
    assert str(path) in str(err.value)


def test_file_level_errors(tmp_path):
    with pytest.raises(DataFormatError, match="expected a JSON list"):
        load_dataset_file(write(tmp_path, {"question": "q"}), "math")
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(DataFormatError, match="invalid JSON"):
        load_dataset_file(bad, "math")
    lines = tmp_path / "lines.json"  # JSON Lines under a .json name
    lines.write_text(json.dumps(MATH_ROW) + "\n" + json.dumps(MATH_ROW) + "\n")
    with pytest.raises(DataFormatError, match=r"line 2: Extra data \(one JSON object per line is JSON Lines: name"):
        load_dataset_file(lines, "math")
    with pytest.raises(FileNotFoundError, match="dataset file not found"):
        load_dataset_file(tmp_path / "missing.json", "math")
    with pytest.raises(ValueError, match="unknown dataset kind"):
        validate_row(MATH_ROW, "images")


def test_infer_kind_and_save_roundtrip(tmp_path):
    assert [row_kind(r) for r in (MATH_ROW, FN_ROW, {"prompt": "p", "response": "r"})] == ["math", "code", "sft"]
    path = save_dataset_file([STDIO_ROW], tmp_path / "sub" / "x.json", "code")
    assert load_dataset_file(path, "code") == [STDIO_ROW]
    lines = save_dataset_file([MATH_ROW, MATH_ROW], tmp_path / "z.jsonl", "math")
    assert [json.loads(x) for x in lines.read_text().splitlines()] == [MATH_ROW, MATH_ROW]  # JSON Lines: a row a line
    assert load_dataset_file(lines, "math") == [MATH_ROW, MATH_ROW]
    odd = {**MATH_ROW, "question": "a\u2028b\u2029c\x85d\re"}  # line separators other than \n are text in a row
    assert load_dataset_file(save_dataset_file([odd], tmp_path / "odd.jsonl", "math"), "math") == [odd]
    with pytest.raises(DataFormatError):
        save_dataset_file([{"question": "q"}], tmp_path / "y.json", "math")
    assert not (tmp_path / "y.json").exists()


# ------------------------------------------------------------------------------------------ built-in tasks
def test_arithmetic_tasks_are_deterministic_and_correct():
    rows = arithmetic_task(50, seed=3, difficulty=3)
    assert rows == arithmetic_task(50, seed=3, difficulty=3)
    assert rows != arithmetic_task(50, seed=4, difficulty=3)
    for row in rows:
        expr = row["expression"]
        assert expr in row["question"] and "\\boxed{}" in row["question"]
        assert int(row["ground_truth_answer"]) == eval(expr, {"__builtins__": {}})  # noqa: S307 - our own digits
        assert score_math(f"so \\boxed{{{row['ground_truth_answer']}}}", row["ground_truth_answer"]) == 1.0
    easy = arithmetic_task(20, seed=0, difficulty=1)
    assert all(len(r["expression"].replace("(", "").replace(")", "").split()) == 3 for r in easy)
    assert all("*" not in r["expression"] for r in easy)
    assert all(abs(int(t)) < 10 for r in easy for t in r["expression"].split() if t.isdigit())
    with pytest.raises(ValueError):
        arithmetic_task(1, difficulty=0)


def test_evaluate_expression_is_restricted():
    assert evaluate_expression("(2 - 5) * 3 + -1") == -10
    with pytest.raises(ValueError, match="unsupported expression element: Call"):
        evaluate_expression("__import__('os')")


def test_code_tasks_are_deterministic_and_solvable():
    rows = code_task(16, seed=1, stdio_fraction=0.4)
    assert rows == code_task(16, seed=1, stdio_fraction=0.4)
    assert rows != code_task(16, seed=2, stdio_fraction=0.4)
    methods = {r["test_method"] for r in rows}
    assert methods == {"function", "stdio"}
    good = [CodeJob.from_task(r, r["solution"]) for r in rows]
    wrong = [CodeJob.from_task(r, code_from_response("    return None\n```", r["prefix"]) if r["test_method"]
                               == "function" else "print('nope')") for r in rows]
    results = run_many(good + wrong, max_workers=4)
    assert all(r.all_passed for r in results[: len(rows)]), [r.tests for r in results if not r.all_passed]
    assert all(r.pass_fraction == 0.0 for r in results[len(rows):])


def test_tasks_cli_writes_a_valid_file(tmp_path):
    out = tmp_path / "arith.json"
    done = subprocess.run([sys.executable, "-m", "tools.write_tasks", "--task", "arithmetic", "--n", "7", "--seed", "0",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert load_dataset_file(out, "math") == arithmetic_task(7, seed=0)
    for bad, error in ((["--n", "0"], "--n: must be >= 1"), (["--difficulty", "0"], "--difficulty: must be >= 1"),
                       (["--out", str(tmp_path)], "is a directory"),
                       (["--task", "code", "--difficulty", "3"], "--difficulty applies to --task arithmetic only")):
        args = ["--task", "arithmetic", "--out", str(out), *bad]
        done = subprocess.run([sys.executable, "-m", "tools.write_tasks", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2 and error in done.stderr.splitlines()[-1], done.stderr
    assert not list(tmp_path.glob("*.tmp"))


# ---------------------------------------------------------------------------------------------- download
def run_download(tmp_path: Path, extra_env: dict[str, str], dataset: str = "MATH500"):
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith("HF_")}
    env.update(extra_env)
    # no retry loop: a hang or a backoff of minutes ends in TimeoutExpired
    return subprocess.run([sys.executable, "-m", "tools.download_data", "--dataset", dataset, "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, env=env, cwd=REPO)


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "cannot reach 127.0.0.1:9"),  # nothing listens on port 9
        ({"HF_ENDPOINT": "https://hub.invalid"}, "cannot reach hub.invalid:443"),
        ({"HF_HUB_OFFLINE": "1", "HF_HOME": "/nonexistent-hf-home"}, "HF_HUB_OFFLINE is set"),
    ],
    ids=["refused", "unresolvable", "offline-flag"],
)
def test_download_fails_fast_offline(tmp_path, env, fragment):
    done = run_download(tmp_path, {"HF_HOME": str(tmp_path / "empty-hf-home"), **env})  # a cache without the file
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], done.stderr
    assert not (tmp_path / "MATH500.json").exists()


def test_an_unreachable_hub_reads_the_local_cache(tmp_path):
    """A hub the probe cannot reach leaves huggingface_hub's local cache (as HF_HUB_OFFLINE would): a file there is
    converted and validated as if just downloaded."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "datasets--Gen-Verse--MATH500"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    cached = repo / "snapshots" / commit / "test" / "MATH500.json"
    cached.parent.mkdir(parents=True)
    cached.write_text(json.dumps([{"question": "1 + 1?", "ground_truth_answer": 2}]))
    done = run_download(tmp_path, {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")})
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "MATH500.json").read_text()) == [{"question": "1 + 1?", "ground_truth_answer": "2"}]
    note = done.stderr.strip()  # the refusal's wording is the OS's
    assert note.startswith("note: cannot reach 127.0.0.1:9: ") and "\n" not in note
    assert note.endswith("(no network?); Gen-Verse/MATH500 read from the local cache")


def test_download_rejects_unknown_dataset(tmp_path):
    done = run_download(tmp_path, {}, dataset="NotADataset")
    assert done.returncode == 1 and "unknown dataset 'NotADataset'" in done.stderr
