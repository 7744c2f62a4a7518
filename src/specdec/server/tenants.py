"""API keys and tenants: who a request is, from its authenticated key and nothing else.

Keys come from a keys file (`--api-keys-file`) or the environment (`SPECDEC_API_KEYS`), each with
a tenant name; `--api-key` / `SPECDEC_API_KEY` is one key of the tenant "default". A tenant's
requests share a cross-request history (drafters/history.py); another tenant's never do. Without
keys every client is anonymous: by default no request then drafts from another's text
(`--shared-history` lets them share one history, the old behaviour).

Formats, the same for the file and the variable:

    # tenant-name key         (one per line, or entries separated by commas)
    alice sk-alice-1
    alice sk-alice-2          (several keys per tenant: rotation)
    bob   sk-bob

    {"alice": ["sk-alice-1", "sk-alice-2"], "bob": "sk-bob"}    (or JSON)

A key is never logged, never in an error message, never in a repr. `AuthMiddleware` checks the
`Authorization` header (a case-insensitive `Bearer` scheme; two such headers are a 400, since a
key check and a tenant could read different ones) and records the tenant in the request's state.

/metrics shows every tenant's traffic, so it takes a key of its own, `--metrics-key` /
`SPECDEC_METRICS_KEY` (no tenant's key: a tenant's gets a 403). Without one, tenant keys read it
only while every key is one tenant's; with keys of several tenants it is a 403 naming
--metrics-key and --public-metrics. `--public-metrics` serves it to anyone.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import stat
from pathlib import Path
from typing import Iterable, Mapping, Optional

from specdec.server.errors import APIError, error_response
from specdec.types import SpecdecError

logger = logging.getLogger("specdec.server")

API_KEY_ENV = "SPECDEC_API_KEY"  # one key, tenant "default"
API_KEYS_ENV = "SPECDEC_API_KEYS"  # the keys file's text
API_KEYS_FILE_ENV = "SPECDEC_API_KEYS_FILE"  # a keys file's path
METRICS_KEY_ENV = "SPECDEC_METRICS_KEY"  # the key /metrics takes
METRICS_PATH = "/metrics"
DEFAULT_TENANT = "default"
TENANT_STATE = "specdec_tenant"  # the key of the tenant's name in the ASGI scope's "state"

_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
_KEY = re.compile(r"^[\x21-\x2b\x2d-\x7e]{1,512}$")  # visible ASCII but the comma, which separates entries


def parse_keys(text: str, source: str) -> list[tuple[str, str]]:
    """(key, tenant) pairs from a keys file's text; a mistake is one line naming `source` and the
    entry (never the key)."""
    stripped = text.strip()
    if stripped.startswith("{"):
        return _parse_json(stripped, source)
    pairs = []
    for line_no, line in enumerate(text.split("\n"), start=1):
        if line.lstrip().startswith("#"):
            continue
        for entry in line.split(","):
            words = entry.split()
            if not words:
                continue
            if len(words) != 2:
                raise SpecdecError(f"{source}, line {line_no}: an entry is `tenant-name key` (two words).")
            pairs.append(_pair(words[1], words[0], f"{source}, line {line_no}"))
    return pairs


def _parse_json(text: str, source: str) -> list[tuple[str, str]]:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        raise SpecdecError(f"{source}: not valid JSON; expected {{\"tenant-name\": \"key\" or [keys]}}.") from None
    if not isinstance(data, dict):
        raise SpecdecError(f"{source}: expected a JSON object of tenant names to keys.")
    pairs = []
    for number, (tenant, keys) in enumerate(data.items(), start=1):
        where = f"{source}, entry {number}"
        for key in [keys] if isinstance(keys, str) else keys if isinstance(keys, list) else [None]:
            if not isinstance(key, str):
                raise SpecdecError(f"{where}: a key is a string (or a list of strings).")
            pairs.append(_pair(key, tenant, where))
    return pairs


def _pair(key: str, tenant: str, where: str) -> tuple[str, str]:
    if not _TENANT_NAME.match(tenant):
        # Not echoed: with the words swapped (`key tenant-name`), the "name" is the key.
        raise SpecdecError(f"{where}: a tenant name must be 1-64 letters, digits or ._@- (starting with a letter "
                           "or digit), before its key.")
    if not _KEY.match(key):
        raise SpecdecError(f"{where}: the key of tenant {tenant!r} must be 1-512 visible ASCII characters, "
                           "without spaces or commas.")
    return key, tenant


def read_keys_file(path: str) -> list[tuple[str, str]]:
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
        mode = file.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecdecError(f"cannot read the API keys file {path}: {exc.__class__.__name__}.") from None
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning("the API keys file %s is readable by other users; chmod 600 it", path)
    pairs = parse_keys(text, str(path))
    if not pairs:
        raise SpecdecError(f"the API keys file {path} holds no keys.")
    return pairs


def configured_keys(api_key: Optional[str] = None, keys_file: Optional[str] = None,
                    environ: Optional[Mapping[str, str]] = None) -> tuple[Optional[str], tuple[tuple[str, str], ...]]:
    """(the one key, the (key, tenant) pairs): `api_key` (else $SPECDEC_API_KEY), of the tenant
    "default"; the keys file (else $SPECDEC_API_KEYS_FILE) and $SPECDEC_API_KEYS. A key given
    twice is an error."""
    environ = os.environ if environ is None else environ
    single = api_key or environ.get(API_KEY_ENV) or None
    if single:
        _pair(single, DEFAULT_TENANT, "--api-key" if api_key else API_KEY_ENV)
    pairs: list[tuple[str, str]] = []
    path = keys_file or environ.get(API_KEYS_FILE_ENV)
    if path:
        pairs.extend(read_keys_file(path))
    if environ.get(API_KEYS_ENV):
        pairs.extend(parse_keys(environ[API_KEYS_ENV], API_KEYS_ENV))
    seen: dict[str, str] = {}
    for key, tenant in ([(single, DEFAULT_TENANT)] if single else []) + pairs:
        if key in seen:
            raise SpecdecError(f"an API key is given twice (tenants {seen[key]!r} and {tenant!r}); keys must be unique.")
        seen[key] = tenant
    return single, tuple(pairs)


def configured_metrics_key(metrics_key: Optional[str], api_key: Optional[str], pairs: Iterable[tuple[str, str]],
                           environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The key /metrics takes: `metrics_key` (else $SPECDEC_METRICS_KEY), never a tenant's key."""
    environ = os.environ if environ is None else environ
    key = metrics_key or environ.get(METRICS_KEY_ENV) or None
    if key is None:
        return None
    source = "--metrics-key" if metrics_key else METRICS_KEY_ENV
    if not _KEY.match(key):
        raise SpecdecError(f"{source} must be 1-512 visible ASCII characters, without spaces or commas.")
    if key == api_key or any(key == tenant_key for tenant_key, _ in pairs):
        raise SpecdecError(f"{source} is also a tenant's API key; the metrics key must be a key of its own.")
    return key


class APIKeys:
    """Key -> tenant. Only SHA-256 digests of the keys are kept; a lookup compares the digest of
    the token with every key's, in constant time, so the time taken does not say which key (or
    how much of one) matched."""

    def __init__(self, pairs: Iterable[tuple[str, str]]):
        self._digests = [(self._digest(key), tenant) for key, tenant in pairs]

    @staticmethod
    def _digest(key: str) -> bytes:
        return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()

    def __bool__(self) -> bool:
        return bool(self._digests)

    @property
    def tenants(self) -> list[str]:
        return sorted({tenant for _, tenant in self._digests})

    def tenant_of(self, token: Optional[str]) -> Optional[str]:
        """The tenant whose key `token` is, or None."""
        if not token:
            return None
        digest, found = self._digest(token), None
        for key_digest, tenant in self._digests:  # no early exit: every key is compared
            if hmac.compare_digest(digest, key_digest):
                found = tenant
        return found

    @classmethod
    def of(cls, api_key: Optional[str], pairs: Iterable[tuple[str, str]]) -> "APIKeys":
        """The keys: the one `api_key` (the tenant "default") and the (key, tenant) pairs."""
        return cls([*pairs, *([(api_key, DEFAULT_TENANT)] if api_key else [])])


def bearer_token(value: bytes) -> Optional[str]:
    """The token of `Bearer <token>` (the scheme in any case, RFC 9110), or None."""
    scheme, _, token = value.decode("latin-1").strip().partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


DUPLICATE_AUTHORIZATION = APIError(400, "the request has more than one Authorization (or x-api-key) header; send one.",
                                   "invalid_request_error", None, "duplicate_header")
INVALID_KEY = APIError(401, "a valid API key is required: send `Authorization: Bearer <key>` (or `x-api-key: <key>`).",
                       "invalid_request_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


METRICS_FORBIDDEN = APIError(403, "/metrics shows every tenant's traffic: a tenant's API key cannot read it. Scrape "
                             "with the metrics key (--metrics-key or SPECDEC_METRICS_KEY), or serve /metrics to "
                             "anyone with --public-metrics.", "invalid_request_error", None, "metrics_key_required")


def presented_token(headers: Iterable[tuple[bytes, bytes]]) -> tuple[Optional[str], Optional[APIError]]:
    """(the key the request sends or None, None), or (None, the error to answer)."""
    headers = list(headers)
    values = [value for name, value in headers if name.lower() == b"authorization"]
    # Anthropic's clients send the key as `x-api-key` (Claude Code, the anthropic SDK).
    api_keys = [value for name, value in headers if name.lower() == b"x-api-key"]
    if len(values) > 1 or len(api_keys) > 1:
        return None, DUPLICATE_AUTHORIZATION
    if values:
        return bearer_token(values[0]), None
    return (api_keys[0].decode("latin-1").strip() or None if api_keys else None), None


def authenticate(headers: Iterable[tuple[bytes, bytes]], keys: APIKeys) -> tuple[Optional[str], Optional[APIError]]:
    """(tenant, None) for a request with a valid key (tenant None: no keys are configured), or
    (None, the error to answer)."""
    token, error = presented_token(headers)
    if error is not None or not keys:
        return None, error
    tenant = keys.tenant_of(token)
    return (tenant, None) if tenant is not None else (None, INVALID_KEY)


def metrics_access(headers: Iterable[tuple[bytes, bytes]], keys: APIKeys, metrics_key: APIKeys) -> Optional[APIError]:
    """None when the request may read /metrics (module docstring), else the error to answer."""
    token, error = presented_token(headers)
    if error is not None:
        return error
    if metrics_key:
        if metrics_key.tenant_of(token) is not None:
            return None
    elif not keys or (len(keys.tenants) == 1 and keys.tenant_of(token) is not None):
        return None
    return METRICS_FORBIDDEN if keys.tenant_of(token) is not None else INVALID_KEY


class AuthMiddleware:
    """Every route but `open_paths` needs a valid key when keys are configured; the tenant of the
    key goes into the request's state (`scope["state"][TENANT_STATE]`), where routes read it.
    /metrics, unless open, takes the metrics key (`metrics_access`)."""

    def __init__(self, app, keys: APIKeys, open_paths: frozenset[str], metrics_key: Optional[str] = None):
        self.app = app
        self.keys = keys
        self.open_paths = open_paths
        self.metrics_key = APIKeys([(metrics_key, "metrics")] if metrics_key else [])  # digest only, as tenants'

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope.get("path") == METRICS_PATH and METRICS_PATH not in self.open_paths:
            error = metrics_access(scope.get("headers") or (), self.keys, self.metrics_key)
            if error is not None:
                return await error_response(error, METRICS_PATH)(scope, receive, send)
            return await self.app(scope, receive, send)
        tenant, error = authenticate(scope.get("headers") or (), self.keys)
        if error is not None and not (error is INVALID_KEY and scope.get("path") in self.open_paths):
            return await error_response(error, scope.get("path"))(scope, receive, send)
        # A state of this request's own: never one that another request could share.
        scope = {**scope, "state": {**(scope.get("state") or {}), TENANT_STATE: tenant}}
        return await self.app(scope, receive, send)


def tenant_of_scope(scope) -> Optional[str]:
    """The authenticated tenant of a request (None: anonymous)."""
    return (scope.get("state") or {}).get(TENANT_STATE)
