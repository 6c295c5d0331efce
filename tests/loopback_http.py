"""An HTTP server on loopback that answers JSON, for tests of HTTP clients (the openai client
through the channel): `answer(method, path, body)` gives each reply's JSON; the server is the real
one of the standard library, in a thread."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = Callable[[str, str, bytes], Any]


@contextlib.contextmanager
def json_server(answer: Answer) -> Iterator[str]:
    """Serve `answer` on a free loopback port; yields the base URL (`http://127.0.0.1:PORT`)."""

    class Handler(BaseHTTPRequestHandler):
        def _reply(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            reply = json.dumps(answer(self.command, self.path, body)).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        do_POST = do_GET = _reply  # noqa: N815

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
