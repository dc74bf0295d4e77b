"""The `gpn` command's start: `gpn --help` answers without importing torch or transformers, and no command prints
the upstream log lines nobody asked for (torchao's unloadable CUDA extensions on a CPU torch, torch's deprecation
notices about torchao's enums), while every other log line still gets through."""

from __future__ import annotations

import enum
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpn_cli import SUBCOMMANDS
from gpn_cli.upstream_noise import keep_pytree_record, keep_torchao_record

NOISE = ("Failed to load", "is an Enum subclass", "register_constant")


def run(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter (PYTHONPATH kept: the mutation check's copy is what it must import)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )


def noise_in(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(part in line for part in NOISE)]


def test_gpn_help_imports_neither_torch_nor_transformers():
    """`gpn --help` took about 4 s: the entry point was inside `modeling_gpn`, whose `__init__` imports torch and
    transformers (to register GPN with the Auto classes). `gpn`, `gpn --help`, a mistyped command and
    `gpn --version` (which imported both to ask their versions) now import nothing of either, and say what they
    said before."""
    result = run(
        "import contextlib, io, json, sys\n"
        "from gpn_cli import main\n"
        "codes, out = [], io.StringIO()\n"
        "for argv in (['--help'], [], ['nosuch'], ['--version']):\n"
        "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):\n"
        "        try:\n"
        "            codes.append(main(argv))\n"
        "        except SystemExit as exit:\n"
        "            codes.append(exit.code)\n"
        "heavy = [m for m in ('torch', 'transformers', 'torchao', 'modeling_gpn') if m in sys.modules]\n"
        "print(json.dumps({'codes': codes, 'heavy': heavy, 'out': out.getvalue()}))\n"
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["heavy"] == [], f"gpn --help imported {found['heavy']}"
    assert found["codes"] == [0, 0, 2, 0]  # help, help, argparse's usage error, the version
    assert all(name in found["out"] for name in SUBCOMMANDS) and "invalid choice: 'nosuch'" in found["out"]
    assert f"(torch {torch.__version__}, transformers " in found["out"]
    assert noise_in(found["out"] + result.stderr) == []


def test_the_console_script_and_every_subcommands_help_exit_0_without_upstream_noise():
    """The installed `gpn` script's --help, then `gpn CMD --help` of every subcommand in one process (the first
    one imports transformers, which imports torchao): each exits 0 and nothing but the help is printed. That
    process has what Windows lacks taken away from GPN's modules (the fcntl and resource modules,
    os.sched_getaffinity): importing each command's module must not need them (`gpn train --help` failed there on `import fcntl`)."""
    script = Path(sys.executable).with_name("gpn")
    if script.exists():
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        top = subprocess.run([str(script), "--help"], env=env, capture_output=True, text=True, timeout=120)
        assert top.returncode == 0 and "generate" in top.stdout and noise_in(top.stdout + top.stderr) == []
    result = run(
        "import builtins, contextlib, io, json, os\n"
        "real_import = builtins.__import__\n"
        "def windows_import(name, globals=None, locals=None, fromlist=(), level=0):\n"
        "    # (only GPN's own imports fail: psutil and the like import their Linux modules on Linux)\n"
        "    if name in ('fcntl', 'resource') and (globals or {}).get('__name__', '').startswith(('modeling', 'gpn')):\n"
        "        raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "    return real_import(name, globals, locals, fromlist, level)\n"
        "builtins.__import__ = windows_import\n"
        "if hasattr(os, 'sched_getaffinity'):\n"
        "    del os.sched_getaffinity\n"
        "from gpn_cli import SUBCOMMANDS, main\n"
        "codes = {}\n"
        "for name in SUBCOMMANDS:\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "        try:\n"
        "            main([name, '--help'])\n"
        "        except SystemExit as exit:\n"
        "            codes[name] = (exit.code, f'usage: gpn {name}' in out.getvalue())\n"
        "print(json.dumps(codes))\n"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {name: [0, True] for name in SUBCOMMANDS}
    noise = noise_in(result.stderr)
    if torch.version.cuda is not None or torch.version.hip is not None:  # there the extensions' failures are kept
        noise = [line for line in noise if "Failed to load" not in line]
    assert noise == [], "\n".join(noise)


def record(name: str, msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)


def test_only_the_known_lines_are_dropped(monkeypatch):
    """Exactly torchao's "Failed to load .../torchao/_C*.so" on a torch without CUDA or ROCm, and torch's notice
    about torchao's enums; the same failure on a CUDA torch (where it may be real), torchao's other warnings, and
    the notice about anyone else's enum still print."""
    so = "/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"
    failed = record("torchao", f"Failed to load {so}: Could not load this library: {so}")

    class KernelPreference(enum.Enum):
        AUTO = "auto"

    class Mine(enum.Enum):
        A = 1

    monkeypatch.setattr(KernelPreference, "__module__", "torchao.quantization.quantize_.common.kernel_preference")
    notice = "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type."

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    assert not keep_torchao_record(failed)
    assert not keep_pytree_record(record("torch.utils._pytree", notice, KernelPreference))
    assert keep_torchao_record(record("torchao", "Skipping import of cpp extensions due to incompatible torch version"))
    assert keep_torchao_record(record("torchao", "Failed to load /site-packages/other/_C.so: missing symbol"))
    assert keep_pytree_record(record("torch.utils._pytree", notice, Mine))
    assert keep_pytree_record(record("torch.utils._pytree", "something else %s", KernelPreference))

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert keep_torchao_record(failed)


def test_the_filters_are_installed_once(capsys):
    """`main` may run many times in one process (tests, scripts): the filters are not stacked up."""
    from gpn_cli import main

    for _ in range(2):
        with pytest.raises(SystemExit):
            main(["--help"])
    capsys.readouterr()
    assert logging.getLogger("torchao").filters.count(keep_torchao_record) == 1
    assert logging.getLogger("torch.utils._pytree").filters.count(keep_pytree_record) == 1


def test_ctrl_c_while_a_subcommand_loads_is_one_line_and_the_shells_status(tmp_path, monkeypatch, capsys):
    """`gpn CMD` imports CMD's module (torch and transformers: seconds) to build its parser; a Ctrl-C then (an
    impatient `gpn train --help`) printed a KeyboardInterrupt traceback. It ends like a Ctrl-C in the command: one
    line naming it, exit status 130. (The interrupt is raised where it lands in life: in the module's import.)"""
    import gpn_cli

    (tmp_path / "interrupted_while_loading.py").write_text("raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(gpn_cli.SUBCOMMANDS, "slow", ("interrupted_while_loading", "a subcommand slow to load"))
    try:
        code = gpn_cli.main(["slow", "--help"])
    except KeyboardInterrupt:  # (caught here: pytest takes one that escapes for the user's, and stops the run)
        pytest.fail("a Ctrl-C while the subcommand loaded escaped gpn's main: a traceback")
    assert code == 130
    assert capsys.readouterr().err == "gpn slow: interrupted (Ctrl-C)\n"


def test_an_unknown_option_is_refused_by_its_subcommand(capsys):
    """`gpn push a b --nosuch` was refused by the top-level parser: "gpn: error: unrecognized arguments" under the
    usage of `gpn` itself, not naming the subcommand nor showing its options. The subcommand now refuses it."""
    from gpn_cli import main

    for argv, prefix in ((["push", "a", "b", "--nosuch", "x"], "gpn push"), (["--nosuch"], "gpn")):
        with pytest.raises(SystemExit) as exit:
            main(argv)
        err = capsys.readouterr().err
        assert exit.value.code == 2 and err.startswith(f"usage: {prefix} "), err
        assert err.splitlines()[-1] == f"{prefix}: error: unrecognized arguments: {' '.join(argv[3:] or argv)}"


BENCH = ["bench", "--preset", "tiny", "--impl", "fast", "--skip-training", "--decode-prompt-lengths"]
BENCH += ["--decode-batches", "1", "--repeats", "1", "--device", "cpu"]  # (a third of a second)


@pytest.mark.parametrize(
    "switched_off_by", ["nothing", "--no-progress", "TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"]
)
def test_the_progress_bar_switches_of_the_hugging_face_libraries_are_every_commands_no_progress(
    switched_off_by, monkeypatch, capsys
):
    """HF_HUB_DISABLE_PROGRESS_BARS=1 (huggingface_hub's, which transformers' bars follow) took away the bars of
    transformers ("Loading weights", "Writing model shards") and left the command's own (training, tokenizing,
    bench, inspect, eval) on standard error; TQDM_DISABLE=1 did the same (each command asks tqdm for its bars
    explicitly, which overrides tqdm's environment). Either is now the command's --no-progress, which `gpn bench`
    did not have. (huggingface_hub reads its variable once, when imported: its setting is put where it keeps it.)"""
    import importlib

    from gpn_cli import main

    hub_bars = importlib.import_module("huggingface_hub.utils.tqdm")  # (the module: the package's name is its class)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.setattr(hub_bars, "HF_HUB_DISABLE_PROGRESS_BARS", None)
    if switched_off_by == "TQDM_DISABLE":
        monkeypatch.setenv("TQDM_DISABLE", "1")
    elif switched_off_by == "HF_HUB_DISABLE_PROGRESS_BARS":
        monkeypatch.setattr(hub_bars, "HF_HUB_DISABLE_PROGRESS_BARS", True)
    assert main(BENCH + (["--no-progress"] if switched_off_by == "--no-progress" else [])) == 0
    captured = capsys.readouterr()
    assert "| tiny | fast |" in captured.out
    assert ("bench: 100%" in captured.err) == (switched_off_by == "nothing"), captured.err


@pytest.mark.parametrize("unbuffered", ["", "1"], ids=["buffered", "PYTHONUNBUFFERED"])
@pytest.mark.parametrize("arguments", [[], ["--help"]], ids=["gpn", "gpn --help"])
def test_a_closed_pipe_ends_the_command_quietly_with_sigpipes_status(arguments, unbuffered):
    """`gpn --help | head -1`, as any command whose reader goes away before it has printed all: what stayed in
    standard output's buffer was flushed at exit, into the closed pipe, and Python printed "Exception ignored in:
    <_io.TextIOWrapper name='<stdout>'> BrokenPipeError", exit status 120 (unseen where PYTHONUNBUFFERED=1 keeps
    nothing in a buffer). Standard output is pointed at os.devnull then, and the status is the shell's for a command
    ended by SIGPIPE, 141. (`gpn` without a command and `gpn --help` print without importing torch: 0.1 s each.)"""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone before anything is printed
    try:
        result = subprocess.run(
            [sys.executable, "-m", "gpn_cli", *arguments],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")


class ClosedPipe:
    """Standard output whose reader has gone: every write fails as a closed pipe's does."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        pass


@pytest.mark.parametrize(
    "arguments", [["--help"], ["bench", "--help"], ["--version"]], ids=["help", "bench-help", "version"]
)
def test_help_and_version_into_a_closed_pipe_end_as_every_commands_output_does(arguments, monkeypatch, capsys):
    """argparse ignores a failed write of its help, usage or version and exits 0: `gpn --help | head -1` ended 0
    where standard output is unbuffered, and 141 where it is buffered (the flush at exit failed). The parsers of
    the command and of its subcommands let the BrokenPipeError through: 141 either way, as for any command's
    output."""
    from gpn_cli import main

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    assert main(arguments) == 141
    assert capsys.readouterr().err == ""


def test_each_line_is_written_as_it_is_printed_into_a_pipe_too(monkeypatch, capsys):
    """Into a pipe or a file Python writes standard output in 8 KB blocks: `gpn train ... | tee train.log` showed
    no line until the run ended (each evaluation's loss held back, for hours on a long run), and a run killed
    meanwhile lost them. A command's standard output is line-buffered, wherever it goes. (Here a pipe's stream as
    Python opens one, and a third-of-a-second `gpn bench`: its first line reaches the pipe before it returns.)"""
    import io

    from gpn_cli import main

    read_end, write_end = os.pipe()
    stream = io.TextIOWrapper(io.FileIO(write_end, "w"), encoding="utf-8")  # (block-buffered, as into a pipe)
    assert not stream.line_buffering
    arrived: list[bytes] = []

    def first_line_before_the_end(rows, args, interrupted=False):  # (called once all is measured, to print it)
        print("measured")
        os.set_blocking(read_end, False)
        try:
            arrived.append(os.read(read_end, 1 << 16))
        except BlockingIOError:
            arrived.append(b"")

    monkeypatch.setattr("sys.stdout", stream)
    monkeypatch.setattr("modeling_gpn.bench.command.report", first_line_before_the_end)
    try:
        assert main(BENCH + ["--no-progress"]) == 0
    finally:
        stream.close()
        os.close(read_end)
    assert arrived == [b"measured\n"]
