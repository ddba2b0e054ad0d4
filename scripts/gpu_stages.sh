#!/usr/bin/env bash
# Pipeline stages on one GPU host with a prebuilt `sanmai` (built elsewhere with
# `cargo build --release --features cuda`, stripped, copied as BIN_DIR/sanmai). Builds nothing.
#
#   scripts/gpu_stages.sh OUT_DIR [BIN_DIR]
#
# For each case below, `sanmai serve` on dummy weights of a full-size config, the case's stages all on
# cuda:0 (as the three-card deployment runs on one big GPU), then:
# - the driver's used memory sampled every 200 ms for the whole run (OUT_DIR/CASE.mem, MiB);
# - the server's memory plan lines (OUT_DIR/CASE.serve.log);
# - greedy requests one at a time (token-id prompts of 40, 300, 1000 and 4000 tokens, 32 new tokens, top-5
#   logprobs, echo with prompt logprobs): OUT_DIR/CASE.seq.json, compared with the case's one-stage
#   run (OUT_DIR/compare.txt);
# - one chat completion (OUT_DIR/CASE.chat.json);
# - `sanmai bench serve` at concurrency 1 and 3 with the per-stage busy table (OUT_DIR/CASE.bench.log).
# Cases: the 125B qwen4_exp (PLE table from `sanmai ple create --rows-scale 0.05`) as 1 stage and as
# the 3x3090 preset's 3 stages of --gpu-memory-budget 23.5GiB (also with --no-pp-deferred-receive),
# and the 80B Qwen3-Next as 1 stage and as 2 stages of 23.5GiB, all with --max-model-len 32768 and
# steps of 256 tokens. `sanmai plan` for the preset's stages on cuda:0 (the q125-3 case) prints into
# OUT_DIR/plan.txt first. The cases q125-1-off and q125-3-off run q125-1 and q125-3 with the QSA K/V
# rows in pinned host memory (--qsa-kv-offload) and are compared with q125-1 too; every case also
# times decode at batch 1 after a prompt of 8,192 tokens (OUT_DIR/CASE.bench.log).
# SANMAI_STAGE_CASES picks cases by name (default: all).
set -uo pipefail
. "$(dirname "$0")/gpu_serve_lib.sh"
serve_setup gpu_stages.sh "$@"
q80=configs/models/qwen3-next-80b-a3b.json
cases=${SANMAI_STAGE_CASES:-q125-1 q125-3 q125-3-nodefer q80-1 q80-2}


"$sanmai" plan --config "$q125" --preset configs/deploy/3x3090.toml --device cuda:0,cuda:0,cuda:0 \
  >"$out/plan.txt" 2>&1 || rc=1

# The requests of a case (serve_run's BODY).
stage_requests() {
  local name=$1 url=$2
  greedy_requests "$url" 40 300 1000 4000 >"$out/$name.seq.json" 2>>"$out/$name.err" || rc=1
  curl -sS "$url/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model":"m","messages":[{"role":"user","content":"Hello!"}],"max_tokens":16,"temperature":0}' \
    >"$out/$name.chat.json" 2>>"$out/$name.err" || rc=1
  for c in 1 3; do
    "$sanmai" bench serve --url "$url" --concurrency $c --num-prompts $((3 * c)) \
      --prompt-len 512 --gen-len 64 >>"$out/$name.bench.log" 2>&1 || rc=1
  done
  "$sanmai" bench serve --url "$url" --concurrency 1 --num-prompts 2 \
    --prompt-len 8192 --gen-len 64 >>"$out/$name.bench.log" 2>&1 || rc=1
}
serve_case() { local name=$1; shift; serve_run "$name" stage_requests "$@"; }

# The one-stage runs get the budget one card would need for the whole model.
flags=(--max-model-len 32768 --max-num-seqs 4 --max-num-batched-tokens 256)
for c in $cases; do
  case $c in
    q125-1) serve_case q125-1 --load-format dummy --config "$q125" --ple-table "$table" --device cuda:0 \
      "${flags[@]}" --gpu-memory-budget 80GiB ;;
    q125-3) serve_case q125-3 --load-format dummy --config "$q125" --ple-table "$table" \
      --preset configs/deploy/3x3090.toml --device cuda:0,cuda:0,cuda:0 ;;
    q125-3-nodefer) serve_case q125-3-nodefer --load-format dummy --config "$q125" --ple-table "$table" \
      --preset configs/deploy/3x3090.toml --device cuda:0,cuda:0,cuda:0 --no-pp-deferred-receive ;;
    q125-1-off) serve_case q125-1-off --load-format dummy --config "$q125" --ple-table "$table" --device cuda:0 \
      "${flags[@]}" --gpu-memory-budget 80GiB --qsa-kv-offload ;;
    q125-3-off) serve_case q125-3-off --load-format dummy --config "$q125" --ple-table "$table" \
      --preset configs/deploy/3x3090.toml --device cuda:0,cuda:0,cuda:0 --qsa-kv-offload ;;
    q80-1) serve_case q80-1 --load-format dummy --config "$q80" --device cuda:0 "${flags[@]}" \
      --gpu-memory-budget 50GiB ;;
    q80-2) serve_case q80-2 --load-format dummy --config "$q80" --pipeline-parallel-size 2 \
      --device cuda:0,cuda:0 "${flags[@]}" --gpu-memory-budget 23.5GiB ;;
  esac
done

# One stage against several, and with offload: the sequential greedy answers must be identical.
compare_runs "$out" q125-1:q125-3 q125-1:q125-1-off q125-1:q125-3-off q80-1:q80-2 >"$out/compare.txt" 2>&1 || rc=1
cat "$out/compare.txt" >>"$out/summary.txt"
exit $rc
