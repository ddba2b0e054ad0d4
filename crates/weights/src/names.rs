//! Per-architecture name maps: where each architecture keeps the tensors of the text model, and the
//! re-layout into the canonical form the model uses.
//!
//! Canonical forms: GDN input projections as Qwen3.5's contiguous `in_proj_qkv` `[q(Hk·dk) | k(Hk·dk) |
//! v(Hv·dv)]`, `in_proj_z`, `in_proj_b`, `in_proj_a`; routed experts as one `[2I, H]` gate|up matrix and a
//! `[H, I]` down matrix per expert.

use sanmai_config::{GdnConfig, ModelConfig};

use crate::{Init, Result, TensorSource};

/// Full name of a tensor of the main text model (`model.` or `model.language_model.` prefix).
pub fn text_name(cfg: &ModelConfig, rel: &str) -> String {
    format!("{}{rel}", cfg.weight_prefix)
}

/// The tensors of one decoder layer (`model.layers.{i}.` or `mtp.layers.{i}.`) or any other scope.
pub struct Scope<'a> {
    pub src: &'a dyn TensorSource,
    pub cfg: &'a ModelConfig,
    pub prefix: String,
}

/// The four GDN input projections in canonical contiguous layout, each `[rows, hidden]`.
pub struct GdnInProj {
    pub qkv: Vec<f32>,
    pub z: Vec<f32>,
    pub b: Vec<f32>,
    pub a: Vec<f32>,
}

/// One routed expert: `gate_up` `[2I, H]` (gate rows first), `down` `[H, I]`.
pub struct Expert {
    pub gate_up: Vec<f32>,
    pub down: Vec<f32>,
}

impl<'a> Scope<'a> {
    pub fn layer(src: &'a dyn TensorSource, cfg: &'a ModelConfig, layer: usize) -> Self {
        Scope {
            src,
            cfg,
            prefix: text_name(cfg, &format!("layers.{layer}.")),
        }
    }

    pub fn mtp(src: &'a dyn TensorSource, cfg: &'a ModelConfig) -> Self {
        Scope {
            src,
            cfg,
            prefix: "mtp.".into(),
        }
    }

    pub fn child(&self, rel: &str) -> Scope<'a> {
        Scope {
            src: self.src,
            cfg: self.cfg,
            prefix: format!("{}{rel}", self.prefix),
        }
    }

    pub fn name(&self, rel: &str) -> String {
        format!("{}{rel}", self.prefix)
    }

    /// A tensor of this scope as f32.
    pub fn get(&self, rel: &str, shape: &[usize], init: Init) -> Result<Vec<f32>> {
        Ok(self.src.tensor(&self.name(rel), shape, init)?.into_f32())
    }

    /// `linear_attn.in_proj_*` in canonical layout, from either architecture's form.
    pub fn gdn_in_proj(&self) -> Result<GdnInProj> {
        let g = &self.cfg.gdn;
        let h = self.cfg.hidden_size;
        let w = Init::std((h as f32).powf(-0.5));
        if self.cfg.arch.grouped_gdn_projections() {
            let qkvz = self.get(
                "linear_attn.in_proj_qkvz.weight",
                &[2 * g.key_dim() + 2 * g.value_dim(), h],
                w,
            )?;
            let ba = self.get("linear_attn.in_proj_ba.weight", &[2 * g.num_v_heads, h], w)?;
            Ok(ungroup_qwen3_next(g, h, &qkvz, &ba))
        } else {
            Ok(GdnInProj {
                qkv: self.get("linear_attn.in_proj_qkv.weight", &[g.conv_dim(), h], w)?,
                z: self.get("linear_attn.in_proj_z.weight", &[g.value_dim(), h], w)?,
                b: self.get("linear_attn.in_proj_b.weight", &[g.num_v_heads, h], w)?,
                a: self.get("linear_attn.in_proj_a.weight", &[g.num_v_heads, h], w)?,
            })
        }
    }

    /// The routed experts of `mlp.experts`, per-expert tensors or the fused 3-D form.
    pub fn experts(&self, num_experts: usize, inter: usize) -> Result<Vec<Expert>> {
        let h = self.cfg.hidden_size;
        let fused = self.name("mlp.experts.gate_up_proj");
        let per_expert = self.name("mlp.experts.0.gate_proj.weight");
        let w_in = Init::std((h as f32).powf(-0.5));
        let w_out = Init::std((inter as f32).powf(-0.5));
        if self.src.contains(&fused) || !self.src.contains(&per_expert) {
            let gate_up = self.get(
                "mlp.experts.gate_up_proj",
                &[num_experts, 2 * inter, h],
                w_in,
            )?;
            let down = self.get("mlp.experts.down_proj", &[num_experts, h, inter], w_out)?;
            let (gu, d) = (2 * inter * h, h * inter);
            Ok((0..num_experts)
                .map(|e| Expert {
                    gate_up: gate_up[e * gu..(e + 1) * gu].to_vec(),
                    down: down[e * d..(e + 1) * d].to_vec(),
                })
                .collect())
        } else {
            (0..num_experts)
                .map(|e| {
                    let p = format!("mlp.experts.{e}.");
                    let mut gate_up =
                        self.get(&format!("{p}gate_proj.weight"), &[inter, h], w_in)?;
                    gate_up.extend(self.get(&format!("{p}up_proj.weight"), &[inter, h], w_in)?);
                    let down = self.get(&format!("{p}down_proj.weight"), &[h, inter], w_out)?;
                    Ok(Expert { gate_up, down })
                })
                .collect()
        }
    }
}

/// Qwen3-Next packs `in_proj_qkvz` per key-head group g as `[q_g | k_g | v_g (r·dv) | z_g (r·dv)]` and
/// `in_proj_ba` per group as `[b_g (r) | a_g (r)]` with r = Hv/Hk; rearrange into the contiguous form.
pub fn ungroup_qwen3_next(g: &GdnConfig, h: usize, qkvz: &[f32], ba: &[f32]) -> GdnInProj {
    let r = g.num_v_heads / g.num_k_heads;
    let (dk, dv) = (g.k_head_dim, g.v_head_dim);
    let group_rows = 2 * dk + 2 * r * dv;
    let rows = |src: &[f32], start: usize, n: usize| src[start * h..(start + n) * h].to_vec();
    let mut q = Vec::with_capacity(g.key_dim() * h);
    let mut k = Vec::with_capacity(g.key_dim() * h);
    let mut v = Vec::with_capacity(g.value_dim() * h);
    let mut z = Vec::with_capacity(g.value_dim() * h);
    let mut b = Vec::with_capacity(g.num_v_heads * h);
    let mut a = Vec::with_capacity(g.num_v_heads * h);
    for grp in 0..g.num_k_heads {
        let base = grp * group_rows;
        q.extend(rows(qkvz, base, dk));
        k.extend(rows(qkvz, base + dk, dk));
        v.extend(rows(qkvz, base + 2 * dk, r * dv));
        z.extend(rows(qkvz, base + 2 * dk + r * dv, r * dv));
        b.extend(rows(ba, grp * 2 * r, r));
        a.extend(rows(ba, grp * 2 * r + r, r));
    }
    q.extend(k);
    q.extend(v);
    GdnInProj { qkv: q, z, b, a }
}
