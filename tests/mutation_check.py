"""Mutation check: every test that claims a feature fails when that feature is taken away.

For each mutation below, a copy of the repository is made with one feature removed by editing its source
(the fast path, the C memory kernels, prepacking, the Triton path, the chunked loss, the cache, and the
checks behind the tests that once could not fail), the tests that claim that feature run on the copy, and
a table says, per mutation, how many of them ran and how many failed. Every one of them must fail: a test
that passes with its feature gone does not test it. Exit status 0 only then.

Not part of CI (it runs a slice of the suite once per mutation: about 10 minutes on 2 cores). Run from the
repository root, with the test environment active (and GPN_SHARED_DIR set, as for the tests):

    python tests/mutation_check.py                # all mutations
    python tests/mutation_check.py --only triton  # those whose name contains "triton"
    python tests/mutation_check.py --list         # the mutations and the tests each runs

Each mutation names the exact source text it replaces; when the code moves and the text is gone, the
check says so (and that mutation fails) rather than silently testing nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = {"configuration": "configuration", "conversion": "conversion", "evaluation": "eval"}  # modeling_gpn.X: folder


@dataclass(frozen=True)
class Mutation:
    name: str  # the feature removed
    file: str  # relative to the repository root
    old: str  # source text that must occur exactly once
    new: str  # what replaces it
    tests: tuple[str, ...]  # pytest node ids or `path -k expression` arguments, the tests that claim the feature


FAST_PATH_TESTS = (
    "tests/test_fast_path.py -k (fast_equals_plain_outputs and 7-holes) or inference_fast_path or generate_fast or truncation or segmented",
    "tests/test_triton_kernels.py::test_inference_on_the_triton_path_equals_plain",
    "tests/test_training_graphs.py::test_what_the_sweep_does_not_take_runs_the_fast_path",
)

MUTATIONS = [
    Mutation(
        "fast path (the dispatcher always takes the plain loop)",
        "modeling_gpn/modeling_gpn.py",
        'if not self.use_fast_path or is_tracing():\n            return "plain"',
        'if True:  # MUTATION\n            return "plain"',
        FAST_PATH_TESTS,
    ),
    Mutation(
        "fast path (the plain loop runs, labelled fast)",
        "modeling_gpn/modeling_gpn.py",
        "return fast_recurrence(self, token_inputs, state, mask, output_memory_decays=output_memory_decays)",
        "return self.recurrence_plain(token_inputs, state, mask, output_memory_decays=output_memory_decays)  # MUTATION",
        FAST_PATH_TESTS,
    ),
    Mutation(
        "C memory kernels (never used: the torch ops serve)",
        "modeling_gpn/memory_kernels.py",
        "    if torch.compiler.is_compiling():\n        return False\n    return all(",
        "    if True:  # MUTATION\n        return False\n    return all(",
        (
            "tests/test_fast_path.py -k memory-kernels and (7-holes or nan or segmented)",
            "tests/test_kernel_safety.py -k memory-kernels and (inference_and_cached or backward_called or chunked)",
        ),
    ),
    Mutation(
        "C step kernels (never chosen: the torch-ops steps serve)",
        "modeling_gpn/fast_recurrence.py",
        "    return step_kernels_enabled() and memory_kernels_usable(U)",
        "    return False  # MUTATION",
        ("tests/test_step_kernels.py -k plain_loop or variant or quantization_error or gpn_generate",),
    ),
    Mutation(
        "prepacking (packing fails and falls back to the plain matmul)",
        "modeling_gpn/recurrence_step.py",
        "        self.matrix = matrix\n        self.packed = ",
        '        raise RuntimeError("MUTATION: no prepacking")\n        self.matrix = matrix\n        self.packed = ',
        ("tests/test_fast_path.py::test_prepacked_matrices_match_the_plain_matmul",),
    ),
    Mutation(
        "Triton path (never selected)",
        "modeling_gpn/triton_kernels.py",
        'setting = os.environ.get("GPN_TRITON", "auto")',
        'setting = "0"  # MUTATION',
        (
            "tests/test_triton_kernels.py -k (fast_equals_plain_on_the_triton_path and gpn+m- and holes) or padded_training_batch or inference_on_the_triton",
            "tests/test_training_graphs.py::test_what_the_sweep_does_not_take_runs_the_fast_path",
            "tests/test_training_graphs.py -k training_sweep_equals and gpn+m-None",
        ),
    ),
    Mutation(
        "chunked loss (the loss always from full logits)",
        "modeling_gpn/modeling_gpn.py",
        "if wants_loss and not return_logits:",
        "if False:  # MUTATION",
        (
            "tests/test_fast_path.py::test_causal_lm_loss_and_gradients_with_chunked_loss",
            "tests/test_kernel_safety.py -k chunked_loss_under_autocast",
        ),
    ),
    Mutation(
        "cache (the state is not carried from one call to the next)",
        "modeling_gpn/modeling_gpn.py",
        "state = cache.get_state() if cache is not None else None",
        "state = None  # MUTATION",
        ("tests/test_cache_and_padding.py -k full_equals_token_by_token and (63 or 200)",),
    ),
    Mutation(
        "hub refusal names the field (the loader's error dropped)",
        "modeling_gpn/hub/__init__.py",
        'f"{path} does not load as a GPNConfig: {error}"',
        'f"{path} does not load as a GPNConfig"  # MUTATION',
        ("tests/test_hub.py::test_refusals_name_the_problem",),
    ),
    Mutation(
        "LAMBADA hits scored (the paper's accuracies always 0)",
        "eval/protocols.py",
        '"acc": sum(s.target_is_top1[0] for s in scores) / n,',
        '"acc": 0.0,  # MUTATION',
        ("tests/test_eval.py -k lambada_paper_metrics_match_a_hand",),
    ),
    Mutation(
        "LAMBADA whole-word hits scored (always 0)",
        "eval/protocols.py",
        '"acc_whole_word": sum(all(s.target_is_top1) for s in scores) / n,',
        '"acc_whole_word": 0.0,  # MUTATION',
        ("tests/test_eval.py -k lambada_openai_matches_the_paper",),
    ),
    Mutation(
        "hostile pickles run nothing (the payload runs, then the refusal)",
        "conversion/reference.py",
        "    try:\n        checkpoint = RestrictedUnpickler(",
        "    try:  # MUTATION\n        __import__('pickle').loads(data)\n    except Exception:\n        pass\n"
        "    try:\n        checkpoint = RestrictedUnpickler(",
        (
            "tests/test_faults_io.py -k hostile_pickles and (os-system or eval or inst-opcode)",
            "tests/test_config_and_conversion.py::test_foreign_object_in_pickle_is_refused",
        ),
    ),
    Mutation(
        "converted folder loadable (a weight left out of the saved folder)",
        "conversion/reference.py",
        "        model.save_pretrained(out)\n",
        "        model.save_pretrained(out, state_dict={k: v for k, v in model.state_dict().items() if 'A_log' not in k})  # MUTATION\n",
        ("tests/test_config_and_conversion.py::test_gpn_convert_command_writes_a_loadable_folder",),
    ),
]


def pytest_arguments(spec: str) -> list[str]:
    """`path -k expression` or a node id, as pytest arguments."""
    if " -k " in spec:
        path, expression = spec.split(" -k ", 1)
        return [path, "-k", expression]
    return [spec]


def copy_of_repository(target: Path) -> None:
    """The tracked and untracked (not ignored) files of the repository: the tree as it is, without .venv."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO_ROOT, capture_output=True, check=True
    ).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    # the sub-packages live at the top of the tree (pyproject's package-dir); linked where Python looks for
    # them, so the copy imports its own (the editable install would otherwise supply the unmutated ones)
    for package, folder in SUBPACKAGES.items():
        (target / "modeling_gpn" / package).symlink_to(Path("..") / folder)


def run_tests(root: Path, specs: tuple[str, ...], report: Path) -> tuple[int, int, list[str]]:
    """Run the tests in the copy at `root`: (tests run, tests failed or errored, ids of those that passed)."""
    env = dict(os.environ, PYTHONPATH=str(root))  # the copy's modeling_gpn, not the installed one
    env.setdefault("GPN_SHARED_DIR", str(REPO_ROOT.parent / "shared"))
    ran = failed = 0
    passed: list[str] = []
    for index, spec in enumerate(specs):
        xml = report.with_name(f"{report.stem}-{index}.xml")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *pytest_arguments(spec)]
        subprocess.run(command, cwd=root, env=env, capture_output=True)
        if not xml.exists():
            failed += 1  # pytest itself failed (e.g. a collection error): the run failed
            continue
        outcomes: dict[str, set] = {}  # (a test failing in its call and its teardown is listed twice)
        for case in ElementTree.parse(xml).iter("testcase"):
            outcomes.setdefault(f"{case.get('classname')}::{case.get('name')}", set()).update(child.tag for child in case)
        for test, outcome in outcomes.items():
            if "skipped" in outcome:
                continue
            ran += 1
            if outcome & {"failure", "error"}:
                failed += 1
            else:
                passed.append(test)
    return ran, failed, passed


def check_imports_the_copy(root: Path) -> None:
    """The copy's tests must import the copy's package, or the mutation would not be tested at all."""
    env = dict(os.environ, PYTHONPATH=str(root))
    modules = ["modeling_gpn", *(f"modeling_gpn.{package}" for package in SUBPACKAGES)]
    code = f"import importlib\nfor name in {modules!r}: print(importlib.import_module(name).__file__)"
    found = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    for module, where in zip(modules, found.stdout.split()):
        if not Path(where).absolute().is_relative_to(root.absolute()):
            raise SystemExit(f"the copy imports {module} from {where}, not from {root}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the mutations whose name contains this text")
    parser.add_argument("--list", action="store_true", help="list the mutations and their tests, run nothing")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.only.lower() in m.name.lower()]
    if args.list:
        for mutation in chosen:
            print(f"{mutation.name}: {mutation.file}\n  " + "\n  ".join(mutation.tests))
        return 0
    rows, all_failed = [], True
    with tempfile.TemporaryDirectory(prefix="gpn-mutation-") as scratch:
        for number, mutation in enumerate(chosen):
            root = Path(scratch) / f"m{number}"
            copy_of_repository(root)
            if number == 0:
                check_imports_the_copy(root)
            path = root / mutation.file
            source = path.read_text()
            if source.count(mutation.old) != 1:
                rows.append((mutation.name, 0, 0, [f"source text not found once in {mutation.file}: update the mutation"]))
                all_failed = False
                continue
            path.write_text(source.replace(mutation.old, mutation.new))
            ran, failed, passed = run_tests(root, mutation.tests, Path(scratch) / f"report-{number}.xml")
            all_failed &= ran > 0 and failed == ran and not passed
            rows.append((mutation.name, ran, failed, passed))
            print(f"{mutation.name}: {failed} of {ran} failed", file=sys.stderr, flush=True)
            shutil.rmtree(root)
    width = max(len(row[0]) for row in rows)
    print(f"\n| {'feature removed':<{width}} | tests run | tests failed | passed anyway |")
    print(f"|{'-' * (width + 2)}|-----------|--------------|---------------|")
    for name, ran, failed, passed in rows:
        print(f"| {name:<{width}} | {ran:>9} | {failed:>12} | {', '.join(passed) or '-'} |")
    print("\nevery claiming test failed with its feature removed" if all_failed else "\nSOME TESTS PASSED WITHOUT THEIR FEATURE")
    return 0 if all_failed else 1


if __name__ == "__main__":
    sys.exit(main())
