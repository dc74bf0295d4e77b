"""Threads: two threads generating with one model at once (a threaded server) each get exactly their own tokens
(what the fast path derives, its plans and their workspaces included, lives in a scope per thread:
`derived_weights.py`), one cache advanced by two calls at once is refused rather than computed from a
half-written state (`GPNCache.claim`), and what the C kernels keep per thread goes when the thread does (a
server that starts a thread per request). And the moments another thread's work can land in, each forced (events,
a hook, a frame seen waiting) rather than hoped for: a weight replaced while a call builds its decode plan or runs
a cache's first call (seen by the next call, refused by `save`), a copy or save overlapping a call on the cache
(refused), two threads on one CUDA graph (each its own) or taking a training sweep's or the pool's buffers at once
(one each). The contract: docs/cache.md, "Threads"."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from ..backend_observer import C_STEP_KERNELS, DECODE_CALLS, FAST_PATH, PLAIN_PATH, ran
from ..environment import require_c_kernels, require_exact_int8
from ..tiny_models import perturbed_model, tiny_config


@pytest.fixture(scope="module")
def model():
    require_c_kernels()
    return perturbed_model(tiny_config(num_predict_layers=2), seed=31).eval()


def test_two_threads_generating_with_one_model_each_get_their_own_tokens(model):
    """Two threads, each with its own prompt (one row each, so that a plan shared per model would be the same
    plan) and its own cache, generate greedily at once, three times over (a barrier starts them together): each
    gets exactly the tokens and logits it gets alone, every decoded token in one C call."""
    prompts = [torch.randint(1, 97, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 7)]

    def generate(ids):
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        return out.sequences, torch.stack(out.logits)

    alone = [generate(ids) for ids in prompts]
    with ran(FAST_PATH, DECODE_CALLS, not_ran=(PLAIN_PATH,)):
        for _ in range(3):
            for (sequences, logits), (sequences_alone, logits_alone) in zip(
                at_once(generate, prompts), alone, strict=True
            ):
                assert torch.equal(sequences, sequences_alone)
                torch.testing.assert_close(logits, logits_alone, rtol=0, atol=0)


def at_once(function, arguments: list) -> list:
    """`function(argument)` for each of `arguments`, each in a thread of its own, started together (a barrier)."""
    barrier, results = threading.Barrier(len(arguments)), [None] * len(arguments)

    def run(index):
        barrier.wait()
        results[index] = function(arguments[index])

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(arguments))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.parametrize("second", ["decoded token", "prompt"])
def test_a_cache_advanced_by_two_calls_at_once_is_refused(model, second):
    """While a forward advances a cache, a second call on it from another thread (a decoded token, which runs as
    one C call writing the state in place, or a prompt through the forward) is refused with a one-line error:
    the first call's result and the cache's state are what that call gives alone, and the cache is free again
    after it. (A hook inside the first forward makes the second call, so the two always overlap.)"""
    ids = torch.randint(1, 97, (1, 8), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        cache = model(ids[:, :4], use_cache=True).cache
        with model.model.fuse_proj.register_forward_pre_hook(lambda module, args: None):  # (the same path)
            alone = model(ids[:, 4:6], cache=copy.deepcopy(cache), use_cache=True)
    other = ids[:, 6:7] if second == "decoded token" else ids[:, 6:8]
    errors = []

    def second_call():
        try:
            with torch.no_grad():
                model(other, cache=cache, use_cache=True)
        except RuntimeError as error:
            errors.append(str(error))

    def inside_the_first(module, args):
        handle.remove()  # (the second call then runs as it would alone: for one token, the one-call decode)
        thread = threading.Thread(target=second_call)
        thread.start()
        thread.join()

    handle = model.model.fuse_proj.register_forward_pre_hook(inside_the_first)
    with torch.no_grad():
        first = model(ids[:, 4:6], cache=cache, use_cache=True)
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert "being advanced by another call" in errors[0]
    torch.testing.assert_close(first.logits, alone.logits, rtol=0, atol=0)
    for held, expected in zip(cache.get_state(), alone.cache.get_state(), strict=True):
        torch.testing.assert_close(held, expected, rtol=0, atol=0)
    assert cache.get_seq_length() == 6
    with torch.no_grad(), ran(DECODE_CALLS):  # (released: the next call runs)
        model(ids[:, 6:7], cache=cache, use_cache=True)


def test_the_c_kernels_give_the_same_bits_at_any_thread_count():
    """torch's thread count (`torch.set_num_threads`) changes how the C kernels' work is shared out, never a sum:
    each product's row, norm and memory head is summed whole by one thread, in one order. A prompt and its decoded
    tokens (1 and 3 rows, widths that cut each product into several tasks) give the same logits, to the bit, at one
    thread and at two (docs/transformers.md, "Reproducibility")."""
    require_c_kernels()
    wide = perturbed_model(tiny_config(hidden_size=256, embedding_size=128, intermediate_size=512), seed=32).eval()
    results = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (1, 3):
                ids = torch.randint(1, 97, (rows, 9), generator=torch.Generator().manual_seed(rows))
                with torch.no_grad(), ran(FAST_PATH, C_STEP_KERNELS, DECODE_CALLS, not_ran=(PLAIN_PATH,)):
                    out = wide(ids[:, :6], use_cache=True)
                    logits = [out.logits]
                    for position in range(6, 9):
                        mask = torch.ones(rows, position + 1, dtype=torch.long)
                        out = wide(ids[:, position : position + 1], cache=out.cache, attention_mask=mask)
                        logits.append(out.logits)
                results[threads, rows] = torch.cat(logits, 1)
    finally:
        torch.set_num_threads(1)
    for rows in (1, 3):
        torch.testing.assert_close(results[2, rows], results[1, rows], rtol=0, atol=0, msg=f"{rows} rows")


def test_the_int8_products_buffer_of_a_thread_goes_with_the_thread():
    """The int8 products quantize their input into a buffer of the thread's own (`quantize_input`): a thread that
    ran them and ended leaves none behind (freed by its thread's destructor), so a server starting a thread per
    request does not grow by one buffer per thread (per OpenMP thread of each) for good."""
    require_exact_int8()
    torchao = pytest.importorskip("torchao.quantization", reason="torchao (the test extra) quantizes the linear")
    from modeling_gpn import memory_kernels

    linear = torch.nn.Linear(64, 48, bias=False)
    torchao.quantize_(linear, torchao.Int8WeightOnlyConfig())
    x = torch.randn(1, 64)
    memory_kernels.module_rows(linear, x)  # (this thread's buffer, and its OpenMP team's: they stay)
    before = memory_kernels.thread_buffers()
    assert before >= 1  # (the products quantized their input: the buffer this test is about was made)
    for _ in range(4):
        thread = threading.Thread(target=memory_kernels.module_rows, args=(linear, x))
        thread.start()
        thread.join()
    # (a thread's destructors run as it exits, after join() returns: its OpenMP workers' after it; so wait for them)
    for _ in range(500):
        if memory_kernels.thread_buffers() <= before:
            break
        time.sleep(0.01)
    assert memory_kernels.thread_buffers() == before


@pytest.mark.parametrize("weight", ["decode_proj", "fuse_gate_norm"])
def test_a_weight_replaced_while_another_thread_derives_is_seen_by_the_next_call(model, weight):
    """Another thread replaces a weight (`module.weight = nn.Parameter(...)`, as `load_state_dict(assign=True)` does)
    while a one-token call builds its decode plan, after the plan read the old weight: the next call continuing that
    cache (it starts after the edit) computes with the new weight, as the same calls on a model edited first do, not
    with the plan built on the old one (kept with the cache, and alive through it). The modules are noted before the
    plan reads them, so the note is older than the edit and the next call builds anew; noted after, the note matched
    the edited model and the edit was lost for every later call on the cache. The edit is forced into that moment:
    the note lets the editing thread run, and waits for it, before it is taken. `decode_proj` is read by the decode
    plan, `fuse_gate_norm` by its step plan (the prompt's call derived the scope's key before)."""
    from modeling_gpn import fast_recurrence

    ids = torch.randint(1, 97, (1, 7), generator=torch.Generator().manual_seed(9))
    model = copy.deepcopy(model)  # (edited: not the module's shared one)

    def edit(target):
        module = target.get_submodule(f"model.{weight}")
        module.weight = torch.nn.Parameter(-module.weight.detach())

    def calls(target, edit_first: bool = False):
        with torch.no_grad():
            cache = target(ids[:, :5], use_cache=True).cache
            if edit_first:
                edit(target)
            target(ids[:, 5:6], cache=cache, use_cache=True)  # (the call during which the other thread edits)
            with ran(DECODE_CALLS):
                return target(ids[:, 6:7], cache=cache, use_cache=True).logits

    expected, unedited = calls(copy.deepcopy(model), edit_first=True), calls(copy.deepcopy(model))
    assert not torch.allclose(expected, unedited, atol=1e-3)
    edits = []

    class EditedMeanwhile(fast_recurrence.WatchedModules):
        def __init__(self, *args, **kwargs):
            if not edits:  # (the middle call's note: the edit lands once)
                editor = threading.Thread(target=lambda: edits.append(edit(model)))
                editor.start()
                editor.join()
            super().__init__(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast_recurrence, "WatchedModules", EditedMeanwhile)
        got = calls(model)
    assert edits == [None]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@torch.no_grad()
def test_two_threads_on_graph_steps_each_read_their_own_tokens(triton_on, monkeypatch):
    """GPN_CUDA_GRAPHS=1 (the graph steps on their static buffers, through Triton's interpreter on CPU): a thread
    whose window is inside a step while another thread runs a whole window of the same batch size gets exactly the
    logits and state it gets alone. The graphs (their token input, state slots and outputs are static buffers) are
    each thread's own: one shared would have the second thread's tokens and state copied over the first's while it
    steps. The moment is forced: the first thread's first step waits until the other thread's call is done."""
    from modeling_gpn import fast_recurrence

    monkeypatch.setenv("GPN_CUDA_GRAPHS", "1")
    model = perturbed_model(tiny_config(), seed=33).eval()
    first, second = (torch.randint(1, 97, (1, 3), generator=torch.Generator().manual_seed(n)) for n in (3, 4))
    inside, done, waited = threading.Event(), threading.Event(), []
    step = fast_recurrence.GRAPH_KERNELS.step

    def waiting_step(*args, **kwargs):
        if threading.current_thread() is waiter and not waited:
            waited.append(True)
            inside.set()
            assert done.wait(timeout=60)
        return step(*args, **kwargs)

    def other():
        assert inside.wait(timeout=60)
        try:
            with torch.no_grad():  # (grad mode is per thread)
                model(second, use_cache=True)
        finally:
            done.set()

    def alone_in_a_thread():
        with torch.no_grad():
            results.append(model(first, use_cache=True))

    # (patched before the graph is made: it keeps the kernels it was made with)
    monkeypatch.setattr(fast_recurrence, "GRAPH_KERNELS", fast_recurrence.GRAPH_KERNELS._replace(step=waiting_step))
    waiter, results = None, []
    alone = model(first, use_cache=True)
    waiter = threading.Thread(target=alone_in_a_thread)
    helper = threading.Thread(target=other)
    waiter.start(), helper.start()
    waiter.join(), helper.join()
    assert waited and done.is_set() and model.model.last_recurrence_path == "fast"
    assert {key[2] for key in model.model._gpn_graphs} == {1}  # (the graph steps ran)
    torch.testing.assert_close(results[0].logits, alone.logits, rtol=0, atol=0)
    for held, expected in zip(results[0].cache.get_state(), alone.cache.get_state(), strict=True):
        torch.testing.assert_close(held, expected, rtol=0, atol=0)


@pytest.mark.parametrize("call", ["prompt", "decoded token"])
def test_a_state_computed_while_another_thread_edits_is_not_saved_as_the_edited_models(model, call, tmp_path):
    """Another thread replaces a weight while a call advances a cache that model has not advanced before (a prompt
    into a new cache; a token decoded in one C call from a state another model computed): the state was computed
    (in part) with the old weight, so `GPNCache.save` refuses it as changed after it was computed, rather than write
    a file naming the edited model. The weights are noted before the call reads them; noted after, the note was the
    edited model's. The edit is forced into the call: a forward pre-hook on the token projection (the prompt), the
    decode plan's note of its modules (the decoded token), lets the editing thread run and waits for it."""
    from modeling_gpn import fast_recurrence

    ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(10))
    model = copy.deepcopy(model)  # (edited: not the module's shared one)
    edits = []

    def edit():
        module = model.model.fuse_gate
        module.weight = torch.nn.Parameter(-module.weight.detach())

    def edit_in_another_thread(*_):
        if not edits:  # (once)
            editor = threading.Thread(target=lambda: edits.append(edit()))
            editor.start()
            editor.join()

    class EditedMeanwhile(fast_recurrence.WatchedModules):
        def __init__(self, *args, **kwargs):
            edit_in_another_thread()
            super().__init__(*args, **kwargs)

    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        if call == "prompt":
            with model.model.fuse_proj.register_forward_pre_hook(edit_in_another_thread):
                cache = model(ids, use_cache=True).cache
        else:
            cache = copy.deepcopy(model)(ids[:, :5], use_cache=True).cache  # (another model's state)
            patch.setattr(fast_recurrence, "WatchedModules", EditedMeanwhile)
            with ran(DECODE_CALLS):
                cache = model(ids[:, 5:6], cache=cache, use_cache=True).cache
    assert edits == [None]
    with pytest.raises(ValueError, match="changed after this state was computed"):
        cache.save(tmp_path / "state.safetensors")


@pytest.mark.parametrize("when", ["during_the_call", "call_during_the_copy"])
def test_a_copy_or_save_overlapping_a_call_that_advances_the_cache_is_refused(model, when, tmp_path):
    """`fork` and `save` from another thread while a call advances the cache (it writes the state, its count and
    fingerprint in several steps, a decoded token in place in C) are refused with one line, rather than copying
    parts of two positions: seen by the claim the call holds (a hook inside the forward copies from another
    thread), or by a claim taken and released while the copy read (a whole call forced into the copy). Copies
    and saves between calls, from any thread, succeed and hold the state (the cache is free again after)."""
    ids = torch.randint(1, 97, (1, 7), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        cache = model(ids[:, :5], use_cache=True).cache
    errors = []

    def copy_and_save():
        for read in (lambda: cache.fork(1), lambda: cache.save(tmp_path / "state.safetensors")):
            try:
                read()
            except RuntimeError as error:
                errors.append(str(error))

    def in_another_thread(function):
        thread = threading.Thread(target=function)
        thread.start()
        thread.join()

    if when == "during_the_call":
        with model.model.fuse_proj.register_forward_pre_hook(lambda *_: in_another_thread(copy_and_save)):
            with torch.no_grad():
                model(ids[:, 5:6], cache=cache, use_cache=True)
    else:
        forked, saved = cache._forked, cache._saved

        def advanced_meanwhile(read):
            def reading(*args):
                with torch.no_grad():
                    in_another_thread(lambda: model(ids[:, 5:6], cache=cache, use_cache=True))
                return read(*args)

            return reading

        cache._forked, cache._saved = advanced_meanwhile(forked), advanced_meanwhile(saved)
        copy_and_save()
        del cache._forked, cache._saved
    assert len(errors) == 2 and all("\n" not in error for error in errors), errors
    assert all("being advanced by another call while it was copied or saved" in error for error in errors)
    copy, expected = cache.fork(1), cache.get_state()  # (between calls: the copy holds the state)
    cache.save(tmp_path / "state.safetensors")
    for held, state in zip(copy.get_state(), expected, strict=True):
        torch.testing.assert_close(held, state, rtol=0, atol=0)


def test_two_threads_taking_a_training_sweeps_buffers_at_once_get_one_owner(triton_on, monkeypatch):
    """GPN_CUDA_GRAPHS=1, training windows on a `TrainingSweep`'s static buffers (through Triton's interpreter on
    CPU): two threads' calls taking the free buffers at once (worker threads calling the model outside their own
    `torch.no_grad()`) get one owner between them; the other runs without the sweep. Forced: the first thread,
    between finding the buffers free and taking them, lets the second try, and goes on once it got an answer, or
    waits on the lock the first holds."""
    import inspect
    import sys

    from modeling_gpn import cuda_graphs

    monkeypatch.setenv("GPN_CUDA_GRAPHS", "1")
    model = perturbed_model(tiny_config(), seed=34)
    model(torch.randint(1, 97, (1, 4), generator=torch.Generator().manual_seed(1))).logits.sum().backward()
    (sweep,) = model.model._gpn_training_sweeps.values()  # (its call done: the buffers are free)
    source, first = inspect.getsourcelines(cuda_graphs.TrainingSweep.take)
    lock_line = next((first + i for i, line in enumerate(source) if "with _take_lock" in line), None)
    owners, second = [], None

    class Racing(cuda_graphs._Owner):
        def __init__(self):
            if second is None or threading.current_thread() is not first_thread:
                return
            second.start()
            while second.is_alive():  # (until the second has its answer, or waits at the lock the first holds)
                frame = sys._current_frames().get(second.ident)
                while frame is not None and frame.f_code is not cuda_graphs.TrainingSweep.take.__code__:
                    frame = frame.f_back
                if frame is not None and frame.f_lineno == lock_line and cuda_graphs._take_lock.locked():
                    break
                time.sleep(0.001)

    monkeypatch.setattr(cuda_graphs, "_Owner", Racing)
    first_thread = threading.Thread(target=lambda: owners.append(sweep.take()))
    second = threading.Thread(target=lambda: owners.append(sweep.take()))
    first_thread.start()
    first_thread.join()
    second.join()
    assert len(owners) == 2 and sum(owner is not None for owner in owners) == 1, owners


def test_two_threads_taking_the_last_pooled_buffer_at_once_each_get_one():
    """The buffer pool of training calls (`fast_recurrence.BufferPool`): two threads' calls taking a buffer of one
    shape while one is free each get a buffer (one the pooled one, the other a new one), rather than the second
    failing on an emptied list. Forced: the first, having seen the free one, lets the second take it first."""
    from modeling_gpn.fast_recurrence import BufferPool

    pool, pooled, taken = BufferPool(), torch.empty(2, 3), []
    pool.give_back(pooled)
    key = pool._key((2, 3), torch.float32, torch.device("cpu"))

    class Racing(list):
        def __bool__(self):
            seen = len(self) > 0
            if threading.current_thread() is first:
                second = threading.Thread(target=lambda: taken.append(pool.take((2, 3), torch.float32, "cpu")))
                second.start()
                second.join()
            return seen

    pool.free[key] = Racing(pool.free[key])
    first = threading.Thread(target=lambda: taken.append(pool.take((2, 3), torch.float32, "cpu")))
    first.start()
    first.join()
    assert len(taken) == 2 and taken[0] is pooled and taken[1] is not pooled and taken[1].shape == (2, 3)
