"""A request's prompt rendered and tokenized in a worker thread, before transformers' handler asks for it.

transformers' handlers render the chat template and tokenize the prompt in `handle_request`, on the server's event
loop, and only then can `--max-context` refuse it: while a large prompt is tokenized (seconds for a few MB of text:
benchmarks/RESULTS.md), no other request is read or answered, and every stream stops. The handler is transformers'
and its call is synchronous, so it cannot be moved; what reaches it is the processor our `_resolve_model` hands
back. `gpn serve` hands back a `PreparedProcessor`: the handler's seam (`StateKeeping._prepare`, in a worker thread)
makes the same call the handler will make, with the same arguments, and when the handler makes it on the loop the
result is there. A call made with other arguments than the prepared one (a transformers version that builds them
otherwise) is made on the loop, as before: the answer is always the processor's for the arguments given.
"""

from __future__ import annotations

from typing import Any


class PreparedProcessor:
    """The model's processor (or tokenizer) as transformers' handler sees it for one request: every attribute is
    the processor's, and `apply_chat_template` and calling it return what `prepare` computed ahead for the same
    arguments (once), or compute it then.

    Args:
        processor: the processor the model manager loaded (shared by every request for the model).
    """

    def __init__(self, processor: Any):
        self._processor = processor
        # (made in the worker thread, read on the loop once the thread is done: never at once)
        self._prepared: list[tuple[str, tuple, dict, Any]] = []

    @property
    def __class__(self):
        """The processor's: transformers tells a tokenizer from a multimodal processor by its class."""
        return type(self._processor)

    def __getattr__(self, name: str):
        return getattr(self._processor, name)

    def prepare(self, method: str, *args, **kwargs) -> None:
        """Make the processor's call `method(*args, **kwargs)` now (in a worker thread), for the handler's same call."""
        self._prepared.append((method, args, kwargs, getattr(self._processor, method)(*args, **kwargs)))

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
        return getattr(self._processor, method)(*args, **kwargs)


def _same(prepared: Any, given: Any) -> bool:
    """Whether the arguments are equal; where comparing them fails or is ambiguous (an array among them), they are
    taken as different, and the handler's call is made anew."""
    try:
        return bool(prepared == given)
    except Exception:  # noqa: BLE001 - a value whose == fails or is ambiguous (an array): not the prepared call
        return False
