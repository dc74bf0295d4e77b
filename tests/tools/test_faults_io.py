"""Hostile and damaged inputs of `gpn convert`, `gpn generate`, the token cache and `gpn eval` (issue 13).

Memory bounds are real: the command runs in a child process whose address space is limited with
RLIMIT_AS to what it had after its imports plus a margin, so a bomb that gets through is a
MemoryError or a kill, never a pass.
"""

from __future__ import annotations

import codecs
import io
import json
import math
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gpn_cli import main as gpn_main  # noqa: E402
from modeling_gpn.conversion.reference import parameter_map  # noqa: E402

from ..environment import REPO_ROOT
from ..subprocesses import another_process_holding, two_at_a_time
from ..tiny_models import copy_with_a_nan_weight, perturbed_model, tiny_config

GIB = 1 << 30


# --------------------------------------------------------------------------------------------------
# Helpers: a reference checkpoint of a tiny model, and running a command under a memory bound
# --------------------------------------------------------------------------------------------------


def reference_params(config=None) -> dict[str, np.ndarray]:
    """The reference-layout parameters (name -> (in, out) array) of a tiny perturbed GPN."""
    config = config or tiny_config()
    state = perturbed_model(config).state_dict()
    return {
        ref_name: np.ascontiguousarray(state[name].numpy().T if transpose else state[name].numpy())
        for ref_name, (name, transpose) in parameter_map(config).items()
    }


def write_pickle(path: Path, params, **extra) -> Path:
    with open(path, "wb") as handle:
        pickle.dump({"params": params, "step": 10, **extra}, handle)
    return path


@dataclass
class Finished:
    """What one `gpn` command run inside a bounded child left behind."""

    returncode: int
    stdout: str
    stderr: str


BOUNDED_PREAMBLE = """
import contextlib, io, json, re, resource, sys, traceback
import gpn_cli, modeling_gpn.conversion.reference, modeling_gpn.data, modeling_gpn.evaluation.runner
import torch; torch.zeros(1) + 1  # start torch's thread pool before the cap
vm = int(re.search(r'VmSize:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) * 1024
cap = vm + int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
"""
BOUNDED_CHILD = (
    BOUNDED_PREAMBLE
    + """
results = []
for args in json.loads(sys.argv[2]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = gpn_cli.main(args)
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 99
    results.append({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps({"cap": cap, "results": results}))
"""
)
CHILD_ENV = {
    "MALLOC_ARENA_MAX": "2",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def run_python_bounded(code: str, margin_bytes: int, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `code` in a child capped like `run_bounded` (it may print; `cap` holds the cap)."""
    return subprocess.run(
        [sys.executable, "-c", BOUNDED_PREAMBLE + code, str(margin_bytes)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **CHILD_ENV},
        cwd=REPO_ROOT,
    )


def run_bounded(commands: list[list[str]], margin_bytes: int, timeout: int = 300) -> tuple[list[Finished], int]:
    """Run each `gpn ARGS` of `commands` in one child process whose address space is capped at its size
    after its imports + `margin_bytes` (one child: imports cost seconds on a busy machine).

    Returns (one `Finished` per command, the cap in bytes)."""
    env = {**os.environ, **CHILD_ENV}
    child = subprocess.run(
        [sys.executable, "-c", BOUNDED_CHILD, str(margin_bytes), json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO_ROOT,
    )
    assert child.returncode == 0, f"the bounded child died ({child.returncode}): {child.stderr[-3000:]}"
    report = json.loads(child.stdout.strip().splitlines()[-1])
    return [Finished(**result) for result in report["results"]], report["cap"]


def assert_one_clear_error(result: Finished | subprocess.CompletedProcess, command: str, *needles: str) -> str:
    """Exit status 1-2, no traceback, no MemoryError, and exactly one `gpn COMMAND:` line naming the problem."""
    output = result.stdout + result.stderr
    assert result.returncode in (1, 2), output
    assert "Traceback" not in output and "MemoryError" not in output, output
    lines = [line for line in result.stderr.splitlines() if line.startswith(f"gpn {command}:")]
    assert len(lines) == 1, output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# The tests below whose fresh processes need nothing of the tests before them (each imports torch and transformers on
# one core): test name (or "bombs", the bomb tests' one child) -> what makes that job's inputs here (in the test
# process: nothing else draws from torch's generator meanwhile) and returns the job, run in the background.
BOMB_TESTS = {
    "test_convert_refuses_resource_bombs_before_allocating",
    "test_convert_under_the_same_bound_still_converts_a_real_checkpoint",
}


@pytest.fixture(scope="module", autouse=True)
def fresh_processes(request, tmp_path_factory) -> Iterator[dict]:
    """The fresh processes of this module's slowest tests (the bombs' bounded child, gpn convert and gpn generate
    in real processes, generate into a closed pipe, the bounded tokenization and perplexity), started two at a
    time in the background from the module's first test on, beside its in-process tests (only the selected
    tests'; subprocesses.started_in_the_background's reason): the suite's time on 2 cores. Each test
    asserts on its job's result as it asserted on the process it ran itself. Name -> future of the job's result."""
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    if selected & BOMB_TESTS:
        selected.add("bombs")
    env = dict(os.environ)  # (taken here: the tests' monkeypatches change os.environ)
    makers: dict[str, Callable[[Path], Callable[[], object]]] = {
        "bombs": _bombs_job,
        "test_convert_malformed_input_in_a_real_process_prints_no_traceback": lambda root: _malformed_convert_job(
            root, env
        ),
        "test_generate_in_a_real_process": lambda root: _generate_job(
            root, request.getfixturevalue("generate_dir"), env
        ),
        "test_generate_into_a_closed_pipe_stops_quietly": lambda root: _closed_pipe_job(
            request.getfixturevalue("generate_dir"), env
        ),
        "test_a_long_document_is_tokenized_in_bounded_memory": lambda root: _long_document_job(
            root, request.getfixturevalue("bpe_tokenizer_dir")
        ),
        "test_fineweb_windows_at_2048_with_a_32k_vocabulary_in_bounded_memory": _fineweb_job,
    }
    with two_at_a_time() as pool:
        started = {}
        for name, make in makers.items():  # (in the order the tests need them; each started once its inputs are made)
            if name in selected:
                with torch.random.fork_rng():  # (the generator as it was, for the tests before those)
                    job = make(tmp_path_factory.mktemp("fresh-process"))
                started[name] = pool.submit(job)
        yield started


# --------------------------------------------------------------------------------------------------
# gpn convert: resource bombs, each under a real memory bound
# --------------------------------------------------------------------------------------------------


def pickle_calling(module: str, name: str, *arg_opcodes: bytes) -> bytes:
    """A protocol-2 pickle of {'params': {'embedding': module.name(*args)}} (each arg one opcode)."""
    return (
        b"\x80\x02}X\x06\x00\x00\x00params}X\x09\x00\x00\x00embedding"
        + f"c{module}\n{name}\n".encode()
        + b"("
        + b"".join(arg_opcodes)
        + b"tRss."
    )


def long1(value: int) -> bytes:
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def tuple_of_ints(*values: int) -> bytes:
    return b"(" + b"".join(long1(v) for v in values) + b"t"


def bytes_bomb(path: Path) -> Path:
    """47 bytes: bytes(3 GiB) through an allowed global."""
    path.write_bytes(pickle_calling("builtins", "bytes", long1(3 * GIB)))
    return path


def shape_claim_bomb(path: Path) -> Path:
    """An embedding reconstructed as a (100M, 32) float32 array (12 GiB) without the data."""
    header = b"cnumpy\nndarray\n" + tuple_of_ints(100_000_000, 32) + b"C\x01b"  # SHORT_BINBYTES b'b'
    path.write_bytes(pickle_calling("numpy.core.multiarray", "_reconstruct", header))
    return path


def claimed_length_bomb(path: Path) -> Path:
    """13 bytes: one BINBYTES8 claiming 3 GiB (the C unpickler allocates it before reading)."""
    path.write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", 3 * GIB) + b"xx")
    return path


def repetition_bomb(path: Path, items: int = 200_000, copies: int = 2_000) -> Path:
    """~400 KB: one memoised list of 200k items, rebuilt as a tuple 2,000 times (3.2 GB of pointers)."""
    body = b"\x80\x02]q\x00(" + b"K\x00" * items + b"e"  # EMPTY_LIST BINPUT 0 MARK BININT1 0 ... APPENDS
    body += b"0cbuiltins\ntuple\nq\x01"  # POP the list (memo keeps it), the global as memo 1
    body += b"}X\x06\x00\x00\x00params]("  # {'params': [ tuple(list) * copies ]}
    body += b"h\x01h\x00\x85R" * copies  # BINGET 1 BINGET 0 TUPLE1 REDUCE
    body += b"es."  # APPENDS SETITEM STOP
    path.write_bytes(body)
    return path


def shared_layers_bomb(path: Path, layers: int = 400) -> Path:
    """A real pickle (~2.5 MB) whose 400 predict layers are one set of arrays: a model of ~1 GB."""
    config = tiny_config(intermediate_size=4096)
    base = reference_params(config)
    params = {name: value for name, value in base.items() if not name.startswith("L0_")}
    for i in range(layers):
        params.update({f"L{i}_{name[3:]}": value for name, value in base.items() if name.startswith("L0_")})
    return write_pickle(path, params)


def npy_header(shape: tuple[int, ...], descr: str = "<f4") -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def zip_bomb_npz(folder: Path, zero_bytes: int = 3 * GIB) -> Path:
    """A valid params.npz (~3 MB) whose embedding member inflates to `zero_bytes` of zeros (CRC included).

    The deflate stream is one block of 16 MiB of zeros repeated (a full flush resets the compressor, so
    every block compresses to the same bytes); the rest are the tiny model's real parameters, stored."""
    folder.mkdir(parents=True, exist_ok=True)
    chunk = 1 << 24
    assert zero_bytes % chunk == 0
    header = npy_header((zero_bytes // (4 * 32), 32))
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = compressor.compress(header) + compressor.flush(zlib.Z_FULL_FLUSH)
    block = compressor.compress(bytes(chunk)) + compressor.flush(zlib.Z_FULL_FLUSH)
    assert block == compressor.compress(bytes(chunk)) + compressor.flush(zlib.Z_FULL_FLUSH)
    last = compressor.flush()
    crc = zlib.crc32(header)
    zeros = bytes(chunk)
    for _ in range(zero_bytes // chunk):
        crc = zlib.crc32(zeros, crc)

    members = []  # (name, data-writer, crc, compressed size, size, method)
    for name, array in reference_params().items():
        if name != "embedding":
            raw = npy_header(array.shape) + array.astype("<f4").tobytes()
            members.append((f"{name}.npy", [raw], zlib.crc32(raw), len(raw), len(raw), 0))
    count = zero_bytes // chunk
    compressed = len(first) + count * len(block) + len(last)
    members.append(("embedding.npy", [first, (block, count), last], crc, compressed, len(header) + zero_bytes, 8))

    central = b""
    with open(folder / "params.npz", "wb") as out:
        for name, pieces, member_crc, csize, size, method in members:
            offset = out.tell()
            local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, method, 0, 0, member_crc, csize, size, len(name), 0)
            out.write(local + name.encode())
            for piece in pieces:
                if isinstance(piece, tuple):
                    for _ in range(piece[1]):
                        out.write(piece[0])
                else:
                    out.write(piece)
            central += (
                struct.pack(
                    "<4s6H3L5H2L",
                    b"PK\x01\x02",
                    20,
                    20,
                    0,
                    method,
                    0,
                    0,
                    member_crc,
                    csize,
                    size,
                    len(name),
                    0,
                    0,
                    0,
                    0,
                    0,
                    offset,
                )
                + name.encode()
            )
        start = out.tell()
        out.write(central)
        out.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members), len(central), start, 0))
    return folder


def large_consistent_npz(folder: Path, vocab: int = 40_000, embedding: int = 1024) -> Path:
    """A stored (uncompressed, 160 MB) params.npz of a model with a large embedding: consistent, no bomb,
    but the conversion needs twice that, more than the bound the test gives it."""
    folder.mkdir(parents=True, exist_ok=True)
    params = reference_params(tiny_config(embedding_size=embedding))
    params["embedding"] = np.zeros((vocab, embedding), dtype=np.float32)
    np.savez(folder / "params.npz", **params)
    return folder


BOMBS = {
    "bytes-of-a-number": (lambda tmp: bytes_bomb(tmp / "checkpoint.pkl"), ["bytes()"]),
    "claimed-shape": (lambda tmp: shape_claim_bomb(tmp / "checkpoint.pkl"), ["(100000000, 32)", "without its data"]),
    "claimed-length": (
        lambda tmp: claimed_length_bomb(tmp / "checkpoint.pkl"),
        ["not a readable reference checkpoint"],
    ),
    "repetition": (lambda tmp: repetition_bomb(tmp / "checkpoint.pkl"), ["builds more than"]),
    "shared-layers": (lambda tmp: shared_layers_bomb(tmp / "checkpoint.pkl"), ["are the same array"]),
    "zip-bomb": (lambda tmp: zip_bomb_npz(tmp / "bomb"), ["zip bomb", "3.00 GiB"]),
    "too-large": (lambda tmp: large_consistent_npz(tmp / "large"), ["needs about", "available"]),
}
BOMB_MARGIN = 256 << 20  # what the child may allocate beyond its imports


def _bombs_job(root: Path) -> Callable[[], tuple]:
    """Every bomb, and then a genuine checkpoint, converted in one child capped at imports + 256 MiB."""
    commands = []
    for case, (make, _needles) in BOMBS.items():
        (root / case).mkdir()
        commands.append(["convert", str(make(root / case)), str(root / case / "out")])
    genuine = write_pickle(root / "genuine.pkl", reference_params(), opt_state={"count": np.int32(10)})
    commands.append(["convert", str(genuine), str(root / "genuine-out")])

    def job() -> tuple:
        finished, cap = run_bounded(commands, BOMB_MARGIN)
        return root, dict(zip([*BOMBS, "genuine"], finished)), cap

    return job


@pytest.fixture(scope="module")
def bomb_runs(fresh_processes):
    """Every bomb, and then a genuine checkpoint, converted in one child capped at imports + 256 MiB (`_bombs_job`,
    started in the background): (its folder, command -> what it left, the cap)."""
    return fresh_processes["bombs"].result()


@pytest.mark.parametrize("case", list(BOMBS))
def test_convert_refuses_resource_bombs_before_allocating(bomb_runs, case):
    root, finished, _cap = bomb_runs
    source = root / case
    assert_one_clear_error(finished[case], "convert", *BOMBS[case][1])
    assert not (source / "out").exists()


def test_the_memory_check_without_proc_or_resource_asks_psutil(monkeypatch):
    """Where there is no /proc/meminfo (macOS, Windows) the bombs' memory check asked nothing and let them
    allocate; there it asks psutil, and without the resource module (Windows) it skips RLIMIT_AS, not the check."""
    import psutil

    from modeling_gpn.conversion import reference

    monkeypatch.setattr(reference, "resource", None)
    real_read_text = Path.read_text

    def no_proc(path: Path, *args, **kwargs) -> str:
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", no_proc)
    available = reference.available_memory()
    assert available is not None and abs(available - psutil.virtual_memory().available) < 2**30, available


def test_convert_under_the_same_bound_still_converts_a_real_checkpoint(bomb_runs):
    """The bound is not what refuses the bombs: a genuine checkpoint converts under it, exactly."""
    root, finished, _cap = bomb_runs
    assert finished["genuine"].returncode == 0, finished["genuine"].stderr
    from modeling_gpn import GPNForCausalLM

    converted = GPNForCausalLM.from_pretrained(root / "genuine-out")
    original = perturbed_model(tiny_config())
    for name, tensor in original.state_dict().items():
        assert torch.equal(converted.state_dict()[name], tensor), name


# --------------------------------------------------------------------------------------------------
# gpn convert: every malformed input gets one clear line
# --------------------------------------------------------------------------------------------------


def _npz_folder(tmp: Path, params=None, config_text: str | None = None) -> Path:
    folder = tmp / "ref"
    folder.mkdir()
    np.savez(folder / "params.npz", **(params if params is not None else reference_params()))
    if config_text is not None:
        (folder / "config.json").write_text(config_text)
    return folder


def _truncated(path: Path, keep: float) -> Path:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])
    return path


def _with(params: dict, **changes) -> dict:
    return {**params, **changes}


def _refilled(name: str, fill, dtype) -> dict:
    """The tiny model's parameters with `name` replaced by an array of its shape filled with `fill`."""
    params = reference_params()
    return {**params, name: np.full(params[name].shape, fill, dtype=dtype)}


def _write(path: Path, data: bytes | str) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def _fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "checkpoint.pkl")
    return tmp / "checkpoint.pkl"


MALFORMED = {
    "truncated-pickle": (
        lambda t: _truncated(write_pickle(t / "c.pkl", reference_params()), 0.5),
        "not a readable reference checkpoint",
    ),
    "empty-file": (lambda t: _write(t / "c.pkl", b""), "not a readable reference checkpoint: it is empty"),
    "text-file": (
        lambda t: _write(t / "c.pkl", "hello\n"),
        "it does not begin as the reference's pickles do (it begins b'hello",
    ),
    "truncated-npz": (lambda t: _truncated(_npz_folder(t) / "params.npz", 0.6).parent, "not a readable npz"),
    "npz-not-a-zip": (lambda t: _write(t / "params.npz", "hello").parent, "not a readable npz"),
    "pickle-without-params": (lambda t: _write(t / "c.pkl", pickle.dumps({"step": 1})), "no 'params' entry"),
    "pickle-of-a-list": (lambda t: _write(t / "c.pkl", pickle.dumps([1, 2])), "no 'params' entry"),
    "string-parameter": (lambda t: write_pickle(t / "c.pkl", _with(reference_params(), embedding="oops")), "is a str"),
    "params-a-list": (lambda t: write_pickle(t / "c.pkl", [np.zeros(3)]), "is a list"),
    "missing-parameters": (
        lambda t: write_pickle(t / "c.pkl", {k: v for k, v in reference_params().items() if k != "write_W_v_k"}),
        "missing parameters: write_W_v_k",
    ),
    "nan-parameter": (
        lambda t: write_pickle(t / "c.pkl", _refilled("fg_gate_b", np.nan, np.float32)),
        "fg_gate_b: contains NaN or inf",
    ),
    "integer-parameter": (
        lambda t: write_pickle(t / "c.pkl", _refilled("fuse_norm_w", 1, np.int64)),
        "not floating point",
    ),
    "object-array": (
        lambda t: write_pickle(t / "c.pkl", _refilled("fuse_norm_w", None, object)),
        "its pickle has dtype object, not a plain numeric dtype",
    ),
    "embedding-wrong-rank": (
        lambda t: write_pickle(t / "c.pkl", _with(reference_params(), embedding=np.zeros(5, np.float32))),
        "embedding has shape (5,)",
    ),
    "zero-heads": (
        lambda t: write_pickle(t / "c.pkl", _with(reference_params(), write_A_log=np.zeros(0, np.float32))),
        "Cannot infer",
    ),
    "folder-without-params": (lambda t: t, "has neither params.npz nor checkpoint.pkl"),
    "missing-path": (lambda t: t / "nowhere.pkl", "does not exist"),
    "fifo-not-a-file": (_fifo, "not a regular file"),
    "config-json-malformed": (lambda t: _npz_folder(t, config_text="{not json"), "not valid JSON"),
    "config-json-a-list": (lambda t: _npz_folder(t, config_text="[1, 2]"), "not a JSON object"),
    "config-json-disagrees": (lambda t: _npz_folder(t, config_text='{"d_state": 64}'), "d_state=64"),
    "npz-extra-member": (
        lambda t: _npz_folder(t, params=_with(reference_params(), **{"notes": np.zeros(2, np.float32)})),
        "unexpected parameters: notes",
    ),
    "npz-object-member": (
        lambda t: _npz_folder(t, params=_refilled("fuse_norm_w", None, object)),
        "not a plain numeric dtype",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_convert_answers_every_malformed_input_with_one_clear_line(tmp_path, capsys, case):
    make, needle = MALFORMED[case]
    source = make(tmp_path)
    code = gpn_main(["convert", str(source), str(tmp_path / "out")])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 1, captured
    assert len(lines) == 1 and lines[0].startswith("gpn convert: "), lines
    assert needle in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def _malformed_convert_job(root: Path, env: dict[str, str]) -> Callable[[], subprocess.CompletedProcess]:
    source = _truncated(write_pickle(root / "c.pkl", reference_params()), 0.5)
    command = [sys.executable, "-m", "gpn_cli", "convert", str(source), str(root / "out")]
    return lambda: subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=env)


def test_convert_malformed_input_in_a_real_process_prints_no_traceback(fresh_processes, request):
    """`gpn convert` of a truncated checkpoint in a real process (`_malformed_convert_job`): one line, no traceback."""
    result = fresh_processes[request.node.originalname].result()
    assert_one_clear_error(result, "convert", "not a readable reference checkpoint")


def test_convert_output_that_is_a_file_is_a_clear_error(tmp_path, capsys):
    source = write_pickle(tmp_path / "c.pkl", reference_params())
    (tmp_path / "out").write_text("not a folder")
    assert gpn_main(["convert", str(source), str(tmp_path / "out")]) == 1
    assert "is a file, not a folder" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# gpn generate: bad arguments are one clear line
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generate_dir(tmp_path_factory):
    """A tiny GPN folder with its own byte-level BPE tokenizer (no shared files needed)."""
    from modeling_gpn.data import train_bpe_tokenizer

    folder = tmp_path_factory.mktemp("generate")
    tokenizer = train_bpe_tokenizer(["the cat sat on the mat. " * 20, "to be or not to be " * 20], 300)
    tokenizer.save_pretrained(folder)
    perturbed_model(tiny_config(vocab_size=len(tokenizer))).save_pretrained(folder)
    return folder


GENERATE_BAD = {
    "missing-folder": (["./no/such/model", "hi"], "model folder ./no/such/model does not exist"),
    "folder-without-config": (["{tmp}", "hi"], "is not a model folder: it has no config.json"),
    "zero-new-tokens": (["{model}", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    "negative-new-tokens": (["{model}", "hi", "--max-new-tokens", "-3"], "--max-new-tokens must be at least 1"),
    "empty-prompt": (["{model}", "hi", ""], "prompt 2 is empty"),
    "blank-prompt": (["{model}", "   "], "prompt 1 is empty"),
    "temperature-without-sample": (
        ["{model}", "hi", "--temperature", "0.5"],
        "--temperature only applies with --sample",
    ),
    "top-p-without-sample": (
        ["{model}", "hi", "--top-p", "0.5", "--num-beams", "2"],
        "--top-p only applies with --sample",
    ),
    "zero-temperature": (["{model}", "hi", "--sample", "--temperature", "0"], "--temperature must be > 0"),
    "infinite-temperature": (["{model}", "hi", "--sample", "--temperature", "inf"], "must be > 0 and finite, got inf"),
    "negative-seed": (["{model}", "hi", "--seed", "-1"], "--seed must be >= 0 and below 2**64"),
    "huge-seed": (["{model}", "hi", "--seed", str(2**64)], "--seed must be >= 0 and below 2**64"),
    "top-p-above-one": (["{model}", "hi", "--sample", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    "zero-beams": (["{model}", "hi", "--num-beams", "0"], "--num-beams must be at least 1"),
    "bad-device": (["{model}", "hi", "--device", "toaster"], "is not a torch device"),
    "absent-device": (["{model}", "hi", "--device", "mps"], "--device mps asks for mps, which this machine does not"),
    "missing-tokenizer": (["{model}", "hi", "--tokenizer", "{tmp}/nowhere"], "/nowhere does not exist"),
    "model-without-tokenizer": (["{small_model}", "hi"], "small holds no tokenizer (none of tokenizer.json"),
    "foreign-tokenizer": (["{small_model}", "hello there", "--tokenizer", "{model}"], "outside the model's vocabulary"),
    # a config.json of more layers than the weights hold: transformers drew the missing ones at random
    "weights-short-of-config": (["{grown_model}", "hi"], "does not match its config.json: its weights lack model."),
    # an unsharded save, then a sharded one into the same folder: transformers loaded the first, in silence
    "stale-weights-beside-shards": (
        ["{resaved_model}", "hi"],
        "holds both model.safetensors and the shards its model.safetensors.index.json names (model-0000",
    ),
    # a weight holding NaN: the same token over and over, as if generated
    "nan-weights": (["{nan_model}", "hi"], "has parameters holding NaN or inf (loaded as torch.float32): model."),
    # a weight of 1e5, finite as saved, inf once cast to float16: refused as gpn eval --dtype float16 refuses it
    "float16-overflow": (
        ["{big_model}", "hi", "--dtype", "float16"],
        "(loaded as torch.float16): model.fuse_gate.weight; nothing computed from them would mean anything; float16's "
        "largest value is 65504",
    ),
}


@pytest.mark.parametrize("case", sorted(GENERATE_BAD))
def test_generate_bad_arguments_are_one_clear_line(generate_dir, tmp_path, capsys, case):
    args, needle = GENERATE_BAD[case]
    if "{small_model}" in args:  # a model of 97 tokens, given the 257+ token tokenizer
        perturbed_model(tiny_config(vocab_size=97)).save_pretrained(tmp_path / "small")
    if "{grown_model}" in args:
        shutil.copytree(generate_dir, tmp_path / "grown")
        config = json.loads((tmp_path / "grown" / "config.json").read_text())
        config["num_predict_layers"] += 1
        (tmp_path / "grown" / "config.json").write_text(json.dumps(config))
    if "{nan_model}" in args:
        copy_with_a_nan_weight(generate_dir, tmp_path / "nan")
    if "{resaved_model}" in args:
        shutil.copytree(generate_dir, tmp_path / "resaved")
        from modeling_gpn import GPNConfig

        perturbed_model(GPNConfig.from_pretrained(generate_dir), seed=9).save_pretrained(
            tmp_path / "resaved", max_shard_size="20KB"
        )
    if "{big_model}" in args:
        copy_with_a_nan_weight(generate_dir, tmp_path / "big", value=1e5)
    folders = dict(small_model=tmp_path / "small", grown_model=tmp_path / "grown", nan_model=tmp_path / "nan")
    folders.update(big_model=tmp_path / "big", resaved_model=tmp_path / "resaved")
    args = [a.format(model=generate_dir, tmp=tmp_path, **folders) for a in args]
    code = gpn_main(["generate", *args])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("gpn generate:")]
    assert code in (1, 2), captured
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert needle in lines[0], lines[0]
    assert captured.out == ""


def test_pickled_weights_beside_model_safetensors_are_never_what_gpn_loads(tmp_path):
    """A pytorch_model.bin beside model.safetensors (an older save's: transformers 5 saves safetensors only) is left
    alone, not refused (docs/generate.md says why): gpn loads model.safetensors, as transformers' resolution does
    by default; only `use_safetensors=False`, which asks for the pickle, reads it."""
    from transformers import AutoModelForCausalLM

    from modeling_gpn.cli.loading import causal_lm_from_pretrained

    config = tiny_config()
    saved, pickled = perturbed_model(config, seed=1), perturbed_model(config, seed=2)
    saved.save_pretrained(tmp_path)
    torch.save(pickled.state_dict(), tmp_path / "pytorch_model.bin")
    loaded = causal_lm_from_pretrained(str(tmp_path)).state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in saved.state_dict().items())
    asked = AutoModelForCausalLM.from_pretrained(tmp_path, use_safetensors=False).state_dict()
    assert all(torch.equal(asked[name], tensor) for name, tensor in pickled.state_dict().items())


@pytest.mark.parametrize("command", ["generate", "convert", "inspect", "eval"])
def test_a_missing_tokenizer_folder_is_named_not_taken_for_a_hub_id(generate_dir, command, tmp_path, capsys):
    """`--tokenizer ./no/such` ended in transformers' "Repo id must be in the form 'repo_name'..." (or a traceback):
    a path that cannot be a Hub id and does not exist is named as a missing folder, by every command."""
    source = write_pickle(tmp_path / "c.pkl", reference_params())
    arguments = {
        "generate": [str(generate_dir), "hi"],
        "convert": [str(source), str(tmp_path / "out")],
        "inspect": [str(generate_dir), "--output", str(tmp_path / "report")],
        "eval": [str(generate_dir), "--output-dir", str(tmp_path / "report")],
    }[command]
    gpn_main([command, *arguments, "--tokenizer", "./no/such/tokenizer"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"gpn {command}:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].endswith("tokenizer folder ./no/such/tokenizer does not exist"), lines[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "report").exists()


@pytest.mark.parametrize("command", ["generate", "inspect", "eval"])
def test_a_model_from_home_loads_and_an_id_neither_here_nor_cached_offline_names_both(
    generate_dir, command, tmp_path, monkeypatch, capsys
):
    """A quoted "~/model" (the shell expands only an unquoted one) passed the model check, which expands it, then
    failed in transformers as a malformed Hub id. `owner/name` that is no folder here, offline (HF_HUB_OFFLINE=1)
    and not in the Hub cache, was refused as a network fault ("We couldn't connect to 'https://huggingface.co'")
    only: the error names the folder it looked for and the cache, before the --output folder is made."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    kernels = os.environ.get("GPN_KERNEL_CACHE") or str(Path.home() / ".cache" / "gpn" / "kernels")
    monkeypatch.setenv("GPN_KERNEL_CACHE", kernels)  # (the C kernels built, not built again under the new home)
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(generate_dir, tmp_path / "my model")
    monkeypatch.chdir(tmp_path)
    report = ["--output", str(tmp_path / "report")] if command != "generate" else ["hi", "--max-new-tokens", "1"]
    if command == "generate":  # (the other two run long: the missing model is refused before anything loads)
        assert gpn_main(["generate", "~/my model", *report, "--save-state", "~/s.safetensors"]) == 0
        assert (tmp_path / "s.safetensors").is_file(), capsys.readouterr().err
        capsys.readouterr()
    gpn_main([command, "nobody/no-such-model", *report])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"gpn {command}:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].endswith(
        f"nobody/no-such-model is neither a folder here (in {tmp_path}) nor a Hub repo in the local cache, and "
        "HF_HUB_OFFLINE=1 keeps the Hub from being asked: give the folder's path, or download the repo first "
        "(without HF_HUB_OFFLINE)"
    ), lines[0]
    assert not (tmp_path / "report").exists()


def test_load_tokenizer_names_a_missing_local_path_and_passes_a_hub_id(tmp_path):
    from modeling_gpn.data import DataError, load_tokenizer

    for path in ("./nowhere", "/no/such", "~/no-such-tokenizer-here", "a/b/c"):
        with pytest.raises(DataError, match=f"^tokenizer folder {path} does not exist$"):
            load_tokenizer(path)
    with pytest.raises(DataError) as hub:  # offline and not in the cache: both readings named, not a network fault
        load_tokenizer("no-such-owner/no-such-tokenizer")
    assert str(hub.value).startswith(
        "Cannot load tokenizer 'no-such-owner/no-such-tokenizer': it is neither a folder here (in "
    ) and str(hub.value).endswith(
        "nor a Hub repo in the local cache, and HF_HUB_OFFLINE=1 keeps the Hub from being "
        "asked: give the folder's path, or download the repo first (without HF_HUB_OFFLINE)"
    )


def test_generate_unparsable_number_is_argparse_usage_not_a_traceback(generate_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpn_main(["generate", str(generate_dir), "hi", "--max-new-tokens", "many"])
    assert exit_info.value.code == 2
    assert "gpn generate: error: argument --max-new-tokens: invalid int value: 'many'" in capsys.readouterr().err


def _generate_job(root: Path, generate_dir: Path, env: dict[str, str]) -> Callable[[], tuple]:
    command = [sys.executable, "-m", "gpn_cli", "generate"]
    arguments = {
        "bad": [str(root / "nowhere"), "hi"],
        "good": [str(generate_dir), "the cat", "to be", "--max-new-tokens", "5", "--device", "cpu"],
    }
    return lambda: tuple(
        subprocess.run([*command, *argv], capture_output=True, text=True, cwd=REPO_ROOT, env=env)
        for argv in arguments.values()
    )


def test_generate_in_a_real_process(fresh_processes, request):
    """The real console entry: a bad path is one line and exit 2; good arguments still generate (`_generate_job`)."""
    bad, good = fresh_processes[request.node.originalname].result()
    assert_one_clear_error(bad, "generate", "does not exist")
    assert good.returncode == 0, good.stderr
    assert good.stdout.count("-" * 40) == 2 and good.stdout.startswith("the cat")


def test_generate_ctrl_c_is_one_line_and_the_shells_status(generate_dir, monkeypatch, capsys):
    """Ctrl-C in the middle of generate() was a 30-line traceback ending in KeyboardInterrupt, exit status 1:
    it is one line and 130, the status a shell gives a command ended by SIGINT."""
    from modeling_gpn import GPNForCausalLM

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(GPNForCausalLM, "generate", interrupted)
    try:
        code = gpn_main(["generate", str(generate_dir), "the cat", "--max-new-tokens", "3", "--device", "cpu"])
    except KeyboardInterrupt:  # (caught here, or it would stop the whole test run)
        pytest.fail("Ctrl-C escaped `gpn generate` (a traceback for a user)")
    captured = capsys.readouterr()
    assert code == 130 and captured.out == "", captured
    assert "Traceback" not in captured.err and captured.err.strip().endswith("gpn generate: interrupted (Ctrl-C)")


def _closed_pipe_job(generate_dir: Path, env: dict[str, str]) -> Callable[[], subprocess.CompletedProcess]:
    env = {name: value for name, value in env.items() if name != "PYTHONUNBUFFERED"}

    def job() -> subprocess.CompletedProcess:
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader has gone before anything is printed
        try:
            return subprocess.run(
                [sys.executable, "-m", "gpn_cli", "generate", str(generate_dir), "the cat", "to be"]
                + ["--max-new-tokens", "3", "--device", "cpu"],
                stdout=write_end,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO_ROOT,
                env=env,
            )
        finally:
            os.close(write_end)

    return job


def test_generate_into_a_closed_pipe_stops_quietly(fresh_processes, request):
    """`gpn generate ... | head -c 10`: the reader gone, printing the texts raised BrokenPipeError with a
    traceback (exit status 1). It stops without one, with the status of a command ended by SIGPIPE. (Standard
    output buffered, as a user's is: with PYTHONUNBUFFERED=1, set where the tests ran, Python's "Exception
    ignored ... BrokenPipeError" at exit, status 120, could not show.) Run by `_closed_pipe_job`."""
    result = fresh_processes[request.node.originalname].result()
    assert result.returncode == 141, result.stderr
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr


# --------------------------------------------------------------------------------------------------
# Tokenizing one long document: pieces, exact tokens, bounded memory
# --------------------------------------------------------------------------------------------------


def tricky_text(min_chars: int) -> str:
    """Real prose (the Shakespeare plays) with every kind of line start a cut could meet: indented lines,
    tabs, runs of blank lines, lines of spaces, CRLF endings, non-ASCII letters and symbols."""
    from modeling_gpn.data import shakespeare_documents

    plays = []
    for index, play in enumerate(shakespeare_documents()):
        lines = play.splitlines(keepends=True)
        for i in range(0, len(lines), 7):
            lines[i] = ["  ", "\t", "   \n", "\n\n\n", "Ünïcödé — ", "😀 ", "\r\n", "'s "][(i + index) % 8] + lines[i]
        plays.append("".join(lines))
        if sum(map(len, plays)) >= min_chars:
            break
    return "".join(plays)


@pytest.fixture(scope="module")
def bpe_tokenizer_dir(tmp_path_factory):
    from modeling_gpn.data import train_bpe_tokenizer

    folder = tmp_path_factory.mktemp("bpe")
    train_bpe_tokenizer([tricky_text(300_000)], 1000).save_pretrained(folder)
    return folder


def whole_and_streamed_tokens(tokenizer, text: str, tmp_path: Path, monkeypatch) -> tuple[list[int], list[int]]:
    from modeling_gpn import data

    path = tmp_path / "one-document.txt"
    path.write_bytes(text.encode("utf-8"))
    whole_text = path.read_text(encoding="utf-8")  # universal newlines, as datasets' text builder reads it
    monkeypatch.setattr(data.corpus, "PIECE_CHARS", 2_000)  # many cuts in a small file
    stream = data.build_token_stream(
        data.CorpusSpec(source=str(path)), tokenizer, cache_dir=tmp_path / "cache", show_progress=False
    )
    whole = tokenizer(whole_text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return whole, stream.tokens(0, len(stream)).tolist()


def test_streamed_tokens_equal_whole_document_tokens_byte_level_bpe(bpe_tokenizer_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from modeling_gpn import data

    text = tricky_text(200_000)
    cuts = []
    original = data.text_file_pieces
    monkeypatch.setattr(data.corpus, "text_file_pieces", lambda *a: (cuts.append(p) or p for p in original(*a)))
    whole, streamed = whole_and_streamed_tokens(
        AutoTokenizer.from_pretrained(bpe_tokenizer_dir), text, tmp_path, monkeypatch
    )
    assert len(cuts) > 50  # the document really was cut
    assert streamed == whole


def test_streamed_tokens_equal_whole_document_tokens_llama(tmp_path, monkeypatch):
    """SentencePiece marks the start of a text with '▁': a piece is encoded after a line break, whose
    tokens are dropped, so it is tokenized as it is mid-document."""
    from transformers import AutoTokenizer

    from ..environment import require_shared

    tokenizer = AutoTokenizer.from_pretrained(require_shared("data/llama2-tokenizer"))
    whole, streamed = whole_and_streamed_tokens(tokenizer, tricky_text(100_000), tmp_path, monkeypatch)
    assert streamed == whole


def _long_document_job(tmp_path: Path, bpe_tokenizer_dir: Path) -> Callable[[], subprocess.CompletedProcess]:
    text = tricky_text(1_000_000)
    path = tmp_path / "big.txt"
    with open(path, "w", encoding="utf-8") as out:
        while out.tell() < 5_000_000:
            out.write(text)
    code = f"""
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained({str(bpe_tokenizer_dir)!r})
corpus = modeling_gpn.data.CorpusSpec(source={str(path)!r})
stream = modeling_gpn.data.build_token_stream(corpus, tokenizer, cache_dir={str(tmp_path / "cache")!r}, show_progress=False)
print("TOKENS", len(stream), stream.meta["documents"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
    return lambda: run_python_bounded(code, margin_bytes=400 << 20)


def test_a_long_document_is_tokenized_in_bounded_memory(fresh_processes, request):
    """5 MB in one .txt file, tokenized under a cap of imports + 400 MiB (`_long_document_job`). Measured (peak RSS
    over the imports, same tokenizer): the old code took +674 MB for 5 MB and +3,045 MB for 20 MB (~150x the
    file); now +135 MB and +145 MB, flat in the file's size."""
    result = fresh_processes[request.node.originalname].result()
    assert result.returncode == 0, result.stderr[-3000:]
    tokens, documents = map(int, result.stdout.split("TOKENS")[1].split()[:2])
    assert documents == 1 and tokens > 1_000_000


# --------------------------------------------------------------------------------------------------
# A damaged token cache names the file and how to rebuild
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def small_cache(bpe_tokenizer_dir, tmp_path, monkeypatch):
    """A token cache of three shards (of 20,000 tokens) for a small text file."""
    from transformers import AutoTokenizer

    from modeling_gpn import data

    monkeypatch.setattr(data.stream, "SHARD_TOKENS", 20_000)
    path = tmp_path / "corpus.txt"
    path.write_text(tricky_text(150_000), encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(bpe_tokenizer_dir)
    corpus = data.CorpusSpec(source=str(path))
    stream = data.build_token_stream(corpus, tokenizer, cache_dir=tmp_path / "cache", show_progress=False)
    assert len(stream.shards) >= 3
    return lambda: data.build_token_stream(
        corpus, tokenizer, cache_dir=tmp_path / "cache", show_progress=False
    ), stream.folder


def _damage(folder: Path, how: str) -> Path:
    shard = folder / "tokens-00001.bin"
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-1001])
    elif how == "grown":
        shard.write_bytes(shard.read_bytes() + b"\0\0")
    elif how == "missing":
        shard.unlink()
    elif how == "overwritten":  # right size, bytes of something else
        shard.write_bytes(b"\xff" * shard.stat().st_size)
    elif how == "zeroed":  # right size, every id one the tokenizer has (a block a crash lost reads as zeros)
        shard.write_bytes(b"\0" * shard.stat().st_size)
    elif how == "bad-meta":
        shard = folder / "meta.json"
        shard.write_text(shard.read_text()[:50])
    elif how == "another-tokenizer":  # the files of a cache another tokenizer wrote, put in this one's place
        shard = folder / "meta.json"
        shard.write_text(json.dumps({**json.loads(shard.read_text()), "tokenizer": "0" * 16}))
    return shard


@pytest.mark.parametrize(
    "how", ["truncated", "grown", "missing", "overwritten", "zeroed", "bad-meta", "another-tokenizer"]
)
def test_a_damaged_token_cache_names_the_file_and_how_to_rebuild(small_cache, how):
    from modeling_gpn.data import DataError, WindowDataset

    reopen, folder = small_cache
    damaged = _damage(folder, how)
    with pytest.raises(DataError) as error:
        stream = reopen()
        dataset = WindowDataset(stream, 64, 0.1, seed=0)
        for index in range(dataset.num_train):
            dataset.window(index)
    message = str(error.value)
    assert str(damaged) in message and f"delete the folder {folder}" in message, message
    assert shutil_rmtree_and_rebuild(reopen, folder)


def shutil_rmtree_and_rebuild(reopen, folder: Path) -> bool:
    """What the message says to do works: delete the folder, run again."""
    import shutil

    shutil.rmtree(folder)
    stream = reopen()
    return not stream.reused and len(stream) > 0


def test_a_corpus_rewritten_with_its_old_mtime_is_tokenized_anew(bpe_tokenizer_dir, tmp_path):
    """`cp -p`, `rsync -a` or `touch -r` give a rewritten file its old modification time: a same-size edit
    then kept its old cache key, and training read the old file's tokens (measured: 21,931 cached tokens
    for a file whose tokens are now 23,168)."""
    from transformers import AutoTokenizer

    from modeling_gpn import data

    tokenizer = AutoTokenizer.from_pretrained(bpe_tokenizer_dir)
    path = tmp_path / "corpus.txt"
    path.write_text("the cat sat on the mat\n" * 200, encoding="utf-8")
    corpus = data.CorpusSpec(source=str(path))
    first = data.build_token_stream(corpus, tokenizer, cache_dir=tmp_path / "cache", show_progress=False)
    old = path.stat()
    path.write_text("THE CAT SAT ON THE MAT\n" * 200, encoding="utf-8")  # same size
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))  # what cp -p / touch -r do
    assert path.stat().st_size == old.st_size and path.stat().st_mtime_ns == old.st_mtime_ns
    second = data.build_token_stream(corpus, tokenizer, cache_dir=tmp_path / "cache", show_progress=False)
    expected = tokenizer(path.read_text(), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert not second.reused and second.folder != first.folder
    assert second.tokens(0, len(second)).tolist() == expected


def test_a_corpus_folder_leaves_out_hidden_and_special_folders(bpe_tokenizer_dir, tmp_path):
    """Jupyter keeps a copy of every file it opened in `.ipynb_checkpoints/`, a macOS zip a binary `._NAME` for
    each in `__MACOSX/`: they were read as corpus files (the corpus trained twice: 65,792 tokens for a folder
    of 43,861), or failed the run as not UTF-8. Left out, as `datasets` leaves them out of a data folder."""
    from transformers import AutoTokenizer

    from modeling_gpn import data

    folder = tmp_path / "corpus"
    (folder / ".ipynb_checkpoints").mkdir(parents=True)
    (folder / "__MACOSX" / "sub").mkdir(parents=True)
    (folder / "sub").mkdir()
    text = "the cat sat on the mat\n" * 50
    (folder / "sub" / "plays.txt").write_text(text, encoding="utf-8")
    (folder / ".ipynb_checkpoints" / "plays-checkpoint.txt").write_text(text, encoding="utf-8")
    (folder / "__MACOSX" / "sub" / "._plays.txt").write_bytes(b"\x00\x05\x16\x07\xff" * 20)
    corpus = data.CorpusSpec(source=str(folder))
    assert corpus.local_files() == [folder / "sub" / "plays.txt"]
    stream = data.build_token_stream(corpus, AutoTokenizer.from_pretrained(bpe_tokenizer_dir), tmp_path / "cache")
    assert stream.meta["documents"] == 1 and corpus.describe() == f"1 local file in {folder}"


def test_a_dataset_glob_reads_the_files_it_matches(bpe_tokenizer_dir, tmp_path, monkeypatch):
    """`--dataset 'shards/*.jsonl'` (as gpn inspect --data takes it) was taken for a Hub id: offline, 'Cannot
    load Hub dataset 'shards/*.jsonl' ... OfflineModeIsEnabled', for files that are right there."""
    from transformers import AutoTokenizer

    from modeling_gpn import data

    shards = tmp_path / "shards"
    shards.mkdir()
    for index in range(3):
        (shards / f"part-{index}.jsonl").write_text(json.dumps({"text": f"document {index} " * 30}) + "\n")
    (shards / "notes.md").write_text("not a corpus")
    monkeypatch.chdir(tmp_path)  # a relative pattern, as typed
    corpus = data.CorpusSpec(source="shards/part-*.jsonl")
    assert corpus.kind == "local" and corpus.local_files() == sorted(Path("shards").glob("*.jsonl"))
    stream = data.build_token_stream(corpus, AutoTokenizer.from_pretrained(bpe_tokenizer_dir), tmp_path / "cache")
    assert stream.meta["documents"] == 3
    with pytest.raises(data.DataError, match=r"No training file matches '.*/n\*' .*1 other files match"):
        data.CorpusSpec(source="shards/n*").local_files()  # only notes.md


def test_a_dataset_glob_leaves_out_what_a_folder_leaves_out_unless_it_names_it(tmp_path, monkeypatch):
    """A folder's `.*` and `__*` files and folders are left out (macOS zips' `__MACOSX/` copies); a glob read the
    `__*` ones its wildcards matched (Python's glob skips only `.*`): `'data/**/*.txt'` read `__MACOSX/` twice."""
    from modeling_gpn import data

    for name in ("data/sub/plays.txt", "data/__MACOSX/sub/plays.txt", "data/.ipynb_checkpoints/plays.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("the cat sat on the mat\n")
    # A link back up (a loop) or a second link to a file reads it once, not once per level of the loop.
    (tmp_path / "data" / "sub" / "loop").symlink_to("..")
    (tmp_path / "data" / "sub" / "same.txt").symlink_to("plays.txt")
    monkeypatch.chdir(tmp_path)
    assert data.CorpusSpec(source="data/**/*.txt").local_files() == [Path("data/sub/plays.txt")]
    assert data.CorpusSpec(source="data").local_files() == [Path("data/sub/plays.txt")]  # (the folder)
    # named by the pattern itself, as Python's glob matches `.*` for a pattern part that starts with a dot
    assert data.CorpusSpec(source="data/__MACOSX/*/*.txt").local_files() == [Path("data/__MACOSX/sub/plays.txt")]
    assert data.CorpusSpec(source="data/__*/*/*.txt").local_files() == [Path("data/__MACOSX/sub/plays.txt")]


def test_a_hub_dataset_is_cached_per_commit_and_read_at_that_commit(bpe_tokenizer_dir, tmp_path, monkeypatch):
    """The token cache of a Hub dataset was keyed by its name, configuration and split alone: a dataset updated
    on the Hub kept handing out the old tokens, and no revision could be asked for. The commit the revision asked
    for names (here from a local dataset repository in the Hugging Face cache's layout, offline) keys the cache,
    and the rows are read at that commit, not at whatever the branch holds by the time they are streamed."""
    import datasets
    import huggingface_hub
    from transformers import AutoTokenizer

    from modeling_gpn import data

    repo = tmp_path / "hub" / "datasets--someone--corpus"

    def publish(ref: str, commit: str) -> None:  # what a download of the dataset card at `ref` leaves
        (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
        (repo / "snapshots" / commit / "README.md").write_text("---\nlicense: mit\n---\n")
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    read_at = []

    def load_dataset(name, config=None, *, split, streaming, revision=None):
        read_at.append(revision)
        return [{"text": f"the rows of {name} at commit {revision} " * 20}]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    tokenizer = AutoTokenizer.from_pretrained(bpe_tokenizer_dir)
    old, new = "a" * 40, "b" * 40
    publish("main", old)
    publish("v2", new)

    def stream(revision=None):
        corpus = data.CorpusSpec(source="someone/corpus", config_name=None, revision=revision)
        return data.build_token_stream(corpus, tokenizer, tmp_path / "cache", show_progress=False)

    first = stream()
    assert read_at == [old] and not first.reused
    assert stream().folder == first.folder and read_at == [old]  # (reused)
    pinned = stream("v2")  # another revision asked for: another cache, read at its commit
    assert pinned.folder != first.folder and read_at == [old, new]
    publish("main", new)  # the dataset updated on the Hub
    updated = stream()
    assert updated.folder not in (first.folder, pinned.folder) and not updated.reused and read_at == [old, new, new]
    assert data.CorpusSpec(source="someone/corpus", revision=old).fingerprint()["commit"] == old
    unresolved = [data.CorpusSpec(source="someone/corpus", revision=r).fingerprint() for r in ("v3", "v4")]
    assert unresolved[0]["commit"] is None and unresolved[0] != unresolved[1]  # (keyed by the revision asked for)

    # HF_DATASETS_OFFLINE=1 alone (the Hub client online): the commit is found in the cache, the Hub never asked
    # (which it was, retried for about half a minute before the load's own offline error)
    asked_the_hub = []
    download = huggingface_hub.hf_hub_download

    def cache_only_download(*args, local_files_only=False, **kwargs):
        if not local_files_only:
            asked_the_hub.append(args)
            raise OSError("no network in this test")
        return download(*args, local_files_only=True, **kwargs)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", cache_only_download)
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", lambda *a, **k: asked_the_hub.append(a))
    assert data.CorpusSpec(source="someone/corpus", revision="v2").hub_commit() == new
    assert data.CorpusSpec(source="someone/corpus", revision="v3").hub_commit() is None and not asked_the_hub
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    # a stream that breaks while it is read (a connection reset: an OSError) is named as the dataset's failure, not
    # blamed on the cache folder the tokens were going to, and leaves no cache behind
    def broken_stream(*args, **kwargs):
        yield {"text": "the first row " * 20}
        raise ConnectionError("Connection reset by peer")

    monkeypatch.setattr(datasets, "load_dataset", broken_stream)
    with pytest.raises(data.DataError, match=r"^Reading Hub dataset 'someone/corpus' failed after 1 rows: Connection"):
        stream("v3")
    assert not list((tmp_path / "cache" / "tokens").glob(".*tmp*"))

    # a row without text is named by its number, as a local file's is (it was skipped in silence)
    def null_row(*args, **kwargs):
        yield from ({"text": "the first row " * 20}, {"text": None})

    monkeypatch.setattr(datasets, "load_dataset", null_row)
    with pytest.raises(data.DataError, match=r"^Hub dataset 'someone/corpus': row 2 has no 'text' \(null"):
        stream("v3")

    # gpn train --dataset-revision is the revision its corpus asks for
    from modeling_gpn import train as train_module
    from modeling_gpn.train import training

    from .train_runs import parse

    class Built(Exception):
        pass

    def corpus_spec(**fields):
        raise Built(fields)

    monkeypatch.setattr(data, "CorpusSpec", corpus_spec)
    config = train_module.resolve_config(parse(["--dataset", "someone/corpus", "--dataset-revision", "v2"]))
    with pytest.raises(Built) as built:
        training.prepare_data(None, config, show_progress=False)
    assert built.value.args[0]["revision"] == "v2" and built.value.args[0]["source"] == "someone/corpus"


def test_a_killed_write_of_the_token_cache_is_cleaned_up_by_the_next(bpe_tokenizer_dir, tmp_path):
    """A run killed while tokenizing left its temporary folder (measured: 12 MB for a 21 MB corpus, as large as
    the cache) for good; the next write of the same cache deletes it, never one whose writer is alive."""
    import fcntl

    from transformers import AutoTokenizer

    from modeling_gpn import data

    path = tmp_path / "corpus.txt"
    path.write_text("the cat sat on the mat\n" * 50, encoding="utf-8")
    build = lambda: data.build_token_stream(  # noqa: E731
        data.CorpusSpec(source=str(path)), AutoTokenizer.from_pretrained(bpe_tokenizer_dir), tmp_path / "cache"
    )
    folder = build().folder
    shutil.rmtree(folder)
    killed, alive = (folder.parent / f".{folder.name}.tmp-{name}" for name in ("killed", "alive"))
    for other in (killed, alive):
        other.mkdir()
        (other / "tokens-00000.bin").write_bytes(b"\0" * 1000)
        (other / ".writing.lock").touch()
    with open(alive / ".writing.lock", encoding="utf-8") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # (flock locks belong to an open file: this one conflicts)
        stream = build()
        assert not stream.reused and not killed.exists() and alive.exists()
    # (and the empty lock file of the cache's key, which stays: `data.cache.writing_alone`)
    assert sorted(p.name for p in folder.parent.iterdir()) == sorted([folder.name, alive.name, f".{folder.name}.lock"])
    assert not (folder / ".writing.lock").exists()


# A run writing the token cache, as a second run sees it: a process holding the flock of the cache's key (a bare
# interpreter, cheap to start), which on "write" puts the finished cache folder it is given in place, as a run's
# rename does, and ends; or is killed while it holds the key.
CACHE_WRITER = """
import fcntl, os, shutil, sys
lock, made, folder = sys.argv[1:]
handle = open(lock)
fcntl.flock(handle, fcntl.LOCK_EX)
print(flush=True)
if sys.stdin.readline().strip() == "write":
    shutil.copytree(made, folder + ".tmp-writer")
    os.replace(folder + ".tmp-writer", folder)
"""


def second_run_beside_a_writer(lock: Path, made: Path, folder: Path, ending: str, run) -> tuple[int, list[str], dict]:
    """Start `CACHE_WRITER` holding `lock`, then `run(tell, result)` in a thread, as a second run that needs the
    folder; once that run has said it waits (through `tell`) and finished nothing, the writer puts `made` in place as
    `folder` (`ending` "write") or is killed ("killed"). Returns the writer's pid, what the run told, and its result."""
    import threading

    writer = subprocess.Popen(
        [sys.executable, "-c", CACHE_WRITER, str(lock), str(made), str(folder)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    told, told_or_done, result = [], threading.Event(), {}

    def tell(message: str) -> None:
        told.append(message)
        told_or_done.set()

    def second_run() -> None:
        try:
            run(tell, result)
        finally:
            told_or_done.set()

    try:
        writer.stdout.readline()  # (it holds the key once it printed)
        second = threading.Thread(target=second_run)
        second.start()
        assert told_or_done.wait(60) and told and not result, "the second run did not wait"
        if ending == "write":
            writer.communicate("write\n", timeout=60)
        else:
            writer.kill()
            writer.wait(timeout=60)
        second.join(60)
    finally:
        writer.kill()
        writer.wait()
    return writer.pid, told, result


def test_a_second_run_waits_for_the_one_writing_the_token_cache_and_reads_it_or_writes_it_if_that_one_is_killed(
    bpe_tokenizer_dir, tmp_path
):
    """Two runs needing the same token cache each tokenized the corpus (each in its own temporary folder, the first
    rename won): minutes wasted on a big corpus. The second waits on the cache's key, saying for whom (the writer's
    pid), then reads what the first wrote; a first run killed meanwhile (`kill -9`: the kernel drops its flock)
    leaves it waiting no longer: it tokenizes the corpus itself."""

    from transformers import AutoTokenizer

    from modeling_gpn import data

    path = tmp_path / "corpus.txt"
    path.write_text("the cat sat on the mat\n" * 50, encoding="utf-8")
    spec, tokenizer = data.CorpusSpec(source=str(path)), AutoTokenizer.from_pretrained(bpe_tokenizer_dir)
    made = data.build_token_stream(spec, tokenizer, tmp_path / "made", show_progress=False)  # what the first writes
    folder = tmp_path / "cache" / "tokens" / made.folder.name
    folder.parent.mkdir(parents=True)
    lock = folder.with_name(f".{folder.name}.lock")
    lock.touch()
    for ending in ("write", "killed"):

        def second_run(tell, built) -> None:
            built["stream"] = data.build_token_stream(
                spec, tokenizer, tmp_path / "cache", show_progress=False, tell=tell
            )

        pid, told, built = second_run_beside_a_writer(lock, made.folder, folder, ending, second_run)
        (message,) = told
        assert f"is in use by another process (pid {pid}: " in message, message
        assert f"that writes the token cache {folder}; this run reads the token cache once" in message, message
        stream = built["stream"]
        assert stream.folder == folder and stream.reused == (ending == "write"), ending
        assert np.array_equal(stream[:], made[:])
        shutil.rmtree(folder)


def test_a_second_run_waits_for_the_one_training_the_bpe_tokenizer_and_reads_it_or_trains_it_if_that_one_is_killed(
    tmp_path,
):
    """Two `gpn train --tokenizer bpe` runs on one corpus and cache each trained the BPE (the second's rename lost
    and its training was thrown away). The second waits on the cached tokenizer's key, naming the writer's pid, and
    loads what the first saved; a first run killed meanwhile (`kill -9`) releases it: it trains the BPE itself."""

    from modeling_gpn import data

    path = tmp_path / "corpus.txt"
    path.write_text("the cat sat on the mat\n" * 50, encoding="utf-8")
    spec = data.CorpusSpec(source=str(path))
    made = data.load_tokenizer("bpe", spec, 300, cache_dir=tmp_path / "made")  # what the first saves
    (made_folder,) = (tmp_path / "made" / "tokenizers").glob("bpe-*")
    folder = tmp_path / "cache" / "tokenizers" / made_folder.name
    folder.parent.mkdir(parents=True)
    lock = folder.with_name(f".{folder.name}.lock")
    lock.touch()
    for ending in ("write", "killed"):

        def second_run(tell, loaded) -> None:
            loaded["tokenizer"] = data.load_tokenizer("bpe", spec, 300, cache_dir=tmp_path / "cache", tell=tell)

        pid, told, loaded = second_run_beside_a_writer(lock, made_folder, folder, ending, second_run)
        (message,) = told
        assert f"is in use by another process (pid {pid}: " in message, message
        assert f"that writes the BPE tokenizer {folder}; this run reads the BPE tokenizer once" in message, message
        tokenizer = loaded["tokenizer"]
        # (loaded from the folder: named after it; trained here: named after nothing)
        assert tokenizer.name_or_path == (str(folder) if ending == "write" else ""), ending
        assert tokenizer.get_vocab() == made.get_vocab() and (folder / "tokenizer.json").is_file()
        shutil.rmtree(folder)


def test_without_flock_the_token_cache_is_still_written_whole_and_no_write_is_taken_for_abandoned(
    bpe_tokenizer_dir, tmp_path, monkeypatch
):
    """Windows has no fcntl (`import fcntl` failed the import of the data package: `gpn train` did not start).
    There the cache is written as elsewhere, without a lock file (Windows cannot rename or delete an open file),
    and another run's temporary folder is kept: without a lock a live write cannot be told from a killed one.
    A corpus with Windows line ends (CRLF) gives the tokens of the same text with LF (read as universal newlines)."""
    from transformers import AutoTokenizer

    from modeling_gpn import data
    from modeling_gpn.data import cache

    monkeypatch.setattr(cache, "fcntl", None)
    tokenizer = AutoTokenizer.from_pretrained(bpe_tokenizer_dir)
    streams = {}
    for name, end in (("lf", b"\n"), ("crlf", b"\r\n")):
        path = tmp_path / f"{name} corp\u00fcs.txt"  # (a space and a non-ASCII letter in the path)
        path.write_bytes(("the cat sat on the m\u00e4t" + end.decode()).encode() * 50)
        spec = data.CorpusSpec(source=str(path))
        folder = data.build_token_stream(spec, tokenizer, tmp_path / "cache", show_progress=False).folder
        other = folder.parent / f".{folder.name}.tmp-other"
        other.mkdir()
        (other / ".writing.lock").touch()
        shutil.rmtree(folder)
        streams[name] = data.build_token_stream(spec, tokenizer, tmp_path / "cache", show_progress=False)
        assert other.exists() and not (folder / ".writing.lock").exists()
    lf, crlf = streams["lf"], streams["crlf"]
    assert len(lf) == len(crlf) and np.array_equal(lf[:], crlf[:])


# A corpus of what real text holds beside ASCII: Chinese, Japanese, Arabic and Hebrew (right to left), combining accents,
# emoji joined by ZWJ and with skin-tone and flag sequences, NUL and other control characters, Unicode line
# separators, a private-use character and a noncharacter.
MIXED_TEXT = "".join(
    f"{line} #{number}\n"
    for number, line in enumerate(
        [
            "\u4e2d\u6587\u8bad\u7ec3\uff1a\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002",
            "\u543e\u8f29\u306f\u732b\u3067\u3042\u308b\u3002\u30ab\u30bf\u30ab\u30ca",
            "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645 / \u05e9\u05dc\u05d5\u05dd",
            "cafe\u0301 na\u0308ive z\u0336\u0317",
            "\U0001f469\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 \U0001f3f3\ufe0f\u200d\U0001f308 \U0001f44d\U0001f3fd \U0001f1ef\U0001f1f5",
            "tab\there NUL\x00here bell\x07 esc\x1b[31m DEL\x7f vtab\x0b ff\x0c",
            "a\u2028b\u2029c NEL\x85d \ue000 \uffff \U0001d538",
        ]
        * 40
    )
)


def test_a_byte_order_mark_is_no_text_and_every_character_comes_back(bpe_tokenizer_dir, tmp_path):
    """A .txt file saved with a UTF-8 byte-order mark (Windows editors write one) trained the mark as a character,
    U+FEFF, at the start of its document, where a jsonl or csv file's is dropped by its reader: it is dropped, and
    the file gives the tokens of the same text without it (CRLF line ends as LF), by `gpn train`'s reader and by
    `datasets`' alike. Every character of a mixed corpus comes back from the token cache as it was; the caches of
    such a file are keyed apart from those written when the mark was read as text."""
    from transformers import AutoTokenizer

    from modeling_gpn import data

    tokenizer = AutoTokenizer.from_pretrained(bpe_tokenizer_dir)
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_bytes(MIXED_TEXT.encode("utf-8"))
    marked.write_bytes(codecs.BOM_UTF8 + MIXED_TEXT.replace("\n", "\r\n").encode("utf-8"))
    streams = [
        data.build_token_stream(data.CorpusSpec(str(path)), tokenizer, tmp_path / "cache", show_progress=False)
        for path in (plain, marked)
    ]
    assert np.array_equal(streams[0][:], streams[1][:])
    tokens = streams[1][:].tolist()
    assert tokens[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(tokens[:-1]) == MIXED_TEXT  # (a byte-level BPE: no character lost)
    assert list(data.CorpusSpec(str(marked)).documents()) == [MIXED_TEXT]  # (`datasets`' text builder kept it)
    assert data.CorpusSpec(str(marked)).fingerprint()["byte_order_mark_dropped"] == [str(marked.resolve())]
    assert "byte_order_mark_dropped" not in data.CorpusSpec(str(plain)).fingerprint()  # (other caches stay valid)


def test_bytes_that_are_not_utf8_are_named_where_they_are_in_the_file(tmp_path):
    """A file that is not UTF-8 is refused in one line naming its first such byte by its offset from the file's
    start and its line, with the bytes around it. The decoder's own position counts from the block it decoded:
    a byte at 1,792,743 of a .txt file was said to be at 178409, one on line 4 of a jsonl file at 492."""
    from modeling_gpn.data import CorpusSpec, DataError
    from modeling_gpn.data.corpus import first_invalid_utf8

    good = MIXED_TEXT.encode("utf-8") * 3  # (over 40 KB: beyond the first block either reader decodes)
    at = len(MIXED_TEXT[: MIXED_TEXT.index("#200")].encode("utf-8")) + 2 * len(MIXED_TEXT.encode("utf-8"))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(good[:at] + b"caf\xe9 " + good[at:])  # (0xe9 then a space: no continuation byte)
    line = MIXED_TEXT.count("\n") * 2 + 201
    with pytest.raises(DataError) as raised:
        list(CorpusSpec(str(latin1)).document_pieces())
    message = str(raised.value)
    assert f"latin1.txt: it is not UTF-8 text: byte {at + 3:,} (line {line:,}: b'\\xe9' in b'" in message, message
    assert "invalid continuation byte" in message and "\n" not in message
    rows = tmp_path / "rows.jsonl"
    lines = [json.dumps({"text": text}, ensure_ascii=False).encode("utf-8") for text in MIXED_TEXT.split("#")]
    lines[150] = lines[150].replace(b"\\n", b"\xff\\n", 1)
    rows.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError, match=r"rows\.jsonl: it is not UTF-8 text: byte [\d,]+ \(line 151: b'\\xff'"):
        list(CorpusSpec(str(rows)).document_pieces())
    # Blocks shorter than a character: a character cut between two blocks is no error, and the offset is the file's.
    assert first_invalid_utf8(latin1, block_bytes=5) == (at + 3, line, "invalid continuation byte")
    assert first_invalid_utf8(latin1, block_bytes=1 << 20) == (at + 3, line, "invalid continuation byte")
    (tmp_path / "good.txt").write_bytes(good)
    assert first_invalid_utf8(tmp_path / "good.txt", block_bytes=5) is None
    (tmp_path / "cut.txt").write_bytes(good[:-2] + "\u4e2d".encode("utf-8")[:2])  # (a file cut mid-character)
    last = (len(good) - 2, good[:-2].count(b"\n") + 1, "unexpected end of data")
    assert first_invalid_utf8(tmp_path / "cut.txt", block_bytes=5) == last


def test_a_cache_folder_that_cannot_be_written_is_one_clear_error(bpe_tokenizer_dir, tmp_path):
    """(A file in the --cache-dir path: what root, as these tests run, cannot write either.) It was a
    NotADirectoryError traceback out of `gpn train`."""
    from transformers import AutoTokenizer

    from modeling_gpn import data

    path = tmp_path / "corpus.txt"
    path.write_text("the cat sat on the mat\n" * 50, encoding="utf-8")
    corpus = data.CorpusSpec(source=str(path))
    cache = path / "cache"  # under a file
    tokenizer = AutoTokenizer.from_pretrained(bpe_tokenizer_dir)
    with pytest.raises(data.DataError, match=r"Cannot write the cache folder .*corpus\.txt/cache/tokens .*--cache-dir"):
        data.build_token_stream(corpus, tokenizer, cache_dir=cache, show_progress=False)
    with pytest.raises(data.DataError, match=r"Cannot write the cache folder .*corpus\.txt/cache/tokenizers"):
        data.load_tokenizer("bpe", corpus, 300, cache_dir=cache)


def test_a_damaged_cached_bpe_tokenizer_names_its_folder(tmp_path):
    """A cached BPE whose tokenizer.json was cut short ended `gpn train` with json's "Expecting value: line 7
    column 12", naming neither the file nor what to do."""
    from modeling_gpn import data

    path = tmp_path / "corpus.txt"
    path.write_text("the cat sat on the mat\n" * 50, encoding="utf-8")
    corpus, cache = data.CorpusSpec(source=str(path)), tmp_path / "cache"
    trained = data.load_tokenizer("bpe", corpus, 300, cache_dir=cache)
    (saved,) = (cache / "tokenizers").glob("bpe-*/tokenizer.json")
    saved.write_bytes(saved.read_bytes()[:100])
    with pytest.raises(data.DataError, match=rf"The cached BPE tokenizer {re.escape(str(saved.parent))} cannot be "):
        data.load_tokenizer("bpe", corpus, 300, cache_dir=cache)
    shutil.rmtree(saved.parent)  # as the message says: trained again, the same
    assert data.load_tokenizer("bpe", corpus, 300, cache_dir=cache).get_vocab() == trained.get_vocab()


# --------------------------------------------------------------------------------------------------
# gpn eval fineweb_paper: chunked logits, same figures, bounded memory
# --------------------------------------------------------------------------------------------------


def full_logits_nll(model, batch: torch.Tensor) -> float:
    """The method `windowed_perplexity` used before: full logits, a float64 copy, one cross-entropy."""
    with torch.no_grad():
        logits = model(input_ids=batch, use_cache=False).logits
    return F.cross_entropy(
        logits[:, :-1].double().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
    ).item()


def tiny_llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


class LogitsOnly(torch.nn.Module):
    """A causal LM whose decoder eval does not know: the fallback path (the model's own logits)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, use_cache=False):
        return self.inner(input_ids=input_ids, use_cache=use_cache)


@pytest.mark.parametrize("kind", ["gpn", "llama", "fallback"])
def test_chunked_window_nll_equals_the_full_logits_method(kind):
    from modeling_gpn.evaluation.protocols import hidden_states_and_decoder, summed_next_token_nll

    vocab = 32000
    model = {"gpn": lambda: perturbed_model(tiny_config(vocab_size=vocab)), "llama": lambda: tiny_llama(vocab)}.get(
        kind, lambda: LogitsOnly(perturbed_model(tiny_config(vocab_size=vocab)))
    )()
    batch = torch.randint(0, vocab, (3, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hidden_states_and_decoder(model, batch) is None) == (kind == "fallback")
    expected = full_logits_nll(model, batch)
    for chunk_rows in (None, 7, 10_000):  # uneven chunks, and one chunk holding everything
        assert summed_next_token_nll(model, batch, chunk_rows) == pytest.approx(expected, rel=1e-9, abs=0)


FINEWEB_WINDOWS = 4


def _fineweb_job(tmp_path: Path) -> Callable[[], tuple]:
    windows = FINEWEB_WINDOWS
    model = perturbed_model(tiny_config(vocab_size=32000))
    model.save_pretrained(tmp_path / "model")
    stream = torch.randint(0, 32000, (windows * 2048 + 5,), generator=torch.Generator().manual_seed(2))
    torch.save(stream, tmp_path / "stream.pt")
    code = f"""
from modeling_gpn import GPNForCausalLM
from modeling_gpn.evaluation.protocols import windowed_perplexity
model = GPNForCausalLM.from_pretrained({str(tmp_path / "model")!r}).eval()
stream = torch.load({str(tmp_path / "stream.pt")!r}).tolist()
result = windowed_perplexity(model, stream, window=2048, batch_size={windows}, progress=False)
print("RESULT", json.dumps(result), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
    return lambda: (model, stream, run_python_bounded(code, margin_bytes=600 << 20))


def test_fineweb_windows_at_2048_with_a_32k_vocabulary_in_bounded_memory(fresh_processes, request):
    """The paper's window and a LLaMA-sized vocabulary, batch 4, under a cap of imports + 600 MiB: the full
    logits alone would be 1.05 GB (and their float64 copies 2.1 GB each). The figure equals the full-logits
    method's, computed in the parent without a cap (the child run by `_fineweb_job`)."""
    windows = FINEWEB_WINDOWS
    model, stream, child = fresh_processes[request.node.originalname].result()
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.split("RESULT", 1)[1].rsplit(" ", 1)[0])
    tokens = stream[: windows * 2048].view(windows, 2048)
    rest = sum(full_logits_nll(model, tokens[i : i + 2]) for i in range(0, windows, 2))
    assert result["windows"] == windows and result["tokens_scored"] == windows * 2048
    assert result["ppl_excluding_first"] == pytest.approx(math.exp(rest / (windows * 2047)), rel=1e-9)


# --------------------------------------------------------------------------------------------------
# The rewritten unpickler still runs nothing
# --------------------------------------------------------------------------------------------------


def _text(value: str) -> bytes:
    """A BINUNICODE opcode pushing `value` (valid in every pickle protocol from 1)."""
    data = value.encode()
    return b"X" + struct.pack("<I", len(data)) + data


# The payloads that would run something (os.system, eval) create the file MARK (replaced by each test with a
# path of its own): the test checks that it does not exist, so code that ran a payload and refused after fails.
MARK = "@MARK@"
HOSTILE_PICKLES = {  # case -> (pickle, what the refusal says)
    "global-os-system": (b"\x80\x02cos\nsystem\n" + _text(f"touch '{MARK}'") + b"\x85R.", "object os.system"),
    "stack-global-eval": (
        b"\x80\x04\x8c\x08builtins\x8c\x04eval\x93" + _text(f"open('{MARK}', 'w').close()") + b"\x85R.",
        "object builtins.eval",
    ),
    "dotted-name": (b"\x80\x04\x8c\x05numpy\x8c\x0fdtype.__class__\x93.", "object numpy.dtype.__class__"),
    "inst-opcode": (b"(" + _text(f"touch '{MARK}'") + b"ios\nsystem\n.", "object os.system"),
    "newobj-of-a-wrapper": (b"\x80\x02cbuiltins\nlist\n)\x81.", "is not a type object"),
    "build-on-a-dict": (b"\x80\x02}}b.", "sets the state of a dict"),
    "codec-other-than-latin1": (
        b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00aX\x04\x00\x00\x00zlib\x86R.",
        "codecs.encode with 'zlib'",
    ),
    "ndarray-called-directly": (b"\x80\x02cnumpy\nndarray\nK\x05\x85R.", "object is not callable"),
    "persistent-id": (b"\x80\x02X\x01\x00\x00\x00xQ.", "persistent objects"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_PICKLES))
def test_hostile_pickles_are_refused_and_run_nothing(tmp_path, case):
    from modeling_gpn.conversion import CheckpointError
    from modeling_gpn.conversion.reference import load_pickle_checkpoint

    path, mark = tmp_path / "checkpoint.pkl", tmp_path / "payload-ran"
    template, needle = HOSTILE_PICKLES[case]
    # (the length fields of the payloads' strings are computed for MARK: rebuild them for the real path)
    data = template.replace(_text(f"touch '{MARK}'"), _text(f"touch '{mark}'"))
    data = data.replace(_text(f"open('{MARK}', 'w').close()"), _text(f"open('{mark}', 'w').close()"))
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        load_pickle_checkpoint(path)
    assert not mark.exists(), "the payload ran before the refusal"


def test_rolling_perplexity_batches_are_capped_by_their_logits():
    """lm-eval holds a rolling batch's (batch, max_length, vocab) logits and log-softmax: at the paper's
    2048 and a 32k vocabulary, 2 rows fit the 1 GiB budget, not 8 (the figures do not depend on it:
    tests/ecosystem/test_eval.py::test_wikitext_rolling_perplexity_batch_invariant)."""
    from modeling_gpn.evaluation.runner import rolling_batch_size

    assert rolling_batch_size(8, 2048, 32000) == 2
    assert rolling_batch_size(8, 128, 32000) == 8
    assert rolling_batch_size(8, 1 << 20, 1 << 20) == 1


def test_eval_token_stream_of_a_long_document_equals_whole_tokenization(bpe_tokenizer_dir, monkeypatch):
    """fineweb_paper's token stream tokenizes a long document in pieces too, to the same tokens."""
    from transformers import AutoTokenizer

    from modeling_gpn import data
    from modeling_gpn.evaluation.protocols import token_stream

    tokenizer = AutoTokenizer.from_pretrained(bpe_tokenizer_dir)
    long_text, short_text = tricky_text(120_000), "A short one.\n"
    monkeypatch.setattr(data.corpus, "PIECE_CHARS", 2_000)
    assert sum(1 for _ in data.split_document(long_text)) > 20
    stream, used = token_stream(tokenizer, [short_text, long_text, short_text])
    eos = tokenizer.eos_token_id
    whole = [tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in (short_text, long_text, short_text)]
    assert used == 3 and stream == [token for ids in whole for token in ids]


def text_io_without_an_encoding(path: Path) -> list[str]:
    """The calls in `path` that open a text file with the platform's default encoding: `read_text()`,
    `write_text(...)` and `open(...)` in a text mode without `encoding=`."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call) or any(keyword.arg == "encoding" for keyword in node.keywords):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        mode = next((keyword.value for keyword in node.keywords if keyword.arg == "mode"), None)
        method = isinstance(node.func, ast.Attribute)  # Path.open(mode) or builtins' open(file, mode)
        if name == "open" and mode is None and len(node.args) > (0 if method else 1):
            mode = node.args[0 if method else 1]
        binary = isinstance(mode, ast.Constant) and "b" in str(mode.value)
        os_open = method and getattr(node.func.value, "id", None) in ("os", "archive")  # a descriptor, a zip member
        if name in ("read_text", "write_text") or (name == "open" and not binary and not os_open):
            found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {name}")
    return found


def test_every_text_file_the_package_reads_or_writes_names_its_encoding():
    """Windows' default text encoding is not UTF-8 (docs/platforms.md): a state store's record, a study's
    definition, a model's config read with it take non-ASCII text wrongly, and a file written there is read
    wrongly elsewhere. ruff's PLW1514 sees only `open(...)` and `Path(...).read_text()`; this sees a path held in
    a variable too, and a replaced file written in text mode (`atomic_files.replacing`)."""
    files = [
        path
        for folder in ("modeling_gpn", "conversion", "eval", "gpn_cli")
        for path in (REPO_ROOT / folder).rglob("*.py")
    ]
    assert len(files) > 50
    assert [call for path in files for call in text_io_without_an_encoding(path)] == []


def test_a_path_held_by_another_process_is_refused_naming_it_and_a_replaced_one_is_seen(tmp_path, monkeypatch):
    """`atomic_files.held`, what gpn generate, eval, convert and push --dry-run hold their file or folder with. A real
    second process holding the flock (a bare interpreter: no torch to import) is named in the refusal by its pid
    and command. A file replaced by a rename after a hold was taken is a new file: a process holding the path now
    holds the new one (a run continuing the state another just saved), and `unchanged_since` tells it was
    replaced. Without flock (Windows) nothing is held, and the replacement is still told."""
    from modeling_gpn.atomic_files import InUseError, held, unchanged_since, write_file_atomically

    state = tmp_path / "state.safetensors"
    state.write_bytes(b"first")
    with another_process_holding(state) as holder:
        with pytest.raises(
            InUseError, match=rf"{state} is in use by another process \(pid {holder.pid}: \S+ -c import fcntl"
        ):
            with held(state, "that tests"):
                pass
    with held(state, "that tests") as first:
        write_file_atomically(state, b"second")  # (as GPNCache.save replaces it)
        assert not unchanged_since(state, first)
        with held(state, "that tests") as second:  # the new file, free
            assert unchanged_since(state, second)
    monkeypatch.setitem(sys.modules, "fcntl", None)  # (import fails, as on Windows)
    with held(state, "that tests") as seen, held(state, "that tests"):
        write_file_atomically(state, b"third")
        assert not unchanged_since(state, seen)


def test_a_path_replaced_between_its_open_and_its_lock_is_held_as_it_is_now(tmp_path, monkeypatch):
    """`held` opens the path, then locks what it opened. A writer that renames a new file over the path in between
    (forced here: the replacement is made as the flock is asked for) leaves the lock on a file the path no longer
    names: `held` opens the path again and holds the new file, so the block reads what the path names now, held."""
    import fcntl

    from modeling_gpn.atomic_files import held, write_file_atomically

    state = tmp_path / "state.safetensors"
    state.write_bytes(b"first")
    real_flock, replaced = fcntl.flock, []

    def replaced_first(descriptor: int, operation: int) -> None:
        if not replaced:
            replaced.append(os.fstat(descriptor).st_ino)  # (the file held's first open named)
            write_file_atomically(state, b"second")
        real_flock(descriptor, operation)

    monkeypatch.setattr(fcntl, "flock", replaced_first)
    with held(state, "that tests") as locked:
        assert replaced and locked.st_ino != replaced[0] and locked.st_ino == os.stat(state).st_ino
        assert state.read_bytes() == b"second"


def test_a_hold_let_go_while_its_holder_is_read_is_taken(tmp_path, monkeypatch):
    """`held` reads who holds the path after its flock was refused, for the message. A holder that lets go in
    between (forced here: it lets go as the read starts) left the path free: it is taken, not refused naming
    "another process". Where /proc/locks never lists the lock (NFS lists flocks as POSIX locks; forced here by
    reading another file's entry), the retries are bounded and the refusal still comes."""
    import fcntl

    from modeling_gpn import atomic_files
    from modeling_gpn.atomic_files import InUseError, held

    state, other = tmp_path / "state.safetensors", tmp_path / "other"
    state.write_bytes(b"state")
    other.write_bytes(b"")
    holder = os.open(state, os.O_RDONLY)  # (a descriptor of its own: its flock refuses held's, as another process's)
    fcntl.flock(holder, fcntl.LOCK_EX)
    read_holder, reads = atomic_files._holder, []

    def letting_go_first(identity):
        reads.append(identity)
        os.close(holder)  # (the holder ends between the refused flock and the read of /proc/locks)
        return read_holder(identity)

    monkeypatch.setattr(atomic_files, "_holder", letting_go_first)
    with held(state, "that tests"):
        assert len(reads) == 1
        probe = os.open(state, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):  # (held: the lock is taken, not only the refusal skipped)
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(probe)
        monkeypatch.setattr(atomic_files, "_holder", lambda identity: reads.append(0) or read_holder(os.stat(other)))
        with pytest.raises(InUseError, match=r"in use by another process \(another process\) that tests"):
            with held(state, "that tests"):
                pass
    assert len(reads) == 2 + atomic_files._RETRIES_AFTER_A_RELEASE
