"""Checks of OpenAI request bodies before transformers' handlers read them.

transformers' handlers convert fields as they use them (`int(body["max_tokens"])`, `float(body["temperature"])`),
so a wrong type or an impossible value fails deep inside, as a 500 ("Internal Server Error"), or worse, runs:
`max_tokens=-1` is a 500, `"n": 3` is ignored. Here every field `gpn serve` reads is checked against what the
OpenAI API documents (and what `generate()` can do), and a problem is a `RequestError` naming the field, which
the handlers turn into a 400.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

MAX_ANSWERS = 128  # the OpenAI API's bound on `n`
MAX_STOP_STRINGS = 4
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PARTS = ("text", "input_text", "output_text")  # the content parts a text-only model reads
# the Responses API input items other than content parts (transformers' `_normalize_response_items` reads them)
RESPONSE_ITEM_TYPES = ("message", "reasoning", "function_call", "function_call_output")
# what transformers' handler passes to apply_chat_template itself: a request setting one would collide with it
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
        "load_audio_from_video",
    }
)


def _is_default(default: Any) -> Callable[[Any], bool]:
    return lambda value: value == default


def _text_format(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type", "text") == "text"


def _plain_text(value: Any) -> bool:
    """A Responses API `text`: a text format, and the default verbosity (or none): what the model answers anyway."""
    if not isinstance(value, dict):
        return False
    return _text_format(value.get("format", {})) and value.get("verbosity") in (None, "medium")


def _no_reasoning(value: Any) -> bool:
    """A Responses API `reasoning` that asks for nothing (every field null): a GPN does not reason apart."""
    return isinstance(value, dict) and all(field is None for field in value.values())


# Fields of the OpenAI API that transformers serve accepts and then ignores (it only logs them, which an OpenAI
# client never sees). A value that would change the answer or what the response holds is refused, naming the
# field; the field's default (what the API does without it), or a value that changes nothing here, is accepted.
# Fields that change nothing in the answer (user, metadata, store, service_tier, stream_options, prediction,
# parallel_tool_calls, safety_identifier, prompt_cache_key, ...) are accepted as transformers accepts them.
NOT_SUPPORTED: dict[str, dict[str, tuple[str, Callable[[Any], bool]]]] = {  # endpoint: {field: (accepted, test)}
    "chat": {
        "logprobs": ("false", lambda value: value is False),
        "top_logprobs": ("0", _is_default(0)),
        "response_format": ('{"type": "text"}', _text_format),
        "modalities": ('["text"]', _is_default(["text"])),
        "audio": ("null", lambda value: False),
        "functions": ("null (give tools)", lambda value: False),
        "function_call": ("null (give tools)", lambda value: False),
        "tool_choice": ('"auto"', _is_default("auto")),
        "reasoning_effort": ("null", lambda value: False),
        "web_search_options": ("null", lambda value: False),
        "verbosity": ('"medium"', _is_default("medium")),  # (the API's default: how long the answer is asked to be)
        "moderation": ("null", lambda value: False),  # (nothing here moderates an answer)
    },
    "completion": {
        "logprobs": ("0", _is_default(0)),
        "echo": ("false", lambda value: value is False),
        "best_of": ("1", _is_default(1)),
        # transformers appends it to the answer's text; the API means text the answer is inserted before
        "suffix": ('""', _is_default("")),
    },
    "response": {
        "previous_response_id": ("null (send the conversation in input)", lambda value: False),
        # (a stored conversation's items would come before the input: nothing is stored here, so they never would)
        "conversation": ("null (send the conversation in input)", lambda value: False),
        "prompt": ("null", lambda value: False),
        "background": ("false", lambda value: value is False),
        "include": ("[]", _is_default([])),
        "text": ('{"format": {"type": "text"}} (and verbosity "medium")', _plain_text),
        "reasoning": ("null", _no_reasoning),
        "context_management": ("[]", _is_default([])),
        "moderation": ("null", lambda value: False),
        "top_logprobs": ("0", _is_default(0)),
        "tool_choice": ('"auto"', _is_default("auto")),
        "truncation": ('"disabled"', _is_default("disabled")),
        "max_tool_calls": ("null", lambda value: False),
    },
}


class RequestError(ValueError):
    """A request the server will not run; the message names the field and what it must be."""

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.status_code = status_code


def check_chat_request(body: dict[str, Any]) -> None:
    """Refuse a `/v1/chat/completions` body with a field of the wrong type or out of range."""
    _check_common(body)
    _check_supported(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with a role and a content")
        if message.get("role") not in CHAT_ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {message.get('role')!r}")
        content = message.get("content")
        if content is None:
            if message["role"] != "assistant" or not message.get("tool_calls"):
                raise RequestError(
                    f"{where}.content is missing (only an assistant message with tool_calls may omit it)"
                )
        elif isinstance(content, list):
            for part_index, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise RequestError(f"{where}.content[{part_index}] must be an object with a type")
                if part["type"] in ("text", "input_text", "output_text") and not isinstance(part.get("text"), str):
                    raise RequestError(f"{where}.content[{part_index}].text must be a string")
        elif not isinstance(content, str):
            raise RequestError(
                f"{where}.content must be a string or a list of content parts, got {type(content).__name__}"
            )
        if message.get("name") is not None and not isinstance(message["name"], str):
            raise RequestError(f"{where}.name must be a string, got {type(message['name']).__name__}")
        _check_tool_calls(message.get("tool_calls"), where)
    _check_positive_int(body, "max_completion_tokens")
    _check_type(body, "tools", list)
    if not all(isinstance(tool, dict) for tool in body.get("tools") or []):
        raise RequestError("tools must be a list of objects")
    _check_type(body, "chat_template_kwargs", dict)
    reserved = sorted(set(body.get("chat_template_kwargs") or {}) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise RequestError(f"chat_template_kwargs cannot set {', '.join(reserved)}: the server sets them")


def _check_tool_calls(tool_calls: Any, where: str) -> None:
    """An assistant message's tool calls, as transformers reads them: objects with a function name and JSON arguments."""
    if tool_calls is None:
        return
    if not isinstance(tool_calls, list):
        raise RequestError(f"{where}.tool_calls must be a list")
    for index, call in enumerate(tool_calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(arguments, str | dict)
        ):
            raise RequestError(f"{where}.tool_calls[{index}] must be an object with a function: {{name, arguments}}")
        if isinstance(arguments, str):
            try:
                json.loads(arguments)
            except ValueError as error:
                raise RequestError(f"{where}.tool_calls[{index}].function.arguments must be JSON: {error}") from error


def check_completion_request(body: dict[str, Any]) -> None:
    """Refuse a `/v1/completions` body with a field of the wrong type or out of range."""
    _check_common(body)
    _check_supported(body, "completion")
    if not isinstance(body.get("prompt"), str):
        raise RequestError("prompt must be a string (lists of prompts and token ids are not supported)")
    _check_type(body, "suffix", str)
    _check_type(body, "echo", bool)


def check_response_request(body: dict[str, Any]) -> None:
    """Refuse a `/v1/responses` body with a field of the wrong type or out of range."""
    _check_common(body)
    _check_supported(body, "response")
    _check_positive_int(body, "max_output_tokens")
    _check_type(body, "instructions", str)
    items = body.get("input")
    if not isinstance(items, str | list) or not items:
        raise RequestError("input must be a non-empty string or a non-empty list of items")
    for index, item in enumerate(items if isinstance(items, list) else []):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object (a message with a role, or a typed item)")
        if "role" in item:
            if item["role"] not in CHAT_ROLES:
                raise RequestError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {item['role']!r}")
            content = item.get("content", "")
            if not isinstance(content, str | list) or not all(
                isinstance(part, dict) and isinstance(part.get("type"), str)
                for part in (content if isinstance(content, list) else [])
            ):
                raise RequestError(f"{where}.content must be a string or a list of content parts with a type")
        elif item.get("type") == "reasoning":
            _check_reasoning(item.get("content"), where)
        elif item.get("type") == "function_call" and not all(
            isinstance(item.get(name), str) for name in ("call_id", "name", "arguments")
        ):
            raise RequestError(f"{where} (a function_call) must have a call_id, a name and arguments, as strings")
        elif item.get("type") == "function_call_output" and (
            not isinstance(item.get("call_id"), str) or "output" not in item
        ):
            raise RequestError(f"{where} (a function_call_output) must have a call_id and an output")
    if isinstance(items, list):
        _check_not_mixed(items)


def is_content_part(item: object) -> bool:
    """Whether a Responses API input item is a bare content part (`input_text`, ...: transformers reads an input
    of them as one user message's content), not a message or another item (reasoning, a tool call)."""
    return isinstance(item, dict) and "role" not in item and item.get("type") not in RESPONSE_ITEM_TYPES


def _check_not_mixed(items: list) -> None:
    """Refuse an input list of bare content parts and items together. The API's input list holds items (messages,
    reasoning, tool calls), never bare parts; transformers reads a list of parts alone as one user message's content
    (kept: its own extension), and a mixed one was its 422, naming no item."""
    parts = [index for index, item in enumerate(items) if is_content_part(item)]
    if not parts or len(parts) == len(items):
        return
    other = next(index for index, item in enumerate(items) if not is_content_part(item))
    kind = "a message" if "role" in items[other] else f"an item of type {items[other].get('type')!r}"
    raise RequestError(
        f"input[{parts[0]}] is a content part (type {items[parts[0]].get('type')!r}) in a list of items "
        f"(input[{other}] is {kind}): an input list holds items (messages with a role, reasoning, function calls); "
        "put the parts in the content of a message with a role (user)"
    )


def _check_reasoning(content: Any, where: str) -> None:
    """A reasoning item's content as transformers joins it: null, or parts with a type and a text (a part without
    them would be a KeyError in its handler: a 500)."""
    if content is None:
        return
    if not isinstance(content, list):
        raise RequestError(
            f"{where}.content (a reasoning item's) must be a list of parts, got {type(content).__name__}"
        )
    for index, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str) or not isinstance(part.get("text"), str):
            raise RequestError(
                f"{where}.content[{index}] (a reasoning item's part) must be an object with a type and a text"
            )


def check_text_only(body: dict[str, Any]) -> None:
    """Refuse a content part other than text (an image, audio, a file) for a model that reads text only:
    transformers drops such parts in silence when it renders the messages, so the model would answer a
    conversation without them."""
    name = "messages" if "messages" in body else "input"
    items = body.get(name)
    for index, item in enumerate(items if isinstance(items, list) else []):
        if not isinstance(item, dict):
            continue
        if "role" not in item and str(item.get("type", "")).startswith("input_"):
            parts = [(f"{name}[{index}]", item)]  # (a Responses API input of bare content parts)
        else:  # a message's parts (not those of other Responses API items: reasoning, tool calls)
            is_message = item.get("type", "message") == "message" and ("role" in item or "type" in item)
            content = item.get("content") if is_message else None
            content = content if isinstance(content, list) else []
            parts = [(f"{name}[{index}].content[{number}]", part) for number, part in enumerate(content)]
        for where, part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PARTS:
                raise RequestError(
                    f"{where} is a part of type {kind!r}: this model reads text only (parts of type text)"
                )


def _check_common(body: dict[str, Any]) -> None:
    for name, value in body.items():
        _check_text(value, name)
    _check_type(body, "model", str)
    _check_type(body, "stream", bool)
    _check_positive_int(body, "max_tokens")
    _check_type(body, "stream_options", dict)
    if not isinstance((body.get("stream_options") or {}).get("include_usage", False), bool):
        raise RequestError("stream_options.include_usage must be true or false")
    _check_number(body, "temperature", low=0.0)
    _check_number(body, "top_p", low=0.0, high=1.0, low_open=True)
    _check_number(body, "frequency_penalty", low=-2.0, high=2.0)  # (the API's ranges: `generation.Penalties`)
    _check_number(body, "presence_penalty", low=-2.0, high=2.0)
    answers = body.get("n")
    if answers is not None and (not _is_int(answers) or not 1 <= answers <= MAX_ANSWERS):
        raise RequestError(f"n must be an integer from 1 to {MAX_ANSWERS}, got {answers!r}")
    if answers is not None and answers > 1 and body.get("stream"):
        raise RequestError("n > 1 cannot be streamed yet: ask for the n answers without stream, or stream one answer")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**64):
        raise RequestError(f"seed must be a 64-bit integer, got {seed!r}")
    stop = body.get("stop")
    if stop is not None and stop != []:  # (an empty list is no stop sequence: vLLM's default, which clients send)
        stops = [stop] if isinstance(stop, str) else stop
        if (
            not isinstance(stops, list)
            or not 1 <= len(stops) <= MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stops)
        ):
            raise RequestError(
                f"stop must be a non-empty string or a list of 1 to {MAX_STOP_STRINGS} non-empty strings"
            )
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise RequestError("logit_bias must be an object mapping token ids to a bias from -100 to 100")
        for token, value in bias.items():
            if not str(token).isdigit() or not _is_number(value) or not -100 <= value <= 100:
                raise RequestError(f"logit_bias maps token ids to a bias from -100 to 100, got {token!r}: {value!r}")
    generation_config = body.get("generation_config")
    if generation_config is not None:
        try:
            parsed = json.loads(generation_config) if isinstance(generation_config, str) else None
        except ValueError as error:
            raise RequestError(f"generation_config must be a JSON object in a string: {error}") from error
        if not isinstance(parsed, dict):
            raise RequestError("generation_config must be a JSON object in a string")


def _check_supported(body: dict[str, Any], endpoint: str) -> None:
    """Refuse a field transformers serve would accept and ignore, with a value that would change the answer."""
    for name, (accepted, honoured) in NOT_SUPPORTED[endpoint].items():
        value = body.get(name)
        if value is not None and not honoured(value):
            raise RequestError(
                f"gpn serve does not support {name} (got {json.dumps(value)}): leave it out, or send {accepted}"
            )


def _check_text(value: Any, where: str) -> None:
    """Refuse a string that is not Unicode text: JSON lets a request escape half of a surrogate pair alone
    ("\\ud83d"), which no tokenizer can encode (transformers: a 500)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise RequestError(
                f"{where} has a lone surrogate ({value[error.start]!r} at character {error.start}): text must be "
                "valid Unicode (a character beyond U+FFFF is escaped as a pair, e.g. \\ud83d\\ude00)"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_text(item, f"{where}[{index}]")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_type(body: dict[str, Any], name: str, kind: type) -> None:
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise RequestError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")


def _check_positive_int(body: dict[str, Any], name: str) -> None:
    value = body.get(name)
    if value is not None and (not _is_int(value) or value < 1):
        raise RequestError(f"{name} must be a positive integer, got {value!r}")


def _check_number(
    body: dict[str, Any], name: str, low: float | None = None, high: float | None = None, low_open: bool = False
) -> None:
    value = body.get(name)
    if value is None:
        return
    too_low = _is_number(value) and low is not None and (value <= low if low_open else value < low)
    too_high = _is_number(value) and high is not None and value > high
    if not _is_number(value) or too_low or too_high:
        bounds = [f"{'above' if low_open else 'at least'} {low}"] if low is not None else []
        bounds += [f"at most {high}"] if high is not None else []
        raise RequestError(f"{name} must be a finite number {' and '.join(bounds)}, got {value!r}".replace("  ", " "))
