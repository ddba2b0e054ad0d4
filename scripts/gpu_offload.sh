#!/usr/bin/env bash
# QSA K/V rows in pinned host memory on one GPU host, with a prebuilt `sanmai` (built elsewhere with
# `cargo build --release --features cuda`, stripped, copied as BIN_DIR/sanmai). Builds nothing.
#
#   scripts/gpu_offload.sh OUT_DIR [BIN_DIR]
#
# The 125B qwen4_exp config (dummy weights in its quantization mix, a PLE table from
# `sanmai ple create --rows-scale 0.05`) on cuda:0, served three ways: all K/V in VRAM (`vram`),
# the QSA K/V rows in host memory with the VRAM row cache (`cache`) and without it (`nocache`). Each
# case runs greedy requests one at a time, prompts of 40, 4,000 and 50,000 tokens (the last prefilled
# through the arena in sections) (OUT_DIR/CASE.seq.json; compared with `vram` in
# OUT_DIR/compare.txt: text and logprobs must be identical), then decode at batch 1 after prompts of
# each length in SANMAI_OFFLOAD_CONTEXTS (default "1024 8192 65536") with `sanmai bench serve`
# (OUT_DIR/CASE.bench.log) and the row-cache counters from /metrics (OUT_DIR/CASE.metrics).
# SANMAI_OFFLOAD_CASES picks cases (default "vram cache nocache").
set -uo pipefail
. "$(dirname "$0")/gpu_serve_lib.sh"
serve_setup gpu_offload.sh "$@"
cases=${SANMAI_OFFLOAD_CASES:-vram cache nocache}
contexts=${SANMAI_OFFLOAD_CONTEXTS:-1024 8192 65536}
longest=$(printf '%s\n' $contexts | sort -n | tail -1)
max_len=$((longest + 4096))


serve_case() {
  local name=$1; shift
  local port=$((18500 + RANDOM % 1000))
  RUST_LOG=info NO_COLOR=1 "$sanmai" serve --port "$port" --served-model-name m --load-format dummy \
    --config "$q125" --ple-table "$table" --device cuda:0 --max-model-len "$max_len" --max-num-seqs 4 \
    --max-num-batched-tokens 2048 --gpu-memory-budget 100GiB "$@" >"$out/$name.serve.log" 2>&1 &
  local pid=$!
  local ready=0
  wait_ready "$port" "$pid" && ready=1
  echo "$name: ready=$ready" | tee -a "$out/summary.txt"
  if [ $ready = 1 ]; then
    greedy_requests "http://127.0.0.1:$port" 40 4000 50000 >"$out/$name.seq.json" 2>>"$out/$name.err" || rc=1
    for n in $contexts; do
      local t0=$(date +%s)
      "$sanmai" bench serve --url "http://127.0.0.1:$port" --concurrency 1 --num-prompts 1 \
        --prompt-len "$n" --gen-len 128 >>"$out/$name.bench.log" 2>&1 || rc=1
      echo "$name: context $n took $(($(date +%s) - t0)) s" >>"$out/summary.txt"
    done
    curl -sS "http://127.0.0.1:$port/metrics" >"$out/$name.metrics" 2>/dev/null
  else
    rc=1
  fi
  kill -TERM "$pid" 2>/dev/null
  wait "$pid"
  grep -h 'memory plan\|pinned' "$out/$name.serve.log" | sed 's/\x1b\[[0-9;]*m//g' | head -8 >>"$out/summary.txt"
  grep -q panicked "$out/$name.serve.log" && rc=1
}

# The default arena (48,576 rows): the 50,000-token prompt and the longest context are prefilled
# through it in sections.
for c in $cases; do
  case $c in
    vram) serve_case vram ;;
    cache) serve_case cache --qsa-kv-offload ;;
    nocache) serve_case nocache --qsa-kv-offload --no-qsa-row-cache ;;
  esac
done

compare_runs "$out" vram:cache vram:nocache >"$out/compare.txt" 2>&1 || rc=1
cat "$out/compare.txt" >>"$out/summary.txt"
for c in $cases; do
  echo "== $c" >>"$out/summary.txt"
  grep -h "prompts of\|Median TPOT\|Median TTFT" "$out/$c.bench.log" >>"$out/summary.txt" 2>/dev/null
  grep -h "^sanmai:qsa_" "$out/$c.metrics" >>"$out/summary.txt" 2>/dev/null
done
exit $rc
