#!/usr/bin/env python3
"""A pass-through HTTP proxy that records what a client sends to a server (standard library only).

Usage: logging_proxy.py --port PORT --upstream http://127.0.0.1:8000 --log-dir DIR

Every request is forwarded unchanged to the upstream server and its answer streamed back as it arrives
(server-sent events included). For each request the proxy appends one JSON line to DIR/requests.jsonl: the
method, path, status, and for JSON bodies a summary (model, stream, stream_options, number of messages and
tools, tool_choice, max_tokens and the other top-level keys); the full request body goes to
DIR/NNNN-request.json, and the answer of a request that failed (status >= 400) to DIR/NNNN-response.txt.
`summarize DIR` prints the log as a table.
"""

import argparse
import http.client
import json
import os
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "host",
}


def summarize_body(body):
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return {"json": False, "bytes": len(body)}
    if not isinstance(req, dict):
        return {"json": True, "type": type(req).__name__}
    tools = req.get("tools") or []
    return {
        "model": req.get("model"),
        "stream": req.get("stream"),
        "stream_options": req.get("stream_options"),
        "messages": len(req.get("messages") or []),
        "tools": len(tools) if isinstance(tools, list) else tools,
        "tool_choice": req.get("tool_choice"),
        "max_tokens": req.get("max_tokens", req.get("max_completion_tokens")),
        "keys": sorted(req.keys()),
        "bytes": len(body),
    }


class Proxy(BaseHTTPRequestHandler):
    # HTTP/1.0 answers end by closing the connection, so a streamed body needs no re-chunking.
    protocol_version = "HTTP/1.0"
    upstream = None
    log_dir = None
    counter = 0
    lock = threading.Lock()

    def log_message(self, fmt, *args):
        pass

    def _forward(self):
        with Proxy.lock:
            Proxy.counter += 1
            n = Proxy.counter
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        entry = {"n": n, "time": time.time(), "method": self.command, "path": self.path}
        if body:
            with open(os.path.join(self.log_dir, f"{n:04d}-request.json"), "wb") as f:
                f.write(body)
            entry.update(summarize_body(body))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        up = urllib.parse.urlsplit(self.upstream)
        conn = http.client.HTTPConnection(up.hostname, up.port or 80, timeout=900)
        status = 502
        failed = bytearray()
        try:
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            status = resp.status
            self.send_response_only(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in HOP_BY_HOP or k.lower() == "content-length":
                    self.send_header(k, v)
            self.send_header("Connection", "close")
            self.end_headers()
            first = None
            while True:
                chunk = resp.read1(65536)
                if not chunk:
                    break
                if first is None:
                    first = time.time()
                if status >= 400 and len(failed) < 1 << 20:
                    failed += chunk
                self.wfile.write(chunk)
                self.wfile.flush()
            entry["first_byte_s"] = round(first - entry["time"], 3) if first else None
        except (OSError, http.client.HTTPException) as e:
            entry["error"] = f"{type(e).__name__}: {e}"
            if status == 502:
                try:
                    self.send_error(502, "upstream failed")
                except OSError:
                    pass
        finally:
            conn.close()
        entry["status"] = status
        entry["seconds"] = round(time.time() - entry["time"], 3)
        if failed:
            with open(os.path.join(self.log_dir, f"{n:04d}-response.txt"), "wb") as f:
                f.write(bytes(failed))
        with Proxy.lock, open(os.path.join(self.log_dir, "requests.jsonl"), "a") as f:
            f.write(json.dumps(entry) + "\n")

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _forward


def summarize(log_dir):
    path = os.path.join(log_dir, "requests.jsonl")
    if not os.path.exists(path):
        print("no requests were made")
        return
    with open(path) as f:
        for line in f:
            e = json.loads(line)
            print(
                f"#{e['n']:<3} {e['method']} {e['path']} -> {e['status']} in {e['seconds']}s"
                f" stream={e.get('stream')} tools={e.get('tools')} tool_choice={e.get('tool_choice')!r}"
                f" messages={e.get('messages')} max_tokens={e.get('max_tokens')} bytes={e.get('bytes')}"
                + (f" error={e['error']}" if "error" in e else "")
            )


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "summarize":
        summarize(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="e.g. http://127.0.0.1:8000")
    ap.add_argument("--log-dir", required=True)
    args = ap.parse_args()
    os.makedirs(args.log_dir, exist_ok=True)
    Proxy.upstream = args.upstream
    Proxy.log_dir = args.log_dir
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Proxy)
    server.daemon_threads = True
    print(f"proxy on 127.0.0.1:{args.port} -> {args.upstream}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
