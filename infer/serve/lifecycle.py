"""uvicorn, run so that a shutdown answers every request it ends.

uvicorn's own graceful shutdown waits up to its timeout and then cancels the request handlers: a non-streaming
client got a bare text "500 Internal Server Error", a stream was cut without an error event or `data: [DONE]`, and
the log filled with a traceback per request; a second Ctrl-C did the same at once. Here the shutdown timeout is
ours: when it expires (or on a second Ctrl-C) every request still in flight is ended through the engine, so each
gets a 503 with an OpenAI-style body (clients retry a 503) or, on a stream, an error event and `data: [DONE]`.
uvicorn's own timeout stays behind it as a backstop, and a third Ctrl-C still quits at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal

log = logging.getLogger("infer.serve")
BACKSTOP_S = 5.0  # how long uvicorn waits past our cut-off for the ended requests to be answered


def json_400_protocol():
    """uvicorn's HTTP protocol (its "auto" choice: httptools when installed, else h11), except that a request it
    cannot parse (a bad request line, a Content-Length that is not a number, a malformed header) is refused with an
    OpenAI-style JSON body, as every other error of the server, not uvicorn's bare text/plain "Invalid HTTP request
    received."."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class JsonErrorHTTPProtocol(AutoHTTPProtocol):
        def send_400_response(self, msg: str) -> None:
            body = json.dumps({"error": {"message": f"{msg} (its request line, a header or its framing is malformed)",
                                         "type": "invalid_request_error", "param": None,
                                         "code": "invalid_http_request"}}).encode()
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return JsonErrorHTTPProtocol


def uvicorn_server(server, app, cut_off_after: float, **config):
    """A uvicorn.Server for `app` (serving `server`, an app.Server) that ends what is still running
    `cut_off_after` seconds into a shutdown."""
    import uvicorn

    class _Server(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None
        cut = False

        async def startup(self, sockets=None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        async def shutdown(self, sockets=None) -> None:
            timer = self.loop.call_later(cut_off_after, self.cut_off, f"--shutdown-timeout {cut_off_after:g} s "
                                                                      "passed") if self.loop else None
            # paused (POST /pause): no POST /resume comes now, so the requests it holds would wait the whole timeout
            n = server.aengine.cut_off("the server shut down while generation was paused (POST /pause) before this "
                                       "request finished", paused_only=True)
            if n:
                log.warning("ended %d request(s) waiting for POST /resume, each answered with a 503", n)
            try:
                await super().shutdown(sockets=sockets)
                done = getattr(getattr(self, "lifespan", None), "shutdown_event", None)  # (None: lifespan "off")
                if self.force_exit and done is not None and not done.is_set():
                    # uvicorn skips the app's shutdown on a force quit (a third Ctrl-C): its lifespan task was then
                    # cancelled as the loop closed, and starlette logged an ERROR traceback of that CancelledError.
                    # Everything in flight is cut off first, so the app's shutdown ends at once.
                    if not self.cut:
                        self.cut_off("a forced quit")
                    await self.lifespan.shutdown()
            finally:
                if timer is not None:
                    timer.cancel()

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit and sig == signal.SIGINT and not self.cut and self.loop is not None:
                self.cut = True  # the second Ctrl-C: answer what runs now; a third one quits at once
                self.loop.call_soon_threadsafe(self.cut_off, "a second Ctrl-C")
                return
            super().handle_exit(sig, frame)

        def cut_off(self, why: str) -> None:
            self.cut = True
            n = server.aengine.cut_off(f"the server shut down before this request finished ({why})")
            if n:
                log.warning("%s: ended %d request(s) still running, each answered with a 503", why, n)

    config.setdefault("http", json_400_protocol())
    return _Server(uvicorn.Config(app, timeout_graceful_shutdown=cut_off_after + BACKSTOP_S, **config))
