"""The OpenAPI document: FastAPI's, plus what it cannot infer from the routes.

- The event stream of `stream: true`, in OpenAPI 3.2's terms (which schemathesis checks event by
  event): `itemSchema` describes one event — a chunk, an error event, or `[DONE]` — and `schema`
  the whole stream, read as an array of events: exactly one `[DONE]`, at most one error event.
- OpenAI-shaped errors (documented per status) in place of FastAPI's 422 validation responses.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from specdec.server.protocol import ErrorResponse

REF = "#/components/schemas/{model}"
ERROR_STATUSES = (400, 401, 404, 429, 503)
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "required": True,
                               "schema": {"type": "string", "pattern": "^[0-9]+$"}}}


def error_responses() -> dict:
    """Every error status a request may get, each with the OpenAI error body (a 429 always says
    when to retry)."""
    responses: dict[int, dict[str, Any]] = {status: {"model": ErrorResponse} for status in ERROR_STATUSES}
    responses[429]["headers"] = RETRY_AFTER
    return responses


def _event(data: dict) -> dict:
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def _json_event(schema: dict) -> dict:
    return _event({"contentMediaType": "application/json", "contentSchema": schema})


def event_stream_response(chunk: type[BaseModel]) -> dict:
    """The 200 response of a completion route: JSON, or with `stream: true`, server-sent events of
    `chunk`, ending in `data: [DONE]`; a failure after the stream started is one error event
    (`{"error": {...}}`) right before `[DONE]`."""
    done = _event({"const": "[DONE]"})
    error = _json_event({"$ref": REF.format(model=ErrorResponse.__name__)})
    chunk_event = _json_event({"$ref": REF.format(model=chunk.__name__)})
    return {200: {
        "description": f"JSON; with stream: true, server-sent events of {chunk.__name__}, ending in `data: [DONE]`. "
                       "A failure after the stream started is one error event `data: {\"error\": {...}}` "
                       "(the OpenAI error object) followed by `data: [DONE]`.",
        "content": {"text/event-stream": {
            "itemSchema": {"anyOf": [chunk_event, error, done]},
            "schema": {"type": "array", "minItems": 1,
                       "allOf": [{"contains": done, "minContains": 1, "maxContains": 1},
                                 {"contains": error, "minContains": 0, "maxContains": 1}]},
        }},
    }}


def openapi_document(app: FastAPI, stream_chunks: tuple[type[BaseModel], ...]) -> dict:
    """FastAPI's schema, less its 422 responses (validation errors here are OpenAI-style 400s),
    plus the schemas of the streamed chunks, which no route returns as JSON."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        _, extra = models_json_schema([(model, "serialization") for model in stream_chunks], ref_template=REF)
        for name, definition in extra.get("$defs", {}).items():
            components.setdefault(name, definition)
        app.openapi_schema = schema
    return app.openapi_schema
