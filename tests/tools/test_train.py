"""`gpn train`: real training runs on CPU (tiny preset, tinyshakespeare), resume after SIGKILL, 2-process DDP,
the recipe's optimizer groups and schedule, and clear errors for bad data."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from modeling_gpn import train as train_module
from modeling_gpn.data import CorpusSpec, DataError, train_bpe_tokenizer

from ..environment import REPO_ROOT
from ..subprocesses import started_in_the_background, two_at_a_time
from ..tiny_models import tiny_config
from .train_runs import (
    RendezvousLaunch,
    finish,
    launch,
    launch_two_processes,
    losses,
    parse,
    read_log,
    saved_weights,
    signalled,
    small_args,
)

pytestmark = pytest.mark.usefixtures("accelerate_on_cpu")


FRESH_PROCESS_TESTS = {
    "test_resume_after_sigkill_equals_uninterrupted_run",
    "test_a_launch_of_several_processes_that_accelerate_runs_as_one_each_is_refused",
    "test_mixed_precision_that_would_not_be_applied_is_refused",
    "test_gpn_train_mixed_precision_bf16_on_cpu_ends_finite",
}


@pytest.fixture(scope="module", autouse=True)
def fresh_processes(request, tmp_path_factory) -> Iterator[dict]:
    """The `gpn train` processes of four tests further down (the killed run and its uninterrupted reference, a
    launch Accelerate runs as one process each, the mixed-precision refusals, a bf16 run), started in the background at the module's first test, beside the
    module's in-process tests (subprocesses.started_in_the_background; only the selected tests'): the suite's time
    on 2 cores. Test name -> future of what the test asserts on."""
    selected = {item.name for item in request.session.items if item.module is request.module}
    if not selected & FRESH_PROCESS_TESTS:  # (nor the corpus, which the tests that need it ask for)
        yield {}
        return
    cache, shakespeare = request.getfixturevalue("cache"), request.getfixturevalue("shakespeare")
    root = tmp_path_factory.mktemp("fresh-processes")
    env = dict(os.environ, ACCELERATE_USE_CPU="1")  # (taken here: the tests' monkeypatches change os.environ)
    jobs = {  # (FRESH_PROCESS_TESTS)
        "test_resume_after_sigkill_equals_uninterrupted_run": lambda: _killed_after_a_checkpoint(
            root / "sigkill", cache, shakespeare, env
        ),
        "test_a_launch_of_several_processes_that_accelerate_runs_as_one_each_is_refused": lambda: (
            _several_processes_accelerate_runs_as_one_each(root / "several", cache, shakespeare, env)
        ),
        "test_mixed_precision_that_would_not_be_applied_is_refused": lambda: (
            root / "refused",
            _mixed_precision_refusals(root / "refused", env),
        ),
        "test_gpn_train_mixed_precision_bf16_on_cpu_ends_finite": lambda: (
            root / "bf16",
            _bf16_run(root / "bf16", cache, shakespeare, env),
        ),
    }
    for name in ("several", "refused"):
        (root / name).mkdir()
    with started_in_the_background(jobs, selected) as started:
        yield started


def test_tiny_preset_loss_falls_output_loads_and_the_log_says_what_ran(
    tmp_path, cache, shakespeare, monkeypatch, capsys
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from modeling_gpn.train import loop

    # A clock that moves only where the run works: 1 s a training step, 100 s a validation or a checkpoint between
    # steps. tokens/s is the training's speed: the validation and checkpoint after step 20 are left out of step 21's.
    clock = [0.0]

    def taking(seconds, function):
        def timed(*args, **kwargs):
            clock[0] += seconds
            return function(*args, **kwargs)

        return timed

    monkeypatch.setattr(loop, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    for name, seconds in (("training_step", 1.0), ("validate", 100.0), ("save_checkpoint", 100.0)):
        monkeypatch.setattr(loop, name, taking(seconds, getattr(loop, name)))
    out = tmp_path / "run"
    extra = ("--steps", "40", "--lr", "0.01", "--warmup-steps", "4", "--sample-tokens", "8", "--eval-interval", "20")
    config = train_module.resolve_config(
        parse(small_args(shakespeare, out, cache, *extra, "--checkpoint-interval", "20"))
    )
    summary = train_module.train(config, show_progress=False)
    records = [r for r in read_log(out) if "lr" in r]
    assert [r["tokens_per_s"] for r in records] == [8 * 32] * 40  # 8 windows of 32 tokens a (1 s) step
    assert [r["tokens"] for r in records] == [8 * 32 * step for step in range(1, 41)]
    assert [r["step"] for r in read_log(out) if "val_loss" in r] == [20, 40]
    # The summary says which positions the held-out perplexity scores (not the first of each window).
    assert (
        f"perplexity {summary['val_ppl']:.2f} (8 held-out windows of 32 tokens, each scored on its 31 next-token "
        in (capsys.readouterr().out)
    )
    curve = losses(out)
    assert len(curve) == 40
    start, end = sum(curve[:3]) / 3, sum(curve[-3:]) / 3
    assert start > math.log(512) - 0.5  # starts near uniform over the vocabulary
    assert end < start - 1.0, f"loss did not fall clearly: {start:.3f} -> {end:.3f}"
    assert summary["val_ppl"] < math.exp(start) and math.isfinite(summary["val_ppl"])
    assert summary["sample"].startswith("ROMEO:")

    model_dir = Path(summary["model_dir"])
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (model_dir / name).exists(), name
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert type(model).__name__ == "GPNForCausalLM" and model.config.vocab_size == len(tokenizer) == 512
    ids = tokenizer("ROMEO:", return_tensors="pt")["input_ids"]
    generated = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 6)
    assert (out / "tensorboard").exists() and any((out / "tensorboard").rglob("events.out.tfevents*"))

    # A second run over the same corpus and tokenizer memory-maps the cached shards instead of re-tokenizing.
    again = train_module.resolve_config(parse(small_args(shakespeare, tmp_path / "again", cache)))
    assert train_module.train(again, prepare_only=True, show_progress=False)["reused_cache"] is True


def test_llama_baseline_trains_from_the_same_entry_point(tmp_path, cache, shakespeare):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "llama"
    config = train_module.resolve_config(
        parse(small_args(shakespeare, out, cache, "--steps", "3")[2:] + ["--recipe", "tiny-cpu-llama"])
    )
    train_module.train(config, show_progress=False)
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 2
    assert len(losses(out)) == 3


KILLED_RUN = ("--steps", "24", "--checkpoint-interval", "4", "--keep-checkpoints", "3")


def _killed_after_a_checkpoint(folder: Path, cache: Path, shakespeare: Path, env: dict[str, str]) -> dict:
    """`python -m modeling_gpn.train` killed (SIGKILL) once it has written a checkpoint, beside the uninterrupted run
    (its loss.png a folder, so the figure cannot be written) in a process of its own: `{"killed_dir", "returncode",
    "reference_dir", "reference_output"}` (the shakespeare fixture has tokenized the corpus into `cache`, so both
    runs start at the same point quickly)."""
    train_cli = [sys.executable, "-m", "modeling_gpn.train"]
    # loss.png: where it cannot be written (a folder in its place), the finished run warns and succeeds
    (folder / "reference" / "loss.png").mkdir(parents=True)
    reference = launch(
        train_cli + small_args(shakespeare, folder / "reference", cache, *KILLED_RUN, "--loss-figure"),
        folder / "r.log",
        env,
    )
    killed_dir = folder / "killed"
    # Killed by itself on entering step 6, after step 4's checkpoint and step 5's record (`signalled`): killed from
    # here once a checkpoint appeared, the kill raced the 24-step run's end, which a busy machine's test thread
    # can miss.
    killer = signalled(folder, "modeling_gpn.train", "enter:6:SIGKILL")
    killed = launch(killer + small_args(shakespeare, killed_dir, cache, *KILLED_RUN), folder / "k.log", env)
    try:
        killed.wait(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    return {
        "killed_dir": killed_dir,
        "returncode": killed.returncode,
        "reference_dir": folder / "reference",
        "reference_output": finish(reference),
    }


def test_resume_after_sigkill_equals_uninterrupted_run(fresh_processes, request, cache, shakespeare, capfd):
    # Both runs ran in the background (_killed_after_a_checkpoint, fresh_processes).
    launched = fresh_processes[request.node.name].result()
    killed_dir, reference_dir = launched["killed_dir"], launched["reference_dir"]
    assert launched["returncode"] == -signal.SIGKILL
    assert not (killed_dir / "model").exists(), "the run finished before it was killed"
    stopped_at = train_module.latest_checkpoint(killed_dir)
    assert stopped_at is not None and stopped_at.name == "step-0000004", stopped_at
    assert [r["step"] for r in read_log(killed_dir)] == [1, 2, 3, 4, 5]  # (step 5 is trained again on resume)

    # Resumed in this process (the kill was of a CLI run; one import of torch and transformers less on 2 cores).
    capfd.readouterr()
    train_module.train(
        train_module.resolve_config(parse(small_args(shakespeare, killed_dir, cache, *KILLED_RUN, "--loss-figure"))),
        resume=True,
        show_progress=False,
    )
    resumed_output = capfd.readouterr().out
    assert f"resumed from {stopped_at}" in resumed_output
    assert f"loss curves: {killed_dir.resolve() / 'loss.png'}" in resumed_output
    reference_output = launched["reference_output"]
    assert f"gpn train: warning: {reference_dir / 'loss.png'} was not drawn (IsADirectoryError" in reference_output, (
        reference_output[-3000:]
    )

    # the resumed run's loss.png is a PNG of the whole log: the steps before the kill too (its text says what the
    # picture shows, read from the figure's lines)
    from PIL import Image

    figure = killed_dir / "loss.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(figure) as image:
        image.verify()
    with Image.open(figure) as image:
        text = image.text
    assert text["Title"] == "killed: recipe tiny-cpu, model tiny", text
    assert "training loss (mean of each log interval): 24 points at x 1-24" in text["Description"], text
    assert re.search(r"held-out loss, final \d\.\d{3}: PPL [\d.]+: 1 points at x 24-24", text["Description"]), text
    assert not list(killed_dir.glob(".loss.png.tmp-*"))

    expected, actual = saved_weights(reference_dir / "model"), saved_weights(killed_dir / "model")
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    assert losses(killed_dir) == losses(reference_dir)  # the log is continued, not duplicated


DDP = ["--multi_gpu"]
FSDP2 = ["--use_fsdp", "--fsdp_version", "2"]
# A checkpoint at step 3 of 6 to resume from; a short sample, so the end of the run does what a user's does.
TWO_PROCESS_RUN = [
    "--steps",
    "6",
    "--lr",
    "0.01",
    "--warmup-steps",
    "2",
    "--checkpoint-interval",
    "3",
    "--keep-checkpoints",
    "1",
    "--sample-tokens",
    "4",
]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory, cache, shakespeare) -> dict[str, tuple[Path, str | None]]:
    """One process, 2-process DDP and 2-process FSDP2 of the same run, the launches started together and the
    one-process run made here meanwhile: name -> (run, output; None for the one-process run)."""
    root = tmp_path_factory.mktemp("two-process")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ACCELERATE_USE_CPU", "1")  # (the function-scoped accelerate_on_cpu fixture does not cover this one)
        return _run_two_process_runs(root, cache, shakespeare)


def _run_two_process_runs(root: Path, cache: Path, shakespeare: Path) -> dict[str, tuple[Path, str | None]]:
    train_module.train(
        train_module.resolve_config(parse(small_args(shakespeare, root / "p", cache))),
        prepare_only=True,
        show_progress=False,
    )
    launches = {
        "ddp": launch_two_processes(
            DDP, small_args(shakespeare, root / "ddp", cache, *TWO_PROCESS_RUN), root / "ddp.log"
        ),
        "fsdp": launch_two_processes(
            FSDP2, small_args(shakespeare, root / "fsdp", cache, *TWO_PROCESS_RUN), root / "fsdp.log"
        ),
    }
    # The one-process run in this process meanwhile (its output is not read: one import of torch and transformers
    # less on 2 cores).
    train_module.train(
        train_module.resolve_config(parse(small_args(shakespeare, root / "one", cache, *TWO_PROCESS_RUN))),
        show_progress=False,
    )
    # Every process must exit by itself within the bound (`finish` dumps every stack and fails otherwise).
    finished = {name: (root / name, finish(process, timeout=300)) for name, process in launches.items()}
    return {"one": (root / "one", None), **finished}


def test_two_process_ddp_matches_one_process(two_process_runs):
    (one_dir, _), (ddp_dir, output) = two_process_runs["one"], two_process_runs["ddp"]
    assert "2 process(es) x 1 accumulation x 4 windows; DDP" in output, output[-3000:]

    one, two = losses(one_dir), losses(ddp_dir)
    assert len(one) == len(two) == 6
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-4, (one, two)
    assert one[-1] < one[0]
    final = [r for r in read_log(ddp_dir) if r.get("event") == "final"][0]
    ranks = final["weights_sha256_per_rank"]
    assert len(ranks) == 2 and ranks[0] == ranks[1]


def test_two_process_fsdp_trains_saves_and_resumes_like_one_process(two_process_runs, tmp_path, cache, shakespeare):
    from transformers import AutoModelForCausalLM

    (one_dir, _), (ddp_dir, _), (fsdp_dir, output) = (two_process_runs[name] for name in ("one", "ddp", "fsdp"))
    # Really sharded: Accelerate alone would have run this launch as DDP on CPU.
    assert "2 process(es) x 1 accumulation x 4 windows; FSDP2" in output, output[-3000:]
    one, fsdp = losses(one_dir), losses(fsdp_dir)
    assert len(fsdp) == 6 and max(abs(a - b) for a, b in zip(one, fsdp)) < 1e-4, (one, fsdp)
    assert "sample (prompt" in output and "model saved to" in output

    # The saved model holds the full weights (not one process's shard) and loads with from_pretrained.
    reference, saved = saved_weights(one_dir / "model"), saved_weights(fsdp_dir / "model")
    assert saved.keys() == reference.keys()
    for name in reference:
        assert saved[name].shape == reference[name].shape, name
        assert torch.allclose(saved[name], reference[name], atol=1e-3), name
    model = AutoModelForCausalLM.from_pretrained(fsdp_dir / "model")
    assert all(torch.equal(model.state_dict()[name], saved[name]) for name in saved)

    # The checkpoint holds the full state too, in one layout for every distribution.
    [checkpoint] = sorted((fsdp_dir / "checkpoints").glob("step-*"))
    assert checkpoint.name == "step-0000003"
    assert {p.name for p in checkpoint.glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}
    assert saved_weights(checkpoint).keys() == reference.keys()

    # --resume: FSDP from its own checkpoint is bit-exact; FSDP from the DDP checkpoint, and one process from
    # the FSDP checkpoint, continue the same training (the sums of 2 processes round differently: not bit-exact).
    same = launch_two_processes(
        FSDP2,
        small_args(shakespeare, tmp_path / "same", cache, *TWO_PROCESS_RUN, "--resume", str(checkpoint)),
        tmp_path / "same.log",
    )
    ddp_checkpoint = ddp_dir / "checkpoints" / "step-0000003"
    from_ddp = launch_two_processes(
        FSDP2,
        small_args(shakespeare, tmp_path / "from-ddp", cache, *TWO_PROCESS_RUN, "--resume", str(ddp_checkpoint)),
        tmp_path / "from-ddp.log",
    )
    config = train_module.resolve_config(parse(small_args(shakespeare, tmp_path / "back", cache, *TWO_PROCESS_RUN)))
    train_module.train(config, resume=str(checkpoint), show_progress=False)
    assert f"resumed from {checkpoint}" in finish(same, timeout=300)
    assert f"resumed from {ddp_checkpoint}" in finish(from_ddp, timeout=300)

    uninterrupted = saved_weights(fsdp_dir / "model")
    for name, tensor in saved_weights(tmp_path / "same" / "model").items():
        assert torch.equal(tensor, uninterrupted[name]), name
    assert losses(tmp_path / "same")[-3:] == fsdp[-3:]
    for run, continued_from in ((tmp_path / "from-ddp", ddp_dir), (tmp_path / "back", fsdp_dir)):
        expected = saved_weights(continued_from / "model")
        for name, tensor in saved_weights(run / "model").items():
            assert torch.allclose(tensor, expected[name], atol=1e-5), (run.name, name)
        assert max(abs(a - b) for a, b in zip(losses(run)[-3:], losses(continued_from)[-3:])) < 1e-5


def test_a_checkpoint_of_the_layout_before_the_decoder_moved_resumes_bit_for_bit(
    two_process_runs, tmp_path, cache, shakespeare
):
    """A checkpoint gpn train wrote before the decoder moved into the base model (2026-12-01, af523f3) holds its
    weights at the top level (`decode_norm.*`, `decode_proj.*`): --resume reads them under their current names and
    continues the run exactly (it failed in load_state_dict naming missing and unexpected keys). Made here from the
    one-process run's checkpoint by renaming those keys back, which is all that layout differed by (checked against
    a run of that commit)."""
    import shutil

    from safetensors.torch import save_file

    one_dir, _ = two_process_runs["one"]
    old = tmp_path / "old" / "step-0000003"
    shutil.copytree(one_dir / "checkpoints" / "step-0000003", old)
    weights = saved_weights(old)
    older = {
        name.removeprefix("model.") if name.startswith("model.decode_") else name: t for name, t in weights.items()
    }
    assert {"decode_norm.weight", "decode_proj.weight"} <= older.keys()
    save_file(older, str(old / "model.safetensors"))

    config = train_module.resolve_config(parse(small_args(shakespeare, tmp_path / "resumed", cache, *TWO_PROCESS_RUN)))
    train_module.train(config, resume=str(old), show_progress=False)
    assert losses(tmp_path / "resumed") == losses(one_dir)[-3:]
    expected = saved_weights(one_dir / "model")
    resumed = saved_weights(tmp_path / "resumed" / "model")
    assert resumed.keys() == expected.keys()
    for name in expected:
        assert torch.equal(resumed[name], expected[name]), name


TWO_STEPS = ("--steps", "2")
# The blocks of the recurrence sharded apart, as `--fsdp_transformer_layer_cls_to_wrap` names them.
BLOCKS_APART = (
    "--fsdp_auto_wrap_policy",
    "TRANSFORMER_BASED_WRAP",
    "--fsdp_transformer_layer_cls_to_wrap",
    "GPNPredictLayer,GPNMemoryWrite",
)


@pytest.fixture(scope="module")
def two_step_runs(tmp_path_factory, cache, shakespeare) -> Iterator[dict[str, tuple[Path, subprocess.Popen | None]]]:
    """The 2-step runs of the FSDP2 tests below, launched together at once (name -> (run folder, its launch, to
    `finish`; None for the one-process run made here meanwhile)): on 2 cores, one launch after another leaves a
    core idle while each launcher imports torch, and the one-process float32 run serves two of the tests."""
    root = tmp_path_factory.mktemp("two-step")
    runs = {
        "default policy": ([*FSDP2, "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP"], ()),
        "size-based wrap": (
            [*FSDP2, "--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP", "--fsdp_min_num_params", "1000"],
            (),
        ),
        # (the blocks of the recurrence sharded apart: their float32 state crosses FSDP2's cast at every token)
        "bf16": ([*FSDP2, *BLOCKS_APART], ("--mixed-precision", "bf16")),
    }
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ACCELERATE_USE_CPU", "1")  # (the function-scoped accelerate_on_cpu fixture does not cover this one)
        launched = {
            name: launch_two_processes(
                distribution, small_args(shakespeare, root / name, cache, *TWO_STEPS, *extra), root / f"{name}.log"
            )
            for name, (distribution, extra) in runs.items()
        }
    # (one-process bf16 in a process of its own: a process's Accelerate state keeps its first precision)
    bf16_alone = small_args(shakespeare, root / "bf16 alone", cache, *TWO_STEPS, "--mixed-precision", "bf16")
    launched["bf16 alone"] = launch([sys.executable, "-m", "modeling_gpn.train", *bf16_alone], root / "bf16 alone.log")
    try:
        alone = root / "alone"
        config = train_module.resolve_config(parse(small_args(shakespeare, alone, cache, *TWO_STEPS)))
        train_module.train(config, show_progress=False)
        yield {"alone": (alone, None)} | {name: (root / name, process) for name, process in launched.items()}
    finally:
        for process in launched.values():  # (those a failing test left running)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_fsdp2_with_accelerate_configs_default_wrap_policy_trains_a_gpn(two_step_runs):
    # `accelerate config`'s FSDP default, TRANSFORMER_BASED_WRAP, wraps a GPN's `_no_split_modules`. It named the
    # whole GPNModel, which holds the embedding; Accelerate 1.15 then sharded the embedding inside it again and
    # every process died in fully_shard: "TypeError: Invariant encountered: value was None when it should not be".
    # `gpn train` then dropped the policy with a note; it names nothing now, so the policy is kept: nothing to say.
    run_dir, process = two_step_runs["default policy"]
    output = finish(process)
    assert "auto-wrap policy" not in output and "FSDP2:" not in output, output[-3000:]
    assert "2 process(es) x 1 accumulation x 4 windows; FSDP2" in output
    assert len(losses(run_dir)) == 2 and all(math.isfinite(loss) for loss in losses(run_dir))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")  # the full weights, gathered
    assert all(torch.equal(model.state_dict()[name], t) for name, t in saved_weights(run_dir / "model").items())


NAMES_GPN_MODEL = {"transformer_cls_names_to_wrap": ["GPNModel"]}  # (--fsdp_transformer_layer_cls_to_wrap GPNModel)


@pytest.mark.parametrize(
    "options, refusal",
    [
        ({"cpu_offload": True}, "--fsdp_offload_params moves the parameters to CPU memory"),
        ({"activation_checkpointing": True}, "--fsdp_activation_checkpointing needs an auto-wrap policy"),
        (  # GPNModel named, dropped (its unit holds the embedding): nothing left to checkpoint by
            {"activation_checkpointing": True, "auto_wrap_policy": "transformer_based_wrap", **NAMES_GPN_MODEL},
            "--fsdp_activation_checkpointing needs an auto-wrap policy",
        ),
        (  # no class named: a GPN's `_no_split_modules` names none, so the policy wraps (and recomputes) nothing
            {"activation_checkpointing": True, "auto_wrap_policy": "transformer_based_wrap"},
            "--fsdp_activation_checkpointing needs an auto-wrap policy",
        ),
    ],
    ids=["offload on CPU", "checkpointing without a policy", "checkpointing of the whole GPN", "default policy"],
)
def test_fsdp2_options_accelerate_would_fail_on_are_refused_in_one_line(options, refusal):
    """Accelerate 1.15 fails deep in its FSDP2 preparation on CPU with `--fsdp_offload_params` (pinned memory
    needs a GPU: "Cannot access accelerator device when none is available") and with
    `--fsdp_activation_checkpointing` without a wrap policy (it calls the missing one: "'NoneType' object is
    not callable"); refused in one line. What works is left as asked."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    model = build_tiny_gpn()
    with pytest.raises(train_module.LaunchError, match=refusal):
        train_module.fit_fsdp_plugin(FullyShardedDataParallelPlugin(fsdp_version=2, **options), model, on_cpu=True)
    layers = {"auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["GPNPredictLayer"]}
    default = {"auto_wrap_policy": "transformer_based_wrap"}  # `accelerate config`'s: it wraps nothing of a GPN
    for works in ({}, layers, {**layers, "activation_checkpointing": True}, default):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **works)
        policy = plugin.auto_wrap_policy
        assert train_module.fit_fsdp_plugin(plugin, model, on_cpu=True) is None and plugin.auto_wrap_policy is policy


def test_fsdp2_wrap_policy_naming_gpnmodel_is_dropped_for_the_model_as_one_unit():
    """`--fsdp_transformer_layer_cls_to_wrap GPNModel` names the unit that holds the embedding, which Accelerate
    1.16 shards again in a group of its own (a failure in fully_shard): the policy is dropped, in one line, and the
    model is sharded as one unit, the same grouping (launched without a policy: test_two_process_fsdp_trains_saves_and_resumes_like_one_process)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", **NAMES_GPN_MODEL
    )
    note = train_module.fit_fsdp_plugin(plugin, build_tiny_gpn(), on_cpu=True)
    assert note.startswith("FSDP2: the auto-wrap policy's unit GPNModel holds the input embedding"), note
    assert plugin.auto_wrap_policy is None


def test_fsdp2_size_based_wrap_shards_the_blocks_it_can_and_trains_like_one_process(two_step_runs):
    # `--fsdp_auto_wrap_policy SIZE_BASED_WRAP` with a small `--fsdp_min_num_params` wraps GPNModel (it holds the
    # embedding) and the ModuleList of predict layers (no forward): Accelerate cannot shard either. The policy
    # was dropped, the whole model one unit, under a line that called that "the same grouping".
    run_dir, process = two_step_runs["size-based wrap"]
    output = finish(process)
    assert (
        "SIZE_BASED_WRAP over 1,000 parameters wraps GPNModel, which holds the embedding: sharded apart instead are "
        "the classes it wraps in every instance that hold no embedding (GPNMemoryWrite, GPNPredictLayer)"
    ) in output, output[-3000:]
    one, fsdp = losses(two_step_runs["alone"][0]), losses(run_dir)
    assert len(fsdp) == 2 and max(abs(a - b) for a, b in zip(one, fsdp)) < 1e-4, (one, fsdp)


def test_fsdp2_on_cpu_computes_in_the_runs_mixed_precision(two_step_runs):
    # Accelerate's FSDP2 computes in bf16 only through its plugin's policy (no autocast around an FSDP2 model); the
    # plugin `gpn train` makes on CPU had none, so `--mixed-precision bf16` trained in float32 under a summary line
    # saying bf16: its losses were bit-identical to the float32 run's. With the blocks of the recurrence sharded
    # apart, the policy also cast their inputs, the float32 state and memory, to bf16: every process failed at the
    # first step ("expected scalar type Float but found BFloat16" in the memory write).
    run_dir, process = two_step_runs["bf16"]
    output = finish(process)
    assert "FSDP2; mixed precision bf16" in output, output[-3000:]
    bf16_dir, bf16_process = two_step_runs["bf16 alone"]
    finish(bf16_process)
    runs = {"no": losses(two_step_runs["alone"][0]), "bf16": losses(bf16_dir)}
    sharded = losses(run_dir)
    assert sharded != runs["no"], (sharded, runs)  # not float32
    assert max(abs(a - b) for a, b in zip(sharded, runs["bf16"])) < 1e-3, (sharded, runs)


def test_fsdp2_size_based_wrap_keeps_the_units_accelerate_can_shard():
    """Which modules Accelerate's FSDP2 preparation then shards apart: every predict layer and memory write, never
    the ModuleList, GPNModel or the tied head (a Linear like the small ones left in the root unit)."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    model = build_tiny_gpn()

    def units(min_num_params):
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="size_based_wrap", min_num_params=min_num_params
        )
        note = train_module.fit_fsdp_plugin(plugin, model, on_cpu=True)
        if plugin.auto_wrap_policy is None:
            return note, []
        plugin.set_auto_wrap_policy(model)  # as Accelerate's preparation does
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
        return note, [name for name, module in model.named_modules() if module is not model and policy(module)]

    assert units(1000)[1] == ["model.memory_write", "model.predict_layers.0"]
    assert set(units(10)[1]) == {"model.memory_write", "model.predict_layers.0"} | {
        name for name, module in model.named_modules() if type(module).__name__ == "GPNRMSNorm"
    }
    note, none = units(sum(p.numel() for p in model.model.predict_layers.parameters()))  # only the holders
    assert none == [] and note.endswith("the model is sharded as one unit instead")
    assert units(10**9) == (None, [])  # nothing wrapped: left as asked
    assert units(0) == (None, [])  # (Accelerate ignores a size of 0: no policy, not every module wrapped)


def build_tiny_gpn():
    from modeling_gpn import GPNForCausalLM

    return GPNForCausalLM(tiny_config())


def _several_processes_accelerate_runs_as_one_each(
    folder: Path, cache: Path, shakespeare: Path, env: dict[str, str]
) -> tuple[Path, str, int]:
    """The user's FSDP config on a machine without GPUs, launched for 2 processes: (the run folder, the launch's
    output, its exit status)."""
    # `use_cpu: true` in the file does not reach the processes, so Accelerate starts each of the 2 launched
    # processes as a single-process run.
    config_file = folder / "fsdp-cpu.yaml"
    config_file.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
        "mixed_precision: 'no'\nnum_machines: 1\nnum_processes: 2\nuse_cpu: true\n"
    )
    run_dir = folder / "run"
    arguments = small_args(shakespeare, run_dir, cache, "--steps", "3")

    def command(port: int) -> list[str]:
        launch_options = ["--config_file", str(config_file), "--main_process_port", str(port)]
        return [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            *launch_options,
            "-m",
            "modeling_gpn.train",
            *arguments,
        ]

    without_use_cpu = {name: value for name, value in env.items() if name != "ACCELERATE_USE_CPU"}
    launcher = RendezvousLaunch(command, folder / "launch.log", without_use_cpu)
    launcher.wait(timeout=300)
    return run_dir, launcher.log_path.read_text(), launcher.returncode


def test_a_launch_of_several_processes_that_accelerate_runs_as_one_each_is_refused(fresh_processes, request):
    run_dir, output, returncode = fresh_processes[request.node.name].result()
    assert returncode != 0, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("gpn train: error:")]
    assert errors and all("launched as several processes (WORLD_SIZE=2" in line for line in errors), output[-3000:]
    assert "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N" in errors[0]
    assert not (run_dir / "log.jsonl").exists() and not (run_dir / "model").exists()  # stopped before training


def test_paper_recipe_weight_decay_groups_and_schedule():
    recipe = train_module.load_recipe("paper-130m")
    assert (recipe["seq_len"], recipe["batch_size"], recipe["steps"]) == (2048, 128, 10000)
    assert (recipe["lr"], recipe["warmup_steps"], recipe["min_lr_ratio"], recipe["weight_decay"]) == (
        6e-4,
        100,
        0.1,
        0.1,
    )
    assert (recipe["beta1"], recipe["beta2"], recipe["clip_norm"], recipe["mixed_precision"]) == (
        0.9,
        0.95,
        1.0,
        "bf16",
    )
    assert recipe["model"] == "gpn-m-1l-130m" and recipe["dataset_config"] == "sample-10BT"
    assert train_module.load_recipe("paper-130m-2l")["bptt_truncation"] == 512
    assert train_module.load_recipe("paper-130m-llama")["model"]["model_type"] == "llama"

    from modeling_gpn import GPNForCausalLM

    config = train_module.resolve_config(parse(["--recipe", "paper-130m"]))
    model = GPNForCausalLM(tiny_config(num_predict_layers=2))
    optimizer, scheduler = train_module.build_optimizer(model, config)
    decay, no_decay = train_module.parameter_groups(model, config["weight_decay"])
    params = dict(model.named_parameters())
    assert set(decay["names"]) == {n for n, p in params.items() if p.dim() == 2}
    assert {"model.memory_write.A_log", "model.memory_write.dt_bias"} <= set(no_decay["names"])
    assert all(params[n].dim() == 1 for n in no_decay["names"])
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert optimizer.defaults["betas"] == (0.9, 0.95)

    lrs = []
    for _ in range(config["steps"]):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    peak = 6e-4
    assert lrs[0] == pytest.approx(peak / 100) and lrs[49] == pytest.approx(peak * 50 / 100)
    assert lrs[99] == pytest.approx(peak) and lrs[100] == pytest.approx(peak)
    assert all(a <= b for a, b in zip(lrs[:100], lrs[1:100]))
    assert all(a >= b for a, b in zip(lrs[100:], lrs[101:]))  # cosine only decreases
    middle = 100 + (10000 - 100) // 2
    assert lrs[middle] == pytest.approx(peak * (0.1 + 0.9 * 0.5), rel=1e-3)
    assert lrs[-1] == pytest.approx(peak * 0.1, rel=1e-4) and min(lrs[100:]) >= peak * 0.1 - 1e-12


def test_configuration_precedence_and_help(tmp_path):
    config_file = tmp_path / "mine.json"
    config_file.write_text(json.dumps({"lr": 0.5, "steps": 7, "seq_len": 16}))
    config = train_module.resolve_config(parse(["--recipe", "tiny-cpu", "--config", str(config_file), "--steps", "9"]))
    assert (config["lr"], config["steps"], config["seq_len"]) == (0.5, 9, 16)  # file over recipe, CLI over file
    assert config["batch_size"] == 64 and config["dataset"] == "shakespeare"  # from the recipe
    # A flag set by a file is turned off on the command line, and on over the file's false
    config_file.write_text(json.dumps({"reset_at_document_start": True}))
    off = parse(["--config", str(config_file), "--no-reset-at-document-start"])
    assert train_module.resolve_config(off)["reset_at_document_start"] is False
    config_file.write_text(json.dumps({"reset_at_document_start": False}))
    on = parse(["--config", str(config_file), "--reset-at-document-start"])
    assert train_module.resolve_config(on)["reset_at_document_start"] is True
    assert (
        train_module.resolve_config(parse(["--recipe", "tiny-cpu", "--hub-data"]))["dataset"]
        == "HuggingFaceFW/fineweb-edu"
    )
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"learning_rate": 1}))
    with pytest.raises(ValueError, match="Unknown keys.*learning_rate"):
        train_module.resolve_config(parse(["--config", str(bad)]))
    # A config file's value of another JSON type is named, not a TypeError traceback (null only where unset is).
    bad.write_text(json.dumps({"lr": "0.1", "val_fraction": None, "reset_at_document_start": 1, "max_tokens": None}))
    with pytest.raises(ValueError) as refused:
        train_module.resolve_config(parse(["--config", str(bad)]))
    for needle in ("lr must be a number, got '0.1'", "val_fraction must be a number, got None", "reset_at_document_"):
        assert needle in str(refused.value), refused.value
    assert "max_tokens" not in str(refused.value)
    with pytest.raises(ValueError, match="No recipe named 'nope'"):
        train_module.resolve_config(parse(["--recipe", "nope"]))
    # A file that is no UTF-8 is named; an `extends` or `model_overrides` of another JSON type, and integers beyond
    # what torch holds, are named settings, not tracebacks from pathlib, the model's config, torch or tokenizers.
    bad.write_bytes('{"lr": 0.1}'.encode("utf-16"))
    with pytest.raises(ValueError, match=f"Cannot read config file {bad}: 'utf-8' codec"):
        train_module.resolve_config(parse(["--config", str(bad)]))
    for values, needle in (
        ({"extends": 5}, f"config file {bad}: extends must be a recipe name or path (a string), got 5"),
        ({"model_overrides": [1]}, "model_overrides must be a JSON object of model config values, got [1]"),
        ({"batch_size": 10**30}, "batch_size must be at most 2**63 - 1, got 10000000"),
        ({"ddp_timeout": 10**30}, "ddp_timeout must be a positive number of seconds, at most 2147483647, got 1000"),
        ({"num_threads": 20_000}, "num_threads must be in [1, 1025), got 20000"),
    ):
        bad.write_text(json.dumps(values))
        with pytest.raises(ValueError) as refused:
            train_module.resolve_config(parse(["--config", str(bad)]))
        assert needle in str(refused.value), refused.value
    parser = argparse.ArgumentParser()
    train_module.add_arguments(parser)
    text = parser.format_help()
    for option in train_module.OPTIONS:
        assert "--" + option.key.replace("_", "-") in text
    # How to start several processes, on CPU too (where `accelerate launch --cpu` starts one).
    flat = " ".join(text.split())
    assert "accelerate launch --multi_gpu --num_processes N -m modeling_gpn.train" in flat
    assert "--use_fsdp --fsdp_version 2" in flat and "ACCELERATE_USE_CPU=1" in flat


def test_settings_torch_would_train_wrongly_with_are_refused_before_the_data(tmp_path, capsys):
    """`--clip-norm -1` trained by gradient ascent (torch scales the gradient by the negative ratio) and
    `--weight-decay -0.1` grew the weights, both in silence; `--keep-checkpoints 0` kept one, `--num-threads -1` was
    a traceback, bad betas or eps were refused only after tokenizing. Each is named, in one line, before any data
    are read."""
    bad = {
        "clip-norm": ("-1", "clip_norm must be in [0, inf), got -1.0"),
        "weight-decay": ("-0.1", "weight_decay must be in [0, inf), got -0.1"),
        "beta1": ("1.5", "beta1 must be in [0, 1), got 1.5"),
        "beta2": ("1", "beta2 must be in [0, 1), got 1.0"),
        "eps": ("nan", "eps must be in [0, inf), got nan"),
        "keep-checkpoints": ("0", "keep_checkpoints must be in [1, inf), got 0"),
        "num-threads": ("-1", "num_threads must be in [1, 1025), got -1"),
        "seed": ("-1", "seed must be in [0, 4294967296), got -1"),
        # A negative --max-tokens cut the corpus's first piece short and trained on that, in silence;
        # --log-interval 0 logged every step; --bpe-max-documents 0 trained the BPE on no text.
        "max-tokens": ("-5", "max_tokens must be a positive integer (or unset: the whole corpus), got -5"),
        "log-interval": ("0", "log_interval must be a positive integer, got 0"),
        "bpe-max-documents": ("0", "bpe_max_documents must be a positive integer, got 0"),
    }
    argv = ["--dataset", str(tmp_path / "missing.txt"), "--output-dir", str(tmp_path / "run")]
    for flag, (value, _) in bad.items():
        argv += [f"--{flag}", value]
    assert train_module.run(parse(argv)) == 1
    err = capsys.readouterr().err
    assert err.startswith("gpn train: error: Invalid training configuration: ") and err.count("\n") == 1, err
    for _, needle in bad.values():
        assert needle in err, err
    # Infinity is out of [0, inf) too: eps inf made every AdamW update 0 (only the decay applied: nothing trained),
    # lr inf stopped only after the first step, both unnamed.
    assert train_module.run(parse([*argv[:4], "--eps", "inf", "--clip-norm", "inf", "--lr", "inf"])) == 1
    err = capsys.readouterr().err
    for needle in ("eps must be in [0, inf), got inf", "clip_norm must be in [0, inf), got inf", "lr must be positive"):
        assert needle in err, err
    assert not (tmp_path / "run").exists()
    # A misspelt model setting was kept by the model's config and ignored: the default size trained in silence
    (tmp_path / "typo.json").write_text(json.dumps({"model_overrides": {"hiden_size": 8, "num_predict_layers": 1}}))
    assert train_module.run(parse([*argv[:4], "--model", "tiny", "--config", str(tmp_path / "typo.json")])) == 1
    err = capsys.readouterr().err
    assert err.startswith("gpn train: error: model_overrides: hiden_size is not a setting of a gpn model's"), err
    # The edges stay allowed (0 = no clipping; eps 0 is what test_train_faults.py diverges with).
    edges = ["--clip-norm", "0", "--weight-decay", "0", "--beta1", "0", "--eps", "0", "--keep-checkpoints", "1"]
    train_module.resolve_config(parse([*edges, "--seed", str(2**32 - 1), "--num-threads", "1"]))


def test_a_terminal_that_cannot_show_the_sample_gets_escapes_and_one_note(tmp_path, capsys, monkeypatch):
    """Under `LC_ALL=C PYTHONUTF8=0` standard output is ASCII: a sample holding one Chinese character ended `gpn
    train` with "'ascii' codec can't encode character", exit 1, after the model was saved and before the loss
    figure. It is written with escapes, said once on stderr, and the run succeeds; bytes the locale could not
    decode go back out as they came. A prompt of such bytes (how Python reads a UTF-8 argument there) failed at
    TensorBoard's record of the settings, after the data were tokenized, naming no setting: it is refused first."""
    import io

    from gpn_cli import main as gpn_main
    from modeling_gpn.cli import terminal

    corpus = tmp_path / "zh.txt"
    corpus.write_text(
        "\u4e2d\u6587\u8bad\u7ec3\u6587\u672c\uff0c\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002\n" * 300, encoding="utf-8"
    )

    def argv(prompt: str) -> list[str]:
        return [
            "train",
            *small_args(corpus, tmp_path / "run", tmp_path / "cache", "--steps", "2"),
            "--sample-tokens",
            "3",
            "--sample-prompt",
            prompt,
            "--loss-figure",
        ]

    assert gpn_main(argv("\udce4\udcb8\udcad")) == 1
    err = capsys.readouterr().err
    assert "sample_prompt holds bytes that are not text in this locale's encoding" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
    ascii_terminal = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", ascii_terminal)
    monkeypatch.setattr(terminal, "_noted", [])
    assert gpn_main(argv("\u4e2d\u6587")) == 0
    print("\udcff\u4e2d")
    ascii_terminal.flush()
    printed = ascii_terminal.buffer.getvalue()
    assert b"sample (prompt '\\u4e2d\\u6587'):\n\\u4e2d\\u6587" in printed and printed.endswith(b"\xff\\u4e2d\n")
    assert capsys.readouterr().err.count("gpn: note: this terminal's encoding (ascii) cannot show some characters") == 1
    assert (tmp_path / "run" / "loss.png").is_file()


def test_nonfinite_loss_stops_naming_the_step_or_is_skipped(tmp_path, cache, shakespeare, monkeypatch):
    # At lr 1e30 the torch-ops fast path's folded matrices (norm weight x matrix) overflow float32, so its loss
    # is NaN from step 2; the plain loop and the C step kernels apply the norm weights to normalised inputs and
    # saturate to a finite loss. Training meets the NaN (its steps run the torch ops); so does validation here,
    # where the C step kernels would otherwise take its few-row no-grad windows.
    monkeypatch.setenv("GPN_STEP_KERNELS", "0")
    args = small_args(shakespeare, tmp_path / "nan", cache, "--steps", "4", "--lr", "1e30", "--warmup-steps", "0")
    with pytest.raises(train_module.NonFiniteLossError, match="Non-finite loss nan at step 2"):
        train_module.train(train_module.resolve_config(parse(args)), show_progress=False)
    assert not (tmp_path / "nan" / "model").exists()

    # Skipping every later step leaves a model whose validation loss is NaN: it is not saved (more in
    # test_train_faults.py).
    args = small_args(shakespeare, tmp_path / "skip", cache, "--steps", "4", "--lr", "1e30", "--warmup-steps", "0")
    with pytest.raises(train_module.NonFiniteLossError, match="ended with a non-finite model"):
        train_module.train(train_module.resolve_config(parse(args)), skip_nonfinite=True, show_progress=False)
    skipped = [r["step"] for r in read_log(tmp_path / "skip") if r.get("event") == "skipped_nonfinite"]
    assert skipped == [2, 3, 4]
    assert not (tmp_path / "skip" / "model").exists()


def test_bad_data_fails_clearly_before_training(tmp_path, cache):
    def attempt(dataset: Path, *extra: str) -> None:
        config = train_module.resolve_config(parse(small_args(dataset, tmp_path / "out", tmp_path / "c", *extra)))
        train_module.train(config, show_progress=False)

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match=r"empty\.txt is empty"):
        attempt(empty)
    with pytest.raises(DataError, match="does not exist"):
        attempt(tmp_path / "missing.txt")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "notes.md").write_text("hello")
    with pytest.raises(DataError, match="holds no training files"):
        attempt(folder)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"this is not parquet" * 10)
    with pytest.raises(DataError, match=r"Cannot read training file .*broken\.parquet"):
        attempt(broken)
    wrong_column = tmp_path / "docs.jsonl"
    wrong_column.write_text(json.dumps({"body": "some text " * 50}) + "\n")
    with pytest.raises(DataError, match="no column 'text'"):
        attempt(wrong_column)
    # one row of a jsonl without the field (read as null) or with a number: named by its row, not skipped
    for name, row, message in (("missing", {"title": "x"}, "row 2 has no 'text'"), ("number", {"text": 5}, "row 2's")):
        rows = tmp_path / f"{name}.jsonl"
        rows.write_text("".join(json.dumps(r) + "\n" for r in ({"text": "some text"}, row, {"text": "more"})))
        with pytest.raises(DataError, match=rf"{name}\.jsonl: {message}"):
            attempt(rows)
    # a `save_to_disk` folder: its metadata .json files are no documents; its .arrow files, by the glob named, are
    import datasets

    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a", "b"]})}).save_to_disk(str(saved))
    with pytest.raises(DataError, match=r"written by datasets' save_to_disk.*as a glob \('.*saved/train/\*\.arrow'\)"):
        attempt(saved)
    assert list(CorpusSpec(str(saved / "train" / "*.arrow")).documents()) == ["a", "b"]

    good = tmp_path / "good.txt"
    good.write_text("To be, or not to be, that is the question. " * 200)
    no_eos = tmp_path / "no-eos-tokenizer"
    tokenizer = train_bpe_tokenizer([good.read_text()], 300)
    tokenizer.eos_token = None
    tokenizer.pad_token = None
    tokenizer.save_pretrained(no_eos)
    config = json.loads((no_eos / "tokenizer_config.json").read_text())
    config.pop("eos_token", None)
    (no_eos / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match="has no EOS token"):
        attempt(good, "--tokenizer", str(no_eos))
    assert not (tmp_path / "out" / "checkpoints").exists()


# `gpn train --mixed-precision` refusals: the case -> (its arguments, its environment, the refusal)
MIXED_PRECISION_REFUSALS = {
    "fp16 on CPU": (["--mixed-precision", "fp16"], {}, "--mixed-precision fp16 is not applied on CPU"),
    "the launcher's choice": (
        [],
        {"ACCELERATE_MIXED_PRECISION": "bf16"},
        "accelerate launch asked for mixed precision bf16, but this run's setting is no",
    ),
}


def _mixed_precision_refusals(folder: Path, env: dict[str, str]) -> dict[str, subprocess.CompletedProcess]:
    """Each of MIXED_PRECISION_REFUSALS in a `gpn train` process of its own (Accelerate's state is per process),
    two at a time: the case -> the finished process."""

    def refusal(extra: list[str], extra_env: dict) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "gpn_cli", "train", "--dataset", str(folder / "missing.txt")]
        command += ["--output-dir", str(folder / "run"), *extra]
        return subprocess.run(
            command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env={**env, **extra_env}
        )

    with two_at_a_time() as pool:  # (each process imports torch and transformers on one core)
        refused = {
            name: pool.submit(refusal, extra, extra_env)
            for name, (extra, extra_env, _) in MIXED_PRECISION_REFUSALS.items()
        }
    return {name: future.result() for name, future in refused.items()}


def test_mixed_precision_that_would_not_be_applied_is_refused(fresh_processes, request):
    """`--mixed-precision fp16` on a CPU trained in float32 (Accelerate applies fp16 only off the CPU) while the
    run's summary said fp16; `accelerate launch --mixed_precision bf16` was overridden by the run's own "no". Both
    are refused in one line, before any data are read (each in its own process: Accelerate's state is per
    process)."""
    folder, refused = fresh_processes[request.node.name].result()
    for name, (_, _, needle) in MIXED_PRECISION_REFUSALS.items():
        done = refused[name]
        assert done.returncode == 1 and f"gpn train: error: {needle}" in done.stderr, (name, done.stderr[-3000:])
        assert "Traceback" not in done.stderr and not (folder / "run").exists(), name


def _bf16_run(run: Path, cache: Path, shakespeare: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`gpn train --mixed-precision bf16` for 4 steps of the tiny preset, in its own process."""
    command = [sys.executable, "-m", "gpn_cli", "train"]
    command += small_args(shakespeare, run, cache, "--steps", "4", "--mixed-precision", "bf16")  # (tokenized)
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)


def test_gpn_train_mixed_precision_bf16_on_cpu_ends_finite(fresh_processes, request):
    """`gpn train --mixed-precision bf16` on CPU (its own process: Accelerate's state is per process): a few
    steps of the tiny preset end with finite losses (before the fix: NaN at step 1, blaming the learning
    rate)."""
    run, done = fresh_processes[request.node.name].result()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mixed precision bf16" in done.stdout + done.stderr
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if line]
    losses = [r["loss"] for r in log if "loss" in r and "event" not in r]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses


def test_a_bpe_smaller_than_asked_is_said(tmp_path, capsys):
    """A byte-level BPE stops merging when the corpus has no pair left: `--bpe-vocab-size 60000` on a short corpus
    gives a few hundred tokens, and the model's vocabulary with it. The run says so instead of leaving the user to
    find a 60,000 in the settings and a few hundred in the model."""
    from accelerate import Accelerator

    from modeling_gpn.train import training

    corpus = tmp_path / "short.txt"
    corpus.write_text("To be, or not to be, that is the question. " * 200)
    config = train_module.resolve_config(
        parse(small_args(corpus, tmp_path / "out", tmp_path / "c", "--bpe-vocab-size", "60000"))
    )
    tokenizer, _stream, _windows = training.prepare_data(Accelerator(cpu=True), config, show_progress=False)
    said = capsys.readouterr().out
    assert len(tokenizer) < 1000
    assert f"a byte-level BPE of {len(tokenizer):,} tokens, fewer than --bpe-vocab-size 60,000" in said


def test_every_row_format_gives_the_same_documents(tmp_path):
    """A corpus given as jsonl, parquet or csv (a row a document, its text in --text-field) is the same documents:
    commas, quotes, line breaks and non-ASCII text inside a row survive each reader."""
    import pandas

    from modeling_gpn.data import CorpusSpec

    texts = ['First, a line.\nThen "a quoted" one;', "Zweite Zeile, mit Umlaut: äöü", "plain third"]
    frame = pandas.DataFrame({"id": [1, 2, 3], "body": texts})
    frame.to_json(tmp_path / "c.jsonl", orient="records", lines=True, force_ascii=False)
    frame.to_parquet(tmp_path / "c.parquet")
    frame.to_csv(tmp_path / "c.csv", index=False)
    for suffix in ("jsonl", "parquet", "csv"):
        spec = CorpusSpec(source=str(tmp_path / f"c.{suffix}"), text_field="body")
        assert list(spec.documents()) == texts, suffix
