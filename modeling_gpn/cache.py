"""The recurrent cache of a GPN: (p, g, M) for every row, its size independent of the sequence length.

`GPNCache` is a transformers `Cache` with one `GPNStateLayer` (three recurrent states in fixed buffers).
Beam search reorders it through the stock `reorder_cache`; it cannot be cropped (assisted decoding is
refused). Because a GPN's whole context is this state, it can be forked into many rows, saved to a file
and loaded in another process (`fork`, `save`, `load`; the file format is `state_file.py`). It is a
registered pytree, so torch.export and torch.compile can take and return one.

It also keeps a fingerprint of the positions it has read (`ReadFingerprint`: one (batch, 2) int64 tensor
updated in place, and one more of the head its first call read, set once, so the cache is exactly constant in size
from its first call), by which
`continuation_start` tells generate()'s two ways of continuing from a cache apart (the whole sequence so
far, or only the new positions). docs/cache.md is the user's page.
"""

from __future__ import annotations

import copy
import json
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.utils._pytree as pytree
from torch import nn
from transformers.cache_utils import Cache, LinearAttentionLayer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from .configuration_gpn import GPNConfig
from .state_file import (
    STATE_TENSOR_NAMES,
    GPNStateFileError,
    gpn_base_model,
    mixed_batch_adapters,
    read_state_file,
    state_fingerprint,
    tokenizer_fingerprint,
    weights_snapshot,
    write_state_file,
)
from .tracing import is_exporting, is_tracing

# ---- what a cache has read: a fingerprint, to tell generate()'s two ways of continuing apart ------------

_FINGERPRINT_MODULUS = 2**31 - 1  # a prime; products of two residues fit in int64
_FINGERPRINT_BASES = (1_000_003, 998_244_353 % (2**31 - 1))  # two independent polynomial hashes: ~62 bits
_PADDING_VALUE = 1  # a padded position's value in the hash (a token id t counts as t + 2)


def token_fingerprint(
    token_ids: torch.Tensor, mask: torch.Tensor | None, start: torch.Tensor | None = None
) -> torch.Tensor:
    """(batch, 2) int64: two polynomial hashes of each row's positions (a padded position counts as padding,
    whatever its id), continuing `start` (the fingerprint of the positions before these) when given.

    The same positions give the same fingerprint however they were split into calls.
    """
    modulus = _FINGERPRINT_MODULUS
    values = token_ids.long() + 2
    if mask is not None:
        values = torch.where(mask.bool(), values, torch.full_like(values, _PADDING_VALUE))
    length = values.shape[1]
    # powers[i] = base^(length-1-i) mod p, built by doubling (log2(length) steps)
    powers = torch.ones(1, 2, dtype=torch.int64, device=values.device)
    while powers.shape[0] < length:
        step = torch.tensor([pow(b, powers.shape[0], modulus) for b in _FINGERPRINT_BASES], device=values.device)
        powers = torch.cat([powers * step % modulus, powers])
    powers = powers[-length:]
    folded = (values[:, :, None] * powers % modulus).sum(dim=1) % modulus
    if start is not None:
        shift = torch.tensor([pow(b, length, modulus) for b in _FINGERPRINT_BASES], device=values.device)
        folded = (folded + start.to(values.device) * shift % modulus) % modulus
    return folded


# A decode step is the hot path: h' = (h * base + id + 2) mod p would be three tensor ops. The fingerprint is
# kept shifted, s = h + c (mod p) with c = 2 / (base - 1) mod p; then the step is s' = (s * base + id) mod p
# (since c * base = c + 2): two ops, one allocation.
_STEP_SHIFTS = tuple(2 * pow(b - 1, -1, _FINGERPRINT_MODULUS) % _FINGERPRINT_MODULUS for b in _FINGERPRINT_BASES)
_CONSTANTS_BY_DEVICE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _constants_on(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The bases and the shifts, (2,) int64 each, on `device` (made once per device; held by no cache)."""
    constants = _CONSTANTS_BY_DEVICE.get(device)
    if constants is None:
        constants = _CONSTANTS_BY_DEVICE[device] = tuple(
            torch.tensor(values, dtype=torch.int64, device=device) for values in (_FINGERPRINT_BASES, _STEP_SHIFTS)
        )
    return constants


class ReadFingerprint:
    """The fingerprint of every position a cache has read (`token_fingerprint`), or "unknown".

    One (batch, 2) int64 tensor from the first position on, updated in place by each call: a call of one
    position (a decode step) multiplies by the bases and adds the new position (two elementwise ops on 2
    numbers a row), a longer call folds its positions in (`token_fingerprint` continuing it). Beside it only the
    head of the first call (`head`, set by that call) is kept, so its size never changes after the first call and
    what it costs a call does not depend on how much was read. It is
    held shifted (see `_STEP_SHIFTS`); `value()` gives the fingerprint itself. It becomes unknown when the
    cache reads positions given as `inputs_embeds`, or is rebuilt without its history (pytree unflattening:
    a traced or exported program's cache); the tensor is kept then (the cache's size stays the same), and
    never read again.
    """

    # The fingerprint of the first `head_length` positions read: the first half of what the first call read, where it
    # read at least `HEAD_MIN_POSITIONS` (else none, length 0). Set once, by that call; it lets `continuation_start`
    # tell a whole sequence that begins as the cache's history and then departs from it (a text tokenized again
    # otherwise, a chat template rendering earlier turns anew) from new positions, which begin otherwise. (Class
    # defaults: a fingerprint pickled before they existed, or loaded from a state file saved before, has none.)
    head: torch.Tensor | None = None  # (batch, 2) int64, unshifted
    head_length = 0
    HEAD_MIN_POSITIONS = 4

    def __init__(
        self,
        known: bool = True,
        fingerprint: torch.Tensor | None = None,
        head: torch.Tensor | None = None,
        head_length: int = 0,
    ):
        self.known = known
        self.shifted = None if fingerprint is None else self._shift(fingerprint)  # (batch, 2) int64
        if head is not None and head_length:
            self.head, self.head_length = head, head_length

    @staticmethod
    def _shift(fingerprint: torch.Tensor) -> torch.Tensor:
        return (fingerprint + _constants_on(fingerprint.device)[1]) % _FINGERPRINT_MODULUS

    def record(self, token_ids: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        """Fold the positions just read (`token_ids` None: embeddings, which make it unknown)."""
        if token_ids is None or not self.known:
            self.known = False
            return
        shifted = self.shifted
        if shifted is not None and token_ids.shape[1] == 1 and shifted.device == token_ids.device:
            ids = token_ids.long()  # a decode step, in place: s = (s * base + id) mod p
            if mask is not None:  # a padded position counts as padding (value 1, "id" -1)
                ids = ids.masked_fill(~mask.bool(), _PADDING_VALUE - 2)
            bases = _constants_on(shifted.device)[0]
            torch.remainder(torch.addcmul(ids, shifted, bases), _FINGERPRINT_MODULUS, out=shifted)
            return
        folded = self._shift(token_fingerprint(token_ids, mask, self.value()))
        if shifted is None and token_ids.shape[1] >= self.HEAD_MIN_POSITIONS:  # the first call: keep its head
            length = token_ids.shape[1] // 2
            self.head = token_fingerprint(token_ids[:, :length], None if mask is None else mask[:, :length])
            self.head_length = length
        if shifted is None or shifted.device != folded.device:  # the first position (or the inputs moved)
            self.shifted = folded
        else:
            shifted.copy_(folded)

    def step_hash(self, rows: int) -> tuple[torch.Tensor, tuple[int, int], int] | None:
        """What a decode step of `rows` rows, every one real, may advance itself as `record` would: the held
        (rows, 2) int64 residues, each column s = (s * base + id) mod modulus, with the two bases and the modulus
        (a kernel that reads the ids anyway does it in place of two torch calls); None where only `record` may
        (unknown, nothing read yet, another number of rows, not a contiguous CPU tensor)."""
        shifted = self.shifted
        if not self.known or shifted is None or shifted.shape != (rows, 2) or not shifted.is_cpu:
            return None
        if shifted.dtype is not torch.int64 or not shifted.is_contiguous():
            return None
        return shifted, _FINGERPRINT_BASES, _FINGERPRINT_MODULUS

    def forget(self) -> None:
        """Mark the fingerprint unknown (after an operation on the state it cannot follow)."""
        self.known = False

    def value(self) -> torch.Tensor | None:
        """(batch, 2) fingerprint of everything read (a new tensor), or None when unknown or nothing was read."""
        if not self.known or self.shifted is None:
            return None
        return (self.shifted - _constants_on(self.shifted.device)[1]) % _FINGERPRINT_MODULUS

    def select_rows(self, select: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a row operation (beam search's reordering, repeat_interleave) to the fingerprint."""
        if self.shifted is not None:
            self.shifted = select(self.shifted)
        if self.head is not None:
            self.head = select(self.head)

    def head_matches(self, token_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
        """(batch,) bool: which rows of `token_ids` begin with the head of what was read (`head`), or None where
        there is no head (unknown, none kept, or fewer positions given than it covers)."""
        length = self.head_length
        if not self.known or self.head is None or token_ids.shape[1] < length:
            return None
        given = token_fingerprint(token_ids[:, :length], None if mask is None else mask[:, :length])
        return (given == self.head.to(given.device)).all(dim=1)


# ---- end of the fingerprint ----------------------------------------------------------------------


class GPNStateLayer(LinearAttentionLayer):
    """The single cache layer of a GPN: three recurrent states in fixed buffers updated in place.

    state 0: the predicted state p (batch, d); state 1: the grounded state g (batch, d);
    state 2: the memory M (batch, H, dk, dv), a (batch, 0) placeholder without memory.
    """

    PREDICTED, GROUNDED, MEMORY = 0, 1, 2
    # The adapters of the PEFT mixed-batch calls that advanced this state (`GPNCache.note_model`): its rows were
    # computed under several adapters, so no one model's state file can name it. (A class default: a layer
    # pickled before it existed reads none.)
    mixed_adapters: frozenset = frozenset()
    # Set while a call writes this state and its bookkeeping (`GPNCache.start_writing`), cleared once all of it is
    # done: still set afterwards, the call was interrupted part-way (a KeyboardInterrupt, Ctrl-C in a notebook, lands
    # between any two bytecodes), and the state may hold positions its count and fingerprint do not. (A class default:
    # a layer pickled before it existed reads False.)
    interrupted: bool = False
    # Where the state carries the autograd graph of the calls that computed it (`store`): the node that a backward
    # through the last of them frees (`_CarriedIn`), and the weights that call read with their versions. (A class
    # default: a layer pickled before it existed carries no graph.)
    graph_probe: tuple | None = None

    def __init__(self, **kwargs):
        super().__init__(number_of_states=3)
        self.seen_tokens = 0
        self.fingerprint = ReadFingerprint()  # of the positions read (see GPNForCausalLM._prefill)

    def store(
        self,
        predicted: torch.Tensor,
        grounded: torch.Tensor,
        memory: torch.Tensor,
        graph_probe: tuple | None = None,
    ) -> None:
        """The state after a call: written into the held buffers in place, except in an exported program and where
        it carries an autograd graph.

        `graph_probe`: the call ran with gradients (`state_entering_call`), and the state is kept with the graph that
        computed it, so that a later call's loss reaches this call's weights (backpropagation through time across
        calls); the probe says later whether a backward has freed that graph or an optimizer step changed the
        weights it holds (`GPNCache.refuse_a_spent_graph`). `GPNCache.detach()` drops it (truncated BPTT).

        An exported program runs a write into its input cache's buffers as an in-place write when it is called,
        but not what else the call changes (the count of positions read, the fingerprint), which it returns in a
        new cache: the given cache's state would hold a position its count and fingerprint do not, and share its
        buffers with the returned cache, so continuing either advanced both. Exported, the state is stored out
        of place instead: the program returns the advanced cache and leaves the one it was given as it was (a
        cache of inference tensors included, which torch lets nothing write outside inference mode)."""
        self._leave_inference_mode()
        out_of_place = is_exporting()
        carries_graph = graph_probe is not None
        for index, tensor in ((self.PREDICTED, predicted), (self.GROUNDED, grounded), (self.MEMORY, memory)):
            stored = self.recurrent_states[index]
            if stored is not None and stored.shape != tensor.shape:
                raise ValueError(
                    f"GPNCache holds a state of shape {tuple(stored.shape)} but the model produced "
                    f"{tuple(tensor.shape)}: the batch size changed between calls that share a cache"
                )
            if carries_graph:
                # the autograd graph of the calls that computed it stays attached (full BPTT across calls): a tensor
                # of its own (a copy: the result may be a view of the call's outputs), never written in place
                self.recurrent_states[index] = tensor.clone()
                self.is_recurrent_states_initialized[index] = True
            elif (out_of_place and self.is_recurrent_states_initialized[index]) or (
                stored is not None and stored.requires_grad
            ):
                # (a held state carrying a graph is replaced, not overwritten: a write in place would change the
                # values the graph links the next call to)
                self.recurrent_states[index] = tensor.detach().clone() if stored.requires_grad else tensor.detach()
            else:
                self.update_recurrent_state(tensor.detach(), state_idx=index)
            # The stock layer only marks a state as present on conv updates; GPN has no conv.
            self.has_previous_state[index] = True
            if self.device is None:
                self.device, self.dtype = tensor.device, tensor.dtype
        self.graph_probe = graph_probe

    def _leave_inference_mode(self) -> None:
        """A cache filled under `torch.inference_mode()` holds inference tensors, which torch lets nothing write in
        place outside it: continued outside it, its buffers are copied once into ordinary tensors (the same
        values), before anything is written (the one-call decode writes them from C, which torch does not see)."""
        # (traced, nothing is copied ahead of the graph: an exported program writes none of the given buffers, `store`;
        # a compiled forward given such a cache runs only in inference mode, docs/transformers.md)
        if is_tracing() or torch.is_inference_mode_enabled():
            return
        for index in range(self.number_of_states):
            tensor = self.recurrent_states[index]
            if isinstance(tensor, torch.Tensor) and tensor.is_inference():
                self.recurrent_states[index] = tensor.clone()
        shifted = self.fingerprint.shifted
        if shifted is not None and shifted.is_inference():
            self.fingerprint.shifted = shifted.clone()

    def reset(self) -> None:
        """Empty the state (the next forward starts from the zero state)."""
        self.detach()  # (zeroed in place below: never a tensor of a graph)
        super().reset()
        self.seen_tokens = 0
        self.fingerprint = ReadFingerprint()
        self.mixed_adapters = frozenset()
        self.interrupted = False
        self.graph_probe = None

    def detach(self) -> None:
        """Keep the state's values, without the autograd graph that computed them (`GPNCache.detach`)."""
        for index in range(self.number_of_states):
            tensor = self.recurrent_states[index]
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                self.recurrent_states[index] = tensor.detach()
        self.graph_probe = None

    def get_seq_length(self) -> int:
        """The number of tokens the state has read."""
        seen = self.seen_tokens  # a 0-dim tensor in a traced program and in a cache one returned (the pytree functions)
        return int(seen) if isinstance(seen, torch.Tensor) and not is_tracing() else seen

    @property
    def is_croppable(self) -> bool:
        """False: a recurrent state cannot be cut back to fewer tokens."""
        return False  # a recurrent state cannot be rolled back

    @property
    def batch_size(self) -> int:
        """The number of batch rows of the state (-1 while empty)."""
        state = self.recurrent_states[self.PREDICTED]
        return -1 if state is None else state.shape[0]

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row of the state `repeats` times (beam search, num_return_sequences)."""
        for index in range(self.number_of_states):
            if self.is_recurrent_states_initialized[index]:
                self.recurrent_states[index] = self.recurrent_states[index].repeat_interleave(repeats, dim=0)
        self.fingerprint.select_rows(lambda rows: rows.repeat_interleave(repeats, dim=0))
        self._keep_probe_with_graph()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search's reordering: the states (the stock layer's) and, with them, what each row has read."""
        super().reorder_cache(beam_idx)
        self.fingerprint.select_rows(lambda rows: rows.index_select(0, beam_idx.to(rows.device)))
        self._keep_probe_with_graph()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows of the state at `indices` (beam search's reordering)."""
        # (indexing with a 0-dim tensor drops the batch dimension: a (d,) state that generate() cannot continue and
        # that `save` wrote to a file `load` refuses)
        indices = torch.as_tensor(indices).reshape(-1)  # (a 0-dim index: one row, kept as a batch of one)
        for index in range(self.number_of_states):
            if self.is_recurrent_states_initialized[index]:
                self.recurrent_states[index] = self.recurrent_states[index][indices, ...]
        self.fingerprint.select_rows(lambda rows: rows[indices.to(rows.device)])
        self._keep_probe_with_graph()

    def _keep_probe_with_graph(self) -> None:
        """After a row operation: rows selected without gradients (generate()'s, under no_grad) no longer carry the
        graph, nor its probe."""
        state = self.recurrent_states[self.PREDICTED]
        if not (isinstance(state, torch.Tensor) and state.requires_grad):
            self.graph_probe = None


CLAIM_ATTRIBUTE = "_gpn_in_use"  # the attribute a forward sets while it advances a cache (`GPNCache.claim`)
# how many calls have claimed the cache so far: a copy or a save that saw no claim before it read and none after (and
# this count unchanged) read no state being written (`GPNCache.read_whole`)
CLAIMS_ATTRIBUTE = "_gpn_claims"
T = TypeVar("T")


class ChunkedRead:
    """The claim a forward read in chunks (`prefill.forward_in_chunks`) holds on a cache across all its chunks, lent
    to each chunk's forward in turn (`GPNCache.claim`): the chunks are one write, which a lent forward starts
    (`start_writing`) and does not finish, so a read interrupted between two chunks leaves the cache refused, not
    holding only the chunks before the interrupt while the caller asked for all of them."""

    def lend(self) -> None:
        """Lend the cache to the next forward that borrows it (`GPNCache.claim`): the reader, before each chunk."""
        self.lendable = True

    def lent(self) -> bool:
        """Whether the cache was lent to the calling forward, which takes the lending: one forward a lending, so a
        call made inside it (a hook calling the model on the same cache) is refused as another call. (Atomic, as
        the claim's `setdefault` is: of two calls racing for one lending, exactly one gets it.)"""
        return self.__dict__.pop("lendable", False)


class GPNCache(Cache):
    """transformers `Cache` holding a GPN's recurrent state (p, g, M) for every row.

    Its size depends on the batch and the model, never on the number of tokens seen. Beam search
    reorders it through the stock `reorder_cache`; it cannot be cropped (assisted decoding is refused).
    """

    def __init__(self, config: GPNConfig | None = None, **kwargs):
        super().__init__(layers=[GPNStateLayer()])

    def __repr__(self) -> str:
        """One line, as a notebook shows the cache: its rows, the positions read, the state's size and where it
        lives, and whether it carries an autograd graph or was interrupted; never the state's values (transformers'
        own line named only the layer class)."""
        if not self.has_state:
            return "GPNCache(empty: the next forward starts from the zero state)"
        layer = self.state_layer
        predicted = layer.recurrent_states[layer.PREDICTED]
        notes = ", carries an autograd graph (detach() ends it)" if self.carries_graph else ""
        if layer.interrupted:
            notes += ", interrupted part-way through a call: refused until reset()"
        return (
            f"GPNCache(rows={predicted.shape[0]}, positions read={self.get_seq_length()}, "
            f"state {self.nbytes() / 2**20:.2f} MiB {str(predicted.dtype).removeprefix('torch.')} on "
            f"{predicted.device}{notes})"
        )

    def __getstate__(self) -> dict:
        """For pickle (multiprocessing, `torch.save`): the state and what it read, without the weak link to the
        model that filled it (`_gpn_model_ref`, set by the forward), which does not pickle; the copy continues as
        the original does, and its `save` says it does not know its model. (`save` and `load` are the checked way
        to keep a state.) A copy made while a call advances this cache is not in use itself."""
        state = self.__dict__.copy()
        state.pop("_gpn_model_ref", None)
        state.pop("_gpn_weights_snapshot", None)
        state.pop(CLAIM_ATTRIBUTE, None)
        if self.carries_graph:  # (an autograd graph does not pickle: the copy holds the values, `detach`ed)
            layer = copy.copy(self.state_layer)
            layer.recurrent_states = dict(layer.recurrent_states)
            layer.detach()
            state["layers"] = [layer]
        return state

    def claim(self, token: object, borrow: bool = False) -> bool:
        """Mark this cache as being advanced by the calling forward (`token`, an object of the caller's) until the
        caller releases it; raise if another call holds it, or if an earlier call was interrupted part-way.
        `borrow`: the caller (the base model's forward, which a read in chunks calls once a chunk) may run under a
        `ChunkedRead` that lent it the cache; it is then told True, and leaves the write it starts unfinished (no
        `finish_writing`): the reader finishes it after its last chunk. (The one-call decode never borrows.)

        A forward reads the state, computes, and writes the state back (the one-call decode writes its buffers in
        place): two calls on one cache at once (two threads, or a hook calling the model inside a forward) would
        each continue from the same state, or from one the other is half-way through writing, and both return
        wrong results in silence. `dict.setdefault` is atomic, so of two calls racing here exactly one wins.
        Nothing is claimed while tracing: a compiled or exported program's cache is its own input.

        The caller calls this inside its `try` and releases in its `finally`, inline, only a claim that is its own
        `token` (`CLAIM_ATTRIBUTE in held and held[CLAIM_ATTRIBUTE] is token and held.pop(CLAIM_ATTRIBUTE)`, `held`
        the cache's `__dict__`): a KeyboardInterrupt lands between bytecodes (at a Python function's entry, after a
        call returns), so a claim taken before the `try`, or released by a method, could be left held for good, and
        every later call refused as "another call"."""
        if borrow and type(held := self.__dict__.get(CLAIM_ATTRIBUTE)) is ChunkedRead and held.lent():
            # (one of the reader's chunks; their write is marked from the first chunk on, and stays marked until the
            # reader has read the last: the reader checked the mark when it claimed)
            return True
        self.refuse_if_interrupted()
        if is_tracing():
            return False
        held = self.__dict__
        if held.setdefault(CLAIM_ATTRIBUTE, token) is token:
            held[CLAIMS_ATTRIBUTE] = held.get(CLAIMS_ATTRIBUTE, 0) + 1  # (by the winner alone: no race)
            return False
        raise RuntimeError(
            "this GPNCache is being advanced by another call right now (another thread, or a call made inside "
            "the forward): a cache can be used by one call at a time; give each thread its own cache "
            "(cache.fork(1) copies one)"
        )

    def read_whole(self, read: Callable[[], T]) -> T:
        """`read()` (a copy of the state and its bookkeeping: `fork`, `save`), refused where a call advancing the
        cache ran meanwhile. A forward or decoded token writes the state, its count and fingerprint in several steps
        (in place, in C, without the GIL), so a copy overlapping it, from another thread, would hold parts of two
        positions in silence. Readers claim nothing (copies and saves from several threads at once go on): a read
        that saw no claim before it began and none after, with no claim taken between (`CLAIMS_ATTRIBUTE`), read
        a state no call was writing."""
        self.refuse_if_interrupted()  # (first, as `claim` does: an interrupted call may have left its claim held)
        held = self.__dict__
        claims = held.get(CLAIMS_ATTRIBUTE, 0)
        if held.get(CLAIM_ATTRIBUTE) is None:
            result = read()
            if held.get(CLAIM_ATTRIBUTE) is None and held.get(CLAIMS_ATTRIBUTE, 0) == claims:
                return result
        raise RuntimeError(
            "this GPNCache was being advanced by another call while it was copied or saved (another thread, or a "
            "call made inside the forward): copy or save it between the calls that advance it"
        )

    def refuse_if_interrupted(self) -> None:
        """Raise, in one line saying what to do, if a call was interrupted while it wrote this state
        (`start_writing`)."""
        if self.state_layer.interrupted:
            raise RuntimeError(
                "this GPNCache was interrupted part-way through a call (Ctrl-C or another error while the call wrote "
                "its state), so its state may hold positions its count and fingerprint do not: continue from a copy "
                "taken before that call (fork, save), or empty it (cache.reset()) and read the text again"
            )

    def reset(self) -> None:
        """Empty the state (the next forward starts from the zero state), and drop a claim an interrupted call left
        held: `reset()` is what the interrupted cache's refusal says to do, and a claim left behind (an interrupt
        landing between a claim and the `try` that releases it) would refuse every later call as "another call".
        (Resetting a cache another call is advancing right now is that call's undoing in any case.)"""
        super().reset()
        self.__dict__.pop(CLAIM_ATTRIBUTE, None)

    def start_writing(self) -> None:
        """Mark the state as being written, until `finish_writing`: a call interrupted in between leaves it marked,
        and it is refused from then on (`refuse_if_interrupted`) rather than continued half-written. An attribute
        store each: nothing a token would notice."""
        self.state_layer.interrupted = True

    def finish_writing(self) -> None:
        """The state and its bookkeeping (count, fingerprint, model) are written whole: see `start_writing`."""
        self.state_layer.interrupted = False

    def __deepcopy__(self, memo: dict) -> GPNCache:
        """A copy of the state that still knows the model that filled it (as `fork` does)."""
        copied = self.__class__.__new__(self.__class__)
        memo[id(self)] = copied
        copied.__dict__.update(copy.deepcopy(self.__getstate__(), memo))
        for name in ("_gpn_model_ref", "_gpn_weights_snapshot"):
            if name in self.__dict__:
                setattr(copied, name, self.__dict__[name])
        layer = self.state_layer
        if layer.graph_probe is not None and torch.is_grad_enabled():  # (as `fork`: linked to the original's graph)
            for index in range(layer.number_of_states):
                copied.state_layer.recurrent_states[index] = layer.recurrent_states[index].clone()
            copied.state_layer.graph_probe = layer.graph_probe
        return copied

    def note_model(self, model: nn.Module, look_for_mixed_adapters: bool = True, snapshot: tuple | None = None) -> None:
        """Remember `model` (a `GPNModel`) as the one that advanced this state, for `save`. A model new to this
        cache also leaves a snapshot of its weights (`state_file.weights_snapshot`), by which `save` tells that
        they changed after the state was computed (the forward calls this after every step: a glance at one
        attribute while the model stays the same). A compiled or exported forward reads no storage: it leaves no
        snapshot, and the save of a state it advanced is not checked.

        `snapshot`: the one `snapshot_before_call` took before the call that advanced the state read the weights (None:
        one is taken now, for a state no call computed here: one loaded from a file).

        `look_for_mixed_adapters`: whether the call that advanced the state may have been PEFT's mixed-batch
        inference (`state_file.mixed_batch_adapters`); if it was, the cache keeps its adapters for good (its rows
        were computed under several), and `save` refuses it. False only where no such call can reach (a
        state just loaded, the one-call decode of a model of plain modules)."""
        if is_tracing():
            self._gpn_model_ref, self._gpn_weights_snapshot = weakref.ref(model), None
            return
        if look_for_mixed_adapters:
            names = mixed_batch_adapters(model)
            if names is not None:
                layer = self.state_layer
                layer.mixed_adapters = layer.mixed_adapters | {str(name) for name in names}
        ref = self.__dict__.get("_gpn_model_ref")
        if ref is None or ref() is not model:
            self._gpn_model_ref = weakref.ref(model)
            self._gpn_weights_snapshot = snapshot if snapshot is not None else weights_snapshot(model)

    @property
    def state_layer(self) -> GPNStateLayer:
        """The cache's single state layer."""
        return self.layers[0]

    @property
    def has_state(self) -> bool:
        """Whether every part of the state has been filled by a forward."""
        return all(self.state_layer.has_previous_state.values())

    def get_state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(p, g, M) as copies (the model never mutates the cache's buffers), or None if empty."""
        if not self.has_state:
            return None
        layer = self.state_layer
        return tuple(layer.recurrent_states[i].clone() for i in range(3))

    def state_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(p, g, M) as the cache holds them, not copies: to read, never to write (`get_state` copies). A decode
        step that reads them and stores its result with `update_state` saves their copies."""
        if not self.has_state:
            raise ValueError("the cache holds no state yet")
        return tuple(self.state_layer.recurrent_states[i] for i in range(3))

    def update_state(
        self,
        predicted: torch.Tensor,
        grounded: torch.Tensor,
        memory: torch.Tensor,
        num_new_tokens: int,
        graph_probe: tuple | None = None,
    ) -> None:
        """Store the state after `num_new_tokens` more tokens (in place, so addresses stay static; with its
        autograd graph, out of place, where `graph_probe` is given: `GPNStateLayer.store`)."""
        self.state_layer.store(predicted, grounded, memory, graph_probe=graph_probe)
        seen = self.state_layer.seen_tokens
        if is_tracing() and not isinstance(seen, torch.Tensor):
            # a tensor while tracing, so the count of a dynamic-length program is computed, not frozen (see pytree);
            # it carries what the cache read before (an eagerly filled cache entering a compiled decode step)
            seen = torch.tensor(seen, dtype=torch.int64)
        self.state_layer.seen_tokens = seen + num_new_tokens

    def detach(self) -> GPNCache:
        """Drop the autograd graph the state carries, keeping its values; returns the cache itself (changed in place).

        A forward with gradients that continues or fills a cache keeps its state attached to the graph that computed
        it, so that a loss of a later call reaches the weights through every call before (backpropagation through
        time across calls, as one forward over the whole sequence). Truncated BPTT detaches it after each backward
        (and optimizer step): the next call then starts from these values as a constant. A no-grad call, `reset()`
        and `save` never keep a graph. Without one, this changes nothing."""
        self.state_layer.detach()
        return self

    @property
    def carries_graph(self) -> bool:
        """Whether the state is attached to the autograd graph of the calls that computed it (`detach`)."""
        return self.state_layer.graph_probe is not None

    def refuse_a_spent_graph(self) -> None:
        """Raise, naming `detach()`, where the state carries a graph that a call with gradients cannot continue: a
        backward has run through any of the calls that computed it (freeing their part, without
        `retain_graph=True`; the first call's part included, as a backward of an earlier chunk's loss alone frees)
        or an optimizer step changed the weights it holds since. torch itself would fail later, in the backward, deep
        in the graph ("backward through the graph a second time", "modified by an inplace operation"), without
        naming the cache. A state a compiled call returned is asked through its program's node (`TRACED_PROBE`)."""
        probe = self.state_layer.graph_probe
        if probe is None:
            return
        last, weights, _ = probe
        first = self.first_call_node()
        if last is None:  # (a compiled call's probe holds no node: its program's node stands for both)
            last = first
        spent = None
        for node in (first, last):  # (a backward through any of the calls runs through the first one's node)
            try:
                _ = node is not None and node.saved_tensors  # (freed by the first backward through it not retaining it)
            except RuntimeError as error:
                # (a compiled program saves the weights themselves: torch checks their versions as it hands them out)
                spent = _STEPPED if "modified by an inplace operation" in str(error) else _FREED
                break
        if spent is None:
            spent = next((_STEPPED for weight, version in weights if weight._version != version), None)
        if spent is not None:
            raise RuntimeError(
                "this GPNCache's state carries the autograd graph of the calls that computed it, and " + spent + ": "
                "a call with gradients cannot continue it. For truncated backpropagation through time, call "
                "cache.detach() after each backward (the state then enters the next call as a constant); for full "
                "backpropagation across calls, run backward once, after the last call, or keep the graph with "
                'backward(retain_graph=True) (docs/cache.md, "Training with a carried state")'
            )

    def first_call_node(self) -> torch.autograd.graph.Node | None:
        """The probed node of the first call whose graph the state carries (`refuse_a_spent_graph`), which a backward
        through any of the calls runs through; None where the state carries no graph or none is found."""
        probe = self.state_layer.graph_probe
        if probe is None:
            return None
        if probe[0] is None:  # (a compiled call's: its program's node, read off the state it returned)
            return traced_call_node(self.state_layer.recurrent_states[GPNStateLayer.PREDICTED])
        return probe[2]

    def advanced_in_place(self, token_ids: torch.Tensor, hashed: bool = False) -> None:
        """Count the positions `token_ids` (batch, seq), every one real, that a call read and wrote straight into
        `state_buffers()` (the one-call decode, never traced), and fold them into the fingerprint: what
        `update_state` and `record_read` do after a call that returns its state, without the copies.
        `hashed`: the call folded them in itself (`step_hash`)."""
        layer = self.state_layer
        # (not +=: the count of a cache an exported or compiled forward returned is a tensor, of inference mode when
        # that ran under torch.inference_mode(), which torch lets nothing write in place outside it)
        layer.seen_tokens = layer.seen_tokens + token_ids.shape[1]
        if not hashed:
            layer.fingerprint.record(token_ids, None)

    def step_hash(self, rows: int) -> tuple[torch.Tensor, tuple[int, int], int] | None:
        """The fingerprint's residues a decode step of `rows` rows may advance itself (`ReadFingerprint.step_hash`)."""
        return self.state_layer.fingerprint.step_hash(rows)

    def record_read(self, token_ids: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        """Fold the positions just read into the cache's fingerprint, in place (`token_ids` None: positions
        given as embeddings, which make it unknown). `mask` (batch, seq) bool, or None when every position is
        real. A decode step costs a few elementwise ops on 2 numbers a row, whatever was read before."""
        if is_tracing():
            self.state_layer.fingerprint.forget()
        else:
            self.state_layer.fingerprint.record(token_ids, mask)

    def read_fingerprint(self) -> torch.Tensor | None:
        """(batch, 2) int64 fingerprint of the positions read (`token_fingerprint` of them, however they were
        split into calls), a copy; None when unknown (it read embeddings, or a traced program rebuilt it)."""
        return self.state_layer.fingerprint.value()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of token positions this cache has consumed (padding included)."""
        return self.state_layer.get_seq_length()

    def nbytes(self) -> int:
        """Bytes held by the state buffers (p, g, M). The fingerprint of what it read adds 16 bytes a row; the
        cache holds nothing else, so its size is the same from its first position on."""
        layer = self.state_layer
        return sum(
            layer.recurrent_states[i].numel() * layer.recurrent_states[i].element_size()
            for i in range(3)
            if layer.recurrent_states[i] is not None
        )

    # ---- a state kept: fork, save, load ---------------------------------------------------------------
    # The whole context of a GPN is this state, so it can be copied into N rows (N continuations of one
    # prompt), written to a file and read back in another process. `GPNModel.forward` stamps the cache
    # with the model that fills it (a weak reference), so `save` can record which model the state belongs to.

    def fork(self, num_copies: int) -> GPNCache:
        """A new cache with every row repeated `num_copies` times: rows i*n .. i*n + n - 1 hold row i.

        The forked rows have read the same positions as the original (`get_seq_length()` is unchanged)
        and continue independently: N sampled or beamed continuations of one prompt without reading the
        prompt N times. The original cache is left as it is; `fork(1)` is a copy.
        """
        if isinstance(num_copies, bool) or not isinstance(num_copies, int) or num_copies < 1:
            raise ValueError(f"fork needs a positive number of copies, got {num_copies!r}")
        return self.read_whole(lambda: self._forked(num_copies))

    def _forked(self, num_copies: int) -> GPNCache:
        """`fork`'s copy (read through `read_whole`)."""
        if not self.has_state:
            raise ValueError("This GPNCache holds no state to fork: run the model on a prompt with it first")
        layer = self.state_layer
        forked = GPNCache()
        forked.update_state(
            *(layer.recurrent_states[i].repeat_interleave(num_copies, dim=0) for i in range(3)),
            num_new_tokens=self.get_seq_length(),
            # (with gradients, the copies stay linked to the original's graph, and are spent when it is)
            graph_probe=layer.graph_probe if torch.is_grad_enabled() else None,
        )
        read = self.read_fingerprint()  # each copy has read what its original row read
        head = layer.fingerprint.head
        forked.state_layer.fingerprint = ReadFingerprint(
            known=read is not None,
            fingerprint=None if read is None else read.repeat_interleave(num_copies, dim=0),
            head=None if head is None else head.repeat_interleave(num_copies, dim=0),
            head_length=layer.fingerprint.head_length,
        )
        forked.state_layer.mixed_adapters = layer.mixed_adapters  # (each copy was computed as its original row)
        forked._gpn_model_ref = getattr(self, "_gpn_model_ref", None)
        forked._gpn_weights_snapshot = getattr(self, "_gpn_weights_snapshot", None)
        return forked

    def save(
        self,
        path: str | os.PathLike,
        *,
        model_fingerprint: dict[str, str] | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        """Write the state to `path` as safetensors (never pickle), with what identifies its model.

        The file holds p, g and M for every row (float32) and, as metadata, the number of positions read,
        the fingerprint of the model that computed the state (`state_file.state_fingerprint`: the
        configuration fields that give the state its meaning, the weights' dtype and a hash of every
        parameter as stored) and a checksum of the tensors and the positions read. It is written under a temporary name unique to the
        call and renamed, so an interrupted save never leaves a partial file at `path`, and saves from several
        threads to one path each succeed. `GPNCache.load(path, model)` reads it.

        Args:
            model_fingerprint: `state_file.state_fingerprint(model)` of the model that computed the state, taken
                while it was loaded; for saving after that model was deleted (a server that unloads idle
                models). By default, that of the model that filled this cache.
            tokenizer: the tokenizer that made the ids the state read, to name in the file
                (`state_file.tokenizer_fingerprint`): `load` given another one refuses the file. By default the
                file names none.
        """
        path = Path(path)
        write_state_file(path, *self.read_whole(lambda: self._saved(path, model_fingerprint, tokenizer)))

    def _saved(
        self, path: Path, model_fingerprint: dict[str, str] | None, tokenizer: PreTrainedTokenizerBase | None
    ) -> tuple:
        """What `save` writes (`write_state_file`'s arguments after the path), read through `read_whole`."""
        if not self.has_state:
            raise ValueError(f"Cannot save {path}: this GPNCache holds no state (run the model on a prompt first)")
        mixed = self.state_layer.mixed_adapters
        if mixed:  # (whatever fingerprint is given: it names one model, and these rows are of several)
            raise ValueError(
                f"Cannot save {path}: PEFT's mixed-batch inference (adapter_names) computed this state, its rows under "
                f"the adapters {sorted(mixed)}, but a state file names one model (the active adapter's), which would "
                "continue each row as if it had computed it. Compute each row's state with its adapter set active "
                '(`set_adapter(name)`; `disable_adapter()` for "__base__"), without adapter_names, then save'
            )
        if model_fingerprint is None:
            model_ref = getattr(self, "_gpn_model_ref", None)
            model = model_ref() if model_ref is not None else None
            if model is None:
                raise ValueError(
                    f"Cannot save {path}: this GPNCache does not know the model that filled it (it was not filled "
                    "by a GPN forward in this process, or that model was deleted), so the file could not say whose "
                    "state it is"
                )
            snapshot = getattr(self, "_gpn_weights_snapshot", None)
            if snapshot is not None and weights_snapshot(model) != snapshot:
                raise ValueError(
                    f"Cannot save {path}: the model's weights or adapters changed after this state was computed "
                    "(a parameter edited in place, replaced, cast or moved, or a PEFT adapter switched, merged or "
                    "disabled), so the file would name a model that did not compute it. Save before changing the "
                    "model, or compute the state again with the model as it is now"
                )
            model_fingerprint = state_fingerprint(model)
        layer = self.state_layer
        tensors = {
            name: layer.recurrent_states[index].detach().to("cpu", copy=True).contiguous()
            for index, name in enumerate(STATE_TENSOR_NAMES)
        }
        # what it read (for generate()'s two ways of continuing, `continuation_start`), or "unknown"
        read = self.read_fingerprint()
        read_fingerprint = json.dumps(read.tolist()) if read is not None else "unknown"
        tokenizer_named = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
        # the head of the first call (`ReadFingerprint.head`), so a loaded state refuses a history departing from it
        # as the cache that saved it would
        kept = layer.fingerprint
        head = (
            json.dumps({"length": kept.head_length, "rows": kept.head.tolist()})
            if read is not None and kept.head is not None
            else None
        )
        return tensors, self.get_seq_length(), read_fingerprint, model_fingerprint, tokenizer_named, head

    @classmethod
    def load(
        cls, path: str | os.PathLike, model: nn.Module, *, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> GPNCache:
        """Read a state written by `save` onto `model`'s device, after checking it belongs to `model` (and to
        `tokenizer`, when given and the file names the tokenizer it was saved with).

        Refuses, with a `GPNStateFileError` naming the file: a file that is not a complete GPN state file
        (truncated, damaged: the checksum recorded at save time does not match), the state of another model
        (another configuration, weights dtype or weights), the state of another tokenizer's ids, and a state
        holding NaN or infinite values.
        Continue from it as from the cache `generate()` returns: the new tokens, with an attention mask
        covering `cache.get_seq_length()` positions more.
        """
        path = Path(path)
        try:
            base = gpn_base_model(model)
        except TypeError:
            raise TypeError(
                f"GPNCache.load needs the GPN model the state belongs to, got {type(model).__name__}"
            ) from None
        state = read_state_file(path, base)
        if tokenizer is not None and state.tokenizer_fingerprint not in (None, tokenizer_fingerprint(tokenizer)):
            raise GPNStateFileError(
                f"{path} holds a state of another tokenizer's ids (its vocabulary differs from the one given): "
                "continue it with the tokenizer it was saved with"
            )
        cache = cls()
        cache.update_state(
            *(state.tensors[name].to(base.device) for name in STATE_TENSOR_NAMES), num_new_tokens=state.positions_read
        )
        if state.read_fingerprint != "unknown":
            batch_size = state.tensors["predicted"].shape[0]
            try:
                table = json.loads(state.read_fingerprint)
                # (torch.tensor would truncate 1.7 to 1 and take true as 1: only integers are a cache's residues)
                values = [value for row in table for value in row] if isinstance(table, list) else [table]
                if not all(type(value) is int for value in values):
                    raise TypeError(f"it holds {sorted({type(value).__name__ for value in values} - {'int'})}")
                read = torch.tensor(table, dtype=torch.int64, device=base.device)
            except (ValueError, TypeError, RuntimeError, OverflowError) as error:
                raise GPNStateFileError(
                    f"{path} holds a read fingerprint that is not a table of integers ({error})"
                ) from None
            if tuple(read.shape) != (batch_size, 2):
                raise GPNStateFileError(
                    f"{path} holds a read fingerprint of shape {tuple(read.shape)}, not ({batch_size}, 2)"
                )
            if bool(((read < 0) | (read >= _FINGERPRINT_MODULUS)).any()):
                raise GPNStateFileError(
                    f"{path} holds a read fingerprint outside [0, {_FINGERPRINT_MODULUS}): not one a cache computes"
                )
            head, head_length = _loaded_head(state.read_head, batch_size, state.positions_read, path, base.device)
            cache.state_layer.fingerprint = ReadFingerprint(fingerprint=read, head=head, head_length=head_length)
        else:
            cache.state_layer.fingerprint.forget()
        cache.note_model(base, look_for_mixed_adapters=False)  # (nothing has run: the file's state is the model's)
        return cache


# ---- pytree registration (torch.export / torch.compile) -------------------------------------------
# The children are the state (p, g, M) and the number of positions read, as a 0-dim int64 tensor; the
# context is only whether a state is held. A count in the context would be a SymInt in a program exported
# with a dynamic sequence length (not serializable: torch.export.save failed with "Object of type SymInt
# is not JSON serializable"), and a constant frozen into the program's output spec at tracing time.


def _seen_tokens_tensor(seen: int | torch.Tensor) -> torch.Tensor:
    return seen if isinstance(seen, torch.Tensor) else torch.tensor(seen, dtype=torch.int64)


def _flatten_gpn_cache(cache: GPNCache):
    """pytree children of a `GPNCache`: (p, g, M) when it holds a state, then the positions read (a tensor)."""
    state = [cache.state_layer.recurrent_states[i] for i in range(3)] if cache.has_state else []
    return [*state, _seen_tokens_tensor(cache.state_layer.seen_tokens)], bool(state)


def _unflatten_gpn_cache(children: list, context: pytree.Context) -> GPNCache:
    has_state = context
    *state, seen_tokens = children
    cache = GPNCache()
    layer = cache.state_layer
    if has_state:
        for index, tensor in enumerate(state):
            layer.recurrent_states[index] = tensor
            layer.is_recurrent_states_initialized[index] = True
            layer.has_previous_state[index] = True
        layer.device, layer.dtype = state[0].device, state[0].dtype
        if state[0].requires_grad:  # (a program run with gradients returned it with its graph: `TRACED_PROBE`)
            layer.graph_probe = TRACED_PROBE
    layer.fingerprint = ReadFingerprint(known=False)  # what it read is not part of the pytree
    layer.seen_tokens = seen_tokens  # stays a tensor (no int() on a traced value); get_seq_length() gives an int
    return cache


# A registered pytree, so torch.export and torch.compile can return a cache from forward (and take one in).
# Each import of this file (the package, or a remote-code copy) defines its own GPNCache class to register.
pytree.register_pytree_node(
    GPNCache,
    _flatten_gpn_cache,
    _unflatten_gpn_cache,
    serialized_type_name=f"{__name__}.GPNCache",
    flatten_with_keys_fn=lambda cache: (
        [(pytree.SequenceKey(i), child) for i, child in enumerate(_flatten_gpn_cache(cache)[0])],
        _flatten_gpn_cache(cache)[1],
    ),
)
# ---- end of the pytree registration ---------------------------------------------------------------


# ---- continuing from a cache: the whole sequence or only the new positions ----------------------------


def continuation_start(
    cache: GPNCache,
    seen: int,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    mask_columns: int | None = None,
) -> int:
    """How many leading positions of what generate() was given the cache has already read: `seen` when it
    is the whole sequence so far (as with a KV cache), 0 when it is only the new positions (as transformers'
    generate() itself reads them for a recurrent cache, and as Mamba continues). Raises, saying what to
    pass, where it cannot tell.

    With G positions given to a cache that has read `seen`:
    - an attention mask of `seen` + G columns: the new positions (transformers' convention; never ambiguous);
      a mask of neither G nor `seen` + G columns is refused;
    - G < `seen`: the new positions (the whole sequence cannot be shorter than what was read);
    - G == `seen`: the new positions, unless they are, row for row, the positions the cache read (its
      fingerprint): that is the whole sequence with nothing new, refused (a recurrent state cannot be rolled
      back). With embeddings or a cache that does not know what it read, refused: it cannot tell;
    - G > `seen`: the fingerprint of the first `seen` positions given (token ids and padding,
      `token_fingerprint`) decides: the cache's own in every row means the whole sequence, in no row the new
      positions; rows that disagree, embeddings (nothing to fingerprint) and a cache that does not know what
      it read (it read embeddings, or was rebuilt by a traced program) are refused;
    - G >= `seen` with a row whose fingerprint matches only with the padding inside it counted as read (the pad
      tokens generate() feeds a row that ended with EOS, which a mask inferred from pad_token_id pads): refused,
      naming the rows (a state cannot un-read them).
    - G >= `seen` positions the rules above read as new by their content (no row with the fingerprint) with a
      row that begins with the first half of what the cache's first call read (`ReadFingerprint.head`): refused,
      naming the rows: the whole sequence departing from what the cache read (`_refuse_a_departing_history`).
      (Fewer positions are new ones: a whole sequence is at least as long as what was read, and a loop that feeds
      each new question alone often repeats the opening of a short first prompt, "Question: What is".)

    What it cannot judge, and takes by the rule above: new positions that repeat, in every row, exactly what
    the cache has read (they are taken for the whole sequence; pass the mask of `seen` + G columns to feed
    them as new), a fingerprint collision (two 31-bit hashes a row: about 2^-62 for a given pair), and the
    pairing of rows: given new positions, or whole sequences none of which begin with their row's history
    (a beam search's cache continued in the order of its returned sequences), rows are paired as given.
    docs/cache.md says the same for users.
    The cost does not depend on anything the cache accumulates: the cache keeps one fingerprint of fixed
    size (updated in O(1) per decoded token) and the head, set once, and only a generate() call without the mask
    that settles it hashes given positions, once: its first `seen` where it was given at least that many, the
    head's where they are read as new by their content.
    """
    given = (input_ids if input_ids is not None else inputs_embeds).shape[1]
    if mask_columns is None:
        mask_columns = None if attention_mask is None else attention_mask.shape[1]
    how = (
        "Pass only the new positions with an attention_mask covering the whole sequence "
        f"({seen} + new columns), or the whole sequence as token ids to a cache filled from token ids."
    )
    if mask_columns is not None and mask_columns != given:
        if mask_columns == seen + given:
            return 0
        raise ValueError(
            f"generate() got {given} positions and an attention_mask of {mask_columns} columns with a "
            f"cache that has read {seen}: the mask must cover the given positions ({given}) or the whole sequence "
            f"({seen + given})."
        )
    if given < seen:  # the whole sequence would be at least as long as what was read
        return 0
    known = cache.read_fingerprint()
    if input_ids is None or known is None:
        what = (
            "as inputs_embeds: embeddings cannot be matched against what the cache read"
            if input_ids is None
            else "to a cache without a record of what it read (it read inputs_embeds, was rebuilt by a traced program "
            "or advanced by a compiled forward, as generate() given a compile_config does)"
        )
        raise ValueError(
            f"generate() got {given} positions {what}, and the cache has read {seen}: it cannot tell the whole "
            f"sequence from new positions. Pass only the new positions with an attention_mask covering the whole "
            f"sequence ({seen} + {given} = {seen + given} columns)."
        )
    prefix_mask = None if attention_mask is None else attention_mask[:, :seen]
    matches = (token_fingerprint(input_ids[:, :seen], prefix_mask) == known.to(input_ids.device)).all(dim=1)
    if prefix_mask is not None and not bool(matches.all()):
        # generate() feeds a row that ended (EOS) pad tokens, unmasked, while others go on, and the cache reads them
        # as tokens; the mask transformers infers from pad_token_id for the whole sequence marks them as padding, so
        # that row looked like new positions: rows disagreeing were refused for the wrong reason, and where every row
        # had such a tail (a continued cache's second round) the whole sequence was read again, in silence. A row that
        # matches with its padding after the first real position taken as read is named instead.
        after_first = prefix_mask.long().cummax(dim=1).values  # left padding kept, padding inside the row read
        read_as_tokens = ~matches & (
            token_fingerprint(input_ids[:, :seen], after_first) == known.to(input_ids.device)
        ).all(dim=1)
        if bool(read_as_tokens.any()):
            raise ValueError(
                f"generate() got {given} positions with a cache that has read {seen}: rows "
                f"{read_as_tokens.nonzero()[:, 0].tolist()} begin with what the cache read, but the attention_mask marks "
                "as padding positions that the cache read as tokens (after a row ends with EOS, generate() feeds it pad "
                "tokens, unmasked, while other rows go on; a mask inferred from pad_token_id marks them as padding), and "
                "a state cannot un-read them. Pass an attention_mask with 1 at those positions (as the cache read "
                f"them), or only the new positions with an attention_mask of {seen} + new columns."
            )
    if given == seen:
        if bool(matches.all()):
            raise ValueError(
                f"generate() got the {seen} positions the cache has already read and nothing new. A GPN state "
                "cannot be rolled back to an earlier position; pass new positions to continue (to feed these again "
                f"as new positions, pass an attention_mask of {2 * seen} columns)."
            )
        _refuse_a_departing_history(cache, seen, input_ids, attention_mask, matches)
        return 0
    if bool(matches.all()):
        return seen
    if not bool(matches.any()):
        _refuse_a_departing_history(cache, seen, input_ids, attention_mask, matches)
        return 0
    raise ValueError(
        f"generate() got {given} positions with a cache that has read {seen}: rows "
        f"{matches.nonzero()[:, 0].tolist()} begin with what the cache read (the whole sequence) and the others "
        f"do not (new positions). {how}"
    )


def _refuse_a_departing_history(
    cache: GPNCache,
    seen: int,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    matches: torch.Tensor,
) -> None:
    """Refuse at least `seen` positions that `continuation_start` would read as new (they do not begin with the `seen`
    positions the cache read, `matches` False) where some row begins with the head of that history (`ReadFingerprint.head`,
    the first half of the first call's positions). Such positions are, far more likely than new ones that happen to
    repeat the history's opening, the whole sequence so far departing from what the cache read: transformers' recipe
    that reuses a prompt's cache (`tokenizer(PROMPT + question)` with a copy of PROMPT's cache: the last token of
    PROMPT tokenized alone, " ", is " question" in the whole text) and a chat loop whose template renders earlier
    turns anew. Read as new positions, the whole conversation would be read a second time after itself, in silence;
    as the whole sequence, a state cannot un-read what it read instead."""
    if input_ids is None:
        return
    heads = cache.state_layer.fingerprint.head_matches(input_ids, attention_mask)
    if heads is None:
        return
    departing = heads & ~matches
    if not bool(departing.any()):
        return
    length = cache.state_layer.fingerprint.head_length
    raise ValueError(
        f"generate() got {input_ids.shape[1]} positions with a cache that has read {seen}: rows "
        f"{departing.nonzero()[:, 0].tolist()} begin with the first {length} positions the cache read but do not "
        f"continue with the rest of them. As the whole sequence so far it departs from what the cache read (the text "
        "tokenized again otherwise, e.g. a prompt cached alone whose last token merges with the text that follows, or "
        "a chat template that renders earlier turns anew), and a state cannot un-read positions: give only the text "
        "that follows what the cache read, or read the whole sequence into a fresh cache. If they are new positions, "
        f"pass an attention_mask of {seen} + {input_ids.shape[1]} = {seen + input_ids.shape[1]} columns."
    )


def _loaded_head(
    recorded: str | None, batch_size: int, positions_read: int, path: Path, device: torch.device
) -> tuple[torch.Tensor | None, int]:
    """The head of the first call (`ReadFingerprint.head`, its length) a state file records, checked; (None, 0) for a
    file that records none (saved before heads were kept, or by a cache that kept none). It is no part of the
    checksum (files with one stay readable where the head is not known), so it is checked as a cache computes it:
    integer residues, one row per state row, a length within the positions read."""
    if recorded is None:
        return None, 0
    try:
        value = json.loads(recorded)
        length, rows = value["length"], value["rows"]
        residues = [residue for row in rows for residue in row]
        if type(length) is not int or not all(type(residue) is int for residue in residues):
            raise TypeError("it holds values that are not integers")
        head = torch.tensor(rows, dtype=torch.int64, device=device)
    except (ValueError, TypeError, KeyError, RuntimeError, OverflowError) as error:
        raise GPNStateFileError(
            f"{path} holds a read head that is not a length and a table of integers ({error})"
        ) from None
    if tuple(head.shape) != (batch_size, 2) or not 0 < length <= positions_read:
        raise GPNStateFileError(
            f"{path} holds a read head of shape {tuple(head.shape)} and length {length}, not ({batch_size}, 2) within "
            f"the {positions_read} positions read"
        )
    if bool(((head < 0) | (head >= _FINGERPRINT_MODULUS)).any()):
        raise GPNStateFileError(
            f"{path} holds a read head outside [0, {_FINGERPRINT_MODULUS}): not one a cache computes"
        )
    return head, length


# ---- end of continuing from a cache ------------------------------------------------------------------


# ---- gradients through a carried state ------------------------------------------------------------------------


# The probe of a state that a compiled call kept with its graph: no node of ours to ask, no versions
# (`state_entering_call`); a later eager call asks the program's node instead (`traced_call_node`).
TRACED_PROBE: tuple = (None, (), None)

# What spent a carried graph (`GPNCache.refuse_a_spent_graph`).
_FREED = "a backward() has already run through that graph (or an earlier call's part of it) and freed it"
_STEPPED = "an optimizer step (or another in-place update) changed the weights it was computed with"


def traced_call_node(state: torch.Tensor) -> torch.autograd.graph.Node | None:
    """The autograd node of the compiled program (torch.compile's AOT autograd Function) that computed `state`,
    reached through the copies and views after it: its saved tensors are freed by a backward through it, as the
    probe's are. None where there is none within a few nodes (an exported program's graph is torch's own nodes)."""
    node = state.grad_fn
    for _ in range(8):
        if node is None or isinstance(node, torch.autograd.function.BackwardCFunction):
            return node
        node = next((function for function, _ in node.next_functions if function is not None), None)
    return None


class _CarriedIn(torch.autograd.Function):
    """The identity on the state a call with gradients starts from, whose node is freed by the first backward that runs
    through the call without retaining the graph: a cache carrying the call's graph holds the node, and a later
    call continuing it asks whether it was freed (`GPNCache.refuse_a_spent_graph`)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, predicted: torch.Tensor, grounded: torch.Tensor, memory: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The state as it is; its first part kept, as the probe."""
        ctx.save_for_backward(predicted)  # (what a freed node no longer gives: the probe)
        return predicted.view_as(predicted), grounded.view_as(grounded), memory.view_as(memory)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        d_predicted: torch.Tensor,
        d_grounded: torch.Tensor,
        d_memory: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gradients as they come: the state goes on into the call before."""
        return d_predicted, d_grounded, d_memory


def state_entering_call(
    cache: GPNCache | None,
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    model: nn.Module,
    inputs: torch.Tensor,
    keeps_state: bool,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple | None]:
    """The state a forward that keeps its state in a cache starts from (`state`: the cache's copy, or the zero state),
    and the probe to store the final state with (`GPNCache.update_state`), or None where the call builds no graph or
    keeps no state (`keeps_state`: `use_cache`).

    A call that builds an autograd graph (gradients enabled, and a trainable weight, `inputs` or the state requiring
    them) keeps its final state attached to it: a later call's loss then reaches this call's weights, and the
    gradients of calls over consecutive chunks are those of one forward over the whole sequence. A cache whose graph
    is spent (freed by a backward through any of its calls, or its weights stepped) is refused here, naming
    `detach()`, rather than failing later inside torch's backward: the probe holds this call's node and the first
    call's (`GPNCache.refuse_a_spent_graph`).

    Compiled (torch.compile), the state is kept with its graph too, without the probe (`TRACED_PROBE`): a traced
    program cannot read an autograd node or the weights' versions. An eager call continuing it asks the compiled
    program's node; a traced call continuing a spent graph is told by torch's own backward (docs/cache.md)."""
    if not torch.is_grad_enabled():
        return state, None
    tracing = is_tracing()
    if cache is not None and not tracing:
        cache.refuse_a_spent_graph()
    if not keeps_state:
        return state, None
    weights = [weight for weight in model.parameters() if weight.requires_grad]
    if not (weights or inputs.requires_grad or any(part.requires_grad for part in state)):
        return state, None
    if tracing:
        # (stored as the program returns it, graph and all: stored in place, detached, the gradients of a compiled
        # loop over chunks stopped at each call in silence, or the next call's write broke the last one's backward)
        return state, TRACED_PROBE
    # (a state that does not require gradients, the zero state or a constant, is made a leaf that does: the probe's
    # node is then in the graph of every call, the first included)
    entering = _CarriedIn.apply(*(part if part.requires_grad else part.detach().requires_grad_() for part in state))
    node = entering[0].grad_fn
    # the first call's node too: a backward of an earlier chunk's loss alone frees the calls up to it, not this one's
    # parent, and the next call's backward would reach them
    first = cache.first_call_node() if cache is not None else None
    return entering, (node, [(weight, weight._version) for weight in weights], first or node)


def snapshot_before_call(cache: GPNCache | None, model: nn.Module) -> tuple | None:
    """The snapshot of `model`'s weights (`state_file.weights_snapshot`) that `GPNCache.note_model` keeps where
    `model` is new to `cache` (None: a cache the call makes), taken by a call before it reads the weights; None where
    `model` advanced that state already (the common case: one weak reference read), or while tracing. Taken after the
    call, an edit another thread made while the call ran would be in the snapshot though not (or not all) in the
    state, and `save` would name the edited model; taken before, `save` sees the edit and refuses."""
    ref = cache.__dict__.get("_gpn_model_ref") if cache is not None else None
    if (ref is not None and ref() is model) or is_tracing():
        return None
    return weights_snapshot(model)
