#!/usr/bin/env python3
"""Train a tiny Qwen3.5-MoE on generated chat exchanges and export it in the layout the server loads.

    python3 train.py OUT_DIR [--steps N] [--device cpu|cuda] [--seed S] [--int4-embed]

The model is transformers' `Qwen3_5MoeForCausalLM` built from the `text_config` of
`configs/models/builtin.json` (gated-delta-net and gated-attention layers, routed experts with a shared
expert, tied embeddings, the 248,320-row vocabulary); `--hidden-size` and friends change its sizes.
An MTP head (`mtp.*`: fc over [norm(embed(x[t+1])), norm(h[t])], one full-attention decoder layer, a
norm, the shared LM head) is trained beside it to predict the token after next, so speculative decoding
with it accepts drafts. Training data is `data.py`'s train split rendered with the repository's chat
template and tokenized with `tokenization.py`; the loss is taken on the assistant reply only (its
`<think>` block when thinking is on, its text or tool call, and the closing `<|im_end|>`), plus the
routers' load-balancing loss.

OUT_DIR receives:
  config.json          builtin.json's wrapper config (`qwen3_5_moe`, vision tower included) with the
                       trained text sizes; with --int4-embed a compressed-tensors quantization_config
  model.safetensors    `model.language_model.*` (bf16; routed experts as fused 3-D tensors),
                       `mtp.*`, and `model.visual.*` (the vision tower, random: it is not trained here);
                       no `lm_head.weight` (tied). With --int4-embed the embedding is INT4
                       pack-quantized (a scale per 32 inputs), the rest bf16.
  generation_config.json, loss.csv (step, loss, mtp_loss, aux_loss, lr, tokens, seconds),
  training.json        the arguments, data seed and final figures (eval.py reads the data seed); with
                       --save-every, interim exports write the model files and a `partial` one.

Serve it with `sanmai serve --model OUT_DIR`; score it with `eval.py OUT_DIR --base-url URL`.
"""

import argparse
import copy
import csv
import json
import math
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
DEFAULT_CONFIG = os.path.join(REPO, "configs", "models", "builtin.json")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35  # noqa: E402

import batching  # noqa: E402
import data  # noqa: E402
import fast  # noqa: E402
from tokenization import EOS_IDS, IM_END_ID, Tokenizer  # noqa: E402

# Text-config keys copied into transformers' Qwen3_5MoeTextConfig (the rest keep its defaults).
TEXT_KEYS = [
    "vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads",
    "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "mtp_num_hidden_layers", "rms_norm_eps", "rope_parameters", "max_position_embeddings",
    "tie_word_embeddings", "bos_token_id", "eos_token_id",
]


def log(msg):
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


def build_config(args):
    with open(args.config) as f:
        top = json.load(f)
    text = copy.deepcopy(top.get("text_config", top))
    overrides = {
        "hidden_size": args.hidden_size,
        "num_experts": args.num_experts,
        "num_experts_per_tok": args.experts_per_tok,
        "moe_intermediate_size": args.moe_intermediate_size,
        "shared_expert_intermediate_size": args.shared_intermediate_size,
    }
    for k, v in overrides.items():
        if v is not None:
            text[k] = v
    if args.layers:
        types = args.layers.split(",")
        bad = [t for t in types if t not in ("linear_attention", "full_attention")]
        if bad or "full_attention" not in types:
            raise SystemExit(f"--layers: linear_attention / full_attention, at least one full: {bad}")
        text["layer_types"] = types
        text["num_hidden_layers"] = len(types)
    if text["vocab_size"] != 248_320 or not text.get("tie_word_embeddings", top.get("tie_word_embeddings")):
        raise SystemExit("the built-in family has the 248,320-row vocabulary and tied embeddings")
    if "out_hidden_size" in top.get("vision_config", {}):
        top["vision_config"]["out_hidden_size"] = text["hidden_size"]
    top["text_config"] = text if "text_config" in top else None
    kwargs = {k: text[k] for k in TEXT_KEYS if k in text}
    kwargs["tie_word_embeddings"] = True
    cfg = Qwen3_5MoeTextConfig(**kwargs)
    cfg.router_aux_loss_coef = args.aux_loss
    return top, text, cfg


# ------------------------------------------------------------------------------------------------
# The MTP head (`mtp.*`; transformers has no module for it)
# ------------------------------------------------------------------------------------------------


class MtpHead(torch.nn.Module):
    """fc(cat[norm_e(embed(x[t+1])), norm_h(h[t])]) -> one decoder layer -> norm; LM head shared."""

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        full = config.layer_types.index("full_attention")
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = q35.Qwen3_5MoeRMSNorm(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = q35.Qwen3_5MoeRMSNorm(h, eps=config.rms_norm_eps)
        self.layers = torch.nn.ModuleList([q35.Qwen3_5MoeDecoderLayer(config, full)])
        self.norm = q35.Qwen3_5MoeRMSNorm(h, eps=config.rms_norm_eps)
        std = config.initializer_range
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name or name.endswith("norm.weight"):
                    p.zero_()
                elif p.dim() >= 2:
                    p.normal_(0.0, std)

    def forward(self, model, ids, hidden):
        """Draft hidden states for t = 0..T-2 (index t reads x[t+1] and h[t])."""
        b, t = ids.shape
        emb = model.model.embed_tokens(ids[:, 1:])
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden[:, : t - 1])], -1))
        pos = torch.arange(t - 1, device=ids.device)
        pe = model.model.rotary_emb(x, pos.view(1, 1, -1).expand(3, b, -1))
        mask = torch.full((t - 1, t - 1), float("-inf"), device=ids.device, dtype=x.dtype).triu(1)[None, None]
        x = self.layers[0](x, position_embeddings=pe, attention_mask=mask, position_ids=pos[None].expand(b, -1))
        return self.norm(x)


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------


def encode_examples(examples, renderer, tok, max_len):
    """(ids, loss mask) per example: the mask marks the reply's tokens (what the model generates)."""
    out, skipped = [], 0
    for ex in examples:
        prompt, completion = renderer.prompt_and_completion(ex)
        p, c = tok.encode(prompt), tok.encode(completion)
        if c[-1] != IM_END_ID:
            raise RuntimeError("a reply does not end with <|im_end|>")
        ids = p + c
        if len(ids) > max_len:
            skipped += 1
            continue
        out.append((ids, [0] * len(p) + [1] * len(c)))
    return out, skipped


def load_packed(path):
    """`data.py --pack`'s arrays: (ids, offsets, reply_start)."""
    import numpy as np

    d = np.load(path)
    return data.load_ids(d), d["offsets"], d["reply_start"]


def pack_encoded(encoded):
    """(ids, loss mask) pairs as load_packed's arrays."""
    import numpy as np

    ids = np.asarray([t for x, _ in encoded for t in x], np.int32)
    offsets = np.cumsum([0] + [len(x) for x, _ in encoded]).astype(np.int64)
    starts = np.asarray([m.index(1) for _, m in encoded], np.int32)
    return ids, offsets, starts


# ------------------------------------------------------------------------------------------------
# Loss
# ------------------------------------------------------------------------------------------------


def head_columns(model, args):
    """The head's rows the softmax runs over, and their logits' correction (or None): every row; or the
    training data's tokens (`--active-vocab`), plus with `--negatives K` K rows drawn afresh each step
    from the others, each corrected by log(others / K), so that the sampled softmax estimates the full
    one and the tokens the data never uses are still pushed down."""
    weight = model.lm_head.weight
    if args.active is None:
        return weight, None
    if not args.negatives:
        return weight[args.active], None
    others = args.inactive
    neg = others[torch.randint(others.numel(), (args.negatives,), device=others.device)]
    return weight[torch.cat([args.active, neg])], args.column_bias


def step_loss(model, mtp, b, args):
    """The reply tokens' cross-entropy (positions gathered by batching.py), the MTP head's, and the
    routers' load-balancing loss."""
    ids = b["ids"]
    # Right-padded rows, one exchange each: causal attention needs no mask (and transformers' check for
    # packed sequences would read a device value back to the host).
    masks = {"full_attention": None, "linear_attention": None}
    out = model.model(input_ids=ids, attention_mask=masks, use_cache=False, output_router_logits=args.aux_loss > 0)
    h = out.last_hidden_state
    hd = h.shape[-1]
    w, bias = head_columns(model, args)
    dtype = torch.bfloat16 if ids.is_cuda else None
    loss = fast.head_loss(h.reshape(-1, hd).index_select(0, b["pos1"]), w, b["tgt1"], b["w1"], dtype=dtype,
                          bias=bias)
    mtp_loss = torch.zeros((), device=ids.device)
    if mtp is not None and args.mtp_weight > 0 and ids.shape[1] > 2:
        d = mtp(model, ids, h)  # [B, T-1, H]; index t predicts ids[t+2]
        mtp_loss = fast.head_loss(d.reshape(-1, hd).index_select(0, b["pos2"]), w, b["tgt2"], b["w2"], dtype=dtype,
                                  bias=bias)
    aux = torch.zeros((), device=ids.device)
    if args.aux_loss > 0 and getattr(out, "router_logits", None):
        aux = fast.load_balancing_loss(out.router_logits, model.config.num_experts, model.config.num_experts_per_tok)
    total = loss + args.mtp_weight * mtp_loss + args.aux_loss * aux
    return total, loss, mtp_loss, aux


class Stepper:
    """One optimizer step on a batch: run eagerly, or (with CUDA graphs) captured once per batch shape
    after two eager warm-up steps, then replayed. Returns [loss, mtp_loss, aux] on the device."""

    def __init__(self, model, mtp, opt, params, args, device, graphs):
        self.model, self.mtp, self.opt, self.params, self.args, self.device = model, mtp, opt, params, args, device
        self.graphs_on = graphs
        self.graphs, self.warm, self.pool = {}, {}, None
        self.ms = {}  # measured milliseconds a step: "eager" (the probe), "graphs" (the second half)
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)
                         if device.type == "cuda" else torch.autocast("cpu", enabled=False))

    def body(self, b):
        with self.autocast:
            total, loss, mtp_loss, aux = step_loss(self.model, self.mtp, b, self.args)
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0, foreach=self.device.type == "cuda")
        self.opt.step()
        return torch.stack([loss.detach().float(), mtp_loss.detach().float(), aux.detach().float()])

    def eager(self, b):
        self.opt.zero_grad(set_to_none=True)
        return self.body(b)

    def __call__(self, batch):
        key = tuple(batch["ids"].shape) + tuple(batch["pos1"].shape)
        if key in self.graphs:
            g, static, out = self.graphs[key]
            for k, v in batch.items():
                static[k].copy_(v, non_blocking=True)
            g.replay()
            return out
        b = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        if not self.graphs_on:
            return self.eager(b)
        if self.warm.get(key, 0) < 2:
            self.warm[key] = self.warm.get(key, 0) + 1
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                out = self.eager(b)
            torch.cuda.current_stream().wait_stream(s)
            return out
        try:
            self.opt.zero_grad(set_to_none=True)
            g = torch.cuda.CUDAGraph()
            # thread_local: the batch thread pins host memory (cudaHostAlloc) while a step is captured
            with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
                out = self.body(b)
            if self.pool is None:
                self.pool = g.pool()
            g.replay()  # capturing ran nothing: this is the step
            self.graphs[key] = (g, b, out)
            return out
        except Exception as e:  # noqa: BLE001
            log(f"CUDA graph capture failed ({type(e).__name__}: {e}); steps run eagerly from here")
            self.graphs_on = False
            self.graphs.clear()
            torch.cuda.synchronize()
            return self.eager(b)


# ------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------


def pack_int4(w, group):
    """compressed-tensors pack-quantized INT4 of a [rows, cols] matrix: symmetric, a scale per `group`
    inputs, codes q + 8 packed 8 to an int32 word LSB first (crates/weights/src/quant.rs)."""
    rows, cols = w.shape
    w = w.float()
    g = w.view(rows, cols // group, group)
    best_s, best_err = None, None
    amax = g.abs().amax(-1, keepdim=True).clamp_min(1e-8)
    for clip in (1.0, 0.95, 0.9, 0.85, 0.8):
        s = (amax * clip / 7).to(torch.bfloat16).float()
        q = torch.round(g / s).clamp(-8, 7)
        err = ((q * s - g) ** 2).sum(-1, keepdim=True)
        if best_s is None:
            best_s, best_err = s, err
        else:
            better = err < best_err
            best_s = torch.where(better, s, best_s)
            best_err = torch.where(better, err, best_err)
    q = torch.round(g / best_s).clamp(-8, 7).view(rows, cols).to(torch.int64) + 8
    q = q.view(rows, cols // 8, 8)
    words = torch.zeros((rows, cols // 8), dtype=torch.int64)
    for j in range(8):
        words |= q[:, :, j] << (4 * j)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    scale = best_s.view(rows, cols // group).to(torch.bfloat16)
    deq = (best_s * torch.round(g / best_s).clamp(-8, 7)).view(rows, cols)
    return words, scale, torch.tensor([rows, cols], dtype=torch.int32), deq


def unpack_int4(words, scale, shape):
    """The inverse of pack_int4: the dequantized [rows, cols] matrix."""
    rows, cols = (int(v) for v in shape)
    w = words.to(torch.int64) & 0xFFFFFFFF
    q = torch.stack([(w >> (4 * j)) & 0xF for j in range(8)], -1).view(rows, cols) - 8
    group = cols // scale.shape[1]
    return (q.float().view(rows, cols // group, group) * scale.float().unsqueeze(-1)).view(rows, cols)


# A grown layer's output projections: zero, so that the layer starts as the identity (its residual adds
# nothing) while its gradients are not (they are the projection's input times the output's gradient).
GROWN_ZERO = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.experts.down_proj",
              "mlp.shared_expert.down_proj.weight")


def grow_layers(sd, old_types, model, spec):
    """Renumbers the checkpoint's layers by `spec` (for each of the model's layers: the checkpoint's
    layer index, or `new`). A new layer keeps its fresh initialisation with GROWN_ZERO zeroed, so the
    grown model computes exactly what the checkpoint did."""
    plan = spec.split(",")
    types = model.config.layer_types
    if len(plan) != len(types):
        raise SystemExit(f"--grow: {len(plan)} entries for a {len(types)}-layer model")
    fresh = model.model.state_dict()
    out = {k: v for k, v in sd.items() if not k.startswith("layers.")}
    for i, src in enumerate(plan):
        mine = f"layers.{i}."
        if src == "new":
            for k, v in fresh.items():
                if k.startswith(mine):
                    out[k] = torch.zeros_like(v) if k[len(mine):] in GROWN_ZERO else v
            continue
        j = int(src)
        if old_types[j] != types[i]:
            raise SystemExit(f"--grow: layer {i} is {types[i]}, the checkpoint's layer {j} is {old_types[j]}")
        for k, v in sd.items():
            if k.startswith(f"layers.{j}."):
                out[mine + k[len(f"layers.{j}."):]] = v
    return out


def load_init(path, model, mtp, grow=None):
    """Starts from an exported checkpoint (its INT4 embedding dequantized), its layers renumbered by
    `grow` if given."""
    t = load_file(os.path.join(path, "model.safetensors"))
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in t) else "model."
    emb = prefix + "embed_tokens.weight"
    if emb + "_packed" in t:
        t[emb] = unpack_int4(t[emb + "_packed"], t[emb + "_scale"], t[emb + "_shape"])
    sd = {k[len(prefix):]: v for k, v in t.items() if k.startswith(prefix) and not k.startswith(emb + "_")}
    if grow:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        sd = grow_layers(sd, cfg.get("text_config", cfg)["layer_types"], model, grow)
    model.model.load_state_dict(sd, strict=True)
    if mtp is not None:
        mtp.load_state_dict({k[4:]: v for k, v in t.items() if k.startswith("mtp.")}, strict=True)
    log(f"started from {path} ({len(sd)} tensors)")


def export(out_dir, top, text, model, mtp, args):
    os.makedirs(out_dir, exist_ok=True)
    bf = lambda t: t.detach().to("cpu", torch.bfloat16).contiguous()  # noqa: E731
    wrapper = "text_config" in top and top["text_config"] is not None
    prefix = "model.language_model." if wrapper else "model."
    tensors = {}
    for k, v in model.model.state_dict().items():
        tensors[prefix + k] = bf(v)
    for k, v in mtp.state_dict().items():
        tensors["mtp." + k] = bf(v)
    cfg = copy.deepcopy(top) if wrapper else copy.deepcopy(text)
    if wrapper:
        cfg["text_config"] = text
    if wrapper and "vision_config" in top and not args.no_vision:
        vc = q35.Qwen3_5MoeVisionConfig(**top["vision_config"])
        torch.manual_seed(args.seed + 1)
        vision = q35.Qwen3_5MoeVisionModel._from_config(vc)
        for k, v in vision.state_dict().items():
            tensors["model.visual." + k] = bf(v)
    elif wrapper and args.no_vision:
        cfg.pop("vision_config", None)
    if args.int4_embed:
        name = prefix + "embed_tokens"
        w = model.model.embed_tokens.weight.detach().to("cpu", torch.float32)
        words, scale, shape, _ = pack_int4(w, args.int4_group)
        del tensors[name + ".weight"]
        tensors[name + ".weight_packed"] = words
        tensors[name + ".weight_scale"] = scale
        tensors[name + ".weight_shape"] = shape
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "embedding": {
                    "targets": [name],
                    "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                "strategy": "group", "group_size": args.int4_group},
                }
            },
            "ignore": [],
        }
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": EOS_IDS, "pad_token_id": EOS_IDS[1]}, f, indent=2)
        f.write("\n")
    size = os.path.getsize(os.path.join(out_dir, "model.safetensors"))
    log(f"exported {len(tensors)} tensors, {size / 1e6:.1f} MB, to {out_dir}")
    return size


def check_export(out_dir, model, args):
    """transformers reads the exported text weights back to the trained ones (bf16-rounded)."""
    if args.int4_embed:
        return {"skipped": "int4 embedding (transformers does not read it)"}
    tensors = load_file(os.path.join(out_dir, "model.safetensors"))
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in tensors) else "model."
    sd = model.model.state_dict()
    missing = [k for k in sd if prefix + k not in tensors]
    worst = max(float((tensors[prefix + k].float() - v.detach().cpu().float()).abs().max()) for k, v in sd.items()
                if prefix + k in tensors)
    return {"missing": missing, "max_abs_diff_vs_trained": worst}


@torch.no_grad()
def generate_batch(model, prompts, device, max_new, tokens_per_batch=131072):
    """Greedy continuations of token-id prompts, batched (right-padded, no cache: every step reads
    the whole padded batch again, which is cheap at this size). Each stops at an EOS id or max_new."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outs = [None] * len(prompts)
    w = model.lm_head.weight
    s = 0
    while s < len(order):
        e = s + 1
        while e < len(order) and (len(prompts[order[e]]) + max_new) * (e - s + 1) <= tokens_per_batch:
            e += 1
        group = order[s:e]
        s = e
        lens = torch.tensor([len(prompts[i]) for i in group], device=device)
        x = torch.full((len(group), int(lens.max()) + max_new), EOS_IDS[1], dtype=torch.long, device=device)
        for r, i in enumerate(group):
            x[r, : len(prompts[i])] = torch.tensor(prompts[i], device=device)
        done = torch.zeros(len(group), dtype=torch.bool, device=device)
        gen = []
        rows = torch.arange(len(group), device=device)
        eos = torch.tensor(EOS_IDS, device=device)
        for _ in range(max_new):
            h = model.model(input_ids=x[:, : int(lens.max())], use_cache=False).last_hidden_state
            nxt = F.linear(h[rows, lens - 1], w).float().argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, -1), nxt)
            gen.append(nxt)
            x[rows, lens] = torch.where(done, x[rows, lens], nxt)
            done = done | torch.isin(nxt, eos)
            lens = torch.where(done, lens, lens + 1)
            if bool(done.all()):
                break
        g = torch.stack(gen, 1).tolist()
        for r, i in enumerate(group):
            toks = [t for t in g[r] if t >= 0]
            outs[i] = toks
    return outs


def load_prompts(path):
    import numpy as np

    d = np.load(path)
    ids, offsets = d["ids"], d["offsets"]
    return [ids[offsets[i] : offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]


# ------------------------------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0, help="the initialisation's and the data order's seed; also "
                   "the eval split's (eval.py reads it from training.json)")
    p.add_argument("--order-seed", type=int, default=None, help="the data order's seed (default: --seed)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="the wrapper (or text) config to start from")
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--layers", default=None, help="comma-separated layer types, e.g. "
                   "linear_attention,linear_attention,linear_attention,full_attention")
    p.add_argument("--num-experts", type=int, default=None)
    p.add_argument("--experts-per-tok", type=int, default=None)
    p.add_argument("--moe-intermediate-size", type=int, default=None)
    p.add_argument("--shared-intermediate-size", type=int, default=None)
    p.add_argument("--max-seconds", type=float, default=None,
                   help="a time budget: training ends and the learning-rate schedule completes when either "
                   "--steps or this many seconds are reached")
    p.add_argument("--tokens-per-batch", type=int, default=32768, help="padded tokens a step (at most)")
    p.add_argument("--max-rows", type=int, default=1024, help="exchanges a step (at most)")
    p.add_argument("--reply-cap", type=int, default=16384, help="reply tokens a step (at most)")
    p.add_argument("--cuda-graphs", action="store_true", help="after --probe-steps eager steps, capture each "
                   "batch shape's whole step as a CUDA graph and replay it")
    p.add_argument("--probe-steps", type=int, default=20)
    p.add_argument("--data", default=None, help="training exchanges packed by `data.py --pack`, comma-separated "
                   "files (default: "
                   "generate --examples of them here)")
    p.add_argument("--examples", type=int, default=40000, help="distinct training exchanges generated")
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--long-share", type=float, default=1.0, help="the share of the batches of exchanges of "
                   "1,024 tokens or more used in each epoch")
    p.add_argument("--eval-prompts", default=None, help="held-out prompts packed by `eval.py --pack-prompts`: "
                   "their greedy continuations are written to OUT_DIR/generated.json (score them with "
                   "`eval.py --score-generated`)")
    p.add_argument("--eval-max-new", type=int, default=96)
    p.add_argument("--active-vocab", action="store_true", help="softmax over the training data's tokens "
                   "only (a cheap head for training on a CPU; other rows keep their weights)")
    p.add_argument("--negatives", type=int, default=0, help="with --active-vocab: also this many of the other "
                   "tokens' rows, drawn afresh each step (a sampled softmax, corrected)")
    p.add_argument("--init", default=None, help="start from this exported checkpoint (same sizes)")
    p.add_argument("--grow", default=None, help="with --init and --layers: for each layer, the checkpoint's "
                   "layer it starts from or `new` (an identity layer), e.g. 0,1,new,2,3")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 5%% of --steps)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--aux-loss", type=float, default=0.01, help="router load-balancing loss weight")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=float, default=0, metavar="SECONDS",
                   help="also export the model every SECONDS of training (each file replaced whole), so "
                        "that a run stopped early leaves its last export; 0: at the end only")
    p.add_argument("--int4-embed", action="store_true", help="export the embedding INT4 pack-quantized")
    p.add_argument("--int4-group", type=int, default=32)
    p.add_argument("--no-vision", action="store_true", help="export without the vision tower")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    args = p.parse_args()
    if args.negatives and not args.active_vocab:
        p.error("--negatives K needs --active-vocab (without it the softmax already covers every token)")
    if args.grow and not args.init:
        p.error("--grow needs --init (the checkpoint whose layers it renumbers)")

    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    os.makedirs(args.out_dir, exist_ok=True)

    top, text, cfg = build_config(args)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "dense"  # fast.py: no syncs, fixed shapes
    model = Qwen3_5MoeForCausalLM(cfg).to(device)
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "embeddings not tied"
    mtp = MtpHead(cfg).to(device) if text.get("mtp_num_hidden_layers", 0) else None
    if args.init:
        load_init(args.init, model, mtp, args.grow)
    n_params = sum(p.numel() for p in model.parameters()) + (sum(p.numel() for p in mtp.parameters()) if mtp else 0)
    n_embed = model.model.embed_tokens.weight.numel()
    log(f"model: hidden {cfg.hidden_size}, layers {cfg.layer_types}, experts {cfg.num_experts} top-"
        f"{cfg.num_experts_per_tok}; {n_params / 1e6:.2f} M parameters ({n_embed / 1e6:.2f} M embedding)")

    import numpy as np

    t0 = time.time()
    if args.data:
        parts = [load_packed(p) for p in args.data.split(",")]
        ids = np.concatenate([p[0] for p in parts])
        bases = np.cumsum([0] + [len(p[0]) for p in parts])
        offsets = np.concatenate([parts[0][1][:1]] + [p[1][1:] + base for p, base in zip(parts, bases)])
        starts = np.concatenate([p[2] for p in parts])
    else:
        examples = data.generate("train", args.examples, args.seed)
        encoded, _ = encode_examples(examples, data.Renderer(), Tokenizer(), args.max_len)
        ids, offsets, starts = pack_encoded(encoded)
    args.active = None
    if args.active_vocab:
        ids_seen = np.union1d(np.unique(ids), EOS_IDS)
        args.active = torch.tensor(ids_seen, dtype=torch.long, device=device)
        args.inactive = torch.tensor(np.setdiff1d(np.arange(model.lm_head.weight.shape[0]), ids_seen),
                                     dtype=torch.long, device=device)
        # The sampled columns' correction, log(others / K); none on the data's own tokens.
        args.column_bias = torch.cat([torch.zeros(args.active.numel(), device=device),
                                      torch.full((args.negatives,), math.log(args.inactive.numel() / max(args.negatives, 1)),
                                                 device=device)])
        log(f"softmax over the {len(ids_seen)} tokens of the training data")
    data_batches = batching.Batches(ids, offsets, starts, args.tokens_per_batch, args.max_rows, args.reply_cap,
                                    EOS_IDS[1], args.seed if args.order_seed is None else args.order_seed, args.max_len,
                                    None if args.active is None else args.active.cpu().numpy(),
                                    long_share=args.long_share)
    n_ex = len(data_batches.lengths)
    log(f"data: {n_ex} exchanges ({data_batches.dropped} over {args.max_len} tokens left out), "
        f"{int(data_batches.lengths.sum())} tokens, {int(data_batches.replies.sum())} reply tokens, "
        f"{time.time() - t0:.1f}s; buckets {json.dumps(data_batches.describe())}")

    params = list(model.parameters()) + (list(mtp.parameters()) if mtp else [])
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    cuda = device.type == "cuda"
    # On a GPU the learning rate is a device tensor, so that a captured step reads the current one.
    lr_t = torch.tensor(args.lr, device=device) if cuda else args.lr
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay, "lr": lr_t},
         {"params": no_decay, "weight_decay": 0.0, "lr": lr_t}],
        lr=lr_t, betas=(0.9, 0.95), eps=1e-8, fused=cuda, capturable=cuda,
    )
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)

    def progress(step, elapsed):
        """How far training is, 0..1: by steps, or by time with --max-seconds, whichever is further."""
        p = step / args.steps
        if args.max_seconds:
            p = max(p, elapsed / args.max_seconds)
        return p

    def lr_at(step, elapsed):
        if step < warmup:
            return args.lr * (step + 1) / warmup
        frac = min(1.0, progress(step, elapsed))
        return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))

    stream = data_batches.stream(pin=cuda)
    stepper = Stepper(model, mtp, opt, params, args, device, graphs=False)
    csv_path = os.path.join(args.out_dir, "loss.csv")
    fcsv = open(csv_path, "w", newline="")
    w = csv.writer(fcsv)
    w.writerow(["step", "loss", "mtp_loss", "aux_loss", "lr", "tokens", "seconds"])
    model.train()
    if mtp:
        mtp.train()
    tokens, first, last, step = 0, None, None, 0
    acc = torch.zeros(4, device=device)
    one = torch.ones(1, device=device)
    start = time.time()
    mark = (0, start)
    marks = []
    saved = start

    def save_now(step):
        """An interim export, written beside and then moved over the previous one file by file."""
        if cuda:
            torch.cuda.synchronize()
        tmp = args.out_dir.rstrip("/") + ".saving"
        export(tmp, top, text, model, mtp, args)
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(args.out_dir, name))
        os.rmdir(tmp)
        with open(os.path.join(args.out_dir, "training.json"), "w") as f:
            json.dump({"args": dict(vars(args), active=None, inactive=None, column_bias=None),
                       "partial": True, "steps": step, "train_seconds": round(time.time() - start, 1)},
                      f, indent=2)
            f.write("\n")
        log(f"saved the model at step {step}")
    while progress(step, time.time() - start) < 1:
        lr = lr_at(step, time.time() - start)
        if cuda:
            lr_t.fill_(lr)
        else:
            for g in opt.param_groups:
                g["lr"] = lr
        batch = next(stream)
        out = stepper(batch)
        acc += torch.cat([out, one])
        tokens += int(batch["ids"].numel())
        step += 1
        if first is None:
            first = float(out[0])
        if args.cuda_graphs and step == args.probe_steps:
            # The probe: eager steps so far; CUDA graphs from here (timed in the next log lines).
            if cuda:
                torch.cuda.synchronize()
            stepper.ms["eager"] = round((time.time() - start) / step * 1000, 2)
            log(f"probe: {step} eager steps, {stepper.ms['eager']} ms a step; CUDA graphs from here")
            stepper.graphs_on = cuda
        if step % args.log_every == 0 or progress(step, time.time() - start) >= 1:
            a = (acc[:3] / acc[3]).tolist()
            now = time.time()
            row = [step, a[0], a[1], a[2], lr, tokens, round(now - start, 2)]
            w.writerow([row[0]] + [f"{v:.5g}" if isinstance(v, float) else v for v in row[1:]])
            fcsv.flush()
            last = row[1]
            log(f"step {row[0]:6d}  loss {row[1]:.4f}  mtp {row[2]:.4f}  aux {row[3]:.4f}  lr {row[4]:.2e}  "
                f"{tokens / max(1e-9, now - start):.0f} tok/s  {(now - mark[1]) / (step - mark[0]) * 1000:.1f} "
                f"ms/step  graphs {len(stepper.graphs)}")
            mark = (step, now)
            marks.append(mark)
            acc.zero_()
            if args.save_every and now - saved >= args.save_every and progress(step, now - start) < 1:
                save_now(step)
                saved = time.time()
    fcsv.close()
    if cuda:
        torch.cuda.synchronize()
    train_s = time.time() - start
    half = next((m for m in marks if m[1] - start >= train_s / 2), None)
    if stepper.graphs and half and step > half[0]:
        stepper.ms["graphs"] = round((time.time() - half[1]) / (step - half[0]) * 1000, 2)
        log(f"CUDA graphs: {len(stepper.graphs)} captured; {stepper.ms['graphs']} ms a step over the second half")

    model.eval()
    size = export(args.out_dir, top, text, model, mtp, args)
    check = check_export(args.out_dir, model, args)
    log(f"export check: {check}")
    active = None if args.active is None else int(args.active.numel())
    summary = {
        "args": dict(vars(args), active=active, inactive=None, column_bias=None),
        "data_seed": args.seed,
        "data_pack_seeds": [int(np.load(p)["seed"]) for p in args.data.split(",")] if args.data else None,
        "parameters": n_params,
        "exchanges": n_ex,
        "steps": step,
        "tokens": tokens,
        "loss_first": first,
        "loss_last": last,
        "train_seconds": round(train_s, 1),
        "step_ms_eager": stepper.ms.get("eager"),
        "step_ms_graphs": stepper.ms.get("graphs"),
        "safetensors_bytes": size,
        "eval_generation": None,
        "export_check": check,
    }

    def write_summary():
        with open(os.path.join(args.out_dir, "training.json"), "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")

    write_summary()  # before generating, so that a run stopped while generating still has it
    log(json.dumps({k: summary[k] for k in ("steps", "loss_first", "loss_last", "safetensors_bytes")}))
    if args.eval_prompts:
        t1 = time.time()
        prompts = load_prompts(args.eval_prompts)
        gen = generate_batch(model, prompts, device, args.eval_max_new)
        with open(os.path.join(args.out_dir, "generated.json"), "w") as f:
            json.dump({"prompts": args.eval_prompts, "generated": gen}, f)
        summary["eval_generation"] = {"prompts": len(prompts), "seconds": round(time.time() - t1, 1)}
        write_summary()
        log(f"generated continuations of {len(prompts)} held-out prompts in {summary['eval_generation']['seconds']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
