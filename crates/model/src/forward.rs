//! One step of the forward pass over a batch of sequence chunks, and the MTP draft head.
//!
//! The residual is a `[rows, S·H]` tensor of S streams (S = 1 without hyper-connections, where it is
//! the plain `[rows, H]` residual). Per decoder layer: the PLE mix on the streams (PLE layers only),
//! then for the mixer and the FFN sublayer: `x` = the streams (S = 1) or their pre-mix, `y = F(N(x))`,
//! then `R += y` (S = 1) or the gated residual of spec §4.

use sanmai_ple::PleError;

use crate::backend::{Backend, DecodeStep, HcWeights, MlpWeights, SeqChunk};
use crate::load::{Ffn, Layer, Mixer, Model};

/// [`DecodeStep::region`] of [`Model::forward`]'s decode steps (outputs: the hidden states).
const REGION_HIDDEN: u32 = 0;
/// [`DecodeStep::region`] of [`Model::forward_logits`]'s decode steps (outputs: hidden states, logits).
const REGION_LOGITS: u32 = 1;

/// What a pipeline stage starts from ([`Model::forward_stage`]).
pub enum StageInput<'a, T> {
    /// The step's token ids (the first stage).
    Tokens(&'a [u32]),
    /// The residual streams `[rows, S·H]` the previous stage returned.
    Streams(T),
}

/// What a step returns: the final-normed hidden states of the requested rows (what the lm_head and the
/// MTP head consume).
pub struct StepOutput<T> {
    pub hidden: T,
}

impl<B: Backend> Model<B> {
    /// Runs `ids` (the tokens of every chunk, in `seqs` order) through the model, appending to the slots'
    /// caches, and returns the final-normed hidden states of `out_rows`.
    ///
    /// # Panics
    /// If the model has PLE layers: those need the rows of [`Model::ple_rows`] through
    /// [`Model::forward_with`].
    pub fn forward(
        &self,
        ids: &[u32],
        seqs: &[SeqChunk<'_>],
        out_rows: &[usize],
    ) -> StepOutput<B::Tensor> {
        self.forward_with(ids, seqs, out_rows, None)
    }

    /// [`Model::forward`] with the step's PLE rows (`[rows, E]`, from [`Model::ple_rows`]), which a model
    /// with PLE layers requires.
    pub fn forward_with(
        &self,
        ids: &[u32],
        seqs: &[SeqChunk<'_>],
        out_rows: &[usize],
        ple_rows: Option<&B::Tensor>,
    ) -> StepOutput<B::Tensor> {
        if self.replayable(seqs) {
            let step = DecodeStep {
                region: REGION_HIDDEN,
                ids,
                seqs,
                out_rows,
            };
            if let Some(rows) = ple_rows {
                self.backend.ple_step_rows(rows);
            }
            let run = || vec![self.forward_pass(ids, seqs, out_rows, ple_rows)];
            let hidden = self.backend.decode_step(&step, &run).pop();
            return StepOutput {
                hidden: hidden.expect("decode_step returned no tensor"),
            };
        }
        StepOutput {
            hidden: self.forward_pass(ids, seqs, out_rows, ple_rows),
        }
    }

    /// [`Model::forward`] followed by [`Model::logits`] of its hidden states: `(hidden, logits)`. A
    /// decode step (every chunk one token) runs as one [`Backend::decode_step`] from the embedding to
    /// the logits, which a backend may replay from a recording.
    ///
    /// # Panics
    /// As [`Model::forward`]: a model with PLE layers goes through [`Model::forward_logits_with`].
    pub fn forward_logits(
        &self,
        ids: &[u32],
        seqs: &[SeqChunk<'_>],
        out_rows: &[usize],
    ) -> (StepOutput<B::Tensor>, B::Tensor) {
        self.forward_logits_with(ids, seqs, out_rows, None)
    }

    /// [`Model::forward_logits`] with the step's PLE rows, as [`Model::forward_with`].
    pub fn forward_logits_with(
        &self,
        ids: &[u32],
        seqs: &[SeqChunk<'_>],
        out_rows: &[usize],
        ple_rows: Option<&B::Tensor>,
    ) -> (StepOutput<B::Tensor>, B::Tensor) {
        let run = || {
            let hidden = self.forward_pass(ids, seqs, out_rows, ple_rows);
            let logits = self.logits(&hidden);
            vec![hidden, logits]
        };
        let mut out = if self.replayable(seqs) {
            let step = DecodeStep {
                region: REGION_LOGITS,
                ids,
                seqs,
                out_rows,
            };
            if let Some(rows) = ple_rows {
                self.backend.ple_step_rows(rows);
            }
            self.backend.decode_step(&step, &run)
        } else {
            run()
        };
        let (Some(logits), Some(hidden), None) = (out.pop(), out.pop(), out.pop()) else {
            panic!("decode_step returned other than (hidden, logits)");
        };
        (StepOutput { hidden }, logits)
    }

    /// Whether a step may go through [`Backend::decode_step`]: every chunk one token. The PLE rows,
    /// the one step input made outside the backend's step metadata, reach the backend through
    /// [`Backend::ple_step_rows`] first.
    fn replayable(&self, seqs: &[SeqChunk<'_>]) -> bool {
        !seqs.is_empty() && seqs.iter().all(|s| s.len == 1)
    }

    fn forward_pass(
        &self,
        ids: &[u32],
        seqs: &[SeqChunk<'_>],
        out_rows: &[usize],
        ple_rows: Option<&B::Tensor>,
    ) -> B::Tensor {
        assert!(
            self.is_first_stage() && self.is_last_stage(),
            "the stage of layers {:?} runs through forward_stage",
            self.stage
        );
        self.forward_stage(StageInput::Tokens(ids), seqs, out_rows, ple_rows)
    }

    /// One pipeline stage's part of a step ([`Model::load_stage`]): the first stage takes the step's
    /// token ids ([`StageInput::Tokens`]), a later one the residual streams `[rows, S·H]` the previous
    /// stage returned ([`StageInput::Streams`], moved onto this stage's backend by the caller). A stage
    /// other than the last returns its residual streams (every row, for the next stage); the last
    /// returns the final-normed hidden states of `out_rows`, as [`Model::forward`]. `ple_rows` as
    /// [`Model::forward_with`] (needed by a stage holding PLE layers). Runs eagerly (no
    /// [`Backend::decode_step`] recording).
    pub fn forward_stage(
        &self,
        input: StageInput<'_, B::Tensor>,
        seqs: &[SeqChunk<'_>],
        out_rows: &[usize],
        ple_rows: Option<&B::Tensor>,
    ) -> B::Tensor {
        let b = &self.backend;
        let mut streams = match input {
            StageInput::Tokens(ids) => {
                let x = b.embed(self.embedding(), ids);
                // Every stream starts as the token embedding.
                match &self.cfg.hyper_connections {
                    Some(hc) if hc.num_streams > 1 => (2..hc.num_streams)
                        .fold(b.concat_cols(&x, &x), |acc, _| b.concat_cols(&acc, &x)),
                    _ => x,
                }
            }
            StageInput::Streams(x) => x,
        };
        // The last sublayer's output, not yet added to the residual: the next norm adds it.
        let mut pending = None;
        for (i, layer) in self.stage.clone().zip(&self.layers) {
            if let Some(w) = &layer.ple {
                if let Some(y) = pending.take() {
                    b.add(&mut streams, &y);
                }
                let (shape, _) = self
                    .ple
                    .as_ref()
                    .expect("PLE weights come with a PLE shape");
                let rows = ple_rows.expect("a model with PLE layers needs forward_with(ple_rows)");
                b.ple_mix(i, shape, &mut streams, rows, w, seqs);
            }
            pending = self.layer_forward(i, layer, &mut streams, pending, seqs);
        }
        if let Some(y) = pending {
            b.add(&mut streams, &y);
        }
        if !self.is_last_stage() {
            return streams;
        }
        let r = b.rows(&streams, out_rows);
        let x = match &self.hc_head {
            Some(pre) => b.hc_premix(&r, pre),
            None => r,
        };
        b.rms_norm(&x, self.final_norm(), self.cfg.rms_norm_eps, 1.0)
    }

    /// The PLE rows of a step: for chunk `i` of `seqs`, the rows of positions `pos0 .. pos0 + len` of
    /// `tokens[i]` (the sequence's tokens from position 0, at least `pos0 + len` of them), placed at the
    /// chunk's activation rows. `None` when the model has no PLE.
    pub fn ple_rows(
        &self,
        tokens: &[&[u32]],
        seqs: &[SeqChunk<'_>],
    ) -> Result<Option<B::Tensor>, PleError> {
        let Some((shape, source)) = &self.ple else {
            return Ok(None);
        };
        if tokens.len() != seqs.len() {
            return Err(PleError::Input(format!(
                "{} token histories for {} chunks",
                tokens.len(),
                seqs.len()
            )));
        }
        let e = shape.row_width;
        let rows = seqs.iter().map(|s| s.start + s.len).max().unwrap_or(0);
        let mut data = vec![0f32; rows * e];
        for (s, toks) in seqs.iter().zip(tokens) {
            source.gather(
                toks,
                s.pos0..s.pos0 + s.len,
                e,
                &mut data[s.start * e..(s.start + s.len) * e],
            )?;
        }
        Ok(Some(self.backend.upload(rows, e, data)))
    }

    /// Logits `[rows, vocab]` of final-normed hidden states.
    pub fn logits(&self, hidden: &B::Tensor) -> B::Tensor {
        self.backend.linear(
            hidden,
            self.lm_head.as_ref().unwrap_or_else(|| self.embedding()),
        )
    }

    /// The MTP draft head: for each row, the token that follows (`next_ids`) and the main model's
    /// final-normed hidden state at the row's position (`h_prev`). Its attention uses cache layer index
    /// `num_layers` (QSA when the model has `qsa`); its residual is plain (no hyper-connections, no PLE).
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
            &b.embed(self.embedding(), next_ids),
            &mtp.pre_fc_norm_embedding,
            eps,
            1.0,
        );
        let h = b.rms_norm(h_prev, &mtp.pre_fc_norm_hidden, eps, 1.0);
        let mut x = b.linear(&b.concat_cols(&e, &h), &mtp.fc);
        match self.layer_forward(self.cfg.num_layers, &mtp.layer, &mut x, None, seqs) {
            Some(y) => Some(b.add_rms_norm(&mut x, &y, &mtp.norm, eps, 1.0)),
            None => Some(b.rms_norm(&x, &mtp.norm, eps, 1.0)),
        }
    }

    /// One decoder layer on the residual `streams`. `pending` is the previous sublayer's output not
    /// yet added (plain residual only): its add is fused with this layer's input norm. Returns this
    /// layer's FFN output, not yet added, for the next norm to take (`None` with hyper-connections,
    /// whose gated residual is applied here).
    fn layer_forward(
        &self,
        index: usize,
        layer: &Layer<B::Weight>,
        streams: &mut B::Tensor,
        pending: Option<B::Tensor>,
        seqs: &[SeqChunk<'_>],
    ) -> Option<B::Tensor> {
        let b = &self.backend;
        let eps = self.cfg.rms_norm_eps;
        let hc = layer.hc.as_ref();
        let (hn, x) = match (hc, pending) {
            (None, Some(y)) => (
                b.add_rms_norm(streams, &y, &layer.input_norm, eps, 1.0),
                None,
            ),
            (_, pending) => {
                if let Some(y) = pending {
                    b.add(streams, &y);
                }
                let x = hc.map(|(a, _)| b.hc_premix(streams, &a.pre));
                let hn = b.rms_norm(x.as_ref().unwrap_or(streams), &layer.input_norm, eps, 1.0);
                (hn, x)
            }
        };
        let mixed = self.mixer(index, layer, &hn, seqs);

        let hn = match hc {
            None => b.add_rms_norm(streams, &mixed, &layer.post_attention_norm, eps, 1.0),
            Some((a, f)) => {
                self.residual(streams, x.as_ref(), &mixed, a);
                let x = b.hc_premix(streams, &f.pre);
                let hn = b.rms_norm(&x, &layer.post_attention_norm, eps, 1.0);
                let out = self.ffn(layer, &hn);
                self.residual(streams, Some(&x), &out, f);
                return None;
            }
        };
        Some(self.ffn(layer, &hn))
    }

    /// The FFN sublayer's output for normed input `hn`: the dense MLP, or the routed experts plus the
    /// sigmoid-gated shared expert.
    fn ffn(&self, layer: &Layer<B::Weight>, hn: &B::Tensor) -> B::Tensor {
        let b = &self.backend;
        match &layer.ffn {
            Ffn::Dense(m) => self.mlp(m, hn),
            Ffn::Moe(m) => {
                let shared = match (&m.shared, &m.shared_gate) {
                    (Some(shared), Some(gate)) => Some((self.mlp(shared, hn), b.linear(hn, gate))),
                    _ => None,
                };
                b.moe_experts(hn, m, shared.as_ref().map(|(y, g)| (y, g)))
            }
        }
    }

    fn mixer(
        &self,
        index: usize,
        layer: &Layer<B::Weight>,
        hn: &B::Tensor,
        seqs: &[SeqChunk<'_>],
    ) -> B::Tensor {
        let b = &self.backend;
        let eps = self.cfg.rms_norm_eps;
        match &layer.mixer {
            Mixer::Attention(w) => {
                let [q, k, v] = linear_n(b, hn, [&w.q_proj, &w.k_proj, &w.v_proj]);
                let o = b.attention(index, &self.attn_shape, &self.rope, &q, &k, &v, w, seqs);
                b.linear(&o, &w.o_proj)
            }
            Mixer::Qsa(w, iw) => {
                let qsa = self
                    .qsa
                    .as_ref()
                    .expect("QSA weights come with a QSA shape");
                let [q, k, v, iq, ik, ig] = linear_n(
                    b,
                    hn,
                    [
                        &w.q_proj,
                        &w.k_proj,
                        &w.v_proj,
                        &iw.wq,
                        &iw.wk,
                        &iw.weights_proj,
                    ],
                );
                let o = b.qsa_attention(
                    index,
                    &self.attn_shape,
                    &self.rope,
                    qsa,
                    &q,
                    &k,
                    &v,
                    w,
                    &iq,
                    &ik,
                    &ig,
                    iw,
                    seqs,
                );
                b.linear(&o, &w.o_proj)
            }
            Mixer::Gdn(w) => {
                let [qkv, z, bb, a] = linear_n(
                    b,
                    hn,
                    [&w.in_proj_qkv, &w.in_proj_z, &w.in_proj_b, &w.in_proj_a],
                );
                let o = b.gdn(index, &self.gdn_shape, &qkv, &z, &bb, &a, w, eps, seqs);
                b.linear(&o, &w.out_proj)
            }
        }
    }

    /// The hyper-connections' gated residual (x the sublayer's pre-mixed input):
    /// `s = silu(down·y + inject·x)`, `u = up·s`, `R_c += sigmoid(u_c) ⊙ y` ([`Backend::hc_residual`]).
    fn residual(
        &self,
        streams: &mut B::Tensor,
        x: Option<&B::Tensor>,
        y: &B::Tensor,
        w: &HcWeights<B::Weight>,
    ) {
        let x = x.expect("a hyper-connection sublayer has its pre-mixed input");
        self.backend.hc_residual(streams, x, y, w);
    }

    fn mlp(&self, m: &MlpWeights<B::Weight>, x: &B::Tensor) -> B::Tensor {
        let b = &self.backend;
        b.linear(&b.swiglu(&b.linear(x, &m.gate_up)), &m.down)
    }
}

/// [`Backend::linear_many`] of `N` weights on one input, as an array of the `N` results.
fn linear_n<B: Backend, const N: usize>(
    b: &B,
    x: &B::Tensor,
    ws: [&B::Weight; N],
) -> [B::Tensor; N] {
    let ys = b.linear_many(x, &ws);
    assert_eq!(ys.len(), N, "linear_many returns one result per weight");
    let mut it = ys.into_iter();
    std::array::from_fn(|_| it.next().expect("one result per weight"))
}
