//! What one decode step must read from memory, counted from the loaded tensors: the roofline of
//! `sanmai bench`. Weights are counted at the bytes the backend stores them in; routed experts only
//! for the experts a step actually routed to (the counts come from [`Probe::take_routing`](crate::backend::Probe::take_routing)); the
//! embedding table only for the rows looked up; plus the per-sequence state the step reads (GDN
//! recurrent and conv state, attention K/V up to the context length).

use crate::backend::{AttnWeights, Backend, GdnWeights, HcWeights, IndexerWeights, MlpWeights};
use crate::backend::{MoeWeights, PleWeights};
use crate::load::{Ffn, Layer, Mixer, Model};

/// Bytes one decode step reads, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepBytes {
    /// Every weight but the routed experts and the embedding table.
    pub dense_weights: u64,
    /// The routed experts the step used.
    pub routed_experts: u64,
    /// Embedding rows of the step's tokens.
    pub embedding_rows: u64,
    /// GDN recurrent + conv state and attention K/V of every sequence.
    pub state: u64,
}

impl StepBytes {
    pub fn total(&self) -> u64 {
        self.dense_weights + self.routed_experts + self.embedding_rows + self.state
    }
}

impl<B: Backend> Model<B> {
    /// The bytes of a decode step of `batch` sequences at context length `context` (each), whose MoE
    /// layers routed to `routed[i]` distinct experts in the i-th MoE call (the main model's layers in
    /// order; the MTP layer is not part of a step). With fewer counts than MoE layers, the missing
    /// layers count `min(experts, batch·top_k)`.
    pub fn decode_step_bytes(&self, batch: usize, context: usize, routed: &[usize]) -> StepBytes {
        let b = &self.backend;
        let wb = |w: &B::Weight| b.weight_bytes(w) as u64;
        let mut out = StepBytes {
            dense_weights: self.norm.as_ref().map_or(0, wb)
                + match (&self.lm_head, self.is_last_stage()) {
                    (Some(w), _) => wb(w),
                    (None, true) => wb(self.embedding()),
                    (None, false) => 0,
                }
                + self.hc_head.as_ref().map_or(0, wb),
            embedding_rows: match (&self.embed, self.is_first_stage()) {
                (Some(e), true) => (wb(e) / self.cfg.vocab_size.max(1) as u64) * batch as u64,
                _ => 0,
            },
            ..StepBytes::default()
        };
        let mut moe_calls = routed.iter();
        for layer in &self.layers {
            out.dense_weights += layer_dense_bytes(layer, &wb);
            if let Ffn::Moe(m) = &layer.ffn {
                let bound = m.experts.len().min(batch * m.top_k);
                let n = moe_calls.next().copied().unwrap_or(bound);
                let per = m
                    .experts
                    .first()
                    .map_or(0, |e| wb(&e.gate_up) + wb(&e.down));
                out.routed_experts += per * n as u64;
            }
        }
        // GDN and PLE conv state at 4 bytes a value (the recurrent state, f32 on every backend,
        // dominates); attention K/V at the cache's bytes, QSA layers reading every index key but
        // only their top-k K/V rows.
        let a = &self.cfg.attention;
        let kv_row = (2 * a.num_kv_heads * a.head_dim * B::CACHE_ELEM_BYTES) as u64;
        let attn = self.attention_layers().len() as u64 - u64::from(self.mtp.is_some());
        let per_layer = match &self.qsa {
            Some(q) => {
                let index = self.cfg.qsa.as_ref().map_or(0, |c| c.index_entry_bytes()) as u64;
                kv_row * context.min(q.topk) as u64 + index * context as u64
            }
            None => kv_row * context as u64,
        };
        out.state = batch as u64 * (self.state_bytes(4) as u64 + attn * per_layer);
        out
    }
}

impl<B: Backend> Model<B> {
    /// Bytes every weight this model holds occupies in its backend (what
    /// [`crate::weight_plan::stage_weight_bytes`] predicts before loading).
    pub fn resident_weight_bytes(&self) -> u64 {
        let b = &self.backend;
        let wb = |w: &B::Weight| b.weight_bytes(w) as u64;
        let layer = |l: &Layer<B::Weight>| {
            layer_dense_bytes(l, &wb)
                + match &l.ffn {
                    Ffn::Moe(m) => m.experts.iter().map(|e| mlp_bytes(e, &wb)).sum(),
                    Ffn::Dense(_) => 0,
                }
        };
        let opt = |w: &Option<B::Weight>| w.as_ref().map_or(0, wb);
        opt(&self.embed)
            + opt(&self.lm_head)
            + opt(&self.norm)
            + opt(&self.hc_head)
            + self.layers.iter().map(layer).sum::<u64>()
            + self.mtp.as_ref().map_or(0, |m| {
                wb(&m.fc)
                    + wb(&m.pre_fc_norm_embedding)
                    + wb(&m.pre_fc_norm_hidden)
                    + layer(&m.layer)
                    + wb(&m.norm)
            })
    }
}

fn layer_dense_bytes<W>(layer: &Layer<W>, wb: &impl Fn(&W) -> u64) -> u64 {
    let mut n = wb(&layer.input_norm) + wb(&layer.post_attention_norm);
    n += match &layer.mixer {
        Mixer::Attention(a) => attn_bytes(a, wb),
        Mixer::Qsa(a, i) => attn_bytes(a, wb) + indexer_bytes(i, wb),
        Mixer::Gdn(g) => gdn_bytes(g, wb),
    };
    n += match &layer.ffn {
        Ffn::Dense(m) => mlp_bytes(m, wb),
        Ffn::Moe(m) => moe_dense_bytes(m, wb),
    };
    if let Some(p) = &layer.ple {
        n += ple_bytes(p, wb);
    }
    if let Some((a, f)) = &layer.hc {
        n += hc_bytes(a, wb) + hc_bytes(f, wb);
    }
    n
}

fn attn_bytes<W>(a: &AttnWeights<W>, wb: &impl Fn(&W) -> u64) -> u64 {
    [
        &a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj, &a.q_norm, &a.k_norm,
    ]
    .into_iter()
    .map(wb)
    .sum()
}

fn indexer_bytes<W>(i: &IndexerWeights<W>, wb: &impl Fn(&W) -> u64) -> u64 {
    [&i.wq, &i.wk, &i.k_norm, &i.k_norm_bias, &i.weights_proj]
        .into_iter()
        .map(wb)
        .sum()
}

fn gdn_bytes<W>(g: &GdnWeights<W>, wb: &impl Fn(&W) -> u64) -> u64 {
    [
        &g.in_proj_qkv,
        &g.in_proj_z,
        &g.in_proj_b,
        &g.in_proj_a,
        &g.conv,
        &g.a_log,
        &g.dt_bias,
        &g.norm,
        &g.out_proj,
    ]
    .into_iter()
    .map(wb)
    .sum()
}

fn mlp_bytes<W>(m: &MlpWeights<W>, wb: &impl Fn(&W) -> u64) -> u64 {
    wb(&m.gate_up) + wb(&m.down)
}

fn moe_dense_bytes<W>(m: &MoeWeights<W>, wb: &impl Fn(&W) -> u64) -> u64 {
    wb(&m.router)
        + m.shared.as_ref().map_or(0, |s| mlp_bytes(s, wb))
        + m.shared_gate.as_ref().map_or(0, wb)
}

fn ple_bytes<W>(p: &PleWeights<W>, wb: &impl Fn(&W) -> u64) -> u64 {
    let lists = [
        &p.key,
        &p.key_bias,
        &p.key_norm,
        &p.query_norm,
        &p.conv_norm,
    ];
    wb(&p.value)
        + wb(&p.value_bias)
        + wb(&p.conv)
        + lists.iter().flat_map(|l| l.iter()).map(wb).sum::<u64>()
}

fn hc_bytes<W>(h: &HcWeights<W>, wb: &impl Fn(&W) -> u64) -> u64 {
    wb(&h.pre) + wb(&h.down) + wb(&h.inject) + wb(&h.up)
}
