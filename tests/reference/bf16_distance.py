#!/usr/bin/env python3
"""How far the reference itself lands from its float64 fixtures when it computes in bfloat16.

Usage:  python3 bf16_distance.py FIXTURES_DIR [--device cpu|cuda] [--dtypes bfloat16,float32] [--json OUT]

For every fixture directory under FIXTURES_DIR that this script knows (the transformers checkpoints of
make_fixtures.py and the qwen4_exp checkpoints of qwen4_exp_ref.py), loads the saved bf16 weights into
the same reference model the fixture was made with, runs each recorded prompt in each dtype (weights and
activations in that dtype, as transformers runs a bf16 checkpoint), and prints the error of its prompt
log-probabilities against the float64 `prompt_logprobs` of reference.json, in the form of the GPU
end-to-end test's lines:

  DIST model=NAME dtype=bfloat16 prompt=P tokens=N mean_err=… max_err=…

That is the distance a bf16 implementation of the same model starts from, which the GPU backend's
whole-pass bounds are read against (the tiny random checkpoints amplify rounding). With --json, also
writes {fixture: [{"prompt", "tokens", "mean_err", "max_err"}, ...]} of the bf16 runs (the committed
tests/fixtures/bf16_distance.json, which the GPU end-to-end tests read).
"""

import argparse
import copy
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402
import qwen4_exp_ref as q4  # noqa: E402

HF = {"qwen3_next_tiny": Qwen3NextForCausalLM, "qwen3_5_moe_text_tiny": Qwen3_5MoeForCausalLM}
EXT_KEYS = ("qsa", "ple", "hyper_connections")


def hf_logits(name, d, dtype, device):
    model = HF[name].from_pretrained(d, dtype=dtype, **mf.IMPL).to(device).eval()
    return lambda ids: model(ids[None].to(device)).logits[0]


def q4_logits(d, dtype, device):
    cfg = json.load(open(os.path.join(d, "config.json")))
    ext = {k: cfg[k] for k in EXT_KEYS if cfg.get(k)}
    ext["mtp"] = cfg.get("mtp_num_hidden_layers", 0) > 0
    kwargs = copy.deepcopy(mf.QWEN3_5_TEXT_KWARGS)
    kwargs["mtp_num_hidden_layers"] = 1 if ext["mtp"] else 0
    model = q4.Qwen4Exp(kwargs, ext).eval()
    saved = load_file(os.path.join(d, "model.safetensors"))
    sd = {("" if k.startswith("mtp.") else "lm.") + k: v for k, v in saved.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{d}: missing {missing[:5]} unexpected {unexpected[:5]}")
    model = model.to(dtype).to(device)
    table = None
    if ext.get("ple"):
        raw = open(os.path.join(d, "ple.bin"), "rb").read()
        row_dim = ext["ple"]["row_dim"]
        table = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).view(-1, row_dim).to(torch.float64)

    def run(ids):
        rows = None
        if table is not None:
            rows, _ = q4.ple_rows(table, [int(t) for t in ids], ext["ple"])
            rows = rows.to(dtype).to(device)
        return model.logits(ids.to(device), rows)

    return run


@torch.no_grad()
def distance(name, d, dtype, device):
    """One line per prompt; returns [{"prompt", "tokens", "mean_err", "max_err"}]."""
    ref = json.load(open(os.path.join(d, "reference.json")))
    logits = hf_logits(name, d, dtype, device) if name in HF else q4_logits(d, dtype, device)
    out = []
    for pi, p in enumerate(ref["prompts"]):
        ids = torch.tensor(p["ids"])
        lp = torch.log_softmax(logits(ids).to(torch.float64), dim=-1).cpu()
        errs = [abs(float(lp[t - 1, ids[t]]) - p["prompt_logprobs"][t]) for t in range(1, len(ids))]
        mean, worst = sum(errs) / len(errs), max(errs)
        dt = str(dtype).removeprefix("torch.")
        print(
            f"DIST model={name} dtype={dt} prompt={pi} tokens={len(ids)} mean_err={mean:.3f} max_err={worst:.3f}",
            flush=True,
        )
        out.append({"prompt": pi, "tokens": len(ids), "mean_err": round(mean, 4), "max_err": round(worst, 4)})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fixtures")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--json", help="write the bf16 runs' distances here")
    args = ap.parse_args()
    found = {}
    dtypes = [getattr(torch, t) for t in args.dtypes.split(",")]
    for name in sorted(os.listdir(args.fixtures)):
        d = os.path.join(args.fixtures, name)
        cfg_path = os.path.join(d, "config.json")
        if not os.path.exists(os.path.join(d, "reference.json")) or not os.path.exists(cfg_path):
            continue
        model_type = json.load(open(cfg_path)).get("model_type")
        if name not in HF and model_type != "qwen4_exp":
            continue
        for dtype in dtypes:
            try:
                rows = distance(name, d, dtype, args.device)
            except Exception as e:  # one fixture failing should not hide the others
                print(f"DIST model={name} dtype={dtype} error={type(e).__name__}: {e}", flush=True)
                continue
            if dtype == torch.bfloat16:
                found[name] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1, sort_keys=True)
            f.write("\n")


if __name__ == "__main__":
    main()
