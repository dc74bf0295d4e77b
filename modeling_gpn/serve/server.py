"""`GPNServe`: transformers' `Serve` (its FastAPI app, endpoints, options, model manager and uvicorn server),
built with the pieces `gpn serve` changes.

`Serve.__init__` composes the server from transformers' serving modules, importing each piece from its module
as it builds it. `GPNServe` runs that same `__init__` with some of those names pointing at `gpn serve`'s
own while it builds: the chat, completion and Responses API handlers (`handlers.py`), the `/v1/systemone` handler
(admitted as they are), the `/v1/audio/transcriptions` one (a 501 without python-multipart), and `build_server`,
whose app is given one step more at shutdown (the kept states written to `--state-dir`) and a middleware that
tells the handlers when a request's client goes away, and the model manager (`GPNModelManager`: a PEFT adapter
folder loaded merged into its base), and uvicorn's `Config` (log colours only on a terminal, never under NO_COLOR); and it makes the model manager able to build a GPN (`models.py`). Nothing of the server is copied. Everything else, every option included, is
transformers' own.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import uvicorn
from transformers.cli.serve import Serve
from transformers.cli.serving import chat_completion, completion, model_manager, response, systemone, transcription
from transformers.cli.serving import server as serving_server

if TYPE_CHECKING:
    import types

    from starlette.types import ASGIApp

from ..cli.quantization import QUANTIZERS
from ..cli.terminal import colours_wanted
from . import (
    DEFAULT_MAX_CONTEXT,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_STATE_DIR_BYTES,
    DEFAULT_STATE_STORE_BYTES,
)
from .errors import add_openai_error_handlers
from .handlers import (
    Admission,
    AdmittedSystemOneHandler,
    CheckedTranscriptionHandler,
    LimitedBodies,
    ServingPolicy,
    StateKeepingChatCompletionHandler,
    StateKeepingCompletionHandler,
    StateKeepingResponseHandler,
    WatchingClients,
)
from .models import (
    load_only_the_pinned_model,
    make_gpn_loadable,
    quantizing_model_manager,
    refuse_two_quantizations,
)
from .state_store import StateStore


@contextlib.contextmanager
def _pointing(module: types.ModuleType, name: str, value: object) -> Iterator[None]:
    """`module.name` is `value` inside the block, and what it was after."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _with_policy(handler: type, policy: ServingPolicy) -> type:
    """`handler` built with `policy`, as a class: the names are pointed at it while the server runs (`Serve.__init__`
    runs the server), and transformers' handlers call their own static methods through their module's name
    (`ResponseHandler._normalize_response_items`), so what the name holds must still be the handler class."""

    class WithPolicy(handler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, policy=policy, **kwargs)

    WithPolicy.__name__ = WithPolicy.__qualname__ = handler.__name__
    return WithPolicy


def _with_shutdown_step(
    build_server: Callable, on_shutdown: Callable[[], None], max_request_bytes: int | None
) -> Callable:
    """transformers' `build_server`, `on_shutdown` run when its app stops gracefully (uvicorn runs the lifespan's
    end on Ctrl-C and SIGTERM, after the last connection closed), before transformers' own end; the app tells
    the handlers when a request's client goes away (`WatchingClients`), refuses a body over `max_request_bytes`
    (`LimitedBodies`, outermost), answers errors in the OpenAI API's shape (`errors`), and, pinned, loads no other
    model (`load_only_the_pinned_model`)."""

    @functools.wraps(build_server)
    def build(*args, **kwargs):
        load_only_the_pinned_model(kwargs["model_manager"] if "model_manager" in kwargs else args[0])
        app = build_server(*args, **kwargs)
        app.add_middleware(WatchingClients)
        if max_request_bytes is not None:
            app.add_middleware(LimitedBodies, max_bytes=max_request_bytes)
        add_openai_error_handlers(app)
        serve_lifespan = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(app: ASGIApp):
            async with serve_lifespan(app) as state:
                try:
                    yield state
                finally:  # before transformers' own end, which unloads the models the states need to be saved
                    on_shutdown()

        app.router.lifespan_context = lifespan
        return app

    return build


def _coloured_as_the_terminal(config_class: type) -> type:
    """uvicorn's `Config`, whose log lines are coloured only where `colours_wanted()` says so (transformers builds
    it without `use_colors`, and uvicorn then asked only whether standard output is a terminal)."""

    class Config(config_class):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("use_colors", colours_wanted())
            super().__init__(*args, **kwargs)

    Config.__name__ = Config.__qualname__ = config_class.__name__
    return Config


class GPNServe(Serve):
    """`transformers serve`, serving GPNs, conversations kept as states (every `Serve` option is accepted).

    Args:
        force_model: as `Serve`'s: the model to preload and serve for every request.
        state_store_bytes: the most the kept states may take in memory; 0 turns the state store off.
        state_dir: a folder for state files: the states evicted from memory, and every kept state when the server
            stops gracefully (Ctrl-C, SIGTERM); found again after a restart.
        state_dir_bytes: the most the state files in `state_dir` may take (those of every server on it together).
        max_context: the most tokens a request's prompt and answer may take together (None: no limit).
        max_queued_requests: the most requests taken on at once, running or waiting (None: no limit).
        max_request_bytes: the largest request body taken, a 413 beyond (None: no limit).
        **serve_options: `Serve`'s options (`host`, `port`, `device`, `dtype`, ...); `dtype` may be "int8" or
            "int4" too: each model is loaded as saved and quantized as `gpn generate --dtype int8 | int4` quantizes
            it (`cli.quantization.quantize_for`: torchao's weight-only quantization of the bfloat16 model, a folder
            saved so served as saved, another quantization refused).
    """

    def __init__(
        self,
        force_model: str | None = None,
        *,
        state_store_bytes: int = DEFAULT_STATE_STORE_BYTES,
        state_dir: str | os.PathLike | None = None,
        state_dir_bytes: int | None = DEFAULT_STATE_DIR_BYTES,
        max_context: int | None = DEFAULT_MAX_CONTEXT,
        max_queued_requests: int | None = DEFAULT_MAX_QUEUED_REQUESTS,
        max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
        **serve_options,
    ) -> None:
        limits = {
            "max_context": max_context,
            "max_queued_requests": max_queued_requests,
            "max_request_bytes": max_request_bytes,
        }
        for name, value in limits.items():
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 (or None for no limit), got {value}")
        store = None
        if state_store_bytes > 0 or state_dir is not None:
            store = StateStore(state_store_bytes, spill_dir=state_dir, spill_max_bytes=state_dir_bytes)
        self.policy = ServingPolicy(store=store, max_context=max_context, admission=Admission(max_queued_requests))
        make_gpn_loadable()
        quantize_to = None
        if serve_options.get("dtype") in QUANTIZERS:  # (transformers takes torch.int8 for a float dtype, and fails)
            quantize_to, serve_options["dtype"] = serve_options["dtype"], "auto"
            # (`gpn serve` refuses it with its arguments, exit 2, before the state store opens its folder; this is
            # GPNServe's own check, made from Python)
            refuse_two_quantizations(quantize_to, serve_options.get("quantization"))
        chat = _with_policy(StateKeepingChatCompletionHandler, self.policy)
        legacy = _with_policy(StateKeepingCompletionHandler, self.policy)
        responses = _with_policy(StateKeepingResponseHandler, self.policy)
        decisions = _with_policy(AdmittedSystemOneHandler, self.policy)
        # a server that stops (Ctrl-C, SIGTERM) writes the states it keeps in memory to --state-dir, so one
        # restarted on the folder continues the conversations (a killed one, kill -9, loses them)
        on_shutdown = store.spill_all if store is not None else lambda: None
        with (
            _pointing(chat_completion, "ChatCompletionHandler", chat),
            _pointing(completion, "CompletionHandler", legacy),
            _pointing(response, "ResponseHandler", responses),
            _pointing(systemone, "SystemOneHandler", decisions),
            _pointing(transcription, "TranscriptionHandler", CheckedTranscriptionHandler),
            # (PEFT adapter folders loaded, merged; quantized for --dtype int8 | int4)
            # (and each GPN loaded refused where one of its states is larger than --state-dir-bytes: exact only
            # once loaded, for a quantization its config does not name)
            _pointing(
                model_manager,
                "ModelManager",
                quantizing_model_manager(
                    quantize_to, store.refuse_a_model_over_the_folder_bound if store is not None else None
                ),
            ),
            _pointing(uvicorn, "Config", _coloured_as_the_terminal(uvicorn.Config)),  # (NO_COLOR, logs to a file)
            _pointing(
                serving_server,
                "build_server",
                _with_shutdown_step(serving_server.build_server, on_shutdown, max_request_bytes),
            ),
        ):
            super().__init__(force_model, **serve_options)
