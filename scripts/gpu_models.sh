#!/usr/bin/env bash
# Model-level GPU checks with a prebuilt `sanmai` binary (built elsewhere with
# `cargo build --release --features cuda`, stripped, copied as BIN_DIR/sanmai). Builds nothing.
#
#   scripts/gpu_models.sh OUT_DIR [BIN_DIR]
#
# Writes OUT_DIR/models.log:
# - `sanmai bench --device cuda` (decode tok/s with the roofline line, prefill, TTFT) on the built-in model
#   and on dummy weights of the full-size configs in $SANMAI_BENCH_CONFIGS (default: Qwen3-Next-80B-A3B
#   and qwen4_exp-125B-A6B, both with their quantization mix); a config with a `ple` block gets a table made
#   with `sanmai ple create --rows-scale $SANMAI_PLE_ROWS_SCALE` (default 0.05, about 4.8 GB) in a
#   temporary directory; with --kernel-times, each batch size's decode step by kernel (timed inside
#   the graph replay, after the untimed figures);
# - decode at batch 1 after prompts of each length in $SANMAI_BENCH_CONTEXTS (default "1024 16384") on
#   the first of those configs: the roofline share at a long context beside a short one;
# - `sanmai serve --device cuda` on the built-in model: the memory plan line, a chat completion through
#   curl, a streamed one, and the server's shutdown.
set -uo pipefail
out=${1:?usage: gpu_models.sh OUT_DIR [BIN_DIR]}
bin_dir=${2:-.device-bin}
sanmai="$bin_dir/sanmai"
log="$out/models.log"
mkdir -p "$out"
: >"$log"
[ -x "$sanmai" ] || { echo "skipped: no executable $sanmai" | tee -a "$log"; exit 0; }
configs=${SANMAI_BENCH_CONFIGS:-configs/models/qwen3-next-80b-a3b.json configs/models/qwen4-exp-125b-a6b.json}
batches=${SANMAI_BENCH_BATCH:-1,4,8}
rc=0

run() {
  echo "\$ $*" >>"$log"
  local t0=$(date +%s)
  "$@" >>"$log" 2>"$out/last.err" || { rc=1; tail -20 "$out/last.err" >>"$log"; }
  grep -h 'memory plan\|model loaded' "$out/last.err" | sed 's/\x1b\[[0-9;]*m//g' >>"$log"
  echo "($(($(date +%s) - t0)) s)" >>"$log"
}

run "$sanmai" bench --device cuda --batch "$batches" --prompt-len 512 --gen-len 64
for c in $configs; do
  extra=()
  if grep -q '"ple"' "$c"; then
    table=$(mktemp -d)
    run "$sanmai" ple create --config "$c" --out "$table" --rows-scale "${SANMAI_PLE_ROWS_SCALE:-0.05}" --fill zeros
    extra=(--ple-table "$table")
  fi
  run "$sanmai" bench --device cuda --load-format dummy --config "$c" "${extra[@]}" --batch "$batches" \
    --prompt-len 512 --gen-len 32 --kernel-times
  [ -n "${table:-}" ] && rm -rf "$table" && table=
done
first=${configs%% *}
for ctx in ${SANMAI_BENCH_CONTEXTS:-1024 16384}; do
  run "$sanmai" bench --device cuda --load-format dummy --config "$first" --batch 1 --prompt-len "$ctx" --gen-len 32
done

port=18431
RUST_LOG=info NO_COLOR=1 "$sanmai" serve --device cuda --port "$port" >"$out/serve.log" 2>&1 &
pid=$!
for _ in $(seq 240); do
  curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.5
done
{
  echo "\$ sanmai serve --device cuda (built-in model)"
  grep -h 'memory plan\|model loaded' "$out/serve.log"
  curl -sS "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"sanmai-demo","messages":[{"role":"user","content":"Hello!"}],"max_tokens":16}'
  echo
  curl -sSN "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"sanmai-demo","messages":[{"role":"user","content":"Hi"}],"max_tokens":4,"stream":true}' | tail -3
} >>"$log" 2>&1 || rc=1
kill -TERM "$pid" 2>/dev/null
wait "$pid"
echo "serve exit: $?" >>"$log"
grep -q panicked "$out/serve.log" && rc=1
exit $rc
