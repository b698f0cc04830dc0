"""Access control for every request: the token, and the Host header without one.

A dashboard bound to a loopback address without a token answers only requests whose ``Host``
is a loopback name (``localhost``, ``127.0.0.1``, ``[::1]``), so a web page elsewhere cannot
reach it by DNS rebinding. With a token, every request must carry it: an
``Authorization: Bearer <token>`` header, a ``?token=<token>`` query parameter (for links and
``EventSource``), or the cookie set on the first request that used the query parameter (so the
page's scripts and styles load). Every response gets headers that stop framing, MIME sniffing
and leaking the token in ``Referer``.
"""

from __future__ import annotations

import json
import secrets
from http.cookies import SimpleCookie
from urllib.parse import parse_qs, quote, unquote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["COOKIE_NAME", "LOOPBACK_HOSTS", "AccessMiddleware"]

COOKIE_NAME = "sweepmaster_token"
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})

_SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        b"img-src 'self' data: blob:; connect-src 'self'; frame-ancestors 'none'; "
        b"base-uri 'none'; form-action 'none'",
    ),
]


def _host_name(host_header: str) -> str:
    """The host of a ``Host`` header, without port or IPv6 brackets, lowercased."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class AccessMiddleware:
    """ASGI middleware that checks the token (or the Host header) of every request.

    Args:
        app: The application to protect.
        token: The token every request must carry; ``None`` for a loopback-only dashboard.
        allowed_hosts: Host names accepted without a token; ``None`` accepts any (for tests
            of the app alone).
    """

    def __init__(
        self, app: ASGIApp, token: str | None, allowed_hosts: frozenset[str] | None
    ) -> None:
        self.app = app
        self.token = token
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse the request with JSON 401/403, or pass it on and add security headers."""
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        set_cookie = False
        refusal: tuple[int, str] | None = None
        if self.token is None:
            host = _host_name(headers.get("host", ""))
            if self.allowed_hosts is not None and host not in self.allowed_hosts:
                refusal = 403, f"host {host!r} is not served without a token"
        else:
            supplied, set_cookie = _supplied_token(scope, headers)
            if supplied is None or not secrets.compare_digest(
                supplied.encode("utf-8"), self.token.encode("utf-8")
            ):
                refusal = 401, "a valid token is required (Authorization: Bearer, or ?token=)"
        if refusal is not None:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            else:
                await _refuse(send, *refusal)
            return

        token = self.token

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], *_SECURITY_HEADERS]
                if set_cookie and token is not None:
                    value = quote(token, safe="")
                    cookie = f"{COOKIE_NAME}={value}; Path=/; HttpOnly; SameSite=Strict"
                    message["headers"].append((b"set-cookie", cookie.encode("latin-1")))
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _supplied_token(scope: Scope, headers: dict[str, str]) -> tuple[str | None, bool]:
    """The token a request carries, and whether it came in the query string."""
    authorization = headers.get("authorization", "")
    if authorization[:7].lower() == "bearer ":
        return authorization[7:].strip(), False
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    if query.get("token"):
        return query["token"][0], True
    cookie: SimpleCookie = SimpleCookie()
    try:
        cookie.load(headers.get("cookie", ""))
    except Exception:  # a malformed Cookie header carries no token
        return None, False
    morsel = cookie.get(COOKIE_NAME)
    return (unquote(morsel.value), False) if morsel is not None else (None, False)


async def _refuse(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode("utf-8")
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode("ascii")),
        *_SECURITY_HEADERS,
    ]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
