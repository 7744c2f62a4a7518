"""Affinity routing on Ray Serve's request-router extension point.

Speculation and prompt processing on a replica feed on what that replica has seen: the
cross-request history is kept per tenant (drafters/history.py), and the prefix cache per
slot (a long prompt served there is reused by the next one that starts the same way). So:

- a request carrying a session key (OpenAI's `prompt_cache_key`, the Messages API's
  `metadata.user_id`: what Codex CLI and Claude Code send) goes to the replica the key hashes to,
  so an agent's turns stay where its conversation is cached while sessions sharing one system
  prompt spread over the replicas (the proxy passes a digest of the key, prefix.py);
- any other request whose prompt starts with at least `--prefix-routing-chars` characters (default
  1,024, about 250 tokens) goes to the replica its first that-many characters hash to: every
  request sharing that prefix (a system prompt, a document, a chat's history) lands on the
  replica that holds it in cache. The proxy's middleware (proxy.py) passes digests of the
  prompt's leading blocks in a header (prefix.py); the router never sees the body;
- any other request with an API key goes to the replica its tenant hashes to: the tenant of its
  key, which the proxy's key check passes in a header (proxy.py), so every key of one tenant
  (rotation) lands on the replica holding that tenant's history; where the proxy checks no keys,
  the key itself;
- requests without either get Ray's default, the less loaded of two random replicas.

Hashing is rendezvous hashing (each affinity ranks the replicas by hash(affinity, replica) and
takes the top one), so a replica joining or leaving moves only what ranked it first, and every
proxy of a multi-node cluster routes alike without shared state. The others form the second
rank, which Ray Serve tries when the first is at `max_ongoing_requests` (the replica's slots).
"""
from __future__ import annotations

import hashlib
import pickle
import random
from typing import Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from specdec.deploy.prefix import DEFAULT_PREFIX_CHARS, PREFIX_HEADER, SESSION_HEADER, routing_digest
from specdec.drafters.history import tenant_of_api_key

# The tenant of the request's key, set by the proxy once the key is checked (proxy.py); routing only.
TENANT_HEADER = b"x-specdec-tenant"


def proxied_headers(pending: Optional[PendingRequest]) -> dict[bytes, bytes]:
    """The headers (lower-case names) of an HTTP request that Ray's proxy forwards; {} otherwise.

    The proxy passes the request as one pickled argument whose `asgi_scope` has the headers;
    anything else (a Python handle call) has none."""
    if pending is None or not pending.args or not isinstance(pending.args[0], bytes):
        return {}
    try:
        scope = getattr(pickle.loads(pending.args[0]), "asgi_scope", None) or {}
    except Exception:  # not a proxied HTTP request
        return {}
    return {name.lower(): value for name, value in scope.get("headers", ())}


def api_key_of(headers: dict[bytes, bytes]) -> Optional[str]:
    """The bearer token, or None."""
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def affinity_of(headers: dict[bytes, bytes], prefix_chars: int) -> Optional[str]:
    """What the request should stay with: its session, else its prompt's prefix, else its key's
    tenant, else its API key, else nothing."""
    session = headers.get(SESSION_HEADER)
    if session:
        return f"session:{session.decode('ascii', 'replace')}"
    digest = routing_digest(headers.get(PREFIX_HEADER), prefix_chars)
    if digest is not None:
        return f"prefix:{digest}"
    tenant = headers.get(TENANT_HEADER)
    if tenant:
        return f"tenant:{tenant.decode('ascii', 'replace')}"
    key = api_key_of(headers)
    # The tenant's digest, never the raw key, in memory longer than needed.
    return None if key is None else f"key:{tenant_of_api_key(key)}"


def rank_for(affinity: str, replicas: list[RunningReplica]) -> list[RunningReplica]:
    """Replicas in the affinity's order of preference (rendezvous hashing).

    Example: affinity "k", replicas A and B; if hash("k", B) > hash("k", A) the order is [B, A],
    and it stays [B, A] whatever replicas join, unless one of them outranks B for "k"."""
    def score(replica: RunningReplica) -> bytes:
        return hashlib.blake2b(f"{affinity}|{replica.replica_id.unique_id}".encode(), digest_size=8).digest()

    return sorted(replicas, key=score, reverse=True)


class AffinityRouter(RequestRouter):
    prefix_chars = DEFAULT_PREFIX_CHARS

    def initialize_state(self, prefix_chars: int = DEFAULT_PREFIX_CHARS, **kwargs):
        """Ray calls this with the deployment's `request_router_kwargs` (app.py)."""
        self.prefix_chars = prefix_chars

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        affinity = affinity_of(proxied_headers(pending_request), self.prefix_chars)
        if affinity is None:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        ranked = rank_for(affinity, candidate_replicas)
        return [ranked[:1], ranked[1:]]
