"""The last line of defence: an exception no route handled becomes a 500 with an OpenAI-style body.

It sits inside the metrics middleware, so such a 500 is counted in `infer:http_requests_total` like any other
answer. A 500 is always a bug in the server (every user mistake is a 4xx): it is logged with its traceback.
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger("infer.serve")


def server_error_body(exc: BaseException) -> dict:
    return {"error": {"message": f"internal server error: {type(exc).__name__}", "type": "server_error",
                      "param": None, "code": None}}


class ErrorGuardMiddleware:
    """Pure ASGI middleware: an unhandled exception before the response started is answered with a 500 JSON body;
    after it started (a stream) the connection is closed by re-raising, as there is no way to change the status."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            # the client's X-Request-Id (the one id it has of a 500) names the traceback, so the two can be matched
            given = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == b"x-request-id"), "")
            log.exception("unhandled error in %s %s%s", scope.get("method"), scope.get("path"),
                          f" (X-Request-Id {given!r})" if given else "")
            if started:
                raise
            body = json.dumps(server_error_body(e)).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
