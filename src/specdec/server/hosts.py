"""The Host allow-list: a defence against DNS rebinding.

A web page on attacker.example can make a browser resolve its own name to 127.0.0.1 and then
send requests to a server on loopback; only the Host header still says attacker.example. So a
server bound to loopback answers only requests addressed to a loopback name (localhost,
127.0.0.1, [::1], the bind address) or to a name given with `--allowed-hosts`; others get 421.
A server bound to another address (0.0.0.0, a LAN address) checks Host only when given a list.
`--allowed-hosts '*'` turns the check off (a reverse proxy on loopback that forwards its own Host).
"""
from __future__ import annotations

import ipaddress
from typing import Iterable, Optional

from specdec.server.errors import APIError, error_response

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts_for(bind_host: str, extra: Iterable[str] = ()) -> Optional[tuple[str, ...]]:
    """The Host names a server bound to `bind_host` accepts; None: any."""
    extra = [name.strip().lower() for name in extra if name.strip()]
    if "*" in extra:
        return None
    if not is_loopback(bind_host):
        return tuple(extra) or None
    names = [*LOOPBACK_NAMES, bind_host.strip("[]").lower(), *extra]
    return tuple(dict.fromkeys(names))


def host_name(value: str) -> str:
    """The name of a Host header value: "[::1]:8000" -> "::1", "Example.COM.:80" -> "example.com"."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    name, _, port = value.rpartition(":")
    if name and port.isdigit():
        value = name
    return value.rstrip(".")


def host_allowed(name: str, allowed: Iterable[str]) -> bool:
    for pattern in allowed:
        if name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:])):
            return True
    return False


DUPLICATE_HOST = APIError(400, "the request has more than one Host header; send one.", "invalid_request_error",
                          None, "duplicate_header")


def misdirected(name: str) -> APIError:
    return APIError(421, f"this server does not answer for the host {name[:100]!r}; start it with "
                         "--allowed-hosts to add that name.", "invalid_request_error", None, "invalid_host")


class HostAllowListMiddleware:
    def __init__(self, app, allowed: tuple[str, ...]):
        self.app = app
        self.allowed = tuple(name.lower() for name in allowed)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        values = [value for name, value in scope.get("headers") or () if name.lower() == b"host"]
        if len(values) > 1:
            return await error_response(DUPLICATE_HOST, scope.get("path"))(scope, receive, send)
        if values:  # none: an HTTP/1.0 request, which no browser sends
            name = host_name(values[0].decode("latin-1"))
            if not host_allowed(name, self.allowed):
                return await error_response(misdirected(name), scope.get("path"))(scope, receive, send)
        return await self.app(scope, receive, send)
