# Shell functions the GPU-host serve scripts share (sourced by gpu_stages.sh, gpu_multi.sh, gpu_offload.sh and
# gpu_long_context.sh).

# serve_setup NAME OUT_DIR [BIN_DIR]: the scripts' common start. Sets out (OUT_DIR, created), sanmai
# (BIN_DIR/sanmai, default BIN_DIR .device-bin; exits when it is not executable), rc=0, q125 (the 125B
# qwen4_exp config) and table (a PLE table for it from `sanmai ple create --rows-scale 0.05`, in a
# temporary folder removed at exit; its log in OUT_DIR/ple.log).
serve_setup() {
  local name=$1
  out=${2:?usage: $name OUT_DIR [BIN_DIR]}
  sanmai="${3:-.device-bin}/sanmai"
  mkdir -p "$out"
  [ -x "$sanmai" ] || { echo "no executable $sanmai" >&2; exit 1; }
  rc=0
  q125=configs/models/qwen4-exp-125b-a6b.json
  table=$(mktemp -d)
  trap 'rm -rf "$table"' EXIT
  "$sanmai" ple create --config "$q125" --out "$table" --rows-scale 0.05 --fill zeros >"$out/ple.log" 2>&1 || rc=1
}

# greedy_requests URL LEN...: greedy completions one at a time of token-id prompts of each length
# (32 new tokens, top-5 logprobs, the prompt echoed with its logprobs), as one JSON document.
greedy_requests() {
  python3 - "$@" <<'PY'
import json, sys, urllib.request
base, lens = sys.argv[1], [int(n) for n in sys.argv[2:]]
def post(path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=900))
out = []
for n in lens:
    prompt = [(i * 7919 + 13) % 30000 + 1000 for i in range(n)]
    r = post("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 32, "temperature": 0,
                                 "logprobs": 5, "echo": True, "ignore_eos": True})
    c = r["choices"][0]
    out.append({"prompt_len": n, "text": c["text"], "logprobs": c["logprobs"], "usage": r["usage"]})
json.dump(out, sys.stdout)
PY
}

# wait_ready PORT PID: waits (up to 10 minutes) until the server on PORT answers /health; fails
# when the process PID ends first.
wait_ready() {
  for _ in $(seq 1200); do
    curl -fsS "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}

# compare_runs OUT_DIR A:B...: for each pair, whether the greedy answers of runs A and B
# (OUT_DIR/A.seq.json, OUT_DIR/B.seq.json) are identical, text and logprobs; fails if any differ.
# A pair with neither run is skipped; a pair with one run is reported missing.
compare_runs() {
  python3 - "$@" <<'PY'
import json, os, sys
out, pairs = sys.argv[1], [p.split(":") for p in sys.argv[2:]]
def load(name):
    p = os.path.join(out, name + ".seq.json")
    return json.load(open(p)) if os.path.exists(p) and os.path.getsize(p) else None
bad = 0
for one, other in pairs:
    a, b = load(one), load(other)
    if a is None or b is None:
        if a is not None or b is not None:
            print(f"{one} vs {other}: missing run")
        continue
    for x, y in zip(a, b):
        same_text = x["text"] == y["text"]
        same_lp = x["logprobs"] == y["logprobs"]
        diffs = [abs(p - q) for p, q in zip(x["logprobs"]["token_logprobs"], y["logprobs"]["token_logprobs"])
                 if p is not None and q is not None]
        print(f"{one} vs {other} prompt {x['prompt_len']}: text identical {same_text}, logprobs identical "
              f"{same_lp}, max |token logprob diff| {max(diffs) if diffs else 0:.3g}")
        bad += not (same_text and same_lp)
sys.exit(1 if bad else 0)
PY
}

# serve_run NAME BODY SERVE_ARGS...: `sanmai serve SERVE_ARGS` on a free port as model `m`, its log in
# OUT_DIR/NAME.serve.log and the driver's used memory of every GPU sampled every 200 ms
# (OUT_DIR/NAME.mem: index, MiB); once it answers, `BODY NAME URL` (a function of the calling script)
# sends the case's requests; then /metrics goes to OUT_DIR/NAME.metrics, the server is stopped, and
# its readiness, exit, memory (before start and peak, per GPU) and plan lines go to
# OUT_DIR/summary.txt. Sets rc=1 when it does not start, panics, or BODY sets it.
serve_run() {
  local name=$1 body=$2
  shift 2
  local port=$((18500 + RANDOM % 1000))
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 >"$out/$name.mem" 2>/dev/null &
  local smi=$!
  local t0=$(date +%s)
  RUST_LOG=info NO_COLOR=1 "$sanmai" serve --port "$port" --served-model-name m "$@" >"$out/$name.serve.log" 2>&1 &
  local pid=$!
  local ready=0
  wait_ready "$port" "$pid" && ready=1
  echo "$name: ready=$ready after $(($(date +%s) - t0)) s" | tee -a "$out/summary.txt"
  if [ $ready = 1 ]; then
    "$body" "$name" "http://127.0.0.1:$port"
    curl -sS "http://127.0.0.1:$port/metrics" >"$out/$name.metrics" 2>/dev/null
  else
    rc=1
  fi
  kill -TERM "$pid" 2>/dev/null
  wait "$pid"
  echo "$name: serve exit $?" >>"$out/summary.txt"
  kill "$smi" 2>/dev/null
  wait "$smi" 2>/dev/null
  awk -F', *' -v n="$name" '{ if (!($1 in b)) b[$1] = $2; if ($2 + 0 > p[$1] + 0) p[$1] = $2 }
    END { for (i in b) printf "%s: gpu %s driver used MiB before start %s, peak %s\n", n, i, b[i], p[i] }' \
    "$out/$name.mem" | sort | tee -a "$out/summary.txt"
  grep -h 'memory plan\|stage\|NCCL' "$out/$name.serve.log" | sed 's/\x1b\[[0-9;]*m//g' | head -40 >>"$out/summary.txt"
  if grep -q panicked "$out/$name.serve.log"; then rc=1; fi
}
