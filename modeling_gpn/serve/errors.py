"""Errors in the OpenAI API's shape: `{"error": {"message", "type", "param", "code"}}`.

transformers serve answers an error as FastAPI does, `{"detail": ...}` (a list of pydantic's findings for a
body that is not JSON), and a stream's error as `data: {"error": "..."}`, its text put between quotes as it
is. An OpenAI client reads neither: the `openai` client's exceptions carry no message of the server's for the
first (`error.message` is the status and the raw body) and "An error occurred during streaming" for the
second, whose JSON is broken outright when the text holds a quote. Here both are the API's error object, and
a stream's error event is one whatever its text holds.
"""

from __future__ import annotations

import json
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# transformers' streamed error event, as its handlers write it: f'data: {{"error": "{message}"}}\n\n'
_STREAM_ERROR = re.compile(r'^data: \{"error": "(?P<message>.*)"\}$', re.DOTALL)


def error_body(message: str, status_code: int) -> dict:
    """The OpenAI API's error object for `message` answered with `status_code`."""
    if status_code == 429:
        kind = "rate_limit_error"
    elif status_code >= 500:
        kind = "server_error"
    else:
        kind = "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def as_openai_stream_error(event: str) -> str | None:
    """transformers' streamed error event as the API's (`data: {"error": {...}}`); None for any other event."""
    found = _STREAM_ERROR.match(event)
    if found is None:
        return None
    # (the message was put between quotes unescaped: read back as written, whatever it holds)
    return "data: " + json.dumps(error_body(found["message"], 500))


def add_openai_error_handlers(app: FastAPI) -> None:
    """Answer the app's HTTP errors, and bodies FastAPI cannot read, with the API's error object."""

    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = error.detail if isinstance(error.detail, str) else json.dumps(error.detail)
        return JSONResponse(error_body(message, error.status_code), error.status_code, headers=error.headers)

    async def unreadable_body(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in problem.get('loc', ()))}: {problem.get('msg')}"
            + (
                f" ({problem['ctx']['error']})"
                if isinstance(problem.get("ctx"), dict) and "error" in problem["ctx"]
                else ""
            )
            for problem in error.errors()
        )
        return JSONResponse(error_body(f"the request body cannot be read: {problems}", 422), 422)

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, unreadable_body)
