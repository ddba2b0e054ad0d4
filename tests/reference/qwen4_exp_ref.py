#!/usr/bin/env python3
"""A PyTorch implementation of qwen4_exp (the model contract's spec) and its tiny fixtures.

Usage:  python3 qwen4_exp_ref.py OUT_DIR [--base-fixture DIR]

qwen4_exp is Qwen3.5-MoE plus three independent blocks (QSA sparse attention with a lightning
indexer, the PLE hashed n-gram memory, hyper-connections) and an MTP head whose layer uses QSA.
This script builds the model on transformers' own Qwen3.5-MoE modules (embedding, decoder layers,
gated attention, GatedDeltaNet, MoE, RMSNorm, rotary embedding, lm_head) and adds the blocks as
plain torch modules attached under the names the checkpoint uses, so a state_dict of the model is
the checkpoint's tensor list.

It writes, under OUT_DIR, one directory per fixture:

  qwen4_exp_qsa_tiny/   qsa on (index_topk 32 < the longer prompts, so QSA selects) + MTP
  qwen4_exp_ple_tiny/   ple on (one GDN layer), with its table ple.bin + ple.json
  qwen4_exp_hc_tiny/    hyper_connections on (4 streams)
  qwen4_exp_all_tiny/   every block on (PLE on a GDN and the attention layer) + MTP

each holding config.json, model.safetensors (bf16; hyper-connection `pre` vectors f32),
reference.json and, for PLE, the table. References are computed on the CPU in float64 from the
saved bf16 weights (promoted), without a cache (every greedy step recomputes the whole sequence).

With --base-fixture pointing at the qwen3_5_moe_text_tiny fixture, it also checks that qwen4_exp
with every block off computes exactly what transformers' Qwen3_5MoeForCausalLM computes there.

Needs torch, transformers >= 5 and safetensors.
"""

import argparse
import copy
import json
import math
import os
import struct
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from torch import nn  # noqa: E402
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402

EOS = 7
GREEDY_STEPS = 24
MTP_POSITIONS = {0: [0, 1, 2, 3], 1: [0, 1, 31, 63, 64, 68]}
QSA_TRACE = {2: [31, 32, 40, 150, 299]}  # prompt index -> positions whose selected sets are recorded
EOS_AT = {1: [30], 2: [150, 151]}  # document boundaries put into the prompts

QSA = {"index_n_heads": 4, "index_head_dim": 16, "index_rope_dim": 8, "index_topk": 32}
HC = {"num_streams": 4, "rank": 16}
PLE_BASE = {
    "orders": [2, 3],
    "heads": 4,
    "row_dim": 8,
    "seed": 0,
    "table_sizes": [[1009, 1013, 1019, 1021], [2003, 2011, 2017, 2027]],
    "conv_kernel": 4,
    "conv_dilation": 3,
    "eos_token_id": EOS,
}
PLE_EPS = 1e-6
INDEX_EPS = 1e-6
FP8_MAX = 448.0
M64 = (1 << 64) - 1


def log(msg):
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------
# The blocks
# ----------------------------------------------------------------------------------------------


class PlainNorm(nn.Module):
    """`w · x · rsqrt(mean(x²) + eps)` (plain weight)."""

    def __init__(self, dim, eps=PLE_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def neox_rope(x, positions, rot_dim, theta):
    """NeoX RoPE on the first rot_dim dims of the last axis; x [n, ..., d], positions [n]."""
    if rot_dim == 0:
        return x
    half = rot_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # f32 like transformers' rotary tables
    cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(shape), sin.view(shape)
    x1, x2, rest = x[..., :half], x[..., half:rot_dim], x[..., rot_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def fp8_index_keys(k):
    """Spec §2.2: s = bf16(max|k|/448) (1 if 0); k8 = fp8_e4m3(k/s) in f32, RNE, saturating; k̂ = k8·s."""
    kf = k.float()
    s = (kf.abs().amax(-1) / FP8_MAX).to(torch.bfloat16).float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    k8 = (kf / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (k8.to(torch.float64) * s.to(torch.float64)[:, None]).to(k.dtype)


class Indexer(nn.Module):
    """QSA's lightning indexer (`self_attn.indexer.`)."""

    def __init__(self, hidden, qsa, theta):
        super().__init__()
        self.n, self.d, self.rope, self.topk = (
            qsa["index_n_heads"],
            qsa["index_head_dim"],
            qsa["index_rope_dim"],
            qsa["index_topk"],
        )
        self.theta = theta
        self.wq = nn.Linear(hidden, self.n * self.d, bias=False)
        self.wk = nn.Linear(hidden, self.d, bias=False)
        self.k_norm = nn.LayerNorm(self.d, eps=INDEX_EPS)
        self.weights_proj = nn.Linear(hidden, self.n, bias=False)

    def select(self, x):
        """x [n, H] (the normed layer input) -> (selected sets per position, min top-k score gap)."""
        n = x.shape[0]
        pos = torch.arange(n)
        q = neox_rope(self.wq(x).view(n, self.n, self.d), pos, self.rope, self.theta)
        k = neox_rope(self.k_norm(self.wk(x)), pos, self.rope, self.theta)
        khat = fp8_index_keys(k)
        w = self.weights_proj(x) * (self.n**-0.5) * (self.d**-0.5)
        scores = torch.einsum("th,ths->ts", w, torch.relu(torch.einsum("thd,sd->ths", q, khat)))
        # Ties go to the larger position: a stable descending sort of each row read backwards.
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        masked = torch.where(causal, scores, torch.full_like(scores, float("-inf")))
        vals, order = torch.sort(masked.flip(-1), dim=-1, descending=True, stable=True)
        positions = (n - 1 - order).tolist()
        vals = vals.tolist()
        sets, min_gap = [], float("inf")
        for t in range(n):
            kk = min(self.topk, t + 1)
            if kk < t + 1 and vals[t][kk - 1] != vals[t][kk]:
                min_gap = min(min_gap, vals[t][kk - 1] - vals[t][kk])  # closest non-tie at the cut
            sets.append(sorted(positions[t][:kk]))
        return sets, min_gap


def selection_mask(sets, n, dtype):
    mask = torch.full((n, n), float("-inf"), dtype=dtype)
    for t, sel in enumerate(sets):
        mask[t, sel] = 0.0
    return mask[None, None]


class PleMix(nn.Module):
    """Spec §3.7 (`model.layers.{i}.ple.`)."""

    def __init__(self, hidden, width, streams, kernel, dilation):
        super().__init__()
        self.h, self.s, self.k, self.dil = hidden, streams, kernel, dilation
        self.value = nn.Linear(width, hidden, bias=True)
        self.key = nn.ModuleList([nn.Linear(width, hidden, bias=True) for _ in range(streams)])
        self.key_norm = nn.ModuleList([PlainNorm(hidden) for _ in range(streams)])
        self.query_norm = nn.ModuleList([PlainNorm(hidden) for _ in range(streams)])
        self.conv_norm = nn.ModuleList([PlainNorm(hidden) for _ in range(streams)])
        self.conv = nn.Conv1d(
            streams * hidden, streams * hidden, kernel, groups=streams * hidden, bias=False, dilation=dilation
        )

    def forward(self, r, e):
        """r [n, S, H] streams, e [n, E] rows -> new streams."""
        n = r.shape[0]
        v = self.value(e)
        us = []
        for c in range(self.s):
            key = self.key_norm[c](self.key[c](e))
            q = self.query_norm[c](r[:, c])
            sig = (key * q).sum(-1) / math.sqrt(self.h)
            sig = torch.sign(sig) * torch.sqrt(torch.clamp(sig.abs(), min=1e-6))
            us.append(torch.sigmoid(sig)[:, None] * v)
        z = torch.cat([self.conv_norm[c](us[c]) for c in range(self.s)], dim=-1)  # [n, S·H]
        pad = (self.k - 1) * self.dil
        y = F.silu(self.conv(F.pad(z.t()[None], (pad, 0)))[0].t()[:n])
        return r + torch.stack(us, dim=1) + y.view(n, self.s, self.h)


class HcSub(nn.Module):
    """One sublayer's hyper-connection (`hc_attn.` / `hc_ffn.`)."""

    def __init__(self, hidden, streams, rank):
        super().__init__()
        self.s, self.h = streams, hidden
        self.pre = nn.Parameter(torch.zeros(streams))
        self.down = nn.Linear(hidden, rank, bias=False)
        self.inject = nn.Linear(hidden, rank, bias=False)
        self.up = nn.Linear(rank, streams * hidden, bias=False)

    def premix(self, r):
        return torch.einsum("c,nch->nh", torch.softmax(self.pre.to(r.dtype), 0), r)

    def residual(self, r, x, y):
        u = self.up(F.silu(self.down(y) + self.inject(x))).view(-1, self.s, self.h)
        return r + torch.sigmoid(u) * y[:, None]


class HcHead(nn.Module):
    def __init__(self, streams):
        super().__init__()
        self.pre = nn.Parameter(torch.zeros(streams))

    def forward(self, r):
        return torch.einsum("c,nch->nh", torch.softmax(self.pre.to(r.dtype), 0), r)


# ----------------------------------------------------------------------------------------------
# The PLE hash and table (spec §3.1-3.5), written independently of the engine's implementation
# ----------------------------------------------------------------------------------------------


def splitmix64(seed, n):
    out, state = [], seed & M64
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & M64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        out.append(z ^ (z >> 31))
    return out


def signed64(x):
    x &= M64
    return x - (1 << 64) if x >> 63 else x


def ple_indices(tokens, ple):
    """Row index per position and sub-table ((order, head) order)."""
    orders, heads, eos = ple["orders"], ple["heads"], ple["eos_token_id"]
    sizes = [p for row in ple["table_sizes"] for p in row]
    mults = [signed64(m | 1) for m in splitmix64(ple["seed"], max(orders))]
    out, last_eos = [], -1
    for t in range(len(tokens)):
        if tokens[t] == eos:
            last_eos = t
        ctx = [eos if (t - j < 0 or t - j < last_eos) else tokens[t - j] for j in range(max(orders))]
        row = []
        for o, n in enumerate(orders):
            mix = 0
            for j in range(n):
                mix ^= (ctx[j] * mults[j]) & M64
            mix = signed64(mix)
            for h in range(heads):
                row.append(mix % sizes[o * heads + h])  # Python's % takes the divisor's sign
        out.append(row)
    return out


def sidecar_checksum(fields):
    text = json.dumps(fields, separators=(",", ":"))
    h = 0xCBF29CE484222325
    for b in text.encode():
        h = ((h ^ b) * 0x100000001B3) & M64
    return f"fnv1a64:{h:016x}"


def write_table(dir_, ple, gen):
    """ple.bin (bf16, sub-tables back to back) + ple.json; returns the table as float64 [rows, row_dim]."""
    total = sum(p for row in ple["table_sizes"] for p in row)
    table = torch.randn((total, ple["row_dim"]), generator=gen).to(torch.bfloat16)
    with open(os.path.join(dir_, "ple.bin"), "wb") as f:
        f.write(bytes(table.contiguous().view(-1).view(torch.uint8).tolist()))  # little-endian bf16
    fields = {
        "file": "ple.bin",
        "dtype": "bf16",
        "row_dim": ple["row_dim"],
        "orders": ple["orders"],
        "heads": ple["heads"],
        "sizes": ple["table_sizes"],
        "seed": ple["seed"],
        "rows_scale": 1.0,
        "fill": "random",
    }
    side = dict(fields, checksum=sidecar_checksum(fields))
    with open(os.path.join(dir_, "ple.json"), "w") as f:
        f.write(json.dumps(side, indent=2) + "\n")
    return table.to(torch.float64)


def ple_rows(table, tokens, ple):
    sizes = [p for row in ple["table_sizes"] for p in row]
    base = [sum(sizes[:i]) for i in range(len(sizes))]
    idx = ple_indices(tokens, ple)
    rows = torch.stack([torch.cat([table[base[k] + r] for k, r in enumerate(row)]) for row in idx])
    return rows, idx


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


class Qwen4Exp(nn.Module):
    def __init__(self, kwargs, ext):
        super().__init__()
        cfg = Qwen3_5MoeTextConfig(**copy.deepcopy(kwargs), **mf.IMPL)
        self.cfg, self.ext = cfg, ext
        self.lm = Qwen3_5MoeForCausalLM(cfg)
        m, h = self.lm.model, cfg.hidden_size
        theta = cfg.rope_parameters["rope_theta"]
        self.qsa, self.ple, self.hc = ext.get("qsa"), ext.get("ple"), ext.get("hyper_connections")
        self.streams = self.hc["num_streams"] if self.hc else 1
        for i, layer in enumerate(m.layers):
            if self.qsa and cfg.layer_types[i] == "full_attention":
                layer.self_attn.indexer = Indexer(h, self.qsa, theta)
            if self.ple and i in self.ple["layer_ids"]:
                width = len(self.ple["orders"]) * self.ple["heads"] * self.ple["row_dim"]
                layer.ple = PleMix(h, width, self.streams, self.ple["conv_kernel"], self.ple["conv_dilation"])
            if self.hc:
                layer.hc_attn = HcSub(h, self.streams, self.hc["rank"])
                layer.hc_ffn = HcSub(h, self.streams, self.hc["rank"])
        if self.hc:
            m.hc_head = HcHead(self.streams)
        self.mtp = None
        if ext.get("mtp"):
            self.mtp = mf.MtpHead(cfg, q35.Qwen3_5MoeDecoderLayer, q35.Qwen3_5MoeRMSNorm)
            if self.qsa:
                self.mtp.layers[0].self_attn.indexer = Indexer(h, self.qsa, theta)

    def tensors(self):
        """The checkpoint's tensors: the model's state_dict (lm_head, model.*, mtp.*)."""
        sd = {k[len("lm.") :]: v for k, v in self.state_dict().items() if k.startswith("lm.")}
        sd.update({k: v for k, v in self.state_dict().items() if k.startswith("mtp.")})
        return sd

    def attend(self, layer, h, pe, n, trace=None, name=None):
        causal = torch.full((n, n), float("-inf"), dtype=h.dtype).triu(1)[None, None]
        idx = getattr(layer.self_attn, "indexer", None)
        mask, gap = causal, None
        if idx is not None:
            sets, gap = idx.select(h[0])
            mask = selection_mask(sets, n, h.dtype)
            if trace is not None:
                trace[name] = {"sets": sets, "min_topk_gap": gap}
        return layer.self_attn(hidden_states=h, position_embeddings=pe, attention_mask=mask)[0]

    @torch.no_grad()
    def hidden(self, ids, rows=None, trace=None):
        """Final-normed hidden states [n, H] of token ids [n]; rows [n, E] are the PLE rows."""
        m = self.lm.model
        n = ids.shape[0]
        x = m.embed_tokens(ids[None])  # [1, n, H]
        pe = m.rotary_emb(x, torch.arange(n).view(1, 1, -1).expand(3, 1, -1))
        r = x[0][:, None, :].repeat(1, self.streams, 1)  # [n, S, H]
        for i, layer in enumerate(m.layers):
            if hasattr(layer, "ple"):
                r = layer.ple(r, rows)
            for sub in ("mixer", "ffn"):
                hc = getattr(layer, "hc_attn" if sub == "mixer" else "hc_ffn", None)
                xin = hc.premix(r) if hc is not None else r[:, 0]
                if sub == "mixer":
                    h = layer.input_layernorm(xin)[None]
                    if layer.block_type == "full_attention":
                        y = self.attend(layer, h, pe, n, trace, f"layer_{i}")
                    else:
                        y = layer.linear_attn(hidden_states=h, cache_params=None, attention_mask=None)
                else:
                    y = layer.mlp(layer.post_attention_layernorm(xin)[None])
                    if isinstance(y, tuple):
                        y = y[0]
                y = y[0]
                r = hc.residual(r, xin, y) if hc is not None else r + y[:, None]
        x = m.hc_head(r) if self.hc else r[:, 0]
        return m.norm(x)

    @torch.no_grad()
    def logits(self, ids, rows=None, trace=None):
        return self.lm.lm_head(self.hidden(ids, rows, trace))

    @torch.no_grad()
    def mtp_logits(self, ids, rows=None, trace=None):
        """Draft logits for t = 0..n-2 (consuming ids[t+1] and the main model's h_t)."""
        m, mtp = self.lm.model, self.mtp
        n = ids.shape[0]
        hp = self.hidden(ids, rows)[: n - 1]
        e = m.embed_tokens(ids[1:])
        x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(e), mtp.pre_fc_norm_hidden(hp)], dim=-1))[None]
        pe = m.rotary_emb(x, torch.arange(n - 1).view(1, 1, -1).expand(3, 1, -1))
        layer = mtp.layers[0]
        x = x + self.attend(layer, layer.input_layernorm(x), pe, n - 1, trace, "mtp")
        y = layer.mlp(layer.post_attention_layernorm(x))
        x = x + (y[0] if isinstance(y, tuple) else y)
        return self.lm.lm_head(mtp.norm(x))[0]


# ----------------------------------------------------------------------------------------------
# Initialisation and fixtures
# ----------------------------------------------------------------------------------------------


def init_ext(name, shape, gen):
    def normal(std, mean=0.0):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    if ".indexer.k_norm.weight" in name or ".ple." in name and "_norm." in name:
        return normal(0.1, 1.0)  # plain-weight norms around 1
    if ".indexer.k_norm.bias" in name or name.endswith(".bias"):
        return normal(0.1)
    if name.endswith(".pre"):
        return normal(0.5)
    if name.endswith("ple.conv.weight"):
        return normal(1.0 / math.sqrt(shape[-1]))
    return mf.init_tensor(name, shape, gen)


@torch.no_grad()
def init_model(model, gen):
    for name, p in model.named_parameters():
        rel = name[len("lm.") :] if name.startswith("lm.") else name
        t = init_ext(rel, tuple(p.shape), gen)
        if not rel.endswith(".pre"):
            t = t.to(torch.bfloat16).to(torch.float32)  # pre stays f32 in the checkpoint
        p.data = t


def config_json(kwargs, ext):
    cfg = copy.deepcopy(kwargs)
    cfg.update(model_type="qwen4_exp", architectures=["Qwen4ExpForCausalLM"], dtype="bfloat16")
    cfg["mtp_num_hidden_layers"] = 1 if ext.get("mtp") else 0
    for k in ("qsa", "ple", "hyper_connections"):
        if ext.get(k):
            cfg[k] = ext[k]
    return cfg


def make_prompts():
    prompts = [p.clone() for p in mf.make_prompts()]
    for pi, positions in EOS_AT.items():
        for t in positions:
            prompts[pi][t] = EOS
    return prompts


def rounded(xs):
    return [float("%.12g" % x) for x in xs]


def build_fixture(out_dir, name, ext, seed, prompts):
    log(f"== {name} (weight seed {seed})")
    gen = torch.Generator().manual_seed(seed)
    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    kwargs = copy.deepcopy(mf.QWEN3_5_TEXT_KWARGS)
    kwargs["mtp_num_hidden_layers"] = 1 if ext.get("mtp") else 0
    model = Qwen4Exp(kwargs, ext).eval()
    init_model(model, gen)
    sd = {k: (v.detach().contiguous() if k.endswith(".pre") else v.detach().to(torch.bfloat16).contiguous())
          for k, v in model.tensors().items()}
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config_json(kwargs, ext), f, indent=2, sort_keys=True)
        f.write("\n")
    table = write_table(d, ext["ple"], torch.Generator().manual_seed(seed + 1)) if ext.get("ple") else None

    # Reload what was saved, in float64, through a fresh model (the names must round-trip).
    ref_model = Qwen4Exp(kwargs, ext).to(torch.float64).eval()
    saved = load_file(os.path.join(d, "model.safetensors"))
    lm_sd = {"lm." + k: v.to(torch.float64) for k, v in saved.items() if not k.startswith("mtp.")}
    mtp_sd = {k: v.to(torch.float64) for k, v in saved.items() if k.startswith("mtp.")}
    missing, unexpected = ref_model.load_state_dict({**lm_sd, **mtp_sd}, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{name}: reload missing {missing[:5]} unexpected {unexpected[:5]}")

    def rows_of(ids):
        if table is None:
            return None, None
        r, idx = ple_rows(table, [int(t) for t in ids], ext["ple"])
        return r, idx

    ref = {
        "model_type": "qwen4_exp",
        "compute_dtype": "float64",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "prompts": [],
        "mtp": [],
    }
    debug = {"min_greedy_top2_gap": float("inf")}
    for pi, ids in enumerate(prompts):
        n = ids.shape[0]
        rows, idx = rows_of(ids)
        trace = {}
        lp = torch.log_softmax(ref_model.logits(ids, rows, trace), dim=-1)
        entry = {
            "ids": [int(i) for i in ids],
            "prompt_logprobs": [None] + [float(lp[t - 1, ids[t]]) for t in range(1, n)],
        }
        if pi in QSA_TRACE and "layer_3" in trace:
            entry["qsa_selected"] = {
                "layer": 3,
                "positions": QSA_TRACE[pi],
                "sets": [trace["layer_3"]["sets"][t] for t in QSA_TRACE[pi]],
            }
            debug[f"prompt{pi}_min_topk_score_gap"] = {k: v["min_topk_gap"] for k, v in trace.items()}
        if idx is not None and pi == 1:
            entry["ple_indices"] = idx
        seq = ids.clone()
        greedy, gaps = [], []
        for _ in range(GREEDY_STEPS):
            rows, _ = rows_of(seq)
            last = ref_model.logits(seq, rows)[-1]
            top2 = last.topk(2)
            tok = int(top2.indices[0])
            greedy.append(tok)
            gaps.append(float(top2.values[0] - top2.values[1]))
            seq = torch.cat([seq, torch.tensor([tok])])
        entry["greedy_ids"] = greedy
        entry["greedy_top2_gap"] = gaps
        debug["min_greedy_top2_gap"] = min(debug["min_greedy_top2_gap"], min(gaps))
        ref["prompts"].append(entry)
        log(f"  prompt {pi} (n={n}): greedy {greedy[:8]}..., min gap {min(gaps):.4f}")
    if ref_model.mtp is not None:
        for pi, positions in MTP_POSITIONS.items():
            ids = prompts[pi]
            rows, _ = rows_of(ids)
            trace = {}
            draft = torch.log_softmax(ref_model.mtp_logits(ids, rows, trace), dim=-1)
            ref["mtp"].append(
                {
                    "prompt_index": pi,
                    "positions": positions,
                    "next_ids": [int(ids[t + 1]) for t in positions],
                    "draft_logprobs": [rounded(draft[t].tolist()) for t in positions],
                }
            )
            if "mtp" in trace:
                debug[f"mtp_prompt{pi}_min_topk_score_gap"] = trace["mtp"]["min_topk_gap"]
    ref["debug"] = debug
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(mf.finite(ref), f, separators=(",", ":"))
        f.write("\n")
    log(f"  debug: {debug}")
    return ref_model


@torch.no_grad()
def check_all_off(base_dir):
    """qwen4_exp with every block off equals transformers' Qwen3_5MoeForCausalLM on its fixture."""
    hf = Qwen3_5MoeForCausalLM.from_pretrained(base_dir, dtype=torch.float64, **mf.IMPL).eval()
    ours = Qwen4Exp(copy.deepcopy(mf.QWEN3_5_TEXT_KWARGS), {}).to(torch.float64).eval()
    saved = load_file(os.path.join(base_dir, "model.safetensors"))
    lm_sd = {"lm." + k: v.to(torch.float64) for k, v in mf.experts_to_fused(saved).items() if not k.startswith("mtp.")}
    missing, unexpected = ours.load_state_dict(lm_sd, strict=False)
    worst = 0.0
    for ids in mf.make_prompts():
        a = hf(input_ids=ids[None], use_cache=False).logits[0]
        b = ours.logits(ids)
        worst = max(worst, float((a - b).abs().max()))
    log(f"== all blocks off vs Qwen3_5MoeForCausalLM: max |logit diff| {worst:.3e} "
        f"(missing {len(missing)}, unexpected {len(unexpected)})")
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--base-fixture", help="the qwen3_5_moe_text_tiny fixture directory")
    ap.add_argument("--only", help="comma-separated fixture names to build")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    t0 = time.time()
    log(f"transformers {transformers.__version__}, torch {torch.__version__}")
    status = 0
    if args.base_fixture:
        if check_all_off(args.base_fixture) > 1e-9:
            status = 1
    prompts = make_prompts()
    ple_one = dict(PLE_BASE, layer_ids=[1])
    ple_two = dict(PLE_BASE, layer_ids=[0, 3])
    specs = [
        ("qwen4_exp_qsa_tiny", {"qsa": QSA, "mtp": True}, 400),
        ("qwen4_exp_ple_tiny", {"ple": ple_one}, 500),
        ("qwen4_exp_hc_tiny", {"hyper_connections": HC}, 600),
        ("qwen4_exp_all_tiny", {"qsa": QSA, "ple": ple_two, "hyper_connections": HC, "mtp": True}, 700),
    ]
    only = set(args.only.split(",")) if args.only else None
    for name, ext, seed in specs:
        if only is None or name in only:
            build_fixture(args.out_dir, name, ext, seed, prompts)
    log(f"done in {time.time() - t0:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
