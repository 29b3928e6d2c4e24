"""`APIError`: how a request ends with an OpenAI-style error body and an HTTP status: from a router error (gRPC
status -> HTTP status; gRPC's own connection details stay in the log, never in an answer; the router's shutdown
is a retryable 503) and from a request FastAPI could not parse (`validation_error`: 400 naming the field, as
OpenAI clients expect, instead of FastAPI's 422)."""

from __future__ import annotations

import logging
import re

import grpc
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from router.client import RouterError
from service import openai_protocol as P

log = logging.getLogger(__name__)

_HTTP_OF_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_GRPC_SHUTDOWN = "Cancelling all calls"  # what gRPC says to the calls a stopping server ends
_TRANSPORT_DETAIL = re.compile(r"ipv[46]:|unix:|failed to connect|Socket closed|Connection refused", re.I)


class APIError(Exception):
    """Ends a request with an OpenAI-style error body and `status`."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    @classmethod
    def from_router(cls, e: RouterError) -> APIError:
        if e.code == grpc.StatusCode.CANCELLED or _GRPC_SHUTDOWN in (e.message or ""):
            # not by us (we close the call when our client leaves): the router is stopping, gRPC ended every call
            log.warning("router call ended by the router's shutdown: %s: %s", e.code.name, e.message)
            return cls(503, "the service is shutting down; retry the request")
        msg = e.message or e.code.name
        if _TRANSPORT_DETAIL.search(msg):  # gRPC's own connection errors name addresses: keep them in the log
            log.warning("router call failed: %s: %s", e.code.name, msg)
            msg = (
                "the router is not reachable; retry later"
                if e.code == grpc.StatusCode.UNAVAILABLE
                else f"router call failed ({e.code.name})"
            )
        return cls(_HTTP_OF_GRPC.get(e.code, 500), msg)

    @property
    def label(self) -> str:  # the `status` label of the requests counter
        return "invalid" if self.status in (400, 404) else "error"

    def response(self) -> JSONResponse:
        # 429 / 503 say when to come back (overload, a worker restarting); the openai client honours it.
        headers = {"Retry-After": "1" if self.status == 429 else "2"} if self.status in (429, 503) else None
        return JSONResponse(
            P.error_body(self.status, self.message, self.param), status_code=self.status, headers=headers
        )


def validation_error(exc: RequestValidationError) -> APIError:
    parts, param = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":  # loc holds a byte offset, not a field: no param
            offset = next((x for x in err.get("loc", ()) if isinstance(x, int)), None)
            where = f" at byte {offset}" if offset is not None else ""
            return APIError(
                400, f"request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')}{where})"
            )
    for err in exc.errors()[:3]:  # a union field (prompt) yields one error per member: keep it short
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        param = param or where or None
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return APIError(400, "; ".join(parts) or "invalid request", param)
