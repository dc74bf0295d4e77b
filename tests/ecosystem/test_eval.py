"""`gpn eval` and the GPN task set on the real lm-eval-harness, offline, with a tiny GPN (and a tiny Llama).

Data: the project's shared LAMBADA (first 40 examples), FineWeb-Edu sample and WikiText-2 test file.
Windows are 128 tokens here (the paper's 2048 is only a default) to keep the file fast on 2 cores.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from ..environment import require_shared
from ..tiny_models import perturbed_model, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

LIMIT = 40
WINDOW = 128


@pytest.fixture(scope="module")
def data():
    return require_shared("data")


def predicting_everywhere(model, token_id: int):
    """`model` with its decoder bias set so that `token_id` is the greedy prediction at every position (its
    embedding row made the longest, the bias along it): a tiny model that scores LAMBADA hits, so the
    accuracies below compare non-zero values (a random tiny model scores 0 on all of them)."""
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        row = embedding[token_id]
        row.mul_(2 * embedding.norm(dim=1).max() / row.norm())
        # logit of v = (W norm(h) + b) . e_v: 12 for the token, at most 6 for any other, +- the small W part
        model.model.decode_proj.bias.copy_(12 * row / row.norm() ** 2)
    return model


def single_token_target(tokenizer, data) -> int:
    """The target of the first of the LAMBADA examples whose last word is one token."""
    from modeling_gpn.evaluation import protocols
    from modeling_gpn.evaluation.runner import load_texts

    for text in load_texts(str(data / "lambada" / "lambada_test.jsonl"), None, "text", limit=6):
        targets = protocols.encode_lambada(tokenizer, text).target_ids
        if len(targets) == 1:
            return targets[0]
    raise AssertionError("none of the first 6 LAMBADA examples ends in a one-token word")


@pytest.fixture(scope="module")
def gpn_dir(tmp_path_factory, data):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("gpn")
    tokenizer = AutoTokenizer.from_pretrained(data / "llama2-tokenizer")
    # (LLaMA-2's end of text: a config ending generate() elsewhere is warned of)
    model = perturbed_model(
        tiny_config(vocab_size=32000, max_length_hint=WINDOW, use_decoder_bias=True, eos_token_id=2, bos_token_id=1)
    )
    predicting_everywhere(model, single_token_target(tokenizer, data)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def loaded(gpn_dir):
    from modeling_gpn.evaluation.runner import load_model

    return load_model(str(gpn_dir))


def settings(data, batch_size, tasks, **overrides):
    from modeling_gpn.evaluation.runner import EvalSettings

    values = dict(
        tasks=list(tasks),
        data_dir=str(data),
        batch_size=batch_size,
        limit=LIMIT,
        fineweb_window=WINDOW,
        fineweb_max_windows=12,
        progress=False,
    )
    values.update(overrides)
    return EvalSettings(**values)


@pytest.fixture(scope="module")
def runs(gpn_dir, loaded, data):
    """The LAMBADA pair and the FineWeb protocol at batch size 1 and 8 (one model, loaded once)."""
    from modeling_gpn.evaluation.runner import evaluate

    model, tokenizer = loaded
    tasks = ("lambada_openai", "lambada_paper", "fineweb_paper")
    return {bs: evaluate(str(gpn_dir), settings(data, bs, tasks), model, tokenizer) for bs in (1, 8)}


def assert_same_metrics(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for task in a:
        assert a[task].keys() == b[task].keys(), task
        for metric, value in a[task].items():
            if isinstance(value, int) or metric.startswith("acc"):
                assert value == b[task][metric], (task, metric)
            else:  # the same sums in a different batch shape: equal to float64 rounding of float32 logits
                assert value == pytest.approx(b[task][metric], rel=1e-6), (task, metric)


# --------------------------------------------------------------------------------------------------
# Batch size invariance, paper variants against hand computations
# --------------------------------------------------------------------------------------------------


def test_batch_size_1_and_8_give_identical_metrics(runs):
    assert_same_metrics(runs[1]["tasks"], runs[8]["tasks"])
    lambada = runs[8]["tasks"]["lambada_paper"]
    assert lambada["examples"] == LIMIT and lambada["target_tokens"] >= LIMIT
    assert (
        0 < lambada["acc"] < 1 and 0 < lambada["acc_whole_word"] < 1
    )  # hits and misses: the equalities mean something
    assert 0 < runs[8]["tasks"]["lambada_openai"]["acc"] < 1
    assert runs[8]["tasks"]["fineweb_paper"]["windows"] == 12


def test_lambada_openai_matches_the_paper_variant_on_the_same_tokens(runs):
    """lm-eval's per-example summed NLL and whole-word greedy match, recomputed by the paper variant."""
    measured = runs[8]["tasks"]
    assert measured["lambada_paper"]["ppl_per_example"] == pytest.approx(
        measured["lambada_openai"]["perplexity"], rel=1e-5
    )
    assert measured["lambada_paper"]["acc_whole_word"] == measured["lambada_openai"]["acc"] > 0  # a hit is scored


def test_lm_eval_scores_a_bfloat16_model_from_float32_logits(gpn_dir, data):
    """With --dtype bfloat16 lm-eval's log-likelihoods are those of the model's logits (as the paper variant
    scores them, in float64), not rounded to bfloat16 by a log-softmax and a sum taken in the logits' dtype
    (-18.23 read as -18.25: the perplexities below would differ by about 1%)."""
    from modeling_gpn.evaluation.runner import evaluate, load_model

    model, tokenizer = load_model(str(gpn_dir), dtype="bfloat16")
    assert model(input_ids=torch.tensor([[1, 2]])).logits.dtype == torch.bfloat16  # what lm-eval would round
    # batch size 1: both protocols run each example alone, so they see the very same bfloat16 logits
    options = settings(data, 1, ("lambada_openai", "lambada_paper"), limit=8, dtype="bfloat16")
    measured = evaluate(str(gpn_dir), options, model, tokenizer)["tasks"]
    assert measured["lambada_paper"]["ppl_per_example"] == pytest.approx(
        measured["lambada_openai"]["perplexity"], rel=1e-5
    )


# (measured on this tiny model, 8 examples: int8 0.07%, int4 0.5% off the bfloat16 run's LAMBADA perplexity; 1% and
# 5% leave room for another CPU's rounding, while an unquantized run is equal and a wrongly scaled one far off)
QUANTIZED_PPL_TOLERANCE = {"int8": 0.01, "int4": 0.05}


def test_gpn_eval_quantized_scores_near_the_bfloat16_model_and_says_so(gpn_dir, data, tmp_path):
    """`gpn eval --dtype int8 | int4` quantizes the bfloat16 model as gpn generate does and scores it on the fast
    path: its LAMBADA perplexity is near the bfloat16 run's, and not equal to it (a quantization skipped in silence
    would give the bfloat16 figures under an int8 label); the results and the report name the quantization, the
    measured row too, so that the row is never read as the float model's."""
    from gpn_cli import main
    from modeling_gpn.evaluation.runner import evaluate, load_model

    from ..backend_observer import FAST_PATH, PLAIN_PATH, ran
    from ..environment import require_c_kernels

    require_c_kernels()
    options = settings(data, 8, ("lambada_paper",), limit=8, dtype="bfloat16")
    reference = evaluate(str(gpn_dir), options, *load_model(str(gpn_dir), dtype="bfloat16"))
    assert reference["quantization"] is None
    bf16_ppl = reference["tasks"]["lambada_paper"]["ppl"]
    argv = ["eval", str(gpn_dir), "--data-dir", str(data), "--tasks", "lambada_paper", "--limit", "8", "--quiet"]
    for kind, tolerance in QUANTIZED_PPL_TOLERANCE.items():
        out = tmp_path / kind
        with ran(FAST_PATH, not_ran=(PLAIN_PATH,)):
            assert main([*argv, "--dtype", kind, "--output-dir", str(out)]) == 0
        results = json.loads((out / "eval_results.json").read_text(encoding="utf-8"))
        ppl = results["tasks"]["lambada_paper"]["ppl"]
        assert ppl != bf16_ppl and ppl == pytest.approx(bf16_ppl, rel=tolerance), (kind, ppl, bf16_ppl)
        quantization = results["quantization"]
        assert results["dtype"] == quantization["weights"] == kind and quantization["head"] == "bfloat16"
        # every nn.Linear of the tiny GPN but the tied head (int4: groups of 32, a 48-long row whole)
        assert quantization["quantized_linears"] == 13
        assert quantization["group_sizes"] == ([32, 48] if kind == "int4" else [32, 48, 64])  # (int8: whole rows)
        report = (out / "eval_report.md").read_text(encoding="utf-8")
        assert f"weights quantized: {quantization['summary']}" in report
        assert f"| **{gpn_dir}** ({kind} weights) | measured |" in report


def test_the_quantization_recorded_tells_int4_groups_from_whole_rows():
    """The results' `quantization` (`cli.quantization.quantization_of`) names int4's groups by the rows they split,
    and the rows no group divides as whole: a model of hidden size 16 has rows of 16, 32, 48 and 64, of which only
    the 64-long ones are split (into 32s). Read from the sizes alone, the smallest taken for the group, this model
    was named "groups of 16"."""
    pytest.importorskip("torchao.quantization", reason="--dtype int4 quantizes with torchao (the test extra)")
    from modeling_gpn.bench.models import perturbed_gpn, tiny_config
    from modeling_gpn.cli.quantization import quantization_of, quantize_int4

    quantization = quantization_of(quantize_int4(perturbed_gpn(tiny_config(hidden_size=16)).to(torch.bfloat16)))
    assert quantization["group_sizes"] == [16, 32, 48]
    assert ", groups of 32 (rows of 16, 48: whole), 13 linears;" in quantization["summary"], quantization["summary"]


def test_gpn_eval_quantized_without_torchao_is_one_line(gpn_dir, tmp_path, capsys, monkeypatch):
    """`--dtype int8` where torchao cannot be imported: one line naming what to install, exit status 2 (no
    traceback), before the model loads, nothing written."""
    from gpn_cli import main

    for name in ("torchao", "torchao.quantization"):  # (as if not installed: importing it fails)
        monkeypatch.setitem(sys.modules, name, None)
    out = tmp_path / "out"
    assert main(["eval", str(gpn_dir), "--tasks", "lambada_paper", "--dtype", "int8", "--output-dir", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("gpn eval: error: --dtype int8 needs torchao (pip install") and error.count("\n") == 1
    assert not out.exists()


def last_word_token_positions(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """Tokens of `text` whose characters lie in its last word, found through the offset mapping
    (independently of the context/target split the implementation uses)."""
    encoded = tokenizer(text, return_offsets_mapping=True)
    last_word_start = text.rindex(" ") + 1
    positions = [i for i, (start, end) in enumerate(encoded["offset_mapping"]) if end > last_word_start]
    return encoded["input_ids"], positions


def test_lambada_paper_metrics_match_a_hand_computation(loaded, data):
    from modeling_gpn.evaluation import protocols
    from modeling_gpn.evaluation.runner import load_texts

    model, tokenizer = loaded
    texts = load_texts(str(data / "lambada" / "lambada_test.jsonl"), None, "text", limit=6)
    assert load_texts(str(data / "lambada" / "lambada_test.jsonl"), None, "text", limit=2, skip=4) == texts[4:6]
    total_nll, total_tokens, first_hits = 0.0, 0, 0
    for text in texts:
        ids, positions = last_word_token_positions(tokenizer, text)
        assert positions and positions == list(range(positions[0], len(ids)))
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        logprobs = F.log_softmax(logits, dim=-1)
        for position in positions:  # logits[t] predicts token t+1
            total_nll -= logprobs[position - 1, ids[position]].item()
        total_tokens += len(positions)
        first = positions[0]
        first_hits += int(logits[first - 1].argmax().item() == ids[first])

    examples = [protocols.encode_lambada(tokenizer, text) for text in texts]
    metrics = protocols.lambada_metrics(protocols.score_lambada(model, examples, batch_size=4, progress=False))
    assert metrics["target_tokens"] == total_tokens
    assert metrics["ppl"] == pytest.approx(math.exp(total_nll / total_tokens), rel=1e-6)
    assert first_hits > 0, "no hit: the accuracy check would compare 0 with 0"
    assert metrics["acc"] == first_hits / len(texts)
    # pooled over tokens is not the per-example mean: the two differ whenever words have several subwords
    assert metrics["ppl_per_example"] != pytest.approx(metrics["ppl"], rel=1e-3)


def test_lambada_first_subword_accuracy_counts_a_hit(loaded):
    """The paper's LAMBADA accuracy counts an example whose last word's first subword is the model's top token a
    hit, whatever its other subwords: "doormat" is three (▁do orm at), only the first of them the model's top one.
    (The position each target is read at: test_lambada_paper_metrics_match_a_hand_computation, whose perplexity
    moves with it; this model's top token is the same at every position.)"""
    from modeling_gpn.evaluation import protocols

    model, tokenizer = loaded
    example = protocols.encode_lambada(tokenizer, "the cat sat on the mat and the dog sat on the doormat")
    assert len(example.target_ids) == 3
    with torch.no_grad():
        row = example.context_ids
        top = model(input_ids=torch.tensor([row])).logits[0, -1].argmax().item()
    forced = protocols.LambadaExample(context_ids=example.context_ids, target_ids=[top] + example.target_ids[1:])
    missed = protocols.LambadaExample(context_ids=example.context_ids, target_ids=[(top + 1) % 32000])
    scores = protocols.score_lambada(model, [forced, missed], batch_size=2, progress=False)
    assert scores[0].target_is_top1 == [True, False, False]  # (the first subword hit, the others missed)
    metrics = protocols.lambada_metrics(scores)
    assert metrics["acc"] == 0.5 and metrics["acc_whole_word"] == 0.0


def test_fineweb_windows_match_a_direct_forward_computation(loaded, data, runs):
    from modeling_gpn.evaluation import protocols
    from modeling_gpn.evaluation.runner import load_texts

    model, tokenizer = loaded
    texts = load_texts(str(next((data / "fineweb-edu").glob("*.jsonl"))), None, "text")
    stream = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(stream) >= 12 * WINDOW:
            break
    first_nll, rest_nll = 0.0, 0.0
    for w in range(12):
        window = torch.tensor(stream[w * WINDOW : (w + 1) * WINDOW])
        with torch.no_grad():
            logits = model(input_ids=window[None]).logits[0].double()
            # the reference's position 0: the prediction of the zero state, before any token
            empty = model.decode(torch.zeros(1, model.config.hidden_size))[0].double()
        first_nll -= F.log_softmax(empty, -1)[window[0]].item()
        rest_nll += F.cross_entropy(logits[:-1], window[1:], reduction="sum").item()

    measured = runs[8]["tasks"]["fineweb_paper"]
    assert measured["ppl_all_positions"] == pytest.approx(math.exp((first_nll + rest_nll) / (12 * WINDOW)), rel=1e-6)
    assert measured["ppl_excluding_first"] == pytest.approx(math.exp(rest_nll / (12 * (WINDOW - 1))), rel=1e-6)
    assert measured["ppl"] == measured["ppl_all_positions"] and measured["tokens_scored"] == 12 * WINDOW
    direct = protocols.windowed_perplexity(
        model, stream, WINDOW, 5, max_windows=12, first_position="skip", progress=False
    )
    assert direct["ppl"] == pytest.approx(measured["ppl_excluding_first"], rel=1e-6)


def test_held_out_fraction_scores_gpn_train_held_out_windows_of_a_real_corpus(gpn_dir, tmp_path, capsys):
    """`gpn eval --fineweb-held-out-fraction` on a corpus of more documents than the default cap (2000) and with
    blank rows: it used to score the last windows of the first 2000 documents, every one a training window
    (measured: 102 of 102), and a blank row added an EOS that gpn train leaves out, shifting every window."""
    from transformers import AutoTokenizer

    from gpn_cli import main
    from modeling_gpn.data import CorpusSpec, WindowDataset, build_token_stream

    words = "the of and to in that is was he for it with as his on be at by".split()
    corpus = tmp_path / "corpus.jsonl"
    with corpus.open("w") as out:
        for index in range(2600):
            text = (
                "" if index % 97 == 5 else " ".join(words[(index * 7 + k) % len(words)] for k in range(3 + index % 5))
            )
            out.write(json.dumps({"text": text}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(gpn_dir)
    stream = build_token_stream(CorpusSpec(source=str(corpus)), tokenizer, tmp_path / "cache", show_progress=False)
    windows = WindowDataset(stream, 16, 0.01, seed=0)  # what gpn train --seq-len 16 --val-fraction 0.01 holds out
    common = ["eval", str(gpn_dir), "--tasks", "fineweb_paper", "--task-data", f"fineweb_paper={corpus}"]
    common += ["--fineweb-window", "16", "--fineweb-held-out-fraction", "0.01", "--quiet"]
    common += ["--cache-dir", str(tmp_path / "cache")]
    assert main([*common, "--output-dir", str(tmp_path / "out")]) == 0
    results = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    scored = results["tasks"]["fineweb_paper"]
    assert (scored["first_window"], scored["windows"]) == (windows.num_train, windows.num_val)
    assert scored["documents"] == stream.meta["documents"]
    assert results["token_cache"] == {"fineweb_paper": str(stream.folder)}  # gpn train's tokens, not tokenized again
    # a folder, as gpn train reads it (recursively, leaving out Jupyter's copies): its held-out windows too
    folder = tmp_path / "folder"
    (folder / "b" / ".ipynb_checkpoints").mkdir(parents=True)
    shutil.copy(corpus, folder / "b" / "corpus.jsonl")
    shutil.copy(corpus, folder / "b" / ".ipynb_checkpoints" / "corpus-checkpoint.jsonl")
    (folder / "a.txt").write_text("the first of the files\n" * 40)
    stream = build_token_stream(CorpusSpec(source=str(folder)), tokenizer, tmp_path / "cache", show_progress=False)
    windows = WindowDataset(stream, 16, 0.01, seed=0)
    common[5] = f"fineweb_paper={folder}"
    assert main([*common, "--output-dir", str(tmp_path / "out-folder")]) == 0
    scored = json.loads((tmp_path / "out-folder" / "eval_results.json").read_text())["tasks"]["fineweb_paper"]
    assert (scored["first_window"], scored["windows"], scored["documents"]) == (
        windows.num_train,
        windows.num_val,
        stream.meta["documents"],
    )
    # the documents cut elsewhere than gpn train cuts them: refused, naming the option
    assert main([*common, "--fineweb-max-documents", "2000", "--output-dir", str(tmp_path / "out2")]) == 2
    assert "--fineweb-max-documents 2000 would cut the token stream elsewhere" in capsys.readouterr().err
    # documents joined otherwise than gpn train joins them (with EOS): refused too
    assert main([*common, "--fineweb-separator", "bos", "--output-dir", str(tmp_path / "out2")]) == 2
    assert "--fineweb-separator bos would shift every window" in capsys.readouterr().err
    # a Hub corpus (the default): its held-out windows need gpn train's token count, else all of it is streamed
    hub = ["eval", str(gpn_dir), "--tasks", "fineweb_paper", "--fineweb-held-out-fraction", "0.01"]
    assert main([*hub, "--output-dir", str(tmp_path / "out3")]) == 2
    assert "pass --fineweb-max-tokens" in capsys.readouterr().err and not (tmp_path / "out3").exists()
    # a run's own token stream, whatever its corpus (a Hub one too, offline): its held-out windows, read from it
    cached = [*hub, "--fineweb-window", "16", "--quiet", "--fineweb-token-cache", str(stream.folder)]
    assert main([*cached, "--output-dir", str(tmp_path / "out4")]) == 0
    results = json.loads((tmp_path / "out4" / "eval_results.json").read_text())
    scored = results["tasks"]["fineweb_paper"]
    assert (scored["first_window"], scored["windows"]) == (windows.num_train, windows.num_val)
    assert results["token_cache"] == {"fineweb_paper": str(stream.folder)}
    named = f"{stream.folder} (gpn train's tokens of {(folder / 'a.txt').resolve()} and 1 more files)"
    assert results["data"]["fineweb_paper"] == named  # (the model card says it is not FineWeb-Edu)
    # beside an option that cuts the documents, of another tokenizer, or not a token cache: refused, saying why
    other_tokenizer = tmp_path / "other-tokenizer-cache"
    shutil.copytree(stream.folder, other_tokenizer)
    meta = json.loads((other_tokenizer / "meta.json").read_text())
    (other_tokenizer / "meta.json").write_text(json.dumps({**meta, "tokenizer": "another"}))
    for changed, needle in (
        (["--fineweb-max-tokens", "100"], "--fineweb-max-tokens would be ignored beside it"),
        (["--fineweb-token-cache", str(other_tokenizer)], "holds the tokens of another tokenizer than the model's"),
        (["--fineweb-token-cache", str(tmp_path)], "is not a gpn train token cache"),
    ):
        assert main([*cached, *changed, "--output-dir", str(tmp_path / "out5")]) == 2, changed
        assert needle in capsys.readouterr().err and not (tmp_path / "out5").exists()


def test_fineweb_stream_leaves_out_blank_documents_as_gpn_train_does(gpn_dir):
    """A blank row added an EOS that gpn train's stream does not hold, shifting every later window (a Hub
    source or a list of files, which go through eval's own reader)."""
    from transformers import AutoTokenizer

    from modeling_gpn.evaluation import protocols

    tokenizer = AutoTokenizer.from_pretrained(gpn_dir)
    with_blanks, used = protocols.token_stream(tokenizer, ["one two", "", "  \n", "three"])
    assert (with_blanks, used) == protocols.token_stream(tokenizer, ["one two", "three"])


def test_held_out_fraction_scores_the_last_windows_like_gpn_train(loaded):
    from modeling_gpn.evaluation import protocols

    model, _ = loaded
    torch.manual_seed(1)
    stream = torch.randint(3, 32000, (10 * 32 + 7,)).tolist()
    held_out = protocols.windowed_perplexity(model, stream, 32, 4, held_out_fraction=0.25, progress=False)
    # 10 windows, floor(10 * 0.25) = 2 held out: windows 8 and 9 (modeling_gpn.data.WindowDataset's split)
    assert held_out["first_window"] == 8 and held_out["windows"] == 2 and held_out["dropped_tail_tokens"] == 7
    direct = protocols.windowed_perplexity(model, stream[8 * 32 : 10 * 32], 32, 4, progress=False)
    assert held_out["ppl"] == pytest.approx(direct["ppl"], rel=1e-9)


# --------------------------------------------------------------------------------------------------
# Rolling perplexity, generation, plain lm-eval
# --------------------------------------------------------------------------------------------------


def test_wikitext_rolling_perplexity_batch_invariant(gpn_dir, loaded, data):
    from modeling_gpn.evaluation.runner import evaluate

    model, tokenizer = loaded
    # the first article: 1,519 tokens, 12 windows of 128, so batches of 8 and of 4 (its last window shorter, padded)
    results = {
        bs: evaluate(str(gpn_dir), settings(data, bs, ["wikitext"], limit=1), model, tokenizer)["tasks"]
        for bs in (1, 8)
    }
    assert_same_metrics(results[1], results[8])
    wikitext = results[8]["wikitext"]
    assert wikitext["byte_perplexity"] == pytest.approx(2 ** wikitext["bits_per_byte"], rel=1e-9)
    assert wikitext["word_perplexity"] > wikitext["byte_perplexity"] > 1


def test_rolling_perplexity_equals_the_direct_sum_over_tokens(gpn_dir, loaded, tmp_path):
    """`gpn_rolling_ppl` on a local jsonl: one window per (short) document, the first token predicted
    from the prefix token (BOS) and the BOS itself never scored."""
    from modeling_gpn.evaluation.runner import EvalSettings, evaluate

    model, tokenizer = loaded
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "A second, slightly longer document about rivers and rain.",
    ]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    options = EvalSettings(
        tasks=["gpn_rolling_ppl"],
        task_data={"gpn_rolling_ppl": str(path)},
        text_field="body",
        batch_size=2,
        progress=False,
    )
    measured = evaluate(str(gpn_dir), options, model, tokenizer)["tasks"]["gpn_rolling_ppl"]
    total_ll, words = 0.0, 0
    for text in texts:
        ids = [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logprobs = F.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
        total_ll += sum(logprobs[t - 1, ids[t]].item() for t in range(1, len(ids)))
        words += len(re.split(r"\s+", text))
    assert measured["word_perplexity"] == pytest.approx(math.exp(-total_ll / words), rel=1e-5)


def test_plain_lm_eval_hf_model_loglikelihood_and_left_padded_generation(gpn_dir, data, tmp_path):
    """The path of `lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True`: batched
    log-likelihoods equal the batch-1 ones, and left-padded batched generation equals row-by-row. (On `gpn_dir`'s
    model undone from predicting one token everywhere: that one generated the same text whatever its state, so
    pads read as tokens went unseen.)"""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml
    from transformers import AutoModelForCausalLM

    from modeling_gpn.evaluation.runner import lm_eval_task_yaml

    model = AutoModelForCausalLM.from_pretrained(gpn_dir)
    with torch.no_grad():  # (`predicting_everywhere` undone: no decoder bias, its token's row of a usual length)
        model.model.decode_proj.bias.zero_()
        norms = model.get_input_embeddings().weight.norm(dim=1)
        model.get_input_embeddings().weight[norms.argmax()] *= norms.median() / norms.max()
    shutil.copytree(gpn_dir, tmp_path / "gpn")
    gpn_dir = tmp_path / "gpn"
    model.save_pretrained(gpn_dir)
    lambada = load_yaml(lm_eval_task_yaml("lambada_openai"))
    lambada.pop("tag", None)
    lambada.update(
        dataset_path="json",
        dataset_name=None,
        dataset_kwargs={"data_files": {"test": [str(data / "lambada" / "lambada_test.jsonl")]}},
    )
    generation = dict(
        lambada,
        task="gpn_lambada_generate",
        output_type="generate_until",
        metric_list=[{"metric": "exact_match"}],
        generation_kwargs={"until": ["\n"], "max_gen_toks": 6, "do_sample": False},
    )
    generation.pop("doc_to_decontamination_query", None)
    outputs = {}
    for bs in (1, 8):
        outputs[bs] = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={gpn_dir},trust_remote_code=True,max_length={WINDOW}",
            tasks=[lambada, generation],
            batch_size=bs,
            device="cpu",
            limit=16,
            bootstrap_iters=0,
            task_manager=TaskManager(include_defaults=False),
            log_samples=True,
            verbosity="WARNING",
        )
    for task in ("lambada_openai", "gpn_lambada_generate"):
        one = {s["doc_id"]: s["resps"] for s in outputs[1]["samples"][task]}
        eight = {s["doc_id"]: s["resps"] for s in outputs[8]["samples"][task]}
        assert one.keys() == eight.keys() and len(one) == 16
        for doc_id in one:
            if task == "lambada_openai":
                (ll1, greedy1), (ll8, greedy8) = one[doc_id][0][0], eight[doc_id][0][0]
                assert ll1 == pytest.approx(ll8, rel=1e-6) and greedy1 == greedy8
            else:
                assert one[doc_id] == eight[doc_id]
    generated = [s["resps"][0][0] for s in outputs[8]["samples"]["gpn_lambada_generate"]]
    assert any(text.strip() for text in generated)  # something was generated, not an empty pass-through


# --------------------------------------------------------------------------------------------------
# The command, the report, other models, errors
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, data):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    folder = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(data / "llama2-tokenizer").save_pretrained(folder)
    return folder


def test_gpn_eval_command_writes_results_and_side_by_side_report(gpn_dir, data, tmp_path, capsys):
    from transformers import AutoTokenizer

    from gpn_cli import main
    from modeling_gpn.evaluation.protocols import encode_lambada
    from modeling_gpn.evaluation.runner import load_texts

    out = tmp_path / "out"
    code = main(
        [
            "eval",
            str(gpn_dir),
            "--data-dir",
            str(data),
            "--tasks",
            "lambada_paper,fineweb_paper",
            "--limit",
            "8",
            "--fineweb-window",
            str(WINDOW),
            "--fineweb-max-windows",
            "2",
            "--output-dir",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    results = json.loads((out / "eval_results.json").read_text())
    for key, kind in (
        ("model", str),
        ("n_params", int),
        ("tasks", dict),
        ("protocols", dict),
        ("lm_eval_version", str),
        ("published_baselines", list),
    ):
        assert isinstance(results[key], kind), key
    assert results["max_length"] == WINDOW  # config.max_length_hint
    assert results["lm_eval_version"] == "0.4.13"
    assert set(results["protocols"]) == set(results["tasks"]) == {"lambada_paper", "fineweb_paper"}
    assert results["n_params"] == sum(
        p.numel() for p in perturbed_model(tiny_config(vocab_size=32000, use_decoder_bias=True)).parameters()
    )
    ratios = results["comparison"]["ratio_to_published"]["Transformer++"]
    assert ratios["lambada_ppl"] == pytest.approx(results["tasks"]["lambada_paper"]["ppl"] / 18.99)
    assert ratios["fineweb_ppl"] == pytest.approx(results["tasks"]["fineweb_paper"]["ppl"] / 16.05)

    report = (out / "eval_report.md").read_text()
    table = [
        line
        for line in report.splitlines()
        if line.startswith("| ") and ("published |" in line or "measured |" in line)
    ]
    assert [line.split(" | ")[0] for line in table] == [
        "| Transformer++",
        "| Gated DeltaNet",
        "| GPN+M 1-layer",
        "| GPN+M 2-layer",
        "| GPN (no memory)",
        f"| **{gpn_dir}**",
    ]
    # the paper's rows as GPN.md quotes them (263.6, not 263.60; 0.160, not 0.16), each column's direction said
    assert table[0].endswith("| published | ≈130M | 12 | 768 | 16.05 | 0.223 | 18.99 |")
    assert table[3].endswith("| 16.95 | 0.160 | 27.39 |") and table[4].endswith("| 23.51 | 0.015 | 263.6 |")
    assert "| FineWeb PPL ↓ | LAMBADA acc ↑ | LAMBADA PPL ↓ |" in report
    assert f"**{results['tasks']['lambada_paper']['ppl']:.2f}**" in table[-1]
    assert "not the full set" in report and "the paper uses 2048" in report
    # --limit cuts LAMBADA, not the FineWeb windows (once "limit 8 examples per task", FineWeb's column included)
    assert "**limit: the first 8 examples of each LAMBADA and lm-eval task**" in report
    assert "lambada_paper" in capsys.readouterr().out

    # A second run into the same folder (the default one of every runs/NAME/model is ./eval-model) replaced the
    # first's results in silence: refused before the model loads, the first's files untouched; --overwrite replaces.
    again = ["eval", str(gpn_dir), "--data-dir", str(data), "--tasks", "lambada_paper", "--limit", "2"]
    assert main([*again, "--output-dir", str(out), "--quiet"]) == 2
    assert capsys.readouterr().err == (
        f"gpn eval: error: --output-dir {out} already holds an evaluation (eval_results.json, eval_report.md); "
        "choose another folder, or give --overwrite to replace it\n"
    )
    assert json.loads((out / "eval_results.json").read_text()) == results
    assert (out / "eval_report.md").read_text() == report
    # (a context longer than --max-length is left-truncated, as lm-eval does: counted and said beside the table)
    assert main([*again, "--max-length", "80", "--output-dir", str(out), "--quiet", "--overwrite"]) == 0
    rerun = json.loads((out / "eval_results.json").read_text())
    assert set(rerun["tasks"]) == {"lambada_paper"}
    tokenizer = AutoTokenizer.from_pretrained(gpn_dir)
    texts = load_texts(str(data / "lambada" / "lambada_test.jsonl"), None, "text", limit=2)
    read = [len(e.context_ids) + len(e.target_ids) - 1 for e in map(partial(encode_lambada, tokenizer), texts)]
    assert min(read) <= 80 < max(read)  # (one is cut, the other not)
    assert rerun["tasks"]["lambada_paper"]["truncated_examples"] == 1
    assert "(**1 of them with the context cut to its last 80 tokens**" in (out / "eval_report.md").read_text()


def test_gpn_eval_of_a_peft_adapter_folder_scores_the_merged_model(gpn_dir, loaded, data, tmp_path, capsys):
    """A PEFT adapter folder (a LoRA fine-tune's, without a tokenizer) was refused: "not a model folder: it has no
    config.json". It is scored merged into its base: the figures of the merged model saved whole, not the base's;
    `eval_results.json`'s `adapter` and the report name the base and whose tokenizer was read."""
    from gpn_cli import main
    from modeling_gpn.evaluation.runner import evaluate, load_model

    from ..tiny_models import saved_lora_adapter

    folder, merged = saved_lora_adapter(gpn_dir, tmp_path)
    options = settings(data, 8, ("lambada_paper",), limit=4)
    argv = ["eval", str(folder), "--data-dir", str(data), "--tasks", "lambada_paper", "--limit", "4", "--quiet"]
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 0
    results = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert results["adapter"] == {"base_model": str(gpn_dir), "merged": True, "tokenizer": str(gpn_dir)}
    assert (
        f"a PEFT adapter, scored merged into its base `{gpn_dir}`" in (tmp_path / "out" / "eval_report.md").read_text()
    )
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gpn eval")]
    assert said == [
        f"gpn eval: {folder} is a PEFT adapter of {gpn_dir}: run merged into it; tokenizer: the base's "
        f"(none in {folder})"
    ]
    adapted = results["tasks"]["lambada_paper"]
    assert_same_metrics({"lambada_paper": adapted}, evaluate(str(merged), options, *load_model(str(merged)))["tasks"])
    assert adapted["ppl"] != evaluate(str(gpn_dir), options, *loaded)["tasks"]["lambada_paper"]["ppl"]


def test_same_command_on_a_llama(llama_dir, data, tmp_path):
    from gpn_cli import main

    out = tmp_path / "llama"
    code = main(
        [
            "eval",
            str(llama_dir),
            "--data-dir",
            str(data),
            "--tasks",
            "lambada_openai,lambada_paper,fineweb_paper",
            "--limit",
            "8",
            "--fineweb-window",
            str(WINDOW),
            "--fineweb-max-windows",
            "2",
            "--output-dir",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    results = json.loads((out / "eval_results.json").read_text())
    assert results["model_type"] == "llama" and results["max_length"] == 256 and results["layers"] == 2
    fineweb = results["tasks"]["fineweb_paper"]
    assert "ppl_all_positions" not in fineweb and fineweb["ppl"] == fineweb["ppl_excluding_first"]
    assert fineweb["tokens_scored"] == 2 * (WINDOW - 1)
    assert "not scored" in results["protocols"]["fineweb_paper"]
    assert results["tasks"]["lambada_paper"]["ppl_per_example"] == pytest.approx(
        results["tasks"]["lambada_openai"]["perplexity"], rel=1e-5
    )
    assert "| **" in (out / "eval_report.md").read_text()


def test_clear_errors(gpn_dir, data, llama_dir, capsys, tmp_path):
    from transformers import AutoModelForCausalLM

    from gpn_cli import main
    from modeling_gpn.evaluation import protocols

    assert main(["eval", str(gpn_dir), "--tasks", "lambada_openai,hellaswag"]) == 2
    assert "unknown task(s) ['hellaswag']" in capsys.readouterr().err
    assert main(["eval", str(gpn_dir), "--tasks", ","]) == 2  # (no task: nothing would be scored, exit 0)
    assert capsys.readouterr().err.startswith("gpn eval: error: --tasks names no task; the GPN task set is [")
    assert main(["eval", str(gpn_dir), "--task-data", "lambada_openai"]) == 2
    assert "TASK=SOURCE" in capsys.readouterr().err
    # what the arguments name, missing or unusable: one `gpn eval: error: ...` line, exit 2, as argparse's own
    assert main(["eval", str(gpn_dir), "--data-dir", str(data / "lambada"), "--tasks", "wikitext"]) == 2
    assert "gpn eval: error: " in (err := capsys.readouterr().err) and "no data for task 'wikitext'" in err
    assert main(["eval", str(gpn_dir.parent / "no-such-model"), "--tasks", "fineweb_paper"]) == 2
    assert capsys.readouterr().err.startswith("gpn eval: error: model folder ")
    bare = tmp_path / "without-tokenizer"  # the model's files, not its tokenizer's
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(gpn_dir / name, bare / name)
    assert main(["eval", str(bare), "--tasks", "fineweb_paper", "--output-dir", str(tmp_path / "out")]) == 2
    assert "gpn eval: error: " in (err := capsys.readouterr().err) and "holds no tokenizer" in err
    assert not (tmp_path / "out").exists()  # a refused run leaves no empty output folder
    llama = AutoModelForCausalLM.from_pretrained(llama_dir)
    with pytest.raises(ValueError, match="needs a model with empty_state_logits"):
        protocols.windowed_perplexity(llama, list(range(300)), WINDOW, first_position="empty_state")
    with pytest.raises(ValueError, match="fewer than one window"):
        protocols.windowed_perplexity(llama, list(range(100)), WINDOW, first_position="skip")


def test_a_task_that_fails_keeps_the_tasks_finished_before_it(gpn_dir, data, tmp_path, capsys, monkeypatch):
    """A task failing late (here FineWeb's one document shorter than a window) lost the figures of every task before
    it: nothing was written. Now they are, the failed task named in the results and the report, exit status 2."""
    from gpn_cli import main

    out = tmp_path / "out"
    argv = ["eval", str(gpn_dir), "--data-dir", str(data), "--tasks", "lambada_paper,fineweb_paper", "--limit", "2"]
    argv += ["--fineweb-max-documents", "1", "--fineweb-window", "100000", "--output-dir", str(out), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpn eval: error: the token stream has ") and "fewer than one window of 100000" in err
    assert err.endswith(f"; lambada_paper, finished before fineweb_paper failed, written to {out}\n")
    results = json.loads((out / "eval_results.json").read_text())
    assert list(results["tasks"]) == ["lambada_paper"] and results["tasks"]["lambada_paper"]["examples"] == 2
    assert (
        list(results["failed"]) == ["fineweb_paper"] and "fewer than one window" in results["failed"]["fineweb_paper"]
    )
    assert results["comparison"]["measured"]["lambada_ppl"] == results["tasks"]["lambada_paper"]["ppl"]
    assert "**task `fineweb_paper` failed, not scored**" in (out / "eval_report.md").read_text()
    # Ctrl-C in a later task keeps them the same way (it lost them all), exit status 130
    from modeling_gpn.evaluation import runner

    load_texts = runner.load_texts

    def interrupted_in_fineweb(source, hub_name, *args, **kwargs):
        if hub_name == runner.FINEWEB_HUB:  # (Ctrl-C while FineWeb's documents are read)
            raise KeyboardInterrupt
        return load_texts(source, hub_name, *args, **kwargs)

    monkeypatch.setattr(runner, "load_texts", interrupted_in_fineweb)
    shutil.rmtree(out)
    assert main(argv) == 130
    assert capsys.readouterr().err.endswith(
        f"interrupted (Ctrl-C); lambada_paper, finished before fineweb_paper failed, written to {out}\n"
    )
    results = json.loads((out / "eval_results.json").read_text())
    assert list(results["tasks"]) == ["lambada_paper"] and results["failed"] == {
        "fineweb_paper": "interrupted (Ctrl-C)"
    }


def test_a_damaged_weights_file_is_one_line(gpn_dir, tmp_path, capsys):
    """A truncated model.safetensors was safetensors' SafetensorError traceback, exit status 1."""
    from safetensors.torch import load_file, save_file

    from gpn_cli import main

    damaged = tmp_path / "damaged"
    shutil.copytree(gpn_dir, damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["eval", str(damaged), "--tasks", "fineweb_paper", "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpn eval: error: cannot load a model from {damaged}: SafetensorError: ")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    # a weight holding NaN: the run wrote perplexities of NaN to eval_results.json, as if measured
    tensors = load_file(gpn_dir / "model.safetensors")
    tensors["model.fuse_gate.weight"][0, 0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    assert main(["eval", str(damaged), "--tasks", "fineweb_paper", "--output-dir", str(tmp_path / "out")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gpn eval: error: ")]
    assert len(errors) == 1 and "model.fuse_gate.weight;" in errors[0], errors
    assert errors[0].startswith(f"gpn eval: error: the model in {damaged} has parameters holding NaN or inf")
    # a weight left out, and a config.json of more predict layers than were trained: transformers drew the weights
    # it lacked at random (saying so only in its load report) and the run scored that model
    del tensors["model.fuse_gate.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    config = json.loads((damaged / "config.json").read_text())
    (damaged / "config.json").write_text(json.dumps(dict(config, num_predict_layers=config["num_predict_layers"] + 1)))
    assert main(["eval", str(damaged), "--tasks", "fineweb_paper", "--output-dir", str(tmp_path / "out")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gpn eval: error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"gpn eval: error: the model in {damaged} does not match its "), (
        errors
    )
    assert "its weights lack model.fuse_gate.weight, model.predict_layers." in errors[0], errors
    (damaged / "config.json").write_text(json.dumps(config))  # a tensor the model has no place for
    save_file({**load_file(gpn_dir / "model.safetensors"), "model.extra.weight": torch.ones(2)}, weights)
    assert main(["eval", str(damaged), "--tasks", "fineweb_paper", "--output-dir", str(tmp_path / "out")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gpn eval: error: ")]
    assert "its weights hold model.extra.weight, which its config.json has no place for" in errors[0], errors
    assert not (tmp_path / "out").exists()


def test_a_repos_own_code_runs_only_with_trust_remote_code(tmp_path, capsys):
    """`gpn eval` runs the modeling code a folder or Hub repo ships only when asked (`--trust-remote-code`), as
    `gpn generate` and `gpn inspect` do; `--no-trust-remote-code` (the old opt-out) still parses and is the
    default. A GPN or Llama folder needs no flag (test_gpn_eval_command..., test_same_command_on_a_llama)."""
    from gpn_cli import build_parser, main
    from modeling_gpn.evaluation.cli import settings_from_args

    shipped = tmp_path / "ships-code"
    shipped.mkdir()
    ran = tmp_path / "the repo's code ran"
    (shipped / "config.json").write_text(
        json.dumps(
            {
                "model_type": "shipped-only",
                "auto_map": {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"},
            }
        )
    )
    (shipped / "configuration_x.py").write_text(f"open({str(ran)!r}, 'w').close()\nraise ImportError('stop')\n")
    code = main(["eval", str(shipped), "--tasks", "fineweb_paper"])
    assert not ran.exists() and code != 0
    assert "trust_remote_code" in capsys.readouterr().err

    def parsed(*flags):
        return settings_from_args(build_parser("eval").parse_args(["eval", "m", *flags])).trust_remote_code

    assert (parsed(), parsed("--trust-remote-code"), parsed("--no-trust-remote-code")) == (False, True, False)


def test_the_device_is_a_gpu_where_one_is_available(monkeypatch):
    """`gpn eval --device` defaults to cuda where torch sees a GPU (as gpn generate, inspect and bench): it ran on the
    CPU of a GPU machine unless told. The parser is built with torch seeing one (no GPU is needed to check the
    default it takes)."""
    from gpn_cli import build_parser

    assert build_parser("eval").parse_args(["eval", "m"]).device == "cpu"  # (imports the package, without a GPU)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert build_parser("eval").parse_args(["eval", "m"]).device == "cuda"


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--limit", "0", "--limit must be at least 1, got 0"),
        ("--batch-size", "0", "--batch-size must be at least 1, got 0"),
        ("--fineweb-window", "1", "--fineweb-window must be at least 2, got 1"),
        ("--fineweb-held-out-fraction", "1.5", "--fineweb-held-out-fraction must be in (0, 1], got 1.5"),
        ("--num-threads", "0", "--num-threads must be at least 1, got 0"),
    ],
)
def test_numbers_out_of_range_are_refused_before_the_model_loads(gpn_dir, option, value, message, capsys, monkeypatch):
    """`--limit 0` scored one example and reported it as a result; `--batch-size 0` ended in `ValueError:`, exit 1.
    Now each is one `gpn eval: error: ...` line and exit 2, before anything loads."""
    from gpn_cli import main
    from modeling_gpn.evaluation import runner

    monkeypatch.setattr(runner, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert main(["eval", str(gpn_dir), "--tasks", "lambada_paper", option, value]) == 2
    assert capsys.readouterr().err == f"gpn eval: error: {message}\n"


@pytest.mark.parametrize("device, message", [("toaster", "is not a torch device"), ("cuda:99", "CUDA")])
def test_an_unusable_device_is_refused_before_the_model_loads(gpn_dir, device, message, capsys, monkeypatch):
    """`--device toaster` (or a GPU the machine does not have) ended in a traceback once the model had loaded."""
    from gpn_cli import main
    from modeling_gpn.evaluation import runner

    monkeypatch.setattr(runner, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert main(["eval", str(gpn_dir), "--tasks", "lambada_paper", "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpn eval: error: --device ") and device in err and message in err and err.count("\n") == 1


def test_local_data_without_the_tasks_column_is_one_clear_line(gpn_dir, tmp_path, capsys):
    """lm-eval read the column only inside its prompt templates: a jsonl without `page` for wikitext ended in
    `gpn eval: error: page`, a --text-field the data lacks in a jinja traceback."""
    from gpn_cli import main

    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "Some words of a document."}) + "\n")
    for task, extra, column in (("wikitext", [], "'page'"), ("gpn_rolling_ppl", ["--text-field", "body"], "'body'")):
        argv = ["eval", str(gpn_dir), "--tasks", task, "--task-data", f"{task}={docs}", *extra, "--quiet"]
        assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"gpn eval: error: {docs} has no column {column}") and "['text']" in err, err


@pytest.mark.parametrize("missing", ["/no/such/wiki.test.raw", "wiki.test.raw", "docs.jsonl,wiki.test.raw"])
def test_task_data_naming_missing_files_is_refused_before_the_model_loads(
    gpn_dir, missing, tmp_path, capsys, monkeypatch
):
    """A missing --task-data file was taken for a Hub dataset's name and failed only at its task's turn: after the
    model loaded and the tasks before it ran (their figures lost), and offline as "Couldn't reach ... on the Hub"."""
    from gpn_cli import main
    from modeling_gpn.evaluation import runner

    monkeypatch.setattr(runner, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "A document."}) + "\n")
    argv = ["eval", str(gpn_dir), "--tasks", "lambada_paper,wikitext", "--task-data", f"wikitext={missing}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"gpn eval: error: --task-data wikitext={missing}: {missing.split(',')[-1]} does not exist\n"


def test_rolling_ppl_reads_a_text_file_whatever_the_text_field(gpn_dir, tmp_path):
    """A .txt file is read by datasets' text builder, whose column is `text`: --text-field (meant for the jsonl
    of another task in the same run) does not apply to it, as the FineWeb protocol reads it."""
    from gpn_cli import main

    text = tmp_path / "doc.txt"
    text.write_text("A short document about rivers and rain.\n")
    argv = ["eval", str(gpn_dir), "--tasks", "gpn_rolling_ppl", "--task-data", f"gpn_rolling_ppl={text}"]
    assert main([*argv, "--text-field", "body", "--quiet", "--output-dir", str(tmp_path / "out")]) == 0
    results = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert results["tasks"]["gpn_rolling_ppl"]["word_perplexity"] > 1


def test_a_limit_takes_that_many_texts(data):
    from modeling_gpn.evaluation.runner import load_texts

    lambada = str(data / "lambada" / "lambada_test.jsonl")
    assert [len(load_texts(lambada, None, "text", limit=n)) for n in (0, 1, 3)] == [0, 1, 3]


@pytest.mark.parametrize("where", ["a file", "under a file", "unwritable"])
def test_an_unusable_output_dir_is_refused_before_the_model_loads(gpn_dir, where, tmp_path, capsys, monkeypatch):
    """`--output-dir` was only created after the whole evaluation, which then ended in a traceback."""
    from gpn_cli import main
    from modeling_gpn.evaluation import runner

    monkeypatch.setattr(runner, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    (tmp_path / "file").write_text("x")
    output = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "out", "unwritable": "/proc/gpn-out"}
    assert main(["eval", str(gpn_dir), "--tasks", "lambada_paper", "--output-dir", str(output[where])]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpn eval: error: --output-dir {output[where]}") and err.count("\n") == 1


def test_a_second_run_into_a_folder_another_run_writes_is_refused_naming_it(
    gpn_dir, data, tmp_path, capsys, monkeypatch
):
    """Two runs into one --output-dir at once (the default ./eval-model of runs/a/model and runs/b/model, two
    terminals) both found it free at their start; the later one's results replaced the earlier's in silence, or
    eval_results.json and eval_report.md were each another run's. A run holds the folder until it ends: a second
    one started meanwhile (here while the first evaluates), --overwrite too, is refused at its start naming the
    first's pid, and the results are the first's. A run that wrote nothing leaves no folder it created."""
    import os

    from gpn_cli import main
    from modeling_gpn.evaluation import runner

    out, real_evaluate, seen = tmp_path / "eval-model", runner.evaluate, {}
    argv = ["eval", str(gpn_dir), "--data-dir", str(data), "--tasks", "lambada_paper", "--limit", "1", "--quiet"]

    def evaluate_beside_another_run(*args, **kwargs):
        seen["other"] = main([*argv, "--output-dir", str(out), "--overwrite", "--limit", "2"])
        seen["said"] = capsys.readouterr().err
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(runner, "evaluate", evaluate_beside_another_run)
    assert main([*argv, "--output-dir", str(out)]) == 0
    assert seen["other"] == 2 and seen["said"].startswith(
        f"gpn eval: error: {out} is in use by another process (pid {os.getpid()}: "
    ), seen["said"]
    assert (
        "that writes an evaluation into it (gpn eval): wait for it to end, or give another --output-dir" in seen["said"]
    )
    assert json.loads((out / "eval_results.json").read_text())["limit"] == 1  # the first run's, whole

    def fails(*args, **kwargs):
        raise OSError("no such model")

    monkeypatch.setattr(runner, "evaluate", fails)
    assert main([*argv, "--output-dir", str(tmp_path / "new" / "eval")]) == 2
    assert not (tmp_path / "new").exists()


def test_quiet_shows_no_progress_bar_of_any_library(gpn_dir, data, tmp_path, capfd):
    """`--quiet` said "no progress bars", but lm-eval's "Running loglikelihood requests" bars (and those of
    transformers' weight loading and datasets' reading) still showed; each library's setting is restored after."""
    from transformers.utils import logging as transformers_logging

    from gpn_cli import main

    lambada = str(data / "lambada" / "lambada_test.jsonl")
    arguments = ["eval", str(gpn_dir), "--tasks", "lambada_openai", "--task-data", f"lambada_openai={lambada}"]
    assert main([*arguments, "--limit", "2", "--output-dir", str(tmp_path), "--quiet"]) == 0
    err = capfd.readouterr().err
    assert "Running loglikelihood requests" not in err and "it/s]" not in err, err
    assert transformers_logging.is_progress_bar_enabled()


def test_outside_a_git_checkout_no_git_error_is_printed(gpn_dir, data, tmp_path, capfd, monkeypatch):
    """lm-eval records the current folder's git commit by running git with its stderr on the terminal: run
    outside a checkout (as `gpn study` and `gpn eval` usually are), every task printed "fatal: not a git
    repository". The lookup is quiet, and the results record no commit."""
    from gpn_cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # (no checkout above it either)
    lambada = str(data / "lambada" / "lambada_test.jsonl")
    arguments = ["eval", str(gpn_dir), "--tasks", "lambada_openai", "--task-data", f"lambada_openai={lambada}"]
    assert main([*arguments, "--limit", "2", "--output-dir", str(tmp_path / "eval"), "--quiet"]) == 0
    err = capfd.readouterr().err
    assert "not a git repository" not in err, err
