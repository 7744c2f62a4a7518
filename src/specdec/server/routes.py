"""The HTTP routes of every API surface: OpenAI's chat and text completions and Responses,
Anthropic's Messages, llama-server's /infill; models, health and metrics. Each route hands its
body to its surface's module, which runs it through the serving core (serving.py)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from specdec.server.completions import complete
from specdec.server.convert import check_model
from specdec.server.errors import json_response
from specdec.server.fim import InfillRequest, infill_response
from specdec.server.limits import OffLoopJSONRoute
from specdec.server.messages import CountTokensRequest, MessagesRequest, count_tokens, create_message
from specdec.server.openapi import error_responses, event_stream_response
from specdec.server.protocol import (
    ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
    ModelCard, ModelList,
)
from specdec.server.responses import ResponsesRequest, create_response, get_response
from specdec.server.serving import ServerState, state_of

__all__ = ["ServerState", "router", "STREAM_CHUNKS"]

ERRORS = error_responses()
STREAM_CHUNKS = (ChatCompletionChunk, CompletionResponse)  # documented in openapi.py's event stream

router = APIRouter(route_class=OffLoopJSONRoute)


# -- plain routes ------------------------------------------------------------------------------
@router.get("/health", summary="Health: 503 with a reason while draining or while the backend is stalled")
async def health(request: Request) -> Response:
    scheduler = state_of(request).scheduler
    health = scheduler.health()
    if health.status != "ok":
        return json_response({"status": health.status, "reason": health.reason}, 503)
    return json_response({"status": "ok", "running": scheduler.num_running, "waiting": scheduler.num_waiting})


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}}})
async def metrics(request: Request) -> Response:
    state = state_of(request)
    body = await state.metrics_exposition(state.metrics) if state.metrics_exposition else state.metrics.render()
    return Response(body, media_type=state.metrics.content_type)


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    state = state_of(request)
    return ModelList(data=[ModelCard(id=state.config.served_model_name, created=state.created)])


@router.get("/v1/models/{model}", response_model=ModelCard, responses=ERRORS)
async def get_model(model: str, request: Request) -> ModelCard:
    state = state_of(request)
    check_model(model, state.config)
    return ModelCard(id=model, created=state.created)


# -- completions -------------------------------------------------------------------------------
@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses={**event_stream_response(ChatCompletionChunk), **ERRORS},
             summary="Chat completion (stream: text/event-stream of chat.completion.chunk)")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await complete(request, body)


@router.post("/v1/completions", response_model=CompletionResponse,
             responses={**event_stream_response(CompletionResponse), **ERRORS},
             summary="Text completion (stream: text/event-stream of text_completion chunks)")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await complete(request, body)


# llama-server's API, not OpenAI's (its stream ends with no [DONE]): out of the OpenAPI document, in docs/server.md.
@router.post("/infill", include_in_schema=False)
async def infill(body: InfillRequest, request: Request) -> Response:
    return await infill_response(request, body)




# -- agent APIs: OpenAI's Responses, Anthropic's Messages (docs/responses.md, docs/messages.md) ---
# Out of the OpenAPI document, like /infill: their wire types are documented on their own pages.
@router.post("/v1/responses", include_in_schema=False)
async def responses(body: ResponsesRequest, request: Request) -> Response:
    return await create_response(request, body)


@router.get("/v1/responses/{response_id}", include_in_schema=False)
async def stored_response(response_id: str, request: Request) -> Response:
    return await get_response(request, response_id)


@router.post("/v1/messages", include_in_schema=False)
async def messages(body: MessagesRequest, request: Request) -> Response:
    return await create_message(request, body)


@router.post("/v1/messages/count_tokens", include_in_schema=False)
async def messages_count_tokens(body: CountTokensRequest, request: Request) -> Response:
    return await count_tokens(request, body)
