#!/usr/bin/env bash
# Builds what scripts/gpu_check.sh runs on a GPU host and copies it, stripped, into BIN_DIR:
# `sanmai` (release, --features cuda) and the sanmai-cuda test binaries (parity, e2e, graphs, packed,
# qsa_ple, qsa_ple_e2e, mrope, vision, fp8, and nccl_link for scripts/gpu_multi.sh). Run from the
# repository root on the build machine (no GPU needed). The executables are found through cargo's JSON
# messages, so a CARGO_TARGET_DIR is honoured.
#
#   scripts/gpu_bins.sh BIN_DIR
set -euo pipefail
dir=${1:?usage: gpu_bins.sh BIN_DIR}
mkdir -p "$dir"
rm -f "$dir"/*

# "KIND NAME EXECUTABLE" for each executable artifact of cargo's JSON messages on stdin.
executables() {
  python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["kind"][0], m["target"]["name"], m["executable"])
'
}

cargo build --release --features cuda --message-format=json 2>/dev/null | executables |
  while read -r kind name exe; do
    [ "$kind $name" = "bin sanmai" ] && install -m 755 "$exe" "$dir/sanmai"
  done
cargo test -p sanmai-cuda --release --no-run --message-format=json 2>/dev/null | executables |
  while read -r kind name exe; do
    case "$kind $name" in
      "test parity" | "test e2e" | "test graphs" | "test packed" | "test qsa_ple" | "test qsa_ple_e2e" | \
        "test mrope" | "test vision" | "test fp8" | "test nccl_link") install -m 755 "$exe" "$dir/$name" ;;
    esac
  done
[ -x "$dir/sanmai" ] || { echo "gpu_bins.sh: cargo built no sanmai executable" >&2; exit 1; }
strip "$dir"/*
ls -l "$dir"
