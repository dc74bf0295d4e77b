"""`gpn push`: the dry-run folder loads with plain transformers, the card parses, the upload gets the right arguments.

The published folder is loaded in a fresh interpreter where `modeling_gpn` cannot be imported (a
`sys.meta_path` finder raises ImportError for it: the editable install would otherwise find it), with
`HF_HUB_OFFLINE=1`. The upload itself is the network boundary: `HfApi.create_repo`, `create_branch` and
`upload_folder` are replaced by recorders, and the test checks what they receive.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ..environment import require_shared
from ..subprocesses import BLOCK_PACKAGE, run_python
from ..tiny_models import perturbed_model, tiny_config

REPO_ID = "someone/gpn-tiny-test"
TOKEN = "hf_TESTtokenDoNotLeak0123456789abcdef"
PROMPT = "The grounded state of a single layer"

EVAL_RESULTS = {  # the schema `gpn eval` writes (eval/cli.py), with made-up numbers
    "schema_version": 1,
    "model": "/somewhere/gpn-tiny-test",
    "n_params": 1050918,
    "dtype": "bfloat16",
    "tasks": {
        "lambada_openai": {
            "acc,none": 0.0125,
            "acc_stderr,none": 0.004,
            "perplexity,none": 2481.5,
            "alias": "lambada_openai",
        },
        "lambada_paper": {"acc": 0.0521, "ppl": 913.25, "acc_whole_word": 0.01, "examples": 40},
        "fineweb_paper": {"ppl": 1204.75, "ppl_excluding_first": 1190.5, "tokens_scored": 8192, "window": 128},
        "wikitext": {"word_perplexity": 3105.5, "bits_per_byte": 2.61},
    },
    "protocols": {
        "lambada_openai": "lm-eval lambada_openai: whole-word greedy match, per-example summed log-likelihood",
        "lambada_paper": "paper LAMBADA: first subword of the last word; ppl = exp(mean CE over last-word subwords)",
        "fineweb_paper": "non-overlapping 2048-token windows from the zero state, all positions",
        "wikitext": "lm-eval loglikelihood_rolling",
    },
    "data": {
        "lambada_openai": "/data/lambada_test.jsonl",
        "fineweb_paper": "hf://HuggingFaceFW/fineweb-edu (sample-10BT, train)",
    },
    "lm_eval_version": "0.4.13",
    "published_baselines": [
        {
            "model": "Transformer++",
            "layers": 12,
            "state_dim": 768,
            "params": 130000000,
            "fineweb_ppl": 16.05,
            "lambada_acc": 0.223,
            "lambada_ppl": 18.99,
        },
        {
            "model": "GPN+M 1-layer",
            "layers": 1,
            "state_dim": 2496,
            "params": 130000000,
            "fineweb_ppl": 18.06,
            "lambada_acc": 0.146,
            "lambada_ppl": 33.45,
        },
    ],
    "comparison": {"measured": {"fineweb_ppl": 1204.75, "lambada_acc": 0.0521, "lambada_ppl": 913.25}},
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny GPN saved with the LLaMA-2 tokenizer, an evaluation JSON and a training log; plus its logits."""
    from transformers import AutoTokenizer

    tokenizer_dir = require_shared("data/llama2-tokenizer")
    folder = tmp_path_factory.mktemp("trained")
    model = perturbed_model(tiny_config(vocab_size=32000, bos_token_id=1, eos_token_id=2))
    model.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(folder)
    (folder / "eval_results.json").write_text(json.dumps(EVAL_RESULTS))
    recipe = {
        "preset": "tiny",
        "data": {"dataset": "HuggingFaceFW/fineweb-edu", "seq_len": 64},
        "optimizer": {"lr": 6e-4, "weight_decay": 0.1, "betas": [0.9, 0.95]},
        "batch_size": 8,
        "hub_token": TOKEN,
        "output_dir": "/home/someone/private/run1",
    }
    (folder / "training_config.json").write_text(json.dumps(recipe))
    rows = [{"step": s, "loss": 10.4 - 0.1 * s, "lr": 6e-4, "tokens": 512 * s} for s in range(1, 21)]
    rows.append({"step": 20, "val_loss": 8.3, "val_ppl": math.exp(8.3)})
    (folder / "train_log.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            logits = model(ids).logits
            generated = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=2)
    finally:
        torch.set_num_threads(threads)
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "dir": folder,
        "ids": ids,
        "logits": logits,
        "generated": generated,
        "n_params": n_params,
        "config": model.config,
    }


@pytest.fixture(scope="module")
def published(source, tmp_path_factory):
    from modeling_gpn.hub import push_folder

    out = tmp_path_factory.mktemp("dry") / "upload"
    push_folder(source["dir"], REPO_ID, dry_run=out, token=TOKEN, tags=["tiny-test"], quiet=True)
    return out


def copy_source(source, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(source["dir"], folder)
    return folder


# --------------------------------------------------------------------------------------------------
# The folder


def imported_siblings(start: Path) -> set[str]:
    """The file names of `start` and of every module it imports relatively, transitively, in any form (`from .x
    import y`, `from . import x`, deferred imports inside functions), read from the syntax tree: what Python will
    import, not what transformers' pattern for relative imports sees."""
    import ast

    found, todo = set(), [start.name]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        for node in ast.walk(ast.parse((start.parent / name).read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                modules = [node.module] if node.module else [alias.name for alias in node.names]
                todo += [f"{module}.py" for module in modules]
    return found


def test_dry_run_folder_holds_exactly_what_the_hub_needs(source, published):
    import modeling_gpn.configuration_gpn as configuration
    import modeling_gpn.modeling_gpn as modeling

    files = sorted(p.name for p in published.iterdir())
    code = sorted(imported_siblings(Path(modeling.__file__)) | imported_siblings(Path(configuration.__file__)))
    assert "configuration_gpn.py" in code and "modeling_gpn.py" in code
    expected = {
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        *code,
    }
    assert set(files) == expected, files
    for name in code:  # every relatively imported file ships, identical to the package's
        assert (published / name).read_bytes() == (Path(modeling.__file__).parent / name).read_bytes()
    assert (published / "model.safetensors").read_bytes() == (source["dir"] / "model.safetensors").read_bytes()
    config = json.loads((published / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_gpn.GPNConfig",
        "AutoModel": "modeling_gpn.GPNModel",
        "AutoModelForCausalLM": "modeling_gpn.GPNForCausalLM",
        "AutoModelForSequenceClassification": "modeling_gpn.GPNForSequenceClassification",
    }
    tokenizer_config = json.loads((published / "tokenizer_config.json").read_text())
    assert "local_files_only" not in tokenizer_config and "is_local" not in tokenizer_config
    for path in published.iterdir():  # no training leftovers, no secrets
        assert TOKEN.encode() not in path.read_bytes(), path.name
        assert not path.name.endswith((".bin", ".pt", ".pth", ".pkl"))


def test_an_upload_folder_holding_the_token_is_refused_without_printing_it(published, tmp_path):
    """The last check before an upload reads every file for the Hub token, streamed in chunks: a token in a file
    copied byte for byte (here the weights' metadata) is refused by the file's name, and a token cut by a chunk's
    end is found across it."""
    from modeling_gpn.hub import HubPushError, check_prepared_folder
    from modeling_gpn.hub.checks import _file_contains

    folder = tmp_path / "upload"
    shutil.copytree(published, folder)
    weights = folder / "model.safetensors"
    save_file(load_file(weights), weights, metadata={"note": TOKEN})
    with pytest.raises(HubPushError, match="^model.safetensors contains the Hub token; refusing to upload it$"):
        check_prepared_folder(folder, token=TOKEN)
    assert _file_contains(weights, [TOKEN.encode()], chunk_size=7)  # (every chunk shorter than the token)
    assert not _file_contains(folder / "config.json", [TOKEN.encode()], chunk_size=7)


def test_published_folder_loads_without_the_package_matches_and_its_card_snippet_runs(source, published, tmp_path):
    """In one fresh interpreter without the package (one start, not two): the folder loads as remote code and
    computes what the model did, and the card's usage snippet runs as written."""
    out = tmp_path / "loaded.safetensors"
    usage = re.search(r"## Usage.*?```python\n(.*?)```", (published / "README.md").read_text(), re.DOTALL)
    assert usage, "the card has no ```python block in a '## Usage' section"
    snippet = usage.group(1)  # (the first one: what a reader would copy)
    assert f'repo = "{REPO_ID}"' in snippet and "trust_remote_code=True" in snippet
    code = BLOCK_PACKAGE + textwrap.dedent(
        f"""
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        folder = {str(published)!r}
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        ids = tokenizer({PROMPT!r}, return_tensors="pt").input_ids
        with torch.no_grad():
            logits = model(ids).logits
            generated = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=2)
        base = AutoModel.from_pretrained(folder, trust_remote_code=True)
        assert type(base).__name__ == "GPNModel"
        leaked = [n for n in sys.modules if n == "modeling_gpn" or n.startswith("modeling_gpn.")]
        assert not leaked, leaked
        save_file({{"ids": ids, "logits": logits.contiguous(), "generated": generated}}, {str(out)!r})
        """
    )
    code += "\n# the card's usage snippet, as written\n" + snippet.replace(f'"{REPO_ID}"', repr(str(published)))
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    loaded = load_file(out)
    assert torch.equal(loaded["ids"], source["ids"])
    assert torch.equal(loaded["logits"], source["logits"])
    assert torch.equal(loaded["generated"], source["generated"])
    assert result.stdout.strip().startswith("The meaning of life is"), result.stdout
    assert "Do you wish to run the custom code" not in result.stdout + result.stderr


# --------------------------------------------------------------------------------------------------
# The card


def test_card_metadata_parses_with_huggingface_hub(source, published):
    from huggingface_hub import ModelCard
    from huggingface_hub.repocard_data import model_index_to_eval_results

    card = ModelCard.load(published / "README.md", ignore_metadata_errors=False)
    data = card.data
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert data.license == "mit"
    assert data.datasets == ["HuggingFaceFW/fineweb-edu"]  # from the training config
    assert {"gpn", "custom_code", "tiny-test"} <= set(data.tags)
    name, results = model_index_to_eval_results(data.to_dict()["model-index"])
    assert name == "gpn-tiny-test"
    got = {r.metric_name: r.metric_value for r in results}
    assert len({(r.unique_identifier, r.metric_type) for r in results}) == len(results)  # none ambiguous
    want = {
        f"{task} {metric.split(',')[0]}": value
        for task, metrics in EVAL_RESULTS["tasks"].items()
        for metric, value in metrics.items()
        if isinstance(value, float) and "stderr" not in metric
    }
    assert "lambada_paper examples" not in got and "lambada_paper acc_whole_word" in got
    assert got == want
    lambada = next(r for r in results if r.metric_name == "lambada_paper acc")
    assert lambada.dataset_type == "EleutherAI/lambada_openai" and lambada.task_type == "text-generation"
    assert lambada.metric_type == "lambada_paper_acc" and lambada.task_name == "lambada_openai, lambada_paper"
    fineweb = next(r for r in results if r.metric_name == "fineweb_paper ppl")
    assert fineweb.metric_type == "ppl"
    assert (fineweb.dataset_type, fineweb.dataset_config, fineweb.dataset_split) == (
        "HuggingFaceFW/fineweb-edu",
        "sample-10BT",
        "train",
    )


def test_card_text_states_architecture_training_and_results_beside_the_paper(source, published):
    text = (published / "README.md").read_text()
    config = source["config"]
    assert f"Parameters: {source['n_params']:,}" in text
    assert f"{config.state_floats_per_row:,} floats" in text and f"{config.memory_cells:,} cells" in text
    # where no compiler builds the kernels, the remote code runs the torch ops without a warning: the card says so
    assert "without a warning, where there is no C compiler. `model.model.last_recurrence_backends` says" in text
    # Training: recipe from training_config.json, last values from train_log.jsonl, secrets and local paths out.
    assert "| optimizer.lr | 0.0006 |" in text and "| data.seq_len | 64 |" in text
    assert "loss = 8.4" in text and "val_loss = 8.3" in text
    assert TOKEN not in text and "hub_token" not in text and "/home/someone" not in text
    # Evaluation: this model's protocol-matched columns beside the published rows of the JSON.
    assert "| **gpn-tiny-test** (this model) | 1 | 48 | 1.1M | 1,204.8 | 0.0521 | 913.2 |" in text
    assert "| Transformer++ (paper) | 12 | 768 | 130.0M | 16.05 | 0.223 | 18.99 |" in text
    assert text.count("(paper) |") == 2  # the JSON's baselines replace the built-in table
    assert "| lambada_openai | acc | 0.0125 ± 0.004 |" in text and "| fineweb_paper | tokens_scored | 8,192 |" in text
    assert "- `lambada_openai`: lm-eval lambada_openai: whole-word greedy match" in text
    # beside the paper's figures, how this run was not the paper's (gpn eval's report flags the same)
    assert (
        "measured by the paper's protocols, but not as the paper ran them: FineWeb PPL over 128-token windows (the "
        "paper's are 2,048); LAMBADA on 40 examples (the paper's are all 5,153); the weights cast to bfloat16" in text
    )
    assert "All results of this model (lm-eval 0.4.13), measured with the weights in bfloat16:" in text


def test_card_says_a_fineweb_figure_of_other_text_is_not_fineweb(source, tmp_path):
    """`fineweb_paper` scored on another corpus (a run's held-out windows of its own text, `--task-data`) filled
    the card's FineWeb PPL column beside the paper's with nothing said."""
    from modeling_gpn.hub import push_folder

    folder = copy_source(source, tmp_path)
    results = json.loads((folder / "eval_results.json").read_text())
    results["data"]["fineweb_paper"] = "/tokens/abc (gpn train's tokens of /data/tinyshakespeare/input.txt)"
    (folder / "eval_results.json").write_text(json.dumps(results))
    text = (push_folder(folder, "gpn-other-text", dry_run=tmp_path / "out", quiet=True).path / "README.md").read_text()
    assert (
        "not as the paper ran them: FineWeb PPL scored on other text than FineWeb-Edu (/tokens/abc (gpn train's "
        "tokens of /data/tinyshakespeare/input.txt)); FineWeb PPL over 128-token windows" in text
    ), text


def test_card_says_lambada_contexts_were_truncated(source, tmp_path):
    """`lambada_paper` with contexts left-truncated to a model's window (`truncated_examples`, `gpn eval
    --max-length`) filled the card's LAMBADA columns beside the paper's, which reads every context whole."""
    from modeling_gpn.hub import push_folder

    folder = copy_source(source, tmp_path)
    results = json.loads((folder / "eval_results.json").read_text())
    results["tasks"]["lambada_paper"]["truncated_examples"] = 67
    (folder / "eval_results.json").write_text(json.dumps(results))
    text = (push_folder(folder, "gpn-cut", dry_run=tmp_path / "out", quiet=True).path / "README.md").read_text()
    assert "LAMBADA with 67 contexts left-truncated to `gpn eval --max-length` (the paper reads them whole)" in text


def test_card_says_the_figures_are_of_quantized_weights(source, tmp_path):
    """An `eval_results.json` of `gpn eval --dtype int4` (its `quantization`): the card's row, the list of what differs
    from the paper's runs and the results' heading say the weights were quantized, and how, so that the figures are
    never read as the float model's."""
    from modeling_gpn.hub import push_folder

    folder = copy_source(source, tmp_path)
    results = json.loads((folder / "eval_results.json").read_text())
    summary = "int4 weight-only (torchao IntxWeightOnlyConfig), groups of 32, 13 linears; head bfloat16"
    results |= {"dtype": "int4", "quantization": {"weights": "int4", "summary": summary}}
    (folder / "eval_results.json").write_text(json.dumps(results))
    text = (push_folder(folder, "gpn-int4", dry_run=tmp_path / "out", quiet=True).path / "README.md").read_text()
    assert "| **gpn-int4** (this model, int4 weights) | 1 | 48 |" in text
    assert f"the weights quantized: {summary} (`gpn eval --dtype int4`)" in text
    assert f"measured with the weights in int4 ({summary}):" in text


def test_card_without_eval_or_training_log_uses_the_paper_table(source, tmp_path):
    from modeling_gpn.hub import push_folder
    from modeling_gpn.hub.model_card import PAPER_TABLE_1

    folder = copy_source(source, tmp_path)
    for name in ("eval_results.json", "training_config.json", "train_log.jsonl"):
        (folder / name).unlink()
    prepared = push_folder(folder, "gpn-bare", dry_run=tmp_path / "out", quiet=True)
    text = (prepared.path / "README.md").read_text()
    assert "model-index" not in prepared.card_metadata and "datasets" not in prepared.card_metadata
    assert "No training log was found" in text and "has not been evaluated yet" in text
    assert text.count("(paper) |") == len(PAPER_TABLE_1)


def test_card_of_gpn_trains_own_output_reads_its_run_folder(source, tmp_path):
    """`gpn train` writes OUTPUT/model beside OUTPUT/train_config.json and OUTPUT/log.jsonl: the card of OUTPUT/model
    said "No training log was found" (it looked for other names, inside the model folder only)."""
    from modeling_gpn.hub import push_folder

    folder = copy_source(source, tmp_path / "run")  # run/model
    for name in ("training_config.json", "train_log.jsonl"):
        (folder / name).unlink()
    settings = {"recipe": "tiny-cpu", "lr": 0.003, "sample_prompt": "ROMEO:\n", "hub_token": TOKEN}
    (tmp_path / "run" / "train_config.json").write_text(json.dumps(settings))
    rows = [{"step": 10, "loss": 7.6, "lr": 0.0015}, {"step": 20, "val_loss": 4.66, "val_ppl": 105.6, "event": "final"}]
    (tmp_path / "run" / "log.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = (push_folder(folder, "gpn-run", dry_run=tmp_path / "out", quiet=True).path / "README.md").read_text()
    assert "| lr | 0.003 |" in text and "| recipe | tiny-cpu |" in text and "| sample_prompt | ROMEO:\\n |" in text
    assert "loss = 7.6" in text and "val_loss = 4.66" in text and TOKEN not in text
    assert "Read from: `../train_config.json`, `../log.jsonl` (2 log rows)." in text
    # the same files beside a folder that is not the run's model (OUTPUT/model) are not its training
    other = folder.rename(tmp_path / "run" / "other")
    text = (push_folder(other, "gpn-run", dry_run=tmp_path / "out2", quiet=True).path / "README.md").read_text()
    assert "No training log was found" in text


def test_a_fine_tunes_folder_keeps_its_base_model_and_gets_every_auto_class(source, tmp_path, capsys):
    """A Trainer or TRL writes README.md beside a fine-tune's weights with its `base_model`; gpn push replaced that
    card with its own, which named no base model, so the Hub showed the fine-tune as trained from scratch. And a
    config saved apart from the model (beside weights an FSDP or Accelerate run wrote) has an auto_map of AutoConfig
    alone: published, AutoModelForSequenceClassification did not load it."""
    from huggingface_hub import ModelCard

    from gpn_cli import main

    folder = copy_source(source, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_gpn.GPNConfig", "AutoModelForTokenClassification": "x.Gone"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "README.md").write_text(  # the metadata TRL's SFTTrainer writes
        "---\nbase_model: someone/gpn-base\nlibrary_name: transformers\nmodel_name: tuned\ntags:\n- trl\n- sft\n"
        "---\n\n# Model Card for tuned\n"
    )
    assert main(["push", str(folder), REPO_ID, "--dry-run", str(tmp_path / "out")]) == 0
    assert ModelCard.load(tmp_path / "out" / "README.md").data.base_model == "someone/gpn-base"
    published_auto_map = json.loads((tmp_path / "out" / "config.json").read_text())["auto_map"]
    assert published_auto_map == json.loads((source["dir"] / "config.json").read_text())["auto_map"]
    capsys.readouterr()
    bad = ["push", str(folder), REPO_ID, "--dry-run", str(tmp_path / "out2"), "--base-model", str(tmp_path)]
    assert main(bad) == 1 and not (tmp_path / "out2").exists()
    assert capsys.readouterr().err.startswith(f"gpn push: --base-model {str(tmp_path)!r} is not a Hub repo id")


def test_paper_columns_without_gpn_evals_comparison_match_protocols_only():
    from modeling_gpn.hub.model_card import model_paper_columns, read_eval_results

    def columns(tasks, protocols=None):
        info = read_eval_results_from({"tasks": tasks, "protocols": protocols or {}})
        return model_paper_columns(info)[0]

    def read_eval_results_from(data):
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "eval_results.json"
            path.write_text(json.dumps(data))
            return read_eval_results(path)

    # lm-eval's lambada_openai measures something else: it never fills the paper's LAMBADA columns.
    assert columns({"lambada_openai": {"acc,none": 0.3, "perplexity,none": 20.0}}) == {}
    assert columns(
        {
            "lambada_paper": {"acc_whole_word": 0.1, "acc": 0.2, "ppl": 30.0},
            "fineweb_paper": {"ppl_excluding_first": 9.0, "ppl": 10.0},
        }
    ) == {
        "lambada_acc": 0.2,
        "lambada_ppl": 30.0,
        "fineweb_ppl": 10.0,
    }
    assert columns({"my_lambada": {"acc": 0.2}}, {"my_lambada": "top-1 of the first subword"}) == {"lambada_acc": 0.2}


def test_validate_card_rejects_broken_metadata():
    from modeling_gpn.hub.model_card import CardError, validate_card

    with pytest.raises(CardError, match="does not parse"):
        validate_card("---\nlibrary_name: [transformers\n---\n# x\n")
    with pytest.raises(CardError, match="pipeline_tag"):
        validate_card("---\nlibrary_name: transformers\n---\n# x\n")
    broken_index = (
        "---\nlibrary_name: transformers\npipeline_tag: text-generation\nmodel-index:\n- name: x\n  results:\n"
        "  - task: {type: text-generation}\n    dataset: {type: d, name: d}\n    metrics:\n    - {type: acc, value: .nan}\n---\n"
    )
    with pytest.raises(CardError, match="non-finite"):
        validate_card(broken_index)


# --------------------------------------------------------------------------------------------------
# Refusals


def test_refusals_name_the_problem(source, tmp_path, capsys):
    from gpn_cli import main

    def refused(folder: Path, *extra: str) -> str:
        out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
        assert main(["push", str(folder), REPO_ID, "--dry-run", str(out), "--token", TOKEN, *extra]) == 1
        assert not out.exists()  # nothing half-written is left behind
        captured = capsys.readouterr()
        assert TOKEN not in captured.out + captured.err
        return captured.err

    def refused_id(repo_id: str) -> str:
        out = tmp_path / "out-repo-id"
        assert main(["push", str(source["dir"]), repo_id, "--dry-run", str(out)]) == 1
        assert not out.exists()
        return capsys.readouterr().err

    for bad_id in ("bad repo id", "owner/two/slashes", "me/name..dots"):  # the Hub's rule, a dry run included
        assert f"{bad_id!r} is not a Hub repo id" in refused_id(bad_id)

    pickled = copy_source(source, tmp_path / "pickle")
    torch.save({"x": torch.zeros(1)}, pickled / "pytorch_model.bin")
    assert "pickle files (pytorch_model.bin)" in refused(pickled)

    bad_config = copy_source(source, tmp_path / "config")
    config = json.loads((bad_config / "config.json").read_text())
    (bad_config / "config.json").write_text(json.dumps(dict(config, hidden_size=-4)))
    refusal = refused(bad_config)
    assert "does not load as a GPNConfig" in refusal and "hidden_size" in refusal  # names the bad field

    (bad_config / "config.json").write_text("{not json")
    assert "not valid JSON" in refused(bad_config)

    (bad_config / "config.json").write_text(json.dumps(dict(config, model_type="llama")))
    assert "model_type 'llama'" in refused(bad_config)

    (bad_config / "config.json").write_text(json.dumps(dict(config, intermediate_size=96)))
    assert "weights do not match config.json" in refused(bad_config)

    (bad_config / "config.json").write_text(json.dumps(dict(config, quantization_config={"quant_method": "torchao"})))
    assert "holds quantized weights (config.json's quantization_config, torchao)" in refused(bad_config)

    adapter = tmp_path / "adapter"  # what PEFT's save_pretrained writes: an adapter, no config.json
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM"}))
    shutil.copyfile(source["dir"] / "model.safetensors", adapter / "adapter_model.safetensors")
    assert "is a PEFT adapter (adapter_config.json), not a whole model" in refused(adapter)

    # save_pretrained into a used folder leaves the last save's index, or its model.safetensors (which transformers
    # loads first), beside the new weights: either was published
    stale = copy_source(source, tmp_path / "stale")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (stale / "model.safetensors.index.json").write_text(json.dumps(index))
    refusal = refused(stale)
    assert "do not agree (its model.safetensors.index.json names model-00001-of-00002" in refusal
    assert "model.safetensors is not in its model.safetensors.index.json" in refusal
    (stale / "model.safetensors.index.json").unlink()
    shutil.copyfile(stale / "model.safetensors", stale / "model-00001-of-00002.safetensors")
    lone_shard = "model-00001-of-00002.safetensors is there with no model.safetensors.index.json naming it"
    assert lone_shard in refused(stale)

    no_weights = copy_source(source, tmp_path / "noweights")
    (no_weights / "model.safetensors").unlink()
    assert "no *.safetensors weights" in refused(no_weights)

    no_tokenizer = copy_source(source, tmp_path / "notok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink()
    assert "pass --tokenizer" in refused(no_tokenizer)
    refusal = refused(no_tokenizer, "--tokenizer", "nobody/no-such-tokenizer")  # offline: transformers' two lines
    assert (
        refusal.startswith("gpn push: cannot load the tokenizer 'nobody/no-such-tokenizer': ")
        and refusal.count("\n") == 1
    ), refusal

    nan_eval = copy_source(source, tmp_path / "naneval")
    (nan_eval / "eval_results.json").write_text(json.dumps({"tasks": {"fineweb_edu": {"perplexity": float("nan")}}}))
    assert "needs finite numbers" in refused(nan_eval)

    wrong_end = copy_source(source, tmp_path / "wrongend")  # LLaMA-2's end of text is 2, "</s>"
    generation = json.loads((wrong_end / "generation_config.json").read_text())
    (wrong_end / "generation_config.json").write_text(json.dumps(dict(generation, eos_token_id=[5, 7])))
    assert "ends generate() at token id 5 ('<0x02>'), 7 ('<0x04>'), not at its tokenizer's end of text 2" in refused(
        wrong_end
    )

    empty = tmp_path / "empty"  # an empty OUT is emptied again: a refusal left the weights and code it had copied
    empty.mkdir()
    assert main(["push", str(no_tokenizer), REPO_ID, "--dry-run", str(empty)]) == 1
    assert "pass --tokenizer" in capsys.readouterr().err and list(empty.iterdir()) == []

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("user data")
    assert main(["push", str(source["dir"]), REPO_ID, "--dry-run", str(taken)]) == 1
    assert "is not empty" in capsys.readouterr().err and (taken / "keep.txt").exists()


def test_a_second_dry_run_into_the_folder_another_is_writing_is_refused_naming_it(
    source, tmp_path, capsys, monkeypatch
):
    """Two `gpn push --dry-run OUT` at once (the same OUT, two models) both found it empty and wrote into it, each
    file the last writer's, in silence. OUT is held from that check to the end of the write: a second dry run
    meanwhile (here while the first prepares the folder) is refused, naming the first's pid. (The first is refused
    after that, which removes the OUT it created: a whole dry run costs seconds.)"""
    import os

    from gpn_cli import main
    from modeling_gpn.hub import HubPushError, push

    out, seen = tmp_path / "upload", {}

    def prepare_beside_another_dry_run(*args, **kwargs):
        seen["other"] = main(["push", str(source["dir"]), REPO_ID, "--dry-run", str(out)])
        seen["said"] = capsys.readouterr().err
        raise HubPushError("refused after the other")

    monkeypatch.setattr(push, "prepare_folder", prepare_beside_another_dry_run)
    assert main(["push", str(source["dir"]), REPO_ID, "--dry-run", str(out)]) == 1
    assert (
        seen["other"] == 1
        and f"--dry-run {out}: {out} is in use by another process (pid {os.getpid()}: " in (seen["said"])
    )
    assert "refused after the other" in capsys.readouterr().err and not out.exists()


def test_remote_code_importing_the_installed_package_is_refused(tmp_path):
    from modeling_gpn.hub import HubPushError, check_remote_code

    (tmp_path / "modeling_gpn.py").write_text(
        "import torch\nfrom .configuration_gpn import GPNConfig\nfrom modeling_gpn.fast import kernel\n"
    )
    (tmp_path / "configuration_gpn.py").write_text("from .helpers import x\n")
    with pytest.raises(HubPushError) as error:
        check_remote_code(tmp_path)
    assert "modeling_gpn.py imports modeling_gpn" in str(error.value)
    assert "configuration_gpn.py imports .helpers, which is not in the folder" in str(error.value)


def test_relative_imports_the_hubs_loader_cannot_follow_are_refused(tmp_path):
    """transformers' remote-code loader ships and fetches only the files its pattern `from .module import` names:
    `from . import helpers` passed the check (helpers.py was never copied, and the published model failed to
    import), as would a package or a module above the folder."""
    from modeling_gpn.hub import HubPushError, check_remote_code

    (tmp_path / "configuration_gpn.py").write_text("import torch\n")
    (tmp_path / "helpers.py").write_text("X = 1\n")
    (tmp_path / "modeling_gpn.py").write_text(
        "import torch\nfrom . import helpers\nfrom .configuration_gpn import GPNConfig\n"
        "def later():\n    from .pkg.checks import check\n    from ..above import thing\n    from .gone import x\n"
    )
    with pytest.raises(HubPushError) as error:
        check_remote_code(tmp_path)
    message = str(error.value)
    assert "modeling_gpn.py line 2: `from . import helpers` is not followed" in message
    assert "modeling_gpn.py line 5 imports .pkg.checks: the remote code is one flat folder" in message
    assert "modeling_gpn.py line 6 imports from ..above, outside the folder" in message
    assert "modeling_gpn.py imports .gone, which is not in the folder" in message
    (tmp_path / "modeling_gpn.py").write_text("import torch\nfrom .helpers import X\n")
    assert check_remote_code(tmp_path) == ["configuration_gpn.py", "helpers.py", "modeling_gpn.py"]


def test_the_remote_codes_kept_parses_are_bounded_the_least_recently_checked_let_go(tmp_path, monkeypatch):
    """What each remote-code file imports is kept by its text for the process's later pushes (`_IMPORTS_OF_TEXT`);
    a process that pushes code edited between pushes kept every text's to its end. Past `IMPORTS_KEPT` texts the
    least recently checked goes: a file checked at every push stays, and each text is still checked as it is."""
    import hashlib

    from modeling_gpn.hub import HubPushError, check_remote_code, checks

    kept: dict = {}
    monkeypatch.setattr(checks, "_IMPORTS_OF_TEXT", kept)  # (this test's alone: others' pushes leave theirs)
    monkeypatch.setattr(checks, "IMPORTS_KEPT", 16)  # (the bound read at each check: fewer pushes to pass it)
    (tmp_path / "configuration_gpn.py").write_text("import torch\n", encoding="utf-8")
    edited, unchanged = tmp_path / "modeling_gpn.py", hashlib.sha256(b"import torch\n").digest()
    for push in range(checks.IMPORTS_KEPT + 8):
        edited.write_text(f"import torch\nfrom .configuration_gpn import GPNConfig\nPUSH = {push}\n", encoding="utf-8")
        check_remote_code(tmp_path)
        assert len(kept) <= checks.IMPORTS_KEPT and unchanged in kept  # (checked at every push: never the least recent)
    assert len(kept) == checks.IMPORTS_KEPT
    edited.write_text("import torch\nimport numpy\n", encoding="utf-8")
    with pytest.raises(HubPushError, match="modeling_gpn.py imports numpy"):
        check_remote_code(tmp_path)


def test_push_takes_a_model_that_ends_only_at_special_tokens_as_generate_and_serve_do(source, tmp_path):
    """A chat model may end generate() at its end of turn, a special token, not at `</s>`: gpn push takes it, as gpn
    generate and gpn serve do (one rule: `cli.loading.end_of_text_disagreement`); an ordinary token is refused."""
    from transformers import AutoTokenizer

    from modeling_gpn.hub.folder import HubPushError, check_end_of_text

    folder = copy_source(source, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(dict(generation, eos_token_id=[1])))  # <s>: special
    check_end_of_text(folder, tokenizer)
    (folder / "generation_config.json").write_text(json.dumps(dict(generation, eos_token_id=[1, 5])))
    with pytest.raises(HubPushError, match="not at its tokenizer's end of text 2"):
        check_end_of_text(folder, tokenizer)


def test_tokenizer_option_adds_a_tokenizer(source, tmp_path):
    from modeling_gpn.hub import push_folder

    folder = copy_source(source, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    tokenizer = str(require_shared("data/llama2-tokenizer"))
    prepared = push_folder(folder, REPO_ID, dry_run=tmp_path / "out", tokenizer=tokenizer, quiet=True)
    assert "tokenizer.json" in prepared.files
    assert tokenizer not in (prepared.path / "README.md").read_text()  # a local path is not a name


# --------------------------------------------------------------------------------------------------
# The network boundary


@pytest.fixture
def hub_calls(monkeypatch, tmp_path):
    """Replace HfApi's network methods with recorders (the thing under test is what they are given)."""
    from huggingface_hub import CommitInfo, HfApi, RepoUrl

    calls: list[tuple[str, dict]] = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", dict(kwargs, repo_id=repo_id, token=self.token)))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_branch(self, repo_id, **kwargs):
        calls.append(("create_branch", dict(kwargs, repo_id=repo_id, token=self.token)))

    def upload_folder(self, **kwargs):
        folder = Path(kwargs["folder_path"])
        snapshot = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        calls.append(("upload_folder", dict(kwargs, token=self.token, snapshot=snapshot)))
        pr = "https://huggingface.co/x/discussions/1" if kwargs.get("create_pr") else None
        return CommitInfo(
            commit_url=f"https://huggingface.co/{kwargs['repo_id']}/commit/abc",
            commit_message="m",
            commit_description="",
            oid="abc",
            pr_url=pr,
        )

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_branch", create_branch)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return calls


def test_upload_gets_the_right_arguments_and_the_dry_run_files(source, published, hub_calls, capsys):
    from gpn_cli import main

    argv = [
        "push",
        str(source["dir"]),
        REPO_ID,
        "--private",
        "--revision",
        "v1",
        "--commit-message",
        "first GPN",
        "--token",
        TOKEN,
        "--tag",
        "tiny-test",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert TOKEN not in captured.out + captured.err
    assert f"Uploaded to https://huggingface.co/{REPO_ID} (revision v1)" in captured.out
    names = [name for name, _ in hub_calls]
    assert names == ["create_repo", "create_branch", "upload_folder"]
    repo, branch, upload = (kwargs for _, kwargs in hub_calls)
    assert repo == {"repo_id": REPO_ID, "repo_type": "model", "private": True, "exist_ok": True, "token": TOKEN}
    assert branch == {"repo_id": REPO_ID, "repo_type": "model", "branch": "v1", "exist_ok": True, "token": TOKEN}
    assert upload["repo_id"] == REPO_ID and upload["revision"] == "v1" and upload["repo_type"] == "model"
    assert upload["commit_message"] == "first GPN" and upload["create_pr"] is False and upload["token"] == TOKEN
    dry_run = {p.name: p.read_bytes() for p in published.iterdir()}
    assert upload["snapshot"] == dry_run  # the upload is exactly the dry-run folder
    assert not any(TOKEN.encode() in data for data in upload["snapshot"].values())
    # a push over an earlier one (sharded weights, pickled weights, another tokenizer) leaves only this one's weights
    # and tokenizer: upload_folder only adds, and transformers loaded a stale shard set's index, a stale chat template,
    # or (`use_safetensors=False`) the stale pickled weights
    from huggingface_hub.utils import filter_repo_objects

    earlier = {
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model.bin.index.json",
        "tokenizer.model",
        "chat_template.jinja",
    }
    own = {".gitattributes", "notes.md", "onnx/model.safetensors"}  # the repo's other files are the user's
    repo = earlier | own | {"model.safetensors", "tokenizer.json", "config.json", "modeling_gpn.py"}
    deleted = set(filter_repo_objects(repo, allow_patterns=upload["delete_patterns"])) - {".gitattributes"}
    after = (repo - deleted) | set(upload["snapshot"])
    assert after == own | set(dry_run), sorted(after ^ (own | set(dry_run)))


def test_upload_as_pull_request_with_defaults(source, hub_calls, capsys):
    from modeling_gpn.hub import push_folder

    push_folder(source["dir"], REPO_ID, create_pr=True, quiet=False)
    assert "Pull request: https://huggingface.co/x/discussions/1" in capsys.readouterr().out
    assert [name for name, _ in hub_calls] == ["create_repo", "upload_folder"]
    repo, upload = (kwargs for _, kwargs in hub_calls)
    assert repo["private"] is None  # not --private: the Hub's default; an existing repo keeps its visibility
    assert upload["create_pr"] is True and upload["revision"] is None
    assert upload["commit_message"] == "Upload gpn-tiny-test (GPN) with gpn push"


@pytest.fixture
def no_network(monkeypatch):
    """The Hub unreachable as on a machine without network (not HF_HUB_OFFLINE, which huggingface_hub answers
    itself): its endpoint is a closed local port, so every request fails in the HTTP client."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")


def word_level_tokenizer(folder: Path) -> Path:
    """A 27-token tokenizer (fits the reference fixtures' vocabulary of 97), saved to `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{chr(ord("a") + i): i + 1 for i in range(26)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<unk>").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("command", ["push", "convert --push-to-hub"])
def test_an_unreachable_hub_is_one_line_not_a_traceback(source, no_network, tmp_path, capsys, command):
    """Without network, huggingface_hub 2's HTTP client (httpx2) raises its own ConnectError, which is no OSError:
    `gpn push` ended in its traceback, and `gpn convert --push-to-hub` in any error of the upload's."""
    from gpn_cli import main

    if command == "push":
        argv = ["push", str(source["dir"]), REPO_ID, "--token", TOKEN]
        prefix = "gpn push: the Hub refused or could not be reached: "
    else:
        fixture = require_shared("fixtures/reference/sot_m_1l")
        tokenizer = str(word_level_tokenizer(tmp_path / "tok"))
        argv = ["convert", str(fixture), str(tmp_path / "out"), "--tokenizer", tokenizer, "--push-to-hub", REPO_ID]
        prefix = f"gpn convert: converted to {tmp_path / 'out'}, but did not publish it: "
    assert main(argv) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("gpn ")]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith(prefix) and TOKEN not in err, err


def test_a_dry_run_into_a_closed_pipe_is_no_hub_error(source, tmp_path, monkeypatch, capsys):
    """`gpn push ... --dry-run OUT | head -1`: printing the file list raised BrokenPipeError, an OSError, which
    ended in "the Hub refused or could not be reached: [Errno 32] Broken pipe" for a run that never met the Hub.
    It stops as `gpn generate` does into a closed pipe (the shell's status of SIGPIPE), its folder written."""
    from gpn_cli import main

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    assert main(["push", str(source["dir"]), REPO_ID, "--dry-run", str(tmp_path / "out")]) == 141
    assert capsys.readouterr().err == "" and (tmp_path / "out" / "README.md").is_file()


def test_push_help_lists_every_option(capsys):
    from gpn_cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["push", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--private", "--revision", "--commit-message", "--token", "--create-pr", "--dry-run", "--tokenizer"):
        assert option in text


def test_convert_push_to_hub_publishes_the_converted_checkpoint(hub_calls, tmp_path, capsys):
    """`gpn convert SRC OUT --push-to-hub REPO` ends in the same checked upload."""
    from gpn_cli import main

    fixture = require_shared("fixtures/reference/sot_m_1l")
    word_level_tokenizer(tmp_path / "tok")

    out = tmp_path / "converted"
    # without a tokenizer gpn push refuses the folder: said before a conversion that could not be published
    assert main(["convert", str(fixture), str(out), "--push-to-hub", "someone/gpn-ref"]) == 1
    assert capsys.readouterr().err.startswith("gpn convert: --push-to-hub needs --tokenizer")
    assert not out.exists() and hub_calls == []
    assert (
        main(
            [
                "convert",
                str(fixture),
                str(out),
                "--tokenizer",
                str(tmp_path / "tok"),
                "--push-to-hub",
                "someone/gpn-ref",
            ]
        )
        == 0
    )
    assert [name for name, _ in hub_calls] == ["create_repo", "upload_folder"]
    upload = hub_calls[-1][1]
    assert upload["repo_id"] == "someone/gpn-ref"
    assert {"model.safetensors", "config.json", "modeling_gpn.py", "tokenizer.json", "README.md"} <= set(
        upload["snapshot"]
    )
    assert upload["snapshot"]["model.safetensors"] == (out / "model.safetensors").read_bytes()
    card = upload["snapshot"]["README.md"].decode()
    assert "Parameters: 30,022" in card  # the reference's own count
    # the card names what was converted (it said "No training log was found", as of weights of unknown origin)
    assert "Converted with `gpn convert` from the reference implementation's" in card
    assert "checkpoint `sot_m_1l` (params.npz)" in card and "No training log" not in card
    # generate() ends at the tokenizer's end of text (<unk>, 0 here), not at the config's LLaMA-2 default 2 ("b")
    config, generation = (json.loads(upload["snapshot"][name]) for name in ("config.json", "generation_config.json"))
    assert config["eos_token_id"] == generation["eos_token_id"] == generation["pad_token_id"] == 0
    assert config.get("bos_token_id") is None and generation.get("bos_token_id") is None


def test_a_limited_evaluation_is_not_published_as_the_whole_test_split(tmp_path):
    """`gpn eval --limit 2` scored 2 LAMBADA examples; the card's model-index said `split: test` (the Hub shows that
    as the test set's score), and put fineweb_paper's `first_window` index among the metrics."""
    from huggingface_hub.repocard_data import model_index_to_eval_results

    from modeling_gpn.hub.card_metadata import eval_results_for_model_index, validate_card
    from modeling_gpn.hub.model_card import read_eval_results, results_lines

    results = json.loads(json.dumps(EVAL_RESULTS))
    results["limit"] = 2
    results["tasks"]["fineweb_paper"]["first_window"] = 0
    path = tmp_path / "eval_results.json"
    path.write_text(json.dumps(results))
    evaluation = read_eval_results(path)
    splits = {(r.metric_name, r.dataset_split) for r in eval_results_for_model_index(evaluation)}
    assert ("lambada_paper acc", "test[:2]") in splits and ("lambada_openai acc", "test[:2]") in splits
    assert ("wikitext word_perplexity", "test[:2]") in splits
    assert ("fineweb_paper ppl", "train") in splits  # --limit does not cut fineweb_paper's windows
    assert not any(name == "fineweb_paper first_window" for name, _ in splits)
    assert any("Scored on the first 2 examples" in line for line in results_lines(evaluation))
    # the Hub reads the sliced split back as it was written
    from huggingface_hub import ModelCard, ModelCardData

    card = ModelCard.from_template(
        ModelCardData(
            library_name="transformers",
            pipeline_tag="text-generation",
            model_name="m",
            eval_results=eval_results_for_model_index(evaluation),
        )
    )
    _, read_back = model_index_to_eval_results(validate_card(str(card))["model-index"])
    assert {r.dataset_split for r in read_back} == {"test[:2]", "train"}


def test_eval_results_from_gpn_evals_own_folder_and_another_models_refused(source, tmp_path, capsys):
    """gpn eval writes ./eval-NAME/ unless told otherwise, and gpn push read only MODEL_DIR/eval_results.json; one
    copied beside other weights (another parameter count) was published, model-index and all, as theirs."""
    from gpn_cli import main

    folder = copy_source(source, tmp_path)
    evaluation = tmp_path / "eval-model" / "eval_results.json"
    evaluation.parent.mkdir()
    (folder / "eval_results.json").rename(evaluation)
    out = tmp_path / "out"
    assert main(["push", str(folder), REPO_ID, "--dry-run", str(out), "--eval-results", str(evaluation)]) == 0
    assert "lambada_paper acc" in (out / "README.md").read_text()
    assert not (out / "eval_results.json").exists()
    capsys.readouterr()
    missing = tmp_path / "eval-other" / "eval_results.json"
    assert (
        main(["push", str(folder), REPO_ID, "--dry-run", str(tmp_path / "out2"), "--eval-results", str(missing)]) == 1
    )
    assert capsys.readouterr().err.startswith(f"gpn push: --eval-results {missing} is not a file")
    other = json.loads(evaluation.read_text())
    other["n_params"] += 1
    (folder / "eval_results.json").write_text(json.dumps(other))
    assert main(["push", str(folder), REPO_ID, "--dry-run", str(tmp_path / "out3")]) == 1
    assert f"evaluated a model of {other['n_params']:,} parameters" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()
