#!/usr/bin/env bash
# Pipeline stages on two to four GPUs of one host, the stages linked by NCCL, with prebuilt binaries
# (built elsewhere: scripts/gpu_bins.sh BIN_DIR puts `sanmai` and the `nccl_link` test there). Builds
# nothing.
#
#   scripts/gpu_multi.sh OUT_DIR [BIN_DIR]
#
# Needs 2 or more GPUs (nvidia-smi -L). Writes into OUT_DIR:
# - gpus.txt: the GPUs and their topology (nvidia-smi topo -m); nccl.txt: the NCCL the dynamic loader
#   offers (ldconfig -p) and nccl_link.log: BIN_DIR/nccl_link run with SANMAI_REQUIRE_NCCL=1 (which
#   library and version the process loaded, and residual-stream-sized tensors sent cuda:0 -> cuda:1
#   bit for bit);
# - for each case below, as scripts/gpu_stages.sh does: the serve log with its memory plan and the
#   stage links it made (CASE.serve.log), the driver's used memory every 200 ms (CASE.mem), greedy
#   requests one at a time (token-id prompts of 40, 300, 1000 and 4000 tokens, 32 new tokens, top-5
#   logprobs, echo with prompt logprobs; CASE.seq.json), `sanmai bench serve` at concurrency 1 and N
#   (N = the number of stages) with its per-stage busy and idle table (CASE.bench.log);
# - on the N-GPU cases, 64 concurrent streamed chat completions, every fourth cancelled after its third
#   chunk: all the others must finish, and /metrics must show no request running or waiting within
#   30 s, after which one more request must succeed (CASE.storm.json);
# - compare.txt: each multi-GPU case's greedy answers against its one-GPU run (text and logprobs
#   identical); summary.txt collects the lines that matter.
# Cases (SANMAI_MULTI_CASES picks by name; default all):
# - q80-1: the 80B Qwen3-Next dummy (INT4 experts / INT8 / INT6 mix) on cuda:0 alone;
# - q80-2g / q80-2g-nodefer: the same as 2 stages on cuda:0 and cuda:1, --gpu-memory-budget 23.5GiB each,
#   the second with --no-pp-deferred-receive;
# - q125-1: the 125B qwen4_exp dummy with its PLE table on cuda:0 alone;
# - q125-ng: the 3x3090 preset's 3 stages on cuda:0..2 (23.5GiB each) where 3 GPUs exist, otherwise 2
#   stages on cuda:0 and cuda:1 with --gpu-memory-budget SANMAI_MULTI_BUDGET2 (default 36GiB: the
#   125B's weights do not fit two 23.5 GiB stages).
set -uo pipefail
. "$(dirname "$0")/gpu_serve_lib.sh"
serve_setup gpu_multi.sh "$@"
bin_dir=${2:-.device-bin}
q80=configs/models/qwen3-next-80b-a3b.json
cases=${SANMAI_MULTI_CASES:-q80-1 q80-2g q80-2g-nodefer q125-1 q125-ng}

ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
{ nvidia-smi -L; nvidia-smi topo -m; } >"$out/gpus.txt" 2>&1
if [ "$ngpu" -lt 2 ]; then
  echo "gpu_multi.sh: $ngpu GPU(s) here; it needs 2 or more" | tee -a "$out/summary.txt"
  exit 1
fi
echo "GPUs: $ngpu" | tee -a "$out/summary.txt"
# The one-GPU runs get what one card has, less 2 GiB, up to 80 GiB.
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | tr -d ' ')
one_budget="$(( mib / 1024 - 2 < 80 ? mib / 1024 - 2 : 80 ))GiB"

ldconfig -p 2>/dev/null | grep -i nccl >"$out/nccl.txt"
if [ -x "$bin_dir/nccl_link" ]; then
  SANMAI_REQUIRE_NCCL=1 "$bin_dir/nccl_link" --nocapture --test-threads 1 >"$out/nccl_link.log" 2>&1 || rc=1
  grep -h 'NCCL\|test result' "$out/nccl_link.log" | head -10 >>"$out/summary.txt"
else
  echo "no $bin_dir/nccl_link: the NCCL link test did not run" | tee -a "$out/summary.txt"
fi

# storm URL: 64 concurrent streams, every fourth cancelled; the rest finish; the server ends idle.
storm() {
  python3 - "$1" <<'PY'
import http.client, json, sys, threading, time, urllib.parse, urllib.request
base = urllib.parse.urlparse(sys.argv[1])
results = [None] * 64
def one(i):
    body = {"model": "m", "stream": True, "max_tokens": 64, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Request {i}: count to twenty."}]}
    conn = http.client.HTTPConnection(base.hostname, base.port, timeout=900)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        r = conn.getresponse()
        chunks, finish = 0, None
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunks += 1
            for c in json.loads(line[6:]).get("choices", []):
                finish = c.get("finish_reason") or finish
            if i % 4 == 0 and chunks == 3:
                results[i] = {"cancelled": True, "chunks": chunks}
                return
        results[i] = {"cancelled": False, "chunks": chunks, "finish_reason": finish, "status": r.status}
    except Exception as e:
        results[i] = {"cancelled": i % 4 == 0, "error": repr(e)}
    finally:
        conn.close()
t0 = time.time()
threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
for t in threads: t.start()
for t in threads: t.join()
done = time.time() - t0
def gauge(name):
    text = urllib.request.urlopen(sys.argv[1] + "/metrics", timeout=30).read().decode()
    return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(f"sanmai:{name}{{"))
idle_after = None
for k in range(60):
    if gauge("num_requests_running") == 0 and gauge("num_requests_waiting") == 0:
        idle_after = round(k * 0.5, 1)
        break
    time.sleep(0.5)
req = urllib.request.Request(sys.argv[1] + "/v1/chat/completions", json.dumps(
    {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello!"}]}).encode(),
    {"content-type": "application/json"})
after = json.load(urllib.request.urlopen(req, timeout=300))["choices"][0]["finish_reason"]
kept = [r for r in results if r and not r["cancelled"]]
ok = [r for r in kept if r.get("finish_reason") in ("length", "stop") and not r.get("error")]
report = {"streams": 64, "cancelled": sum(1 for r in results if r and r["cancelled"]), "completed": len(ok),
          "expected_complete": len(kept), "seconds": round(done, 2), "idle_after_s": idle_after,
          "request_after": after, "results": results}
json.dump(report, sys.stdout, indent=1)
sys.exit(0 if len(ok) == len(kept) and idle_after is not None and after else 1)
PY
}

# The requests of a case (serve_run's BODY); `stages` is the case's number of stages.
multi_requests() {
  local name=$1 url=$2
  greedy_requests "$url" 40 300 1000 4000 >"$out/$name.seq.json" 2>>"$out/$name.err" || rc=1
  for c in 1 "$stages"; do
    "$sanmai" bench serve --url "$url" --concurrency "$c" --num-prompts $((3 * c)) \
      --prompt-len 512 --gen-len 64 >>"$out/$name.bench.log" 2>&1 || rc=1
  done
  if [ "$stages" -gt 1 ]; then
    storm "$url" >"$out/$name.storm.json" 2>>"$out/$name.err" || rc=1
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); r.pop("results"); print(sys.argv[2], "storm:", r)' \
      "$out/$name.storm.json" "$name" >>"$out/summary.txt" 2>&1
  fi
}
serve_case() { local name=$1; stages=$2; shift 2; serve_run "$name" multi_requests "$@"; }

flags=(--max-model-len 32768 --max-num-seqs 4 --max-num-batched-tokens 256)
n125=$(( ngpu >= 3 ? 3 : 2 ))
for c in $cases; do
  case $c in
    q80-1) serve_case q80-1 1 --load-format dummy --config "$q80" --device cuda:0 "${flags[@]}" \
      --gpu-memory-budget "$one_budget" ;;
    q80-2g) serve_case q80-2g 2 --load-format dummy --config "$q80" --pipeline-parallel-size 2 \
      --device cuda:0,cuda:1 "${flags[@]}" --gpu-memory-budget 23.5GiB ;;
    q80-2g-nodefer) serve_case q80-2g-nodefer 2 --load-format dummy --config "$q80" --pipeline-parallel-size 2 \
      --device cuda:0,cuda:1 "${flags[@]}" --gpu-memory-budget 23.5GiB --no-pp-deferred-receive ;;
    q125-1) serve_case q125-1 1 --load-format dummy --config "$q125" --ple-table "$table" --device cuda:0 \
      "${flags[@]}" --gpu-memory-budget "$one_budget" ;;
    q125-ng)
      if [ "$n125" = 3 ]; then
        serve_case q125-ng 3 --load-format dummy --config "$q125" --ple-table "$table" \
          --preset configs/deploy/3x3090.toml --device cuda:0,cuda:1,cuda:2 --max-model-len 32768
      else
        serve_case q125-ng 2 --load-format dummy --config "$q125" --ple-table "$table" \
          --preset configs/deploy/3x3090.toml --pipeline-parallel-size 2 --device cuda:0,cuda:1 \
          --max-model-len 32768 --gpu-memory-budget "${SANMAI_MULTI_BUDGET2:-36GiB}"
      fi ;;
  esac
done

compare_runs "$out" q80-1:q80-2g q80-1:q80-2g-nodefer q125-1:q125-ng >"$out/compare.txt" 2>&1 || rc=1
cat "$out/compare.txt" >>"$out/summary.txt"
exit $rc
