"""transformers' chat, completion and Responses API handlers, with what `gpn serve` adds around them.

The handlers are transformers' own (`ChatCompletionHandler`, `CompletionHandler`, `ResponseHandler`): they parse the request,
render the chat template, build the generation config, stream and format the answer. `StateKeeping` (a
mixin placed before them) adds, at the points where they hand over:

- the request checked first (`validation`): a wrong type or value is a 400 naming the field, never a 500;
  so is a chat or Responses request to a model whose tokenizer has no chat template (every model `gpn train`
  makes: transformers would answer with a 500 and a traceback in the log);
- admission: at most `max_queued_requests` requests taken on at once (running or waiting for the model's
  inference thread); one more is a 429. A request's slot is freed when its answer is over: its response sent,
  or its stream ended, finished or cut off by the client (whose generation transformers' streamer then
  cancels at the next token), or its `generate()` returned, whichever comes first; a non-streamed answer whose
  client went away (`WatchingClients`) stops generating at its next token too;
- the context limit: the prompt and `max_tokens` within `max_context` tokens, or a 400 (without
  `max_tokens`, the answer is cut to fit, as transformers' default of 1024 new tokens would otherwise refuse
  long prompts);
- the model, as the handlers see it, is a `StateKeepingModel` (its `generate()` goes through the state
  store), and the prompt tokens continued from a kept state are reported as the OpenAI API does, in
  `usage.prompt_tokens_details.cached_tokens`;
- `n` answers (transformers ignores `n`): made as `n` rows of one `generate()` call, each formatted by
  transformers' own response builder (chat and completions: the Responses API has no `n`);
- each answer cut before its `stop` sequence, streamed or not, and its generation ended there, not at one the
  prompt begins (`stop_strings`), a stream's error event in the
  OpenAI API's shape (`errors`), and what the chat template would drop in silence refused with a 400: tools
  it never renders, a message's `name` it never renders, content parts other than text for a model that reads
  text; `stream_options: {"include_usage": false}` honoured (transformers sends usage in a stream's last chunk
  whatever the request says);
- the CPU-long steps before generation off the server's event loop, where every other request would wait for
  them: the model resolved (loaded, when it is not yet) and checked against the request, and the prompt rendered
  and tokenized, in a worker thread, with transformers' handler handed the result (`prepared`); so is the
  decoding that finds where each of `n` answers stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import threading
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from fastapi import HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from transformers import GenerationConfig
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.systemone import SystemOneHandler
from transformers.cli.serving.transcription import TranscriptionHandler
from transformers.cli.serving.utils import CBGenerateManager, Modality
from transformers.utils.import_utils import is_multipart_available

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator

    from starlette.requests import Request
    from starlette.types import ASGIApp, Receive, Scope, Send
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin

from .errors import as_openai_stream_error, error_body
from .generation import Penalties, StateKeepingModel
from .prepared import PreparedProcessor, prepared_processor
from .state_store import StateStore
from .stop_strings import StreamCutter, cut_at_stop, stop_position, stop_sequences
from .validation import (
    RequestError,
    check_chat_request,
    check_completion_request,
    check_response_request,
    check_text_only,
    is_content_part,
)

# The seconds a client refused for a full queue is told to wait: about one short answer's time on a CPU.
RETRY_AFTER_S = 1


class Admission:
    """The requests a server has taken on (running, or waiting for the inference thread), at most `limit`."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.active = 0
        self._lock = threading.Lock()

    def admit(self) -> Slot:
        """A `Slot` for one request, or HTTP 429 while the server has as many as it admits."""
        with self._lock:
            if self.limit is not None and self.active >= self.limit:
                raise HTTPException(
                    status_code=429,
                    detail=f"the server is busy: {self.active} requests are running or waiting (--max-queued-requests "
                    f"{self.limit}); retry later",
                    # (the `openai` client waits this long before its own retries, instead of its backoff's
                    # fraction of a second, and HTTP clients and proxies read it)
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            self.active += 1
        return Slot(self)

    def _release(self) -> None:
        with self._lock:
            self.active -= 1


class Slot:
    """One admitted request; `release` (idempotent, from any thread) gives its place back."""

    def __init__(self, admission: Admission):
        self._admission = admission
        self._released = False
        self._lock = threading.Lock()

    def release(self) -> None:
        """Give the slot back (once; later calls do nothing)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._admission._release()


@dataclass
class ServingPolicy:
    """What every handler of one server shares: the state store (None: off) and the limits."""

    store: StateStore | None
    max_context: int | None
    admission: Admission


@dataclass
class _Request:
    slot: Slot
    answers: int
    max_tokens_field: str | None  # the field that set the answer's length, if any
    stops: list[str]
    usage: bool = True  # whether a stream's last chunk keeps its usage (`stream_options.include_usage`)
    model: StateKeepingModel | None = None
    # what `_resolve_model` returned (in the worker thread, `_prepare`): the handler's own call gets it again
    resolved: tuple[str, StateKeepingModel, PreparedProcessor] | None = None


# The request a handler is working on: set in handle_request, read where transformers' handler calls back.
_current: ContextVar[_Request] = ContextVar("gpn_serve_request")
# Set when the client of the HTTP request being handled has gone away (`WatchingClients`).
_client_gone: ContextVar[threading.Event | None] = ContextVar("gpn_serve_client_gone", default=None)


class WatchingClients:
    """ASGI middleware: tells the handlers (`_client_gone`) when a request's client goes away.

    A streamed answer learns it from its next write, and transformers' streamer then cancels its generation; a
    non-streamed answer writes nothing until it is done, so without this a client that gave up (a timeout, whose
    `openai` client then retries) kept the model's inference thread and a slot for the whole answer, and each retry
    queued behind it. Once the request's body is read, the server's `receive` returns only when the client
    disconnects (or the response is complete): a task waits on it.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send):
        """The ASGI call: an HTTP request runs with an event set when its client disconnects."""
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        gone, body_read = threading.Event(), asyncio.Event()

        async def receiving():
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif not message.get("more_body", False):
                body_read.set()
            return message

        async def watch():
            await body_read.wait()  # (before: the app's own reads would race this one for the body)
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        token = _client_gone.set(gone)
        watcher = asyncio.ensure_future(watch())
        try:
            await self.app(scope, receiving, send)
        finally:
            watcher.cancel()
            _client_gone.reset(token)


class LimitedBodies:
    """ASGI middleware: a request body over `max_bytes` is answered 413 (in the API's error shape) without being
    kept: refused by its Content-Length, or (a chunked body) once the bytes read pass the limit. A body within the
    limit is read here and handed on as one message.

    FastAPI reads a body whole into memory, and its prompt is tokenized before the context limit can refuse it
    (in a worker thread: `prepared`): a body of hundreds of MB would take the server's memory, and a core for
    minutes. (starlette's own `RequestBodyLimitMiddleware` answers its 413 as plain text, which the `openai` client
    shows without the reason; and an error raised while FastAPI reads the body reaches it through transformers'
    request-id middleware as "There was an error parsing the body".)"""

    # What a refused client is still sending is read and dropped for at most this long before the answer: a
    # connection closed on a client still writing is reset, and the client (`openai`, `httpx`) then reports the
    # reset, not the 413 (nginx drains so too). A client that waits for "100 Continue" has sent nothing.
    DRAIN_SECONDS = 5.0

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send):
        """The ASGI call: a request body over `max_bytes` is refused with HTTP 413."""
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            sending = headers.get(b"expect", b"").lower() != b"100-continue"
            return await self.refuse(scope, receive, send, sending)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before its body was sent
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self.refuse(scope, receive, send, more)
        body, handed = b"".join(chunks), False

        async def receiving():
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # (then only the client's going away: WatchingClients waits on it)

        await self.app(scope, receiving, send)

    async def refuse(self, scope: Scope, receive: Receive, send: Send, sending: bool) -> None:
        """Answer 413, after dropping what the client is still `sending` (for at most `DRAIN_SECONDS`)."""

        async def drop_the_rest():
            while (message := await receive())["type"] == "http.request" and message.get("more_body", False):
                pass

        if sending:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(drop_the_rest(), self.DRAIN_SECONDS)
        message = (
            f"the request body is larger than this server takes: at most {self.max_bytes} bytes (--max-request-bytes)"
        )
        answer = JSONResponse(error_body(message, 413), 413, headers={"Connection": "close"})
        await answer(scope, receive, send)


class StateKeeping:
    """Mixin for a transformers serving handler (see the module docstring); `check_request` validates bodies."""

    check_request = staticmethod(lambda body: None)
    renders_chat = True  # whether the endpoint renders messages with the tokenizer's chat template
    takes_n = True  # whether the endpoint has `n` (the Responses API has not: transformers refuses it, 422)
    # what sets the answer's length, the first given winning (as in transformers' handlers)
    max_tokens_fields = ("max_completion_tokens", "max_tokens")

    def __init__(self, *args, policy: ServingPolicy, **kwargs):
        super().__init__(*args, **kwargs)
        self.policy = policy

    async def handle_request(self, body: dict, request_id: str) -> StreamingResponse | JSONResponse:
        """Check the request, then answer it keeping the conversation's state."""
        try:
            self.check_request(body)
        except RequestError as error:
            raise HTTPException(status_code=error.status_code, detail=str(error)) from None
        if body.get("model") is None and self.model_manager.force_model is None:
            raise HTTPException(status_code=400, detail="model is required (this server is not pinned to one model)")
        if body.get("stop") == []:
            del body["stop"]  # no stop sequence (transformers would hand generate() an empty stop_strings)
        if body.get("logit_bias"):  # generate() takes float biases only; JSON's -100 is an int (transformers: a 500)
            body["logit_bias"] = {token: float(bias) for token, bias in body["logit_bias"].items()}
        # transformers would ignore n (with a warning): the answers are made here
        answers = (body.pop("n", None) or 1) if self.takes_n else 1
        max_tokens_field = next((name for name in self.max_tokens_fields if body.get(name) is not None), None)
        slot = self.policy.admission.admit()
        # a stream's usage unless the request says include_usage: false (the API sends it only when asked; here,
        # as in transformers serve, unless refused, for the clients that read it from the last chunk)
        usage = (body.get("stream_options") or {}).get("include_usage") is not False
        token = _current.set(_Request(slot, answers, max_tokens_field, stop_sequences(body), usage))
        streaming = False
        try:
            # what takes seconds on a large prompt is done in a worker thread, not on the event loop, where every
            # other request would wait for it (the worker gets the context: `_current`, `_client_gone`)
            await asyncio.to_thread(self._prepare, body)
            response = await super().handle_request(body, request_id)
            # a stream's answer is under way: its end (or its generate()'s) frees the slot
            streaming = isinstance(response, StreamingResponse)
            return response
        except TemplateError as error:  # the template's own errors (raise_exception, syntax): the request's fault
            raise HTTPException(
                status_code=400, detail=f"the chat template cannot render these messages: {error}"
            ) from None
        finally:
            _current.reset(token)
            if not streaming:
                slot.release()

    def _prepare(self, body: dict) -> None:
        """In a worker thread, before transformers' handler runs on the event loop: its first steps as it takes them
        (its field check, the model resolved: loaded if it is not, and checked against the request), then the
        prompt rendered and tokenized with the arguments the handler will give (`prepared`)."""
        self._validate_request(body)
        _, model, processor = self._resolve_model(body)
        modality = self.model_manager.get_model_modality(model, processor=processor)
        self._tokenize_ahead(body, processor, modality, self.generation_state.use_continuous_batching(model, modality))

    def _tokenize_ahead(self, body: dict, processor: PreparedProcessor, modality: Modality, use_cb: bool) -> None:
        """The chat template's rendering and tokenization, prepared with the arguments transformers 5.24's chat and
        Responses API handlers give `apply_chat_template` (their `handle_request`)."""
        messages, tools = self._messages_and_tools(body)
        processor_inputs = self.get_processor_inputs_from_messages(messages, modality)
        has_video = any(
            part.get("type") == "video"
            for message in processor_inputs
            for part in (message.get("content") if isinstance(message.get("content"), list) else [])
        )
        chat_template_kwargs = {"num_frames": 32} if has_video else {}
        chat_template_kwargs.update(self.chat_template_kwargs)
        chat_template_kwargs.update(body.get("chat_template_kwargs") or {})
        processor.prepare(
            "apply_chat_template",
            processor_inputs,
            add_generation_prompt=True,
            tools=tools,
            return_tensors=None if use_cb else "pt",
            return_dict=True,
            tokenize=True,
            load_audio_from_video=modality == Modality.MULTIMODAL and has_video,
            **chat_template_kwargs,
        )

    def _messages_and_tools(self, body: dict) -> tuple[list[dict], list[dict] | None]:
        """The messages and tools the handler renders (chat: the request's own)."""
        return body["messages"], body.get("tools")

    def _resolve_model(self, body: dict):
        request = _current.get()
        if request.resolved is not None:  # (resolved in the worker thread: `_prepare`)
            return request.resolved
        try:
            model_id, model, processor = super()._resolve_model(body)
        except HTTPException:
            raise
        except (OSError, ValueError) as error:  # not a model transformers can find or load
            raise HTTPException(
                status_code=404, detail=f"model {body.get('model')!r} cannot be loaded: {error}"
            ) from None
        if self.renders_chat and getattr(processor, "chat_template", None) is None:
            raise HTTPException(
                status_code=400,
                detail=f"model {model_id!r} has no chat template (its tokenizer's chat_template is not set), so it "
                "cannot render messages: send raw text to /v1/completions, or set tokenizer.chat_template and save "
                "the tokenizer into the model folder",
            )
        if self.renders_chat:
            self._check_renderable(body, model, processor)
        vocabulary = getattr(getattr(model, "config", None), "vocab_size", None)
        outside = sorted(int(token) for token in body.get("logit_bias") or {} if int(token) >= (vocabulary or 1 << 62))
        if outside:  # (generate() refuses them as it starts: a stream would already have begun, a 200)
            raise HTTPException(
                status_code=400,
                detail=f"logit_bias names token ids the model does not have ({', '.join(map(str, outside[:5]))}): "
                f"its vocabulary has {vocabulary} tokens",
            )
        request.model = StateKeepingModel(
            model,
            self.policy.store,
            answers=request.answers,
            on_done=request.slot.release,
            seed=body.get("seed"),
            client_gone=_client_gone.get(),
            penalties=_penalties(body),
        )
        request.resolved = (model_id, request.model, prepared_processor(processor))
        return request.resolved

    def _check_renderable(
        self, body: dict, model: PreTrainedModel, processor: ProcessorMixin | PreTrainedTokenizerBase
    ) -> None:
        """Refuse what the chat template would drop in silence: content parts other than text for a model that
        reads text only, and tools when the template never reads `tools` (the model would answer as if it had
        none, and never call one)."""
        modality = self.model_manager.get_model_modality(model, processor=processor)
        if modality == Modality.LLM:
            try:
                check_text_only(body)
            except RequestError as error:
                raise HTTPException(status_code=error.status_code, detail=str(error)) from None
        template = processor.chat_template
        sources = template.values() if isinstance(template, dict) else [template]
        if body.get("tools") and not any("tools" in source for source in sources):
            raise HTTPException(
                status_code=400,
                detail="tools: this model's chat template does not render tools, so the model would never see them: "
                "leave them out, or give the model a chat template that renders `tools`",
            )
        named = [index for index, message in enumerate(body.get("messages") or []) if message.get("name")]  # (chat)
        if named and not self._renders_names(body, processor, modality):
            raise HTTPException(
                status_code=400,
                detail=f"messages[{named[0]}].name: this model's chat template does not render a message's name, so "
                "the model would never see it: leave it out, or give the model a chat template that renders "
                "`message.name`",
            )

    def _renders_names(
        self, body: dict, processor: ProcessorMixin | PreTrainedTokenizerBase, modality: Modality
    ) -> bool:
        """Whether the chat template renders the request's messages' names: told by rendering the prompt with
        and without them (the word `name` is in most templates, for tools, so reading the source cannot tell)."""

        def rendered(messages: list[dict]) -> str:
            return processor.apply_chat_template(
                self.get_processor_inputs_from_messages(messages, modality),
                tools=body.get("tools"),
                add_generation_prompt=True,
                tokenize=False,
                **{**self.chat_template_kwargs, **(body.get("chat_template_kwargs") or {})},
            )

        return rendered(body["messages"]) != rendered([{**message, "name": None} for message in body["messages"]])

    def _build_generation_config(self, body: dict, model_generation_config: GenerationConfig, use_cb: bool = False):
        if not use_cb:
            # the seed is applied as the request's generate() starts (`StateKeepingModel`), not here, when it
            # arrives: transformers' seeding here reseeds the generator other requests are drawing from; and the
            # penalties are the API's (`Penalties`), not transformers' repetition penalty of 1 + frequency_penalty
            body = {**body, "seed": None, "frequency_penalty": None}
        elif _penalties(body) is not None:  # (no generate() call to give them to)
            raise HTTPException(
                status_code=400,
                detail="frequency_penalty and presence_penalty are not supported with --continuous-batching",
            )
        try:
            config = super()._build_generation_config(body, model_generation_config, use_cb=use_cb)
            if body.get("logit_bias") and not config.sequence_bias:
                # transformers' completion handler accepts logit_bias and never applies it (its chat handler
                # does, as here): a bias on one token is a sequence_bias of one token
                config.sequence_bias = {(int(token),): bias for token, bias in body["logit_bias"].items()}
            if _asks_to_sample(body):  # as the OpenAI API means it (transformers leaves the model's default)
                config.do_sample = True
                if config.top_k is None:
                    # the API samples from the whole distribution (it has no top_k): left unset, generate() would
                    # keep only the 50 likeliest tokens (its library default), which no model or request asked for
                    config.top_k = 0
            config.validate()
        except (ValueError, TypeError) as error:  # from the request's own values (generation_config, ...)
            raise HTTPException(status_code=400, detail=f"invalid generation parameters: {error}") from None
        return config

    def _fit_context(self, inputs: dict, gen_config: GenerationConfig) -> None:
        """Refuse an empty prompt, or one that with its answer would pass `max_context`; without a
        `max_tokens`, cut the answer to what fits."""
        length = inputs["input_ids"].shape[-1]
        if length == 0:
            raise HTTPException(status_code=400, detail="the prompt is empty: it has no tokens to continue")
        if gen_config.max_new_tokens is None:
            _resolve_max_new_tokens(gen_config, length)
        limit = self.policy.max_context
        if limit is None:
            return
        if length >= limit:
            raise HTTPException(
                status_code=400,
                detail=f"the prompt has {length} tokens: this server's context limit is {limit} tokens (--max-context), "
                "prompt and answer together",
            )
        max_tokens_field = _current.get().max_tokens_field
        if max_tokens_field is None:
            gen_config.max_new_tokens = min(gen_config.max_new_tokens, limit - length)
        elif length + gen_config.max_new_tokens > limit:
            raise HTTPException(
                status_code=400,
                detail=f"the prompt ({length} tokens) and {max_tokens_field} ({gen_config.max_new_tokens}) pass this server's "
                f"context limit of {limit} tokens (--max-context): shorten the conversation or ask for fewer tokens",
            )

    # transformers' handlers differ in what they pass (the Responses API's passes the body too): the arguments are
    # read by name, from the signature of the method they are for

    def _streaming(self, *args, **kwargs):
        arguments = inspect.signature(super()._streaming).bind(*args, **kwargs).arguments
        self._fit_context(arguments["inputs"], arguments["gen_config"])
        response = super()._streaming(*args, **kwargs)
        request = _current.get()
        gen_config, model = arguments["gen_config"], arguments["model"]
        model_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        response.body_iterator = _finishing_stream(
            response.body_iterator,
            model,
            request.slot,
            request.stops,
            request.usage,
            _end_ids(gen_config, model_eos),
            gen_config.max_new_tokens,
        )
        return response

    async def _non_streaming(self, *args, **kwargs):
        arguments = inspect.signature(super()._non_streaming).bind(*args, **kwargs)
        self._fit_context(arguments.arguments["inputs"], arguments.arguments["gen_config"])
        try:
            body = await self._answers(arguments)
        except (ValueError, TypeError) as error:
            # generate() checks what the request asked for (its generation_config's values, ...) as it runs:
            # the request's fault, said as such (a stream reports it in its error event)
            raise HTTPException(status_code=400, detail=f"generate() refused this request: {error}") from None
        _report_cached_tokens(body.get("usage"), arguments.arguments["model"].cached_tokens)
        _cut_answers_at_stop(body.get("choices", []), _current.get().stops)
        return JSONResponse(body, media_type="application/json")

    async def _answers(self, arguments: inspect.BoundArguments) -> dict:
        """transformers' non-streamed response body, with the n answers when n > 1."""
        model, processor = arguments.arguments["model"], arguments.arguments["processor"]
        inputs, gen_config = arguments.arguments["inputs"], arguments.arguments["gen_config"]
        rows = None  # each row's answer tokens and whether it stopped (`_answer_rows`), once, when needed
        if model.answers == 1:
            body = json.loads((await super()._non_streaming(*arguments.args, **arguments.kwargs)).body)
        else:
            # one generate() for the n answers (through transformers' own manager and inference thread), then
            # each answer formatted by transformers' handler, as it formats one
            gen_manager = arguments.arguments["gen_manager"]
            if isinstance(gen_manager, CBGenerateManager):  # (a model other than a GPN, --continuous-batching)
                raise HTTPException(status_code=400, detail="n > 1 is not supported with --continuous-batching")
            request_id = arguments.arguments["request_id"]
            await gen_manager.generate_non_streaming(model, processor, inputs, gen_config, request_id=request_id)
            body = None
            rows = await _answer_rows_off_the_loop(model, inputs, gen_config, processor)
            for row, (input_len, ids, _) in enumerate(rows):
                arguments.arguments["gen_manager"] = _Answer((input_len, ids), processor)
                answer = json.loads((await super()._non_streaming(*arguments.args, **arguments.kwargs)).body)
                if body is None:
                    body = answer
                    continue
                answer["choices"][0]["index"] = row
                body["choices"].extend(answer["choices"])
                for name in ("completion_tokens", "total_tokens"):
                    body["usage"][name] += answer["usage"]["completion_tokens"]
        if body.get("object") == "response" and body.get("status") == "completed" and model.sequences is not None:
            _, ids, stopped = (await _answer_rows_off_the_loop(model, inputs, gen_config, processor))[0]
            if not stopped and len(ids) >= (gen_config.max_new_tokens or float("inf")):
                _mark_incomplete(body)
        choices = body.get("choices", [])
        at_length = [row for row, choice in enumerate(choices) if choice.get("finish_reason") == "length"]
        if at_length and model.sequences is not None:  # (None: continuous batching ran it, without generate())
            if rows is None:
                rows = await _answer_rows_off_the_loop(model, inputs, gen_config, processor)
            for row in at_length:
                if rows[row][2]:
                    # it ended on EOS or a stop string at its last allowed token: it stopped. (transformers says
                    # "length" for any answer max_tokens long; here the row's end is known.)
                    choices[row]["finish_reason"] = "stop"
        return body


def _penalties(body: dict) -> Penalties | None:
    """The request's `frequency_penalty` and `presence_penalty` (`Penalties`), or None when both are 0 or absent."""
    frequency, presence = body.get("frequency_penalty") or 0.0, body.get("presence_penalty") or 0.0
    return Penalties(float(frequency), float(presence)) if frequency or presence else None


def _mark_incomplete(response: dict) -> None:
    """A Responses API response cut at its `max_output_tokens`, as the API marks it (transformers says
    "completed" for every answer, so a client cannot tell a cut answer from a finished one)."""
    response["status"] = "incomplete"
    response["incomplete_details"] = {"reason": "max_output_tokens"}


def _asks_to_sample(body: dict) -> bool:
    """A temperature above 0, or a top_p below 1, means sampling in the OpenAI API. transformers serve sets only
    the value, so a model whose generation config does not sample (a GPN's, by default) would answer greedily.
    A temperature of 0 is greedy whatever top_p says, as in transformers serve (it sets do_sample=False)."""
    temperature, top_p = body.get("temperature"), body.get("top_p")
    if temperature is not None and temperature == 0:
        return False
    return (temperature is not None and temperature > 0) or (top_p is not None and top_p < 1)


def _resolve_max_new_tokens(gen_config: GenerationConfig, length: int) -> None:
    """Set `max_new_tokens` to what `generate()` would make without it (a request's `generation_config` without
    max_new_tokens, and no max_tokens): up to its `max_length`, prompt included, or 20 new tokens when it has
    none, as plain transformers serve answers. Set, the context limit can bound it and transformers' handlers
    can tell an answer cut at its length from one that stopped."""
    if gen_config.max_length is None:
        gen_config.max_new_tokens = GenerationConfig._get_default_generation_params()["max_length"]
        return
    if gen_config.max_length <= length:
        raise HTTPException(
            status_code=400,
            detail=f"generation_config's max_length ({gen_config.max_length}) leaves no room for an answer after the "
            f"prompt's {length} tokens: raise it, or give max_new_tokens or max_tokens",
        )
    gen_config.max_new_tokens, gen_config.max_length = gen_config.max_length - length, None


class StateKeepingChatCompletionHandler(StateKeeping, ChatCompletionHandler):
    """transformers' `/v1/chat/completions` handler, through the state store."""

    check_request = staticmethod(check_chat_request)

    @staticmethod
    def get_processor_inputs_from_messages(messages: list[dict], modality: Modality) -> list[dict]:
        """transformers' messages for the chat template, each with its `name` (the OpenAI API's author of a
        message, which transformers leaves out): a template that renders `message.name` gets it, and one that
        does not is refused a request with names (`_check_renderable`)."""
        inputs = ChatCompletionHandler.get_processor_inputs_from_messages(messages, modality)
        for message, parsed in zip(messages, inputs, strict=True):
            if message.get("name"):
                parsed["name"] = message["name"]
        return inputs


class StateKeepingCompletionHandler(StateKeeping, CompletionHandler):
    """transformers' `/v1/completions` handler, through the state store."""

    check_request = staticmethod(check_completion_request)
    renders_chat = False  # raw text: no chat template needed

    def _tokenize_ahead(self, body: dict, processor: PreparedProcessor, modality: Modality, use_cb: bool) -> None:
        """The prompt's tokenization, prepared as transformers 5.24's completion handler makes it: by the processor
        when it is the tokenizer (a processor's tokenizer, a multimodal model's, tokenizes on the loop, as before)."""
        prompt = body.get("prompt", "")
        if isinstance(prompt, str) and getattr(processor, "tokenizer", processor) is processor:
            processor.prepare("__call__", prompt, return_tensors=None if use_cb else "pt")


class StateKeepingResponseHandler(StateKeeping, ResponseHandler):
    """transformers' `/v1/responses` handler, through the state store, with the same checks and limits."""

    check_request = staticmethod(check_response_request)
    takes_n = False
    max_tokens_fields = ("max_output_tokens",)

    def _messages_and_tools(self, body: dict) -> tuple[list[dict], list[dict] | None]:
        """The Responses API's input as messages and its tools as the chat template takes them (transformers')."""
        return self._normalize_input(body), self._normalize_tools(body.get("tools"))

    @staticmethod
    def _normalize_input(body: dict) -> list[dict]:
        """The input as messages, as transformers makes them, `instructions` a system message of their own before
        them, as the API inserts them: transformers' handler writes them over the content of the first message it
        makes when that is a system message (the input's first item, or one after items that make no message, such
        as reasoning), which the model then never sees. An input of items that begins with one without a role (a
        reasoning item) is read as items; transformers takes it for one message's content parts, dropping them."""
        items = body["input"]
        if isinstance(items, list) and not all(is_content_part(item) for item in items):
            messages = ResponseHandler._normalize_response_items(items)
        else:
            messages = ResponseHandler._normalize_input({**body, "instructions": None})
        if body.get("instructions"):
            messages.insert(0, {"role": "system", "content": body["instructions"]})
        return messages

    async def handle_request(self, body: dict, request_id: str) -> StreamingResponse | JSONResponse:
        """Answer /v1/responses: one JSON answer unless a stream is asked for."""
        if body.get("stream") is None:
            # the API answers with one JSON response unless asked to stream; transformers' handler streams by
            # default, which the `openai` client, not having asked for a stream, cannot read (it returns the raw text)
            body = {**body, "stream": False}
        return await super().handle_request(body, request_id)


class AdmittedSystemOneHandler(SystemOneHandler):
    """transformers' `/v1/systemone` handler (typed decisions: the model's forward, no text generated), taking a
    slot of the admission limit as the other endpoints do: its requests wait for the same inference thread, and
    transformers let any number of them in, past `--max-queued-requests`."""

    def __init__(self, *args, policy: ServingPolicy, **kwargs):
        super().__init__(*args, **kwargs)
        self.policy = policy

    async def handle_request(self, body: dict, request_id: str) -> JSONResponse:
        """Answer the request once admitted (HTTP 429 when the server is full)."""
        slot = self.policy.admission.admit()
        try:
            return await super().handle_request(body, request_id)  # (one JSON answer: over when it returns)
        finally:
            slot.release()


class CheckedTranscriptionHandler(TranscriptionHandler):
    """transformers' `/v1/audio/transcriptions` handler (a speech model's), answering a 501 that says so where
    python-multipart, which reads its form, is not installed (the serving extra does not bring it): transformers
    raised an ImportError, a bare "Internal Server Error" with a traceback in the log."""

    async def handle_request(self, request: Request) -> JSONResponse | StreamingResponse:
        """Answer /v1/audio/transcriptions, or HTTP 501 without python-multipart."""
        if not is_multipart_available():
            raise HTTPException(
                status_code=501,
                detail="/v1/audio/transcriptions is not available on this server: it reads its form with "
                "python-multipart, which is not installed (pip install python-multipart; it serves speech models)",
            )
        return await super().handle_request(request)


class _Answer:
    """Stands in for transformers' generation manager when its handler formats one of the n answers
    (already generated): returns what `GenerateManager.generate_non_streaming` returns for it."""

    def __init__(self, prompt_and_ids: tuple[int, torch.Tensor], processor: ProcessorMixin | PreTrainedTokenizerBase):
        self.input_len, self.ids = prompt_and_ids
        self.processor = processor

    async def generate_non_streaming(
        self,
        model: PreTrainedModel,
        processor: ProcessorMixin | PreTrainedTokenizerBase,
        inputs: dict,
        gen_config: GenerationConfig,
        request_id: str,
    ):
        return self.processor.decode(self.ids, skip_special_tokens=True), self.input_len, self.ids


async def _answer_rows_off_the_loop(
    model: StateKeepingModel,
    inputs: dict,
    gen_config: GenerationConfig,
    processor: ProcessorMixin | PreTrainedTokenizerBase,
) -> list[tuple[int, torch.Tensor, bool]]:
    """`_answer_rows` of the answers `model` generated, in a worker thread: with a `stop` sequence each answer is
    decoded token by token (benchmarks/RESULTS.md, "gpn serve: an answer's text, decoded"), which on the event loop
    would hold every other request."""
    eos_token_id = model.generation_config.eos_token_id
    return await asyncio.to_thread(_answer_rows, model.sequences, inputs, gen_config, processor, eos_token_id)


def _answer_rows(
    sequences: torch.Tensor,
    inputs: dict,
    gen_config: GenerationConfig,
    processor: ProcessorMixin | PreTrainedTokenizerBase,
    eos_token_id: int | list[int] | None = None,
) -> list[tuple[int, torch.Tensor, bool]]:
    """Per row of `sequences`: (prompt length, the row's generated tokens up to where it finished, whether it
    finished by itself).

    A row that finished before the longest one is padded after its end with the pad token, which is the EOS
    token when the configuration has no pad: so the row's end is found the way generate() found it, at the
    first EOS (kept, as generate() keeps it) or the token with which the answer's text first holds a stop string
    (the same check, `stop_strings.stop_position`, as `StopInAnswer`'s), never by looking for padding. A row that did
    neither ran to its length. `eos_token_id` is the model's, for a generation config (a request's own) that
    names none."""
    input_len = inputs["input_ids"].shape[-1]
    ends = _end_ids(gen_config, eos_token_id)
    stops = stop_sequences({"stop": gen_config.stop_strings})
    tokenizer = getattr(processor, "tokenizer", processor)
    rows = []
    for row in range(sequences.shape[0]):
        ids = sequences[row, input_len:]
        tokens = ids.tolist()
        at_end = next((position for position, token in enumerate(tokens) if token in ends), None)
        # (only the tokens before its end: the padding after an EOS is no part of the answer's text)
        at_stop = stop_position(tokenizer, tokens[:at_end], stops) if stops else None
        end = min((position for position in (at_end, at_stop) if position is not None), default=None)
        rows.append((input_len, ids, False) if end is None else (input_len, ids[: end + 1], True))
    return rows


def _end_ids(gen_config: GenerationConfig, eos_token_id: int | list[int] | None) -> set[int]:
    """The ids that end an answer: the generation config's `eos_token_id` (one id, a list), or, where it names
    none (a request's own config), the model's `eos_token_id`."""
    ids = gen_config.eos_token_id if gen_config.eos_token_id is not None else eos_token_id
    return set(ids if isinstance(ids, list) else [] if ids is None else [ids])


def _ended_on(model: StateKeepingModel, total_tokens: int, ends: set[int]) -> bool:
    """Whether a streamed answer's last token (at `total_tokens` - 1, prompt included) is one of `ends`."""
    return total_tokens > 0 and model.token_at(total_tokens - 1) in ends


def _cut_answers_at_stop(choices: list[dict], stops: list[str]) -> None:
    """Each answer's text up to its first stop sequence, as the OpenAI API returns it (`stop_strings`)."""
    for choice in choices if stops else []:
        holder, key = _text_of(choice)
        if isinstance(holder.get(key), str):
            holder[key], stopped = cut_at_stop(holder[key], stops)
            if stopped:
                choice["finish_reason"] = "stop"


def _text_of(choice: dict) -> tuple[dict, str]:
    """Where a choice holds its text: a chat message's or chunk delta's `content`, a completion's `text`."""
    for holder in ("message", "delta"):
        if isinstance(choice.get(holder), dict):
            return choice[holder], "content"
    return choice, "text"


def _report_cached_tokens(usage: dict | None, cached_tokens: int) -> None:
    """The OpenAI API's field for prompt caching: `input_tokens_details` in the Responses API's usage,
    `prompt_tokens_details` in the others'."""
    if usage is not None:
        details = "input_tokens_details" if "input_tokens" in usage else "prompt_tokens_details"
        usage.setdefault(details, {})["cached_tokens"] = cached_tokens


def _cut_chunk_at_stop(data: dict, cutter: StreamCutter) -> bool:
    """Cut one streamed chunk's text before the stop sequence (holding back what may begin one; the last chunk,
    with the finish reason, gets what was held). Returns whether the chunk is still worth sending."""
    choices = data.get("choices") or []
    if not choices:
        return True
    choice = choices[0]
    holder, key = _text_of(choice)
    text = holder.get(key)
    if choice.get("finish_reason") is not None:
        rest = cutter.feed(text or "") + cutter.flush()
        if rest or text is not None:
            holder[key] = rest
        if cutter.stopped:
            choice["finish_reason"] = "stop"
        return True
    if not text:
        return True
    holder[key] = cutter.feed(text)
    return bool(holder[key])


async def _finishing_stream(
    chunks: AsyncGenerator[str, None],
    model: StateKeepingModel,
    slot: Slot,
    stops: list[str],
    usage: bool = True,
    ends: set[int] | frozenset = frozenset(),
    max_new_tokens: int | None = None,
):
    """transformers' SSE stream, its last chunk (the one with `usage`) given `cached_tokens`, or its usage left
    out when not `usage` (`include_usage: false`), its finish reason "stop" when the answer ended on one of `ends`
    (EOS) at its `max_tokens`-th token (transformers says "length"), a Responses API answer cut at its
    `max_new_tokens` ending in "response.incomplete" (`_mark_incomplete`; transformers: "response.completed"), the
    text cut before the first `stop` sequence (`stop_strings`; the text itself is the answer's, `streaming`), an
    error event in the OpenAI API's shape; the request's slot is freed when the stream ends, finished or cut off by
    the client (or when its generate() ends, if sooner: with continuous batching there is no generate() call to
    end)."""
    cutter = StreamCutter(stops) if stops else None
    try:
        async for chunk in chunks:
            if '"usage"' in chunk or '"error"' in chunk or cutter is not None:
                events = []
                for event in chunk.split("\n\n"):
                    error = as_openai_stream_error(event)
                    if error is not None:  # (its JSON may be broken: written anew, not read)
                        event = error
                    elif event.startswith("data: {"):
                        data = json.loads(event.removeprefix("data: "))
                        if cutter is not None and not _cut_chunk_at_stop(data, cutter):
                            continue  # its text is held back (or past the stop sequence): nothing to send yet
                        last, counts = (data.get("choices") or [{}])[0], data.get("usage") or {}
                        if last.get("finish_reason") == "length" and _ended_on(
                            model, counts.get("total_tokens", 0), ends
                        ):
                            last["finish_reason"] = "stop"  # it ended on EOS, at its last allowed token
                        whole = data.get("response") if data.get("type") == "response.completed" else None
                        if whole is not None and max_new_tokens:  # (the Responses API takes no `stop`)
                            counts = whole.get("usage") or {}
                            made, total = counts.get("output_tokens", 0), counts.get("total_tokens", 0)
                            if made >= max_new_tokens and not _ended_on(model, total, ends):
                                data["type"] = "response.incomplete"
                                _mark_incomplete(whole)
                        if not usage:
                            data.pop("usage", None)
                        # (the Responses API's last event carries the response, and its usage, whole)
                        counts = data.get("usage") or (data.get("response") or {}).get("usage")
                        _report_cached_tokens(counts, model.cached_tokens)
                        event = "data: " + json.dumps(data, separators=(",", ":"))
                    events.append(event)
                chunk = "\n\n".join(events)
            if chunk:
                yield chunk
    finally:
        slot.release()
        await chunks.aclose()
