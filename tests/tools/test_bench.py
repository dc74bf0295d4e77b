"""`gpn bench` runs end to end on a tiny preset and reports every figure for every implementation."""

from __future__ import annotations

import json

import pytest

from gpn_cli import main

from ..backend_observer import C_STEP_KERNELS, FAST_PATH, PLAIN_PATH, ran
from ..environment import REPO_ROOT


def test_bench_reports_every_implementation(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "--preset",
            "tiny",
            "--batch",
            "2",
            "--seq-len",
            "12",
            "--segment-length",
            "5",
            "--memory-seq-lens",
            "24",
            "--decode-prompt-lengths",
            "4",
            "9",
            "--decode-tokens",
            "3",
            "--decode-batches",
            "1",
            "4",
            "--repeats",
            "1",
            "--device",
            "cpu",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "bench.png"),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    # --plot: a PNG of decode ms and cache bytes against the prompt length, a line per implementation, and the
    # GPN's byte limit (its text says what was drawn, read from the figure's lines)
    from PIL import Image

    assert f"plot: {tmp_path / 'bench.png'}" in printed
    with Image.open(tmp_path / "bench.png") as image:
        drawn = image.text["Description"].split("; ")
    decode, cache = "(a) generate() decode, batch 1: ", "(b) what a prompt leaves in the cache: "
    lines = ("GPN plain loop", "GPN fast path", "Llama (matched)")  # (in --impl's order)
    assert [line for line in drawn if line.startswith(decode)] == [
        *(f"{decode}{line}: 2 points at x 4-9" for line in lines),
        f"{decode}GPN byte limit: {rows_limit_mb(out)} MB a step / read bandwidth: 2 points at x 4-9",
    ], drawn
    assert [line for line in drawn if line.startswith(cache)] == [f"{cache}{line}: 2 points at x 4-9" for line in lines]
    for impl in ("plain", "fast", "llama"):
        assert f"| tiny | {impl} |" in printed
    assert "train tok/s / Llama's" in printed and "train peak memory @24 / @12" in printed
    assert "batch 2 x 12 tokens, GPN training segment 5," in printed
    from modeling_gpn import memory_kernels

    kernels = f"on ({memory_kernels.products_isa()})" if memory_kernels.available() else "off ("
    assert f"GPN memory kernels {kernels}" in printed
    report = json.loads(out.read_text())
    assert report["memory_kernels"].startswith(kernels)
    rows = {row["impl"]: row for row in report["rows"]}
    for impl, row in rows.items():
        assert row["train_tok_s"] > 0 and row["forward_tok_s"] > 0, impl
        for length in ("4", "9"):
            assert row["prefill_tok_s"][length] > 0 and row["decode_ms"][length] > 0, impl
    # what the fast path's timings ran on (on CPU without GPN_TRITON=1: the torch ops for training, the C step
    # kernels for every no-grad window of up to 16 rows, the forward of 2 x 12 tokens too, where they build)
    backend = rows["fast"]["backend"]
    assert backend["train"] == "torch ops"
    for timing in ("forward", "step @1 rows", "step @4 rows", "prefill and decode @4", "prefill and decode @9"):
        assert backend[timing].startswith("c step kernels" if memory_kernels.available() else "torch ops"), timing
    if memory_kernels.available():  # (a one-token step of one row: the whole token in one C call)
        assert "decoded tokens in one call" in backend["step @1 rows"], backend
    assert "fast train ran on: torch ops" in printed and report["triton_self_checks"] == {}
    # a GPN's cache does not grow with the prompt; the Llama's holds the prompt's positions (it was the cache
    # generate() ended with: 2 more new tokens' positions here)
    assert rows["fast"]["cache_bytes"]["4"] == rows["fast"]["cache_bytes"]["9"]
    assert rows["llama"]["cache_bytes"]["9"] * 4 == rows["llama"]["cache_bytes"]["4"] * 9
    # benchmarks/byte_limit_table.py on a report of two presets (as a plain `gpn bench` run's, tiny and small: it
    # stopped at unpacking one fast row) lays out the JSON's figures under their headers (a batch not measured:
    # "-", where it printed 0 tok/s)
    (tmp_path / "tables").mkdir()
    second = {**rows["fast"], "preset": "small", "step_ms": 2 * rows["fast"]["step_ms"]}
    report["rows"].append(second)
    (tmp_path / "tables" / "both-after.json").write_text(json.dumps(report))
    table = table_cells(tmp_path / "tables")
    assert [(cells["preset"], cells["code"]) for cells in table] == [("small", "after"), ("tiny", "after")]
    for cells, row in zip(table, (second, rows["fast"])):
        step, limit, at = row["step_ms"], row["limit_ms"], row["limit_ms_at"]["9"]
        assert cells["step ms (x limit)"] == f"{step:.3f} ({step / limit:.2f}x)", cells
        assert cells["decode ms @9 (x)"] == f"{row['decode_ms']['9']:.3f} ({row['decode_ms']['9'] / at:.2f}x)"
        assert cells["tok/s @4 rows"] == f"{row['batch_tok_s']['4']:,.0f}" and cells["tok/s @16 rows"] == "-"


def rows_limit_mb(report_path) -> str:
    """The fast row's step bytes of a --json report, in MB as --plot's legend writes them."""
    (fast,) = [row for row in json.loads(report_path.read_text())["rows"] if row["impl"] == "fast"]
    return f"{fast['limit_bytes'] / 1e6:.1f}"


def table_cells(folder) -> list[dict]:
    """The rows of `benchmarks/byte_limit_table.py FOLDER`'s table, each as {header: cell}."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "byte_limit_table.py"
    text = subprocess.run([sys.executable, str(script), str(folder)], capture_output=True, text=True, check=True)
    header, _, *lines = text.stdout.splitlines()
    split = lambda line: [cell.strip() for cell in line.strip().strip("|").split(" | ")]  # noqa: E731
    return [dict(zip(split(header), split(line), strict=True)) for line in lines]


def test_bench_measures_int4_weights_on_the_fast_path(tmp_path, capsys):
    """`gpn bench --dtype int4` quantizes both models with torchao's int4 weight-only config (the GPN's every
    nn.Linear but the tied head) and measures the GPN on the fast path against the bytes its quantized weights
    hold, as the C kernels' int4 products read them where they take them; like int8 it measures inference only. With no one-token steps (--decode-batches none) the limits
    that generate()'s figures are ratios to are still stated, in the JSON and after the table (they were null,
    the ratios printed to a limit stated nowhere)."""
    import pytest

    pytest.importorskip("torchao.quantization", reason="--dtype int4 quantizes with torchao (the test extra)")
    from modeling_gpn import memory_kernels
    from modeling_gpn.bench import build_gpn, prefill_bytes, step_bytes, tensor_bytes
    from modeling_gpn.bench.limit import weight_bytes

    out = tmp_path / "bench.json"
    common = ["bench", "--preset", "tiny", "--impl", "fast", "--dtype", "int4", "--device", "cpu"]
    measure = ["--skip-training", "--decode-prompt-lengths", "6", "--decode-tokens", "3", "--repeats", "1"]
    with ran(FAST_PATH, C_STEP_KERNELS, not_ran=(PLAIN_PATH,)):
        assert main([*common, *measure, "--decode-batches", "--json", str(out)]) == 0
    fast = json.loads(out.read_text())["rows"][0]
    model = build_gpn("tiny", "int4", "cpu", 0)
    assert type(model.model.fuse_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert fast["limit_bytes"] == step_bytes(model) < step_bytes(build_gpn("tiny", "bfloat16", "cpu", 0))
    assert fast["prefill_limit_bytes"] == prefill_bytes(model) and fast["step_ms"] is None
    weight = model.model.predict_layers[0].ffn_in.weight
    if "+vnni" in memory_kernels.products_isa():
        # the limit counts what the int4 products read, not torchao's int4 values held a byte each: half a byte a
        # value and a float32 scale a group (ffn_in's rows of 48 weights, no multiple of 32, are a group each)
        assert weight.shape == (128, 48) and weight_bytes(weight) == 128 * 48 // 2 + 128 * 4 < tensor_bytes(weight)
    # a weight the products do not take is counted as held, and not among the operands the kernels made (which
    # `int4_dequantized` counts by why they kept the dequantized matrix)
    memory_kernels.int4_dequantized.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GPN_INT4_KERNEL", "0")
        assert weight_bytes(weight) == tensor_bytes(weight) and not memory_kernels.int4_dequantized
    step, prompt, at = fast["limit_bytes"], fast["prefill_limit_bytes"], fast["limit_ms_at"]["6"]
    printed = capsys.readouterr().out
    assert f"tiny fast limit: {step / 1e6:.1f} MB a step, a prompt token {prompt / 1e6:.1f} MB (" in printed
    assert f"beside generate() @6: {step / at / 1e6:.1f} GB/s" in printed
    assert main(common) == 2
    assert "--dtype int4 measures inference only" in capsys.readouterr().err


def test_bench_states_every_batch_one_figure_against_its_byte_limit(tmp_path, capsys):
    """`gpn bench --dtype int8` (torchao int8 weight-only) measures the limit in the same run (a read of the
    step's bytes) and prints each batch-1 figure as a ratio of it; `--help` says what the limit is."""
    import pytest

    pytest.importorskip("torchao.quantization", reason="--dtype int8 quantizes with torchao (the test extra)")
    out = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "--preset",
            "tiny",
            "--impl",
            "fast",
            "llama",
            "--dtype",
            "int8",
            "--skip-training",
            "--decode-prompt-lengths",
            "6",
            "--decode-tokens",
            "3",
            "--decode-batches",
            "1",
            "2",
            "--repeats",
            "1",
            "--device",
            "cpu",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    for header in ("| step ms | limit ms | step / limit |", "prefill / limit @6", "decode / limit @6", "tok/s @2 rows"):
        assert header in printed, header
    assert (
        "train tok/s" not in printed
        and "inference only (--skip-training)," in printed
        and " x 256 tokens" not in printed
    )
    rows = {row["impl"]: row for row in json.loads(out.read_text())["rows"]}
    fast = rows["fast"]
    assert fast["limit_ms"] > 0 and fast["step_ms"] > 0 and fast["batch_tok_s"]["2"] > 0
    # the limit counts the int8 weights as int8: less than half the bf16 bytes of the same model
    from modeling_gpn.bench import build_gpn, step_bytes

    assert (
        fast["limit_bytes"]
        == step_bytes(build_gpn("tiny", "int8", "cpu", 0))
        < step_bytes(build_gpn("tiny", "bfloat16", "cpu", 0))
    )
    assert f"tiny fast limit: {fast['limit_bytes'] / 1e6:.1f} MB a step" in printed
    assert "x its byte limit" in printed and "beyond the model's step" in printed
    assert rows["llama"]["limit_ms"] is None  # (the limit is stated for the GPN's step)
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "the byte limit" in capsys.readouterr().out


def test_generate_timings_decode_to_the_end_without_logits_processors(monkeypatch):
    """`gpn bench` times generate() for exactly `--decode-tokens` tokens even where greedy decoding reaches the
    model's end-of-sequence token at once, and with no logits processor at any step: the per-token time is a
    plain generate() call's (`min_new_tokens` would mask the end token at every step)."""
    from types import SimpleNamespace

    import torch
    from transformers.generation import LogitsProcessorList

    from modeling_gpn.bench import generate_timings

    from ..tiny_models import perturbed_model, tiny_config

    model = perturbed_model(tiny_config(), seed=48).eval()
    prompt = torch.randint(1, 97, (1, 5), generator=torch.Generator().manual_seed(49))
    with torch.no_grad():
        first = int(model(prompt).logits[0, -1].argmax())
    model.generation_config.eos_token_id = first  # (a plain greedy call stops after one token)
    assert model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0).shape[1] == 6
    processors = []
    call = LogitsProcessorList.__call__
    monkeypatch.setattr(LogitsProcessorList, "__call__", lambda self, *a: processors.extend(self) or call(self, *a))
    to_first, gaps = generate_timings(model, prompt, SimpleNamespace(device="cpu", decode_tokens=6))
    assert len(gaps) == 5 and to_first > 0 and processors == []


def test_the_one_token_step_continues_each_models_cache():
    """`gpn bench`'s one-token step (a forward of one token with its cache) continues the cache it was given, for a
    GPN and for the Llama (transformers 5 names the Llama's `cache=` too; `past_key_values=` is its deprecated
    alias): the Llama's cache grows by a position a step, and a GPN's logits are those of its prompt continued,
    not of a fresh one-token prompt."""
    import torch

    from modeling_gpn.bench import build_gpn, matched_llama, one_token_step_fn

    gpn = build_gpn("tiny", "float32", "cpu", 0).eval()
    llama = matched_llama(gpn.config, 50_000, "float32", "cpu").eval()
    seen = []
    forward = llama.model.forward

    def watched(*args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        seen.append(None if cache is None else cache.get_seq_length())
        return forward(*args, **kwargs)

    llama.model.forward = watched
    step = one_token_step_fn(llama, 1, gpn.config.vocab_size, "cpu", prompt_length=5)
    step()
    step()
    assert seen == [None, 5, 6]  # (the prompt, then two steps continuing its cache)
    logits = []
    gpn_forward = gpn.forward
    gpn.forward = lambda *args, **kwargs: logits.append(gpn_forward(*args, **kwargs)) or logits[-1]
    one_token_step_fn(gpn, 1, gpn.config.vocab_size, "cpu", prompt_length=5)()
    generator = torch.Generator().manual_seed(1)  # (the prompt the step function draws)
    prompt = torch.randint(1, gpn.config.vocab_size, (1, 5), generator=generator)
    with torch.no_grad():
        continued = gpn_forward(torch.cat([prompt, prompt[:, -1:]], dim=1)).logits[:, -1]
    torch.testing.assert_close(logits[-1].logits[:, -1], continued, rtol=1e-4, atol=1e-4)


def test_gflops_count_each_weight_once():
    """GFLOP/s counts 2 flops a weight a token: every matrix once (the tied embedding as the output head only:
    its lookup multiplies nothing), plus a GPN's memory or a Llama's attention (q.K and the weighted sum of V at
    the mean context). The tied head was counted twice (a fifth of small's figure), the attention half."""
    from modeling_gpn.bench import build_gpn, forward_flops_per_token, matched_llama

    gpn = build_gpn("tiny", "float32", "cpu", 0)
    llama = matched_llama(gpn.config, 50_000, "float32", "cpu")
    config = gpn.config

    def matrices(model):  # (parameters() yields a tied weight once)
        return sum(p.numel() for p in model.parameters() if p.dim() == 2)

    memory = (6 + 2 * config.num_predict_layers) * config.memory_cells
    assert forward_flops_per_token(gpn, 64) == 2 * matrices(gpn) + memory
    layers, hidden = llama.config.num_hidden_layers, llama.config.hidden_size
    assert forward_flops_per_token(llama, 64) == 2 * matrices(llama) + 2 * (2 * 64 * hidden) * layers


def test_an_unknown_preset_is_refused_before_anything_is_measured(capsys):
    """Every preset is checked first: a misspelt second one is one line naming it and the presets there are,
    not a traceback after the first one's minutes of measuring."""
    assert main(["bench", "--preset", "tiny", "smal", "--skip-training"]) == 2
    message = refusal(capsys)
    assert message.startswith("--preset: No preset named 'smal'") and "small" in message


@pytest.mark.parametrize("case", ["not-json", "not-an-object", "invalid-config", "llama-config", "beyond-memory"])
def test_a_preset_file_that_is_no_config_is_refused_before_anything_is_measured(case, tmp_path, monkeypatch, capsys):
    """A config JSON given as a preset is read before the first preset is measured: a file that is not JSON,
    or a config GPNConfig refuses, was a traceback once the models were built (after every preset before it)."""
    import modeling_gpn.bench.command as command

    monkeypatch.setattr(command, "measure", lambda *args: pytest.fail("a preset was measured"))
    preset = tmp_path / "mine.json"
    preset.write_text(
        {
            "not-json": "{hidden_size: 8",
            "not-an-object": "[1, 2]",  # (a TypeError traceback inside GPNConfig(**values))
            "invalid-config": '{"hidden_size": -3}',
            # another model's config.json (a Llama's): measured in silence as a GPN of the default sizes
            "llama-config": '{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}',
            # (torch's allocator was asked for 128 TB: a traceback once the presets before it were measured)
            "beyond-memory": '{"vocab_size": 1000000000000, "hidden_size": 32, "embedding_size": 32}',
        }[case]
    )
    assert main(["bench", "--preset", "tiny", str(preset), "--skip-training"]) == 2
    message = refusal(capsys)
    assert message.startswith(f"--preset {preset}: "), message
    needle = {"not-json": "Expecting property name", "invalid-config": "hidden_size must be"}
    needle["not-an-object"] = "holds a JSON list, not an object of config values"
    needle["llama-config"] = "is the config of a 'llama' model, not a GPN"
    needle["beyond-memory"] = "its weights alone take 119,209.3 GiB in float32, more than the "
    assert needle[case] in message, message


TINY = ["--preset", "tiny", "--impl", "fast", "--skip-training", "--decode-prompt-lengths", "4"]
TINY += ["--decode-tokens", "3", "--decode-batches", "1", "--repeats", "1", "--device", "cpu"]

BENCH_BAD = {  # each was a traceback once the models were built (or, for --json, after the whole run)
    "zero-repeats": (["--repeats", "0"], "--repeats must be at least 1, got 0"),
    "negative-repeats": (["--repeats", "-2"], "--repeats must be at least 1, got -2"),
    "one-decode-token": (["--decode-tokens", "1"], "--decode-tokens must be at least 2"),
    "zero-batch-rows": (["--decode-batches", "1", "0"], "--decode-batches must be at least 1, got 1 0"),
    "negative-prompt": (["--decode-prompt-lengths", "-3"], "--decode-prompt-lengths must be at least 1"),
    "zero-batch": (["--batch", "0"], "--batch must be at least 1, got 0"),
    "zero-threads": (["--threads", "0"], "--threads must be at least 1, got 0"),
    "negative-segment": (["--segment-length", "-1"], "--segment-length must be >= 0"),
    "unknown-device": (["--device", "toaster"], "--device 'toaster' is not a torch device"),
    "json-in-no-folder": (["--json", "{tmp}/no/such/bench.json"], "its folder does not exist"),
    "json-a-folder": (["--json", "{tmp}"], "is a folder"),
    "json-in-no-file-folder": (["--json", "/proc/bench.json"], "its folder cannot hold a new file"),  # (as root too)
    "plot-a-folder": (["--plot", "{tmp}"], "is a folder: name the file to write"),
    "plot-without-lengths": (["--decode-prompt-lengths", "--plot", "{tmp}/b.png"], "--plot draws decode and cache"),
    "plot-over-json": (["--json", "{tmp}/b.out", "--plot", "{tmp}/b.out"], "--plot and --json name the same file"),
    # (a preset's config JSON, replaced by the report at the end of the run; a hard link to it too)
    "json-over-preset": (
        ["--preset", "{tmp}/p.json", "--json", "{tmp}/./p.json"],
        "--json {tmp}/./p.json is the file --preset {tmp}/p.json reads: writing it would replace that input",
    ),
    "plot-over-preset": (["--preset", "{tmp}/p.json", "--plot", "{tmp}/link.json"], "is the file --preset"),
    "plot-over-json-hard-link": (["--json", "{tmp}/p.json", "--plot", "{tmp}/link.json"], "name the same file"),
    "memory-without-training": (["--memory-seq-lens", "64"], "--memory-seq-lens measures the training step's"),
    "nothing-to-measure": (["--decode-prompt-lengths", "--decode-batches"], "nothing to measure"),
    # (measured twice, its rows and ratios printed twice)
    "repeated-preset": (["--preset", "tiny", "tiny"], "--preset names tiny more than once: name each preset once"),
    "repeated-length": (["--decode-prompt-lengths", "4", "8", "4"], "--decode-prompt-lengths names 4 more than once"),
    # (ignored in silence, the report saying "batch 8 x 256 tokens" of a run that trained nothing)
    "batch-without-training": (["--batch", "4"], "--batch sets the training and forward runs, which --skip-training"),
    "training-options-without-training": (
        ["--seq-len", "64", "--segment-length", "0"],
        "--seq-len, --segment-length set the training and forward runs",
    ),
}


def refusal(capsys) -> str:
    """The message of gpn bench's refusal, checked to be one line worded as argparse's ("gpn bench: error: ...",
    exit status 2, checked by the caller): its refusals were the bare message with exit status 1."""
    captured = capsys.readouterr()
    # (from its first character: no progress bar before it, nothing was measured)
    assert captured.err.startswith("gpn bench: error: ") and captured.err.count("\n") == 1, captured.err
    return captured.err.removeprefix("gpn bench: error: ").rstrip("\n")


@pytest.mark.parametrize("case", sorted(BENCH_BAD))
def test_bad_arguments_are_refused_before_any_model_is_built(case, tmp_path, monkeypatch, capsys):
    import modeling_gpn.bench.command as command

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(command, "build_gpn", no_model)
    extra, needle = BENCH_BAD[case]
    (tmp_path / "p.json").write_bytes((REPO_ROOT / "configuration" / "tiny.json").read_bytes())
    (tmp_path / "link.json").hardlink_to(tmp_path / "p.json")
    preset = (tmp_path / "p.json").read_bytes()
    assert main(["bench", *TINY, *[a.format(tmp=tmp_path) for a in extra]]) == 2
    assert needle.format(tmp=tmp_path) in refusal(capsys)
    assert (tmp_path / "p.json").read_bytes() == preset


def test_an_interrupted_json_write_leaves_no_half_file(tmp_path, monkeypatch):
    """The JSON report was written straight into --json: a run stopped while writing it left half a document
    there (in place of the previous run's). It is written beside it and renamed."""
    import modeling_gpn.bench.command as command

    out = tmp_path / "bench.json"
    out.write_text('{"previous": "run"}')
    monkeypatch.setattr(command, "measure", lambda models, preset, args: [])

    def interrupted_dump(report, handle, **kwargs):
        handle.write('{"args": {')
        raise KeyboardInterrupt

    monkeypatch.setattr(command.json, "dump", interrupted_dump)
    with pytest.raises(KeyboardInterrupt):
        command.run(_bench_args(["--json", str(out)]))
    assert json.loads(out.read_text()) == {"previous": "run"}
    assert [path.name for path in tmp_path.iterdir()] == ["bench.json"]  # (nor a temporary file)
    monkeypatch.undo()
    monkeypatch.setattr(command, "measure", lambda models, preset, args: [])
    assert command.run(_bench_args(["--json", str(out)])) == 0
    assert json.loads(out.read_text())["rows"] == []


def test_the_json_report_is_synced_and_a_failed_write_names_it(tmp_path, monkeypatch):
    """The JSON report was renamed into place unsynced (a power cut after the run could leave the name on an
    empty file) and a failed write named the hidden temporary file. It is written as every file gpn replaces
    (`modeling_gpn.atomic_files`): the file fsynced, then its folder; a full disk (here a real EFBIG, from a
    file-size limit) names --json's path and leaves no temporary file."""
    import os
    import resource

    import modeling_gpn.bench.command as command

    out = tmp_path / "bench.json"
    monkeypatch.setattr(command, "measure", lambda models, preset, args: [])
    synced, real_fsync = [], os.fsync

    def recording_fsync(descriptor):
        synced.append(os.fstat(descriptor).st_ino)
        return real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    assert command.run(_bench_args(["--json", str(out)])) == 0
    assert out.stat().st_ino in synced and tmp_path.stat().st_ino in synced, "the report or its folder was not synced"

    written = out.read_text()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, hard))  # (CPython ignores SIGXFSZ: the write fails)
    try:  # (the writer alone: pytest's captured output is a file, which the limit would stop too)
        with pytest.raises(OSError) as error:
            command.write_json(str(out), {"rows": ["a report larger than the limit"]})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert error.value.filename == str(out) and "File too large" in str(error.value), error.value
    assert out.read_text() == written and [path.name for path in tmp_path.iterdir()] == ["bench.json"]


def _bench_args(extra: list[str]):
    import argparse

    from modeling_gpn.bench import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([*TINY, *extra])


def test_threads_take_the_name_gpn_train_and_eval_give_them():
    """`gpn train` and `gpn eval` say --num-threads; `gpn bench --num-threads 2` was refused ("unrecognized
    arguments"). Both spellings set the same option."""
    assert _bench_args(["--num-threads", "2"]).threads == 2 and _bench_args(["--threads", "3"]).threads == 3


def test_float16_weights_are_two_bytes_in_the_byte_limit_and_the_memory_check(tmp_path, capsys):
    """`gpn bench --dtype float16` (GPUs without bf16) builds the models in float16: a step's byte limit and the
    check that a preset's weights fit count 2 bytes a weight, as for bfloat16 (no timed run here). It measures
    inference only: its training step's AdamW turned the weights NaN, and generate() then refused them."""
    import torch

    from modeling_gpn.bench import build_gpn, step_bytes
    from modeling_gpn.bench.models import weight_bytes
    from modeling_gpn.configuration import load_preset

    assert _bench_args(["--dtype", "float16"]).dtype == "float16"
    half, bf16 = build_gpn("tiny", "float16", "cpu", 0), build_gpn("tiny", "bfloat16", "cpu", 0)
    assert half.dtype == torch.float16 and step_bytes(half) == step_bytes(bf16)
    config = load_preset("tiny")
    assert weight_bytes(config, "float16") == weight_bytes(config, "bfloat16") == weight_bytes(config, "float32") // 2
    preset = tmp_path / "huge.json"
    preset.write_text('{"vocab_size": 1000000000000, "hidden_size": 32, "embedding_size": 32}')
    assert main(["bench", "--preset", str(preset), "--skip-training", "--dtype", "float16", "--device", "cpu"]) == 2
    assert "its weights alone take 59,604.6 GiB in float16, more than the " in refusal(capsys)
    assert main(["bench", "--preset", "tiny", "--dtype", "float16", "--device", "cpu"]) == 2
    assert refusal(capsys).startswith("--dtype float16 measures inference only: AdamW on float16 weights")


def test_help_explains_every_column(capsys):
    """Every header the table can print (every option on) is named, in quotes, in `gpn bench --help`: the
    limit's columns were, the speed and memory ones only in the module's docstring."""
    import re

    from modeling_gpn.bench.report import _columns

    args = _bench_args(["--memory-seq-lens", "24", "--decode-batches", "1", "4"])
    args.skip_training, args.seq_len = False, 12
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for header, _ in _columns(args):
        if header in ("preset", "impl"):
            continue
        name = re.sub(r"@\d+ rows", "@B rows", re.sub(r"@\d+$", "@N", header))
        name = re.sub(r"^(train|fwd) GFLOP/s$", "GFLOP/s", name)
        assert f'"{name}"' in text, header


def test_figures_below_one_keep_their_digits_in_the_table(capsys):
    """A small model's byte limit is a few microseconds: the table printed "limit ms 0.00" beside "step / limit
    16.55x", a column no reader could check; figures below 1 keep three significant digits."""
    from modeling_gpn.bench.measure import Row
    from modeling_gpn.bench.report import fmt, print_table

    row = Row("tiny", "fast", 43302, step_ms=0.05436, limit_ms=0.003284)
    print_table([row], _bench_args(["--decode-prompt-lengths"]))
    header, _, figures = capsys.readouterr().out.splitlines()
    cells = dict(zip(*[[cell.strip() for cell in line.strip("| ").split(" | ")] for line in (header, figures)]))
    assert cells["limit ms"] == "0.00328" and cells["step ms"] == "0.0544", cells
    assert cells["step / limit"] == "16.55x"
    assert (fmt(0), fmt(2.5), fmt(1234.5)) == ("0.00", "2.50", "1,234")


def test_ctrl_c_reports_the_presets_measured_before_it(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the second preset is measured: the first one's figures (minutes of measuring) were lost, the
    table printed only at the end. They are printed and written (--json, marked interrupted), exit status 130."""
    import modeling_gpn.bench.command as command
    from modeling_gpn.bench.measure import Row

    def measured(models, preset, args):
        if preset == "small":
            raise KeyboardInterrupt
        limits = dict(limit_bytes=1000, limit_probe="a read", prefill_limit_bytes=500, prefill_limit_ms=0.125)
        return [Row(preset, "fast", 1000, step_ms=0.5, limit_ms=0.25, **limits)]

    monkeypatch.setattr(command, "measure", measured)
    out = tmp_path / "bench.json"
    try:
        status = command.run(_bench_args(["--preset", "tiny", "small", "--json", str(out)]))
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C lost the figures measured before it")
    assert status == 130
    captured = capsys.readouterr()
    assert "| tiny | fast |" in captured.out and "| small |" not in captured.out, captured.out
    assert "interrupted (Ctrl-C)" in captured.err and "(tiny)" in captured.err
    report = json.loads(out.read_text())
    assert report["interrupted"] is True and [(r["preset"], r["step_ms"]) for r in report["rows"]] == [("tiny", 0.5)]

    monkeypatch.setattr(command, "measure", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):  # (nothing measured: the command's own one line, no empty table)
        command.run(_bench_args(["--preset", "tiny", "--json", str(out)]))


def test_sigterm_reports_the_presets_measured_before_it(tmp_path, monkeypatch, capsys):
    """SIGTERM (`timeout 600 gpn bench ...`, a scheduler's time limit) while the second preset is measured killed
    the run with nothing printed: the first preset's minutes lost. They are reported as after Ctrl-C, exit 143."""
    import os
    import signal

    import modeling_gpn.bench.command as command
    from modeling_gpn.bench.measure import Row

    def measured(models, preset, args):
        if preset == "small":
            os.kill(os.getpid(), signal.SIGTERM)
        limits = dict(limit_bytes=1000, limit_probe="a read", prefill_limit_bytes=500, prefill_limit_ms=0.125)
        return [Row(preset, "fast", 1000, step_ms=0.5, limit_ms=0.25, **limits)]

    def unhandled(signum, frame):  # what the default action (the process killed) would mean here
        raise AssertionError("SIGTERM was not taken by gpn bench: the process would have died, nothing printed")

    monkeypatch.setattr(command, "measure", measured)
    out = tmp_path / "bench.json"
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        status = command.run(_bench_args(["--preset", "tiny", "small", "--json", str(out)]))
        assert signal.getsignal(signal.SIGTERM) is unhandled  # given back after the run
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert status == 143
    captured = capsys.readouterr()
    assert "| tiny | fast |" in captured.out and "| small |" not in captured.out, captured.out
    assert "interrupted (SIGTERM)" in captured.err and "(tiny)" in captured.err
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["interrupted"] is True and [r["preset"] for r in report["rows"]] == ["tiny"]
