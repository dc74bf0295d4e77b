"""The documentation cannot rot: its code blocks run, and its commands parse.

Every fenced code block of README.md, CONTRIBUTING.md and the pages of docs/ is collected:
- a block opened as ```` ```python runnable ```` runs, in a folder holding a tiny GPN saved as
  `me/gpn-tiny` (with a byte-level BPE tokenizer), so `from_pretrained("me/gpn-tiny")` loads it as a user's
  would load a Hub repo;
- a block opened as ```` ```python serving ```` (the README's OpenAI client session) runs against a real
  `gpn serve` in tests/tools/test_serve.py;
- every `gpn ...` command in a bash block, and every `accelerate launch ... -m modeling_gpn.train ...` or
  `python -m modeling_gpn.X ...`, is parsed by the real `gpn` parser of that subcommand (nothing runs): a
  renamed or removed option, or a subcommand that no longer exists, fails here, naming the page and line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex

import pytest
import torch

from ..tiny_models import tiny_config
from .doc_blocks import ALL_BLOCKS, DOC_FILES

RUNNABLE = [block for block in ALL_BLOCKS if block.language == "python" and "runnable" in block.options]
SHELL = [block for block in ALL_BLOCKS if block.language in ("bash", "sh", "shell", "console")]


def shell_commands(code: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped, `&&` / `;` / `|` split."""
    joined = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError as error:
            raise AssertionError(f"unparsable shell line {line!r}: {error}") from error
        command: list[str] = []
        for word in words:
            if word in ("&&", ";", "|", "||"):
                commands.append(command)
                command = []
            else:
                command.append(word)
        commands.append(command)
    return [command for command in commands if command]


def gpn_arguments(command: list[str]) -> list[str] | None:
    """The arguments of the `gpn` command a shell command runs, as `gpn` would get them, or None."""
    while command and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", command[0]):  # VARIABLE=value prefixes
        command = command[1:]
    if not command:
        return None
    if command[0] == "gpn":
        return command[1:]
    if "-m" in command and command[0] in ("python", "python3", "accelerate", "torchrun"):
        module = command[command.index("-m") + 1]
        if module == "gpn_cli":
            return command[command.index("-m") + 2 :]
        if module.startswith("modeling_gpn."):
            subcommand = {"modeling_gpn.train": "train"}.get(module, module.rsplit(".", 1)[-1])
            rest = command[command.index("-m") + 2 :]
            return rest if subcommand is None else [subcommand, *rest]
    return None


DOCUMENTED_COMMANDS = [
    pytest.param(arguments, id=f"{block.where}:{' '.join(arguments[:1])}")
    for block in SHELL
    for command in shell_commands(block.code)
    if (arguments := gpn_arguments(command)) is not None
]


def test_the_docs_hold_runnable_blocks_and_gpn_commands():
    """The collection itself works (a change of the fence syntax would silently select nothing)."""
    assert len(RUNNABLE) >= 2, [block.where for block in RUNNABLE]
    assert len(DOCUMENTED_COMMANDS) >= 20
    documented = {param.values[0][0] for param in DOCUMENTED_COMMANDS if param.values[0]}
    from gpn_cli import SUBCOMMANDS

    assert set(SUBCOMMANDS) <= documented, f"subcommands without a documented example: {set(SUBCOMMANDS) - documented}"


@pytest.mark.parametrize("arguments", DOCUMENTED_COMMANDS)
def test_documented_gpn_commands_parse(arguments):
    from gpn_cli import SUBCOMMANDS, build_parser

    assert arguments, "a bare `gpn` with no subcommand"
    subcommand = arguments[0]
    if subcommand in ("--help", "-h"):
        return
    assert subcommand in SUBCOMMANDS, (
        f"`gpn {subcommand}` is documented but is no gpn subcommand ({sorted(SUBCOMMANDS)})"
    )
    parser = build_parser(subcommand)
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(arguments)
        except SystemExit as exit:
            assert exit.code == 0, f"`gpn {' '.join(arguments)}` does not parse: {errors.getvalue().strip()}"


def test_documented_model_folders_are_where_gpn_train_writes_them():
    """A documented command's model is a placeholder (`path/to/...`), a Hub id of the docs' own (`me/...`,
    `user/...`), or where `gpn train` writes a model: `runs/NAME/model` (docs/generate.md used
    `outputs/tiny-shakespeare`, which nothing writes)."""
    from gpn_cli import build_parser

    stale = []
    for param in DOCUMENTED_COMMANDS:
        arguments = param.values[0]
        if not arguments or arguments[0] not in ("generate", "eval", "inspect", "push", "serve"):
            continue
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            parsed = build_parser(arguments[0]).parse_args(arguments)
        model = getattr(parsed, "model", None) or getattr(parsed, "model_dir", None)
        if model and not re.fullmatch(r"path/.*|(me|user)/[^/]+|runs/[^/]+/model", model):
            stale.append(f"{param.id}: {model}")
    assert stale == []


@pytest.mark.parametrize("subcommand", ["generate", "bench", "eval", "push"])
def test_help_gives_each_option_its_default_once(subcommand):
    """`gpn CMD --help` appends an option's default where it has one (`--max-new-tokens ... (default: 64)`);
    an option without one says in its own words what happens when it is not given, so no "(default: None)"
    follows it (for `--temperature`, "(with --sample, default 0.8) (default: None)" contradicted itself), and a flag
    shows none ("--no-stream ... (default: True)" read as if streaming were off by default); nor does a repeatable
    option given nothing ("--tag ... (default: [])")."""
    from gpn_cli import build_parser

    parser = build_parser(subcommand)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[subcommand]
    text = " ".join(sub.format_help().split())
    assert "(default: None)" not in text and "(default: [])" not in text  # (`gpn push --tag`: none unless given)
    assert "(default: True)" not in text and "(default: False)" not in text  # (a flag: --no-stream read as on)
    assert {"generate": "(default: 64)", "bench": "(default: 3)", "eval": "(default: ", "push": "(default: "}[
        subcommand
    ] in text
    if subcommand == "generate":
        assert "generation_config.json's, else 0.8)" in text and "else 0.8) (default" not in text


@pytest.mark.parametrize(
    "subcommand", ["convert", "train", "eval", "push", "inspect", "bench", "study", "generate", "serve"]
)
def test_every_option_has_help_and_the_help_an_example(subcommand):
    """`gpn eval --batch-size` and `gpn bench --device` were listed in --help with nothing said about them; and only
    `gpn train --help` showed a command to start from. Each help now ends with an example, which parses."""
    from gpn_cli import EXAMPLES, available_subcommands, build_parser

    if subcommand not in available_subcommands():
        pytest.skip(f"gpn {subcommand} needs what this environment lacks")
    parser = build_parser(subcommand)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[subcommand]
    assert [a.option_strings for a in sub._actions if a.option_strings and not a.help] == []
    help_text = " ".join(sub.format_help().split())
    if subcommand == "train":  # (its description names it too, beside the recipes; the end had none: README says
        assert "Example: `gpn train --recipe tiny-cpu`" in help_text  # every help ends with one)
    assert help_text.endswith(f"example: {EXAMPLES[subcommand]}"), help_text[-200:]
    arguments = shlex.split(EXAMPLES[subcommand])[1:]  # (the words after `gpn`)
    with contextlib.redirect_stderr(io.StringIO()) as errors:
        try:
            parsed = parser.parse_args(arguments)
        except SystemExit:
            pytest.fail(f"the example of gpn {subcommand} --help does not parse: {errors.getvalue().strip()}")
    assert parsed.command == subcommand


def subcommand_help(subcommand: str) -> str:
    from gpn_cli import build_parser

    parser = build_parser(subcommand)
    return (
        next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[subcommand].format_help()
    )


@pytest.mark.parametrize("columns", [80, 40])
def test_the_help_breaks_no_word_and_keeps_its_paragraphs_and_example(monkeypatch, columns):
    """argparse wraps help text after hyphens too: at 80 columns `gpn train --help` printed "--max-skipped-" and
    "steps" on two lines (and recipe names, paths, `tiny-` / `cpu-llama`), which no search for the option finds;
    `gpn bench --help` printed its paragraphs as written, lines of up to 130 characters; at 40 columns the example
    broke inside its path ("runs/tiny-" / "cpu/model"). Text now wraps at spaces only, to the terminal's width,
    paragraphs kept, and the example is a line of its own, whole."""
    from gpn_cli import EXAMPLES

    monkeypatch.setenv("COLUMNS", str(columns))
    for subcommand in ("train", "bench", "generate"):
        text = subcommand_help(subcommand)
        broken = [line for line in text.splitlines() if re.search(r"[\w]-$", line)]
        assert broken == [], f"gpn {subcommand} --help breaks words after a hyphen: {broken}"
        if subcommand in EXAMPLES:
            assert text.endswith(f"example:\n  {EXAMPLES[subcommand]}\n"), text[-200:]
    bench = subcommand_help("bench")
    assert "\n\nthe byte limit: " in bench and "\n\nthe other columns: " in bench  # (its three paragraphs)
    description = bench.split("\n\n")[1:4]
    too_long = [line for paragraph in description for line in paragraph.splitlines() if len(line) > columns]
    assert too_long == [], too_long


# (subcommand, its own spelling of an option, the other subcommands' spelling it also takes): one option, two names
ALIASES = [
    ("train", "--output-dir", "--output"),
    ("eval", "--output-dir", "--output"),
    ("eval", "--quiet", "--no-progress"),
    ("inspect", "--output", "--output-dir"),
    ("inspect", "--data", "--dataset"),
    ("inspect", "--data-config", "--dataset-config"),
    ("inspect", "--text-column", "--text-field"),
    ("inspect", "--quiet", "--no-progress"),
    ("study", "--output", "--output-dir"),
    ("bench", "--batch", "--batch-size"),
    ("bench", "--segment-length", "--bptt-segment"),
    ("bench", "--threads", "--num-threads"),
]


def test_each_alias_parses_as_the_option_it_spells_and_abbreviations_still_do():
    """A concept spelt differently by two subcommands (`gpn inspect --output`, `gpn eval --output-dir`) takes both
    spellings in each, as one option; and an abbreviation that matches only the two spellings of one option
    (`gpn eval --out`) is still that option, not "ambiguous" as argparse alone would call it (it worked before the
    alias)."""
    from gpn_cli import EXAMPLES, build_parser

    def options(parser: argparse.ArgumentParser, subcommand: str) -> dict[str, argparse.Action]:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[subcommand]
        return sub._option_string_actions

    def parse(subcommand: str, option: str, spelling: str) -> argparse.Namespace:
        """`gpn SUBCOMMAND ... OPTION VALUE`, where OPTION is a way to write `spelling`."""
        base = shlex.split(EXAMPLES[subcommand])[1:] if subcommand in EXAMPLES else [subcommand]
        parser = build_parser(subcommand)
        action = options(parser, subcommand)[spelling]
        value = [] if action.nargs == 0 else ["7"] if action.type is int else ["somewhere"]
        with contextlib.redirect_stderr(io.StringIO()) as errors:
            try:
                return parser.parse_args([*base, option, *value])
            except SystemExit:
                pytest.fail(f"gpn {subcommand} {option}: {errors.getvalue().strip()}")

    for subcommand, spelling, alias in ALIASES:
        spellings = options(build_parser(subcommand), subcommand)  # (an alias, not an abbreviation argparse takes)
        assert alias in spellings and spellings[alias] is spellings[spelling], (subcommand, alias)
        assert vars(parse(subcommand, alias, spelling)) == vars(parse(subcommand, spelling, spelling)), alias
    for subcommand, abbreviation, spelling in [
        ("eval", "--out", "--output-dir"),
        ("inspect", "--text", "--text-column"),
    ]:
        assert vars(parse(subcommand, abbreviation, spelling)) == vars(parse(subcommand, spelling, spelling))


def test_the_training_programs_own_help_gives_each_default_once(capsys):
    """`python -m modeling_gpn.train --help` (what `accelerate launch -m modeling_gpn.train` users read) does not go
    through the `gpn` command, so it needs the same formatter: no "(default: None)", a default where there is one.
    The settings' built-in values read "[built-in: X]"; an unset one says in its own help what unset means, never
    "[built-in: None]" (`--output-dir ... (default runs/<recipe name>) [built-in: None]`)."""
    from modeling_gpn.train.cli import main
    from modeling_gpn.train.settings import OPTIONS

    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exit.value.code == 0 and "(default: None)" not in text and "(default: " in text
    assert "[built-in: None]" not in text and "[built-in: 2048]" in text
    unexplained = [
        option.key
        for option in OPTIONS
        if option.default is None and not re.search(r"\b(unset|default|without it)\b", option.help)
    ]
    assert unexplained == [], "options with no built-in value whose help does not say what unset means"


def test_gpn_version_names_the_installed_package_and_what_it_runs_on(capsys):
    """`gpn --version` (for a bug report): the version pip installed, which `modeling_gpn.__version__` repeats
    (pyproject.toml and the package must not drift apart), and torch's and transformers' versions."""
    from importlib.metadata import version

    import transformers

    import modeling_gpn
    from gpn_cli import main

    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    line = capsys.readouterr().out.strip()
    assert exit.value.code == 0 and modeling_gpn.__version__ == version("gpn")
    assert line.startswith(f"gpn {version('gpn')} (torch {torch.__version__}, transformers {transformers.__version__},")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder holding `me/gpn-tiny`: a tiny GPN and its tokenizer, saved as a user's download would be."""
    from modeling_gpn import GPNForCausalLM
    from modeling_gpn.data import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("docs")
    text = ["ROMEO: But soft, what light through yonder window breaks?", "Once upon a time there was a cat."] * 30
    tokenizer = train_bpe_tokenizer(text, vocab_size=300)
    torch.manual_seed(0)
    model = GPNForCausalLM(
        tiny_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    )
    folder = root / "me" / "gpn-tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return root


@pytest.mark.parametrize("block", RUNNABLE, ids=[block.where for block in RUNNABLE])
def test_runnable_python_blocks_run(block, workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    code = compile(block.code, block.where, "exec")  # a traceback names the page and line
    namespace = {"__name__": "__docs__"}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(code, namespace)  # noqa: S102 - the documentation's own code, run as a reader would


def test_no_install_hint_names_the_unrelated_gpn_package_on_pypi():
    """This package installs from its repository (`pip install -e ".[gpu]"`): `gpn` on PyPI is another project
    (genomic language models), so `pip install 'gpn[serving]'`, which `gpn serve` printed when its extra was
    missing (and docs/gpu.md and the Triton kernels' import error said for `[gpu]`), installs that instead."""
    from ..environment import REPO_ROOT

    files = [REPO_ROOT / "README.md", REPO_ROOT / "CONTRIBUTING.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    for folder in ("modeling_gpn", "eval", "conversion", "benchmarks"):
        files += sorted((REPO_ROOT / folder).rglob("*.py")) + sorted((REPO_ROOT / folder).rglob("*.sh"))
    assert len(files) > 50
    assert [f"{path.relative_to(REPO_ROOT)}" for path in files if "gpn[" in path.read_text()] == []


def heading_anchors(page) -> set[str]:
    """The `#anchors` GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), flags=re.M):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


def test_the_docs_links_and_named_files_exist():
    """Every relative link of README.md, CONTRIBUTING.md and docs/ (reports included) leads to a file (and a
    `#heading` in it to a heading there), and every file of the repository a page names in backticks
    (`benchmarks/serve_ttft.py`) is there: a moved script or a renamed page or heading fails here, naming the page. Links out of the repository (`../shared/GPN.md`) are the
    shared folder's, checked by the tests that read it."""
    from ..environment import REPO_ROOT

    pages = [REPO_ROOT / "README.md", REPO_ROOT / "CONTRIBUTING.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
    from_sdist = {"tests/test_modeling_common.py"}  # transformers' file, fetched by the common-tests test
    missing = []
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if re.match(r"[a-z]+://", target) or not path.is_relative_to(REPO_ROOT):
                continue
            if not path.exists():
                missing.append(f"{page.relative_to(REPO_ROOT)}: link {target}")
            elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path):
                missing.append(f"{page.relative_to(REPO_ROOT)}: link {target} (no such heading)")
        for named in re.findall(
            r"`((?:benchmarks|modeling_gpn|tests|configuration|eval|conversion|docs)/[\w./-]+)`", text
        ):
            if named not in from_sdist and not (REPO_ROOT / named).exists():
                missing.append(f"{page.relative_to(REPO_ROOT)}: `{named}`")
    assert len(pages) > 15 and missing == []


def prose(page) -> str:
    """A page's text outside its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def test_gpn_options_the_docs_prose_names_exist():
    """A `gpn CMD --option ...` written in a page's text, outside the code blocks that
    `test_documented_gpn_commands_parse` parses (`gpn eval --limit N`, `gpn train --reset-at-document-start`),
    names a subcommand and options it has: a renamed option fails here too, naming the page."""
    from gpn_cli import SUBCOMMANDS, build_parser

    options = {}
    stale = []
    for page in DOC_FILES:
        for command, rest in re.findall(r"`gpn ([a-z]+)\b([^`]*)`", prose(page)):
            if command not in SUBCOMMANDS:
                stale.append(f"{page.name}: gpn {command} (no such subcommand)")
                continue
            if command not in options:
                parser = build_parser(command)
                sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
                options[command] = {option for action in sub._actions for option in action.option_strings}
            stale += [
                f"{page.name}: gpn {command} {option}"
                for option in re.findall(r"(?<![\w-])--[a-z][\w-]*", rest)
                if option not in options[command]
            ]
    assert len(options) >= 5 and stale == []


# The libraries whose behaviour the docs state with their version ("Accelerate 1.16 then fails ..."): the version
# named must be the one installed, the one the tests ran that behaviour against (docs/training.md said
# "Accelerate 1.15" for months under 1.16). Names as the pages write them, each with its distribution.
DOCUMENTED_LIBRARIES = {
    "accelerate": "accelerate",
    "datasets": "datasets",
    "lm-eval": "lm_eval",
    "onnx": "onnx",
    "onnxscript": "onnxscript",
    "peft": "peft",
    "torch": "torch",
    "torchao": "torchao",
    "transformers": "transformers",
    "trl": "trl",
}


def test_the_library_versions_the_docs_name_are_the_installed_ones():
    from importlib.metadata import version

    names = "|".join(re.escape(name) for name in DOCUMENTED_LIBRARIES)
    stale, seen = [], 0
    for page in DOC_FILES:
        for name, stated in re.findall(rf"(?<![\w.-])({names}) (\d+\.\d+(?:\.\d+)?)\b", page.read_text(), flags=re.I):
            seen += 1
            installed = version(DOCUMENTED_LIBRARIES[name.lower()]).split("+")[0]
            if installed.split(".")[: stated.count(".") + 1] != stated.split("."):
                stale.append(f"{page.name}: {name} {stated} (installed: {installed})")
    assert seen >= 10 and stale == []


def test_contributing_names_every_file_of_the_model():
    """CONTRIBUTING.md's layout lists the files that ship to the Hub as remote code, each with what it holds:
    `output_layer.py` and `sharding.py` had been added to `modeling_gpn/` without a line there."""
    from ..environment import REPO_ROOT

    layout = (REPO_ROOT / "CONTRIBUTING.md").read_text()
    files = sorted(path.name for path in (REPO_ROOT / "modeling_gpn").glob("*.py") if path.name != "__init__.py")
    assert len(files) > 15 and [name for name in files if f"`{name}`" not in layout] == []


def test_the_python_names_the_docs_give_exist():
    """A name the pages give in backticks as `modeling_gpn.X.Y` or `module.name` (a module of the package:
    `fast_recurrence.fast_project`, `triton_kernels.self_check_failures()`) is there, so a reader can import it:
    `modeling_gpn.RECURRENCE_METHODS` was named for months, which lives in `modeling_gpn.modeling_gpn`.
    (`cache.`, `data.` and `train.` read as a GPNCache, report.json's keys and a file name there, so they are not
    taken for the modules.)"""
    import importlib

    from ..environment import REPO_ROOT

    modules = {path.stem for path in (REPO_ROOT / "modeling_gpn").glob("*.py")} | {
        path.parent.name for path in (REPO_ROOT / "modeling_gpn").glob("*/__init__.py")
    }
    modules -= {"__init__", "cache", "data", "train"}
    missing, seen = [], 0
    for page in DOC_FILES:
        for name in re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)", page.read_text()):
            parts = name.split(".")
            if parts[-1] in ("py", "md", "json", "jsonl", "sh") or parts[0] not in modules | {"modeling_gpn"}:
                continue
            if parts[0] != "modeling_gpn":
                parts = ["modeling_gpn", *parts]
            seen += 1
            for split in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
                try:
                    found = importlib.import_module(".".join(parts[:split]))
                except ImportError:
                    continue
                for attribute in parts[split:]:
                    found = getattr(found, attribute, None)
                break
            if found is None:
                missing.append(f"{page.name}: {name}")
    assert seen >= 15 and missing == []


def lm_eval_options() -> set[str]:
    """The options of lm-eval's own `lm_eval run` parser: docs/evaluation.md names them for plain lm-eval."""
    from lm_eval._cli.run import Run

    subparsers = argparse.ArgumentParser().add_subparsers()
    Run(subparsers)
    return {option for action in subparsers.choices["run"]._actions for option in action.option_strings}


def trl_sft_options() -> set[str]:
    """The options of TRL's `trl sft` command (its parser's dataclasses): docs/fine-tuning.md names them."""
    from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig))
    return {option for action in parser._actions for option in action.option_strings}


def test_accelerate_launch_options_the_docs_name_exist():
    """Every `accelerate launch` of a code block parses with Accelerate's own launcher parser, and every
    Accelerate-style option (`--fsdp_auto_wrap_policy`, `--multi_gpu`) the pages name is one it has (or lm-eval's or
    `trl sft`'s, whose commands the pages name too): the FSDP notes of docs/training.md and docs/fine-tuning.md name
    a dozen of them, which `gpn train`'s parser (`test_documented_gpn_commands_parse`) never sees."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    known = {option for action in parser._actions for option in action.option_strings}
    other_known = lm_eval_options() | trl_sft_options()
    launches = []
    for block in SHELL:
        for command in shell_commands(block.code):
            words = [word for word in command if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", word)]  # (VARIABLE=1)
            if words[:2] == ["accelerate", "launch"]:
                launches.append(words[2:])
    for arguments in launches:
        errors = io.StringIO()
        with contextlib.redirect_stderr(errors):
            try:
                parser.parse_args(arguments)
            except SystemExit as exit:
                raise AssertionError(
                    f"`accelerate launch {' '.join(arguments)}`: {errors.getvalue().strip()}"
                ) from exit
    named = {
        f"{page.name}: {option}"
        for page in DOC_FILES
        for option in re.findall(r"(?<![\w-])(--[a-z0-9]+_[a-z0-9_]+|--multi_gpu|--use_fsdp|--cpu)\b", page.read_text())
        if option not in known and option not in other_known
    }
    assert len(launches) >= 5 and named == set()


def test_a_renamed_option_fails_the_parse_check():
    """The check can fail: an option the parser does not know is reported with the parser's message."""
    with pytest.raises(AssertionError, match="unrecognized arguments: --tokens-to-generate"):
        test_documented_gpn_commands_parse(["generate", "MODEL", "PROMPT", "--tokens-to-generate", "5"])
    with pytest.raises(AssertionError, match="is no gpn subcommand"):
        test_documented_gpn_commands_parse(["chat", "MODEL"])
    assert gpn_arguments(
        ["ACCELERATE_USE_CPU=1", "accelerate", "launch", "-m", "modeling_gpn.train", "--steps", "3"]
    ) == [
        "train",
        "--steps",
        "3",
    ]
