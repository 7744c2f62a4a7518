"""Clients for OpenAI-compatible endpoints, and the resumable batch runner behind `specdec batch`.

    from specdec.client import Client, chat_body
    with Client("http://127.0.0.1:8000/v1") as client:
        model = client.models()[0]
        result = client.chat(chat_body([{"role": "user", "content": "hi"}], model, max_tokens=32,
                                       speculative="ngram"))
        print(result.text, result.usage["speculative"], len(result.attempts))
"""
from specdec.client.http import (
    DEFAULT_BASE_URL,
    APIConnectionError,
    APIError,
    APIResponseError,
    APIStatusError,
    APITimeoutError,
    AsyncClient,
    AsyncTextStream,
    Attempt,
    AuthenticationError,
    BadRequestError,
    Client,
    Completion,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RetryPolicy,
    TextStream,
    Timeouts,
    chat_body,
    completion_body,
    request_fields,
    speculative_decoding_field,
)

__all__ = [
    "DEFAULT_BASE_URL", "APIConnectionError", "APIError", "APIResponseError", "APIStatusError", "APITimeoutError",
    "AsyncClient", "AsyncTextStream", "Attempt", "AuthenticationError", "BadRequestError", "Client", "Completion",
    "InternalServerError", "NotFoundError", "PermissionDeniedError", "RateLimitError", "RetryPolicy", "TextStream",
    "Timeouts", "chat_body", "completion_body", "request_fields", "speculative_decoding_field",
]
