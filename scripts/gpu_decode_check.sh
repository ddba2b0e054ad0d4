#!/usr/bin/env bash
# The decode-kernel check of one GPU host, in one run, with prebuilt binaries (scripts/gpu_bins.sh
# BIN_DIR): the parity suite, the GDN decode timings, the MoE combine's and the INT8 output
# projection's (alone, then the add and norm, and both in one launch), the decode attention's (batch 1
# and 8, 576 to 32,768 positions), the one-launch MoE, GDN and attention layers' (with their phases), and, on dummy weights
# of each config, three arms: the default (`on`), the fused launches without the one-launch MoE, GDN and
# attention layers (`launches`, `SANMAI_MOE_LAYER=0 SANMAI_GDN_LAYER=0 SANMAI_ATTN_LAYER=0`) and no fused launches (`off`, `SANMAI_FUSED_DECODE=0`). Greedy
# tokens and log-probs of one prompt: `launches` against `off` bit for bit (the same arithmetic), `on`
# against `launches` to its first differing token and the top two log-probs there (the layer sums in
# another order: a near-tie may flip); the alternated A/B of scripts/gpu_ab.sh, `on` against
# `launches` (its median inter-token latencies); a per-kernel table of each of those two. Builds
# nothing; run from the repository root.
#
#   scripts/gpu_decode_check.sh OUT_DIR BIN_DIR [CONFIG...]
#
# CONFIG defaults to configs/models/qwen3-next-80b-a3b.json. ROUNDS (default 3) runs of each arm in the
# A/B. Writes OUT_DIR/summary.md (what passed, the greedy comparison, the A/B table) and the logs beside
# it. Exits non-zero when a parity test fails, a run fails, or the greedy tokens differ.
set -uo pipefail
out=${1:?usage: gpu_decode_check.sh OUT_DIR BIN_DIR [CONFIG...]}
bin=${2:?usage: gpu_decode_check.sh OUT_DIR BIN_DIR [CONFIG...]}
shift 2
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=(configs/models/qwen3-next-80b-a3b.json)
mkdir -p "$out"
bin=$(cd "$bin" && pwd)
if [ -d "${CUDA_HOME:-/usr/local/cuda}/lib64" ]; then
  export LD_LIBRARY_PATH="${CUDA_HOME:-/usr/local/cuda}/lib64:${LD_LIBRARY_PATH:-}"
fi
summary="$out/summary.md"
rc=0
note() { echo "$*" | tee -a "$summary"; }
: >"$summary"

"$bin/parity" --test-threads=1 >"$out/parity.log" 2>&1 || rc=1
note "- parity: $(grep -h '^test result' "$out/parity.log" | head -1)"
grep -h 'FAILED\|panicked' "$out/parity.log" | head -5 | sed 's/^/  /' | tee -a "$summary"
"$bin/parity" --ignored --test-threads=1 --nocapture bench_gdn::bench_gdn_decode >"$out/bench_gdn.log" 2>&1 || rc=1
grep -h 'BENCH' "$out/bench_gdn.log" | sed 's/.*BENCH/  - BENCH/' | tee -a "$summary"
"$bin/parity" --ignored --test-threads=1 --nocapture bench_moe::bench_moe_decode >"$out/bench_moe.log" 2>&1 || rc=1
grep -h 'BENCH moe_combine' "$out/bench_moe.log" | sed 's/.*BENCH/  - BENCH/' | tee -a "$summary"
"$bin/parity" --ignored --test-threads=1 --nocapture bench_dense::bench_gemv_add_norm >"$out/bench_gemv_norm.log" 2>&1 || rc=1
grep -h 'BENCH' "$out/bench_gemv_norm.log" | sed 's/.*BENCH/  - BENCH/' | tee -a "$summary"
"$bin/parity" --ignored --test-threads=1 --nocapture bench_attn::bench_attention_decode >"$out/bench_attn.log" 2>&1 || rc=1
grep -h 'BENCH' "$out/bench_attn.log" | sed 's/.*BENCH/  - BENCH/' | tee -a "$summary"
for b in bench_moe_layer bench_gdn_layer bench_attn_layer; do
  "$bin/parity" --ignored --test-threads=1 --nocapture "$b::$b" >"$out/$b.log" 2>&1 || rc=1
  grep -h 'BENCH' "$out/$b.log" | sed 's/.*BENCH/  - BENCH/' | tee -a "$summary"
done

off="$out/sanmai-fused-off"
printf '#!/bin/sh\nSANMAI_FUSED_DECODE=0 exec "%s/sanmai" "$@"\n' "$bin" >"$off"
launches="$out/sanmai-layers-off"
printf '#!/bin/sh\nSANMAI_MOE_LAYER=0 SANMAI_GDN_LAYER=0 SANMAI_ATTN_LAYER=0 exec "%s/sanmai" "$@"\n' "$bin" >"$launches"
chmod +x "$off" "$launches"
for c in "${configs[@]}"; do
  name=$(basename "$c" .json)
  for arm in on launches off; do
    exe="$bin/sanmai"
    [ "$arm" = off ] && exe=$off
    [ "$arm" = launches ] && exe=$launches
    # One request: room for a few sequences of 4,096 tokens (the 125B's default context does not fit
    # beside its weights on an 80 GB card; the tokens do not depend on it).
    "$exe" generate --device cuda --load-format dummy --config "$c" --max-num-seqs 8 --max-model-len 4096 \
      --prompt-ids 785,3974,13876,38835,34208,916,279,15678,5562,323,1221 --max-tokens 48 --logprobs 2 \
      --json >"$out/greedy-$name-$arm.json" 2>"$out/greedy-$name-$arm.err"
    status=$?
    [ $status -eq 0 ] || { rc=1; note "- $name: generate ($arm) exited $status"; }
  done
  python3 - "$out" "$name" >>"$summary" <<'PY' || rc=1
import json, sys
out, name = sys.argv[1:3]
try:
    on, launches, off = (json.load(open(f"{out}/greedy-{name}-{arm}.json")) for arm in ("on", "launches", "off"))
except (OSError, ValueError) as e:
    print(f"- {name}: greedy outputs missing ({e})")
    sys.exit(1)
def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a["ids"], b["ids"])) if x != y), None)
same = launches["ids"] == off["ids"]
dl = max((abs(x - y) for x, y in zip(launches["logprobs"], off["logprobs"])), default=0.0)
first = first_diff(launches, off)
print(f"- {name}: greedy tokens fused launches on/off " + ("identical" if same else f"differ from token {first}")
      + f" ({len(off['ids'])} tokens), largest log-prob difference {dl:.3g}")
i = first_diff(on, launches)
if i is None:
    print(f"- {name}: greedy tokens with the one-launch layers identical to the launches'")
else:
    top = lambda g: ", ".join(f"{t['id']}: {t['logprob']:.4f}" for t in g["top_logprobs"][i])
    print(f"- {name}: with the one-launch layers the greedy tokens differ from token {i}; "
          f"top two there: layer [{top(on)}], launches [{top(launches)}]")
sys.exit(0 if same else 1)
PY
  tail -2 "$summary"
done

SANMAI_BENCH_CONFIGS="${configs[*]}" scripts/gpu_ab.sh "$out/ab" "$bin/sanmai" "$launches" "${ROUNDS:-3}" >/dev/null 2>&1 || rc=1
cat "$out/ab/ab.md" >>"$summary"
for c in "${configs[@]}"; do
  name=$(basename "$c" .json)
  for arm in on launches; do
    exe="$bin/sanmai"
    [ "$arm" = launches ] && exe=$launches
    "$exe" bench --device cuda --load-format dummy --config "$c" --batch 1,8 --prompt-len 512 --gen-len 32 \
      --kernel-times >"$out/kernels-$name-$arm.log" 2>&1 || rc=1
    note "- $name kernels ($arm): $(grep -h 'launches,' "$out/kernels-$name-$arm.log" | head -1 | sed 's/^ *//')"
  done
done
exit $rc
