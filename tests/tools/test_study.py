"""`gpn study` end to end at a toy budget: every model trains, is evaluated and lands in the report."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from modeling_gpn.study import load_study, run_study

from ..environment import require_shared
from ..subprocesses import started_in_the_background


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
    # each model's held-out perplexity scores the windows gpn train held out of its 20,000 tokens, read from its
    # token cache (once tokenized, for every model): not the end of the whole corpus
    from modeling_gpn.data import TokenStream, WindowDataset

    # (the one cache folder, beside the empty lock file of its key: `data.cache.writing_alone`)
    (cache,) = (path for path in (tmp_path / "cache" / "tokens").iterdir() if path.is_dir())
    held_out = WindowDataset(TokenStream(cache), 32, 0.1, seed=0)
    for name in expected:
        evaluated = json.loads((tmp_path / name / "eval" / "eval_results.json").read_text())
        fineweb = evaluated["tasks"]["fineweb_paper"]
        assert (fineweb["first_window"], fineweb["windows"]) == (held_out.num_train, held_out.num_val) == (563, 62)
        assert fineweb["stream_tokens"] == 20000 and evaluated["token_cache"] == {"fineweb_paper": str(cache)}
        # (the stream its training summary named)
        assert evaluated["data"]["fineweb_paper"] == f"{cache} (gpn train's tokens of {corpus.resolve()})"
        # every model reads LAMBADA through the training window (the Gated DeltaNet read it through Qwen3-Next's
        # 32,768 tokens, the others through 32)
        assert evaluated["max_length"] == 32, (name, evaluated["max_length"])
    saved = json.loads((tmp_path / "study_results.json").read_text())
    assert saved["tokens_per_model"] == 6 * 4 * 32
    report = (tmp_path / "study_report.md").read_text()
    # the parameter counts are the saved models' (recounted from their weights), and the report states how far
    # apart they are: it said "matched" whatever they were (here 39% apart)
    from safetensors import safe_open

    counts = {}
    for name, row in results["rows"].items():
        with safe_open(str(tmp_path / name / "model" / "model.safetensors"), "pt") as weights:
            shapes = {key: weights.get_slice(key).get_shape() for key in weights.keys()}  # noqa: SIM118
        total = sum(math.prod(shape) for shape in shapes.values())
        assert (row["params"], row["non_embedding_params"]) == (total, total - 512 * 16), name
        counts[name] = row["non_embedding_params"]
        # every model read the same tokens in the same order under the same schedule: its log's steps, token
        # counts and learning rates are the gpn model's; the curve and the first / last loss are its log's
        log = [json.loads(line) for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]
        logged = [(r["step"], r["tokens"]) for r in log if "loss" in r and "lr" in r]
        assert logged == [(step, step * 4 * 32) for step in range(1, 7)], name
        curve = json.loads((tmp_path / name / "study_run.json").read_text())["run"]["train"]["curve"]
        assert curve == [[r["tokens"], r["loss"]] for r in log if "loss" in r and "lr" in r], name
        assert (row["first_loss"], row["last_loss"]) == (curve[0][1], curve[-1][1]), name
    lrs = {name: [json.loads(line).get("lr") for line in (tmp_path / name / "log.jsonl").open()] for name in counts}
    assert all(rates == lrs["gpn"] for rates in lrs.values()), lrs
    low, high = min(counts.values()), max(counts.values())
    assert f"{low:,} to {high:,} here, the largest {(high - low) / low * 100:.1f}% above the smallest." in report
    assert "Curves, first and last loss: each step's training loss, for every model alike." in report, report
    for name in expected:
        assert f"| {name} |" in report
    assert "| gpn-m-1l | transformer++ | fineweb_ppl |" in report
    assert "## Reading" in report
    # (the baselines' first position of a window is not scored: the report said "every position scored")
    assert "a GPN's first position predicted from its empty state, a baseline's not scored" in report, report
    assert (tmp_path / "training_curves.png").stat().st_size > 10_000


def _stopped_study(folder: Path, env: dict[str, str]) -> tuple[Path, str]:
    """`gpn study` of one toy model in a process of its own (in `env`), sent SIGTERM once its model has logged step
    2: (its output folder, its output; `stopped` checks the signal's exit code and that no traceback was
    printed)."""
    import signal
    import sys

    from .train_runs import launch, stopped, wait_for_step

    corpus = require_shared("data/tinyshakespeare/input.txt")
    study = load_study("toy")
    study["recipe"].update(dataset=str(corpus), max_tokens=20000, cache_dir=str(folder / "cache"), steps=100000)
    study["models"] = {"gpn-m-1l": study["models"]["gpn-m-1l"]}
    (folder / "study.json").write_text(json.dumps(study))
    output = folder / "out"
    process = launch(
        [
            sys.executable,
            "-m",
            "gpn_cli",
            "study",
            "--study",
            str(folder / "study.json"),
            "--output",
            str(output),
            "--no-progress",
        ],
        folder / "study.log",
        env,
    )
    wait_for_step(process, output / "gpn-m-1l", 2)
    process.send_signal(signal.SIGTERM)
    return output, stopped(process, 128 + signal.SIGTERM)


@pytest.fixture(scope="module", autouse=True)
def study_processes(request, tmp_path_factory) -> Iterator[dict]:
    """The `gpn study` process of the SIGTERM test (`_stopped_study`), started in the background at the module's
    first test, beside the module's in-process studies (subprocesses.started_in_the_background; only where that
    test is selected): the suite's time on 2 cores, where a process waited on in its test leaves a core idle while
    it imports and tokenizes. Test name -> future of what the test asserts on."""
    selected = {item.name for item in request.session.items if item.module is request.module}
    env = dict(os.environ)  # (taken here: the tests meanwhile change os.environ with monkeypatch)
    folder = tmp_path_factory.mktemp("study-sigterm")
    jobs = {
        "test_sigterm_during_a_study_stops_cleanly_with_the_model_checkpointed": lambda: _stopped_study(folder, env)
    }
    with started_in_the_background(jobs, selected) as started:
        yield started


def test_sigterm_during_a_study_stops_cleanly_with_the_model_checkpointed(study_processes, request):
    """`gpn study` trains in-process: SIGTERM reaches `gpn train`'s handler, which checkpoints the model being
    trained; the study then ends with the signal's exit code and one line, not a traceback."""
    output, text = study_processes[request.node.name].result()  # (_stopped_study, in the background)
    assert "gpn study: stopped by SIGTERM after step " in text, text[-3000:]
    assert list((output / "gpn-m-1l" / "checkpoints").glob("step-*"))


@pytest.mark.parametrize(
    "case",
    [
        "unknown-study",
        "unknown-model",
        "not-a-study",
        "zero-steps",
        "negative-steps",
        "bad-recipe",
        "misspelt-data-dir",
        "held-out-window",
        "held-out-fraction",
        "held-out-text-field",
        "no-tasks",
    ],
)
def test_a_study_that_cannot_run_is_one_line_before_anything_is_written(tmp_path, capsys, case):
    """A misspelt study or model name (`--only`), or a file that is not a study: exit 2 and one line saying
    what is wrong and what there is, before any model trains or any folder is made."""
    from gpn_cli import main

    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    bad_recipe = load_study("toy")  # a recipe `gpn train` refuses: before the first model trains
    bad_recipe["recipe"]["lr"] = -1.0
    (tmp_path / "bad_recipe.json").write_text(json.dumps(bad_recipe))
    (tmp_path / "corpus.txt").write_text("a local corpus\n")  # its held-out windows are gpn train's: cut alike
    for name, key, value in (
        ("window", "fineweb_window", 16),
        ("fraction", "fineweb_held_out_fraction", 0.2),
        ("text_field", "text_field", "text"),  # (the recipe reads "content": the eval would score the "text" column)
    ):
        other_cut = load_study("toy")
        other_cut["recipe"].update(dataset=str(tmp_path / "corpus.txt"), text_field="content")
        other_cut["eval"][key] = value
        if key != "text_field":
            other_cut["eval"]["text_field"] = "content"
        (tmp_path / f"held_out_{name}.json").write_text(json.dumps(other_cut))
    no_tasks = load_study("toy")
    no_tasks["eval"]["tasks"] = []  # (every model trained, then its evaluation failed)
    (tmp_path / "no_tasks.json").write_text(json.dumps(no_tasks))
    arguments, needle = {
        "no-tasks": (["--study", str(tmp_path / "no_tasks.json")], "the study's eval.tasks: --tasks names no task"),
        "unknown-study": (["--study", "cpu-smal"], "No study named 'cpu-smal'; available: cpu-small, toy"),
        "unknown-model": (["--study", "toy", "--only", "gpn-m-1l", "gpn-m-9l"], "no model named gpn-m-9l; it has"),
        "not-a-study": (["--study", str(broken)], f"Cannot read the study {broken}"),
        "zero-steps": (["--study", "toy", "--steps", "0"], "steps must be a positive integer, got 0"),  # (not ignored)
        "negative-steps": (["--study", "toy", "--steps", "-3"], "model gpn: Invalid training configuration: steps"),
        "misspelt-data-dir": (  # (found once the first model had trained: a traceback)
            ["--study", "toy", "--data-dir", str(tmp_path / "shared" / "dta")],
            f"--data-dir {tmp_path / 'shared' / 'dta'} has no data for the study's task",
        ),
        "bad-recipe": (["--study", str(tmp_path / "bad_recipe.json")], "model gpn: Invalid training configuration: lr"),
        "held-out-window": (
            ["--study", str(tmp_path / "held_out_window.json")],
            "eval.fineweb_window is 16, its recipe's seq_len 32",
        ),
        "held-out-fraction": (
            ["--study", str(tmp_path / "held_out_fraction.json")],
            "eval.fineweb_held_out_fraction is 0.2, its recipe's val_fraction 0.1",
        ),
        "held-out-text-field": (
            ["--study", str(tmp_path / "held_out_text_field.json")],
            "eval.text_field is text, its recipe's text_field content",
        ),
    }[case]
    output = tmp_path / "out"
    assert main(["study", *arguments, "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpn study: error: ") and needle in err, err
    assert not output.exists()


def test_a_corpus_that_cannot_be_read_is_one_line_not_a_traceback(tmp_path, capsys):
    """`gpn train`'s data errors (a corpus file that is not there, the Hub unreachable) end a study with exit 1
    and `gpn train`'s one line naming the problem, as they end `gpn train`."""
    from gpn_cli import main

    study = load_study("toy")
    study["recipe"]["dataset"] = str(tmp_path / "no-such-corpus.txt")
    study["models"] = {"gpn": study["models"]["gpn"]}
    (tmp_path / "study.json").write_text(json.dumps(study))
    assert main(["study", "--study", str(tmp_path / "study.json"), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "gpn study: error: " in err and "no-such-corpus.txt" in err and "Traceback" not in err, err


def test_a_corpus_copy_interrupted_while_written_is_not_left_for_the_next_run(tmp_path, monkeypatch):
    """The held-out corpus the study evaluates on (`corpus.jsonl`, written once and reused by later runs) is
    written whole or not at all: a copy cut short (Ctrl-C, a kill) would be reused in silence, and every model
    evaluated on a fraction of the held-out text."""
    import modeling_gpn.data
    from modeling_gpn.study import held_out_source

    def documents_then_interrupted():
        yield "ROMEO: a first play"
        raise KeyboardInterrupt

    monkeypatch.setattr(modeling_gpn.data, "shakespeare_documents", documents_then_interrupted)
    study = {"recipe": {"dataset": "shakespeare"}}
    with pytest.raises(KeyboardInterrupt):
        held_out_source(study, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_stopped_study_continues_where_it_stopped(tmp_path, monkeypatch, capsys):
    """A study stopped part-way (here SIGTERM at step 3 of its second model) continues when run again: the
    model it finished is reused (neither trained nor evaluated again), the one it was training resumes from
    the checkpoint `gpn train` wrote. Run again, the study refused (the first model's folder "already holds
    the model of a finished run"), and its message pointed to a --resume option gpn study does not have. A
    later run with other settings is refused: it would put models trained otherwise in one table."""
    import os
    import signal

    from gpn_cli import main
    from modeling_gpn.train.context import TrainingRun

    corpus = require_shared("data/tinyshakespeare/input.txt")
    study = load_study("toy")
    study["recipe"].update(dataset=str(corpus), max_tokens=20000, cache_dir=str(tmp_path / "cache"), steps=8)
    study["recipe"].update(checkpoint_interval=0)  # (the stop writes the only checkpoint)
    study["models"] = {name: study["models"][name] for name in ("gpn", "gpn-m-1l")}
    study["eval"] = {**study["eval"], "tasks": ["fineweb_paper"], "limit": 2}
    (tmp_path / "study.json").write_text(json.dumps(study))
    output = tmp_path / "out"
    command = ["study", "--study", str(tmp_path / "study.json"), "--output", str(output), "--no-progress"]

    log = TrainingRun.log

    def stopped_at_step_3_of_the_second_model(run, record):
        log(run, record)
        if run.run_dir.name == "gpn-m-1l" and record.get("step") == 3 and "loss" in record:
            os.kill(os.getpid(), signal.SIGTERM)  # (gpn train's handler: a checkpoint, then TrainingStopped)

    monkeypatch.setattr(TrainingRun, "log", stopped_at_step_3_of_the_second_model)
    # the study's clock, in this stopped run alone: 1000 s a reading (so the training before the stop is longer
    # than any real time after the resume, and a wall time without it is seen short)
    from modeling_gpn.study import runs

    ticks = iter(range(0, 10**9, 1000))
    monkeypatch.setattr(runs, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    assert main(command) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "gpn study: stopped by SIGTERM after step 3" in err and "--resume" not in err, err
    first_model = (output / "gpn" / "model" / "model.safetensors").stat().st_mtime_ns
    before_stop = json.loads((output / "gpn-m-1l" / "study_run.json").read_text())["trained_before_stop_s"]
    assert before_stop >= 1000
    monkeypatch.undo()

    assert main(command) == 0
    out = capsys.readouterr().out
    assert "== gpn: trained and evaluated by an earlier run of this study (reused)" in out, out
    assert "== gpn-m-1l: training (resumed from its last checkpoint)" in out, out
    assert (output / "gpn" / "model" / "model.safetensors").stat().st_mtime_ns == first_model
    steps = [json.loads(line).get("step") for line in (output / "gpn-m-1l" / "log.jsonl").read_text().splitlines()]
    assert steps[:3] == [1, 2, 3] and steps[-1] == 8
    assert set(json.loads((output / "study_results.json").read_text())["rows"]) == {"gpn", "gpn-m-1l"}
    report = (output / "study_report.md").read_text()  # (this run's time is not the whole study's)
    assert "Wall time of this run: " in report and "(reused from earlier runs of the study: gpn)" in report
    assert "| model | first loss | last loss | gpn train's validation PPL |" in report  # (not a 2nd held-out PPL)
    # the resumed model's wall time counts its training before the stop (it was the time since the resume alone),
    # and the report says it was resumed
    resumed = json.loads((output / "gpn-m-1l" / "study_run.json").read_text())["run"]["train"]
    assert resumed["wall_time_s"] > before_stop and resumed["resumed_at_step"] == 3, resumed
    assert " min (resumed at step 3) |" in report, report

    assert main([*command, "--steps", "9"]) == 2
    assert "trained by an earlier run with other settings (steps)" in capsys.readouterr().err


def test_a_run_of_part_of_a_study_reports_every_model_finished_in_its_folder(tmp_path, capsys):
    """`--only X` after a run of the other models: the report and study_results.json cover every model of the
    study finished in the folder (X alone, once), and name the models left out. They held X alone: the first
    run's figures were gone from the report while its models stayed in the folder."""
    from gpn_cli import main

    corpus = require_shared("data/tinyshakespeare/input.txt")
    study = load_study("toy")
    study["recipe"].update(max_tokens=20000, cache_dir=str(tmp_path / "cache"), steps=2)  # (its corpus: --dataset)
    study["recipe"]["log_interval"] = 2  # (each logged loss is the mean of 2 steps: the report says so)
    study["models"] = {name: study["models"][name] for name in ("gpn", "gpn-m-1l", "transformer++")}
    study["eval"] = {**study["eval"], "tasks": ["fineweb_paper"], "limit": 2}
    (tmp_path / "study.json").write_text(json.dumps(study))
    output = tmp_path / "out"
    command = ["study", "--study", str(tmp_path / "study.json"), "--output", str(output), "--no-progress"]
    command += ["--dataset", str(corpus)]
    assert main([*command, "--only", "gpn"]) == 0
    assert main([*command, "--only", "gpn-m-1l"]) == 0
    capsys.readouterr()
    assert list(json.loads((output / "study_results.json").read_text())["rows"]) == ["gpn", "gpn-m-1l"]
    report = (output / "study_report.md").read_text()
    assert "| gpn | " in report and "| gpn-m-1l | " in report, report
    assert "Left out of this report, models of the study without finished figures here: transformer++" in report
    assert "Curves, first and last loss: the mean training loss of the 2 steps up to each logged step" in report
    # a model evaluated before the held-out windows were gpn train's own (its FineWeb figure scored the end of the
    # whole corpus), or before every model read LAMBADA through the training window: evaluated again, its training
    # reused; one trained before its summary named its token cache reads its local corpus again, to the same windows
    record_path, results_path = output / "gpn" / "study_run.json", output / "gpn" / "eval" / "eval_results.json"
    scored = json.loads(results_path.read_text())["tasks"]["fineweb_paper"]
    for marker in ("held_out", "max_length"):
        record = json.loads(record_path.read_text())
        record["evaluation"].pop(marker)
        record["train"].pop("token_cache", None)
        record_path.write_text(json.dumps(record))
        assert main([*command, "--only", "gpn"]) == 0
        out = capsys.readouterr().out
        assert "== gpn: trained by an earlier run of this study (reused)" in out and "== gpn: evaluating" in out, out
        again = json.loads(results_path.read_text())
        assert (
            again["tasks"]["fineweb_paper"] == scored
            and again["data"]["fineweb_paper"] != again["token_cache"]["fineweb_paper"]
        )
    # an evaluation that fails once the model is trained (here LAMBADA data without its "text" column; the Hub
    # offline alike) is one line saying the training is kept, not gpn eval's error deep in a traceback
    (tmp_path / "lambada.jsonl").write_text('{"passage": "no text column"}\n')
    study["eval"] = {
        **study["eval"],
        "tasks": ["lambada_paper"],
        "task_data": {"lambada_paper": str(tmp_path / "lambada.jsonl")},
    }
    (tmp_path / "study.json").write_text(json.dumps(study))
    assert main([*command, "--only", "gpn"]) == 1
    err = capsys.readouterr().err  # (after transformers' "Loading weights" bar)
    assert "Traceback" not in err and err.endswith("\n") and err.count("gpn study: error: ") == 1, err
    line = err.splitlines()[-1]
    assert line.startswith(f"gpn study: error: model gpn is trained ({output / 'gpn'})"), err
    assert "has no column 'text'" in line and "run the same gpn study command again" in err, err


def test_the_report_names_the_held_out_data_the_evaluation_read(tmp_path):
    """A study on a Hub corpus scores the `fineweb_paper` data: with --data-dir, that folder's files, which the
    report called "FineWeb-Edu from the Hub"."""
    from modeling_gpn.study import held_out_data

    data_dir = require_shared("data")
    study = {"recipe": {"dataset": "HuggingFaceFW/fineweb-edu"}, "eval": {"tasks": ["fineweb_paper"]}}
    assert held_out_data(study, tmp_path, None) == "FineWeb-Edu from the Hub"
    local = held_out_data(study, tmp_path, str(data_dir))
    assert local == f"the documents of {data_dir / 'fineweb-edu' / 'fineweb_edu_sample10bt_150.jsonl'}", local


@pytest.fixture(scope="module")
def finished_study(tmp_path_factory) -> Path:
    """The output folder of a study of one model (2 steps, 2 evaluation windows) run to the end, which each
    test that needs one copies: one run, not one per test (seconds of the suite's time on 2 cores)."""
    from gpn_cli import main

    folder = tmp_path_factory.mktemp("finished-study")
    corpus = require_shared("data/tinyshakespeare/input.txt")
    study = load_study("toy")
    study["recipe"].update(dataset=str(corpus), max_tokens=20000, cache_dir=str(folder / "cache"), steps=2)
    study["models"] = {"gpn": study["models"]["gpn"]}
    study["eval"] = {**study["eval"], "tasks": ["fineweb_paper"], "limit": 2}
    (folder / "study.json").write_text(json.dumps(study))
    output = folder / "out"
    assert main(["study", "--study", str(folder / "study.json"), "--output", str(output), "--no-progress"]) == 0
    return output


@pytest.mark.parametrize("file", ["study_results.json", "study_report.md"])
def test_a_report_write_cut_short_leaves_the_previous_one_whole(finished_study, tmp_path, monkeypatch, file):
    """study_results.json and study_report.md were written in place: a write cut short (here a real EFBIG, a
    file-size limit standing for a full disk) left half a file where the previous run's was. Each is replaced
    whole or not at all, and no temporary file is left."""
    import resource

    from modeling_gpn.study import runs

    output = tmp_path / "out"
    shutil.copytree(finished_study, output)
    previous = {name: (output / name).read_bytes() for name in ("study_results.json", "study_report.md")}
    results = json.loads(previous["study_results.json"])
    monkeypatch.setattr(runs, "plot_curves", lambda runs, path: None)
    limit = 16  # (study_results.json, written first, is cut short)
    if file == "study_report.md":  # a report larger than the limit, written after a results file within it
        limit = len(previous["study_results.json"]) * 2
        monkeypatch.setattr(runs, "render_report", lambda results: "x" * limit * 2)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # (CPython ignores SIGXFSZ: the write fails)
    try:  # (the writer alone: pytest's captured output is a file, which the limit would stop too)
        with pytest.raises(OSError) as error:
            runs.write_report(results, {}, output)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert "File too large" in str(error.value) and error.value.filename == str(output / file), error.value
    assert (output / file).read_bytes() == previous[file]
    assert not [path.name for path in output.iterdir() if path.name.startswith(".")]


def test_a_model_trained_before_a_setting_existed_is_reused(tmp_path):
    """A model's record written before gpn train had a setting (loss_figure) holds no value for it: read as its
    built-in value, the model is the study's, not one "trained by an earlier run with other settings" (which would
    have trained every model of a study again after an upgrade). A setting that did change is still refused."""
    from modeling_gpn.study import runs

    study = load_study("toy")
    name = next(iter(study["models"]))
    config = runs.training_config(name, study["models"][name], study, tmp_path)
    earlier = runs.record_of(config)
    assert earlier.pop("loss_figure") is True
    (tmp_path / name).mkdir()
    runs.write_record(tmp_path / name, {"config": earlier})
    assert runs.earlier_record(name, config, tmp_path) == {"config": earlier}
    runs.write_record(tmp_path / name, {"config": {**earlier, "steps": earlier["steps"] + 1}})
    with pytest.raises(runs.StudyError, match=r"with other settings \(steps\)"):
        runs.earlier_record(name, config, tmp_path)


def test_another_study_into_a_folder_holding_a_report_is_refused(finished_study, tmp_path, capsys):
    """A second study (other models) run into a folder holding a first study's report replaced its
    study_report.md, study_results.json and training curves in silence. It is refused before anything trains,
    naming the study there; the first study's report is left whole."""
    from gpn_cli import main

    output = tmp_path / "out"
    shutil.copytree(finished_study, output)
    previous = {name: (output / name).read_bytes() for name in ("study_results.json", "study_report.md")}
    other = load_study("toy")
    other["models"] = {"gpn-wide": {**other["models"]["gpn"], "hidden_size": 32}}
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main(["study", "--study", str(tmp_path / "other.json"), "--output", str(output), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{output} holds the report of another study (" in err, err
    assert {name: (output / name).read_bytes() for name in previous} == previous
    assert not (output / "gpn-wide").exists()


def test_ctrl_c_in_a_models_last_step_stops_the_study_there(tmp_path, monkeypatch, capsys):
    """`gpn train` lets a run that gets SIGINT in its last step (or final phase) finish and save its model; in a
    study the Ctrl-C was then forgotten: the study evaluated that model and went on to train the next ones (hours at
    the cpu-small budget), and exited 0. It stops once that model's training is recorded (kept: the same command
    goes on from there), with the signal's exit status."""
    import os
    import signal

    from gpn_cli import main
    from modeling_gpn.train.context import TrainingRun

    corpus = require_shared("data/tinyshakespeare/input.txt")
    study = load_study("toy")
    study["recipe"].update(dataset=str(corpus), max_tokens=20000, cache_dir=str(tmp_path / "cache"), steps=3)
    study["models"] = {name: study["models"][name] for name in ("gpn", "gpn-m-1l")}
    (tmp_path / "study.json").write_text(json.dumps(study))
    output = tmp_path / "out"
    log = TrainingRun.log

    def ctrl_c_in_the_first_models_last_step(run, record):
        log(run, record)
        if run.run_dir.name == "gpn" and record.get("step") == 3 and "loss" in record:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(TrainingRun, "log", ctrl_c_in_the_first_models_last_step)
    command = ["study", "--study", str(tmp_path / "study.json"), "--output", str(output), "--no-progress"]
    assert main(command) == 128 + signal.SIGINT
    captured = capsys.readouterr()
    assert "gpn study: stopped by SIGINT once model gpn had finished training. Run the same" in captured.err
    assert "== gpn: evaluating" not in captured.out and not (output / "gpn-m-1l").exists()
    assert "train" in json.loads((output / "gpn" / "study_run.json").read_text())  # (kept for the next run)


def test_a_stopped_model_whose_corpus_changed_is_one_line_not_a_traceback(tmp_path, capsys):
    """A study stopped part-way, its corpus edited before it was run again: the model it was training cannot
    resume (other training windows). That was `gpn train`'s ValueError as a traceback, pointing to an
    --output-dir gpn study does not have; it is one line naming the model, what changed and what to do."""
    from gpn_cli import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(require_shared("data/tinyshakespeare/input.txt").read_bytes()[:60000])
    study = load_study("toy")
    study["recipe"].update(dataset=str(corpus), cache_dir=str(tmp_path / "cache"), steps=3, checkpoint_interval=1)
    study["models"] = {"gpn": study["models"]["gpn"]}
    study["eval"] = {**study["eval"], "tasks": ["fineweb_paper"], "limit": 2}
    (tmp_path / "study.json").write_text(json.dumps(study))
    output = tmp_path / "out"
    command = ["study", "--study", str(tmp_path / "study.json"), "--output", str(output), "--no-progress"]
    assert main(command) == 0
    record = output / "gpn" / "study_run.json"  # as a study stopped while training it leaves it: settings alone
    record.write_text(json.dumps({"config": json.loads(record.read_text())["config"]}))
    with corpus.open("a") as handle:
        handle.write("\nA line added to the corpus since.\n")
    capsys.readouterr()
    assert main(command) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpn study: error: model gpn cannot resume from "), err
    assert "the corpus changed since the checkpoint" in err and f"move {output / 'gpn'} away" in err, err
    assert "--output-dir" not in err
