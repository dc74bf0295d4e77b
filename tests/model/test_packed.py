"""Packed (padding-free) batches: several sequences in one row, the state reset to zero where each starts.

A packed batch must give the loss, the logits and every gradient of running its sequences one by one, whichever
way the starts are given (`position_ids` restarting, `cu_seq_lens_q/k` with `max_length_q/k`, `seq_idx`, or all
together), with padding inside the rows, with BPTT segments, and from a cache. transformers'
`DataCollatorWithFlattening` with `Trainer`, and TRL's `SFTTrainer(packing=True, padding_free=True)` (no
override: TRL's fused LM head scores the packed rows), train a GPN. A sequence classifier (one score a row)
refuses packed rows.
"""

from __future__ import annotations

import os

import pytest
import torch

from ..tiny_models import perturbed_model, tiny_config
from ..trainer_arguments import common_arguments

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 97
# Two rows of 14 tokens: the sequences packed into each (flattened, they are cu_seq_lens' sequences).
ROW_SEQUENCE_LENGTHS = ([5, 3, 6], [2, 7, 4, 1])
VARIANTS = {
    "gpn+m": dict(),
    "gpn": dict(use_memory=False),
    "gpn+m-2l": dict(num_predict_layers=2),
}
INPUT_FORMS = ("position_ids", "cu_seq_lens", "seq_idx", "all")


def packed_problem(seed: int = 0):
    """The sequences (each (1, n) ids, with their labels: a few targets ignored) and the packed rows built from
    them as `DataCollatorWithFlattening` builds a row: ids concatenated, labels -100 at every sequence start."""
    generator = torch.Generator().manual_seed(seed)
    sequences, row_ids, row_labels = [], [], []
    for lengths in ROW_SEQUENCE_LENGTHS:
        ids_parts, label_parts = [], []
        for n in lengths:
            ids = torch.randint(1, VOCAB, (1, n), generator=generator)
            labels = ids.clone()
            labels[torch.rand(1, n, generator=generator) < 0.2] = -100
            sequences.append((ids, labels))
            ids_parts.append(ids)
            label_parts.append(torch.cat([torch.tensor([[-100]]), labels[:, 1:]], dim=1))
        row_ids.append(torch.cat(ids_parts, dim=1))
        row_labels.append(torch.cat(label_parts, dim=1))
    return sequences, torch.cat(row_ids), torch.cat(row_labels)


def packing_arguments(form: str) -> dict:
    """The arguments saying where the sequences of `ROW_SEQUENCE_LENGTHS` start, in the given form."""
    lengths = [n for row in ROW_SEQUENCE_LENGTHS for n in row]
    position_ids = torch.cat([torch.arange(n) for n in lengths]).view(len(ROW_SEQUENCE_LENGTHS), -1)
    cu_seq_lens = torch.cumsum(torch.tensor([0, *lengths]), 0).to(torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))
    forms = {
        "position_ids": dict(position_ids=position_ids),
        "cu_seq_lens": dict(
            cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=max(lengths), max_length_k=max(lengths)
        ),
        "seq_idx": dict(seq_idx=seq_idx.view(len(ROW_SEQUENCE_LENGTHS), -1)),
    }
    if form == "all":
        return {name: value for arguments in forms.values() for name, value in arguments.items()}
    return forms[form]


def gradients(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def one_by_one(model, sequences, num_items: int):
    """Loss (the sum over every sequence's targets divided by `num_items`), logits and gradients of running
    each sequence alone from the zero state."""
    model.zero_grad(set_to_none=True)
    total, logits = 0.0, []
    for ids, labels in sequences:
        output = model(ids, labels=labels, num_items_in_batch=num_items)
        output.loss.backward()
        total += output.loss.detach()
        logits.append(output.logits.detach())
    return total, logits, gradients(model)


def packed(model, row_ids, row_labels, num_items: int, **arguments):
    model.zero_grad(set_to_none=True)
    output = model(row_ids, labels=row_labels, num_items_in_batch=num_items, **arguments)
    output.loss.backward()
    return output.loss.detach(), output.logits.detach(), gradients(model)


def split_rows(logits: torch.Tensor) -> list[torch.Tensor]:
    """The packed logits cut back into the sequences, in `packed_problem`'s order."""
    pieces = []
    for row, lengths in zip(logits, ROW_SEQUENCE_LENGTHS):
        pieces += [piece[None] for piece in row.split(list(lengths))]
    return pieces


def assert_same_run(expected, got, rtol=1e-4, atol=1e-6):
    (loss, logits, grads), (packed_loss, packed_logits, packed_grads) = expected, got
    torch.testing.assert_close(packed_loss, loss, rtol=rtol, atol=atol)
    for piece, alone in zip(split_rows(packed_logits), logits):
        torch.testing.assert_close(piece, alone, rtol=rtol, atol=1e-5)
    assert packed_grads.keys() == grads.keys()
    for (
        name,
        grad,
    ) in grads.items():  # (relative to the gradient's largest entry, as tests/fast_path/recurrences.py's assert_same)
        error = ((packed_grads[name] - grad).abs().max() / grad.abs().max().clamp_min(1e-6)).item()
        assert error < rtol, f"gradient of {name} differs by {error:.2e} (relative to its max)"


# --------------------------------------------------------------------------------------------------
# The plain path: every input form, every variant, BPTT segments
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("form", INPUT_FORMS)
def test_packed_batch_equals_its_sequences_one_by_one_on_the_plain_path(variant, form):
    model = perturbed_model(tiny_config(**VARIANTS[variant]), seed=1).train()
    model.model.use_fast_path = False
    sequences, row_ids, row_labels = packed_problem()
    num_items = int((row_labels[:, 1:] != -100).sum())
    expected = one_by_one(model, sequences, num_items)
    got = packed(model, row_ids, row_labels, num_items, **packing_arguments(form))
    assert model.model.last_recurrence_path == "plain"
    assert_same_run(expected, got)


def test_packed_batch_with_checkpointed_segments_equals_one_by_one():
    """Gradient checkpointing's segments (4 tokens) cut across the packed sequences: the same gradients."""
    model = perturbed_model(tiny_config(), seed=2).train()
    model.model.use_fast_path = False
    model.config.bptt_segment_length = 4
    model.activation_checkpointing_enable()
    sequences, row_ids, row_labels = packed_problem(seed=3)
    num_items = int((row_labels[:, 1:] != -100).sum())
    expected = one_by_one(model, sequences, num_items)
    got = packed(model, row_ids, row_labels, num_items, **packing_arguments("position_ids"))
    assert_same_run(expected, got)


def test_packed_rows_with_padding_equal_one_by_one():
    """Padding inside packed rows (one pad at a sequence start, one inside a sequence, one at the end): padded
    positions leave the state unchanged and a start on a pad takes effect at the next real token."""
    model = perturbed_model(tiny_config(), seed=4).train()
    model.model.use_fast_path = False
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (1, 12), generator=generator)
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[0, [4, 7, 11]] = 0  # sequences: 0..3, 4..9 (starting on the pad at 4, a pad at 7), 10..11 (ending on a pad)
    cu_seq_lens = torch.tensor([0, 4, 10, 12], dtype=torch.int32)
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, [0, 4, 5, 10]] = -100  # nothing predicts a sequence's first real token
    num_items = int((labels[:, 1:] != -100).sum())

    model.zero_grad(set_to_none=True)
    total, alone_logits = 0.0, []
    for start, stop in zip(cu_seq_lens[:-1].tolist(), cu_seq_lens[1:].tolist()):
        output = model(
            ids[:, start:stop],
            attention_mask=mask[:, start:stop],
            labels=labels[:, start:stop],
            num_items_in_batch=num_items,
        )
        output.loss.backward()
        total += output.loss.detach()
        alone_logits.append(output.logits.detach())
    expected_grads = gradients(model)
    for form in (
        {"cu_seq_lens_q": cu_seq_lens},
        {"position_ids": torch.tensor([[0, 1, 2, 3, 0, 0, 1, 0, 2, 3, 0, 0]])},
    ):
        loss, logits, grads = packed(model, ids, labels, num_items, attention_mask=mask, **form)
        torch.testing.assert_close(loss, total, rtol=1e-5, atol=1e-6)
        real = mask[0].bool()
        torch.testing.assert_close(logits[0, real], torch.cat(alone_logits, dim=1)[0, real], rtol=1e-4, atol=1e-5)
        for name, grad in expected_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_truncated_bptt_counts_positions_in_the_row():
    """With truncated BPTT the forward values still equal one by one (the cut is on the gradient only), and
    the gradient is cut at the row's positions t % K == 0, as for an unpacked window."""
    model = perturbed_model(tiny_config(bptt_truncation_length=4), seed=6).train()
    model.model.use_fast_path = False
    sequences, row_ids, row_labels = packed_problem(seed=7)
    num_items = int((row_labels[:, 1:] != -100).sum())
    loss, logits, _ = one_by_one(model, sequences, num_items)
    packed_loss, packed_logits, _ = packed(model, row_ids, row_labels, num_items, **packing_arguments("seq_idx"))
    torch.testing.assert_close(packed_loss, loss, rtol=1e-5, atol=1e-6)
    for piece, alone in zip(split_rows(packed_logits), logits):
        torch.testing.assert_close(piece, alone, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# Caches: a packed prefill continues its last sequence; a call from a cache continues its first
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def test_a_cache_continues_the_last_packed_sequence_and_a_continuation_its_first():
    model = perturbed_model(tiny_config(), seed=8)
    model.model.use_fast_path = False
    generator = torch.Generator().manual_seed(9)
    first, second, more = (torch.randint(1, VOCAB, (1, n), generator=generator) for n in (4, 3, 5))
    row = torch.cat([first, second], dim=1)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    cache = model(row, position_ids=positions, use_cache=True).cache
    continued = model(more, cache=cache).logits
    torch.testing.assert_close(continued, model(torch.cat([second, more], dim=1)).logits[:, 3:], rtol=1e-5, atol=1e-5)
    # from a cache holding `first`: [second-part of first | a new sequence], numbered as one packed row would be
    cache = model(first, use_cache=True).cache
    # (continuing, position ids may be longer, as generate() may give the attention mask: their last columns)
    both = model(
        torch.cat([second, more], dim=1), cache=cache, position_ids=torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]])
    )
    torch.testing.assert_close(both.logits[:, :3], model(row).logits[:, 4:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both.logits[:, 3:], model(more).logits, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_generate_from_a_packed_prompt_continues_its_last_sequence():
    """Position ids the caller passes to generate() say where a packed prompt's sequences start (generate() builds
    none of its own for a GPN): the tokens are those generated from the last sequence alone."""
    model = perturbed_model(tiny_config(), seed=32)
    generator = torch.Generator().manual_seed(33)
    first, second = (torch.randint(1, VOCAB, (1, n), generator=generator) for n in (4, 3))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    packed = model.generate(torch.cat([first, second], dim=1), position_ids=positions, **settings)
    assert torch.equal(packed[:, 7:], model.generate(second, **settings)[:, 3:])
    assert not torch.equal(packed[:, 7:], model.generate(torch.cat([first, second], dim=1), **settings)[:, 7:])


@torch.no_grad()
def test_a_long_packed_prompt_is_not_cut_into_prefill_chunks(monkeypatch):
    """No-grad calls over more positions than `prefill_chunk_length` run in chunks, each continuing the
    previous one's cache; a packed batch runs in one pass instead (a sequence starting at a chunk's first
    position would not be reset), so its loss and kept logits are still its sequences' one by one."""
    model = perturbed_model(tiny_config(), seed=30)
    monkeypatch.setattr(model, "prefill_chunk_length", 4)
    sequences, row_ids, row_labels = packed_problem(seed=31)
    num_items = int((row_labels[:, 1:] != -100).sum())
    expected = sum(model(ids, labels=labels, num_items_in_batch=num_items).loss for ids, labels in sequences)
    for form in INPUT_FORMS:
        arguments = dict(
            labels=row_labels, num_items_in_batch=num_items, return_logits=False, **packing_arguments(form)
        )
        torch.testing.assert_close(model(row_ids, **arguments).loss, expected, rtol=1e-5, atol=1e-6)
    last = [ids for ids, _ in sequences][2]  # the first row's last sequence
    kept = model(row_ids, logits_to_keep=2, **packing_arguments("position_ids")).logits[0]
    torch.testing.assert_close(kept, model(last).logits[0, -2:], rtol=1e-5, atol=1e-5)
    # positions named by a tensor (transformers' form for packed rows): each sequence's last one in the first row
    sequence_ends = torch.tensor(ROW_SEQUENCE_LENGTHS[0]).cumsum(0) - 1
    kept = model(row_ids, logits_to_keep=sequence_ends, **packing_arguments("position_ids")).logits[0]
    alone = torch.cat([model(ids).logits[0, -1:] for ids, _ in sequences[: len(sequence_ends)]])
    torch.testing.assert_close(kept, alone, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_ordinary_position_ids_change_nothing():
    """Position ids that only increase over the real tokens (generate()'s for left padding, with padding at 0
    or 1) pack nothing: the logits are those without them."""
    model = perturbed_model(tiny_config(), seed=10)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(11))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    expected = model(ids, attention_mask=mask).logits
    for padding_value in (0, 1):
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, padding_value)
        torch.testing.assert_close(model(ids, attention_mask=mask, position_ids=positions).logits, expected)
    torch.testing.assert_close(model(ids, attention_mask=mask, position_ids=torch.arange(6)[None]).logits, expected)


@torch.no_grad()
@pytest.mark.parametrize("form", INPUT_FORMS)
def test_sequence_classification_refuses_rows_packing_several_sequences(form):
    """A sequence classifier gives one score a row, at its last real token: a row packing several sequences
    would be scored as its last sequence alone, the others silently unscored, so it is refused by name. Position
    ids that pack nothing (a padded batch's) and packing arguments whose every row holds one sequence score as
    without them."""
    from modeling_gpn import GPNForSequenceClassification

    model = GPNForSequenceClassification(tiny_config(num_labels=2, pad_token_id=0)).eval()
    _, row_ids, _ = packed_problem(seed=30)
    with pytest.raises(ValueError, match=r"GPNForSequenceClassification reads one result a row.*row 0, position 5"):
        model(row_ids, **packing_arguments(form))

    mask = torch.ones_like(row_ids)
    mask[1, :3] = 0  # left padding
    expected = model(row_ids, attention_mask=mask).logits
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    torch.testing.assert_close(model(row_ids, attention_mask=mask, position_ids=positions).logits, expected)
    one_each = torch.tensor([0, 14, 28], dtype=torch.int32)  # cu_seq_lens of one sequence a row
    torch.testing.assert_close(model(row_ids, attention_mask=mask, cu_seq_lens_q=one_each).logits, expected)


# --------------------------------------------------------------------------------------------------
# Bad packing arguments: one clear error each
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments,message",
    [
        (
            dict(cu_seq_lens_q=torch.tensor([0, 5, 27])),
            r"must run from 0 to the number of tokens in the batch \(2 x 14 = 28\), got 0 .. 27: the input has 1 "
            "more positions than the packed sequences, as when tokens are put in front .*PEFT's prompt tuning.*; "
            r"with an IterableDataset, Trainer's batch dispatcher \(Accelerate's\) cuts cu_seq_lens_q .*"
            '"dispatch_batches": False',
        ),
        (
            dict(cu_seq_lens_q=torch.tensor([0, 5, 30])),
            r"must run from 0 to the number of tokens in the batch \(2 x 14 = 28\), got 0 .. 30$",
        ),
        (dict(cu_seq_lens_q=torch.tensor([0, 5, 5, 28])), "strictly increasing"),
        (dict(cu_seq_lens_q=torch.tensor([0, 10, 28])), "running from row 0 into row 1"),
        (
            dict(cu_seq_lens_q=torch.tensor([[0, 14, 28]])),
            r"1-D tensor \[0, end of sequence 1, ..., 28\], got shape \(1, 3\)$",
        ),
        (dict(cu_seq_lens_q=torch.tensor([0.0, 14.0, 28.0])), "must hold integers"),
        (dict(cu_seq_lens_q=torch.tensor([0, 14, 28]), cu_seq_lens_k=torch.tensor([0, 7, 14, 28])), "differ"),
        (dict(cu_seq_lens_q=torch.tensor([0, 14, 28]), max_length_q=13), "max_length_q=13 is shorter"),
        (dict(max_length_k=14), "max_length_k was given without cu_seq_lens_k"),
        (dict(seq_idx=torch.zeros(2, 13, dtype=torch.int32)), r"seq_idx must have shape \(batch=2, seq=14\)"),
        (dict(position_ids=torch.arange(14)), r"position_ids must have shape"),
        (  # (ids cut at the right, their position ids not: the last columns would put the starts elsewhere)
            dict(position_ids=torch.cat([torch.arange(9), torch.arange(7)])[None]),
            r"got \(1, 16\); longer ones only when continuing from a cache",
        ),
        (
            dict(position_ids=torch.arange(14)[None].repeat(2, 1), cu_seq_lens_q=torch.tensor([0, 5, 14, 28])),
            r"disagree .* \(row 0, position 5\) a sequence does not start by position_ids but starts by cu_seq_lens_q",
        ),
        (  # (cut to the batch's one row by Accelerate's dispatcher, as Trainer's for an IterableDataset)
            dict(cu_seq_lens_q=torch.tensor([0])),
            r"got shape \(1,\); with an IterableDataset, Trainer's batch dispatcher \(Accelerate's\) cuts cu_seq_lens_q "
            r'to the batch\'s rows: pass TrainingArguments\(accelerator_config=\{"dispatch_batches": False\}\)',
        ),
    ],
)
def test_inconsistent_packing_arguments_are_refused_by_name(arguments, message):
    model = perturbed_model(tiny_config())
    ids = torch.randint(1, VOCAB, (2, 14))
    with pytest.raises(ValueError, match=message):
        model(ids, **arguments)


# --------------------------------------------------------------------------------------------------
# The fast path, on every backend: the C memory kernels, the torch ops, Triton (through its interpreter)
# --------------------------------------------------------------------------------------------------


BACKENDS = ("c kernels", "torch ops", "triton")


def on_every_backend(names: str, values: list[tuple], triton_takes: tuple) -> pytest.MarkDecorator:
    """`names` (after "backend") over `values` on every backend, Triton on `triton_takes` alone: a packed
    batch reaches every backend as the same resets (fast_recurrence marks them), and Triton's interpreter
    takes about 40 times the others' time, so it runs one of the cases, not each."""
    cases = [
        (backend, *value) for backend in BACKENDS for value in values if backend != "triton" or value == triton_takes
    ]
    return pytest.mark.parametrize(f"backend,{names}", cases, indirect=["backend"])


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """The fast path's backend for the test, and what `model.model.last_recurrence_backends` must say it ran:
    the C memory kernels (where they build), the torch ops (GPN_MEMORY_KERNELS=0), or Triton's steps forced
    on CPU through its interpreter (GPN_TRITON=1; tests/fast_path/test_triton_kernels.py)."""
    from modeling_gpn import memory_kernels
    from modeling_gpn import triton_kernels as tk

    from ..environment import TRITON_INTERPRETER_AT_START

    if request.param == "c kernels" and not memory_kernels.available():
        pytest.skip(f"memory kernels unavailable: {memory_kernels.unavailable_reason()}")
    if request.param == "torch ops":
        monkeypatch.setenv("GPN_MEMORY_KERNELS", "0")
    if request.param == "triton":
        if not (TRITON_INTERPRETER_AT_START and tk.available()):
            message = "triton's interpreter unavailable (TRITON_INTERPRET=1 before torch is imported, triton installed)"
            if os.environ.get("GPN_REQUIRE_TRITON") == "1":
                pytest.fail(message)
            pytest.skip(message)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv("GPN_TRITON", "1")
    return request.param


def assert_backend_ran(model, backend: str, training: bool = True) -> None:
    core = model.model
    ran = core.last_recurrence_backends
    assert core.last_recurrence_path == "fast" and ran is not None and ran.graphs is None, (
        core.last_recurrence_path,
        ran,
    )
    if backend == "triton":
        assert ran.step == "triton" and ran.step_backward == ("triton" if training else None), ran
    else:
        assert ran.step == "torch ops" and ran.memory in (None, backend), ran


@on_every_backend("form", [(form,) for form in INPUT_FORMS], triton_takes=("all",))
def test_packed_batch_equals_one_by_one_on_the_fast_path(backend, form):
    """Loss, logits and every gradient of a packed batch on the fast path == its sequences one by one (plain
    path), for every input form on every backend (Triton: the forms together); and the no-grad window
    (inference) too."""
    model = perturbed_model(tiny_config(), seed=20).train()
    sequences, row_ids, row_labels = packed_problem(seed=21)
    num_items = int((row_labels[:, 1:] != -100).sum())
    model.model.use_fast_path = False
    expected = one_by_one(model, sequences, num_items)
    model.model.use_fast_path = True
    got = packed(model, row_ids, row_labels, num_items, **packing_arguments(form))
    assert_backend_ran(model, backend)
    assert_same_run(expected, got)
    with torch.no_grad():
        logits = model(row_ids, **packing_arguments(form)).logits
    assert_backend_ran(model, backend, training=False)
    for piece, alone in zip(split_rows(logits), expected[1]):
        torch.testing.assert_close(piece, alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", ["gpn", "gpn+m-2l"])
def test_packed_variants_on_the_fast_path(backend, variant):
    model = perturbed_model(tiny_config(**VARIANTS[variant]), seed=22).train()
    sequences, row_ids, row_labels = packed_problem(seed=23)
    num_items = int((row_labels[:, 1:] != -100).sum())
    model.model.use_fast_path = False
    expected = one_by_one(model, sequences, num_items)
    model.model.use_fast_path = True
    got = packed(model, row_ids, row_labels, num_items, **packing_arguments("position_ids"))
    assert_backend_ran(model, backend)
    assert_same_run(expected, got)


@on_every_backend("segment,truncation", [(4, None), (3, 5), (None, 4)], triton_takes=(3, 5))
def test_packed_fast_path_across_bptt_segments_and_truncation_equals_plain(backend, segment, truncation):
    """BPTT segments (the backward recomputes each from its boundary, resets included) and truncation cuts:
    the fast path's loss and gradients == the plain path's on the same packed batch with padding."""
    config = tiny_config(bptt_segment_length=segment, bptt_truncation_length=truncation)
    model = perturbed_model(config, seed=24).train()
    _, row_ids, row_labels = packed_problem(seed=25)
    mask = torch.ones_like(row_ids)
    mask[0, [3, 9]] = 0
    mask[1, 13] = 0
    labels = row_labels.masked_fill(mask == 0, -100)
    arguments = dict(attention_mask=mask, **packing_arguments("cu_seq_lens"))
    model.model.use_fast_path = False
    expected = packed(model, row_ids, labels, None, **arguments)
    model.model.use_fast_path = True
    got = packed(model, row_ids, labels, None, **arguments)
    assert_backend_ran(model, backend)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-4, atol=1e-5)
    for name, grad in expected[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_fast_path_under_bf16_autocast(backend):
    """Under CPU bf16 autocast the packed fast path computes what the plain loop computes under the same
    autocast (tests/bf16_closeness.py's bar), and each sequence's loss stays its own."""
    from ..bf16_closeness import assert_bf16_close
    from ..tiny_models import well_conditioned_model

    model = well_conditioned_model(tiny_config(bptt_segment_length=5), seed=26)
    _, row_ids, row_labels = packed_problem(seed=27)
    params = dict(model.named_parameters())

    def run(fast: bool, autocast: bool):
        model.model.use_fast_path = fast
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(row_ids, labels=row_labels, **packing_arguments("seq_idx"))
        out.loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        return out.loss.detach().float(), out.logits.detach().float().log_softmax(-1), grads

    exact, plain, fast = run(False, False), run(False, True), run(True, True)
    assert_backend_ran(model, backend)
    assert_bf16_close(fast, plain, exact, params)


@pytest.mark.parametrize("backend", ["triton"], indirect=True)  # (graphs run on the Triton backend only)
@torch.no_grad()
def test_packed_windows_never_run_on_cuda_graphs(backend, monkeypatch):
    """GPN_CUDA_GRAPHS=1 (Triton): a packed window, training or not, runs the fast path without graphs (their
    static steps do not reset), and equals the plain path; an unpacked one still takes the graphs."""
    monkeypatch.setenv("GPN_CUDA_GRAPHS", "1")
    model = perturbed_model(tiny_config(), seed=28)
    _, row_ids, row_labels = packed_problem(seed=29)
    arguments = packing_arguments("position_ids")
    model.model.use_fast_path = False
    expected = model(row_ids, **arguments).logits
    model.model.use_fast_path = True
    torch.testing.assert_close(model(row_ids, **arguments).logits, expected, rtol=1e-4, atol=1e-5)
    assert_backend_ran(model, backend, training=False)
    with torch.enable_grad():
        model.train()
        expected_loss = packed(model, row_ids, row_labels, None, **arguments)
        assert_backend_ran(model, backend)
        model.model.use_fast_path = False
        torch.testing.assert_close(expected_loss[0], packed(model, row_ids, row_labels, None, **arguments)[0])
        model.model.use_fast_path = True
    model.eval()
    model(row_ids)
    assert model.model.last_recurrence_backends.graphs == "inference"


# --------------------------------------------------------------------------------------------------
# transformers' DataCollatorWithFlattening with Trainer, TRL's SFTTrainer with packing
# --------------------------------------------------------------------------------------------------


class FirstStep:
    """Records the loss and gradients of the first optimizer step (a `TrainerCallback`, made lazily)."""

    @staticmethod
    def callback():
        from transformers import TrainerCallback

        class Recorder(TrainerCallback):
            grads = None

            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                if self.grads is None:
                    self.grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

        return Recorder()


def trainer_arguments(tmp_path, **overrides):
    from transformers import TrainingArguments

    return TrainingArguments(**common_arguments(tmp_path, **{"max_steps": 3, "max_grad_norm": 0.0} | overrides))


def test_data_collator_with_flattening_trains_with_the_loss_of_the_sequences_one_by_one(tmp_path):
    """Trainer + DataCollatorWithFlattening (position ids, FlashAttention's cu_seq_lens and seq_idx): the first
    step's loss and gradients are those of the batch's sequences run one by one; the loss then falls."""
    from transformers import DataCollatorWithFlattening, Trainer

    sequences, _, _ = packed_problem(seed=14)
    rows = [{"input_ids": ids[0].tolist()} for ids, _ in sequences]
    reference = perturbed_model(tiny_config(), seed=15).train()
    reference.model.use_fast_path = False
    num_items = sum(len(row["input_ids"]) - 1 for row in rows)
    whole = [(ids, ids) for ids, _ in sequences]
    expected_loss, _, expected_grads = one_by_one(reference, whole, num_items)

    model = perturbed_model(tiny_config(), seed=15).train()
    recorder = FirstStep.callback()
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    args = trainer_arguments(tmp_path, per_device_train_batch_size=len(rows))  # one batch: every sequence
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator, callbacks=[recorder])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[0] == pytest.approx(expected_loss.item(), abs=2e-4)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(recorder.grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("column, adapter", [("position_ids", None), ("seq_idx", None), ("position_ids", "lora")])
def test_trainer_keeps_a_pre_packed_datasets_packing_column(tmp_path, column, adapter):
    """A `datasets.Dataset` of rows packed already (a `position_ids` or `seq_idx` column, the default collator and
    `remove_unused_columns=True`): `Trainer` keeps only the columns the forward's signature names, of the base model
    under PEFT, so a GPN names them; the first step's loss and gradients are those of the sequences one by one."""
    from datasets import Dataset
    from transformers import Trainer

    def build():
        model = perturbed_model(tiny_config(), seed=19).train()
        model.model.use_fast_path = False
        if adapter == "lora":
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
        return model

    sequences, row_ids, row_labels = packed_problem(seed=20)
    num_items = int((row_labels[:, 1:] != -100).sum())
    expected_loss, _, expected_grads = one_by_one(build(), sequences, num_items)
    columns = {"input_ids": row_ids, "labels": row_labels, **packing_arguments(column)}
    rows = Dataset.from_dict({name: values.tolist() for name, values in columns.items()})
    recorder = FirstStep.callback()
    args = trainer_arguments(tmp_path, max_steps=1, per_device_train_batch_size=len(rows))
    trainer = Trainer(model=build(), args=args, train_dataset=rows, callbacks=[recorder])
    trainer.train()
    assert trainer.state.log_history[0]["loss"] == pytest.approx(expected_loss.item(), abs=2e-4)
    assert recorder.grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(recorder.grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_trl_sft_trainer_with_packing_trains(tmp_path):
    """TRL's SFTTrainer(packing=True, padding_free=True), as its documentation shows (no override): the examples are
    packed into padding-free rows (position ids, cu_seq_lens, seq_idx); every step's loss -- TRL's own, through its
    fused LM head -- equals the model's own loss on the same packed batch and that of the sequences it packed, run
    one by one at the step's weights, and is the loss the trainer logs."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from modeling_gpn.data import train_bpe_tokenizer

    text = ["the cat sat on the mat.", "a dog.", "once upon a time there was a cat and a dog.", "the end."] * 4
    tokenizer = train_bpe_tokenizer(text, vocab_size=300)
    model = perturbed_model(tiny_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id), seed=16)
    model.train()
    checks = []

    def check_against_one_by_one(module, args, kwargs, output):
        """TRL's fused loss (the mean over the packed batch's targets) == the model's own loss on the batch == the
        packed sequences' own losses, run one by one on the plain path, summed over the batch's target count."""
        if not kwargs.get("fused_lm_head"):
            return
        ids, labels, cu = kwargs["input_ids"], kwargs["labels"], kwargs["cu_seq_lens_q"].tolist()
        assert {"position_ids", "seq_idx", "max_length_q"} <= kwargs.keys()
        counted = int((labels[:, 1:] != -100).sum())
        inputs = {k: v for k, v in kwargs.items() if k != "fused_lm_head"}
        with torch.no_grad():
            own = type(module).forward(module, **inputs).loss  # the class's forward: not TRL's patched one
            module.model.use_fast_path = False
            alone = sum(
                type(module).forward(module, ids[:, a:b], labels=labels[:, a:b], num_items_in_batch=counted).loss
                for a, b in zip(cu[:-1], cu[1:])
                if b - a > 1
            )
            module.model.use_fast_path = True
        checks.append((len(cu) - 1, float(output.loss), float(own), float(alone)))

    handle = model.register_forward_hook(check_against_one_by_one, with_kwargs=True)
    args = SFTConfig(
        **common_arguments(tmp_path, max_steps=3),
        packing=True,
        padding_free=True,
        max_length=24,
        per_device_train_batch_size=4,
        dataset_text_field="text",
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict({"text": text}), processing_class=tokenizer
    )
    trainer.train()
    handle.remove()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == len(checks) == 3 and all(loss == loss for loss in losses)
    assert any(sequences > 1 for sequences, *_ in checks), "TRL packed no row with several sequences"
    for (sequences, fused, own, alone), logged in zip(checks, losses):
        assert fused == pytest.approx(own, rel=1e-5) and fused == pytest.approx(alone, rel=1e-4), (
            sequences,
            fused,
            own,
            alone,
        )
        assert logged == pytest.approx(fused, rel=1e-5)


# --------------------------------------------------------------------------------------------------
# gpn train --reset-at-document-start
# --------------------------------------------------------------------------------------------------


def test_document_position_ids_restart_after_every_eos():
    from modeling_gpn.packing import document_position_ids

    eos = 0
    windows = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 0, 4], [0, 3, 3, 3, 3, 3, 3, 3, 0]])
    expected = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 0], [0, 0, 1, 2, 3, 4, 5, 6, 7]])
    assert torch.equal(document_position_ids(windows, eos), expected)


@torch.no_grad()
def test_document_position_ids_run_every_document_of_a_window_from_the_zero_state():
    """A window [end of a document | EOS-joined documents | start of one]: with `document_position_ids` the model's
    logits over each piece are those of the piece run alone (the window's first piece from the zero state too)."""
    from modeling_gpn.packing import document_position_ids

    model = perturbed_model(tiny_config(), seed=17)
    eos = model.config.eos_token_id
    generator = torch.Generator().manual_seed(18)
    pieces = [torch.randint(1, VOCAB, (1, n), generator=generator) for n in (3, 5, 1, 4)]
    pieces = [torch.cat([piece, torch.tensor([[eos]])], dim=1) for piece in pieces[:-1]] + [pieces[-1]]
    window = torch.cat(pieces, dim=1)
    logits = model(window, position_ids=document_position_ids(window, eos)).logits
    alone = torch.cat([model(piece).logits for piece in pieces], dim=1)
    torch.testing.assert_close(logits, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(model(window).logits, alone, rtol=1e-3, atol=1e-3)  # (without them, they differ)


def test_gpn_train_reset_at_document_start_trains_and_changes_the_loss(tmp_path):
    """`gpn train --reset-at-document-start` on a corpus of short documents: it trains, its first loss (the same
    weights and batch) differs from the default run's, and a non-GPN model is refused with the reason."""
    import json

    from modeling_gpn import train as train_module

    corpus = tmp_path / "docs.jsonl"
    words = "the cat sat on a mat and the dog ran to the log while a bird sang".split()
    generator = torch.Generator().manual_seed(19)
    with corpus.open("w") as handle:
        for _ in range(300):
            n = int(torch.randint(3, 12, (1,), generator=generator))
            text = " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=generator))
            handle.write(json.dumps({"text": text}) + "\n")

    def run(name: str, *extra: str) -> list[float]:
        parser = __import__("argparse").ArgumentParser()
        train_module.add_arguments(parser)
        out = tmp_path / name
        config = train_module.resolve_config(
            parser.parse_args(
                [
                    "--recipe",
                    "tiny-cpu",
                    "--dataset",
                    str(corpus),
                    "--bpe-vocab-size",
                    "300",
                    "--seq-len",
                    "32",
                    "--batch-size",
                    "4",
                    "--micro-batch-size",
                    "4",
                    "--eval-windows",
                    "4",
                    "--log-interval",
                    "1",
                    "--eval-interval",
                    "0",
                    "--checkpoint-interval",
                    "0",
                    "--sample-tokens",
                    "0",
                    "--num-threads",
                    "1",
                    "--steps",
                    "2",
                    "--output-dir",
                    str(out),
                    "--cache-dir",
                    str(tmp_path / "cache"),
                    "--no-progress",
                    "--no-loss-figure",
                    *extra,
                ]
            )
        )
        summary = train_module.train(config, show_progress=False)
        records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line]
        assert summary["val_ppl"] == summary["val_ppl"]  # (not NaN)
        return [record["loss"] for record in records if "loss" in record and "event" not in record]

    reset = run("reset", "--reset-at-document-start")
    default = run("default")
    assert len(reset) == len(default) == 2
    assert abs(reset[0] - default[0]) > 1e-4, (reset, default)
    with pytest.raises(ValueError, match="--reset-at-document-start resets a GPN's state"):
        run("llama", "--reset-at-document-start", "--recipe", "tiny-cpu-llama")
