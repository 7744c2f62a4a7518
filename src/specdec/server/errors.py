"""Errors in each API surface's own shape, chosen by the request's path: OpenAI's
`{"error": {"message", "type", "param", "code"}}` everywhere but Anthropic's Messages API
(`/v1/messages...`), which answers `{"type": "error", "error": {"type", "message"}}` with
Anthropic's error types.

Bad input is a 4xx naming the parameter; a 500 only ever means a bug in the server.
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any, Iterator, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

logger = logging.getLogger("specdec.server")


class APIError(Exception):
    """An error answered to the client as-is."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}


class HTTPAPIError(StarletteHTTPException):
    """An APIError raised where FastAPI lets only HTTPException through as it is (while it reads a
    request's body: server/limits.py's 413 and 408)."""

    def __init__(self, error: APIError):
        super().__init__(error.status, error.message, error.headers)
        self.error = error


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


ANTHROPIC_PATHS = ("/v1/messages",)
# Anthropic's error type by status (its API's errors page); 503 is its "overloaded_error" (529).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(error: APIError) -> dict:
    kind = ANTHROPIC_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def uses_anthropic_errors(path: Optional[str]) -> bool:
    return path is not None and any(path == p or path.startswith(p + "/") for p in ANTHROPIC_PATHS)


def shaped_error_body(error: APIError, path: Optional[str] = None) -> dict:
    """The error's body in the shape of the API surface at `path`."""
    if uses_anthropic_errors(path):
        return anthropic_error_body(error)
    return error_body(error.message, error.type, error.param, error.code)


def error_response(error: APIError, path: Optional[str] = None) -> Response:
    return json_response(shaped_error_body(error, path), error.status, error.headers)


def json_response(content: Any, status: int = 200, headers: Optional[dict[str, str]] = None) -> Response:
    return Response(json_bytes(content), status_code=status, headers=headers, media_type="application/json")


# -- encoding, piece by piece ------------------------------------------------------------------
# ensure_ascii: a lone surrogate echoed from the request can never break the encoding.
_encode = json.JSONEncoder(ensure_ascii=True, separators=(",", ":")).encode
# Values one json encoder call takes at most (about 20-60 KB of text). The C encoder holds the GIL
# through a call: a worker thread encoding a big answer in one call would stall the event loop
# (/health, every stream) for as long; in pieces, the loop gets its turn between them.
PIECE_VALUES = 2048
_MAX_DEPTH = 32  # deeper values are weighed as one (nothing this server answers nests as deep)
_SAMPLES = 16  # a longer list's (or dict's) weight is estimated from this many of its items


class RawJSON:
    """JSON text that json_pieces puts in as it is: a big part of an answer encoded ahead, in
    pieces (choices.logprobs_json), and held as one string rather than as many small objects,
    which every full pass of the garbage collector walks, holding the GIL."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"RawJSON({self.text[:60]!r}...)" if len(self.text) > 60 else f"RawJSON({self.text!r})"


def _sampled(items: Sequence, depth: int) -> list[int]:
    """The weights of the items, or of _SAMPLES of them evenly spaced."""
    step = max(1, len(items) // _SAMPLES)
    return [_weight(items[i], depth) for i in range(0, step * _SAMPLES, step) if i < len(items)]


def _weight(value: Any, depth: int = 0) -> int:
    """About how many values `value` holds (a string counts one per 64 characters), in time that
    does not grow with its size: a long list's items are sampled. Whatever holds a RawJSON
    weighs more than a piece, so that it is taken apart down to it."""
    if isinstance(value, str):
        return 1 + (len(value) >> 6)
    if isinstance(value, RawJSON):
        return PIECE_VALUES + 1 + (len(value.text) >> 6)
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        if not value or depth >= _MAX_DEPTH:
            return 1
        sampled = _sampled(value, depth + 1)
        return 1 + sum(sampled) * len(value) // len(sampled)
    return 1


def _encoded(value: Any) -> Optional[str]:
    """One encoder call's text; None for a list or dict that holds a RawJSON (taken apart then)."""
    try:
        return _encode(value)
    except TypeError:
        if isinstance(value, (dict, list, tuple)):
            return None  # a RawJSON the weights missed (a sampled list), or a bad value found below
        raise


def json_pieces(content: Any, depth: int = 0) -> Iterator[str]:
    """The text of `json_text(content)` in pieces, each made by one short encoder call: a large
    dict a value at a time, a large list a batch of items at a time (by their weights, or for a
    long list by their sampled average); a RawJSON as it is. A JSON value's text does not depend
    on what holds it, so the pieces join into exactly the text of one call."""
    if isinstance(content, RawJSON):
        yield content.text
        return
    if _weight(content, depth) <= PIECE_VALUES:
        text = _encoded(content)
        if text is not None:
            yield text
            return
    if isinstance(content, dict):
        if not all(isinstance(key, str) for key in content):
            yield _encode(content)  # keys the encoder converts (numbers, None): its own way, whole
            return
        sep = "{"
        for key, value in content.items():
            yield sep + _encode(key) + ":"
            yield from json_pieces(value, depth + 1)
            sep = ","
        yield "}" if content else "{}"
    elif isinstance(content, (list, tuple)):
        yield "["
        sep = ""
        for start, end in _batches(content, depth + 1):
            text = _encoded(content[start:end]) if end - start > 1 else None
            if text is not None:  # the batch's items comma-separated: its text without the brackets
                yield sep + text[1:-1]
                sep = ","
                continue
            for item in content[start:end]:
                yield sep
                yield from json_pieces(item, depth + 1)
                sep = ","
        yield "]"
    else:
        yield _encode(content)  # a long string: one call, about as fast as a copy


def _batches(items: Sequence, depth: int) -> Iterator[tuple[int, int]]:
    """[start, end) runs of the items of about PIECE_VALUES values each."""
    if len(items) > _SAMPLES:
        sampled = _sampled(items, depth)
        per = max(1, PIECE_VALUES * len(sampled) // max(1, sum(sampled)))
        for start in range(0, len(items), per):
            yield start, min(start + per, len(items))
        return
    start, weight = 0, 0
    for i, item in enumerate(items):
        size = _weight(item, depth)
        if i > start and weight + size > PIECE_VALUES:
            yield start, i
            start, weight = i, 0
        weight += size
    if start < len(items):
        yield start, len(items)


def json_text(content: Any) -> str:
    """`content` as compact JSON, ASCII only: json.dumps(content, ensure_ascii=True,
    separators=(",", ":")), made in pieces (json_pieces) when it is large; a RawJSON in it as it is."""
    if _weight(content) <= PIECE_VALUES:
        text = _encoded(content)
        if text is not None:
            return text
    return "".join(json_pieces(content))


def json_bytes(content: Any) -> bytes:
    """json_text(content), encoded (ASCII); a large one joined from its pieces' bytes."""
    if _weight(content) <= PIECE_VALUES:
        text = _encoded(content)
        if text is not None:
            return text.encode("ascii")
    return b"".join(piece.encode("ascii") for piece in json_pieces(content))


# -- request validation ------------------------------------------------------------------------
_UNION_TAG = re.compile(r"^[a-z-]+(\[.*\])?$|^[A-Z]\w*$")  # pydantic's loc entries naming a union member
_FIELD_NAMES: set[str] = set()  # filled by protocol.py: real field names are never taken for union tags


def register_field_names(names) -> None:
    _FIELD_NAMES.update(names)


def _param(loc: tuple) -> Optional[str]:
    parts: list[str] = []
    items = loc[1:] if loc and loc[0] == "body" else loc
    for i, item in enumerate(items):
        if i and item == items[i - 1] and isinstance(item, str):
            continue  # a union's tag named as its field (response_format's "json_schema")
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item in _FIELD_NAMES or not _UNION_TAG.match(str(item)):
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = list(exc.errors())
    if not errors:
        return bad_request("the request is invalid.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request("the request body is not valid JSON.", None, "invalid_json")
    if first.get("loc") == ("body",) and first.get("type") == "missing":
        return bad_request("the request body is missing; send a JSON object.", None, "missing_body")
    # Among the alternatives of a union, the deepest error on the first bad field explains the mistake.
    field = tuple(first.get("loc", ()))[:2]
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:2] == field]
    error = max(same_field, key=lambda e: len(e.get("loc", ())))
    param = _param(tuple(error.get("loc", ())))
    message = str(error.get("msg", "invalid value"))
    for prefix in ("Value error, ", "Assertion failed, "):
        if message.startswith(prefix):
            message = message[len(prefix):]
    if error.get("type") == "extra_forbidden":
        loc = tuple(error.get("loc", ()))
        base = _param(loc[:-1])
        param = f"{base}.{loc[-1]}" if base else str(loc[-1])
        message = "unrecognized field; this server does not support it"
    elif error.get("type") == "model_attributes_type" and param is None:
        message = "the request body must be a JSON object"
    code = "unsupported_parameter" if error.get("type") == "extra_forbidden" else "invalid_value"
    return bad_request(f"{param}: {message}" if param else message, param, code)


def unparsable_body(cause: BaseException) -> APIError:
    """FastAPI's 400 for a body json.loads could not read, by what went wrong."""
    if isinstance(cause, RecursionError):
        return bad_request("the request body is nested too deeply.", None, "invalid_json")
    if isinstance(cause, UnicodeDecodeError):
        return bad_request("the request body is not valid UTF-8.", None, "invalid_json")
    if "integer string conversion" in str(cause):  # Python's bound on the digits of an int
        return bad_request("a number in the request body has too many digits.", None, "invalid_json")
    return bad_request("the request body is not valid JSON.", None, "invalid_json")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(validation_error(exc), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        path = request.url.path
        if isinstance(exc, HTTPAPIError):
            return error_response(exc.error, path)
        if exc.status_code == 400 and exc.__cause__ is not None:
            return error_response(unparsable_body(exc.__cause__), path)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = {404: f"no route {path}.", 405: f"method {request.method} is not allowed on {path}."}
        error = APIError(exc.status_code, message.get(exc.status_code, str(exc.detail)), kind)
        error.headers = dict(exc.headers or {})
        return error_response(error, path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("internal error on %s", request.url.path)
        return error_response(APIError(500, "internal server error.", "server_error", None, "internal_error"),
                              request.url.path)
