//! Building a [`Model`]: asks the weight source for every tensor (through the architecture's name map),
//! converts it into the backend's storage and assembles the layers.

use std::cell::RefCell;
use std::ops::Range;

use sanmai_config::{FfnType, LayerType, ModelConfig};
use sanmai_weights::names::{text_name, ungroup_qwen3_next, GdnInProj, Scope};
use sanmai_weights::quant::{PackedTensor, PackedWords};
use sanmai_weights::{Init, Result, TensorSource, WeightError};

use crate::backend::{
    AttnShape, AttnWeights, Backend, GdnShape, GdnWeights, HcWeights, IndexerWeights, KvHost,
    MlpWeights, MoeWeights, PackedInfo, PleShape, PleWeights, QsaShape, Rope,
};
use crate::ple::source::PleSource;

mod blocks;
mod held;

pub enum Mixer<W> {
    Attention(AttnWeights<W>),
    /// qwen4_exp QSA: gated attention restricted to the indexer's top-k positions.
    Qsa(AttnWeights<W>, IndexerWeights<W>),
    Gdn(GdnWeights<W>),
}

pub enum Ffn<W> {
    Dense(MlpWeights<W>),
    Moe(MoeWeights<W>),
}

pub struct Layer<W> {
    pub input_norm: W,
    pub post_attention_norm: W,
    pub mixer: Mixer<W>,
    pub ffn: Ffn<W>,
    /// qwen4_exp PLE mix before the mixer (layers in `ple.layer_ids`).
    pub ple: Option<PleWeights<W>>,
    /// qwen4_exp hyper-connections of the mixer and FFN sublayers.
    pub hc: Option<(HcWeights<W>, HcWeights<W>)>,
}

/// The MTP draft head: `fc(cat[norm_e(embed(next)), norm_h(h_prev)])`, one decoder layer, `norm`.
pub struct MtpWeights<W> {
    pub fc: W,
    pub pre_fc_norm_embedding: W,
    pub pre_fc_norm_hidden: W,
    pub layer: Layer<W>,
    pub norm: W,
}

/// A loaded model on a backend.
pub struct Model<B: Backend> {
    pub cfg: ModelConfig,
    pub backend: B,
    /// The decoder layers this model holds: all of them, or one pipeline stage's contiguous range
    /// ([`Model::load_stage`]). `layers[j]` is layer `stage.start + j`; cache layer indices are the
    /// absolute ones.
    pub stage: Range<usize>,
    /// The token embedding: on the first stage, and on the last when it serves as the lm_head (tied)
    /// ([`Model::embedding`]).
    pub embed: Option<B::Weight>,
    /// The MTP head's copy of the token embedding on a last stage that is not the first and whose
    /// lm_head is not the embedding: in host memory, `[vocab, hidden]` f32, its few rows a step
    /// gathered there and uploaded ([`Model::draft_embed`]). The device keeps its room for K/V.
    pub mtp_embed: Option<Vec<f32>>,
    /// Not loaded when tied to the embedding, or on a stage other than the last.
    pub lm_head: Option<B::Weight>,
    /// The final norm, on the last stage ([`Model::final_norm`]).
    pub norm: Option<B::Weight>,
    pub layers: Vec<Layer<B::Weight>>,
    pub mtp: Option<MtpWeights<B::Weight>>,
    pub attn_shape: AttnShape,
    pub gdn_shape: GdnShape,
    pub rope: Rope,
    /// QSA shapes (every full-attention layer and the MTP layer), when the config has `qsa`.
    pub qsa: Option<QsaShape>,
    /// PLE shape and row source, when the config has `ple`.
    pub ple: Option<(PleShape, PleSource)>,
    /// Hyper-connections' head collapse `hc_head.pre` `[S]`, when the config has them.
    pub hc_head: Option<B::Weight>,
    /// The weights loaded in packed form, in load order.
    pub packed: Vec<PackedInfo>,
    /// Where [`Model::init_cache`] puts the K/V rows of QSA layers: pinned host memory when set.
    pub kv_host: Option<KvHost>,
}

/// The four GDN input projections `(qkv, z, b, a)` in backend form.
type GdnWeights4<W> = (W, W, W, W);

/// Zero-centred RMSNorm weights are stored as offsets from 1.
const NORM: Init = Init::ZEROS;

pub(crate) struct Loader<'a, B: Backend> {
    pub(crate) backend: &'a B,
    pub(crate) cfg: &'a ModelConfig,
    /// What went to the backend packed.
    pub(crate) packed: RefCell<Vec<PackedInfo>>,
}

/// Rows `rows` of a packed matrix (in that order) as a new owned packed matrix named `name`.
fn packed_rows(
    name: &str,
    parts: &[&PackedTensor<'_>],
    rows: &[(usize, usize)],
) -> PackedTensor<'static> {
    let p0 = parts[0];
    let (wpr, sc) = (p0.words_per_row(), p0.scale_cols());
    let words: Vec<_> = parts.iter().map(|p| p.words()).collect();
    let mut w = Vec::with_capacity(rows.len() * wpr);
    let mut scales = Vec::with_capacity(rows.len() * sc);
    for &(part, r) in rows {
        w.extend_from_slice(&words[part][r * wpr..(r + 1) * wpr]);
        scales.extend_from_slice(&parts[part].scales[r * sc..(r + 1) * sc]);
    }
    PackedTensor {
        name: name.into(),
        bits: p0.bits,
        group_size: p0.group_size,
        out_features: rows.len(),
        in_features: p0.in_features,
        packed: PackedWords::Owned(w),
        scales,
        fp8: p0.fp8,
    }
}

/// `a` rows then `b` rows, when both share a scheme and input width.
fn packed_concat(
    name: &str,
    a: &PackedTensor<'_>,
    b: &PackedTensor<'_>,
) -> Option<PackedTensor<'static>> {
    if a.scheme() != b.scheme() || a.fp8 != b.fp8 || a.in_features != b.in_features {
        return None;
    }
    let rows: Vec<_> = (0..a.out_features)
        .map(|r| (0, r))
        .chain((0..b.out_features).map(|r| (1, r)))
        .collect();
    Some(packed_rows(name, &[a, b], &rows))
}

impl<B: Backend> Loader<'_, B> {
    pub(crate) fn w(&self, data: Vec<f32>, shape: &[usize]) -> Result<B::Weight> {
        self.backend
            .weight(data, shape)
            .map_err(|e| WeightError::Upload {
                message: e.to_string(),
            })
    }

    /// Hands a packed matrix to the backend and records it.
    fn packed_w(&self, p: &PackedTensor<'_>) -> Result<B::Weight> {
        self.packed.borrow_mut().push(PackedInfo {
            name: p.name.clone(),
            bits: p.bits,
            group_size: p.group_size,
            out_features: p.out_features,
            in_features: p.in_features,
            bytes: p.nbytes(),
        });
        self.backend
            .packed_weight(p)
            .map_err(|e| WeightError::Upload {
                message: format!("`{}`: {e}", p.name),
            })
    }

    /// The packed form of the Linear weight `rel` `[out, inp]`, when the source holds it packed.
    fn packed<'s>(
        &self,
        s: &Scope<'s>,
        rel: &str,
        out: usize,
        inp: usize,
        init: Init,
    ) -> Result<Option<PackedTensor<'s>>> {
        s.src.packed(&s.name(rel), &[out, inp], init)
    }

    pub(crate) fn get(
        &self,
        s: &Scope,
        rel: &str,
        shape: &[usize],
        init: Init,
    ) -> Result<B::Weight> {
        self.w(s.get(rel, shape, init)?, shape)
    }

    /// A Linear weight `[out, inp]`: packed when the source holds it packed, else as f32.
    pub(crate) fn proj(&self, s: &Scope, rel: &str, out: usize, inp: usize) -> Result<B::Weight> {
        let init = Init::std((inp as f32).powf(-0.5));
        match self.packed(s, rel, out, inp, init)? {
            Some(p) => self.packed_w(&p),
            None => self.get(s, rel, &[out, inp], init),
        }
    }

    /// Two Linear weights `[n_a, inp]`, `[n_b, inp]` stacked into one `[n_a + n_b, inp]` weight
    /// `fused` (a scope-relative name): packed when both are packed with one scheme, else as f32
    /// (a packed half dequantised).
    fn stacked(
        &self,
        s: &Scope,
        (a, n_a): (&str, usize),
        (b, n_b): (&str, usize),
        inp: usize,
        fused: &str,
    ) -> Result<B::Weight> {
        let init = Init::std((inp as f32).powf(-0.5));
        let pa = self.packed(s, a, n_a, inp, init)?;
        let pb = self.packed(s, b, n_b, inp, init)?;
        if let (Some(x), Some(y)) = (&pa, &pb) {
            if let Some(p) = packed_concat(&s.name(fused), x, y) {
                return self.packed_w(&p);
            }
        }
        let mut data = match pa {
            Some(p) => p.dequantize(),
            None => s.get(a, &[n_a, inp], init)?,
        };
        data.extend(match pb {
            Some(p) => p.dequantize(),
            None => s.get(b, &[n_b, inp], init)?,
        });
        self.w(data, &[n_a + n_b, inp])
    }

    fn mlp(&self, s: &Scope, prefix: &str, inter: usize) -> Result<MlpWeights<B::Weight>> {
        let h = self.cfg.hidden_size;
        Ok(MlpWeights {
            gate_up: self.stacked(
                s,
                (&format!("{prefix}gate_proj.weight"), inter),
                (&format!("{prefix}up_proj.weight"), inter),
                h,
                &format!("{prefix}gate_up_proj"),
            )?,
            down: self.proj(s, &format!("{prefix}down_proj.weight"), h, inter)?,
            inter,
        })
    }

    /// The routed experts, packed when the source holds them packed (fused 3-D tensors or
    /// per-expert ones), else as f32 through [`Scope::experts`].
    fn experts(&self, s: &Scope, e: usize, inter: usize) -> Result<Vec<MlpWeights<B::Weight>>> {
        let h = self.cfg.hidden_size;
        let fused = s.name("mlp.experts.gate_up_proj");
        let per_expert = s.name("mlp.experts.0.gate_proj.weight");
        if s.src.contains(&fused) || !s.src.contains(&per_expert) {
            let gu = s
                .src
                .packed(&fused, &[e, 2 * inter, h], Init::std((h as f32).powf(-0.5)))?;
            let dn = s.src.packed(
                &s.name("mlp.experts.down_proj"),
                &[e, h, inter],
                Init::std((inter as f32).powf(-0.5)),
            )?;
            if let (Some(gu), Some(dn)) = (gu, dn) {
                return (0..e)
                    .map(|x| {
                        let rows =
                            |n: usize| (x * n..(x + 1) * n).map(|r| (0, r)).collect::<Vec<_>>();
                        let g = packed_rows(&format!("{fused}.{x}"), &[&gu], &rows(2 * inter));
                        let d = packed_rows(&format!("{}.{x}", dn.name), &[&dn], &rows(h));
                        Ok(MlpWeights {
                            gate_up: self.packed_w(&g)?,
                            down: self.packed_w(&d)?,
                            inter,
                        })
                    })
                    .collect();
            }
        } else {
            let before = self.packed.borrow().len();
            let experts = (0..e)
                .map(|x| self.mlp(s, &format!("mlp.experts.{x}."), inter))
                .collect::<Result<Vec<_>>>()?;
            self.check_expert_schemes(s, e, before)?;
            return Ok(experts);
        }
        s.experts(e, inter)?
            .into_iter()
            .map(|x| {
                Ok(MlpWeights {
                    gate_up: self.w(x.gate_up, &[2 * inter, h])?,
                    down: self.w(x.down, &[h, inter])?,
                    inter,
                })
            })
            .collect()
    }

    /// Refuses per-expert weights of one layer that mix quantization schemes (or packed and
    /// unpacked) within a projection: a backend runs each projection of a layer's experts as one
    /// grouped call. `before` is the packed record's length before the experts were loaded.
    fn check_expert_schemes(&self, s: &Scope, e: usize, before: usize) -> Result<()> {
        let packed = self.packed.borrow();
        for what in ["gate_up_proj", "down_proj.weight"] {
            let schemes: Vec<_> = packed[before..]
                .iter()
                .filter(|p| p.name.ends_with(what))
                .map(|p| (p.bits, p.group_size))
                .collect();
            let uniform = schemes.windows(2).all(|w| w[0] == w[1]);
            if !(schemes.is_empty() || schemes.len() == e && uniform) {
                return Err(WeightError::Quant {
                    name: s.name("mlp.experts"),
                    message: format!(
                        "the routed experts' {what} mix quantization schemes ({} of {e} packed, \
                         schemes {schemes:?}): every expert of a layer must share one",
                        schemes.len()
                    ),
                });
            }
        }
        Ok(())
    }

    /// Qwen3-Next's grouped `in_proj_qkvz` held packed: its rows rearranged into the canonical
    /// `in_proj_qkv` and `in_proj_z` without dequantising (`in_proj_ba` as f32, or packed likewise).
    fn grouped_in_proj(&self, s: &Scope) -> Result<Option<GdnWeights4<B::Weight>>> {
        let g = &self.cfg.gdn;
        let h = self.cfg.hidden_size;
        let init = Init::std((h as f32).powf(-0.5));
        let n_qkvz = 2 * g.key_dim() + 2 * g.value_dim();
        let n_ba = 2 * g.num_v_heads;
        let Some(qkvz) = self.packed(s, "linear_attn.in_proj_qkvz.weight", n_qkvz, h, init)? else {
            return Ok(None);
        };
        // The row order of every output, from the re-layout applied to row numbers (h = 1).
        let idx = |n: usize| (0..n).map(|r| r as f32).collect::<Vec<_>>();
        let order: GdnInProj = ungroup_qwen3_next(g, 1, &idx(n_qkvz), &idx(n_ba));
        let rows = |o: &[f32]| o.iter().map(|&r| (0, r as usize)).collect::<Vec<_>>();
        let qkv = packed_rows(
            &s.name("linear_attn.in_proj_qkv"),
            &[&qkvz],
            &rows(&order.qkv),
        );
        let z = packed_rows(&s.name("linear_attn.in_proj_z"), &[&qkvz], &rows(&order.z));
        let (b, a) = match self.packed(s, "linear_attn.in_proj_ba.weight", n_ba, h, init)? {
            Some(ba) => (
                self.packed_w(&packed_rows(
                    &s.name("linear_attn.in_proj_b"),
                    &[&ba],
                    &rows(&order.b),
                ))?,
                self.packed_w(&packed_rows(
                    &s.name("linear_attn.in_proj_a"),
                    &[&ba],
                    &rows(&order.a),
                ))?,
            ),
            None => {
                let ba = s.get("linear_attn.in_proj_ba.weight", &[n_ba, h], init)?;
                let pick = |o: &[f32]| {
                    o.iter()
                        .flat_map(|&r| ba[r as usize * h..(r as usize + 1) * h].iter().copied())
                        .collect::<Vec<_>>()
                };
                (
                    self.w(pick(&order.b), &[g.num_v_heads, h])?,
                    self.w(pick(&order.a), &[g.num_v_heads, h])?,
                )
            }
        };
        Ok(Some((self.packed_w(&qkv)?, self.packed_w(&z)?, b, a)))
    }

    fn attention(&self, s: &Scope) -> Result<AttnWeights<B::Weight>> {
        let a = &self.cfg.attention;
        let h = self.cfg.hidden_size;
        Ok(AttnWeights {
            q_proj: self.proj(
                s,
                "self_attn.q_proj.weight",
                a.num_heads * a.head_dim * 2,
                h,
            )?,
            k_proj: self.proj(s, "self_attn.k_proj.weight", a.num_kv_heads * a.head_dim, h)?,
            v_proj: self.proj(s, "self_attn.v_proj.weight", a.num_kv_heads * a.head_dim, h)?,
            o_proj: self.proj(s, "self_attn.o_proj.weight", h, a.num_heads * a.head_dim)?,
            q_norm: self.get(s, "self_attn.q_norm.weight", &[a.head_dim], NORM)?,
            k_norm: self.get(s, "self_attn.k_norm.weight", &[a.head_dim], NORM)?,
        })
    }

    fn gdn(&self, s: &Scope) -> Result<GdnWeights<B::Weight>> {
        let g = &self.cfg.gdn;
        let h = self.cfg.hidden_size;
        let (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) =
            if self.cfg.arch.grouped_gdn_projections() {
                match self.grouped_in_proj(s)? {
                    Some(w) => w,
                    None => {
                        let p = s.gdn_in_proj()?;
                        (
                            self.w(p.qkv, &[g.conv_dim(), h])?,
                            self.w(p.z, &[g.value_dim(), h])?,
                            self.w(p.b, &[g.num_v_heads, h])?,
                            self.w(p.a, &[g.num_v_heads, h])?,
                        )
                    }
                }
            } else {
                (
                    self.proj(s, "linear_attn.in_proj_qkv.weight", g.conv_dim(), h)?,
                    self.proj(s, "linear_attn.in_proj_z.weight", g.value_dim(), h)?,
                    self.proj(s, "linear_attn.in_proj_b.weight", g.num_v_heads, h)?,
                    self.proj(s, "linear_attn.in_proj_a.weight", g.num_v_heads, h)?,
                )
            };
        // A ~ U(1, 16) as transformers initialises it, so log A is positive; dt_bias near 1.
        let a_log = Init::Random {
            mean: 1.7,
            std: 0.6,
        };
        Ok(GdnWeights {
            in_proj_qkv,
            in_proj_z,
            in_proj_b,
            in_proj_a,
            conv: self.w(
                s.get(
                    "linear_attn.conv1d.weight",
                    &[g.conv_dim(), 1, g.conv_kernel],
                    Init::std((g.conv_kernel as f32).powf(-0.5)),
                )?,
                &[g.conv_dim(), g.conv_kernel],
            )?,
            a_log: self.get(s, "linear_attn.A_log", &[g.num_v_heads], a_log)?,
            dt_bias: self.get(s, "linear_attn.dt_bias", &[g.num_v_heads], Init::ONES)?,
            norm: self.get(s, "linear_attn.norm.weight", &[g.v_head_dim], Init::ONES)?,
            out_proj: self.proj(s, "linear_attn.out_proj.weight", h, g.value_dim())?,
        })
    }

    fn ffn(&self, s: &Scope, kind: FfnType) -> Result<Ffn<B::Weight>> {
        let h = self.cfg.hidden_size;
        match (kind, &self.cfg.moe) {
            (FfnType::Moe, Some(m)) => {
                let experts = self.experts(s, m.num_experts, m.intermediate_size)?;
                let (shared, shared_gate) = if m.shared_intermediate_size > 0 {
                    (
                        Some(self.mlp(s, "mlp.shared_expert.", m.shared_intermediate_size)?),
                        Some(self.proj(s, "mlp.shared_expert_gate.weight", 1, h)?),
                    )
                } else {
                    (None, None)
                };
                Ok(Ffn::Moe(MoeWeights {
                    router: self.proj(s, "mlp.gate.weight", m.num_experts, h)?,
                    experts,
                    top_k: m.top_k,
                    renormalize: m.norm_topk_prob,
                    shared,
                    shared_gate,
                }))
            }
            _ => Ok(Ffn::Dense(self.mlp(
                s,
                "mlp.",
                self.cfg.intermediate_size,
            )?)),
        }
    }

    /// One decoder layer; `main` is false for the MTP layer (plain residual, no PLE).
    fn layer(
        &self,
        s: &Scope,
        index: usize,
        mixer: LayerType,
        ffn: FfnType,
        main: bool,
    ) -> Result<Layer<B::Weight>> {
        let h = self.cfg.hidden_size;
        let ple_here = main
            && self
                .cfg
                .ple
                .as_ref()
                .is_some_and(|p| p.layer_ids.contains(&index));
        Ok(Layer {
            input_norm: self.get(s, "input_layernorm.weight", &[h], NORM)?,
            post_attention_norm: self.get(s, "post_attention_layernorm.weight", &[h], NORM)?,
            mixer: match (mixer, &self.cfg.qsa) {
                (LayerType::FullAttention, None) => Mixer::Attention(self.attention(s)?),
                (LayerType::FullAttention, Some(q)) => {
                    Mixer::Qsa(self.attention(s)?, self.indexer(s, q)?)
                }
                (LayerType::LinearAttention, _) => Mixer::Gdn(self.gdn(s)?),
            },
            ffn: self.ffn(s, ffn)?,
            ple: if ple_here { Some(self.ple(s)?) } else { None },
            hc: match (&self.cfg.hyper_connections, main) {
                (Some(hc), true) => Some((
                    self.hc(s, "hc_attn.", hc.num_streams, hc.rank)?,
                    self.hc(s, "hc_ffn.", hc.num_streams, hc.rank)?,
                )),
                _ => None,
            },
        })
    }
}

impl<B: Backend> Model<B> {
    /// Loads every tensor of `cfg` from `src` onto `backend`. A config with a `ple` block needs
    /// [`Model::load_with_ple`].
    pub fn load(cfg: ModelConfig, src: &dyn TensorSource, backend: B) -> Result<Self> {
        Self::load_with_ple(cfg, src, backend, None)
    }

    /// Loads the model with the source of its PLE rows (required iff the config has `ple`; see
    /// [`PleSource::open`] for the table checks).
    pub fn load_with_ple(
        cfg: ModelConfig,
        src: &dyn TensorSource,
        backend: B,
        ple_source: Option<PleSource>,
    ) -> Result<Self> {
        let all = 0..cfg.num_layers;
        Self::load_stage(cfg, src, backend, ple_source, all)
    }

    /// Loads one pipeline stage: decoder layers `stage` (a non-empty range of `0..num_layers`), plus
    /// the embedding on the first stage and the final norm, lm_head, MTP head and hyper-connection
    /// head on the last (the embedding there too when the lm_head is tied or an MTP head embeds).
    /// Stages hand their residual streams to the next through [`Model::step`]; the whole range
    /// is the whole model.
    pub fn load_stage(
        cfg: ModelConfig,
        src: &dyn TensorSource,
        backend: B,
        ple_source: Option<PleSource>,
        stage: Range<usize>,
    ) -> Result<Self> {
        if stage.start >= stage.end || stage.end > cfg.num_layers {
            return Err(WeightError::File {
                path: "config.json".into(),
                message: format!(
                    "a stage of layers {}..{} of a {}-layer model: expected a non-empty range \
                     inside 0..{}",
                    stage.start, stage.end, cfg.num_layers, cfg.num_layers
                ),
            });
        }
        let (first, last) = (stage.start == 0, stage.end == cfg.num_layers);
        if cfg.ple.is_some() && ple_source.is_none() {
            return Err(WeightError::File {
                path: "config.json".into(),
                message: "the model config has a `ple` block: load it with a PLE table \
                          (--ple-table DIR)"
                    .into(),
            });
        }
        let l = Loader {
            backend: &backend,
            cfg: &cfg,
            packed: RefCell::new(Vec::new()),
        };
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let top = Scope {
            src,
            cfg: &cfg,
            prefix: String::new(),
        };
        // A quantized embedding table goes to the backend packed too (its lookup decodes rows).
        let embed_name = text_name(&cfg, "embed_tokens.weight");
        let embed = if first || (last && cfg.tie_word_embeddings) {
            Some(match src.packed(&embed_name, &[v, h], Init::std(1.0))? {
                Some(p) => l.packed_w(&p)?,
                None => l.get(&top, &embed_name, &[v, h], Init::std(1.0))?,
            })
        } else {
            None
        };
        // The MTP head's embedding where no device copy is at hand: the table's values as the
        // backend's embedding would give them (a packed table dequantized).
        let mtp_embed = if last && cfg.mtp_layers > 0 && embed.is_none() {
            Some(match src.packed(&embed_name, &[v, h], Init::std(1.0))? {
                Some(p) => p.dequantize(),
                None => src.tensor(&embed_name, &[v, h], Init::std(1.0))?.into_f32(),
            })
        } else {
            None
        };
        let lm_head = if cfg.tie_word_embeddings || !last {
            None
        } else {
            Some(l.proj(&top, "lm_head.weight", v, h)?)
        };
        let norm = if last {
            Some(l.get(&top, &text_name(&cfg, "norm.weight"), &[h], NORM)?)
        } else {
            None
        };
        let progress = Progress::new(stage.len());
        let layers = stage
            .clone()
            .enumerate()
            .map(|(k, i)| {
                let layer = l.layer(
                    &Scope::layer(src, &cfg, i),
                    i,
                    cfg.layer_types[i],
                    cfg.ffn_types[i],
                    true,
                );
                progress.layer_done(k + 1);
                layer
            })
            .collect::<Result<Vec<_>>>()?;
        let mtp = if cfg.mtp_layers > 0 && last {
            let s = Scope::mtp(src, &cfg);
            let ffn = if cfg.moe.is_some() {
                FfnType::Moe
            } else {
                FfnType::Dense
            };
            Some(MtpWeights {
                fc: l.proj(&s, "fc.weight", h, 2 * h)?,
                pre_fc_norm_embedding: l.get(&s, "pre_fc_norm_embedding.weight", &[h], NORM)?,
                pre_fc_norm_hidden: l.get(&s, "pre_fc_norm_hidden.weight", &[h], NORM)?,
                layer: l.layer(
                    &s.child("layers.0."),
                    cfg.num_layers,
                    LayerType::FullAttention,
                    ffn,
                    false,
                )?,
                norm: l.get(&s, "norm.weight", &[h], NORM)?,
            })
        } else {
            None
        };
        let a = &cfg.attention;
        let g = &cfg.gdn;
        let attn_shape = AttnShape {
            num_heads: a.num_heads,
            num_kv_heads: a.num_kv_heads,
            head_dim: a.head_dim,
            eps: cfg.rms_norm_eps,
        };
        let gdn_shape = GdnShape {
            num_k_heads: g.num_k_heads,
            num_v_heads: g.num_v_heads,
            k_head_dim: g.k_head_dim,
            v_head_dim: g.v_head_dim,
            conv_kernel: g.conv_kernel,
        };
        let rope = Rope {
            rot_dim: cfg.rope.rot_dim,
            inv_freq: cfg.rope.inv_freq(),
            mscale: cfg.rope.attention_factor(),
        };
        let qsa = cfg.qsa.as_ref().map(|q| QsaShape {
            n_heads: q.index_n_heads,
            head_dim: q.index_head_dim,
            topk: q.index_topk,
            rope: Rope {
                rot_dim: q.index_rope_dim,
                inv_freq: (0..q.index_rope_dim / 2)
                    .map(|j| {
                        cfg.rope
                            .theta
                            .powf(-2.0 * j as f64 / q.index_rope_dim as f64)
                            as f32
                    })
                    .collect(),
                mscale: 1.0,
            },
        });
        let ple = match (&cfg.ple, ple_source) {
            (Some(p), Some(source)) => Some((
                PleShape {
                    streams: cfg.hyper_connections.as_ref().map_or(1, |h| h.num_streams),
                    hidden: h,
                    row_width: p.num_tables() * p.row_dim,
                    conv_kernel: p.conv_kernel,
                    conv_dilation: p.conv_dilation,
                },
                source,
            )),
            _ => None,
        };
        let hc_head = match &cfg.hyper_connections {
            Some(hc) if last => Some(l.get(
                &top,
                &text_name(&cfg, "hc_head.pre"),
                &[hc.num_streams],
                Init::ZEROS,
            )?),
            _ => None,
        };
        let packed = l.packed.take();
        Ok(Model {
            cfg,
            backend,
            stage,
            embed,
            mtp_embed,
            lm_head,
            norm,
            layers,
            mtp,
            attn_shape,
            gdn_shape,
            rope,
            qsa,
            ple,
            hc_head,
            packed,
            kv_host: None,
        })
    }
}

/// Reports a long load's progress: a log line at each tenth of the layers, once the load has taken
/// more than [`Progress::QUIET`] (a small model loads without a word).
struct Progress {
    layers: usize,
    started: std::time::Instant,
}

impl Progress {
    const QUIET: std::time::Duration = std::time::Duration::from_secs(2);

    fn new(layers: usize) -> Self {
        Progress {
            layers,
            started: std::time::Instant::now(),
        }
    }

    /// `done` of the layers are loaded.
    fn layer_done(&self, done: usize) {
        let tenth = |d: usize| d * 10 / self.layers.max(1);
        let elapsed = self.started.elapsed();
        if tenth(done) > tenth(done - 1) && elapsed > Self::QUIET {
            tracing::info!(
                "loading the weights: {done} of {} layers ({}%), {:.1} s",
                self.layers,
                done * 100 / self.layers,
                elapsed.as_secs_f64()
            );
        }
    }
}
