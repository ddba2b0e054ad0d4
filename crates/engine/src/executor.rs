//! The executor seam: the engine loop hands a [`StepPlan`] to an [`Executor`] and gets logits back.
//! [`ModelExecutor`] runs a [`Model`] on any backend in one step; executors with several steps in flight
//! (pipeline stages on several GPUs) implement the same trait.

use sanmai_model::{Backend, Model, SeqChunk};

/// Which logits a chunk needs back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    None,
    /// The chunk's last token (to sample the next one).
    Last,
    /// Every token of the chunk (prompt log-probabilities).
    All,
}

/// One sequence's tokens in a step.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedChunk {
    pub slot: usize,
    /// Position of `tokens[0]`; the slot's caches hold exactly `pos0` tokens before the step.
    pub pos0: usize,
    pub tokens: Vec<u32>,
    pub logits: LogitRows,
}

/// One step: the chunks of the scheduled sequences.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    pub chunks: Vec<PlannedChunk>,
}

impl StepPlan {
    pub fn num_tokens(&self) -> usize {
        self.chunks.iter().map(|c| c.tokens.len()).sum()
    }
}

/// Logits of the requested rows, in chunk order, `width` wide each.
#[derive(Debug, Clone, Default)]
pub struct StepLogits {
    pub width: usize,
    pub rows: Vec<f32>,
}

impl StepLogits {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.rows[i * self.width..(i + 1) * self.width]
    }
}

/// Runs steps for the engine loop.
pub trait Executor: Send {
    /// A fresh per-sequence cache slot.
    fn alloc_slot(&mut self) -> usize;
    /// Releases a slot's caches.
    fn free_slot(&mut self, slot: usize);
    /// Runs one step.
    fn execute(&mut self, plan: &StepPlan) -> StepLogits;
}

/// An executor over a model on one backend.
pub struct ModelExecutor<B: Backend> {
    pub model: Model<B>,
}

impl<B: Backend> ModelExecutor<B> {
    pub fn new(model: Model<B>) -> Self {
        ModelExecutor { model }
    }
}

impl<B: Backend> Executor for ModelExecutor<B> {
    fn alloc_slot(&mut self) -> usize {
        self.model.backend.alloc_seq()
    }

    fn free_slot(&mut self, slot: usize) {
        self.model.backend.free_seq(slot);
    }

    fn execute(&mut self, plan: &StepPlan) -> StepLogits {
        let m = &self.model;
        let mut ids = Vec::with_capacity(plan.num_tokens());
        let mut seqs = Vec::with_capacity(plan.chunks.len());
        let mut rows = Vec::new();
        for c in &plan.chunks {
            let start = ids.len();
            ids.extend_from_slice(&c.tokens);
            seqs.push(SeqChunk {
                slot: c.slot,
                start,
                len: c.tokens.len(),
                pos0: c.pos0,
            });
            match c.logits {
                LogitRows::None => {}
                LogitRows::Last => rows.push(start + c.tokens.len() - 1),
                LogitRows::All => rows.extend(start..start + c.tokens.len()),
            }
        }
        let out = m.forward(&ids, &seqs, &rows);
        if rows.is_empty() {
            return StepLogits::default();
        }
        let (_, width, rows) = m.backend.to_host(&m.logits(&out.hidden));
        StepLogits { width, rows }
    }
}
