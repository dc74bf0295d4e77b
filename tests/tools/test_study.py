"""`gpn study` end to end at a toy budget: every model trains, is evaluated and lands in the report."""

from __future__ import annotations

import json

import pytest

from modeling_gpn.study import load_study, run_study

from ..environment import require_shared


@pytest.mark.slow
def test_toy_study_end_to_end(tmp_path):
    corpus = require_shared("data/tinyshakespeare/input.txt")
    data_dir = require_shared("data")
    results = run_study(
        "toy",
        tmp_path,
        data_dir=str(data_dir),
        show_progress=False,
        overrides={"dataset": str(corpus), "max_tokens": 20000, "cache_dir": str(tmp_path / "cache")},
    )
    expected = set(load_study("toy")["models"])
    assert set(results["rows"]) == expected
    for name, row in results["rows"].items():
        assert row["last_loss"] < row["first_loss"], f"{name} did not learn"
        for metric in ("fineweb_ppl", "lambada_acc", "lambada_ppl", "lm_eval_lambada_acc"):
            assert row[metric] is not None, f"{name}: {metric} missing"
        assert row["train_tokens_per_s"] > 0
        assert (tmp_path / name / "model" / "config.json").exists()
        assert (tmp_path / name / "eval" / "eval_results.json").exists()
    saved = json.loads((tmp_path / "study_results.json").read_text())
    assert saved["tokens_per_model"] == 6 * 4 * 32
    report = (tmp_path / "study_report.md").read_text()
    for name in expected:
        assert f"| {name} |" in report
    assert "| gpn-m-1l | transformer++ | fineweb_ppl |" in report
    assert "## Reading" in report
    assert (tmp_path / "training_curves.png").stat().st_size > 10_000


def test_sigterm_during_a_study_stops_cleanly_with_the_model_checkpointed(tmp_path):
    """`gpn study` trains in-process: SIGTERM reaches `gpn train`'s handler, which checkpoints the model being
    trained; the study then ends with the signal's exit code and one line, not a traceback."""
    import signal
    import sys

    from .train_runs import launch, stopped, wait_for_step

    corpus = require_shared("data/tinyshakespeare/input.txt")
    study = load_study("toy")
    study["recipe"].update(dataset=str(corpus), max_tokens=20000, cache_dir=str(tmp_path / "cache"), steps=100000)
    study["models"] = {"gpn-m-1l": study["models"]["gpn-m-1l"]}
    (tmp_path / "study.json").write_text(json.dumps(study))
    output = tmp_path / "out"
    process = launch(
        [
            sys.executable,
            "-m",
            "modeling_gpn.cli",
            "study",
            "--study",
            str(tmp_path / "study.json"),
            "--output",
            str(output),
            "--no-progress",
        ],
        tmp_path / "study.log",
    )
    wait_for_step(process, output / "gpn-m-1l", 2)
    process.send_signal(signal.SIGTERM)
    text = stopped(process, 128 + signal.SIGTERM)
    assert "gpn study: stopped by SIGTERM after step " in text, text[-3000:]
    assert list((output / "gpn-m-1l" / "checkpoints").glob("step-*"))


@pytest.mark.parametrize(
    "case",
    ["unknown-study", "unknown-model", "not-a-study"],
)
def test_a_study_that_cannot_run_is_one_line_before_anything_is_written(tmp_path, capsys, case):
    """A misspelt study or model name (`--only`), or a file that is not a study: exit 2 and one line saying
    what is wrong and what there is, before any model trains or any folder is made."""
    from modeling_gpn.cli import main

    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    arguments, needle = {
        "unknown-study": (["--study", "cpu-smal"], "No study named 'cpu-smal'; available: cpu-small, toy"),
        "unknown-model": (["--study", "toy", "--only", "gpn-m-1l", "gpn-m-9l"], "no model named gpn-m-9l; it has"),
        "not-a-study": (["--study", str(broken)], f"Cannot read the study {broken}"),
    }[case]
    output = tmp_path / "out"
    assert main(["study", *arguments, "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpn study: error: ") and needle in err, err
    assert not output.exists()
