"""API-key affinity on Ray Serve's request-router extension point.

Speculation on a replica feeds on what that replica has seen: the cross-request n-gram cache is
kept per API key (drafters/history.py), and the prefix cache per slot. So every request carrying
one API key goes to one replica while that replica is up and has room: rendezvous hashing of the
key over the running replicas (each key ranks the replicas by hash(key, replica) and takes the
top one), so that a replica joining or leaving moves only the keys that ranked it first. The
others form the second rank, which Ray Serve tries when the first is at `max_ongoing_requests`.
Requests without a key get Ray's default, the less loaded of two random replicas.
"""
from __future__ import annotations

import hashlib
import pickle
import random
from typing import Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from specdec.drafters.history import tenant_of_api_key


def api_key_of(pending: Optional[PendingRequest]) -> Optional[str]:
    """The bearer token of an HTTP request that Ray's proxy forwards, or None.

    The proxy passes the request as one pickled argument whose `asgi_scope` has the headers;
    anything else (a Python handle call) carries no key."""
    if pending is None or not pending.args or not isinstance(pending.args[0], bytes):
        return None
    try:
        scope = getattr(pickle.loads(pending.args[0]), "asgi_scope", None) or {}
    except Exception:  # not a proxied HTTP request
        return None
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() != "bearer":
                return None
            return token.strip() or None
    return None


def rank_for(key: str, replicas: list[RunningReplica]) -> list[RunningReplica]:
    """Replicas in the key's order of preference (rendezvous hashing).

    Example: key "k", replicas A and B; if hash("k", B) > hash("k", A) the order is [B, A], and it
    stays [B, A] whatever replicas join, unless one of them outranks B for "k"."""
    tenant = tenant_of_api_key(key)  # never the raw key in memory longer than needed

    def score(replica: RunningReplica) -> bytes:
        return hashlib.blake2b(f"{tenant}|{replica.replica_id.unique_id}".encode(), digest_size=8).digest()

    return sorted(replicas, key=score, reverse=True)


class ApiKeyAffinityRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = api_key_of(pending_request)
        if key is None:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        ranked = rank_for(key, candidate_replicas)
        return [ranked[:1], ranked[1:]]
