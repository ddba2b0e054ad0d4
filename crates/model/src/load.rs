//! Building a [`Model`]: asks the weight source for every tensor (through the architecture's name map),
//! converts it into the backend's storage and assembles the layers.

use sanmai_config::{FfnType, LayerType, ModelConfig};
use sanmai_weights::names::{text_name, Scope};
use sanmai_weights::{Init, Result, TensorSource};

use crate::backend::{
    AttnShape, AttnWeights, Backend, CacheSpec, GdnShape, GdnWeights, MlpWeights, MoeWeights, Rope,
};

pub enum Mixer<W> {
    Attention(AttnWeights<W>),
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
}

/// Zero-centred RMSNorm weights are stored as offsets from 1.
const NORM: Init = Init::ZEROS;

struct Loader<'a, B: Backend> {
    backend: &'a B,
    cfg: &'a ModelConfig,
}

impl<B: Backend> Loader<'_, B> {
    fn w(&self, data: Vec<f32>, shape: &[usize]) -> B::Weight {
        self.backend.weight(data, shape)
    }

    fn get(&self, s: &Scope, rel: &str, shape: &[usize], init: Init) -> Result<B::Weight> {
        Ok(self.w(s.get(rel, shape, init)?, shape))
    }

    fn proj(&self, s: &Scope, rel: &str, out: usize, inp: usize) -> Result<B::Weight> {
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

    fn layer(&self, s: &Scope, mixer: LayerType, ffn: FfnType) -> Result<Layer<B::Weight>> {
        let h = self.cfg.hidden_size;
        Ok(Layer {
            input_norm: self.get(s, "input_layernorm.weight", &[h], NORM)?,
            post_attention_norm: self.get(s, "post_attention_layernorm.weight", &[h], NORM)?,
            mixer: match mixer {
                LayerType::FullAttention => Mixer::Attention(self.attention(s)?),
                LayerType::LinearAttention => Mixer::Gdn(self.gdn(s)?),
            },
            ffn: self.ffn(s, ffn)?,
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

    /// Bytes of K/V one token takes across all attention layers, at `elem` bytes per value.
    pub fn kv_bytes_per_token(&self, elem: usize) -> usize {
        let a = &self.cfg.attention;
        self.attention_layers().len() * 2 * a.num_kv_heads * a.head_dim * elem
    }

    /// Bytes of one sequence's GDN state across all GDN layers (conv + recurrent), at `elem` bytes per value.
    pub fn state_bytes(&self, elem: usize) -> usize {
        let g = &self.cfg.gdn;
        let per_layer =
            (g.conv_kernel - 1) * g.conv_dim() + g.num_v_heads * g.k_head_dim * g.v_head_dim;
        self.gdn_layers().len() * per_layer * elem
    }

    /// Allocates the backend's caches for `num_blocks` blocks of `block_size` positions.
    pub fn init_cache(&self, num_blocks: usize, block_size: usize) {
        self.backend.init_cache(&CacheSpec {
            num_blocks,
            block_size,
            attn_layers: self.attention_layers(),
            num_kv_heads: self.cfg.attention.num_kv_heads,
            head_dim: self.cfg.attention.head_dim,
            gdn_layers: self.gdn_layers(),
            gdn: self.gdn_shape,
        });
    }

    /// Loads every tensor of `cfg` from `src` onto `backend`.
    pub fn load(cfg: ModelConfig, src: &dyn TensorSource, backend: B) -> Result<Self> {
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
                    cfg.layer_types[i],
                    cfg.ffn_types[i],
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
                layer: l.layer(&s.child("layers.0."), LayerType::FullAttention, ffn)?,
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
        })
    }
}
