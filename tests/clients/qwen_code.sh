#!/usr/bin/env bash
# qwen-code (the coding agent CLI) against a running sanmai server: a one-shot prompt in YOLO mode must
# exit 0, with the server having answered its streamed, tool-carrying chat requests.
#
# Usage: tests/clients/qwen_code.sh PORT [QWEN_BIN] [MODEL]
#   PORT      the port of a sanmai server on 127.0.0.1
#   QWEN_BIN  the qwen executable (default: qwen on PATH), e.g. from
#             `npm install --prefix DIR @qwen-code/qwen-code@0.15.10` -> DIR/node_modules/.bin/qwen
#   MODEL     the served model name (default: sanmai-demo)
#
# The agent talks to the server through tests/clients/logging_proxy.py, which records every request (full
# bodies under the work directory, printed as a table at the end), so a request the server refuses is named
# exactly. The agent runs with a throw-away HOME and working directory. QWEN_TIMEOUT (seconds, default 900)
# bounds the run, QWEN_MAX_OUTPUT_TOKENS (default: qwen-code's own, 8,000) each reply; QWEN_KEEP=1 keeps the work directory.
set -euo pipefail

port=${1:?usage: qwen_code.sh PORT [QWEN_BIN] [MODEL]}
qwen=${2:-qwen}
model=${3:-sanmai-demo}
here="$(cd "$(dirname "$0")" && pwd)"
python=${PYTHON:-python3}

work="$(mktemp -d)"
proxy_pid=""
cleanup() {
    if [ -n "$proxy_pid" ]; then kill "$proxy_pid" 2>/dev/null || true; wait "$proxy_pid" 2>/dev/null || true; fi
    if [ "${QWEN_KEEP:-0}" != 1 ]; then rm -rf "$work"; else echo "qwen-code: work directory kept: $work"; fi
}
trap cleanup EXIT

# A free port for the proxy.
proxy_port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$python" "$here/logging_proxy.py" --port "$proxy_port" --upstream "http://127.0.0.1:$port" \
    --log-dir "$work/requests" >"$work/proxy.log" 2>&1 &
proxy_pid=$!
for _ in $(seq 100); do
    if curl -fsS "http://127.0.0.1:$proxy_port/health" >/dev/null 2>&1; then break; fi
    sleep 0.1
done
curl -fsS "http://127.0.0.1:$proxy_port/health" >/dev/null

mkdir -p "$work/home" "$work/project"
status=0
started=$(date +%s)
(
    cd "$work/project"
    # qwen-code's own settings: it asks for 8,000 output tokens a reply. The built-in model ends its replies
    # by itself. QWEN_MAX_OUTPUT_TOKENS, when set, lowers that budget through qwen-code's
    # QWEN_CODE_MAX_OUTPUT_TOKENS (a model that never ends a reply, e.g. random weights, needs it).
    HOME="$work/home" NO_COLOR=1 CI=true env ${QWEN_MAX_OUTPUT_TOKENS:+QWEN_CODE_MAX_OUTPUT_TOKENS="$QWEN_MAX_OUTPUT_TOKENS"} timeout "${QWEN_TIMEOUT:-900}" "$qwen" -p "say hi" --yolo \
        --auth-type openai --openai-base-url "http://127.0.0.1:$proxy_port/v1" --openai-api-key x \
        -m "$model" </dev/null
) >"$work/qwen.out" 2>"$work/qwen.err" || status=$?
echo "qwen-code exited $status after $(($(date +%s) - started))s"
echo "--- qwen-code stdout (last 20 lines)"
tail -n 20 "$work/qwen.out" || true
echo "--- qwen-code stderr (last 40 lines)"
tail -n 40 "$work/qwen.err" || true
echo "--- requests qwen-code made"
"$python" "$here/logging_proxy.py" summarize "$work/requests"

fail=0
if [ "$status" != 0 ]; then
    echo "FAIL: qwen-code exited $status"
    fail=1
fi
# Every request it made was answered with success, and at least one was a streamed chat request with tools.
"$python" - "$work/requests" <<'EOF' || fail=1
import json, os, sys
d = sys.argv[1]
path = os.path.join(d, "requests.jsonl")
entries = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
bad = [e for e in entries if e["status"] >= 400 or "error" in e]
for e in bad:
    print(f"FAIL: request #{e['n']} {e['method']} {e['path']} -> {e['status']} {e.get('error', '')}")
    resp = os.path.join(d, f"{e['n']:04d}-response.txt")
    if os.path.exists(resp):
        print("  answer:", open(resp, errors="replace").read()[:2000])
    req = os.path.join(d, f"{e['n']:04d}-request.json")
    if os.path.exists(req):
        body = json.load(open(req))
        for key in ("messages", "tools"):
            if isinstance(body.get(key), list):
                body[key] = f"<{len(body[key])} items>"
        print("  request fields:", json.dumps(body)[:2000])
chats = [e for e in entries if e["path"].startswith("/v1/chat/completions") and e["status"] == 200]
streamed = [e for e in chats if e.get("stream") and isinstance(e.get("tools"), int) and e["tools"] > 0]
if not streamed:
    print(f"FAIL: no streamed chat request with tools was answered ({len(chats)} chat requests in all)")
if bad or not streamed:
    sys.exit(1)
print(f"qwen-code: {len(entries)} requests, {len(streamed)} streamed with tools, all answered")
EOF
if [ "$fail" != 0 ]; then
    QWEN_KEEP=1
    exit 1
fi
echo "qwen-code: 1 passed, 0 failed"
