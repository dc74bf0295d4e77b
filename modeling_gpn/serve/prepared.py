"""A request's prompt rendered and tokenized in a worker thread, before transformers' handler asks for it.

transformers' handlers render the chat template and tokenize the prompt in `handle_request`, on the server's event
loop, and only then can `--max-context` refuse it: while a large prompt is tokenized (seconds for a few MB of text:
benchmarks/RESULTS.md), no other request is read or answered, and every stream stops. The handler is transformers'
and its call is synchronous, so it cannot be moved; what reaches it is the processor our `_resolve_model` hands
back. `gpn serve` hands back a `PreparedProcessor` (`prepared_processor`): the handler's seam (`StateKeeping._prepare`, in a worker thread)
makes the same call the handler will make, with the same arguments, and when the handler makes it on the loop the
result is there. A call made with other arguments than the prepared one (a transformers version that builds them
otherwise) is made on the loop, as before: the answer is always the processor's for the arguments given.
"""

from __future__ import annotations

import types
from typing import Any

_SUBCLASSES: dict[type, type] = {}  # a processor's class -> its PreparedProcessor subclass (made once)


def prepared_processor(processor: Any) -> PreparedProcessor:
    """`processor` for one request, as an instance of a subclass of its own class (`PreparedProcessor` and the
    processor's class): transformers tells a tokenizer from a multimodal processor with `isinstance`
    (`ModelManager.get_model_modality`), so what the handler gets must be one. It holds the processor's
    attributes (the same objects: its Rust tokenizer, its template), the processor itself is left as it is.

    Args:
        processor: the processor the model manager loaded (shared by every request for the model).
    """
    kind = type(processor)
    subclass = _SUBCLASSES.get(kind)
    if subclass is None:
        subclass = _SUBCLASSES[kind] = types.new_class(f"Prepared{kind.__name__}", (PreparedProcessor, kind))
    prepared = object.__new__(subclass)
    prepared.__dict__.update(vars(processor))
    # (made in the worker thread, read on the loop once the thread is done: never at once)
    prepared._prepared = []
    return prepared


class PreparedProcessor:
    """A processor (or tokenizer) as transformers' handler sees it for one request (`prepared_processor` makes one,
    a subclass of the processor's class too): `apply_chat_template` and calling it return what `prepare` computed
    ahead for the same arguments (once), or compute it then, as the processor's class does."""

    _prepared: list[tuple[str, tuple, dict, Any]]

    def prepare(self, method: str, *args, **kwargs) -> None:
        """Make the processor's call `method(*args, **kwargs)` now (in a worker thread), for the handler's same call."""
        self._prepared.append((method, args, kwargs, getattr(super(), method)(*args, **kwargs)))

    def apply_chat_template(self, *args, **kwargs) -> Any:
        """The processor's `apply_chat_template`, prepared ahead when these are the prepared arguments."""
        return self._prepared_or_made("apply_chat_template", args, kwargs)

    def __call__(self, *args, **kwargs) -> Any:
        """The tokenizer's call, prepared ahead when these are the prepared arguments."""
        return self._prepared_or_made("__call__", args, kwargs)

    def _prepared_or_made(self, method: str, args: tuple, kwargs: dict) -> Any:
        for index, (name, prepared_args, prepared_kwargs, result) in enumerate(self._prepared):
            if name == method and _same(prepared_args, args) and _same(prepared_kwargs, kwargs):
                del self._prepared[index]  # (a result is handed out once: the handler changes it in place)
                return result
        return getattr(super(), method)(*args, **kwargs)


def _same(prepared: Any, given: Any) -> bool:
    """Whether the arguments are equal; where comparing them fails or is ambiguous (an array among them), they are
    taken as different, and the handler's call is made anew."""
    try:
        return bool(prepared == given)
    except Exception:  # noqa: BLE001 - a value whose == fails or is ambiguous (an array): not the prepared call
        return False
