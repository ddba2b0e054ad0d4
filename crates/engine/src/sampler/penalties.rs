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

use super::params::SamplingParams;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    id: u32,
    in_prompt: bool,
    output: u32,
}

/// Which tokens a sequence has seen: membership of the prompt, and occurrence counts in the output.
#[derive(Debug, Clone, Default)]
pub struct TokenCounts {
    entries: Vec<Entry>,
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

    fn entry(&mut self, id: u32) -> &mut Entry {
        let next = self.entries.len() as u32;
        let slot = *self.index.entry(id).or_insert(next);
        if slot == next {
            self.entries.push(Entry {
                id,
                in_prompt: false,
                output: 0,
            });
        }
        &mut self.entries[slot as usize]
    }

    /// Records a prompt token (repetition penalty only).
    pub fn add_prompt_token(&mut self, id: u32) {
        self.entry(id).in_prompt = true;
    }

    /// Records one accepted output token.
    pub fn add_output_token(&mut self, id: u32) {
        let e = self.entry(id);
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
            .is_some_and(|&i| self.entries[i as usize].in_prompt)
    }

    /// Number of distinct tokens seen in prompt or output.
    pub fn distinct(&self) -> usize {
        self.entries.len()
    }
}

fn edit(logits: &mut [f32], id: u32, value: f32, edits: &mut Vec<(u32, f32)>) {
    let slot = &mut logits[id as usize];
    edits.push((id, *slot));
    *slot = value;
}

/// Applies repetition, frequency and presence penalties in place; returns whether anything changed.
pub fn apply_penalties(
    logits: &mut [f32],
    counts: &TokenCounts,
    params: &SamplingParams,
    edits: &mut Vec<(u32, f32)>,
) -> bool {
    if !params.uses_penalties() {
        return false;
    }
    let rep = params.repetition_penalty;
    let (freq, pres) = (params.frequency_penalty, params.presence_penalty);
    let before = edits.len();
    for e in &counts.entries {
        let Some(&z) = logits.get(e.id as usize) else {
            continue;
        };
        let mut v = z;
        if rep != 1.0 {
            v = if v > 0.0 { v / rep } else { v * rep };
        }
        if e.output > 0 {
            v -= freq * e.output as f32 + pres;
        }
        if v.to_bits() != z.to_bits() {
            edit(logits, e.id, v, edits);
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
    for &(id, b) in bias {
        if let Some(&z) = logits.get(id as usize) {
            edit(logits, id, z + b, edits);
        }
    }
    edits.len() > before
}

/// Sets the logit of every token whose bit is clear in `allowed` to `-inf`.
///
/// `allowed` is a bitmask, token `i` at bit `i % 32` of word `i / 32` (the layout grammar engines
/// produce); tokens past the end of the mask are disallowed.
pub fn apply_allowed_mask(logits: &mut [f32], allowed: &[u32]) {
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let word = allowed.get(w).copied().unwrap_or(0);
        if word == u32::MAX {
            continue;
        }
        if word == 0 {
            chunk.fill(f32::NEG_INFINITY);
            continue;
        }
        for (bit, z) in chunk.iter_mut().enumerate() {
            if word & (1 << bit) == 0 {
                *z = f32::NEG_INFINITY;
            }
        }
    }
}

/// The value `id` had before any logged edit, given its current value.
pub(crate) fn original_value(current: f32, id: u32, edits: &[(u32, f32)]) -> f32 {
    edits.iter().find(|e| e.0 == id).map_or(current, |e| e.1)
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

    #[test]
    fn original_value_reads_the_first_edit() {
        let edits = [(4, 1.0), (2, 5.0), (4, 0.5)];
        assert_eq!(original_value(9.0, 4, &edits), 1.0);
        assert_eq!(original_value(9.0, 3, &edits), 9.0);
    }
}
