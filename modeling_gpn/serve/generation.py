"""Where a request becomes a `generate()` call: continuing from a kept state, and keeping the new ones.

transformers' handlers call `model.generate(input_ids=..., attention_mask=..., streamer=..., generation_config=...,
tokenizer=...)` on the model the model manager loaded, on one inference thread per model. `gpn serve` hands
them a `StateKeepingModel` instead: the same model (every other attribute is the model's), whose `generate`
asks the `StateStore` for the longest kept state the prompt begins with and reads only the rest: a private
copy of the kept state (`fork(1)`) reads the prompt's new ids up to its last token (a forward, given the new
ids with an attention mask over the positions read plus the new ones: never ambiguous), then `generate()` is
given the whole prompt with that cache and reads only its last token (it recognises what the cache has read by
its fingerprint). Every logits processor and stopping criterion of `generate()` so sees the whole prompt, and
it returns what `generate()` returns for the whole prompt, token for token: nothing downstream changes.

Two states are kept per request. One is the state before the prompt's last token: `generate()` must read at
least one token (its logits give the first answer token), so this is the state that serves the same prompt
again (a retry, more samples: one token read) and the next turn, which begins with this prompt (one token more
than its new ones). It is made by reading the prompt up to that token in a forward of its own, then
`generate()`, given the whole prompt, reads the last token. The other is the state after the answer (the prompt and every answer token
but the last, which `generate()` never reads), which serves the next turn when the answer's text, rendered by
the chat template and tokenized again, gives back the generated tokens (it need not: then the first state
serves).

`n` answers to one request are `n` rows forked from one state (`GPNCache.fork`): the prompt is read once.
Models other than a GPN, beam search, padded or batched inputs run `generate()` as they are.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel
    from transformers.generation.streamers import BaseStreamer

from .. import GPNCache, GPNForCausalLM
from ..derived_weights import derived_weights_scope, drop_kept
from .state_store import StateStore
from .stop_strings import StopInAnswer
from .streaming import sending_whole_text

logger = logging.getLogger(__name__)

# Sampling draws from torch's one global generator, which every thread shares: one model's inference thread
# draws while another's does (an unpinned server runs one per model). Sampled generate() calls take turns, so
# that a request's seed, applied when its turn comes, gives the same answer whatever runs beside it.
_sampling_turn = threading.Lock()


class StateKeepingModel:
    """The served model as transformers' handlers see it for one request (see the module docstring).

    Args:
        model: the model the model manager loaded.
        store: where states are kept; None (or a model that is not a GPN) runs `generate()` as it is.
        answers: how many answers to make (the request's `n`): rows of one state, or of the prompt repeated.
        on_done: called once when this request's `generate()` is over (finished, failed or cancelled).
        seed: the request's `seed`: torch's generator is seeded with it as its `generate()` starts, on the inference
            thread (transformers serve seeds it when the request arrives, so the requests generating or waiting
            before it draw from its seed, and its own draws come from whichever request arrived last).
        client_gone: set when the request's client has gone away: its `generate()` stops at the next token (a
            streamed answer's is cancelled by transformers' streamer; nothing stops a non-streamed one's).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        store: StateStore | None,
        answers: int = 1,
        on_done: Callable[[], None] | None = None,
        seed: int | None = None,
        client_gone: threading.Event | None = None,
        penalties: Penalties | None = None,
    ):
        self._model = model
        self.penalties = penalties
        self._store = store if isinstance(model, GPNForCausalLM) else None
        self.answers = answers
        self._on_done = on_done
        self.seed = seed
        self._client_gone = client_gone
        self.cached_tokens = 0  # prompt tokens continued from a kept state rather than read
        self.sequences: torch.Tensor | None = None  # every row generate() returned (n answers: n rows)
        # the ids generate() has made so far, prompt included: known before a stream's end is (`LastToken`)
        self.ids_so_far: torch.Tensor | None = None

    @property
    def __class__(self):
        """The model's: transformers' handlers name a model (and tell its modality) by its class."""
        return type(self._model)

    def __getattr__(self, name: str):
        if name == "init_continuous_batching" and isinstance(self._model, GPNForCausalLM):
            # transformers' continuous batching is paged attention: a GPN has none, so the handlers fall back to
            # generate() (they check for this attribute and say so in the log)
            raise AttributeError(name)
        return getattr(self._model, name)

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        streamer: BaseStreamer | None = None,
        generation_config: GenerationConfig | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """generate() from the stored state of the conversation (when kept), storing the state it ends in."""
        try:
            # (a stream's text is the answer's text, runs of byte tokens that are no UTF-8 included: `streaming`)
            streamer = sending_whole_text(streamer)
            config = copy.deepcopy(
                generation_config if generation_config is not None else self._model.generation_config
            )
            answers = self.answers  # rows made here: greedy decoding refuses num_return_sequences > 1
            watchers = [LastToken(self)] + ([] if self._client_gone is None else [ClientGone(self._client_gone)])
            if config.stop_strings and kwargs.get("tokenizer") is not None:
                # the answer stops where its text is cut, at a stop sequence in the answer itself (`StopInAnswer`);
                # transformers' check, which a config's stop_strings adds, also stops on one the prompt begins
                stops = [config.stop_strings] if isinstance(config.stop_strings, str) else list(config.stop_strings)
                tokenizer = getattr(kwargs["tokenizer"], "tokenizer", kwargs["tokenizer"])
                beams = (config.num_beams or 1) > 1
                watchers.append(StopInAnswer(tokenizer, stops, prompt_length=input_ids.shape[-1], beams=beams))
                config.stop_strings = None
            kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), *watchers])
            if self.penalties is not None:
                processors = self.penalties.processors(config, prompt_length=input_ids.shape[-1])
                kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), *processors])
            with _seeded(self.seed, samples=bool(config.do_sample)):
                if self._continues_from_store(input_ids, attention_mask, config, kwargs):
                    self.sequences = self._generate_from_kept_state(input_ids, answers, streamer, config, kwargs)
                else:
                    if answers > 1:
                        input_ids = input_ids.repeat_interleave(answers, dim=0)
                        attention_mask = (
                            None if attention_mask is None else attention_mask.repeat_interleave(answers, dim=0)
                        )
                    self.sequences = self._model.generate(
                        input_ids=input_ids,
                        attention_mask=attention_mask,
                        streamer=streamer,
                        generation_config=config,
                        **kwargs,
                    )
            return self.sequences
        finally:
            if self._on_done is not None:
                self._on_done()

    def token_at(self, position: int) -> int | None:
        """The first row's token at `position` (prompt included) as generate() made it; None if not made."""
        ids = self.ids_so_far
        return None if ids is None or ids.shape[-1] <= position else int(ids[0, position])

    def _continues_from_store(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, config: GenerationConfig, kwargs: dict
    ) -> bool:
        """Whether this call can go through the store: one unpadded row of token ids, sampling or greedy
        (beam search from a given cache is not supported), with a cache, not assisted."""
        if self._store is None or input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] != 1:
            return False
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            return False
        if (config.num_beams or 1) > 1 or config.use_cache is False:
            return False
        return not any(
            kwargs.get(name) is not None for name in ("inputs_embeds", "assistant_model", "cache", "past_key_values")
        )

    def _generate_from_kept_state(
        self,
        input_ids: torch.Tensor,
        answers: int,
        streamer: BaseStreamer | None,
        config: GenerationConfig,
        kwargs: dict,
    ) -> torch.Tensor:
        model, store = self._model, self._store
        prompt = input_ids[0].tolist()
        length = len(prompt)
        # generate() reads at least the prompt's last token (its logits give the first answer token), so the
        # state that serves a prompt is the one before that token: found here, or made and kept here
        found = store.lookup(model, prompt, max_length=length - 1)
        start, cache = found if found is not None else (0, None)
        self.cached_tokens = start
        # one scope for the forward below and generate(): the weights the fast path derives (folded, prepacked)
        # are derived once for the request, as generate() alone does, not once for each
        with derived_weights_scope(model.model):
            if start < length - 1:
                with torch.no_grad():
                    cache = model(
                        input_ids[:, start : length - 1],
                        attention_mask=torch.ones(1, length - 1, dtype=torch.long, device=input_ids.device),
                        cache=cache,
                        use_cache=True,
                        logits_to_keep=1,
                    ).cache
                _keep_safely(store, model, prompt[: length - 1], lambda: cache.fork(1))
            if cache is None:  # a one-token prompt: nothing before its last token
                cache = GPNCache()
            elif answers > 1:
                cache = cache.fork(answers)  # n answers, one state: the prompt is not read n times
            # generate() is given the whole prompt, not only its last token: the cache has read all but that
            # token, and generate() recognises what it read (its fingerprint) and reads only the rest. So every
            # logits processor and stopping criterion sees the whole history (repetition_penalty,
            # no_repeat_ngram_size, sequence_bias, min_length, max_length, ...) and the answer is generate()'s
            # on the whole conversation, token for token.
            sequences = model.generate(
                input_ids=input_ids.repeat_interleave(answers, dim=0),
                attention_mask=torch.ones(answers, length, dtype=torch.long, device=input_ids.device),
                cache=cache,
                streamer=streamer,
                generation_config=config,
                **kwargs,
            )
        # the store keeps the cache generate() filled, and with it what the fast path derived (kept for a decode
        # loop continuing that cache); the next request opens its own scope and derives afresh, so let it go
        drop_kept(model.model)
        generated = sequences[:, length:]
        # The answers' states: each row has read the prompt and its tokens but the last (generate() stops
        # without reading it); rows that finished early have read padding after their end, kept as read.
        read = cache.get_seq_length()
        for row in range(answers):
            answer_state = (lambda: cache) if answers == 1 else (lambda row=row: _row(cache, row, answers))
            _keep_safely(store, model, (prompt + generated[row].tolist())[:read], answer_state)
        return sequences


class ClientGone(StoppingCriteria):
    """Stops every row once `gone` is set (the request's client went away): no one is left to read the answer.
    What was read is read: the states kept are those of the tokens read, and a retry continues from them."""

    def __init__(self, gone: threading.Event):
        self.gone = gone

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        """Stop every row once the client has gone."""
        return torch.full((input_ids.shape[0],), self.gone.is_set(), dtype=torch.bool, device=input_ids.device)


class Penalties:
    """The OpenAI API's `frequency_penalty` and `presence_penalty`: before sampling, each token's logit is lowered by
    `frequency` times the number of times the answer has made it so far, and by `presence` once it has made it at
    all (the prompt does not count). transformers serve reads `frequency_penalty` as a repetition penalty of
    `1 + frequency_penalty`, which divides the logits of every token of the prompt and answer alike."""

    def __init__(self, frequency: float, presence: float):
        self.frequency, self.presence = frequency, presence

    def processors(self, config: GenerationConfig, prompt_length: int) -> list[LogitsProcessor]:
        """The processors generate() adds after its own: the penalties, then (when it samples) the request's
        temperature, top-k and top-p, taken out of `config` (set neutral there), which generate() would apply
        before anything it is given: the API penalises the logits, and then scales and cuts them."""
        chain: list[LogitsProcessor] = [_Penalised(self.frequency, self.presence, prompt_length)]
        if config.do_sample:
            if config.temperature is not None and config.temperature != 1.0:
                chain.append(TemperatureLogitsWarper(config.temperature))
            if config.top_k:
                chain.append(TopKLogitsWarper(config.top_k))
            if config.top_p is not None and config.top_p < 1.0:
                chain.append(TopPLogitsWarper(config.top_p))
            config.temperature, config.top_k, config.top_p = 1.0, 0, 1.0
        return chain


class _Penalised(LogitsProcessor):
    """`Penalties` on the logits of rows whose first `prompt_length` tokens are the prompt."""

    def __init__(self, frequency: float, presence: float, prompt_length: int):
        self.frequency, self.presence, self.prompt_length = frequency, presence, prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        made = input_ids[:, self.prompt_length :]
        counts = torch.zeros_like(scores).scatter_add_(1, made, torch.ones_like(made, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class LastToken(StoppingCriteria):
    """Records on `model` the ids made so far (never stops a row; a reference, no copy or device sync). generate()
    checks its stopping criteria after each token, before it ends the streamer, so a stream's last chunk can
    tell an answer that ended on EOS at its `max_tokens`-th token from one cut at its length (by position: a
    deferred stop check on a GPU makes, then undoes, one token more)."""

    def __init__(self, model: StateKeepingModel):
        self.model = model

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        """Record the ids so far (the state kept is theirs); never stops."""
        self.model.ids_so_far = input_ids
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@contextlib.contextmanager
def _seeded(seed: int | None, samples: bool) -> Iterator[None]:
    """A sampled generate()'s turn at torch's generator, seeded with `seed` (when given) as it begins. Greedy
    decoding draws nothing: it neither waits nor seeds."""
    if not samples:
        yield
        return
    with _sampling_turn:
        if seed is not None:
            torch.manual_seed(seed)
        yield


def _keep_safely(store: StateStore, model: PreTrainedModel, ids: list[int], state: Callable[[], GPNCache]) -> None:
    """Keep a state; a state that cannot be kept never fails the request that made it (it is logged)."""
    try:
        store.keep(model, ids, state())
    except Exception:  # noqa: BLE001 - the answer is right whether or not its state is kept
        logger.exception("state store: keeping a state of %d tokens failed", len(ids))


def _row(cache: GPNCache, row: int, rows: int) -> GPNCache:
    """One row of a cache, as a new one-row cache (the original is left as it is)."""
    copy_of_row = cache.fork(1)
    if rows > 1:
        copy_of_row.batch_select_indices(torch.tensor([row], device=copy_of_row.state_layer.recurrent_states[0].device))
    return copy_of_row
