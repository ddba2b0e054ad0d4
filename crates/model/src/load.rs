//! Building a [`Model`]: asks the weight source for every tensor (through the architecture's name map),
//! converts it into the backend's storage and assembles the layers.

use sanmai_config::{FfnType, LayerType, ModelConfig};
use sanmai_weights::names::{text_name, Scope};
use sanmai_weights::{Init, Result, TensorSource, WeightError};

use crate::backend::{
    AttnShape, AttnWeights, Backend, CacheSpec, GdnShape, GdnWeights, HcWeights, IndexerWeights,
    MlpWeights, MoeWeights, PleShape, PleWeights, QsaShape, Rope,
};
use crate::ple::PleSource;

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
    pub embed: B::Weight,
    /// `None` when tied to the embedding.
    pub lm_head: Option<B::Weight>,
    pub norm: B::Weight,
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
}

/// Zero-centred RMSNorm weights are stored as offsets from 1.
const NORM: Init = Init::ZEROS;

pub(crate) struct Loader<'a, B: Backend> {
    pub(crate) backend: &'a B,
    pub(crate) cfg: &'a ModelConfig,
}

impl<B: Backend> Loader<'_, B> {
    pub(crate) fn w(&self, data: Vec<f32>, shape: &[usize]) -> B::Weight {
        self.backend.weight(data, shape)
    }

    pub(crate) fn get(
        &self,
        s: &Scope,
        rel: &str,
        shape: &[usize],
        init: Init,
    ) -> Result<B::Weight> {
        Ok(self.w(s.get(rel, shape, init)?, shape))
    }

    pub(crate) fn proj(&self, s: &Scope, rel: &str, out: usize, inp: usize) -> Result<B::Weight> {
        self.get(s, rel, &[out, inp], Init::std((inp as f32).powf(-0.5)))
    }

    fn mlp(&self, s: &Scope, prefix: &str, inter: usize) -> Result<MlpWeights<B::Weight>> {
        let h = self.cfg.hidden_size;
        let init = Init::std((h as f32).powf(-0.5));
        let mut gate_up = s.get(&format!("{prefix}gate_proj.weight"), &[inter, h], init)?;
        gate_up.extend(s.get(&format!("{prefix}up_proj.weight"), &[inter, h], init)?);
        Ok(MlpWeights {
            gate_up: self.w(gate_up, &[2 * inter, h]),
            down: self.proj(s, &format!("{prefix}down_proj.weight"), h, inter)?,
            inter,
        })
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
        let p = s.gdn_in_proj()?;
        // A ~ U(1, 16) as transformers initialises it, so log A is positive; dt_bias near 1.
        let a_log = Init::Random {
            mean: 1.7,
            std: 0.6,
        };
        Ok(GdnWeights {
            in_proj_qkv: self.w(p.qkv, &[g.conv_dim(), h]),
            in_proj_z: self.w(p.z, &[g.value_dim(), h]),
            in_proj_b: self.w(p.b, &[g.num_v_heads, h]),
            in_proj_a: self.w(p.a, &[g.num_v_heads, h]),
            conv: self.w(
                s.get(
                    "linear_attn.conv1d.weight",
                    &[g.conv_dim(), 1, g.conv_kernel],
                    Init::std((g.conv_kernel as f32).powf(-0.5)),
                )?,
                &[g.conv_dim(), g.conv_kernel],
            ),
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
                let experts = s
                    .experts(m.num_experts, m.intermediate_size)?
                    .into_iter()
                    .map(|e| MlpWeights {
                        gate_up: self.w(e.gate_up, &[2 * m.intermediate_size, h]),
                        down: self.w(e.down, &[h, m.intermediate_size]),
                        inter: m.intermediate_size,
                    })
                    .collect();
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
    /// Layer indices with attention K/V caches (the MTP layer is `num_layers`).
    pub fn attention_layers(&self) -> Vec<usize> {
        let mut v: Vec<usize> = (0..self.cfg.num_layers)
            .filter(|&i| self.cfg.layer_types[i] == LayerType::FullAttention)
            .collect();
        if self.mtp.is_some() {
            v.push(self.cfg.num_layers);
        }
        v
    }

    pub fn gdn_layers(&self) -> Vec<usize> {
        (0..self.cfg.num_layers)
            .filter(|&i| self.cfg.layer_types[i] == LayerType::LinearAttention)
            .collect()
    }

    /// Bytes of K/V one token takes across all attention layers, at `elem` bytes per value, plus the
    /// QSA index-key entry (`dI + 2` bytes) of each attention layer.
    pub fn kv_bytes_per_token(&self, elem: usize) -> usize {
        let a = &self.cfg.attention;
        let index = self.cfg.qsa.as_ref().map_or(0, |q| q.index_entry_bytes());
        self.attention_layers().len() * (2 * a.num_kv_heads * a.head_dim * elem + index)
    }

    /// Bytes of one sequence's state: GDN conv + recurrent state across all GDN layers and the PLE
    /// conv state of each PLE layer, at `elem` bytes per value.
    pub fn state_bytes(&self, elem: usize) -> usize {
        let g = &self.cfg.gdn;
        let per_layer =
            (g.conv_kernel - 1) * g.conv_dim() + g.num_v_heads * g.k_head_dim * g.v_head_dim;
        let ple = self.ple.as_ref().map_or(0, |(sh, _)| {
            self.ple_layers().len() * sh.state_rows() * sh.channels()
        });
        (self.gdn_layers().len() * per_layer + ple) * elem
    }

    /// Layers with a PLE mix (and a PLE conv state per state slot).
    pub fn ple_layers(&self) -> Vec<usize> {
        (0..self.cfg.num_layers)
            .filter(|&i| self.layers[i].ple.is_some())
            .collect()
    }

    /// Allocates the backend's caches for `num_blocks` blocks of `block_size` positions.
    pub fn init_cache(&self, num_blocks: usize, block_size: usize) {
        self.backend.init_cache(&CacheSpec {
            num_blocks,
            block_size,
            attn_layers: self.attention_layers(),
            num_kv_heads: self.cfg.attention.num_kv_heads,
            head_dim: self.cfg.attention.head_dim,
            index_head_dim: self.qsa.as_ref().map_or(0, |q| q.head_dim),
            gdn_layers: self.gdn_layers(),
            gdn: self.gdn_shape,
            ple_layers: self.ple_layers(),
            ple: self.ple.as_ref().map(|(sh, _)| *sh),
        });
    }

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
        };
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let top = Scope {
            src,
            cfg: &cfg,
            prefix: String::new(),
        };
        let embed = l.get(
            &top,
            &text_name(&cfg, "embed_tokens.weight"),
            &[v, h],
            Init::std(1.0),
        )?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(l.proj(&top, "lm_head.weight", v, h)?)
        };
        let norm = l.get(&top, &text_name(&cfg, "norm.weight"), &[h], NORM)?;
        let layers = (0..cfg.num_layers)
            .map(|i| {
                l.layer(
                    &Scope::layer(src, &cfg, i),
                    i,
                    cfg.layer_types[i],
                    cfg.ffn_types[i],
                    true,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let mtp = if cfg.mtp_layers > 0 {
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
            Some(hc) => Some(l.get(
                &top,
                &text_name(&cfg, "hc_head.pre"),
                &[hc.num_streams],
                Init::ZEROS,
            )?),
            None => None,
        };
        Ok(Model {
            cfg,
            backend,
            embed,
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
        })
    }
}
