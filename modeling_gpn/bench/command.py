"""`gpn bench`'s command line: its arguments and the run (models built per preset, measured, reported)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..configuration_gpn import GPNConfig

from ..atomic_files import replacing
from ..cli.arguments import refuse_output_over_inputs, same_path, torch_device
from ..cli.quantization import DTYPES, QUANTIZERS
from ..generation import device_memory_bytes
from .measure import measure
from .models import build_gpn, count_params, matched_llama, weight_bytes
from .plot import draw_bench_plot
from .report import print_limits, print_ratios, print_table
from .timing import memory_kernels_state, self_checks_state

IMPLEMENTATIONS = ("plain", "fast", "llama")


class Terminated(Exception):
    """SIGTERM while presets are measured (`timeout`, a batch scheduler's time limit, `kill`)."""


@contextlib.contextmanager
def sigterm_stops() -> Iterator[None]:
    """Inside it SIGTERM raises `Terminated`, so that the presets measured before it are reported as after a
    Ctrl-C: by default it killed the process, and a preset takes minutes, the table being printed at the end.
    Off the main thread (where Python takes no handler) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class BenchError(ValueError):
    """A run `gpn bench` refuses, before any model is measured: one line, "gpn bench: error: ...", exit status 2,
    as argparse's refusals and the other subcommands' own (gpn study, gpn eval, gpn inspect)."""


LIMIT_HELP = """\
the byte limit: a batch-1 GPN step reads every weight once (the tied embedding as the output matrix) and
its state, and nothing grows with the context, so its time per token cannot go below those bytes over the
machine's read bandwidth. The bench measures that bandwidth in the same run, reading as many bytes as the
step, in turn with the step's own timings, each timed read after an untimed one (so from L3 when the
weights fit it, as a decode loop's do between tokens, else from DRAM, on the 2 MB pages such weights are
put on; see docs/inference-speed.md): "limit ms" is that read's median; "step ms" the model's one-token step (a forward of one token with
its cache, batch 1); "step / limit" and "decode / limit @N" (generate()'s ms per new token) are ratios to
it. A prompt token reads less (the recurrence's weights: the token-side projection runs for the whole
prompt beforehand, and only the last position is decoded), so "prefill / limit @N" (seconds per prompt
token) is a ratio to a second read of those bytes. 1.00x is a step that costs its bytes and nothing else. The lines after the table say each limit's bytes and bandwidth (beside the steps, and
beside generate()'s calls at each prompt length: what its ratios use), and how much of generate()'s time per
token lies beyond the model's step."""


COLUMNS_HELP = """\
the other columns: "params" the model's parameters; "train tok/s" forward + backward + AdamW step on
--batch x --seq-len random tokens, "fwd tok/s" a no-grad forward of them, "GFLOP/s" the model's matmul
and memory arithmetic per second (training = 3x forward); "train peak @N" the training step's peak
memory at length N (CUDA: max_memory_allocated; CPU: resident-set growth); "tok/s @B rows" one-token
steps at B batch rows (--decode-batches); "prefill tok/s @N" a prompt of N tokens over generate()'s time
to its first new token, "decode ms @N" the median time between its later new tokens (greedy, batch 1);
"cache @N" the bytes of the cache a prompt of N tokens leaves (a GPN's state does not grow with it).
Every figure is a median of --repeats after a warm-up; the lines "... ran on:" say which backend each of
the fast path's timings used."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `gpn bench`."""
    # three paragraphs, each wrapped to the terminal (the command's formatter keeps blank-line breaks; the limit's
    # paragraphs printed as written were lines of up to 130 characters, broken by an 80-column terminal)
    parser.description = (parser.description or "") + "\n\n" + LIMIT_HELP + "\n\n" + COLUMNS_HELP
    parser.add_argument(
        "--preset",
        nargs="+",
        default=["tiny", "small"],
        help="GPN presets or config JSON paths, each named once (a repeated one is refused)",
    )
    parser.add_argument(
        "--impl", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS, help="implementations to measure"
    )
    # (None: not given, so that --skip-training can refuse them; `check_arguments` sets TRAINING_DEFAULTS)
    parser.add_argument(  # (--batch-size: as gpn eval and gpn inspect spell it, per forward pass)
        "--batch",
        "--batch-size",
        dest="batch",
        type=int,
        default=None,
        help="training / forward batch size (default 8; not with --skip-training)",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="training / forward sequence length (default 256; not with --skip-training)",
    )
    parser.add_argument(
        "--decode-prompt-lengths",
        type=int,
        nargs="*",
        default=[128, 1024, 4096],
        help="prompt lengths for prefill and decode (batch 1); none to skip decoding",
    )
    parser.add_argument("--decode-tokens", type=int, default=16, help="new tokens per generate() call")
    parser.add_argument(
        "--decode-batches",
        type=int,
        nargs="*",
        default=[1, 4, 16],
        help="batch sizes of the one-token step (tokens/s columns; batch 1 always, with its "
        "byte limit); none to skip the steps",
    )
    parser.add_argument(
        "--memory-seq-lens",
        type=int,
        nargs="*",
        default=[],
        help="also measure the training peak memory at these lengths (same batch)",
    )
    parser.add_argument(
        "--skip-training",
        action="store_true",
        help="measure inference only (no training, forward throughput or training memory)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median reported)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="weight dtype (float16: GPUs without bf16; 2 bytes a weight in the byte limit, as bfloat16; needs "
        "--skip-training, AdamW's eps being 0 in float16); int8 / int4: the bfloat16 model with every nn.Linear quantized by torchao's "
        "int8 weight-only config / its int4 weight-only IntxWeightOnlyConfig (groups of 32) (needs torchao and "
        "--skip-training; the tied heads stay bf16; int4 counts in the byte limit as the C kernels' int4 "
        "products read it, 0.625 bytes a weight, where they take it, else as torchao holds it, 1.09)",
    )
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device to measure on"
    )
    parser.add_argument(
        "--segment-length",
        "--bptt-segment",  # (as gpn train spells it)
        dest="segment_length",
        type=int,
        default=None,
        help="bptt_segment_length for GPN training, as `gpn train --bptt-segment` (0: keep every "
        "step; default 256; not with --skip-training); windows up to this long train without recomputation",
    )
    parser.add_argument(
        "--skip-plain-decode", action="store_true", help="do not run the (slow) plain path through generate()"
    )
    parser.add_argument(  # (--num-threads: as gpn train and gpn eval spell it)
        "--threads",
        "--num-threads",
        dest="threads",
        type=int,
        default=None,
        help="torch intra-op threads (CPU; default: torch's own, one per core it sees)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (as gpn train, eval, inspect)")
    parser.add_argument(
        "--json", default=None, help="also write all figures to this JSON file (replacing one there, in one step)"
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="also draw decode ms per new token and cache bytes against the prompt length (one line per preset and "
        "implementation: a GPN's flat, the Llama's growing), with each GPN's byte limit as a dotted line, to this "
        "PNG (replacing one there, in one step; needs --decode-prompt-lengths)",
    )


TRAINING_DEFAULTS = {"batch": 8, "seq_len": 256, "segment_length": 256}  # what only training and the forward use


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse what would fail only once models are built and measured (a traceback from `statistics.median`,
    `generate()` or `torch.set_num_threads`), or after the whole run (a --json file that cannot be written), and
    options the run would ignore; then set the training options not given to `TRAINING_DEFAULTS`."""
    counts = {"--repeats": [args.repeats]}
    for option, value in (("--batch", args.batch), ("--seq-len", args.seq_len)):
        if value is not None:  # (None: not given, the default set below)
            counts[option] = [value]
    counts.update({"--decode-prompt-lengths": args.decode_prompt_lengths, "--decode-batches": args.decode_batches})
    counts.update({"--memory-seq-lens": args.memory_seq_lens})
    if args.threads is not None:
        counts["--threads"] = [args.threads]
    repeated = sorted({preset for preset in args.preset if args.preset.count(preset) > 1})
    if repeated:  # (it was measured twice, its rows and ratios printed twice)
        raise BenchError(f"--preset names {', '.join(repeated)} more than once: name each preset once")
    lengths = args.decode_prompt_lengths
    repeated = sorted({length for length in lengths if lengths.count(length) > 1})
    if repeated:  # (measured twice, its columns and ratios printed twice, the JSON holding the last)
        raise BenchError(
            f"--decode-prompt-lengths names {' '.join(map(str, repeated))} more than once: name each length once"
        )
    for option, values in counts.items():
        if any(value < 1 for value in values):
            raise BenchError(f"{option} must be at least 1, got {' '.join(map(str, values))}")
    if args.decode_prompt_lengths and args.decode_tokens < 2:  # decode: the median gap between new tokens
        raise BenchError(
            f"--decode-tokens must be at least 2 (decode times the gaps between them), got {args.decode_tokens}"
        )
    if args.segment_length is not None and args.segment_length < 0:
        raise BenchError(f"--segment-length must be >= 0 (0: keep every step), got {args.segment_length}")
    given = [f"--{name.replace('_', '-')}" for name in TRAINING_DEFAULTS if getattr(args, name) is not None]
    if args.skip_training and given:  # (they were ignored in silence, and the report said "batch 8 x 256 tokens")
        sets = "sets" if len(given) == 1 else "set"
        raise BenchError(f"{', '.join(given)} {sets} the training and forward runs, which --skip-training skips")
    for name, default in TRAINING_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    try:
        torch_device(args.device)
    except ValueError as error:
        raise BenchError(str(error)) from None
    if args.skip_training and args.memory_seq_lens:  # (it would be ignored in silence)
        raise BenchError("--memory-seq-lens measures the training step's memory: it does not go with --skip-training")
    if args.skip_training and not args.decode_prompt_lengths and not args.decode_batches:
        raise BenchError("nothing to measure: --skip-training with no --decode-prompt-lengths and no --decode-batches")
    if args.dtype in QUANTIZERS and not args.skip_training:
        raise BenchError(
            f"--dtype {args.dtype} measures inference only (quantized weights do not train): add --skip-training"
        )
    if args.dtype == "float16" and not args.skip_training:  # (the models trained are the ones then decoded)
        raise BenchError(
            "--dtype float16 measures inference only: AdamW on float16 weights turns them NaN (its eps, 1e-8, is 0 "
            "in float16; float16 trains as mixed precision, gpn train --mixed-precision fp16): add --skip-training"
        )
    if args.plot is not None and not args.decode_prompt_lengths:  # (an empty figure, after the whole run)
        raise BenchError(
            "--plot draws decode and cache figures against the prompt length: it needs --decode-prompt-lengths"
        )
    if args.plot is not None and args.json is not None and same_path(args.plot, args.json):
        raise BenchError(f"--plot and --json name the same file, {args.json}: the figure would replace the report")
    for option, file in (("--json", args.json), ("--plot", args.plot)):
        if file is not None:
            check_writable(option, file)
            try:  # (a preset's config JSON, replaced by the report once the run ended)
                refuse_output_over_inputs(file, option, {"--preset": args.preset})
            except ValueError as error:
                raise BenchError(str(error)) from None


def check_writable(option: str, file: str) -> None:
    """Refuse an output `file` that could not be written once the run is over: a folder, a missing or read-only
    folder, a full disk."""
    if Path(file).is_dir():
        raise BenchError(f"{option} {file} is a folder: name the file to write")
    folder = Path(file).resolve().parent
    if not folder.is_dir():
        raise BenchError(f"{option} {file}: its folder does not exist")
    try:  # a file made there and removed: what the report will need (a read-only folder, a full disk, /proc)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as error:
        raise BenchError(f"{option} {file}: its folder cannot hold a new file ({error.strerror})") from None


def write_json(path: str, report: dict) -> None:
    """`report` to `path` in one step (`atomic_files.replacing`: written beside it, fsynced and renamed), so
    that a run interrupted while writing leaves the previous file (or none), never half a JSON document."""
    with replacing(path, "w") as handle:
        json.dump(report, handle, indent=2, default=str)


def run(args: argparse.Namespace) -> int:
    """Run `gpn bench`; a `BenchError` becomes one line on stderr and exit status 2."""
    try:
        return run_bench(args)
    except BenchError as error:
        print(f"gpn bench: error: {error}", file=sys.stderr)
        return 2


def run_bench(args: argparse.Namespace) -> int:
    """The run: every argument and preset checked (`BenchError`), then each preset measured and reported."""
    from tqdm import tqdm

    from modeling_gpn.configuration import load_preset

    check_arguments(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    for preset in args.preset:  # all of them read before the first is measured (a preset takes minutes)
        try:
            config = load_preset(preset)
        except FileNotFoundError as error:
            raise BenchError(f"--preset: {error}") from None
        except (OSError, ValueError) as error:  # (a file that is not JSON, or not a valid GPNConfig)
            raise BenchError(f"--preset {preset}: {error}") from None
        check_fits(preset, config, args.dtype, args.device)
    rows = []
    try:
        with sigterm_stops():
            for preset in tqdm(args.preset, desc="bench", unit="preset", disable=args.no_progress):
                rows += measure_preset(preset, args)
    except (KeyboardInterrupt, Terminated) as stopped:  # the presets measured so far are reported, not lost
        how, signum = (
            ("Ctrl-C", signal.SIGINT) if isinstance(stopped, KeyboardInterrupt) else ("SIGTERM", signal.SIGTERM)
        )
        if not rows:
            if how == "Ctrl-C":
                raise
            print("gpn bench: interrupted (SIGTERM) before a preset was measured", file=sys.stderr)
            return 128 + signal.SIGTERM
        finished = list(dict.fromkeys(r.preset for r in rows))
        print(
            f"gpn bench: interrupted ({how}); reported: the presets measured before it ({', '.join(finished)})",
            file=sys.stderr,
        )
        report(rows, args, interrupted=True)
        return 128 + signum
    report(rows, args)
    return 0


def check_fits(preset: str, config: GPNConfig, dtype: str, device: str) -> None:
    """Refuse `preset` (its `config`) where its weights alone pass the memory of `device` (a vocabulary of 10**12 in
    a config file asked the allocator for 128 TB: torch's traceback after the presets before it were measured)."""
    needed = weight_bytes(config, dtype)
    place = torch.device(device)
    memory = device_memory_bytes(place)
    if memory is None:  # (no way to tell here: the allocator will say)
        return
    if needed > memory:
        raise BenchError(
            f"--preset {preset}: its weights alone take {needed / 2**30:,.1f} GiB in {dtype}, more than the "
            f"{memory / 2**30:,.1f} GiB of {place.type} memory here"
        )


def measure_preset(preset: str, args: argparse.Namespace) -> list:
    """The rows of one preset: one model per implementation, built and measured."""
    models = {}
    try:
        for impl in args.impl:  # one model per implementation (same seed, same weights for plain and fast)
            gpn = build_gpn(preset, args.dtype, args.device, args.segment_length)
            models[impl] = (
                gpn if impl != "llama" else matched_llama(gpn.config, count_params(gpn), args.dtype, args.device)
            )
    except ImportError as error:  # --dtype int8 / int4 without torchao (it says what to install)
        raise BenchError(str(error)) from None
    rows = measure(models, preset, args)
    del models, gpn
    gc.collect()
    return rows


def report(rows: list, args: argparse.Namespace, interrupted: bool = False) -> None:
    """The table and the lines after it; the JSON report if asked for (`interrupted`: said in it, for a run
    stopped before its last preset)."""
    training = (
        f"batch {args.batch} x {args.seq_len} tokens, GPN training segment {args.segment_length or 'none'}, "
        if not args.skip_training
        else "inference only (--skip-training), "
    )
    print(
        f"\ndevice {args.device}, dtype {args.dtype}, threads {torch.get_num_threads()}, {training}"
        f"medians of {args.repeats} repeats, GPN memory kernels {memory_kernels_state(args.device)}\n"
    )
    print_table(rows, args)
    print_limits(rows)
    print_ratios(rows, args)
    checks = self_checks_state()
    for r in rows:
        for timing, backend in r.backend.items():
            print(f"{r.preset} {r.impl} {timing} ran on: {backend}")
    print(f"Triton self-checks: {checks or 'none ran'}")
    if args.json:
        write_json(
            args.json,
            {
                "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                "memory_kernels": memory_kernels_state(args.device),
                "cuda_graphs_setting": os.environ.get("GPN_CUDA_GRAPHS", "off"),
                "triton_self_checks": checks,
                "interrupted": interrupted,
                "rows": [r.__dict__ for r in rows],
            },
        )
    if args.plot:
        try:
            print(f"plot: {draw_bench_plot(rows, args, args.plot)}")
        except OSError as error:  # (checked writable before the run: the disk filled, the folder went away)
            where = f" and {args.json} hold" if args.json else " holds"
            raise BenchError(f"--plot {args.plot}: not written ({error}); the table above{where} the figures") from None
