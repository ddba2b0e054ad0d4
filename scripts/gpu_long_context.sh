#!/usr/bin/env bash
# The 262,144-token context on one GPU host with a prebuilt `sanmai` (built elsewhere with
# `cargo build --release --features cuda`, stripped, copied as BIN_DIR/sanmai). Builds nothing.
#
#   scripts/gpu_long_context.sh OUT_DIR [BIN_DIR]
#
# The 125B qwen4_exp config (dummy weights in its quantization mix, a PLE table from
# `sanmai ple create --rows-scale 0.05`), --max-model-len 262144, steps of 256 tokens, served as the
# cases named in SANMAI_LONG_CASES (default "off3 vram1"):
# - off3: the 3x3090 preset's three stages on cuda:0 (--gpu-memory-budget 23.5GiB each) with the
#   QSA K/V rows in pinned host memory and the VRAM row cache (--qsa-kv-offload);
# - vram1: one stage, every K/V row in VRAM, no budget;
# - nocache3: off3 without the row cache (--no-qsa-row-cache);
# - off1 / nocache1: one stage with --qsa-kv-offload, with and without the row cache.
# Every case takes the GDN state checkpoint interval of off3's plan (SANMAI_LONG_INTERVAL, default
# 149040): prefill chunks stop at checkpoints, so equal intervals give every case the same steps and
# the same arithmetic.
# Each case: greedy completions one at a time of token-id prompts of the lengths in
# SANMAI_LONG_PROMPTS (default "64000 240000"; 32 new tokens, top-5 logprobs) into OUT_DIR/CASE.seq.json
# (compare two cases with compare_runs of gpu_serve_lib.sh: text and logprobs must be identical);
# then decode at batch 1 (128 tokens, streamed) after prompts of each length in
# SANMAI_LONG_CONTEXTS (default "1024 8192 64000 240000"; the lengths of the greedy prompts reuse
# them through the prefix cache) into OUT_DIR/CASE.itl.json (TTFT, median and p90 inter-token
# latency); off3 then runs four requests at once, each the longest greedy prompt plus its own
# 2,048 tokens, watching /metrics for the running count and preemptions (OUT_DIR/CASE.four.json).
# The driver's used memory is sampled every 200 ms (OUT_DIR/CASE.mem, MiB); the row-cache counters
# from /metrics are in OUT_DIR/CASE.metrics; OUT_DIR/summary.txt collects the lines that matter.
set -uo pipefail
. "$(dirname "$0")/gpu_serve_lib.sh"
serve_setup gpu_long_context.sh "$@"
cases=${SANMAI_LONG_CASES:-off3 vram1}
prompts=${SANMAI_LONG_PROMPTS:-64000 240000}
contexts=${SANMAI_LONG_CONTEXTS:-1024 8192 64000 240000}
interval=${SANMAI_LONG_INTERVAL:-149040}
longest=$(printf '%s\n' $prompts | sort -n | tail -1)


# client SCRIPT ARGS...: the Python clients below (token-id prompts as greedy_requests makes them).
client() {
  python3 - "$@" <<'PY'
import json, sys, threading, time, urllib.request
mode, base = sys.argv[1], sys.argv[2]
def ids(n, salt=0):
    return [(i * 7919 + 13 + salt * 104729) % 30000 + 1000 for i in range(n)]
def post(body, stream=False):
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    return urllib.request.urlopen(req, timeout=1800)
if mode == "greedy":
    out = []
    for n in map(int, sys.argv[3:]):
        t0 = time.time()
        r = json.load(post({"model": "m", "prompt": ids(n), "max_tokens": 32, "temperature": 0,
                            "logprobs": 5, "ignore_eos": True}))
        c = r["choices"][0]
        out.append({"prompt_len": n, "seconds": round(time.time() - t0, 2), "text": c["text"],
                    "logprobs": c["logprobs"], "usage": r["usage"]})
        print(f"greedy prompt {n}: {out[-1]['seconds']} s", file=sys.stderr)
    json.dump(out, sys.stdout)
elif mode == "itl":
    greedy = set(map(int, sys.argv[3].split()))
    out = []
    for n in map(int, sys.argv[4:]):
        # Lengths of the greedy prompts reuse them (prefix cache); others are fresh.
        prompt = ids(n) if n in greedy else ids(n, salt=n)
        t0 = time.time()
        times = []
        resp = post({"model": "m", "prompt": prompt, "max_tokens": 128, "temperature": 0,
                     "ignore_eos": True, "stream": True})
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text"):
                    times.append(time.time())
        gaps = sorted(b - a for a, b in zip(times, times[1:]))
        med = gaps[len(gaps) // 2] * 1e3 if gaps else None
        p90 = gaps[int(len(gaps) * 0.9)] * 1e3 if gaps else None
        out.append({"context": n, "prefix_cached": n in greedy, "ttft_s": round(times[0] - t0, 3),
                    "tokens": len(times), "itl_median_ms": med and round(med, 3),
                    "itl_p90_ms": p90 and round(p90, 3)})
        print(f"itl context {n}: {out[-1]}", file=sys.stderr)
    json.dump(out, sys.stdout)
elif mode == "four":
    n = int(sys.argv[3])
    res, errs = [None] * 4, []
    def one(i):
        try:
            t0 = time.time()
            r = json.load(post({"model": "m", "prompt": ids(n) + ids(2048, salt=i + 1), "max_tokens": 64,
                                "temperature": 0, "ignore_eos": True}))
            res[i] = {"prompt_tokens": r["usage"]["prompt_tokens"],
                      "completion_tokens": r["usage"]["completion_tokens"],
                      "seconds": round(time.time() - t0, 2)}
        except Exception as e:
            errs.append(repr(e))
    ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    peak_running, preempt = 0, None
    def metric(text, name):
        for l in text.splitlines():
            if l.startswith(name):
                return float(l.rsplit(" ", 1)[1])
        return None
    preempt0 = metric(urllib.request.urlopen(base + "/metrics").read().decode(), "sanmai:num_preemptions_total")
    while any(t.is_alive() for t in ts):
        text = urllib.request.urlopen(base + "/metrics").read().decode()
        peak_running = max(peak_running, metric(text, "sanmai:num_requests_running") or 0)
        preempt = metric(text, "sanmai:num_preemptions_total")
        time.sleep(0.5)
    json.dump({"requests": res, "errors": errs, "peak_running": peak_running,
               "preemptions_during": (preempt or 0) - (preempt0 or 0)}, sys.stdout)
PY
}

serve_case() {
  local name=$1; shift
  local port=$((18500 + RANDOM % 1000))
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$out/$name.mem" 2>/dev/null &
  local smi=$!
  local t0=$(date +%s)
  RUST_LOG=info NO_COLOR=1 "$sanmai" serve --port "$port" --served-model-name m --load-format dummy \
    --config "$q125" --ple-table "$table" --max-model-len 262144 --max-num-seqs 4 \
    --max-num-batched-tokens 256 --block-size 16 --state-checkpoint-interval "$interval" "$@" \
    >"$out/$name.serve.log" 2>&1 &
  local pid=$!
  local ready=0
  wait_ready "$port" "$pid" && ready=1
  echo "$name: ready=$ready after $(($(date +%s) - t0)) s" | tee -a "$out/summary.txt"
  if [ $ready = 1 ]; then
    local url="http://127.0.0.1:$port"
    client greedy "$url" $prompts >"$out/$name.seq.json" 2>>"$out/summary.txt" || rc=1
    client itl "$url" "$prompts" $contexts >"$out/$name.itl.json" 2>>"$out/summary.txt" || rc=1
    if [ "$name" = off3 ]; then
      client four "$url" "$longest" >"$out/$name.four.json" 2>>"$out/summary.txt" || rc=1
      cat "$out/$name.four.json" >>"$out/summary.txt"
      echo >>"$out/summary.txt"
    fi
    curl -sS "$url/metrics" >"$out/$name.metrics" 2>/dev/null
  else
    rc=1
  fi
  kill -TERM "$pid" 2>/dev/null
  wait "$pid"
  kill "$smi" 2>/dev/null
  wait "$smi" 2>/dev/null
  echo "$name: driver used MiB before start $(head -1 "$out/$name.mem"), peak $(sort -n "$out/$name.mem" | tail -1)" \
    | tee -a "$out/summary.txt"
  grep -h 'memory plan\|pinned' "$out/$name.serve.log" | sed 's/\x1b\[[0-9;]*m//g' | head -12 >>"$out/summary.txt"
  grep -h "^sanmai:qsa_\|^sanmai:num_preemptions" "$out/$name.metrics" >>"$out/summary.txt" 2>/dev/null
  grep -q panicked "$out/$name.serve.log" && rc=1
}

for c in $cases; do
  case $c in
    off3) serve_case off3 --preset configs/deploy/3x3090.toml --device cuda:0,cuda:0,cuda:0 --qsa-kv-offload ;;
    nocache3) serve_case nocache3 --preset configs/deploy/3x3090.toml --device cuda:0,cuda:0,cuda:0 --qsa-kv-offload \
      --no-qsa-row-cache ;;
    vram1) serve_case vram1 --device cuda:0 --enable-prefix-caching ;;
    off1) serve_case off1 --device cuda:0 --enable-prefix-caching --qsa-kv-offload ;;
    nocache1) serve_case nocache1 --device cuda:0 --enable-prefix-caching --qsa-kv-offload --no-qsa-row-cache ;;
    *) echo "unknown case $c" >&2; rc=1 ;;
  esac
done
exit $rc
