#!/usr/bin/env bash
# Image input on a GPU host with a prebuilt `sanmai` binary (BIN_DIR/sanmai, built with
# `cargo build --release --features cuda`): time to first token of chat requests carrying a 1 MP and
# a 2 MP image, the vision tower resident on the GPU against its blocks streamed from pinned host
# memory (`--vit-on-host`), on dummy weights of a Qwen3.5-MoE config with its 27-block tower.
# Builds nothing.
#
#   scripts/gpu_images.sh OUT_DIR [BIN_DIR]
#
# Writes OUT_DIR/images.log (each run's TTFT per request, the medians, whether the two forms gave
# the same greedy tokens and log-probabilities) and each server's log. $SANMAI_IMAGES_CONFIG picks
# another config (default configs/models/qwen3.5-35b-a3b.json); $SANMAI_IMAGES_RUNS the requests per
# image size and form (default 5, each with a different image, so the prefix cache never hits).
set -uo pipefail
here=$(dirname "$0")
# shellcheck source=scripts/gpu_serve_lib.sh
. "$here/gpu_serve_lib.sh"
out=${1:?usage: gpu_images.sh OUT_DIR [BIN_DIR]}
sanmai="${2:-.device-bin}/sanmai"
mkdir -p "$out"
[ -x "$sanmai" ] || { echo "no executable $sanmai" >&2; exit 1; }
config=${SANMAI_IMAGES_CONFIG:-configs/models/qwen3.5-35b-a3b.json}
runs=${SANMAI_IMAGES_RUNS:-5}
log="$out/images.log"
: >"$log"
rc=0

# ttft URL RUNS: for 1 MP (1024x1024) and 2 MP (1448x1448) images, RUNS greedy chat requests of one
# new token one at a time (the request's time is its TTFT, the image's decoding and the tower
# included), each with its own random image; prints one JSON document: the TTFTs and, for the first
# image of each size (the same pixels in every run of this script), its 4 tokens and logprobs.
ttft() {
  python3 - "$@" <<'PY'
import base64, json, random, struct, sys, time, urllib.request, zlib

base, runs = sys.argv[1], int(sys.argv[2])

def png(w, h, seed):
    rnd = random.Random(seed)
    row = lambda: b"\0" + bytes(rnd.getrandbits(8) for _ in range(3 * w))
    raw = b"".join(row() for _ in range(h))
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 1)) + chunk(b"IEND", b""))

def request(image, logprobs, max_tokens):
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    body = {"model": "m", "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is in this picture?"}]}]}
    if logprobs:
        body["logprobs"], body["top_logprobs"] = True, 5
    return urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                  {"content-type": "application/json"})

result = {}
for name, side in [("1MP", 1024), ("2MP", 1448)]:
    first = png(side, side, 0)
    r = json.load(urllib.request.urlopen(request(first, True, 4), timeout=900))
    result[name + "_answer"] = {"content": r["choices"][0]["message"]["content"],
                                "logprobs": r["choices"][0]["logprobs"],
                                "prompt_tokens": r["usage"]["prompt_tokens"]}
    times = []
    for k in range(runs):
        # One new token: the request's whole time is its time to first token.
        image = png(side, side, 1000 * side + k)
        req = request(image, False, 1)
        t0 = time.perf_counter()
        json.load(urllib.request.urlopen(req, timeout=900))
        times.append(time.perf_counter() - t0)
    result[name + "_ttft_s"] = times
json.dump(result, sys.stdout)
PY
}

for form in resident streamed; do
  extra=()
  [ "$form" = streamed ] && extra=(--vit-on-host)
  port=$((18500 + RANDOM % 1000))
  echo "\$ sanmai serve --device cuda --load-format dummy --config $config --mm-processor-kwargs '{\"max_pixels\": 2097152}' ${extra[*]}" >>"$log"
  RUST_LOG=info NO_COLOR=1 "$sanmai" serve --port "$port" --served-model-name m --device cuda \
    --load-format dummy --config "$config" --mm-processor-kwargs '{"max_pixels": 2097152}' \
    "${extra[@]}" >"$out/$form.serve.log" 2>&1 &
  pid=$!
  if wait_ready "$port" "$pid"; then
    ttft "http://127.0.0.1:$port" "$runs" >"$out/$form.json" 2>>"$log" || rc=1
  else
    echo "$form: the server did not start" >>"$log"
    rc=1
  fi
  grep -h "memory plan: stage 0\|pinned host RAM" "$out/$form.serve.log" | sed 's/\x1b\[[0-9;]*m//g' >>"$log"
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
done

python3 - "$out" >>"$log" <<'PY' || rc=1
import json, os, statistics, sys
out = sys.argv[1]
runs = {f: json.load(open(os.path.join(out, f + ".json")))
        for f in ("resident", "streamed") if os.path.exists(os.path.join(out, f + ".json"))}
for size in ("1MP", "2MP"):
    for form, r in runs.items():
        t = sorted(r[size + "_ttft_s"])
        print(f"{size} ({r[size + '_answer']['prompt_tokens']} prompt tokens), {form}: TTFT median "
              f"{1e3 * statistics.median(t):.1f} ms, min {1e3 * t[0]:.1f}, max {1e3 * t[-1]:.1f} over {len(t)}")
    if len(runs) == 2:
        same = runs["resident"][size + "_answer"] == runs["streamed"][size + "_answer"]
        print(f"{size}: resident and streamed answers (tokens and logprobs) identical: {same}")
        if not same:
            sys.exit(1)
PY
cat "$log"
exit $rc
