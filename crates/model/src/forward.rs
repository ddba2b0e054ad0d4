//! One step of the forward pass over a batch of sequence chunks, and the MTP draft head.

use crate::backend::{Backend, MlpWeights, SeqChunk};
use crate::load::{Ffn, Layer, Mixer, Model};

/// What a step returns: the final-normed hidden states of the requested rows (what the lm_head and the
/// MTP head consume).
pub struct StepOutput<T> {
    pub hidden: T,
}

impl<B: Backend> Model<B> {
    /// Runs `ids` (the tokens of every chunk, in `seqs` order) through the model, appending to the slots'
    /// caches, and returns the final-normed hidden states of `out_rows`.
    pub fn forward(
        &self,
        ids: &[u32],
        seqs: &[SeqChunk<'_>],
        out_rows: &[usize],
    ) -> StepOutput<B::Tensor> {
        let b = &self.backend;
        let mut x = b.embed(&self.embed, ids);
        for (i, layer) in self.layers.iter().enumerate() {
            self.layer_forward(i, layer, &mut x, seqs);
        }
        let x = b.rows(&x, out_rows);
        StepOutput {
            hidden: b.rms_norm(&x, &self.norm, self.cfg.rms_norm_eps, 1.0),
        }
    }

    /// Logits `[rows, vocab]` of final-normed hidden states.
    pub fn logits(&self, hidden: &B::Tensor) -> B::Tensor {
        self.backend
            .linear(hidden, self.lm_head.as_ref().unwrap_or(&self.embed))
    }

    /// The MTP draft head: for each row, the token that follows (`next_ids`) and the main model's
    /// final-normed hidden state at the row's position (`h_prev`). Its attention uses cache layer index
    /// `num_layers`.
    /// Returns the hidden states after `mtp.norm`; [`Model::logits`] turns them into draft logits.
    pub fn mtp_forward(
        &self,
        next_ids: &[u32],
        h_prev: &B::Tensor,
        seqs: &[SeqChunk<'_>],
    ) -> Option<B::Tensor> {
        let mtp = self.mtp.as_ref()?;
        let b = &self.backend;
        let eps = self.cfg.rms_norm_eps;
        let e = b.rms_norm(
            &b.embed(&self.embed, next_ids),
            &mtp.pre_fc_norm_embedding,
            eps,
            1.0,
        );
        let h = b.rms_norm(h_prev, &mtp.pre_fc_norm_hidden, eps, 1.0);
        let mut x = b.linear(&b.concat_cols(&e, &h), &mtp.fc);
        self.layer_forward(self.cfg.num_layers, &mtp.layer, &mut x, seqs);
        Some(b.rms_norm(&x, &mtp.norm, eps, 1.0))
    }

    fn layer_forward(
        &self,
        index: usize,
        layer: &Layer<B::Weight>,
        x: &mut B::Tensor,
        seqs: &[SeqChunk<'_>],
    ) {
        let b = &self.backend;
        let eps = self.cfg.rms_norm_eps;
        let hn = b.rms_norm(x, &layer.input_norm, eps, 1.0);
        let mixed = match &layer.mixer {
            Mixer::Attention(w) => {
                let q = b.linear(&hn, &w.q_proj);
                let k = b.linear(&hn, &w.k_proj);
                let v = b.linear(&hn, &w.v_proj);
                let o = b.attention(index, &self.attn_shape, &self.rope, &q, &k, &v, w, seqs);
                b.linear(&o, &w.o_proj)
            }
            Mixer::Gdn(w) => {
                let qkv = b.linear(&hn, &w.in_proj_qkv);
                let z = b.linear(&hn, &w.in_proj_z);
                let bb = b.linear(&hn, &w.in_proj_b);
                let a = b.linear(&hn, &w.in_proj_a);
                let o = b.gdn(index, &self.gdn_shape, &qkv, &z, &bb, &a, w, eps, seqs);
                b.linear(&o, &w.out_proj)
            }
        };
        b.add(x, &mixed);
        let hn = b.rms_norm(x, &layer.post_attention_norm, eps, 1.0);
        let out = match &layer.ffn {
            Ffn::Dense(m) => self.mlp(m, &hn),
            Ffn::Moe(m) => {
                let mut routed = b.moe_experts(&hn, m);
                if let (Some(shared), Some(gate)) = (&m.shared, &m.shared_gate) {
                    let y = self.mlp(shared, &hn);
                    let g = b.linear(&hn, gate);
                    b.add_sigmoid_gated(&mut routed, &y, &g);
                }
                routed
            }
        };
        b.add(x, &out);
    }

    fn mlp(&self, m: &MlpWeights<B::Weight>, x: &B::Tensor) -> B::Tensor {
        let b = &self.backend;
        b.linear(&b.swiglu(&b.linear(x, &m.gate_up)), &m.down)
    }
}
