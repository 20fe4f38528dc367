"""A small OpenAI-compatible HTTP server on 127.0.0.1 for the deployment-record tests: the routes
`record capture` reads (/v1/models, /version, /metrics, /health), with vLLM's key rule (a
Bearer key on /v1 routes when --key is set) and, with --basic USER:PW, HTTP Basic accepted too.

Run as a script; it writes its port to --port-file once it listens. vLLM itself (tests/validate)
takes 15-30 s to load on this host; these tests need only its HTTP surface.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MODELS = {"object": "list", "data": [{"id": "tiny", "root": "/models/tiny", "max_model_len": 64}]}
METRICS = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0\n'


def handler(
    key: str | None, basic: str | None, root: str | None = None
) -> type[BaseHTTPRequestHandler]:
    models = json.loads(json.dumps(MODELS))
    if root:  # the served model's root, as vLLM reports a local checkpoint directory
        models["data"][0]["root"] = root
    allowed = set()
    if key:
        allowed.add(f"Bearer {key}")
    if basic:
        allowed.add("Basic " + base64.b64encode(basic.encode()).decode())

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            guarded = self.path.startswith("/v1/")
            if guarded and allowed and self.headers.get("Authorization") not in allowed:
                return self._send(401, {"error": "Unauthorized"})
            body = {"/v1/models": models, "/version": {"version": "0.33.0"}, "/health": {}}
            if self.path == "/metrics":
                return self._send(200, METRICS)
            if self.path in body:
                return self._send(200, body[self.path])
            return self._send(404, {"detail": "Not Found"})

        def _send(self, status: int, body: object) -> None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--key")
    ap.add_argument("--basic")
    ap.add_argument("--root")
    args = ap.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(args.key, args.basic, args.root))
    tmp = Path(f"{args.port_file}.tmp")
    tmp.write_text(str(server.server_address[1]))
    os.replace(tmp, args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
