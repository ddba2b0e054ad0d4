#!/usr/bin/env python3
"""Checks fast.py's training-step pieces against transformers' originals in float64 on the CPU, and
that a whole training step has no host syncs (which would stop a CUDA graph capture).

    python3 check_fast.py

Prints the largest differences (forward and gradients) and exits 1 if one exceeds 1e-9 (1e-3
relative for the whole step's gradients: transformers computes the gated delta rule, its decay and
its gated norm in float32 even in a float64 model, and the decay parameters' small gradients carry
that rounding), or if the step
calls an op that reads a device value back to the host.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35  # noqa: E402

import batching  # noqa: E402
import fast  # noqa: E402
import train  # noqa: E402

TOL = 1e-9
REL_TOL = 1e-3
LAYERS = "linear_attention,full_attention,linear_attention,full_attention,linear_attention,full_attention"
worst = {}


def diff(name, a, b):
    d = float((a - b).abs().max())
    worst[name] = max(worst.get(name, 0.0), d)


class Args:
    config = train.DEFAULT_CONFIG
    hidden_size = num_experts = experts_per_tok = moe_intermediate_size = shared_intermediate_size = None
    layers = LAYERS
    aux_loss = 0.01
    mtp_weight = 0.3
    active = None


def build(impl, seed=0):
    _, _, cfg = train.build_config(Args)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = impl
    torch.manual_seed(seed)
    model = train.Qwen3_5MoeForCausalLM(cfg).double()
    model.tie_weights()
    mtp = train.MtpHead(cfg).double()
    with torch.no_grad():  # non-zero norms and routers, so that every path matters
        for p in list(model.parameters()) + list(mtp.parameters()):
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
            layer.mlp.experts.gate_up_proj.normal_(0, 0.1)
            layer.mlp.experts.down_proj.normal_(0, 0.1)
    return model, mtp


def check_experts():
    _, _, cfg = train.build_config(Args)
    for impl in ("eager", "dense"):
        cfg._experts_implementation_internal = impl
    torch.manual_seed(1)
    block = q35.Qwen3_5MoeSparseMoeBlock(cfg).double()
    with torch.no_grad():
        block.gate.weight.normal_(0, 1)
        block.experts.gate_up_proj.normal_(0, 0.1)
        block.experts.down_proj.normal_(0, 0.1)
    x = torch.randn(3, 17, cfg.hidden_size, dtype=torch.float64)
    outs = {}
    for impl in ("eager", "dense"):
        cfg._experts_implementation_internal = impl
        block.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = block(xi)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        outs[impl] = [y.detach(), xi.grad] + [p.grad.clone() for p in block.parameters()]
    for a, b in zip(outs["eager"], outs["dense"]):
        diff("experts (output and gradients)", a, b)


def check_head():
    torch.manual_seed(2)
    h = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(300, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 300, (50,))
    wt = (torch.rand(50) < 0.8).double()
    ref = (F.cross_entropy(h @ w.t(), t, reduction="none") * wt).sum() / wt.sum()
    gh, gw = torch.autograd.grad(ref, (h, w))
    got = fast.head_loss(h, w, t, wt, chunk=7)
    fh, fw = torch.autograd.grad(got, (h, w))
    diff("head loss", ref, got)
    diff("head loss gradients", torch.cat([gh.flatten(), gw.flatten()]), torch.cat([fh.flatten(), fw.flatten()]))
    # With a per-column correction (the sampled softmax of --negatives).
    bias = torch.randn(300, dtype=torch.float64)
    ref = (F.cross_entropy(h @ w.t() + bias, t, reduction="none") * wt).sum() / wt.sum()
    gh, gw = torch.autograd.grad(ref, (h, w))
    got = fast.head_loss(h, w, t, wt, chunk=7, bias=bias)
    fh, fw = torch.autograd.grad(got, (h, w))
    diff("head loss with a column correction", ref, got)
    diff("head loss with a column correction, gradients", torch.cat([gh.flatten(), gw.flatten()]),
         torch.cat([fh.flatten(), fw.flatten()]))


def check_aux():
    torch.manual_seed(3)
    logits = tuple(torch.randn(40, 8, dtype=torch.float64) for _ in range(3))
    diff("load-balancing loss", q35.load_balancing_loss_func(logits, 8, 2), fast.load_balancing_loss(logits, 8, 2))


def old_step_loss(model, mtp, ids, mask, args):
    """train.py's step loss before fast.py: boolean-mask selection, plain cross-entropy."""
    out = model.model(input_ids=ids, use_cache=False, output_router_logits=True)
    h = out.last_hidden_state
    sel = mask[:, 1:]
    w = model.lm_head.weight
    loss = F.cross_entropy(F.linear(h[:, :-1][sel], w), ids[:, 1:][sel])
    d = mtp(model, ids, h)
    sel2 = mask[:, 2:]
    mtp_loss = F.cross_entropy(F.linear(d[:, :-1][sel2], w), ids[:, 2:][sel2])
    aux = q35.load_balancing_loss_func(out.router_logits, model.config.num_experts, model.config.num_experts_per_tok)
    return loss + args.mtp_weight * mtp_loss + args.aux_loss * aux, loss, mtp_loss, aux


def toy_batch(rng, n=6):
    lengths = rng.integers(20, 60, n)
    ids = rng.integers(0, 5000, int(lengths.sum())).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    starts = (lengths * rng.uniform(0.3, 0.8, n)).astype(np.int32)
    b = batching.Batches(ids, offsets, starts, tokens_per_batch=64 * n, max_rows=n, reply_cap=4096,
                         pad_id=248044, seed=0, max_len=64)
    return b.assemble(0, list(range(n))), b


def check_step():
    batch, _ = toy_batch(np.random.default_rng(4))
    ids = batch["ids"]
    # the reply mask the old code used, rebuilt from the gathered positions
    mask = torch.zeros_like(ids, dtype=torch.bool)
    t = ids.shape[1]
    for p, wt in zip(batch["pos1"].tolist(), batch["w1"].tolist()):
        if wt:
            mask[p // t, p % t + 1] = True
    results = {}
    for impl, fn in (("eager", "old"), ("dense", "new")):
        model, mtp = build(impl)
        if fn == "old":
            total, *parts = old_step_loss(model, mtp, ids, mask, Args)
        else:
            total, *parts = train.step_loss(model, mtp, batch, Args)
        total.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p)
                 for p in list(model.parameters()) + list(mtp.parameters())]
        results[fn] = (torch.stack([total] + [torch.as_tensor(x, dtype=torch.float64) for x in parts]), grads)
    diff("training step losses", results["old"][0], results["new"][0])
    # transformers computes the gated delta rule and its decay in float32 even in a float64 model, so
    # the gradients below it carry float32 rounding: compared relative to each tensor's largest one.
    rel = max(float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
              for a, b in zip(results["old"][1], results["new"][1]))
    worst["training step gradients (relative; float32 inside the gated delta rule)"] = rel


def check_syncs():
    batch, _ = toy_batch(np.random.default_rng(5))
    model, mtp = build("dense")
    model.float(), mtp.float()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        total, *_ = train.step_loss(model, mtp, batch, Args)
        total.backward()
    syncs = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::is_nonzero", "aten::bincount",
             "aten::masked_select", "aten::unique", "aten::_unique2"}
    found = sorted({e.name for e in prof.events() if e.name in syncs})
    return found


def main():
    check_experts()
    check_head()
    check_aux()
    check_step()
    found = check_syncs()
    bad = False
    for k, v in worst.items():
        ok = v <= (REL_TOL if "relative" in k else TOL)
        bad |= not ok
        print(f"{'ok ' if ok else 'BAD'} {k}: max abs diff {v:.3g}")
    print(f"{'ok ' if not found else 'BAD'} host syncs in a training step: {found or 'none'}")
    return 1 if bad or found else 0


if __name__ == "__main__":
    sys.exit(main())
