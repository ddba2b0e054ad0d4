//! Token sampling math, one row of logits per sequence: the one host implementation, used by the
//! engine's sampler and by [`crate::Backend::sample`]'s default (a device kernel mirrors it stage for
//! stage, see `kernels/sample.cu`), and the one parameter type every layer reads ([`SamplingParams`],
//! checked once into [`ValidatedParams`]; a row's [`RowSampling`] borrows it).
//!
//! One row runs these stages in order:
//!
//! 1. **padding** — only ids below `valid_vocab` are tokens; the lm_head padding past it is never read.
//! 2. **mask** — the allowed-token bitmask ([`apply_allowed_mask`]): structured output (and tokens a
//!    request may not produce yet) report and sample the constrained distribution.
//! 3. **raw logprobs** — log-normaliser and top-N of the logits so far: what the response reports,
//!    independent of everything below.
//! 4. **edits** — repetition, frequency and presence penalties, then `logit_bias` ([`Edit`]).
//! 5. **temperature** — weights `e^((z - max) / T)`; greedy (`T` below [`GREEDY_TEMPERATURE`]) takes the
//!    argmax (lowest id among equal maxima) instead.
//! 6. **top-k → top-p → min-p** — truncation of the weights (see the `filter` module for exact rules).
//! 7. **draw** — inverse CDF over the kept tokens in id order with the row's uniform ([`RowSampling::uniform`]).
//!
//! Cost: two vectorised passes over the row (block maxima, block sums of exponentials) serve the raw
//! logprobs, greedy, top-k and min-p; plain sampling and top-p at `T != 1` add a third. Everything
//! else touches only the blocks that can hold the answer. The row is used as working space: on return
//! its contents are unspecified. Buffers live in [`Scratch`] and are reused, so a warm step allocates
//! nothing row-sized.

mod filter;
mod logprobs;
mod math;
mod params;

use std::fmt;

use filter::{Candidate, Scaled, Truncation};

pub use logprobs::top_n;
pub use params::{ParamError, SamplingParams, ValidatedParams, MAX_LOGPROBS};

/// Temperatures below this are greedy (the same cut-off vLLM uses).
pub const GREEDY_TEMPERATURE: f32 = 1e-5;

/// A token a sequence has seen (in its prompt or output): the repetition penalty applies to it, the
/// frequency and presence penalties when `output > 0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeenToken {
    pub id: u32,
    /// Occurrences in the output so far.
    pub output: u32,
}

/// Everything one row's draw depends on besides its logits: the request's parameters (borrowed, never
/// copied), what the sequence has seen, the mask and the draw's uniform.
#[derive(Debug, Clone, Copy)]
pub struct RowSampling<'a> {
    /// Temperature, filters, penalties and biases (the `logprobs` and `seed` fields are not read here).
    pub params: &'a SamplingParams,
    /// Distinct tokens of prompt and output (read only when a penalty is active).
    pub seen: &'a [SeenToken],
    /// Allowed-token bitmask, token `i` at bit `i % 32` of word `i / 32`; missing words disallow.
    pub allowed: Option<&'a [u32]>,
    /// The draw's uniform in `[0, 1)`, from the request's own random stream (unused when greedy).
    pub uniform: f64,
}

impl<'a> RowSampling<'a> {
    /// A row drawn with `params`, nothing seen, no mask, uniform 0.
    pub fn new(params: &'a SamplingParams) -> Self {
        Self {
            params,
            seen: &[],
            allowed: None,
            uniform: 0.0,
        }
    }
}

/// One sampled token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampled {
    pub id: u32,
    /// Its log-probability under the raw (masked, unpenalised, temperature 1) distribution.
    pub logprob: f32,
}

/// Why a row could not be sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowError {
    /// `valid_vocab` is 0 or wider than the row.
    Vocab { valid_vocab: usize, row_len: usize },
    /// Every logit is `-inf`, NaN or masked out.
    NoCandidates,
    /// The logits contain `+inf`.
    InfiniteLogit,
}

impl fmt::Display for RowError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Vocab {
                valid_vocab,
                row_len,
            } => write!(
                f,
                "valid vocabulary of {valid_vocab} ids does not fit a logits row of {row_len}"
            ),
            Self::NoCandidates => {
                write!(
                    f,
                    "no token can be sampled: every logit is -inf, NaN or masked out"
                )
            }
            Self::InfiniteLogit => write!(f, "the logits contain +inf"),
        }
    }
}

impl std::error::Error for RowError {}

/// One logit edit of a row: the penalties of a seen token and the sum of its biases, applied by
/// [`Edit::apply`]. [`collect_edits`] lists a row's edits by ascending id, one per id.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Edit {
    pub id: u32,
    /// The token is in `seen` and a penalty is active.
    pub penalized: bool,
    /// Output occurrences (frequency / presence penalties when positive).
    pub output: u32,
    /// Sum of the token's `logit_bias` entries, in request order.
    pub bias: Option<f32>,
}

impl Edit {
    /// The edited logit: `z / rep` if positive else `z · rep` (penalised tokens), minus
    /// `freq · output + pres` (tokens of the output), plus the bias. Every operation is one f32
    /// rounding in this order (the device kernel performs the same ones).
    #[inline]
    pub fn apply(&self, z: f32, p: &SamplingParams) -> f32 {
        let mut v = z;
        if self.penalized {
            let rep = p.repetition_penalty;
            if rep != 1.0 {
                v = if v > 0.0 { v / rep } else { v * rep };
            }
            if self.output > 0 {
                v -= p.frequency_penalty * self.output as f32 + p.presence_penalty;
            }
        }
        if let Some(b) = self.bias {
            v += b;
        }
        v
    }
}

/// The edits of `p` for a vocabulary of `valid_vocab` tokens, one per id (ids at or past `valid_vocab`
/// are dropped), by ascending id when `sorted` (else in `seen` order when there is no bias: the host
/// applies them in any order, distinct ids being independent).
pub fn collect_edits(p: &RowSampling<'_>, valid_vocab: usize, sorted: bool, out: &mut Vec<Edit>) {
    out.clear();
    if p.params.uses_penalties() {
        out.extend(
            p.seen
                .iter()
                .filter(|t| (t.id as usize) < valid_vocab)
                .map(|t| Edit {
                    id: t.id,
                    penalized: true,
                    output: t.output,
                    bias: None,
                }),
        );
    }
    let seen = out.len();
    out.extend(
        p.params
            .logit_bias
            .iter()
            .filter(|b| (b.0 as usize) < valid_vocab)
            .map(|&(id, b)| Edit {
                id,
                penalized: false,
                output: 0,
                bias: Some(b),
            }),
    );
    // Stable: a penalty entry precedes the biases of its id, and biases keep request order.
    if seen < out.len() || (sorted && !out.windows(2).all(|w| w[0].id < w[1].id)) {
        out.sort_by_key(|e| e.id);
        out.dedup_by(|next, kept| {
            if next.id != kept.id {
                return false;
            }
            kept.penalized |= next.penalized;
            kept.output = kept.output.max(next.output);
            kept.bias = match (kept.bias, next.bias) {
                (Some(a), Some(b)) => Some(a + b),
                (a, b) => a.or(b),
            };
            true
        });
    }
}

/// Sets the logit of every token whose bit is clear in `allowed` to `-inf` (words past the end of
/// `allowed` disallow their tokens).
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

/// `ln Σ e^x` over the row; `None` when no value is finite (nothing to normalise) or one is `+inf`.
pub fn log_sum_exp(xs: &[f32]) -> Option<f32> {
    math::log_sum_exp(xs)
}

/// Reusable buffers of one sampling thread. Their size follows the number of blocks and of surviving
/// candidates, so once warm a step allocates nothing row-sized.
#[derive(Debug, Clone, Default)]
pub struct Scratch {
    maxima: Vec<f32>,
    sums: Vec<f32>,
    tmp: Vec<f32>,
    cands: Vec<Candidate>,
    work: Vec<Candidate>,
    edits: Vec<Edit>,
    /// `(id, logit before its edit)` of every edited token.
    originals: Vec<(u32, f32)>,
    levels: math::LevelMass,
}

impl Scratch {
    /// Empty scratch.
    pub fn new() -> Self {
        Self::default()
    }
}

/// Samples one row: `row` holds exactly the real vocabulary (padding already cut off). With
/// `top_logprobs > 0` also returns the most likely tokens of the raw distribution with their
/// log-probabilities (most likely first, lower id on ties; tokens the mask forbids are left out).
/// The row is clobbered.
pub fn sample_row(
    row: &mut [f32],
    p: &RowSampling<'_>,
    top_logprobs: usize,
    scratch: &mut Scratch,
) -> Result<(Sampled, Vec<(u32, f32)>), RowError> {
    let valid_vocab = row.len();
    if valid_vocab == 0 || valid_vocab > u32::MAX as usize {
        return Err(RowError::Vocab {
            valid_vocab,
            row_len: row.len(),
        });
    }
    // The mask: tokens it forbids do not exist for anything below.
    if let Some(mask) = p.allowed {
        apply_allowed_mask(row, mask);
    }

    // The raw distribution, before any edit.
    let raw_max = math::block_maxima(row, &mut scratch.maxima);
    if raw_max == f32::INFINITY {
        return Err(RowError::InfiniteLogit);
    }
    if raw_max == f32::NEG_INFINITY {
        return Err(RowError::NoCandidates);
    }
    let params = p.params;
    let greedy = params.is_greedy();
    let t = Truncation {
        top_k: params.top_k_within(valid_vocab),
        top_p: params.top_p,
        min_p: params.min_p,
    };
    let scale = 1.0 / params.temperature;
    let want_levels = !greedy && t.uses_levels();
    // At temperature 1 the raw weights are the sampling weights (unless edits change them below).
    let raw_levels = (want_levels && scale == 1.0).then_some(&mut scratch.levels);
    let raw_total = math::block_exp_sums(row, raw_max, 1.0, &mut scratch.sums, raw_levels);
    let log_z = raw_max + raw_total.ln() as f32;
    let mut top = Vec::new();
    if top_logprobs > 0 {
        top = logprobs::top_logprobs(row, Some(&scratch.maxima), top_logprobs, log_z);
        // Tokens the mask forbids are no alternatives.
        if p.allowed.is_some() {
            top.retain(|t| t.1 > f32::NEG_INFINITY);
        }
    }

    // Penalties and bias; the block maxima follow the edits.
    collect_edits(p, valid_vocab, false, &mut scratch.edits);
    scratch.originals.clear();
    for e in &scratch.edits {
        let z = &mut row[e.id as usize];
        let v = e.apply(*z, params);
        if v.to_bits() != z.to_bits() {
            scratch.originals.push((e.id, *z));
            *z = v;
        }
    }
    let edited = !scratch.originals.is_empty();
    if edited {
        math::refresh_maxima(
            row,
            &mut scratch.maxima,
            scratch.originals.iter().map(|e| e.0),
        );
    }
    let m = if edited {
        math::max(&scratch.maxima)
    } else {
        raw_max
    };
    if m == f32::NEG_INFINITY {
        return Err(RowError::NoCandidates);
    }

    // Temperature, truncation, draw (or the argmax).
    let id = if greedy || m == f32::INFINITY {
        math::position_of_max(row, &scratch.maxima, m).map(|i| i as u32)
    } else {
        let s = Scaled {
            row,
            maxima: &scratch.maxima,
            m,
            scale,
        };
        // The raw pass's block sums are the sampling weights when nothing changed them.
        let mut total = raw_total;
        if t.needs_total() && (edited || scale != 1.0) {
            let levels = want_levels.then_some(&mut scratch.levels);
            total = math::block_exp_sums(row, m, scale, &mut scratch.sums, levels);
        }
        let levels = want_levels.then_some(&scratch.levels);
        if filter::select(
            &s,
            &t,
            total,
            levels,
            &mut scratch.tmp,
            &mut scratch.cands,
            &mut scratch.work,
        ) {
            filter::draw_from(&scratch.cands, p.uniform)
        } else {
            filter::draw_from_row(&s, &scratch.sums, total, p.uniform)
        }
    }
    .ok_or(RowError::NoCandidates)?;

    let raw = scratch
        .originals
        .iter()
        .find(|e| e.0 == id)
        .map_or(row[id as usize], |e| e.1);
    Ok((
        Sampled {
            id,
            logprob: raw - log_z,
        },
        top,
    ))
}

/// Samples `specs.len()` rows of `cols` logits each, laid out back to back in `values`, with the first
/// `valid_vocab` of each row real tokens: the host version of [`crate::Backend::sample`].
pub fn sample_rows(
    values: &mut [f32],
    cols: usize,
    valid_vocab: usize,
    specs: &[RowSampling<'_>],
) -> Vec<Result<Sampled, RowError>> {
    let mut scratch = Scratch::new();
    specs
        .iter()
        .enumerate()
        .map(|(r, p)| {
            if valid_vocab == 0 || valid_vocab > cols || (r + 1) * cols > values.len() {
                return Err(RowError::Vocab {
                    valid_vocab,
                    row_len: cols,
                });
            }
            let row = &mut values[r * cols..r * cols + valid_vocab];
            sample_row(row, p, 0, &mut scratch).map(|s| s.0)
        })
        .collect()
}

/// A small seeded generator for the tests of this module.
#[cfg(test)]
pub(crate) mod rng {
    pub struct TestRng(u64);

    impl TestRng {
        pub fn seeded(seed: u64) -> Self {
            Self(seed)
        }

        pub fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        pub fn next_f64(&mut self) -> f64 {
            (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edits_merge_penalties_and_biases_by_id() {
        let seen = [
            SeenToken { id: 9, output: 2 },
            SeenToken { id: 3, output: 0 },
        ];
        let params = SamplingParams {
            repetition_penalty: 2.0,
            frequency_penalty: 0.5,
            logit_bias: vec![(9, 1.0), (4, -1.0), (9, 0.5), (100, 3.0)],
            ..SamplingParams::default()
        };
        let p = RowSampling {
            seen: &seen,
            ..RowSampling::new(&params)
        };
        let mut edits = Vec::new();
        collect_edits(&p, 50, true, &mut edits);
        let ids: Vec<u32> = edits.iter().map(|e| e.id).collect();
        assert_eq!(ids, [3, 4, 9]);
        assert_eq!(edits[2].bias, Some(1.5));
        assert!(edits[2].penalized && edits[2].output == 2);
        // 4 / 2 - 0.5 · 2 + 1.5.
        assert_eq!(edits[2].apply(4.0, &params), 2.5);
        assert_eq!(edits[0].apply(-1.0, &params), -2.0);
    }

    #[test]
    fn a_mask_makes_the_reported_distribution_the_constrained_one() {
        let mut logits = vec![0.0f32; 64];
        let mask = [0b11u32, 0];
        let params = SamplingParams::default();
        let p = RowSampling {
            allowed: Some(&mask),
            uniform: 0.7,
            ..RowSampling::new(&params)
        };
        let (s, top) = sample_row(&mut logits, &p, 3, &mut Scratch::new()).unwrap();
        assert_eq!(s.id, 1);
        assert!((s.logprob - 0.5f32.ln()).abs() < 1e-5, "{}", s.logprob);
        // Only the two allowed tokens are alternatives.
        assert_eq!(top.len(), 2);
        assert!((top[0].1 - 0.5f32.ln()).abs() < 1e-5);
    }

    #[test]
    fn the_draw_walks_the_kept_tokens_in_id_order() {
        // Weights 1, 1/2, 1/4, 1/4 at ids 3, 0, 2, 1 (by logit); top-k 3 keeps ids 3, 0 and 1 (the
        // lower id of the tie), of mass 1.75: in id order 0 [0, .5), 1 [.5, .75), 3 [.75, 1.75).
        let ln2 = std::f32::consts::LN_2;
        let row = [-ln2, -2.0 * ln2, -2.0 * ln2, 0.0];
        let params = SamplingParams {
            top_k: 3,
            ..SamplingParams::default()
        };
        for (u, want) in [
            (0.0, 0),
            (0.28, 0),
            (0.29, 1),
            (0.42, 1),
            (0.43, 3),
            (0.99, 3),
        ] {
            let p = RowSampling {
                uniform: u,
                ..RowSampling::new(&params)
            };
            let mut r = row;
            let (s, _) = sample_row(&mut r, &p, 0, &mut Scratch::new()).unwrap();
            assert_eq!(s.id, want, "u = {u}");
        }
    }
}
