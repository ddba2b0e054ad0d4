#!/usr/bin/env python3
"""Build tiny random Qwen3-Next / Qwen3.5-MoE checkpoints and record reference outputs.

Usage:  python3 make_fixtures.py OUT_DIR

Writes three checkpoint directories under OUT_DIR:

  qwen3_next_tiny/          model_type qwen3_next        (Qwen3NextForCausalLM)
  qwen3_5_moe_text_tiny/    model_type qwen3_5_moe_text  (Qwen3_5MoeForCausalLM)
  qwen3_5_moe_tiny/         model_type qwen3_5_moe       (multimodal wrapper layout, same text
                                                          weights and references as the one above)

Each holds config.json, model.safetensors (bf16), generation_config.json and reference.json.
Weights are random, scaled so activations stay near unit variance and logits are peaked, rounded
to bf16 before saving; references are computed by HF transformers (5.x) from the saved bf16 weights
promoted to float64, on the CPU. The MTP head (`mtp.*`, ignored by transformers) is evaluated by a
small forward built from the model family's own decoder layer and RMSNorm modules. See README.md
beside this script for the exact definitions.

Needs torch, transformers >= 5 and safetensors. No GPU is used.
"""

import argparse
import copy
import json
import math
import os
import re
import shutil
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (  # noqa: E402
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as qn  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Sizes and knobs
# ----------------------------------------------------------------------------------------------

VOCAB = 1024
HIDDEN = 64
LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
MTP_LAYER_IDX = 3  # a full-attention layer index whose MLP is the MoE block
PROMPT_LENGTHS = [5, 70, 300]
PROMPT_SEED = 20250101
GREEDY_STEPS = 24
MTP_POSITIONS = {0: [0, 1, 2, 3], 1: [0, 1, 31, 63, 64, 68]}
SEED_CANDIDATES = 8  # weight seeds tried per model; the least tie-prone one is kept

LM_HEAD_GAIN = 4.0  # logits std ~ this (the final norm output has unit RMS)
ROUTER_GAIN = 4.0  # router logits std ~ this, so top-k selection is decisive
NORM_OFFSET_STD = 0.1  # zero-centred RMSNorm weights ~ N(0, this^2); gated norm ~ 1 + N(0, this^2)

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=len(LAYER_TYPES),
    layer_types=list(LAYER_TYPES),
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    hidden_act="silu",
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    initializer_range=0.02,
)

QWEN3_NEXT_KWARGS = dict(
    COMMON,
    intermediate_size=96,
    mlp_only_layers=[1],
    decoder_sparse_step=1,
    norm_topk_prob=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    num_nextn_predict_layers=1,
)

# rotary dim = 32 * 0.25 = 8 -> 4 frequencies; mrope_section must sum to 4.
QWEN3_5_TEXT_KWARGS = dict(
    COMMON,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    mtp_num_hidden_layers=1,
)

QWEN3_5_VISION_KWARGS = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=HIDDEN,
    num_position_embeddings=64,
)

IMPL = dict(attn_implementation="eager", experts_implementation="eager")

PER_EXPERT_RE = re.compile(r"^(?P<p>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<w>gate_proj|up_proj|down_proj)\.weight$")
FUSED_RE = re.compile(r"^(?P<p>.+\.mlp\.experts)\.(?P<w>gate_up_proj|down_proj)$")
ZERO_CENTRED_NORM_RE = re.compile(
    r"(^|\.)(input_layernorm|post_attention_layernorm|norm|q_norm|k_norm|"
    r"pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight$"
)


def log(msg):
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------
# Weight initialisation
# ----------------------------------------------------------------------------------------------


def init_tensor(name, shape, gen):
    """Scaled random init for one parameter, chosen by its name."""

    def normal(std, mean=0.0):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if name == "lm_head.weight":
        return normal(LM_HEAD_GAIN / math.sqrt(shape[1]))
    if name.endswith("linear_attn.norm.weight"):  # plain-weight gated RMSNorm
        return normal(NORM_OFFSET_STD, 1.0)
    if ZERO_CENTRED_NORM_RE.search(name):  # y = norm(x) * (1 + w)
        return normal(NORM_OFFSET_STD)
    if name.endswith("linear_attn.A_log"):
        # As transformers initialises it (A ~ U(0.01, 16)), except value head 0 of each layer gets
        # a slow decay (A ~ U(0.005, 0.05)) so the recurrent state carries information across the
        # 64-token chunk boundary and through decode.
        a = torch.rand(shape, generator=gen, dtype=torch.float32) * (16.0 - 0.01) + 0.01
        a[0] = torch.rand((), generator=gen, dtype=torch.float32) * 0.045 + 0.005
        return a.log()
    if name.endswith("linear_attn.dt_bias"):
        return normal(0.1, 1.0)
    if name.endswith("conv1d.weight"):  # [channels, 1, kernel]
        return normal(1.0 / math.sqrt(shape[-1]))
    if name.endswith("mlp.gate.weight"):  # router [E, H]
        return normal(ROUTER_GAIN / math.sqrt(shape[1]))
    if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]
        return normal(1.0 / math.sqrt(shape[2]))
    if name.endswith("mlp.experts.down_proj"):  # [E, H, I]
        return normal(1.0 / math.sqrt(shape[2]))
    if name.endswith(".weight") and len(shape) == 2:  # every other Linear [out, in]
        return normal(1.0 / math.sqrt(shape[1]))
    raise ValueError(f"no init rule for parameter {name} {tuple(shape)}")


@torch.no_grad()
def init_and_round(module, gen, prefix=""):
    """Initialise every parameter of `module` and round it to bf16 (kept in float32)."""
    for name, p in module.named_parameters():
        t = init_tensor(prefix + name, tuple(p.shape), gen)
        p.data = t.to(torch.bfloat16).to(p.dtype)


# ----------------------------------------------------------------------------------------------
# Expert weight forms
# ----------------------------------------------------------------------------------------------


def experts_to_per_expert(sd):
    """Fused `experts.gate_up_proj` [E,2I,H] / `experts.down_proj` [E,H,I] -> per-expert Linears."""
    out = {}
    for k, v in sd.items():
        m = FUSED_RE.match(k)
        if m is None:
            out[k] = v
            continue
        p, w = m["p"], m["w"]
        if w == "gate_up_proj":
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{p}.{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                out[f"{p}.{e}.up_proj.weight"] = v[e, inter:].contiguous()
        else:
            for e in range(v.shape[0]):
                out[f"{p}.{e}.down_proj.weight"] = v[e].contiguous()
    return out


def experts_to_fused(sd):
    """Per-expert `experts.{e}.{gate,up,down}_proj.weight` -> fused 3-D tensors."""
    out, groups = {}, {}
    for k, v in sd.items():
        m = PER_EXPERT_RE.match(k)
        if m is None:
            out[k] = v
            continue
        groups.setdefault(m["p"], {}).setdefault(m["w"], {})[int(m["e"])] = v
    for p, ws in groups.items():
        n = len(ws["gate_proj"])
        gate = torch.stack([ws["gate_proj"][e] for e in range(n)])
        up = torch.stack([ws["up_proj"][e] for e in range(n)])
        out[f"{p}.gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()
        out[f"{p}.down_proj"] = torch.stack([ws["down_proj"][e] for e in range(n)]).contiguous()
    return out


def expert_form(keys):
    per = any(PER_EXPERT_RE.match(k) for k in keys)
    fused = any(FUSED_RE.match(k) for k in keys)
    if per == fused:
        raise RuntimeError(f"cannot tell the expert form (per-expert={per}, fused={fused})")
    return "per_expert" if per else "fused"


def to_form(sd, form):
    return experts_to_per_expert(sd) if form == "per_expert" else experts_to_fused(sd)


# ----------------------------------------------------------------------------------------------
# MTP head
# ----------------------------------------------------------------------------------------------


class MtpHead(torch.nn.Module):
    """`mtp.*`: fc(cat[norm_e(embed(next)), norm_h(h)]) -> decoder layer -> norm (lm_head shared)."""

    def __init__(self, config, decoder_layer_cls, norm_cls):
        super().__init__()
        h = config.hidden_size
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = norm_cls(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_cls(h, eps=config.rms_norm_eps)
        self.layers = torch.nn.ModuleList([decoder_layer_cls(config, MTP_LAYER_IDX)])
        self.norm = norm_cls(h, eps=config.rms_norm_eps)


def family(model_type):
    if model_type == "qwen3_next":
        return qn.Qwen3NextDecoderLayer, qn.Qwen3NextRMSNorm
    return q35.Qwen3_5MoeDecoderLayer, q35.Qwen3_5MoeRMSNorm


def rope_position_ids(model_type, positions):
    pos = positions.view(1, -1)
    if model_type == "qwen3_next":
        return pos
    return pos.view(1, 1, -1).expand(3, 1, -1)  # text-only MRoPE: T = H = W


@torch.no_grad()
def mtp_forward(model, mtp, model_type, ids):
    """Draft logits for MTP indices t = 0..n-2 (index t consumes x_{t+1} and h_t)."""
    n = ids.shape[0]
    h = model.model(input_ids=ids[None], use_cache=False).last_hidden_state  # after final norm
    emb = model.model.embed_tokens(ids[None, 1:])
    x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(emb), mtp.pre_fc_norm_hidden(h[:, : n - 1])], dim=-1))
    positions = torch.arange(n - 1)
    pe = model.model.rotary_emb(x, rope_position_ids(model_type, positions))
    mask = torch.full((n - 1, n - 1), float("-inf"), dtype=x.dtype).triu(1)[None, None]
    x = mtp.layers[0](x, position_embeddings=pe, attention_mask=mask, position_ids=positions[None])
    x = mtp.norm(x)
    return model.lm_head(x)[0]


# ----------------------------------------------------------------------------------------------
# Reference computation
# ----------------------------------------------------------------------------------------------


def make_prompts():
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    return [torch.randint(0, VOCAB, (n,), generator=gen, dtype=torch.long) for n in PROMPT_LENGTHS]


def floats(t):
    return [float(x) for x in t.reshape(-1).tolist()]


def router_hooks(model, store):
    """Record, per router, the smallest gap between the k-th and (k+1)-th router logit."""
    handles = []
    for name, mod in model.named_modules():
        if name.endswith("mlp.gate") and hasattr(mod, "top_k"):

            def hook(mod, args, out, name=name):
                logits = out[0].detach().to(torch.float64)
                top = logits.topk(mod.top_k + 1, dim=-1).values
                gap = float((top[:, mod.top_k - 1] - top[:, mod.top_k]).min())
                store[name] = min(store.get(name, float("inf")), gap)

            handles.append(mod.register_forward_hook(hook))
    return handles


@torch.no_grad()
def compute_reference(model, mtp, model_type, prompts):
    ref = {
        "model_type": model_type,
        "compute_dtype": "float64",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "prompts": [],
        "mtp": [],
    }
    debug = {
        "precision_note": (
            "weights are the saved bf16 values promoted to float64; transformers computes RMSNorm, "
            "softmaxes, RoPE tables, the router softmax and the GatedDeltaNet kernels in float32 internally"
        ),
        "mtp_layer_index_used": MTP_LAYER_IDX,
    }
    router_gaps = {}
    handles = router_hooks(model, router_gaps)
    mismatches, max_cache_diff, max_prefill_diff = [], 0.0, 0.0
    logits_std, top1_probs, gaps_all = [], [], []
    for pi, ids in enumerate(prompts):
        n = ids.shape[0]
        logits = model(input_ids=ids[None], use_cache=False).logits[0].to(torch.float64)
        lp = torch.log_softmax(logits, dim=-1)
        prompt_lp = [None] + [float(lp[t - 1, ids[t]]) for t in range(1, n)]
        logits_std.append(float(logits.std()))
        top1_probs += floats(lp.exp().max(dim=-1).values)

        # Greedy with the model's cache: chunked prefill, then single-token recurrent decode.
        out = model(input_ids=ids[None], use_cache=True)
        cache = out.past_key_values
        step_logits = out.logits[0, -1].to(torch.float64)
        max_prefill_diff = max(max_prefill_diff, float((out.logits[0].to(torch.float64) - logits).abs().max()))
        greedy, greedy_lp, greedy_gap, rows = [], [], [], []
        for _ in range(GREEDY_STEPS):
            row = torch.log_softmax(step_logits, dim=-1)
            top2 = step_logits.topk(2)
            tok = int(top2.indices[0])
            greedy.append(tok)
            greedy_lp.append(float(row[tok]))
            greedy_gap.append(float(top2.values[0] - top2.values[1]))
            rows.append(row)
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            step_logits = out.logits[0, -1].to(torch.float64)
        gaps_all += greedy_gap

        # Cross-check: one no-cache forward over prompt + greedy tokens (chunked GDN everywhere).
        full = torch.cat([ids, torch.tensor(greedy, dtype=torch.long)])
        full_logits = model(input_ids=full[None], use_cache=False).logits[0].to(torch.float64)
        full_rows = torch.log_softmax(full_logits[n - 1 : n - 1 + GREEDY_STEPS], dim=-1)
        recompute = [int(i) for i in full_rows.argmax(dim=-1)]
        for i, (a, b) in enumerate(zip(greedy, recompute)):
            if a != b:
                mismatches.append({"prompt_index": pi, "step": i, "cached": a, "recompute": b})
        max_cache_diff = max(max_cache_diff, float((torch.stack(rows) - full_rows).abs().max()))

        ref["prompts"].append(
            {
                "ids": [int(i) for i in ids],
                "prompt_logprobs": prompt_lp,
                "greedy_ids": greedy,
                "greedy_logprobs": greedy_lp,
                "greedy_top2_gap": greedy_gap,
            }
        )
        log(
            f"  prompt {pi} (n={n}): logits std {logits_std[-1]:.3f}, greedy {greedy[:8]}..., "
            f"min top2 gap {min(greedy_gap):.4f}"
        )
    for h in handles:
        h.remove()

    # model.generate as a further cross-check of the manual loop
    try:
        gen_ok = []
        for pi, ids in enumerate(prompts):
            out = model.generate(input_ids=ids[None], max_new_tokens=GREEDY_STEPS, do_sample=False)
            gen_ok.append([int(i) for i in out[0, ids.shape[0] :]] == ref["prompts"][pi]["greedy_ids"])
        debug["generate_matches_manual_loop"] = gen_ok
    except Exception as e:  # recorded, not fatal
        debug["generate_matches_manual_loop"] = f"error: {type(e).__name__}: {e}"
    log(f"  generate() matches manual greedy loop: {debug['generate_matches_manual_loop']}")

    # MTP
    mtp_gaps = {}
    mtp_handles = router_hooks(mtp, mtp_gaps)
    mtp_argmax = {}
    for pi, positions in MTP_POSITIONS.items():
        ids = prompts[pi]
        draft = torch.log_softmax(mtp_forward(model, mtp, model_type, ids).to(torch.float64), dim=-1)
        ref["mtp"].append(
            {
                "prompt_index": pi,
                "positions": positions,
                "next_ids": [int(ids[t + 1]) for t in positions],
                "draft_logprobs": [floats(draft[t]) for t in positions],
            }
        )
        mtp_argmax[str(pi)] = [int(draft[t].argmax()) for t in positions]
        # Causality check: the draft rows of a prefix must not depend on later tokens.
        if pi == 1:
            short = torch.log_softmax(mtp_forward(model, mtp, model_type, ids[:33]).to(torch.float64), dim=-1)
            debug["mtp_prefix_consistency_max_abs_diff"] = float((short - draft[:32]).abs().max())
    for h in mtp_handles:
        h.remove()
    for k, v in mtp_gaps.items():
        router_gaps["mtp." + k] = v

    # Debug: per-layer hidden-state norms for prompt 0 and its final hidden states.
    ids0 = prompts[0]
    acts = {}
    hs = [
        model.model.embed_tokens.register_forward_hook(lambda m, a, o: acts.__setitem__("embed", o)),
        model.model.norm.register_forward_hook(lambda m, a, o: acts.__setitem__("final_norm", o)),
    ]
    for i, layer in enumerate(model.model.layers):
        hs.append(layer.register_forward_hook(lambda m, a, o, i=i: acts.__setitem__(f"layer_{i}", o)))
    last_logits = model(input_ids=ids0[None], use_cache=False).logits[0, -1].to(torch.float64)
    for h in hs:
        h.remove()
    debug["prompt0_hidden_l2_norms"] = {
        k: floats(v[0].to(torch.float64).norm(dim=-1)) for k, v in sorted(acts.items())
    }
    debug["prompt0_final_hidden"] = [floats(r) for r in acts["final_norm"][0].to(torch.float64)]
    debug["prompt0_last_logits_first16"] = floats(last_logits[:16])
    debug["router_min_topk_logit_gap"] = router_gaps
    debug["gdn_A"] = {
        name: floats(p.detach().to(torch.float64).exp())
        for name, p in model.named_parameters()
        if name.endswith("A_log")
    }
    debug["logits_std_per_prompt"] = logits_std
    debug["frac_prompt_positions_top1_prob_gt_0_2"] = sum(p > 0.2 for p in top1_probs) / len(top1_probs)
    debug["median_top1_prob"] = sorted(top1_probs)[len(top1_probs) // 2]
    debug["min_greedy_top2_gap"] = min(gaps_all)
    debug["cache_vs_recompute"] = {
        "token_mismatches": mismatches,
        "max_abs_logprob_diff": max_cache_diff,
        "max_abs_prefill_logit_diff_cache_vs_nocache": max_prefill_diff,
    }
    debug["mtp_draft_argmax"] = mtp_argmax

    # How far lower-precision runs of the same weights land (guides test tolerances).
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        try:
            low = copy.deepcopy(model).to(dt)
            low_logits = low(input_ids=prompts[1][None], use_cache=False).logits[0].to(torch.float64)
            ref_logits = model(input_ids=prompts[1][None], use_cache=False).logits[0].to(torch.float64)
            debug[f"{name}_run_prompt1"] = {
                "max_abs_logit_diff": float((low_logits - ref_logits).abs().max()),
                "argmax_agreement": float((low_logits.argmax(-1) == ref_logits.argmax(-1)).double().mean()),
            }
            del low
        except Exception as e:
            debug[f"{name}_run_prompt1"] = f"error: {type(e).__name__}: {e}"
    ref["debug"] = debug
    log(
        f"  logits std {['%.2f' % s for s in logits_std]}, top1>0.2 on "
        f"{debug['frac_prompt_positions_top1_prob_gt_0_2']:.2f} of positions, median top1 "
        f"{debug['median_top1_prob']:.2f}, min greedy gap {debug['min_greedy_top2_gap']:.4f}"
    )
    log(f"  router min top-k logit gaps: { {k: round(v, 4) for k, v in router_gaps.items()} }")
    log(f"  cache vs recompute: {debug['cache_vs_recompute']}")
    log(f"  f32 run: {debug['float32_run_prompt1']}; bf16 run: {debug['bfloat16_run_prompt1']}")
    return ref


# ----------------------------------------------------------------------------------------------
# Checkpoint writing
# ----------------------------------------------------------------------------------------------


def finite(obj):
    """Replace non-finite floats (not valid JSON) by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write_json(path, obj, compact=False):
    obj = finite(obj)
    with open(path, "w") as f:
        if compact:
            json.dump(obj, f, separators=(",", ":"))
        else:
            json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def ensure_config_keys(path, config, keys):
    """Write keys that the diff-serialiser dropped because they equal a library default."""
    with open(path) as f:
        cfg = json.load(f)
    full = config.to_dict()
    for k in keys:
        if k not in cfg and k in full:
            cfg[k] = full[k]
    write_json(path, cfg)


def bf16_state(module, prefix=""):
    return {prefix + k: v.detach().to(torch.bfloat16).contiguous() for k, v in module.state_dict().items()}


def check_same(name, a, b):
    bad = [k for k in a if k not in b or not torch.equal(a[k].to(torch.float64), b[k].to(torch.float64))]
    missing = [k for k in b if k not in a]
    if bad or missing:
        raise RuntimeError(f"{name}: tensors differ {bad[:5]} / missing {missing[:5]}")


def build_text_checkpoint(out_dir, model_cls, config_cls, kwargs, seed):
    """Init, round to bf16, save_pretrained, append mtp.* in the same expert form."""
    gen = torch.Generator().manual_seed(seed)
    config = config_cls(**copy.deepcopy(kwargs), **IMPL)
    model = model_cls(config).eval()
    init_and_round(model, gen)
    layer_cls, norm_cls = family(config.model_type)
    mtp = MtpHead(config, layer_cls, norm_cls).eval()
    init_and_round(mtp, gen, prefix="mtp.")

    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    ensure_config_keys(os.path.join(out_dir, "config.json"), config, ["tie_word_embeddings"])
    st_path = os.path.join(out_dir, "model.safetensors")
    if not os.path.exists(st_path):
        raise RuntimeError(f"save_pretrained did not write a single model.safetensors in {out_dir}")
    tensors = load_file(st_path)
    form = expert_form(tensors.keys())
    # Our form conversion must agree with the one transformers applied when saving.
    expected = to_form(bf16_state(model), form)
    conv_ok = set(expected) == set(tensors) and all(torch.equal(expected[k], tensors[k]) for k in expected)
    log(f"  expert form conversion agrees with save_pretrained: {conv_ok}")
    if not conv_ok:
        log(f"    only ours: {sorted(set(expected) - set(tensors))[:6]}")
        log(f"    only saved: {sorted(set(tensors) - set(expected))[:6]}")
    mtp_sd = to_form(bf16_state(mtp, "mtp."), form)
    clash = set(mtp_sd) & set(tensors)
    if clash:
        raise RuntimeError(f"mtp names clash with saved names: {sorted(clash)[:5]}")
    tensors.update(mtp_sd)
    save_file(tensors, st_path, metadata={"format": "pt"})
    log(f"  saved {len(tensors)} tensors, routed experts stored {form}")
    return model.to(torch.float32), mtp, form, conv_ok


def load_for_reference(out_dir, model_cls, in_memory, form):
    """Reload the saved checkpoint in float64 and rebuild the MTP head from its mtp.* tensors."""
    model, info = model_cls.from_pretrained(out_dir, dtype=torch.float64, output_loading_info=True, **IMPL)
    model.eval()
    if info["missing_keys"] or info["mismatched_keys"]:
        raise RuntimeError(f"loading {out_dir}: {info}")
    check_same("reloaded model vs in-memory", model.state_dict(), in_memory.state_dict())
    tensors = load_file(os.path.join(out_dir, "model.safetensors"))
    mtp_sd = {k[len("mtp.") :]: v for k, v in tensors.items() if k.startswith("mtp.")}
    if form == "per_expert":
        mtp_sd = experts_to_fused(mtp_sd)
    layer_cls, norm_cls = family(model.config.model_type)
    mtp = MtpHead(model.config, layer_cls, norm_cls).to(torch.float64).eval()
    mtp.load_state_dict({k: v.to(torch.float64) for k, v in mtp_sd.items()}, strict=True)
    return model, mtp


def build_wrapper_checkpoint(out_dir, text_dir, text_model, form):
    """qwen3_5_moe multimodal layout of the qwen3_5_moe_text weights, other expert form."""
    other = "fused" if form == "per_expert" else "per_expert"
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    cfg = Qwen3_5MoeConfig(
        text_config=copy.deepcopy(QWEN3_5_TEXT_KWARGS),
        vision_config=copy.deepcopy(QWEN3_5_VISION_KWARGS),
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    cfg.dtype = torch.bfloat16
    cfg.text_config.dtype = torch.bfloat16
    cfg.vision_config.dtype = torch.bfloat16
    cfg.save_pretrained(out_dir)
    ensure_config_keys(os.path.join(out_dir, "config.json"), cfg, ["tie_word_embeddings"])
    shutil.copy(os.path.join(text_dir, "generation_config.json"), os.path.join(out_dir, "generation_config.json"))

    src = load_file(os.path.join(text_dir, "model.safetensors"))
    dst = {}
    for k, v in src.items():
        if k.startswith("model."):
            dst["model.language_model." + k[len("model.") :]] = v
        else:  # lm_head.weight, mtp.*
            dst[k] = v
    dst = to_form(experts_to_fused(dst), other)
    save_file(dst, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    log(f"  saved {len(dst)} tensors, routed experts stored {other}")

    # Cross-check: transformers' multimodal class reads this layout to the same text weights.
    check = {}
    try:
        wrap, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(
            out_dir, dtype=torch.float64, output_loading_info=True, **IMPL
        )
        wrap.eval()
        missing = [k for k in info["missing_keys"] if not k.startswith("model.visual.")]
        check["missing_non_vision_keys"] = missing
        check["unexpected_keys"] = list(info["unexpected_keys"])
        lm = wrap.model.language_model.state_dict()
        ref_sd = text_model.model.state_dict()
        check["language_model_weights_equal"] = all(
            k in lm and torch.equal(lm[k], v.to(torch.float64)) for k, v in ref_sd.items()
        )
        check["lm_head_equal"] = torch.equal(wrap.lm_head.weight, text_model.lm_head.weight.to(torch.float64))
        diffs = []
        with torch.no_grad():
            for ids in make_prompts():
                a = wrap(input_ids=ids[None], use_cache=False).logits[0]
                b = text_model(input_ids=ids[None], use_cache=False).logits[0]
                diffs.append(float((a - b).abs().max()))
        check["max_abs_logit_diff_vs_text_model"] = diffs
    except Exception as e:
        check["error"] = f"{type(e).__name__}: {e}"
    try:
        causal, info = Qwen3_5MoeForCausalLM.from_pretrained(
            out_dir, dtype=torch.float64, output_loading_info=True, **IMPL
        )
        check["causal_lm_class_reads_wrapper_layout"] = {
            "missing_keys": list(info["missing_keys"]),
            "weights_equal": all(
                torch.equal(causal.state_dict()[k], v.to(torch.float64))
                for k, v in text_model.state_dict().items()
            ),
        }
    except Exception as e:
        check["causal_lm_class_reads_wrapper_layout"] = f"error: {type(e).__name__}: {e}"
    log(f"  wrapper cross-check: {check}")
    return check, other


def tensor_listing(path):
    t = load_file(path)
    return {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in sorted(t.items())}


def robustness(ref):
    """Smallest router top-k logit gap and greedy top-2 logit gap seen while making the references."""
    d = ref["debug"]
    return min(min(d["router_min_topk_logit_gap"].values()), d["min_greedy_top2_gap"])


def build_text_fixture(out_dir, name, model_cls, config_cls, kwargs, seeds, prompts):
    """Build one candidate per weight seed; keep the one whose references are least tie-prone."""
    best, scores = None, {}
    for seed in seeds:
        tmp = os.path.join(out_dir, f".{name}.seed{seed}")
        log(f"-- {name}, weight seed {seed}")
        try:
            in_memory, _, form, conv_ok = build_text_checkpoint(tmp, model_cls, config_cls, kwargs, seed)
            model, mtp = load_for_reference(tmp, model_cls, in_memory, form)
            ref = compute_reference(model, mtp, model.config.model_type, prompts)
        except Exception:
            traceback.print_exc()
            shutil.rmtree(tmp, ignore_errors=True)
            continue
        scores[str(seed)] = robustness(ref)
        log(f"  robustness (min router / greedy gap): {scores[str(seed)]:.5f}")
        if best is None or scores[str(seed)] > scores[str(best[0])]:
            if best is not None:
                shutil.rmtree(best[1])
            best = (seed, tmp, ref, model, form, conv_ok)
        else:
            shutil.rmtree(tmp)
    if best is None:
        return None
    seed, tmp, ref, model, form, conv_ok = best
    d = os.path.join(out_dir, name)
    if os.path.exists(d):
        shutil.rmtree(d)
    os.rename(tmp, d)
    ref["debug"]["routed_expert_form"] = form
    ref["debug"]["weight_seed"] = seed
    ref["debug"]["weight_seed_robustness"] = scores
    write_json(os.path.join(d, "reference.json"), ref, compact=True)
    log(f"== {name}: kept weight seed {seed} (robustness {scores[str(seed)]:.5f})")
    summary = {
        "expert_form": form,
        "expert_form_conversion_agrees_with_save_pretrained": conv_ok,
        "tensors": tensor_listing(os.path.join(d, "model.safetensors")),
    }
    return ref, model, form, summary


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", help="directory that receives the fixture directories")
    ap.add_argument("--summary", help="also write a JSON listing of every fixture's tensors here")
    ap.add_argument("--candidates", type=int, default=SEED_CANDIDATES, help="weight seeds tried per model")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out_dir, exist_ok=True)
    t0 = time.time()
    log(f"transformers {transformers.__version__}, torch {torch.__version__}")
    prompts = make_prompts()
    summary = {}

    specs = [
        ("qwen3_next_tiny", Qwen3NextForCausalLM, Qwen3NextConfig, QWEN3_NEXT_KWARGS, 100),
        ("qwen3_5_moe_text_tiny", Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, QWEN3_5_TEXT_KWARGS, 200),
    ]
    built = {}
    for name, model_cls, config_cls, kwargs, base in specs:
        seeds = range(base, base + args.candidates)
        res = build_text_fixture(args.out_dir, name, model_cls, config_cls, kwargs, seeds, prompts)
        if res is not None:
            built[name] = res
            summary[name] = res[3]

    text_name = "qwen3_5_moe_text_tiny"
    if text_name in built:
        name = "qwen3_5_moe_tiny"
        log(f"== {name}")
        d = os.path.join(args.out_dir, name)
        text_ref, text_model, text_form, _ = built[text_name]
        check, other = build_wrapper_checkpoint(d, os.path.join(args.out_dir, text_name), text_model, text_form)
        ref = copy.deepcopy(text_ref)
        ref["model_type"] = "qwen3_5_moe"
        ref["debug"]["routed_expert_form"] = other
        ref["debug"]["same_references_as"] = text_name
        ref["debug"]["wrapper_cross_check"] = check
        write_json(os.path.join(d, "reference.json"), ref, compact=True)
        summary[name] = {"expert_form": other, "tensors": tensor_listing(os.path.join(d, "model.safetensors"))}

    if args.summary:
        write_json(args.summary, summary)
    log(f"done in {time.time() - t0:.1f} s")
    return 0 if len(built) == len(specs) else 1


if __name__ == "__main__":
    sys.exit(main())
