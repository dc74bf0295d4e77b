"""The single state, kept: bounded-memory prefill and scoring, a state saved, loaded and forked.

A GPN's whole context is its state (p, g, M): a long prompt is read a chunk of positions at a time
(`prefill.forward_in_chunks`), a state is written to a safetensors file and read back in another
process (`GPNCache.save` / `GPNCache.load`), one state is forked into N rows (`GPNCache.fork`), and
`gpn generate --save-state / --state` does both from the command line.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import safetensors.torch
import torch

from modeling_gpn import GPNCache
from modeling_gpn.state_file import GPNStateFileError, _state_checksum, state_fingerprint

from ..environment import REPO_ROOT, require_shared, small_disk
from ..subprocesses import one_started_in_the_background
from ..tiny_models import perturbed_model, tiny_config, without_metadata

VOCAB = 97


def token_ids(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def padded_mask(rows: int, length: int) -> torch.Tensor:
    """Row 0 left-padded, row 1 with holes on both sides of chunk boundaries, row 2 (if any) unpadded."""
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[0, :5] = 0
    mask[1, [i for i in (6, 7, 13, 20) if i < length]] = 0
    return mask


class ChunkSpy:
    """Counts the real `forward_in_chunks` calls of a model (it calls through: nothing is replaced)."""

    def __init__(self, model, monkeypatch):
        import modeling_gpn.modeling_gpn as modeling

        self.calls = 0
        real = modeling.forward_in_chunks

        def counted(chunked_model, *args, **kwargs):
            self.calls += chunked_model is model
            return real(chunked_model, *args, **kwargs)

        monkeypatch.setattr(modeling, "forward_in_chunks", counted)


@pytest.fixture(params=["gpn+m", "gpn"])
def model(request):
    overrides = {} if request.param == "gpn+m" else dict(use_memory=False)
    return perturbed_model(tiny_config(eos_token_id=None, **overrides), seed=5)


def one_pass(model, *args, **kwargs):
    """The forward with chunking off: every position in one pass, as before issue 20."""
    chunk, model.prefill_chunk_length = model.prefill_chunk_length, 0
    try:
        return model(*args, **kwargs)
    finally:
        model.prefill_chunk_length = chunk


def assert_same_state(ours: GPNCache, theirs: GPNCache) -> None:
    assert ours.get_seq_length() == theirs.get_seq_length()
    for a, b in zip(ours.get_state(), theirs.get_state()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------------------------------
# 1. Prefill and scoring in bounded memory: the same results, chunk by chunk
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("keep", [1, 3])
def test_chunked_prefill_equals_one_pass_with_padding(model, monkeypatch, keep):
    ids, mask = token_ids(3, 29, seed=1), padded_mask(3, 29)
    model.prefill_chunk_length = 6  # 29 positions: 5 chunks, the last one short; the holes straddle boundaries
    spy = ChunkSpy(model, monkeypatch)
    chunked = model(ids, attention_mask=mask, use_cache=True, logits_to_keep=keep)
    assert spy.calls == 1
    whole = one_pass(model, ids, attention_mask=mask, use_cache=True, logits_to_keep=keep)
    assert spy.calls == 1 and chunked.logits.shape == whole.logits.shape == (3, keep, VOCAB)
    torch.testing.assert_close(chunked.logits, whole.logits, atol=1e-5, rtol=1e-6)
    assert_same_state(chunked.cache, whole.cache)

    # continuing from a cache, with a mask over the whole sequence (as generate() passes it)
    more, more_mask = token_ids(3, 14, seed=2), torch.ones(3, 14, dtype=torch.long)
    more_mask[2, 3] = 0
    full_mask = torch.cat([mask, more_mask], dim=1)
    chunked_more = model(more, attention_mask=full_mask, cache=chunked.cache, use_cache=True, logits_to_keep=keep)
    whole_more = one_pass(model, more, attention_mask=full_mask, cache=whole.cache, use_cache=True, logits_to_keep=keep)
    assert spy.calls == 2 and chunked_more.cache is chunked.cache
    torch.testing.assert_close(chunked_more.logits, whole_more.logits, atol=1e-5, rtol=1e-6)
    assert_same_state(chunked.cache, whole.cache)


@torch.no_grad()
def test_chunked_prefill_without_use_cache_leaves_a_given_cache_unchanged(monkeypatch):
    model = perturbed_model(tiny_config(), seed=6)
    model.prefill_chunk_length = 4
    cache = model(token_ids(1, 5, seed=3), use_cache=True).cache
    before = cache.get_state()
    spy = ChunkSpy(model, monkeypatch)
    out = model(token_ids(1, 11, seed=4), cache=cache, use_cache=False, logits_to_keep=1)
    assert spy.calls == 1 and out.cache is None and cache.get_seq_length() == 5
    for old, new in zip(before, cache.get_state()):
        assert torch.equal(old, new)
    empty = GPNCache(model.config)
    model(token_ids(1, 11, seed=4), cache=empty, use_cache=False, logits_to_keep=1)
    assert spy.calls == 2 and not empty.has_state and empty.get_seq_length() == 0


@torch.no_grad()
@pytest.mark.parametrize("targets", ["labels", "shift_labels", "num_items_in_batch"])
def test_chunked_loss_equals_one_pass(model, monkeypatch, targets):
    ids, mask = token_ids(3, 31, seed=5), padded_mask(3, 31)
    labels = ids.masked_fill(mask == 0, -100)
    labels[2, 12] = -100
    kwargs = dict(attention_mask=mask, return_logits=False)
    if targets == "shift_labels":
        kwargs["shift_labels"] = torch.cat([labels[:, 1:], torch.full((3, 1), -100)], dim=1)
    else:
        kwargs["labels"] = labels
    if targets == "num_items_in_batch":
        kwargs["num_items_in_batch"] = torch.tensor(200)
    model.prefill_chunk_length = 7
    spy = ChunkSpy(model, monkeypatch)
    chunked = model(ids, **kwargs)
    assert spy.calls == 1 and chunked.logits is None
    whole = one_pass(model, ids, **kwargs)
    reference = one_pass(model, ids, attention_mask=mask, labels=labels).loss  # the (batch, seq, vocab) logits' loss
    torch.testing.assert_close(chunked.loss, whole.loss, atol=1e-6, rtol=1e-6)
    if targets != "num_items_in_batch":
        torch.testing.assert_close(chunked.loss, reference, atol=1e-6, rtol=1e-6)


def test_chunking_runs_only_where_it_changes_nothing(monkeypatch):
    """Gradients, per-position outputs and short inputs take the one-pass path."""
    model = perturbed_model(tiny_config(), seed=7)
    model.prefill_chunk_length = 4
    spy = ChunkSpy(model, monkeypatch)
    ids = token_ids(2, 9, seed=6)
    model(ids, labels=ids, return_logits=False)  # training: the backward needs every step
    with torch.no_grad():
        model(ids)  # every position's logits
        model(ids, logits_to_keep=1, output_hidden_states=True)
        model(ids, logits_to_keep=1, output_predicted_states=True)
        model(ids, logits_to_keep=1, output_memory_decays=True)
        model(ids, logits_to_keep=5)  # more logits kept than one chunk
        model(ids[:, :4], logits_to_keep=1)  # one chunk
    assert spy.calls == 0
    with torch.no_grad():
        model(ids, logits_to_keep=1)
    assert spy.calls == 1


@torch.no_grad()
def test_generate_prefills_in_chunks_and_gives_the_same_tokens(monkeypatch):
    model = perturbed_model(tiny_config(eos_token_id=None), seed=8)
    ids, mask = token_ids(3, 23, seed=7), padded_mask(3, 23)
    settings = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    model.prefill_chunk_length = 5
    spy = ChunkSpy(model, monkeypatch)
    chunked = model.generate(ids, **settings)
    assert spy.calls == 1  # the prefill, in chunks; the decoding steps are one position each
    model.prefill_chunk_length = 0
    whole = model.generate(ids, **settings)
    assert spy.calls == 1
    assert torch.equal(chunked, whole)


@torch.no_grad()
@pytest.mark.parametrize("setting", [-1, 1.5, "8", True])
def test_a_prefill_chunk_length_that_is_not_a_non_negative_integer_is_refused_by_name(setting):
    """-1 ran one pass in silence (no chunk, unbounded memory, where the setting looked on), True chunks of one
    position; 1.5 and "8" failed inside the chunk loop with a bare TypeError."""
    model = perturbed_model(tiny_config(), seed=8)
    model.prefill_chunk_length = setting
    with pytest.raises(
        ValueError, match=rf"prefill_chunk_length must be a non-negative integer .* got {re.escape(repr(setting))}"
    ):
        model(token_ids(1, 9, seed=3), logits_to_keep=1)
    model.prefill_chunk_length = None  # off, as 0
    model(token_ids(1, 9, seed=3), logits_to_keep=1)


# --------------------------------------------------------------------------------------------------
# 2. A state as a file
# --------------------------------------------------------------------------------------------------


# A new process's environment: torch's one thread, as in this one (tests/conftest.py), so that what it computes is
# compared with what this process computed at the same thread count, whatever the machine's cores (torch's default).
def one_thread_environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


CONTINUE_IN_A_NEW_PROCESS = """
import json, sys, torch
from transformers import AutoModelForCausalLM
import modeling_gpn
from modeling_gpn import GPNCache
folder, state_file, new_tokens, mask_before = sys.argv[1:5]
model = AutoModelForCausalLM.from_pretrained(folder).eval()
cache = GPNCache.load(state_file, model)
new = torch.tensor(json.loads(new_tokens))
mask = torch.cat([torch.tensor(json.loads(mask_before)), torch.ones_like(new)], dim=1)
with torch.no_grad():
    out = model.generate(new, attention_mask=mask, cache=cache, max_new_tokens=9, do_sample=False, pad_token_id=0)
print(json.dumps({"tokens": out.tolist(), "read": cache.get_seq_length()}))
"""


def _saved_state_and_its_process(folder: Path) -> tuple[dict, Callable[[], subprocess.CompletedProcess]]:
    """A model and the state of a prefix saved into `folder`, with the uninterrupted run to compare with: (what the
    test compares, the job that continues the state in a new process)."""
    model = perturbed_model(tiny_config(eos_token_id=None), seed=9)
    model.save_pretrained(folder / "model")
    prefix, prefix_mask = token_ids(2, 12, seed=8), padded_mask(2, 12)
    new = token_ids(2, 4, seed=9)
    with torch.no_grad():
        uninterrupted = model.generate(
            torch.cat([prefix, new], 1),
            attention_mask=torch.cat([prefix_mask, torch.ones_like(new)], 1),
            max_new_tokens=9,
            do_sample=False,
            pad_token_id=0,
        )
        cache = model(prefix, attention_mask=prefix_mask, use_cache=True).cache
    cache.save(folder / "prefix.safetensors")
    command = [
        sys.executable,
        "-c",
        CONTINUE_IN_A_NEW_PROCESS,
        str(folder / "model"),
        str(folder / "prefix.safetensors"),
        json.dumps(new.tolist()),
        json.dumps(prefix_mask.tolist()),
    ]
    made = dict(folder=folder, model=model, prefix=prefix, uninterrupted=uninterrupted, cache=cache)
    return made, lambda: subprocess.run(
        command, capture_output=True, text=True, cwd=REPO_ROOT, env=one_thread_environment()
    )


@pytest.fixture(scope="module", autouse=True)
def saved_state_in_a_new_process(request, tmp_path_factory) -> Iterator[tuple[dict, Future] | None]:
    """The new process of `test_saved_state_continued_in_a_new_process_equals_one_run`, which needs nothing of the
    tests before it, started in the background at the module's first test (where that test is selected), beside the
    module's in-process tests (`subprocesses.one_started_in_the_background`: the suite's time on 2 cores; its inputs made
    here, in the test process): (what it compares, the future of the finished process)."""
    test, folder = "test_saved_state_continued_in_a_new_process_equals_one_run", tmp_path_factory.mktemp
    with one_started_in_the_background(
        request, test, lambda: _saved_state_and_its_process(folder("saved-state"))
    ) as started:
        yield started


def test_saved_state_continued_in_a_new_process_equals_one_run(saved_state_in_a_new_process):
    made, finished = saved_state_in_a_new_process
    tmp_path, model, prefix, uninterrupted, cache = (
        made[k] for k in ("folder", "model", "prefix", "uninterrupted", "cache")
    )
    assert not list(tmp_path.glob(".*tmp*"))  # written under a temporary name, then renamed
    result = finished.result()
    assert result.returncode == 0, result.stderr
    continued = json.loads(result.stdout.strip().splitlines()[-1])
    assert torch.equal(torch.tensor(continued["tokens"]), uninterrupted[:, prefix.shape[1] :])
    assert continued["read"] == 12 + 4 + 8

    # and in this process: the loaded state is the saved one, bit for bit, on the model's device
    loaded = GPNCache.load(tmp_path / "prefix.safetensors", model)
    assert loaded.get_seq_length() == 12
    for saved, back in zip(cache.get_state(), loaded.get_state()):
        assert torch.equal(saved, back)


def test_one_row_of_a_saved_batch_continues_as_its_uninterrupted_run(tmp_path):
    """docs/cache.md: a saved batch's row is continued alone by selecting it after loading."""
    model = perturbed_model(tiny_config(eos_token_id=None), seed=9)
    prefix, prefix_mask, new = token_ids(3, 12, seed=8), padded_mask(3, 12), token_ids(3, 4, seed=9)
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        mask = torch.cat([prefix_mask, torch.ones_like(new)], 1)
        uninterrupted = model.generate(torch.cat([prefix, new], 1), attention_mask=mask, **greedy)
        model(prefix, attention_mask=prefix_mask, use_cache=True).cache.save(tmp_path / "batch.safetensors")
    state = GPNCache.load(tmp_path / "batch.safetensors", model)
    # row 0, the left-padded one, as row 1 of its fork (rows 0, 0, 1, 1, 2, 2), by a 0-dim index (which dropped the
    # batch dimension: a state that `save` wrote and `load` refused), saved again
    state = state.fork(2)
    state.batch_select_indices(torch.tensor(1))
    state.save(tmp_path / "row.safetensors")
    state = GPNCache.load(tmp_path / "row.safetensors", model)
    with torch.no_grad():
        continued = model.generate(new[:1], attention_mask=mask[:1], cache=state, **greedy)
    assert torch.equal(continued, uninterrupted[:1, 12:])


@pytest.fixture
def saved(tmp_path):
    """A model, and the path of a state it saved."""
    model = perturbed_model(tiny_config(), seed=10)
    with torch.no_grad():
        cache = model(token_ids(2, 7, seed=10), use_cache=True).cache
    path = tmp_path / "state.safetensors"
    cache.save(path)
    return model, path


def test_saves_from_several_threads_to_one_path_all_succeed(saved, tmp_path):
    """Each save writes under a temporary name of its own: two threads saving one state to one path (as a
    server keeping conversations does) never remove each other's file, and what is left loads."""
    import threading

    model, first = saved
    cache = GPNCache.load(first, model)
    path = tmp_path / "shared.safetensors"
    errors, start = [], threading.Barrier(2)

    def save_repeatedly():
        start.wait()
        for _ in range(20):
            try:
                cache.save(path)
            except Exception as error:  # noqa: BLE001 - every failure is the finding
                errors.append(repr(error))

    threads = [threading.Thread(target=save_repeatedly) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, f"{len(errors)} of 40 saves failed: {errors[:2]}"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    for saved_state, back in zip(cache.get_state(), GPNCache.load(path, model).get_state()):
        assert torch.equal(saved_state, back)


def refused(path, model, needle: str) -> str:
    with pytest.raises(GPNStateFileError, match=re.escape(str(path))) as error:
        GPNCache.load(path, model)
    assert needle in str(error.value), str(error.value)
    return str(error.value)


def test_a_save_cut_short_keeps_the_old_file_and_names_the_path(saved, tmp_path):
    """A full disk (here a real EFBIG, from a file-size limit) while saving leaves the old file whole and no partial
    one; the error names the path asked for (it named the hidden temporary file the state was written to)."""
    import resource

    model, path = saved
    old = path.read_bytes()
    with torch.no_grad():
        bigger = model(token_ids(16, 3, seed=1), use_cache=True).cache
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(old) + 64, hard))  # (CPython ignores SIGXFSZ: the write fails)
    try:
        with pytest.raises(OSError) as error:
            bigger.save(path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert error.value.filename == str(path) and "File too large" in str(error.value), error.value
    assert path.read_bytes() == old and list(tmp_path.iterdir()) == [path]


def test_a_state_of_another_model_is_refused(saved, tmp_path):
    model, path = saved
    message = refused(path, perturbed_model(tiny_config(hidden_size=40), seed=10), "another model")
    assert "hidden_size 48 (this model: 40)" in message
    refused(path, perturbed_model(tiny_config(use_memory=False), seed=10), "use_memory True (this model: False)")
    refused(path, perturbed_model(tiny_config(), seed=11), "other weights")
    refused(path, perturbed_model(tiny_config(), seed=10).to(torch.bfloat16), "bfloat16")
    same = perturbed_model(tiny_config(), seed=10)
    GPNCache.load(path, same)  # the same model, built again: accepted
    weight = same.model.embed_tokens.weight
    kept = weight[3, 1].item()
    with torch.no_grad():  # one matrix changed in place (a merged LoRA, an optimizer step), every vector the same
        weight[3, 1] += 0.5
    refused(path, same, "other weights")
    with torch.no_grad():
        weight[3, 1] = kept
    GPNCache.load(path, same)  # and back
    original = weight.detach().clone()
    weight.data.mul_(1.01)  # through `.data`, as EMA or PEFT's merge write: no version bump
    refused(path, same, "other weights")
    weight.data.copy_(original)
    GPNCache.load(path, same)


def test_a_state_of_quantized_weights_refused_across_dtypes_names_both_sides_as_dtype_spells_them(tmp_path):
    """A quantized model's dtype is the float one it computes in: a state of int8 weights was refused beside bf16 ones
    as "computed with bfloat16 weights; this model's are bfloat16"-like words that sent users to load the model in
    bf16, and then by torchao's class (Int8Tensor), not the words the user typed. The file now names the weights'
    kind and the weights as `--dtype` does (`dtype_name`), and the refusal gives both sides so, with the kind beside
    where it says more, and how to continue (not the --dtype both sides have: int8 of other float weights); a
    quantized model takes its own state back. A file saved before that field was written still loads, and is
    refused with the words it was refused with."""
    torchao = pytest.importorskip("torchao.quantization", reason="torchao (the test extra) quantizes the int8 model")
    int8 = perturbed_model(tiny_config(), seed=10).to(torch.bfloat16)
    torchao.quantize_(int8, torchao.Int8WeightOnlyConfig())
    bf16 = perturbed_model(tiny_config(), seed=10).to(torch.bfloat16)
    paths = {"int8": tmp_path / "int8.st", "bf16": tmp_path / "bf16.st"}
    with torch.no_grad():
        int8(token_ids(1, 5, seed=2), use_cache=True).cache.save(paths["int8"])
        bf16(token_ids(1, 5, seed=2), use_cache=True).cache.save(paths["bf16"])
    GPNCache.load(paths["int8"], int8)
    message = refused(paths["int8"], bf16, "computed with int8 (bfloat16, quantized (Int8Tensor)) weights;")
    assert message.endswith("this model's are bfloat16: continue it on the model loaded with --dtype int8")
    message = refused(paths["bf16"], int8, "computed with bfloat16 weights; this model's are int8 (bfloat16, quantized")
    assert message.endswith("continue it on the model loaded with --dtype bfloat16"), message
    # int8 both, quantized from other float weights (a folder saved quantized from float32 runs as saved under
    # --dtype int8): the way on is the file's float weights, not the --dtype the user already gave
    int8_of_float32 = perturbed_model(tiny_config(), seed=10)
    torchao.quantize_(int8_of_float32, torchao.Int8WeightOnlyConfig())
    message = refused(paths["int8"], int8_of_float32, "this model's are int8 (float32, quantized (Int8Tensor))")
    assert message.endswith(
        ": both are int8, quantized from other float weights; continue it on a model whose are bfloat16, quantized"
        " (Int8Tensor)"
    ), message
    for path in paths.values():
        without_metadata(path, "dtype_name", "merged_adapters_hashed")
    GPNCache.load(paths["int8"], int8)
    GPNCache.load(paths["bf16"], bf16)
    message = refused(paths["int8"], bf16, "computed with bfloat16, quantized (Int8Tensor) weights;")
    assert message.endswith("this model's are bfloat16"), message
    message = refused(paths["bf16"], int8, "computed with bfloat16 weights;")
    assert message.endswith("this model's are bfloat16, quantized (Int8Tensor)"), message


def test_a_quantized_weight_has_one_dtype_name_for_state_files_and_for_dtype():
    """A state file's `dtype_name` and the tools' `quantized_as` (what `--dtype int8 | int4` takes a folder saved
    quantized for) had two recognisers, torchao's class names and the fast path's, which disagreed at the edges: an
    int8 or int4 weight of float16 was "int8" / "int4" to a state file and another quantization to `--dtype int8`,
    refused as saved; an int8 weight of per-group scales, or either with activation quantization (which no `--dtype`
    makes), was "int8" / "int4" to a state file, whose refusal then sent the user to `--dtype int8`. Both now read
    `state_file.quantized_kind`: the name is what `--dtype` makes, of any float dtype; any other quantization is its
    class."""
    torchao = pytest.importorskip("torchao.quantization", reason="torchao (the test extra) quantizes the weights")
    from torchao.quantization.granularity import PerAxis, PerGroup

    from modeling_gpn.cli.quantization import quantize_for, quantized_as
    from modeling_gpn.state_file import dtype_name

    int4 = {"weight_dtype": torch.int4}
    cases = [  # (float dtype, torchao's config, the name)
        (torch.bfloat16, torchao.Int8WeightOnlyConfig(), "int8"),
        (torch.float16, torchao.Int8WeightOnlyConfig(), "int8"),
        (torch.bfloat16, torchao.Int8WeightOnlyConfig(granularity=PerGroup(16)), "Int8Tensor"),
        (torch.bfloat16, torchao.Int8DynamicActivationInt8WeightConfig(), "Int8Tensor"),
        (torch.bfloat16, torchao.IntxWeightOnlyConfig(**int4, granularity=PerAxis(0)), "int4"),
        (torch.float16, torchao.IntxWeightOnlyConfig(**int4, granularity=PerGroup(16)), "int4"),
        (torch.float32, torchao.Int8DynamicActivationIntxWeightConfig(**int4), "IntxUnpackedToInt8Tensor"),
        (torch.bfloat16, torchao.IntxWeightOnlyConfig(weight_dtype=torch.int2), "IntxUnpackedToInt8Tensor"),
    ]
    for dtype, config, name in cases:
        model = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False), torch.nn.Linear(32, 8, bias=False)).to(dtype)
        torchao.quantize_(model, config)
        case = f"{config} of {dtype}"
        assert quantized_as(model) == {name}, case
        assert dtype_name(model) == (name if name in ("int8", "int4") else ""), case
        if name in ("int8", "int4"):
            assert quantize_for(model, name) is model, case  # (run as saved)
        else:
            with pytest.raises(ValueError, match=rf"saved quantized already \({name} weights\): --dtype int8"):
                quantize_for(model, "int8")


@pytest.mark.parametrize("cut", [4, 40, "header", "data", 1])
def test_a_truncated_state_file_is_refused(saved, tmp_path, cut):
    model, path = saved
    payload = path.read_bytes()
    header_end = 8 + int.from_bytes(payload[:8], "little")
    keep = {"header": header_end - 10, "data": header_end + 100, 1: len(payload) - 1}.get(cut, cut)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(payload[:keep])
    refused(truncated, model, "truncated" if cut != "data" and cut != 1 else "damaged")


def test_a_damaged_state_file_is_refused(saved, tmp_path):
    model, path = saved
    payload = path.read_bytes()
    header_end = 8 + int.from_bytes(payload[:8], "little")
    for offset in (header_end + 3, len(payload) - 2, header_end + (len(payload) - header_end) // 2):
        flipped = bytearray(payload)
        flipped[offset] ^= 0x10  # one bit of the state's data
        damaged = tmp_path / f"flip-{offset}.safetensors"
        damaged.write_bytes(bytes(flipped))
        refused(damaged, model, "checksum")
    for offset in (0, 9, header_end - 2):  # the header length, and inside the header
        flipped = bytearray(payload)
        flipped[offset] ^= 0x20
        damaged = tmp_path / f"header-{offset}.safetensors"
        damaged.write_bytes(bytes(flipped))
        with pytest.raises(GPNStateFileError, match=re.escape(str(damaged))):
            GPNCache.load(damaged, model)
    weights = tmp_path / "model"
    model.save_pretrained(weights)
    refused(weights / "model.safetensors", model, "not a GPN state file")
    missing = tmp_path / "nowhere.safetensors"
    refused(missing, model, "Cannot read")


def test_a_pipe_is_refused_by_name_without_being_read(saved, tmp_path):
    """`GPNCache.load` read any path to its end: a FIFO blocked it until a writer came and went (and took what was
    written for a damaged file), `/dev/zero` filled the memory. Only a regular file is read; and `save` refuses to
    put a file in a pipe's place."""
    import os
    import stat
    import threading

    model, _ = saved
    pipe = tmp_path / "pipe.safetensors"
    os.mkfifo(pipe)
    writer = os.open(pipe, os.O_RDWR)  # (never blocks) a writer is there, so the unfixed load does not hang

    def write_then_close():
        os.write(writer, b"x" * 16)
        threading.Event().wait(0.2)
        os.close(writer)

    thread = threading.Thread(target=write_then_close)
    thread.start()
    try:
        with pytest.raises(GPNStateFileError, match="is a device, pipe or socket, not a GPN state file"):
            GPNCache.load(pipe, model)
    finally:
        thread.join()
    # nor written: the rename put a state file in the pipe's place (as root, in /dev/full's and /dev/stdout's)
    with pytest.raises(OSError, match="a device, pipe or socket, not a file") as error:
        GPNCache.load(saved[1], model).save(pipe)
    assert error.value.filename == str(pipe) and stat.S_ISFIFO(os.lstat(pipe).st_mode)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["pipe.safetensors", "state.safetensors"]


def test_a_non_finite_state_is_refused(saved, tmp_path):
    model, path = saved
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    metadata = json.loads(path.read_bytes()[8 : 8 + header_length])["__metadata__"]
    tensors = safetensors.torch.load(path.read_bytes())
    tensors["memory"][1, 2, 3, 4] = float("nan")  # a consistent file (checksum and all) of a non-finite state
    poisoned = tmp_path / "nan.safetensors"
    poisoned.write_bytes(
        safetensors.torch.save(
            tensors, metadata={**metadata, "checksum": _state_checksum(tensors, metadata["read_fingerprint"], "7")}
        )
    )
    refused(poisoned, model, "NaN or infinite")
    # and save never writes one
    cache = GPNCache.load(path, model)
    cache.state_layer.recurrent_states[0][0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or infinite"):
        cache.save(tmp_path / "inf.safetensors")
    assert not (tmp_path / "inf.safetensors").exists()


def test_a_state_of_no_rows_is_neither_saved_nor_loaded(saved, tmp_path):
    """A cache whose rows were all selected away was saved, into a file every load refused as a read fingerprint
    "of shape (0,)"; such a file (consistent, checksum and all) is refused saying it holds no rows."""
    model, path = saved
    cache = GPNCache.load(path, model)
    cache.batch_select_indices(torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="holds no rows"):
        cache.save(tmp_path / "empty.safetensors")
    assert not (tmp_path / "empty.safetensors").exists()
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    metadata = json.loads(path.read_bytes()[8 : 8 + header_length])["__metadata__"]
    tensors = {name: tensor[:0] for name, tensor in safetensors.torch.load(path.read_bytes()).items()}
    empty = tmp_path / "forged.safetensors"
    checksum = _state_checksum(tensors, "unknown", "7")
    empty.write_bytes(
        safetensors.torch.save(tensors, metadata={**metadata, "read_fingerprint": "unknown", "checksum": checksum})
    )
    refused(empty, model, "no rows")


@pytest.mark.parametrize(
    "read_fingerprint, needle",
    [
        ("[[1, 2], [3, 2147483647]]", "outside"),
        ("[[1, 2], [-3, 4]]", "outside"),
        ('[["a", 2], [3, 4]]', "not a table"),
        ("[[1, 2], [3, 99999999999999999999999]]", "not a table"),
        pytest.param("[[1.7, 2], [3, 4]]", "not a table", id="float"),  # (taken as 1 before)
        pytest.param("[[true, 2], [3, 4]]", "not a table", id="bool"),
    ],
)
def test_a_read_fingerprint_no_cache_computes_is_refused(saved, tmp_path, read_fingerprint, needle):
    """A consistent file (checksum and all) whose read fingerprint a cache could not have computed (values
    outside [0, 2^31 - 1), not integers) is refused, not taken to judge continuations."""
    model, path = saved
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    metadata = json.loads(path.read_bytes()[8 : 8 + header_length])["__metadata__"]
    tensors = safetensors.torch.load(path.read_bytes())
    forged = tmp_path / "forged.safetensors"
    forged.write_bytes(
        safetensors.torch.save(
            tensors,
            metadata={
                **metadata,
                "read_fingerprint": read_fingerprint,
                "checksum": _state_checksum(tensors, read_fingerprint, "7"),
            },
        )
    )
    refused(forged, model, needle)


@pytest.mark.parametrize(
    "read_head, needle",
    [
        pytest.param('{"length": 3, "rows": [[1, 2], [3, 2147483647]]}', "outside", id="outside"),
        pytest.param('{"length": 3, "rows": [[1.5, 2], [3, 4]]}', "not a length and a table", id="float"),
        pytest.param('{"length": 8, "rows": [[1, 2], [3, 4]]}', "within the 7 positions read", id="longer"),
        pytest.param('{"length": 3, "rows": [[1, 2]]}', "not (2, 2)", id="rows"),
        pytest.param("[1, 2]", "not a length and a table", id="list"),
    ],
)
def test_a_read_head_no_cache_computes_is_refused(saved, tmp_path, read_head, needle):
    """The head of the first call (what a loaded state refuses a departing history by) is recorded outside the
    checksum, so that an earlier version of format 2 reads the file: one that no cache could have kept (values
    outside [0, 2^31 - 1), not integers, longer than what was read, another number of rows) is refused by name."""
    model, path = saved
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    metadata = json.loads(path.read_bytes()[8 : 8 + header_length])["__metadata__"]
    assert json.loads(metadata["read_head"])["length"] == 3  # (the first half of the 7 positions of its one call)
    forged = tmp_path / "forged.safetensors"
    forged.write_bytes(
        safetensors.torch.save(safetensors.torch.load(path.read_bytes()), {**metadata, "read_head": read_head})
    )
    refused(forged, model, needle)


def test_a_changed_count_of_positions_read_is_refused(saved, tmp_path):
    """The positions read are where a continuation counts from: a file whose count was changed after it was
    saved (its tensors and their checksum left as they were) is damaged, not a state of that many positions."""
    model, path = saved
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    metadata = json.loads(path.read_bytes()[8 : 8 + header_length])["__metadata__"]
    tensors = safetensors.torch.load(path.read_bytes())
    for count in ("5", "100000000000000000000000"):
        changed = tmp_path / f"positions-{count[:3]}.safetensors"
        changed.write_bytes(safetensors.torch.save(tensors, metadata={**metadata, "positions_read": count}))
        refused(changed, model, "checksum")


def test_a_state_is_not_saved_after_its_model_changed(tmp_path):
    """A state names the model that computed it, not the one it was saved beside: weights edited in place
    (an optimizer step), replaced (`load_state_dict`) or cast after the state was computed refuse the save, naming
    why (the file named the edited model, which then loaded a state it never computed). The same model, unedited,
    saves, and so does a state computed again after the edit; a loaded state is checked from its loading."""
    model = perturbed_model(tiny_config(eos_token_id=None), seed=13)
    ids, path = token_ids(1, 5, seed=13), tmp_path / "state.safetensors"
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
        cache.save(path)  # unedited: saved
        model.model.embed_tokens.weight[3, 1] += 0.5  # in place (as an optimizer step): a version bump
    with pytest.raises(ValueError, match="changed after this state was computed") as error:
        cache.save(path)
    assert str(path) in str(error.value)
    with torch.no_grad():  # continued by the edited model: a state of neither model
        model(ids[:, :1], attention_mask=torch.ones(1, 6, dtype=torch.long), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="changed after this state was computed"):
        cache.save(path)
    with torch.no_grad():
        again = model(ids, use_cache=True).cache
    again.save(tmp_path / "again.safetensors")  # computed with the model as it is now
    loaded = GPNCache.load(tmp_path / "again.safetensors", model)
    model.load_state_dict(perturbed_model(tiny_config(eos_token_id=None), seed=14).state_dict())
    with pytest.raises(ValueError, match="changed after this state was computed"):
        loaded.save(tmp_path / "loaded.safetensors")
    with torch.no_grad():
        cast = model(ids, use_cache=True).cache
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="changed after this state was computed"):
        cast.save(tmp_path / "cast.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.safetensors", "state.safetensors"]


def test_the_state_file_says_whose_state_it_is(saved):
    model, path = saved
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    metadata = json.loads(path.read_bytes()[8 : 8 + header_length])["__metadata__"]
    assert metadata["format"] == "gpn-state" and metadata["positions_read"] == "7" and metadata["batch_size"] == "2"
    assert {key: metadata[key] for key in state_fingerprint(model.model)} == state_fingerprint(model.model)
    assert json.loads(metadata["state_config"])["hidden_size"] == 48
    with pytest.raises(ValueError, match="holds no state"):
        GPNCache().save(path.parent / "empty.safetensors")


def test_one_state_saved_again_is_the_same_file_byte_for_byte(saved, tmp_path):
    """safetensors writes its header from hash maps seeded afresh for each save: the metadata's order, and so the
    file's bytes, differed from one save of a state to the next (in one process or two), so equal states could not be
    told equal by their files' hashes. The header is now written in order of its names."""
    model, path = saved
    state = GPNCache.load(path, model)
    for n in range(4):  # (13 metadata entries: unordered, 4 saves alike by chance are out of reach)
        state.save(tmp_path / f"again-{n}.safetensors")
        assert (tmp_path / f"again-{n}.safetensors").read_bytes() == path.read_bytes(), n


def test_a_state_is_saved_after_its_model_is_deleted_by_the_fingerprint_taken_before(tmp_path):
    """A server unloads an idle model and still writes its kept states: `save(model_fingerprint=...)`, the
    fingerprint taken while the model was loaded, writes a file the same model, loaded again, continues from.
    Without it the cache refuses, and a fingerprint no model gives is refused before anything is written."""
    import gc

    ids = torch.tensor([[5, 17, 3, 44]])
    model = perturbed_model(tiny_config(eos_token_id=None), seed=31)
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
    fingerprint = state_fingerprint(model.model)
    del model
    gc.collect()
    with pytest.raises(ValueError, match="does not know the model"):
        cache.save(tmp_path / "no-model.safetensors")
    for bad, needle in (({**fingerprint, "state_config": "{}"}, "not one state_fingerprint"), ({}, "has the fields")):
        with pytest.raises(ValueError, match=needle):
            cache.save(tmp_path / "bad.safetensors", model_fingerprint=bad)
    assert not list(tmp_path.iterdir())
    cache.save(tmp_path / "state.safetensors", model_fingerprint=fingerprint)
    reloaded = perturbed_model(tiny_config(eos_token_id=None), seed=31)
    loaded = GPNCache.load(tmp_path / "state.safetensors", reloaded)
    assert all(torch.equal(a, b) for a, b in zip(loaded.get_state(), cache.get_state()))
    refused(tmp_path / "state.safetensors", perturbed_model(tiny_config(eos_token_id=None), seed=32), "another model")


# --------------------------------------------------------------------------------------------------
# 3. Fork: one state, N continuations
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_fork_equals_separate_prompts():
    model = perturbed_model(tiny_config(eos_token_id=None), seed=12)
    system = token_ids(1, 15, seed=13)  # the shared prompt, read once
    questions = token_ids(3, 4, seed=14)  # three different continuations of it
    settings = dict(max_new_tokens=7, do_sample=False, pad_token_id=0)
    separate = model.generate(torch.cat([system.expand(3, -1), questions], 1), **settings)

    cache = model(system, use_cache=True).cache
    forked = cache.fork(3)
    assert forked.get_seq_length() == 15 and forked.get_state()[2].shape[0] == 3
    mask = torch.ones(3, 15 + 4, dtype=torch.long)
    continued = model.generate(questions, attention_mask=mask, cache=forked, **settings)
    assert torch.equal(continued[:, 4:], separate[:, 19:])
    assert cache.get_seq_length() == 15 and cache.get_state()[0].shape[0] == 1  # the original is untouched
    # of several rows, each row's copies lie together (rows i*n .. i*n + n - 1 hold row i), not the batch tiled
    two_rows = model(token_ids(2, 5, seed=15), use_cache=True).cache
    three_each = two_rows.fork(3)
    for original, copies in zip(two_rows.get_state(), three_each.get_state()):
        assert not torch.equal(original[0], original[1])
        assert torch.equal(copies, original.repeat_interleave(3, dim=0))
    assert torch.equal(three_each.read_fingerprint(), two_rows.read_fingerprint().repeat_interleave(3, dim=0))

    # N sampled continuations of one prompt: the prompt's state forked, each row sampled on its own
    sampling = dict(max_new_tokens=6, do_sample=True, top_k=30, pad_token_id=0)
    torch.manual_seed(3)
    sampled_separately = model.generate(system.expand(4, -1), **sampling)
    prefix_state = model(system[:, :-1], use_cache=True).cache.fork(4)
    torch.manual_seed(3)
    sampled_from_fork = model.generate(
        system[:, -1:].expand(4, -1), attention_mask=torch.ones(4, 15, dtype=torch.long), cache=prefix_state, **sampling
    )
    assert torch.equal(sampled_from_fork[:, 1:], sampled_separately[:, 15:])
    assert len({tuple(row.tolist()) for row in sampled_from_fork}) > 1  # sampled: the rows differ


def test_fork_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="no state to fork"):
        GPNCache().fork(2)
    model = perturbed_model(tiny_config(), seed=1)
    with torch.no_grad():
        cache = model(token_ids(1, 3, seed=1), use_cache=True).cache
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive number of copies"):
            cache.fork(bad)


@torch.no_grad()
def test_beam_search_from_a_state_is_refused_by_name():
    """Beam search from a given cache that holds a state is not supported (docs/cache.md): refused as that, not
    by the forward's "the cache holds 1 rows but the input has 2", rows the caller never asked for."""
    model = perturbed_model(tiny_config(), seed=1)
    state = model(token_ids(1, 5, seed=1), use_cache=True).cache
    more = token_ids(1, 3, seed=2)
    with pytest.raises(ValueError, match=r"Beam search \(num_beams=2\) cannot continue from a given cache"):
        model.generate(more, cache=state.fork(1), num_beams=2, max_new_tokens=3)
    assert model.generate(more, cache=GPNCache(), num_beams=2, max_new_tokens=3).shape == (1, 6)  # empty: fine
    assert model.generate(more, cache=state.fork(1), max_new_tokens=3).shape == (1, 6)  # greedy from a state


@torch.no_grad()
def test_a_pickled_or_copied_cache_continues_as_the_original(tmp_path):
    """A cache pickles (multiprocessing, `torch.save`) and deep-copies: either copy continues to the original's
    tokens. The pickle leaves the model behind (its `save` says so by name, as for any cache no GPN filled);
    the deep copy keeps it, so it saves as the original does."""
    import copy
    import pickle

    model = perturbed_model(tiny_config(eos_token_id=None), seed=12)
    prompt, follow = token_ids(2, 6, seed=15), token_ids(2, 1, seed=16)
    settings = dict(attention_mask=torch.ones(2, 7, dtype=torch.long), max_new_tokens=5, do_sample=False)
    cache = model(prompt, use_cache=True).cache
    unpickled, copied = pickle.loads(pickle.dumps(cache)), copy.deepcopy(cache)
    expected = model.generate(follow, cache=cache, pad_token_id=0, **settings)
    for other in (unpickled, copied):
        assert other.get_seq_length() == 6
        assert torch.equal(model.generate(follow, cache=other, pad_token_id=0, **settings), expected)
    with pytest.raises(ValueError, match="does not know the model that filled it"):
        pickle.loads(pickle.dumps(model(prompt, use_cache=True).cache)).save(tmp_path / "pickled.safetensors")
    copy.deepcopy(model(prompt, use_cache=True).cache).save(tmp_path / "copied.safetensors")
    assert GPNCache.load(tmp_path / "copied.safetensors", model).get_seq_length() == 6


# --------------------------------------------------------------------------------------------------
# 4. On the command line: gpn generate --save-state / --state
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generate_dir(tmp_path_factory):
    """A tiny GPN folder with its own byte-level BPE tokenizer (no EOS stop, so every run is full length)."""
    from modeling_gpn.data import train_bpe_tokenizer

    folder = tmp_path_factory.mktemp("generate-state")
    tokenizer = train_bpe_tokenizer(["the cat sat on the mat. " * 20, "to be or not to be " * 20], 300)
    tokenizer.save_pretrained(folder)
    perturbed_model(tiny_config(vocab_size=len(tokenizer), eos_token_id=None), seed=13).save_pretrained(folder)
    return folder


def printed_texts(stdout: str) -> list[str]:
    """The texts `gpn generate` printed, one per prompt (each followed by a line of dashes; a text may hold
    newlines of its own)."""
    return stdout.split("\n" + "-" * 40 + "\n")[:-1]


def gpn_generate(*args) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "gpn_cli", "generate", *map(str, args), "--device", "cpu"]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=one_thread_environment())


def test_cli_save_state_then_continue_equals_one_run(generate_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    state = tmp_path / "story.safetensors"
    # saved in this process (run_cli, below), continued in a fresh one through the console script
    code, _, err = run_cli(capsys, generate_dir, "the cat sat", "--max-new-tokens", "5", "--save-state", state)
    assert code == 0 and f"written to {state}" in err and state.is_file(), err
    second = gpn_generate(generate_dir, "--state", state, " on the", "--max-new-tokens", "6")
    assert second.returncode == 0, second.stderr

    # The same text read in one process, token for token: the prompt, the 5 generated tokens, " on the", 6 more
    tokenizer = AutoTokenizer.from_pretrained(generate_dir)
    model = AutoModelForCausalLM.from_pretrained(generate_dir).eval()
    prompt = tokenizer("the cat sat", return_tensors="pt").input_ids
    with torch.no_grad():
        story = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        follow = tokenizer(" on the", return_tensors="pt", add_special_tokens=False).input_ids
        whole = model.generate(torch.cat([story, follow], 1), max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = " on the" + tokenizer.decode(whole[0, story.shape[1] + follow.shape[1] :], skip_special_tokens=True)
    assert printed_texts(second.stdout)[0] == expected
    assert GPNCache.load(state, model).get_seq_length() == prompt.shape[1] + 5


def test_cli_three_turns_read_the_ids_of_one_text_with_a_sentencepiece_tokenizer(tmp_path, capsys):
    """Turn by turn (`--save-state`, then `--state` and `--save-state` again, then a sampled third turn), the model
    reads the ids one call reads for the whole text: the prompt's BOS once, each answer's ids, and each following
    text as the middle of a text. Tokenized alone, Llama 2's tokenizer (the paper's) put a "▁" in front of every
    continuation ("\nUser: hi" read as " \nUser: hi"), ids the text in one piece never holds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "model"
    AutoTokenizer.from_pretrained(require_shared("data/llama2-tokenizer")).save_pretrained(folder)
    perturbed_model(tiny_config(vocab_size=32000, eos_token_id=None, bos_token_id=1), seed=4).save_pretrained(folder)
    turns, states = (
        ["Hello there", "\nUser: hi", "\nUser: more"],
        [tmp_path / "1.safetensors", tmp_path / "2.safetensors"],
    )
    printed = [run_cli(capsys, folder, turns[0], "--max-new-tokens", 3, "--save-state", states[0])]
    printed.append(
        run_cli(capsys, folder, "--state", states[0], turns[1], "--max-new-tokens", 3, "--save-state", states[1])
    )
    printed.append(
        run_cli(capsys, folder, "--state", states[1], turns[2], "--max-new-tokens", 3, "--sample", "--seed", 7)
    )
    assert all(code == 0 for code, _, _ in printed), [err for _, _, err in printed]

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids, expected = tokenizer(turns[0], return_tensors="pt").input_ids, []  # the first prompt, with its BOS
    for turn, follow in enumerate(turns):
        follow_ids = ids
        if turn:  # the ids of `follow` in one text, after whole words: the first prompt's, say
            in_text = tokenizer(turns[0] + follow).input_ids[len(tokenizer(turns[0]).input_ids) :]
            assert in_text != tokenizer(follow, add_special_tokens=False).input_ids  # (the case in point)
            follow_ids = torch.tensor([in_text])
            ids = torch.cat([ids, follow_ids], 1)
        torch.manual_seed(7)
        sampling = dict(do_sample=True, temperature=0.8, top_p=0.95) if turn == 2 else dict(do_sample=False)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=3, pad_token_id=0, **sampling)
        before = tokenizer.decode(follow_ids[0], skip_special_tokens=True)
        after = tokenizer.decode(torch.cat([follow_ids[0], out[0, ids.shape[1] :]]), skip_special_tokens=True)
        expected.append(follow + after[len(before) :])
        ids = out
    assert [printed_texts(out)[0] for _, out, _ in printed] == expected
    assert GPNCache.load(states[1], model).get_seq_length() == 1 + 2 + 3 + 4 + 3  # BOS once, no "▁" before "\n"


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """`gpn generate ARGS` through the console script's own entry point, in this process."""
    from gpn_cli import main as gpn_main

    code = gpn_main(["generate", *map(str, args), "--device", "cpu"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_one_saved_state_continues_several_prompts_and_saves_again(generate_dir, tmp_path, capsys):
    state, again = tmp_path / "system.safetensors", tmp_path / "again.safetensors"
    assert run_cli(capsys, generate_dir, "to be or", "--max-new-tokens", "2", "--save-state", state)[0] == 0
    code, both, err = run_cli(
        capsys, generate_dir, "--state", state, " not", " the cat", "--max-new-tokens", "4", "--save-state", again
    )
    assert code == 0, err
    alone = [
        run_cli(capsys, generate_dir, "--state", state, prompt, "--max-new-tokens", "4")[1]
        for prompt in (" not", " the cat")
    ]
    assert printed_texts(both)[0] == printed_texts(alone[0])[0]  # one state row, forked to each prompt
    assert printed_texts(both)[1] == printed_texts(alone[1])[0]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(generate_dir)
    assert GPNCache.load(again, model).get_state()[0].shape[0] == 2
    code, _, err = run_cli(capsys, generate_dir, "--state", again, "a", "b", "c", "--max-new-tokens", "1")
    assert code == 2 and "holds 2 rows" in err


@pytest.mark.parametrize(
    "case", ["missing", "damaged", "other-model", "other-tokenizer", "beams", "no-folder", "save-to-folder"]
)
def test_cli_bad_state_is_one_clear_line(generate_dir, tmp_path, capsys, case):
    state = tmp_path / "s.safetensors"
    extra = []
    if case == "damaged":
        assert run_cli(capsys, generate_dir, "the cat", "--max-new-tokens", "1", "--save-state", state)[0] == 0
        state.write_bytes(state.read_bytes()[:-7])
        needle = "damaged"
    elif case == "other-model":
        other_model = perturbed_model(tiny_config(), seed=1)
        with torch.no_grad():
            cache = other_model(token_ids(1, 3, seed=1), use_cache=True).cache
        cache.save(state)
        needle = "another model"
    elif case == "other-tokenizer":  # of the model's vocabulary size: its ids were continued as other words
        from modeling_gpn.data import train_bpe_tokenizer

        assert run_cli(capsys, generate_dir, "the cat", "--max-new-tokens", "1", "--save-state", state)[0] == 0
        other = train_bpe_tokenizer(["a stitch in time saves nine. " * 20, "all that glitters is not gold " * 20], 300)
        other.save_pretrained(tmp_path / "other")
        # (the model's own tokenizer continues it; naming it again is no change)
        assert run_cli(capsys, generate_dir, "--state", state, "hi", "--tokenizer", generate_dir)[0] == 0
        extra, needle = ["--tokenizer", tmp_path / "other"], "another tokenizer's ids"
    elif case == "beams":
        state.write_bytes(b"x")
        extra, needle = ["--num-beams", "2"], "--num-beams"
    elif case == "no-folder":
        extra, needle = ["--save-state", tmp_path / "no" / "such.safetensors"], "its folder does not exist"
        state.write_bytes(b"x")
    elif case == "save-to-folder":  # (failed at the save, after generating)
        extra, needle = ["--save-state", tmp_path], "is not a file"
        state.write_bytes(b"x")
    else:
        needle = "is not a file"
    code, out, err = run_cli(capsys, generate_dir, "--state", state, "hi", "--max-new-tokens", "2", *extra)
    lines = [line for line in err.splitlines() if line.startswith("gpn generate:")]
    assert code == 2 and "Traceback" not in err and out == "", err
    assert len(lines) == 1 and needle in lines[0], err
    if case not in ("beams", "no-folder", "save-to-folder"):
        assert str(state) in lines[0]


def test_a_save_over_a_file_that_is_no_state_is_refused_and_the_file_kept(generate_dir, saved, tmp_path, capsys):
    """`gpn generate --save-state MODEL/model.safetensors` (or config.json, or a link to either) replaced the model's
    weights with the state, in silence, exit status 0; `GPNCache.save` too. Now a file there that is not a state is
    refused, before anything is generated, and kept; a state file, an empty file and no file are replaced. `--state
    S --save-state S` continues and saves back to S, as saving to another file would."""
    import os

    model, path = saved
    cache = GPNCache.load(path, model)
    weights = tmp_path / "weights.safetensors"
    safetensors.torch.save_file({"w": torch.ones(3)}, weights)
    before = weights.read_bytes()
    with pytest.raises(GPNStateFileError, match=f"^Cannot save a state to {weights}: it holds a file that is not"):
        cache.save(weights)
    assert weights.read_bytes() == before
    (tmp_path / "empty").touch()
    cache.save(tmp_path / "empty")
    cache.save(path)  # (a state replaces a state)
    assert GPNCache.load(tmp_path / "empty", model).get_seq_length() == GPNCache.load(path, model).get_seq_length()

    model_files = {name: (generate_dir / name).read_bytes() for name in ("model.safetensors", "config.json")}
    os.symlink(generate_dir / "model.safetensors", tmp_path / "link.safetensors")
    for target in (generate_dir / "model.safetensors", generate_dir / "config.json", tmp_path / "link.safetensors"):
        code, out, err = run_cli(capsys, generate_dir, "the cat", "--max-new-tokens", "1", "--save-state", target)
        assert (code, out) == (2, ""), err
        assert f"gpn generate: error: --save-state: Cannot save a state to {target}: it holds a file that" in err
    assert {name: (generate_dir / name).read_bytes() for name in model_files} == model_files

    state, elsewhere = tmp_path / "s.safetensors", tmp_path / "t.safetensors"
    assert run_cli(capsys, generate_dir, "the cat", "--max-new-tokens", "2", "--save-state", state)[0] == 0
    continued = ["--state", state, " sat", "--max-new-tokens", "2", "--save-state"]
    assert run_cli(capsys, generate_dir, *continued, elsewhere)[0] == 0
    assert run_cli(capsys, generate_dir, *continued, state)[0] == 0
    saved_back, saved_elsewhere = (safetensors.safe_open(f, "pt") for f in (state, elsewhere))
    assert saved_back.metadata() == saved_elsewhere.metadata()  # (its checksum covers the tensors)


def test_a_state_is_not_saved_under_a_weights_name_in_a_model_folder_and_a_sharded_copy_takes_its_states(
    generate_dir, saved, tmp_path, capsys
):
    """`gpn generate SHARDED --save-state SHARDED/model.safetensors` (a `max_shard_size` save: shards and an index, no
    model.safetensors) wrote the state there, exit status 0, and every later load of the folder read the state as
    the model's weights (transformers reads model.safetensors before an index). A state named as a weights file
    (model.safetensors, the index, pytorch_model.bin and its index) is refused in a folder holding config.json and
    nothing is written; elsewhere the name is free. The sharded copy of a model takes the unsharded one's states
    (one weights fingerprint) and gives the same tokens."""
    from transformers import AutoModelForCausalLM

    model, path = saved
    cache = GPNCache.load(path, model)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 1 and not (sharded / "model.safetensors").exists()
    names = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
    for name in names[:1] + names[2:]:  # (the index is there: refused as a file that is no state, as before)
        with pytest.raises(GPNStateFileError, match=f"is a model folder .* reads {re.escape(name)} as the model"):
            cache.save(sharded / name)
        assert not (sharded / name).exists()
    cache.save(tmp_path / "model.safetensors")  # (no config.json beside it: no model reads it)
    reloaded = AutoModelForCausalLM.from_pretrained(sharded)
    continued = GPNCache.load(path, reloaded)  # (the sharded copy's weights are the model's: its state is taken)
    ids = token_ids(2, 3, seed=11)
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(ids, cache=continued, use_cache=True).logits,
            model(ids, cache=GPNCache.load(path, model), use_cache=True).logits,
            rtol=0,
            atol=0,
        )

    shards = tmp_path / "generate-sharded"  # (generate_dir's model and tokenizer, the model in shards)
    shards.mkdir()
    for file in generate_dir.glob("tokenizer*"):
        (shards / file.name).write_bytes(file.read_bytes())
    AutoModelForCausalLM.from_pretrained(generate_dir).save_pretrained(shards, max_shard_size="20KB")
    target = shards / "model.safetensors"
    code, out, err = run_cli(capsys, shards, "the cat", "--max-new-tokens", "1", "--save-state", target)
    assert (code, out) == (2, "") and not target.exists(), err
    assert f"--save-state: Cannot save a state to {target}: {shards} is a model folder" in err
    state, again = tmp_path / "from-sharded.safetensors", tmp_path / "from-whole.safetensors"
    assert run_cli(capsys, shards, "the cat", "--max-new-tokens", "2", "--save-state", state)[0] == 0
    assert run_cli(capsys, generate_dir, "the cat", "--max-new-tokens", "2", "--save-state", again)[0] == 0
    on_whole = run_cli(capsys, generate_dir, "--state", state, " sat", "--max-new-tokens", "3")
    on_sharded = run_cli(capsys, shards, "--state", again, " sat", "--max-new-tokens", "3")
    assert on_whole[0] == on_sharded[0] == 0 and on_whole[1] == on_sharded[1], (on_whole, on_sharded)


def test_a_read_only_or_full_disk_loses_no_text_and_names_the_state_file(generate_dir, saved, tmp_path, capsys):
    """A read-only file system: `save` failed naming its hidden temporary file (removing one that was never made
    fails there too, EROFS, and that error replaced the first), and `gpn generate --save-state` generated, then
    failed at the save. A disk that fills during generation: the generated text was lost (printed only after a
    save that succeeded); now it is printed, and the failed save is one line."""
    model, path = saved
    cache = GPNCache.load(path, model)
    with small_disk(tmp_path / "read-only", "64k", read_only=True) as folder:
        with pytest.raises(OSError) as error:
            cache.save(folder / "s.safetensors")
        assert (error.value.errno, error.value.filename) == (errno.EROFS, str(folder / "s.safetensors")), error.value
        code, out, err = run_cli(capsys, generate_dir, "the cat", "--max-new-tokens", "1", "--save-state", folder / "s")
        assert (code, out) == (2, "") and f"--save-state {folder}: cannot write in {folder}" in err, err
    with small_disk(tmp_path / "full", "4k") as folder:  # room for no two-row state of this model
        state = folder / "s.safetensors"
        code, out, err = run_cli(
            capsys, generate_dir, "the cat", "to be", "--max-new-tokens", "2", "--save-state", state
        )
        lines = [line for line in err.splitlines() if line.startswith("gpn generate:")]
        assert code == 2 and len(printed_texts(out)) == 2 and "Traceback" not in err, err
        assert lines == [f"gpn generate: error: cannot write --save-state {state}: No space left on device"], err
        assert list(folder.iterdir()) == []


def test_cli_save_state_of_a_model_without_a_gpn_state_is_refused_before_generating(generate_dir, tmp_path, capsys):
    """A Llama's cache is no GPN state: `--save-state` ended in an AttributeError traceback after generating."""
    from transformers import AutoTokenizer

    from ..tiny_models import saved_tiny_llama

    llama = tmp_path / "llama"
    saved_tiny_llama(llama, AutoTokenizer.from_pretrained(generate_dir))
    state = tmp_path / "s.safetensors"
    code, out, err = run_cli(capsys, llama, "the cat", "--max-new-tokens", "2", "--save-state", state)
    assert (code, out) == (2, "") and not state.exists(), err
    assert "Traceback" not in err and [line for line in err.splitlines() if line.startswith("gpn")] == [
        f"gpn generate: error: --save-state needs a GPN model (a state of fixed size to save); {llama} is a "
        "LlamaForCausalLM"
    ]


def test_loaded_and_forked_states_keep_what_they_read_for_both_ways_of_continuing(tmp_path):
    """A saved, loaded or forked state keeps the fingerprint of the positions it read, so `generate()`
    continues it from the whole sequence (as with a KV cache) as well as from the new positions only, and
    both give the uninterrupted run's tokens. Without the fingerprint in the file, the whole sequence is
    refused after a load ("cannot tell")."""
    model = perturbed_model(tiny_config(eos_token_id=None), seed=5).eval()
    prompt = token_ids(1, 9, seed=1)
    settings = dict(do_sample=False, max_new_tokens=6, pad_token_id=0)
    uninterrupted = model.generate(prompt, **settings, max_length=None)
    first = model.generate(prompt, do_sample=False, max_new_tokens=3, pad_token_id=0, return_dict_in_generate=True)
    first.cache.save(tmp_path / "state.safetensors")
    loaded = GPNCache.load(tmp_path / "state.safetensors", model)
    assert torch.equal(loaded.read_fingerprint(), first.cache.read_fingerprint())
    forked = first.cache.fork(2)
    assert torch.equal(forked.read_fingerprint(), first.cache.read_fingerprint().repeat(2, 1))
    whole = model.generate(first.sequences, cache=loaded.fork(1), do_sample=False, max_new_tokens=3, pad_token_id=0)
    assert torch.equal(whole, uninterrupted)
    new_only = model.generate(
        first.sequences[:, loaded.get_seq_length() :], cache=loaded, do_sample=False, max_new_tokens=3, pad_token_id=0
    )
    assert torch.equal(new_only[:, -3:], uninterrupted[:, -3:])
    both = model.generate(first.sequences.repeat(2, 1), cache=forked, do_sample=False, max_new_tokens=3, pad_token_id=0)
    assert torch.equal(both, uninterrupted.repeat(2, 1))
