#!/usr/bin/env bash
# A/B of two prebuilt `sanmai` binaries (built elsewhere with `cargo build --release --features cuda`)
# on one GPU host: `sanmai bench --device cuda` on dummy weights of each full-size config, the two
# binaries alternated back to back (A, B, A, B, ...) so that both see the same machine state, then a
# summary of decode and prefill tok/s per config, arm and batch size: every run's figure, the median
# and the spread (max − min), and the median inter-token latency of each run (steadier than the mean
# rate the tok/s come from, which a few slow steps move). Builds nothing.
#
#   scripts/gpu_ab.sh OUT_DIR SANMAI_A SANMAI_B [ROUNDS]
#
# ROUNDS (default 2) runs of each arm per config. Configs: $SANMAI_BENCH_CONFIGS (default: the
# Qwen3-Next-80B-A3B and qwen4_exp-125B-A6B configs with their quantization mix); batch sizes
# $SANMAI_BENCH_BATCH (default 1,4,8); prompt lengths $SANMAI_AB_PROMPT_LEN (default 512; a list such as
# 512,4096 measures each with every batch size in one process). An arm may be a
# wrapper that sets a switch's variable, e.g. a script running `SANMAI_FP8_TENSOR_CORES=0 exec
# BIN_DIR/sanmai "$@"`, to compare the two sides of a switch in one build. A config with a `ple` block gets one table, made by SANMAI_B with
# `sanmai ple create --rows-scale $SANMAI_PLE_ROWS_SCALE` (default 0.05) in a temporary directory and
# read by both arms. Writes OUT_DIR/ab.log (every run's output) and OUT_DIR/ab.md (the summary), and
# prints the summary. Exits non-zero when a run fails.
set -uo pipefail
out=${1:?usage: gpu_ab.sh OUT_DIR SANMAI_A SANMAI_B [ROUNDS]}
a=${2:?usage: gpu_ab.sh OUT_DIR SANMAI_A SANMAI_B [ROUNDS]}
b=${3:?usage: gpu_ab.sh OUT_DIR SANMAI_A SANMAI_B [ROUNDS]}
rounds=${4:-2}
configs=${SANMAI_BENCH_CONFIGS:-configs/models/qwen3-next-80b-a3b.json configs/models/qwen4-exp-125b-a6b.json}
batches=${SANMAI_BENCH_BATCH:-1,4,8}
mkdir -p "$out"
log="$out/ab.log"
: >"$log"
rc=0
for c in $configs; do
  extra=()
  table=
  if grep -q '"ple"' "$c"; then
    table=$(mktemp -d)
    "$b" ple create --config "$c" --out "$table" --rows-scale "${SANMAI_PLE_ROWS_SCALE:-0.05}" \
      --fill zeros >>"$log" 2>&1 || rc=1
    extra=(--ple-table "$table")
  fi
  for r in $(seq "$rounds"); do
    for arm in A B; do
      bin=$a
      [ "$arm" = B ] && bin=$b
      echo "=== config=$c arm=$arm round=$r" >>"$log"
      "$bin" bench --device cuda --load-format dummy --config "$c" "${extra[@]}" --batch "$batches" \
        --prompt-len "${SANMAI_AB_PROMPT_LEN:-512}" --gen-len 32 >>"$log" 2>"$out/last.err" || { rc=1; tail -20 "$out/last.err" >>"$log"; }
    done
  done
  [ -n "$table" ] && rm -rf "$table"
done

python3 - "$log" >"$out/ab.md" <<'PY'
import re, statistics, sys
runs, cur = {}, None
for line in open(sys.argv[1]):
    m = re.match(r"=== config=(\S+) arm=(\S) round=(\d+)", line)
    if m:
        cur = (m[1].split("/")[-1], m[2])
        continue
    m = re.match(r"batch (\d+): prefill ([\d.]+) tok/s \(TTFT median [\d.]+ ms, prompt (\d+) tokens\).*decode ([\d.]+) tok/s"
                 r"(?:, inter-token latency median ([\d.]+) ms)?", line)
    if m and cur:
        itl = float(m[5]) if m[5] else float("nan")
        runs.setdefault(cur + (int(m[3]), int(m[1])), []).append((float(m[2]), float(m[4]), itl))
print("| config | prompt | batch | arm | decode tok/s (runs) | decode median | spread | ITL median ms (runs) | "
      "ITL median | prefill tok/s (runs) | prefill median |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for key in sorted(runs, key=lambda k: (k[0], k[2], k[3], k[1])):
    pre = [p for p, _, _ in runs[key]]
    dec = [d for _, d, _ in runs[key]]
    itl = [i for _, _, i in runs[key]]
    print(f"| {key[0]} | {key[2]} | {key[3]} | {key[1]} | {' / '.join(f'{d:.1f}' for d in dec)} | "
          f"{statistics.median(dec):.1f} | {max(dec) - min(dec):.1f} | {' / '.join(f'{i:.2f}' for i in itl)} | "
          f"{statistics.median(itl):.2f} | {' / '.join(f'{p:.0f}' for p in pre)} | {statistics.median(pre):.0f} |")
PY
cat "$out/ab.md"
exit $rc
