"""A call interrupted half-way (Ctrl-C, Jupyter's "interrupt kernel": a KeyboardInterrupt between any two bytecodes)
leaves the cache it advances exactly as before the call, exactly advanced, or refused on its next use in one line
(`GPNCache.start_writing`), never holding a position its count or fingerprint does not; and never claimed for good
(`GPNCache.claim`), which would refuse every later call as "another call"; nor a scope of derived weights left open
(`derived_weights_scope`). A prompt read in chunks (`prefill.forward_in_chunks`) is one such call: never left holding
only its earlier chunks. Interrupts are injected deterministically, at every line of the forward, the read in chunks,
the one-call decode and the cache's bookkeeping, by `sys.settrace`."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from modeling_gpn import cache as cache_module
from modeling_gpn import derived_weights, fast_recurrence, prefill
from modeling_gpn import modeling_gpn as model_module

from ..backend_observer import DECODE_CALLS, ran
from ..environment import require_c_kernels
from ..tiny_models import perturbed_model, tiny_config

# Where the interrupt is injected: every line of the functions that claim, write and record a cache's state, in
# these files (the recurrence itself computes from copies of the state and the checks read none: left out, the
# sweep stays at about a hundred points a call)
_FILES = {cache_module.__file__, fast_recurrence.__file__, model_module.__file__, derived_weights.__file__}
_FILES |= {prefill.__file__}
_TRACED = {"forward", "fast_decode_token", "claim", "refuse_if_interrupted", "start_writing", "finish_writing"}
_TRACED |= {"update_state", "record_read", "advanced_in_place", "step_hash", "note_model", "keep_with"}
_TRACED |= {"__enter__", "__exit__", "current", "forward_in_chunks", "lend", "lent"}
# The inline release of a claim (`held.pop(CLAIM_ATTRIBUTE)`, no call before it): settrace reports that line before it
# runs, but a real KeyboardInterrupt lands only at a Python function's entry or after a call returns, never there.
_RELEASE = "held.pop(CLAIM_ATTRIBUTE)"


class _InterruptAt:
    """A trace function raising KeyboardInterrupt at the `at`-th line event in `_FILES`."""

    def __init__(self, at: int):
        self.at, self.count = at, 0

    def __call__(self, frame, event, arg):
        if frame.f_code.co_filename not in _FILES or frame.f_code.co_name not in _TRACED:
            return None
        return self.local

    def local(self, frame, event, arg):
        # (line events only: an exception a trace function raises at a return event is dropped by CPython 3.11,
        # and tracing stops; the next line event of the caller is the same point)
        if event == "line":
            if _RELEASE in _source_line(frame):
                return self.local
            self.count += 1
            if self.count == self.at:
                raise KeyboardInterrupt
        return self.local


_LINES: dict = {}


def _source_line(frame) -> str:
    key = (frame.f_code.co_filename, frame.f_lineno)
    if key not in _LINES:
        import linecache

        _LINES[key] = linecache.getline(*key)
    return _LINES[key]


def _snapshot(cache):
    return [t.clone() for t in cache.state_buffers()], cache.get_seq_length(), cache.read_fingerprint()


def _same(a, b) -> bool:
    return all(map(torch.equal, a[0], b[0])) and a[1] == b[1] and torch.equal(a[2], b[2])


@pytest.fixture(scope="module")
def model():
    require_c_kernels()
    return perturbed_model(tiny_config(num_predict_layers=1), seed=5).eval()


@pytest.fixture
def chunk_length(model, call):
    """The model reading a prompt of more than 2 positions in chunks of 2 for the "chunked prompt" case (the
    bounded-memory prefill, `prefill.py`), and in one pass otherwise."""
    model.prefill_chunk_length = 2 if call == "chunked prompt" else 0
    yield model.prefill_chunk_length
    del model.prefill_chunk_length  # (the class's default again)


@pytest.mark.parametrize("call", ["decoded token", "positions", "chunked prompt"])
def test_a_call_interrupted_anywhere_leaves_the_cache_before_after_or_refused(model, call, chunk_length):
    """At every injection point of a decoded token (the one-call decode, writing the state in place), of a forward
    over 2 positions and of one over 4 read in 2 chunks (never left holding the first chunk only): after the interrupt
    the cache holds exactly the state, count and fingerprint it had before the call (and continues as the
    uninterrupted run does), or exactly those after it, or its next forward, `fork` and `save` are refused in one line
    naming the interruption; never "being advanced by another call"."""
    prompt = torch.tensor([[5, 9, 3], [7, 1, 4]])
    ids = {"decoded token": [[3], [4]], "positions": [[3, 8], [4, 2]], "chunked prompt": [[3, 8, 1, 7], [4, 2, 9, 5]]}
    ids = torch.tensor(ids[call])
    following = torch.tensor([[6], [2]])
    chunks = []  # (the base model's forwards of the uninterrupted call: one a chunk)
    with torch.no_grad():
        start = model(prompt, use_cache=True).cache
        reference = copy.deepcopy(start)
        # (a hook keeps the one-call decode from running: counted only where the call is read in chunks)
        counting = model.model.register_forward_pre_hook(lambda *args: chunks.append(1)) if chunk_length else None
        try:
            model(ids, cache=reference, use_cache=True, logits_to_keep=1)
        finally:
            counting is not None and counting.remove()
        assert len(chunks) == (2 if chunk_length else 0)
        after = _snapshot(reference)
        continued = model(following, cache=copy.deepcopy(reference), use_cache=True).logits
    before, outcomes, at = _snapshot(start), set(), 0
    while True:
        at += 1
        cache = copy.deepcopy(start)
        with torch.no_grad():  # (the model as every run finds it: what the interrupted run left is not seen)
            model(ids, cache=copy.deepcopy(start), use_cache=True, logits_to_keep=1)
        sys.settrace(_InterruptAt(at))
        try:
            with torch.no_grad():
                model(ids, cache=cache, use_cache=True, logits_to_keep=1)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        finally:
            sys.settrace(None)
        if not interrupted:
            break
        with derived_weights.derived_weights_scope(model.model) as derived:  # (none left open: a new one is empty)
            assert derived.key is None and not derived.entries, f"interrupt {at}: a scope of derived weights left open"
        if cache.state_layer.interrupted:
            for use in (
                lambda cache=cache: model(following, cache=cache, use_cache=True),
                lambda cache=cache: cache.fork(1),
                lambda cache=cache: cache.save("never-written.safetensors"),
            ):
                with pytest.raises(RuntimeError, match="interrupted part-way through a call") as refusal:
                    use()
                assert "\n" not in str(refusal.value)
            # what the refusal says to do: the cache reads again, claimed by no one (CPython 3.11 runs no handler
            # for an exception a trace function raises at a `try:` line, so the sweep leaves one claim held there)
            cache.reset()
            with torch.no_grad():
                model(prompt, cache=cache, use_cache=True)
            outcomes.add("refused")
            continue
        now = _snapshot(cache)
        assert _same(now, before) or _same(now, after), f"interrupt {at}: the cache is neither as before nor after"
        outcome = "before" if _same(now, before) else "after"
        outcomes.add(outcome)
        if outcome == "after":
            with torch.no_grad():  # (not claimed for good, and continuing gives the uninterrupted run's logits)
                torch.testing.assert_close(model(following, cache=cache, use_cache=True).logits, continued)
    assert outcomes == {"before", "after", "refused"}, (outcomes, at)  # (every kind of point was reached)
    if call == "decoded token":
        with ran(DECODE_CALLS), torch.no_grad():  # (the sweep above went through the one-call decode)
            model(ids, cache=copy.deepcopy(start), use_cache=True)


class _InterruptOnCall:
    """A generate() streamer (`put`) or logits processor (`__call__`) raising KeyboardInterrupt on its `at`-th call,
    keeping the ids it was given: what a user interrupting generate() has of its sequence."""

    def __init__(self, at: int):
        self.at, self.calls, self.ids = at, 0, []

    def put(self, ids):  # (a streamer: the prompt first, then each token chosen, before the forward reading it)
        self.calls += 1
        self.ids.append(ids.reshape(1, -1).clone())
        if self.calls == self.at:
            raise KeyboardInterrupt

    def end(self):
        pass

    def __call__(self, ids, scores):  # (a logits processor: after the forward reading the last token chosen)
        self.calls += 1
        self.ids = [ids.clone()]
        if self.calls == self.at:
            raise KeyboardInterrupt
        return scores


@pytest.mark.parametrize("where", ["before its forward", "after its forward"])
def test_a_generate_interrupted_between_decoded_tokens_continues_from_its_cache(model, where):
    """docs/cache.md: a greedy `generate()` interrupted between two decoded tokens leaves its cache consistent, having
    read the prompt and the tokens decoded before the interrupt. Interrupted after choosing its 2nd token, before the
    forward reading it (a streamer's `put`), the whole sequence given again with that cache continues exactly as the
    uninterrupted run (the fingerprint skips what was read); interrupted after that forward (a logits processor, before
    the 3rd token is chosen), the cache has read the whole sequence and the next token's logits are lost: continuing
    with it is refused in one line ("nothing new"), as the docs say."""
    from transformers import LogitsProcessorList

    prompt = torch.tensor([[5, 9, 3, 7]])
    with torch.no_grad():
        uninterrupted = model.generate(prompt, max_new_tokens=5, do_sample=False)
        cache = model(prompt[:, :2], use_cache=True).cache  # (a cache passed in, as docs/cache.md shows)
    stop = _InterruptOnCall(3)  # (streamer: the prompt, token 1, token 2; processor: after prompt, token 1, token 2)
    hook = dict(streamer=stop) if where == "before its forward" else dict(logits_processor=LogitsProcessorList([stop]))
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model.generate(prompt, cache=cache, max_new_tokens=5, do_sample=False, **hook)
    have = torch.cat(stop.ids, dim=1)
    assert torch.equal(have, uninterrupted[:, :6]) and not cache.state_layer.interrupted
    if where == "before its forward":
        assert cache.get_seq_length() == 5
        with torch.no_grad():
            continued = model.generate(have, cache=cache, max_new_tokens=3, do_sample=False)
        assert torch.equal(continued, uninterrupted)
    else:
        assert cache.get_seq_length() == 6
        with pytest.raises(ValueError, match="already read and nothing new") as refusal, torch.no_grad():
            model.generate(have, cache=cache, max_new_tokens=3, do_sample=False)
        assert "\n" not in str(refusal.value)
