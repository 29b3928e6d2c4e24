"""The router's caller authentication: a per-cluster token every gRPC call must carry (as Ray's GCS does).

The launcher makes one random token per service (`new_token`), hands it to the router actor and to the
HTTP ingress replicas through Ray (never over the network in the clear to anyone else), and the clients
send it as the `x-dsv4-token` call metadata. The server compares in constant time; a call without it
ends with UNAUTHENTICATED before any handler runs.
"""

from __future__ import annotations

import hmac
import secrets

import grpc

METADATA_KEY = "x-dsv4-token"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def call_metadata(token: str | None) -> tuple | None:
    """The metadata a client attaches to every call (None: no token configured)."""
    return ((METADATA_KEY, token),) if token else None


def _deny(kind: str, handler):
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")
        yield  # a server-streaming handler must be a generator

    make = {"unary_unary": grpc.unary_unary_rpc_method_handler, "unary_stream": grpc.unary_stream_rpc_method_handler}[
        kind
    ]
    return make(
        unary if kind == "unary_unary" else stream,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class TokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        if not token:
            raise ValueError("the cluster token must be a non-empty string")
        self._token = token.encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        given = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
        given = given.encode() if isinstance(given, str) else bytes(given)
        if handler is None or hmac.compare_digest(given, self._token):
            return handler
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        return _deny(kind, handler)
