//! Sparse logit edits that precede the draw: repetition / frequency / presence penalties, logit bias,
//! and the allowed-token mask.
//!
//! Penalties follow vLLM: the repetition penalty applies to every token seen in prompt or output (a
//! positive logit is divided by it, any other multiplied), then `frequency · count + presence · [count > 0]`
//! is subtracted for tokens of the output only. The counts live in [`TokenCounts`], which the sequence
//! owns and updates once per accepted token, so a step costs O(distinct tokens), never O(length).
//!
//! Every edit of a single logit records the value it overwrote in an `edits` log, so the caller can still
//! read the model's raw logit of the token it ends up choosing.

use std::collections::HashMap;

use sanmai_model::sample::{Edit, SamplingParams, SeenToken};

pub use sanmai_model::sample::apply_allowed_mask;

/// Which tokens a sequence has seen: membership of the prompt, and occurrence counts in the output.
#[derive(Debug, Clone, Default)]
pub struct TokenCounts {
    /// Distinct tokens in first-seen order, with their output counts.
    entries: Vec<SeenToken>,
    /// Whether `entries[i]` occurs in the prompt.
    in_prompt: Vec<bool>,
    index: HashMap<u32, u32>,
}

impl TokenCounts {
    /// Empty counts.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts holding the prompt's tokens.
    pub fn from_prompt(prompt: &[u32]) -> Self {
        let mut counts = Self::new();
        for &t in prompt {
            counts.add_prompt_token(t);
        }
        counts
    }

    fn slot(&mut self, id: u32) -> usize {
        let next = self.entries.len() as u32;
        let slot = *self.index.entry(id).or_insert(next);
        if slot == next {
            self.entries.push(SeenToken { id, output: 0 });
            self.in_prompt.push(false);
        }
        slot as usize
    }

    /// Records a prompt token (repetition penalty only).
    pub fn add_prompt_token(&mut self, id: u32) {
        let i = self.slot(id);
        self.in_prompt[i] = true;
    }

    /// Records one accepted output token.
    pub fn add_output_token(&mut self, id: u32) {
        let i = self.slot(id);
        let e = &mut self.entries[i];
        e.output = e.output.saturating_add(1);
    }

    /// How often `id` occurs in the output so far.
    pub fn output_count(&self, id: u32) -> u32 {
        self.index
            .get(&id)
            .map_or(0, |&i| self.entries[i as usize].output)
    }

    /// Whether `id` occurs in the prompt.
    pub fn in_prompt(&self, id: u32) -> bool {
        self.index
            .get(&id)
            .is_some_and(|&i| self.in_prompt[i as usize])
    }

    /// Number of distinct tokens seen in prompt or output.
    pub fn distinct(&self) -> usize {
        self.entries.len()
    }

    /// Every distinct token seen, with its output count (what the penalties read).
    pub fn seen(&self) -> &[SeenToken] {
        &self.entries
    }
}

fn edit(logits: &mut [f32], id: u32, value: f32, edits: &mut Vec<(u32, f32)>) {
    let slot = &mut logits[id as usize];
    edits.push((id, *slot));
    *slot = value;
}

/// Applies repetition, frequency and presence penalties in place (as the sampler does, see
/// [`Edit::apply`]); returns whether anything changed. `edits` receives `(id, previous value)` of
/// every changed logit.
pub fn apply_penalties(
    logits: &mut [f32],
    counts: &TokenCounts,
    params: &SamplingParams,
    edits: &mut Vec<(u32, f32)>,
) -> bool {
    if !params.uses_penalties() {
        return false;
    }
    let before = edits.len();
    for t in counts.seen() {
        let Some(&z) = logits.get(t.id as usize) else {
            continue;
        };
        let e = Edit {
            id: t.id,
            penalized: true,
            output: t.output,
            bias: None,
        };
        let v = e.apply(z, params);
        if v.to_bits() != z.to_bits() {
            edit(logits, t.id, v, edits);
        }
    }
    edits.len() > before
}

/// Adds each `(token, bias)` to its logit; ids outside `logits` are skipped. Returns whether any applied.
pub fn apply_logit_bias(
    logits: &mut [f32],
    bias: &[(u32, f32)],
    edits: &mut Vec<(u32, f32)>,
) -> bool {
    let before = edits.len();
    let unpenalised = SamplingParams::default();
    for &(id, b) in bias {
        if let Some(&z) = logits.get(id as usize) {
            let e = Edit {
                id,
                penalized: false,
                output: 0,
                bias: Some(b),
            };
            edit(logits, id, e.apply(z, &unpenalised), edits);
        }
    }
    edits.len() > before
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_track_prompt_and_output() {
        let mut c = TokenCounts::from_prompt(&[3, 5, 3]);
        c.add_output_token(5);
        c.add_output_token(7);
        c.add_output_token(7);
        assert!(c.in_prompt(3) && c.in_prompt(5) && !c.in_prompt(7));
        assert_eq!(
            (c.output_count(3), c.output_count(5), c.output_count(7)),
            (0, 1, 2)
        );
        assert_eq!(c.distinct(), 3);
    }

    #[test]
    fn mask_keeps_exactly_the_set_bits() {
        let mut logits = vec![1.0f32; 70];
        let mut mask = vec![0u32; 2];
        for i in [0usize, 31, 32, 63] {
            mask[i / 32] |= 1 << (i % 32);
        }
        apply_allowed_mask(&mut logits, &mask);
        for (i, &z) in logits.iter().enumerate() {
            let kept = [0, 31, 32, 63].contains(&i);
            assert_eq!(z == 1.0, kept, "token {i}");
            assert_eq!(z == f32::NEG_INFINITY, !kept, "token {i}");
        }
    }
}
