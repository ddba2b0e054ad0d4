//! One step of the model, [`Model::step`]: a batch of sequence chunks in, the rows asked for out.
//!
//! A step starts from the chunks' tokens (the first pipeline stage embeds them), from the residual
//! streams the previous stage returned, or, for the MTP draft head, from the main model's final-normed
//! hidden states ([`StepStart`]). The residual is a `[rows, S·H]` tensor of S streams (S = 1 without
//! hyper-connections, where it is the plain `[rows, H]` residual). Per decoder layer: the PLE mix on
//! the streams (PLE layers only; its table rows are gathered from the chunks' token ids by `ple.rs`),
//! then for the mixer and the FFN sublayer: `x` = the streams (S = 1) or their pre-mix, `y = F(N(x))`,
//! then `R += y` (S = 1) or the gated residual of spec §4. The last stage ends with the final norm
//! and, for the rows asked for, the lm_head.
//!
//! A prompt with images ([`Model::step_multimodal`]) adds two things to a step: rows whose input
//! embedding is given (an image's merged tokens in place of its placeholder tokens' embeddings,
//! put in before the streams are made from the embeddings), and explicit interleaved-MRoPE
//! positions that the attention layers turn queries and keys by instead of `pos0 + i`.

use sanmai_ple::PleError;
use thiserror::Error;

use crate::backend::{
    AttnCall, AttnMixerCall, AttnWeights, Backend, BackendError, DecodeStep, GdnMixerCall,
    GdnWeights, HcNext, MlpWeights, Mrope, OpResult, QsaCall, QsaMixerCall, SeqChunk,
};
use crate::load::{Layer, Mixer, Model};

mod multimodal;
mod pending;

use pending::Pending;

/// [`DecodeStep::region`] of decode steps that return hidden states only.
const REGION_HIDDEN: u32 = 0;
/// [`DecodeStep::region`] of decode steps that return hidden states and logits.
const REGION_LOGITS: u32 = 1;
/// The region of decode steps of a pipeline stage before the last (its output: the streams).
const REGION_STREAMS: u32 = 2;

/// Which rows of a chunk a step returns (logits on the last stage, and hidden states when asked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutRows {
    None,
    /// The chunk's last token (to sample the next one).
    Last,
    /// Every token of the chunk (prompt log-probabilities, an MTP draft over a prompt).
    All,
    /// The chunk's last `n` tokens (a verify step: the row before the drafts and each draft's row).
    Tail(usize),
}

impl OutRows {
    /// Rows returned for a chunk of `len` tokens.
    pub fn count(self, len: usize) -> usize {
        match self {
            OutRows::None => 0,
            OutRows::Last => len.min(1),
            OutRows::All => len,
            OutRows::Tail(n) => n.min(len),
        }
    }
}

/// One sequence's share of a step.
#[derive(Debug, Clone, Copy)]
pub struct StepChunk<'a> {
    /// The tokens at positions `pos0 ..`; for [`StepStart::Draft`], the token that follows each row's
    /// position (what the draft head embeds).
    pub tokens: &'a [u32],
    /// The tokens just before `pos0` (up to the PLE n-gram's longest order minus one; fewer near the
    /// start): what the step reads of the past besides the caches.
    pub history: &'a [u32],
    /// Position of `tokens[0]`; the caches hold exactly `pos0` tokens before the step.
    pub pos0: usize,
    /// GDN (and PLE conv) state slot, holding the state after `pos0` tokens.
    pub state: usize,
    /// K/V block table covering at least `pos0 + tokens.len()` positions.
    pub blocks: &'a [u32],
    /// The rows returned.
    pub out: OutRows,
}

/// What a step starts from.
pub enum StepStart<T> {
    /// The chunks' token embeddings (the first stage).
    Tokens,
    /// The residual streams `[rows, S·H]` the previous stage returned, on this stage's backend.
    Streams(T),
    /// The MTP draft head (last stage): the main model's final-normed hidden state `[rows, H]` at each
    /// row's position. Its attention uses cache layer `num_layers`; its residual is plain.
    Draft(T),
}

/// One step's input.
pub struct StepInput<'a, T> {
    /// The chunks, in row order: chunk `i`'s tokens are the rows after chunk `i − 1`'s.
    pub chunks: &'a [StepChunk<'a>],
    pub start: StepStart<T>,
    /// Also return final-normed hidden states (what an MTP draft reads): of every row of a step from
    /// tokens or streams, of the rows asked for of a [`StepStart::Draft`] step.
    pub hidden: bool,
}

/// What a step of a prompt with images adds to its [`StepInput`] ([`Model::step_multimodal`]).
pub struct StepMultimodal<'a, T> {
    /// The interleaved-MRoPE `(t, h, w)` positions of each chunk's tokens, one per token, in the
    /// order of [`StepInput::chunks`]: what transformers' `get_rope_index` gives an image's tokens
    /// and the text after it (`crate::vision::PromptPositions`). `None`, or no entry, for a chunk:
    /// `pos0 + i` on every axis, plain RoPE. Only the rotary angles change; the K/V cache slots and
    /// the causal mask stay the sequence positions `pos0 + i`.
    pub positions: &'a [Option<&'a [[u32; 3]]>],
    /// Input embeddings in place of the token embeddings of some rows (the first stage only).
    pub embeds: Option<StepEmbeds<'a, T>>,
}

impl<T> StepMultimodal<'_, T> {
    /// Nothing added: [`Model::step_multimodal`] is then [`Model::step`].
    pub fn none() -> Self {
        StepMultimodal {
            positions: &[],
            embeds: None,
        }
    }
}

/// Rows whose input embedding is given rather than looked up: an image's merged vision tokens in
/// place of its placeholder tokens' embeddings (transformers' `masked_scatter` of the image features
/// into `inputs_embeds`). Applied to the token embeddings before anything else reads them (with
/// hyper-connections, before the streams are copied from them).
pub struct StepEmbeds<'a, T> {
    /// Rows of the step, distinct (the step's rows are the chunks' tokens one after another).
    pub rows: &'a [usize],
    /// `[rows.len(), hidden]`: row `i` is the input embedding of row `rows[i]`.
    pub values: T,
}

/// What a step returns. On the last stage: the logits `[rows, vocab]` of the rows the chunks asked
/// for (`None` when none did), and the hidden states [`StepInput::hidden`] asks for. On another
/// stage: the residual streams of every row, for the next stage.
pub struct StepOutput<T> {
    pub logits: Option<T>,
    pub hidden: Option<T>,
    pub streams: Option<T>,
}

/// Why a step failed.
#[derive(Debug, Error)]
pub enum StepError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("PLE rows: {0}")]
    Ple(#[from] PleError),
    #[error("{0}")]
    Input(String),
}

/// The step's chunks as the backend sees them, with the rows they return.
pub(crate) struct Layout<'a> {
    pub ids: Vec<u32>,
    pub seqs: Vec<SeqChunk<'a>>,
    pub out_rows: Vec<usize>,
    /// Explicit MRoPE positions of every row, when a chunk has them.
    pub mrope: Option<Vec<[u32; 3]>>,
}

/// What a layer's ops take of the step's layout: its chunks and the rows' MRoPE positions.
#[derive(Clone, Copy)]
struct Rows<'a> {
    seqs: &'a [SeqChunk<'a>],
    mrope: Option<Mrope<'a>>,
}

impl Rows<'_> {
    /// The rows of the step: every chunk's tokens.
    fn count(&self) -> usize {
        self.seqs.iter().map(|s| s.len).sum()
    }
}

impl<'a> Layout<'a> {
    fn of(chunks: &'a [StepChunk<'a>]) -> Self {
        let mut ids = Vec::with_capacity(chunks.iter().map(|c| c.tokens.len()).sum());
        let mut seqs = Vec::with_capacity(chunks.len());
        let mut out_rows = Vec::new();
        for c in chunks {
            let start = ids.len();
            ids.extend_from_slice(c.tokens);
            seqs.push(SeqChunk {
                start,
                len: c.tokens.len(),
                pos0: c.pos0,
                state: c.state,
                blocks: c.blocks,
            });
            let end = start + c.tokens.len();
            out_rows.extend(end - c.out.count(c.tokens.len())..end);
        }
        Layout {
            ids,
            seqs,
            out_rows,
            mrope: None,
        }
    }
}

/// A step made ready before its input arrives ([`Model::prepare`]): the chunks' layout, the PLE rows
/// gathered from the table, and the backend's step metadata staged. A pipeline stage prepares its
/// next step while the previous stage still computes the streams it starts from.
pub struct Prepared<'a, T> {
    layout: Layout<'a>,
    ple: Option<T>,
}

impl<B: Backend> Model<B> {
    /// Runs one step: appends the chunks' tokens to their caches and returns what [`StepOutput`]
    /// says. A decode step of the whole model (every chunk one token, from tokens) runs as one
    /// [`Backend::decode_step`] from the embedding to the logits, which a backend may replay from a
    /// recording. [`Model::prepare`] then [`Model::run_prepared`] do the same in two parts.
    pub fn step(
        &self,
        input: StepInput<'_, B::Tensor>,
    ) -> Result<StepOutput<B::Tensor>, StepError> {
        let layout = Layout::of(input.chunks);
        let ple = match input.start {
            // The draft head reads no PLE rows.
            StepStart::Draft(_) => None,
            _ => self.ple_rows(input.chunks, &layout)?,
        };
        self.run_prepared(Prepared { layout, ple }, input.start, input.hidden)
    }

    /// What the layers take of `layout`.
    fn rows_of<'l>(&self, layout: &'l Layout<'_>) -> Rows<'l> {
        Rows {
            seqs: &layout.seqs,
            mrope: layout.mrope.as_deref().map(|positions| Mrope {
                positions,
                sections: self.cfg.rope.mrope_section.unwrap_or_default(),
            }),
        }
    }

    /// The part of a step that needs only its chunks: their layout, their PLE rows (read from the
    /// table on the host) and the backend's step metadata ([`Backend::prepare_step`]).
    pub fn prepare<'a>(
        &self,
        chunks: &'a [StepChunk<'a>],
    ) -> Result<Prepared<'a, B::Tensor>, StepError> {
        let layout = Layout::of(chunks);
        let ple = self.ple_rows(chunks, &layout)?;
        self.backend
            .prepare_step(&layout.ids, &layout.seqs, &layout.out_rows)?;
        Ok(Prepared { layout, ple })
    }

    /// Runs a prepared step from `start` (see [`Model::step`]).
    pub fn run_prepared(
        &self,
        prepared: Prepared<'_, B::Tensor>,
        start: StepStart<B::Tensor>,
        hidden: bool,
    ) -> Result<StepOutput<B::Tensor>, StepError> {
        self.run(prepared, start, hidden, None)
    }

    /// [`Model::run_prepared`] with the rows' input embeddings `embeds` in place of their token
    /// embeddings.
    fn run(
        &self,
        prepared: Prepared<'_, B::Tensor>,
        start: StepStart<B::Tensor>,
        hidden: bool,
        embeds: Option<&StepEmbeds<'_, B::Tensor>>,
    ) -> Result<StepOutput<B::Tensor>, StepError> {
        let Prepared { layout, ple } = prepared;
        // A step with MRoPE positions or input embeddings is not a plain decode step.
        let plain = layout.mrope.is_none() && embeds.is_none();
        let last = self.is_last_stage();
        let logits = last && !layout.out_rows.is_empty();
        match start {
            StepStart::Tokens if !self.is_first_stage() => Err(StepError::Input(format!(
                "the stage of layers {:?} starts from the previous stage's streams, not tokens",
                self.stage
            ))),
            StepStart::Streams(_) if self.is_first_stage() => Err(StepError::Input(
                "the first stage starts from tokens, not streams".into(),
            )),
            StepStart::Draft(h) => {
                let h = self
                    .mtp_pass(&layout, &h)?
                    .filter(|_| last)
                    .ok_or_else(|| StepError::Input("this model holds no MTP head".into()))?;
                if layout.out_rows.is_empty() {
                    return Ok(StepOutput {
                        logits: None,
                        hidden: None,
                        streams: None,
                    });
                }
                let h = self.backend.rows(&h, &layout.out_rows)?;
                Ok(self.outputs(h, logits, hidden)?)
            }
            start if plain && layout.seqs.iter().all(|s| s.len == 1) => {
                // A decode step: from the tokens, or from the previous stage's streams where the
                // backend keeps them in place for a recording.
                let from_streams = match start {
                    StepStart::Streams(x) => match self.backend.keep_streams(x)? {
                        None => true,
                        Some(x) => {
                            return self.eager(&layout, Some(x), ple.as_ref(), logits, hidden, None)
                        }
                    },
                    _ => false,
                };
                if let Some(rows) = &ple {
                    self.backend.ple_step_rows(rows)?;
                }
                let step = DecodeStep {
                    region: match (last, logits) {
                        (false, _) => REGION_STREAMS,
                        (true, true) => REGION_LOGITS,
                        (true, false) => REGION_HIDDEN,
                    },
                    ids: &layout.ids,
                    seqs: &layout.seqs,
                    out_rows: &layout.out_rows,
                };
                let run = || {
                    let input = match from_streams {
                        true => Some(self.backend.kept_streams()?),
                        false => None,
                    };
                    let streams = self.layers_pass(&layout, input, ple.as_ref(), None)?;
                    if !last {
                        return Ok(vec![streams]);
                    }
                    let out = self.head(&layout, streams, logits, true)?;
                    Ok(out.hidden.into_iter().chain(out.logits).collect())
                };
                let mut out = self.backend.decode_step(&step, &run)?.into_iter();
                if !last {
                    return Ok(StepOutput {
                        logits: None,
                        hidden: None,
                        streams: out.next(),
                    });
                }
                let h = out.next();
                let logits = if logits { out.next() } else { None };
                Ok(StepOutput {
                    logits,
                    hidden: h.filter(|_| hidden),
                    streams: None,
                })
            }
            start => {
                let streams = match start {
                    StepStart::Streams(x) => Some(x),
                    _ => None,
                };
                self.eager(&layout, streams, ple.as_ref(), logits, hidden, embeds)
            }
        }
    }

    /// A step's layers and (on the last stage) head, op by op.
    fn eager(
        &self,
        layout: &Layout<'_>,
        streams: Option<B::Tensor>,
        ple: Option<&B::Tensor>,
        logits: bool,
        hidden: bool,
        embeds: Option<&StepEmbeds<'_, B::Tensor>>,
    ) -> Result<StepOutput<B::Tensor>, StepError> {
        let streams = self.layers_pass(layout, streams, ple, embeds)?;
        if !self.is_last_stage() {
            return Ok(StepOutput {
                logits: None,
                hidden: None,
                streams: Some(streams),
            });
        }
        Ok(self.head(layout, streams, logits, hidden)?)
    }

    /// The last stage's head on the residual streams of every row: the hyper-connections' head
    /// collapse and the final norm of the rows asked for (of every row with `hidden`), and the
    /// lm_head of the rows asked for when `logits`.
    fn head(
        &self,
        layout: &Layout<'_>,
        streams: B::Tensor,
        logits: bool,
        hidden: bool,
    ) -> OpResult<StepOutput<B::Tensor>> {
        let b = &self.backend;
        let every = layout.out_rows.len() == layout.ids.len();
        let r = match hidden || every {
            true => streams,
            false => b.rows(&streams, &layout.out_rows)?,
        };
        let x = match &self.hc_head {
            Some(pre) => b.hc_premix(&r, pre)?,
            None => r,
        };
        let h = b.rms_norm(&x, self.final_norm(), self.cfg.rms_norm_eps, 1.0)?;
        if !hidden || every {
            return self.outputs(h, logits, hidden);
        }
        let logits = match logits {
            true => Some(self.logits(&b.rows(&h, &layout.out_rows)?)?),
            false => None,
        };
        Ok(StepOutput {
            logits,
            hidden: Some(h),
            streams: None,
        })
    }

    /// A last stage's outputs from the final-normed hidden states `h` of the rows asked for.
    fn outputs(&self, h: B::Tensor, logits: bool, hidden: bool) -> OpResult<StepOutput<B::Tensor>> {
        let logits = if logits { Some(self.logits(&h)?) } else { None };
        Ok(StepOutput {
            logits,
            hidden: hidden.then_some(h),
            streams: None,
        })
    }

    /// The stage's decoder layers over the step's rows, from `streams` (a later stage) or the token
    /// embeddings (the first stage), `embeds`' rows replaced; returns the residual streams
    /// `[rows, S·H]` of every row.
    fn layers_pass(
        &self,
        layout: &Layout<'_>,
        streams: Option<B::Tensor>,
        ple_rows: Option<&B::Tensor>,
        embeds: Option<&StepEmbeds<'_, B::Tensor>>,
    ) -> OpResult<B::Tensor> {
        let b = &self.backend;
        let rows = self.rows_of(layout);
        let mut streams = match streams {
            Some(_) if embeds.is_some() => {
                return Err(BackendError::invalid(
                    "set_rows",
                    "input embeddings for a step that starts from streams",
                ))
            }
            Some(x) => x,
            None => {
                let mut x = b.embed(self.embedding(), &layout.ids)?;
                if let Some(e) = embeds {
                    b.set_rows(&mut x, e.rows, &e.values)?;
                }
                // Every stream starts as the token embedding.
                match &self.cfg.hyper_connections {
                    Some(hc) if hc.num_streams > 1 => {
                        let mut acc = b.concat_cols(&x, &x)?;
                        for _ in 2..hc.num_streams {
                            acc = b.concat_cols(&acc, &x)?;
                        }
                        acc
                    }
                    _ => x,
                }
            }
        };
        // The last sublayer's output, not yet added to the residual: the next norm adds it.
        let mut pending: Option<Pending<'_, B::Tensor, B::Weight>> = None;
        for (i, layer) in self.stage.clone().zip(&self.layers) {
            if let Some(w) = &layer.ple {
                if let Some(y) = pending.take() {
                    y.add_to(b, &mut streams)?;
                }
                self.ple_mix(i, w, &mut streams, ple_rows, rows.seqs)?;
            }
            pending = self.layer_forward(i, layer, &mut streams, pending, rows)?;
        }
        if let Some(y) = pending {
            y.add_to(b, &mut streams)?;
        }
        Ok(streams)
    }

    /// Logits `[rows, vocab]` of final-normed hidden states.
    pub fn logits(&self, hidden: &B::Tensor) -> OpResult<B::Tensor> {
        self.backend.linear(
            hidden,
            self.lm_head.as_ref().unwrap_or_else(|| self.embedding()),
        )
    }

    /// The embeddings of `ids` for the MTP head: the device table's rows, or the rows of its copy
    /// in host memory ([`Model::mtp_embed`]) gathered and uploaded.
    pub fn draft_embed(&self, ids: &[u32]) -> OpResult<B::Tensor> {
        let Some(table) = &self.mtp_embed else {
            return self.backend.embed(self.embedding(), ids);
        };
        let h = self.cfg.hidden_size;
        let mut rows = Vec::with_capacity(ids.len() * h);
        for &id in ids {
            let at = id as usize * h;
            let row = table.get(at..at + h).ok_or_else(|| {
                BackendError::invalid(
                    "draft_embed",
                    format!("token id {id} is past the vocabulary"),
                )
            })?;
            rows.extend_from_slice(row);
        }
        self.backend.upload(ids.len(), h, rows)
    }

    /// The MTP draft head over every row: `fc(cat[norm_e(embed(next)), norm_h(h_prev)])`, its decoder
    /// layer (cache layer `num_layers`), then `mtp.norm`: the draft's final-normed hidden states.
    /// `None` without an MTP head.
    fn mtp_pass(&self, layout: &Layout<'_>, h_prev: &B::Tensor) -> OpResult<Option<B::Tensor>> {
        let Some(mtp) = self.mtp.as_ref() else {
            return Ok(None);
        };
        let b = &self.backend;
        let eps = self.cfg.rms_norm_eps;
        let rows = self.rows_of(layout);
        let e = b.rms_norm(
            &self.draft_embed(&layout.ids)?,
            &mtp.pre_fc_norm_embedding,
            eps,
            1.0,
        )?;
        let h = b.rms_norm(h_prev, &mtp.pre_fc_norm_hidden, eps, 1.0)?;
        let mut x = b.linear(&b.concat_cols(&e, &h)?, &mtp.fc)?;
        let h = match self.layer_forward(self.cfg.num_layers, &mtp.layer, &mut x, None, rows)? {
            Some(y) => y.add_rms_norm(b, &mut x, &mtp.norm, eps, 1.0)?,
            None => b.rms_norm(&x, &mtp.norm, eps, 1.0)?,
        };
        Ok(Some(h))
    }

    /// One decoder layer on the residual `streams`. `pending` is the previous sublayer's output not
    /// yet added: its add is fused with this layer's input norm (and a MoE output's combine with
    /// both, where the backend does so), or with hyper-connections its gated residual with this
    /// layer's pre-mix and input norm. Returns this layer's FFN output, not yet added, for the next
    /// norm to take.
    fn layer_forward<'l>(
        &self,
        index: usize,
        layer: &'l Layer<B::Weight>,
        streams: &mut B::Tensor,
        pending: Option<Pending<'_, B::Tensor, B::Weight>>,
        rows: Rows<'_>,
    ) -> OpResult<Option<Pending<'l, B::Tensor, B::Weight>>> {
        let b = &self.backend;
        let eps = self.cfg.rms_norm_eps;
        let hc = layer.hc.as_ref();
        let (hn, x) = match (hc, pending) {
            (None, Some(y)) => (
                y.add_rms_norm(b, streams, &layer.input_norm, eps, 1.0)?,
                None,
            ),
            (Some((a, _)), Some(Pending::Hc { x, y, w })) => {
                let next = HcNext {
                    pre: &a.pre,
                    norm: &layer.input_norm,
                    eps,
                    offset: 1.0,
                };
                let (x, hn) = b.hc_residual_premix_norm(streams, (&x, &y), w, next)?;
                (hn, Some(x))
            }
            (_, pending) => {
                if let Some(y) = pending {
                    y.add_to(b, streams)?;
                }
                let x = match hc {
                    Some((a, _)) => Some(b.hc_premix(streams, &a.pre)?),
                    None => None,
                };
                let hn = b.rms_norm(x.as_ref().unwrap_or(streams), &layer.input_norm, eps, 1.0)?;
                (hn, x)
            }
        };
        // A GDN mixer the backend runs whole (one launch on a GPU), else the mixer's ops; an
        // attention mixer likewise where no hyper-connections take its rows.
        let whole = match &layer.mixer {
            Mixer::Gdn(w) if b.gdn_mixer_whole(w, &self.gdn_shape, rows.count()) => {
                Some(self.gdn_call(index, w, &hn, rows))
            }
            _ => None,
        };
        let post = &layer.post_attention_norm;
        if let (None, Mixer::Attention(w)) = (hc, &layer.mixer) {
            if b.attn_mixer_whole(w, &self.attn_shape, rows.count()) {
                let c = self.attn_call(index, w, &hn, rows);
                let hn = b.attn_mixer_add_rms_norm(&c, streams, post, eps, 1.0)?;
                return Ok(Some(self.ffn(layer, hn, rows.count())?));
            }
        }
        let hn = match (hc, whole) {
            (None, Some(c)) => b.gdn_mixer_add_rms_norm(&c, streams, post, eps, 1.0)?,
            (None, None) => {
                let mixed = self.mixer(index, layer, &hn, rows)?;
                mixed.add_rms_norm(b, streams, post, eps, 1.0)?
            }
            (Some((a, f)), whole) => {
                let mixed = match whole {
                    Some(c) => b.gdn_mixer(&c)?,
                    None => self.mixer(index, layer, &hn, rows)?.rows(b)?,
                };
                let x = x.ok_or_else(|| {
                    BackendError::invalid(
                        "hc_residual",
                        "a hyper-connection sublayer without its input",
                    )
                })?;
                let next = HcNext {
                    pre: &f.pre,
                    norm: &layer.post_attention_norm,
                    eps,
                    offset: 1.0,
                };
                let (x, hn) = b.hc_residual_premix_norm(streams, (&x, &mixed), a, next)?;
                let y = self.ffn(layer, hn, rows.count())?.rows(b)?;
                return Ok(Some(Pending::Hc { x, y, w: f }));
            }
        };
        Ok(Some(self.ffn(layer, hn, rows.count())?))
    }

    /// The mixer sublayer's output for normed input `hn`, its output projection left pending (see
    /// [`Pending`]).
    fn mixer<'l>(
        &self,
        index: usize,
        layer: &'l Layer<B::Weight>,
        hn: &B::Tensor,
        rows: Rows<'_>,
    ) -> OpResult<Pending<'l, B::Tensor, B::Weight>> {
        let b = &self.backend;
        let seqs = rows.seqs;
        let attn = |w, q_gate, k, v| AttnCall {
            layer: index,
            shape: &self.attn_shape,
            rope: &self.rope,
            q_gate,
            k,
            v,
            w,
            seqs,
            mrope: rows.mrope,
        };
        match &layer.mixer {
            Mixer::Attention(w) => Ok(Pending::Linear {
                x: b.attn_from_input(&self.attn_call(index, w, hn, rows))?,
                w: &w.o_proj,
            }),
            Mixer::Qsa(w, iw) => {
                let qsa = self.qsa.as_ref().ok_or_else(|| {
                    BackendError::invalid("qsa_attention", "QSA weights without a QSA shape")
                })?;
                let whole = QsaMixerCall {
                    mixer: self.attn_call(index, w, hn, rows),
                    qsa,
                    indexer: iw,
                };
                let within = seqs.iter().all(|s| s.pos0 + s.len <= qsa.topk);
                if within {
                    if let Some(o) = b.qsa_mixer_within_topk(&whole)? {
                        return Ok(Pending::Rows(o));
                    }
                }
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
                )?;
                let o = b.qsa_attention(&QsaCall {
                    attn: attn(w, &q, &k, &v),
                    qsa,
                    iq: &iq,
                    ik: &ik,
                    iw: &ig,
                    indexer: iw,
                })?;
                Ok(Pending::Linear { x: o, w: &w.o_proj })
            }
            Mixer::Gdn(w) => Ok(Pending::Linear {
                x: b.gdn_from_input(&self.gdn_call(index, w, hn, rows))?,
                w: &w.out_proj,
            }),
        }
    }

    /// The GDN mixer call of layer `index` (weights `w`) on normed input `hn`.
    fn gdn_call<'a>(
        &'a self,
        index: usize,
        w: &'a GdnWeights<B::Weight>,
        hn: &'a B::Tensor,
        rows: Rows<'a>,
    ) -> GdnMixerCall<'a, B::Tensor, B::Weight> {
        GdnMixerCall {
            layer: index,
            shape: &self.gdn_shape,
            x: hn,
            w,
            eps: self.cfg.rms_norm_eps,
            seqs: rows.seqs,
        }
    }

    /// The attention mixer call of layer `index` (weights `w`) on normed input `hn`.
    fn attn_call<'a>(
        &'a self,
        index: usize,
        w: &'a AttnWeights<B::Weight>,
        hn: &'a B::Tensor,
        rows: Rows<'a>,
    ) -> AttnMixerCall<'a, B::Tensor, B::Weight> {
        AttnMixerCall {
            layer: index,
            shape: &self.attn_shape,
            rope: &self.rope,
            x: hn,
            w,
            seqs: rows.seqs,
            mrope: rows.mrope,
        }
    }

    fn mlp(&self, m: &MlpWeights<B::Weight>, x: &B::Tensor) -> OpResult<B::Tensor> {
        let b = &self.backend;
        b.swiglu_linear(&b.linear(x, &m.gate_up)?, &m.down)
    }
}

/// [`Backend::linear_many`] of `N` weights on one input, as an array of the `N` results.
fn linear_n<B: Backend, const N: usize>(
    b: &B,
    x: &B::Tensor,
    ws: [&B::Weight; N],
) -> OpResult<[B::Tensor; N]> {
    let ys = b.linear_many(x, &ws)?;
    let got = ys.len();
    <[B::Tensor; N]>::try_from(ys)
        .map_err(|_| BackendError::invalid("linear_many", format!("{got} results for {N} weights")))
}
