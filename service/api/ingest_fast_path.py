"""POST /v1/batches answered without the framework's per-request layers.

The ingest route is the collector's hot path, about a thousand requests a second under load. Its
handler (routes/ingest.py `post_batch`) takes the bare Request and returns a ready Response, so it
uses none of what Starlette and FastAPI wrap around each request: server-error and exception
middleware, an exit stack, the router's match over every route, the route's dependency solving.
Those layers run on the event loop with the GIL held, and the batch writer's thread waits for the
GIL: answering the route directly raised SQLite ingest by 8-20% in three alternating rounds
(docs/performance.md, "The ingest route's fast path, and the GIL").

Kept, so the route answers exactly as through the app: the collector's own middleware in the same
order (request metrics, body limit, body deadline; main.py builds both stacks from one list), the
app's exception handlers (HTTPException's JSON, the 422 that names each field), and the route's
template as the metrics label. The route stays registered on the app for its OpenAPI entry.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

INGEST_METHOD = "POST"
INGEST_PATH = "/v1/batches"


class IngestEndpoint:
    """The ingest route as a plain ASGI app: its handler, and the app's exception handlers for
    what it raises (anything they do not handle propagates, and the server answers 500)."""

    def __init__(self, app: FastAPI, router: APIRouter) -> None:
        self._app = app
        self._route = next(
            r
            for r in router.routes
            if isinstance(r, APIRoute) and r.path == INGEST_PATH and INGEST_METHOD in (r.methods or ())
        )
        self._handler: Callable[[Request], Awaitable[Response]] = self._route.endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"] = self._route  # what the router sets: the request metrics label it by template
        request = Request(scope, receive, send)
        try:
            response = await self._handler(request)
        except Exception as exc:
            handler = _handler_for(self._app, exc)
            if handler is None:
                raise
            response = handler(request, exc)
            if inspect.isawaitable(response):
                response = await response
        await response(scope, receive, send)


def _handler_for(app: FastAPI, exc: Exception) -> Callable[[Request, Any], Any] | None:
    """The app's handler for the exception, by its class's MRO, as Starlette looks it up."""
    handlers = app.exception_handlers
    for cls in type(exc).__mro__:
        if cls in handlers:
            return handlers[cls]
    return None


def is_ingest(scope: Scope) -> bool:
    return scope["type"] == "http" and scope["method"] == INGEST_METHOD and scope["path"] == INGEST_PATH
