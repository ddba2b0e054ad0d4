//! Verifying draft tokens (speculative decoding).
//!
//! A verify step gives the target model's logits at the sequence's next position and after each of
//! its `K` draft tokens `d_1..d_K`: row `i` is the target's distribution `p_i` given the tokens before
//! it, drafts included. The drafts are the draft head's greedy picks, so the draft distribution
//! `q_i` is one-hot at `d_i`. Rejection sampling with such a `q` accepts `d_i` with probability
//! `min(1, p_i(d_i) / q_i(d_i)) = p_i(d_i)` and otherwise draws from the normalised `max(0, p_i − q_i)`,
//! which is `p_i` restricted to tokens other than `d_i`. Drawing `x` from `p_i` exactly as a step
//! without drafts would (the same masks, penalties, filters and the request's next uniform) and
//! accepting `d_i` exactly when `x == d_i` does both at once: `d_i` comes out with probability
//! `p_i(d_i)`, and a rejected row emits `x`, distributed as `p_i` given `x ≠ d_i`. So every emitted
//! token is the one the request would have drawn without drafts from the same uniform: greedy and
//! seeded requests give the same output with and without speculation, and the output distribution
//! is the target's.
//!
//! The rows are drawn in order and the drawing stops at the first rejection: rows past it are not
//! drawn, so they take no uniform from the request's stream (the next step draws those positions
//! again, after the emitted token). When every draft is accepted the last row's draw is the bonus
//! token.

/// What verifying one sequence's drafts emitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The emitted tokens: the accepted drafts, then the token drawn at the first rejected row (or,
    /// when all were accepted, the bonus token of the last row). Never empty.
    pub emitted: Vec<u32>,
    /// Drafts accepted (`emitted.len() − 1`).
    pub accepted: usize,
}

/// Verifies `drafts` against the target: `draw(i)` draws the token of verify row `i` (`0..=K`) as a
/// step without drafts would, given that rows `0..i` emitted `drafts[..i]` (the caller records each
/// emitted token before the next row is drawn: penalties and grammars read it). Stops at the first
/// draw that differs from its draft, or after the bonus row.
pub fn verify_drafts<E>(
    drafts: &[u32],
    mut draw: impl FnMut(usize) -> Result<u32, E>,
) -> Result<Verdict, E> {
    let mut emitted = Vec::with_capacity(drafts.len() + 1);
    for i in 0..=drafts.len() {
        let x = draw(i)?;
        emitted.push(x);
        if drafts.get(i) != Some(&x) {
            break;
        }
    }
    let accepted = emitted.len() - 1;
    Ok(Verdict { emitted, accepted })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::{sample_row, SamplerState, SamplingParams, Scratch};

    /// Target logits of a small vocabulary: the distribution at temperature 1 is softmax of these.
    const TARGET: [f32; 8] = [1.2, 0.3, -0.5, 2.0, 0.0, -1.5, 0.9, 0.4];
    /// The drafter's logits: a different distribution, so drafts are often wrong.
    const DRAFTER: [f32; 8] = [0.0, 1.5, 0.2, 0.1, -0.3, 0.8, 0.0, 1.1];
    const DRAWS: usize = 20_000;
    /// The chi-square bound for 7 degrees of freedom at p = 0.001.
    const CHI2_BOUND: f64 = 24.32;

    fn softmax(z: &[f32]) -> Vec<f64> {
        let m = z.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f64> = z.iter().map(|&x| ((x - m) as f64).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    fn chi2(counts: &[usize], p: &[f64]) -> f64 {
        let n: usize = counts.iter().sum();
        counts
            .iter()
            .zip(p)
            .map(|(&c, &q)| {
                let e = q * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    /// A draft from the drafter's distribution (its own uniform, not the request's).
    fn draft(rng: &mut crate::sampler::Rng) -> u32 {
        let q = softmax(&DRAFTER);
        let u = rng.next_f64();
        let mut acc = 0.0;
        for (i, w) in q.iter().enumerate() {
            acc += w;
            if u < acc {
                return i as u32;
            }
        }
        (q.len() - 1) as u32
    }

    /// The first emitted token of `DRAWS` verify steps of two drafts each (the target's distribution
    /// is the same at every position here), counted per token, with `verify` the rule under test.
    fn first_tokens(
        verify: impl Fn(&[u32], &mut dyn FnMut(usize) -> Result<u32, ()>) -> Verdict,
    ) -> (Vec<usize>, Vec<usize>) {
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..SamplingParams::greedy()
        };
        let mut state = SamplerState::new(&params, &[]);
        let mut drafter = crate::sampler::Rng::seeded(11);
        let mut scratch = Scratch::new();
        let (mut first, mut second) = (vec![0; TARGET.len()], vec![0; TARGET.len()]);
        for _ in 0..DRAWS {
            let drafts = [draft(&mut drafter), draft(&mut drafter)];
            let v = verify(&drafts, &mut |_| {
                let mut row = TARGET.to_vec();
                let s = sample_row(
                    &mut row,
                    TARGET.len(),
                    &params,
                    &mut state,
                    None,
                    &mut scratch,
                )
                .map_err(|_| ())?;
                Ok(s.id)
            });
            first[v.emitted[0] as usize] += 1;
            if v.emitted.len() > 1 {
                second[v.emitted[1] as usize] += 1;
            }
        }
        (first, second)
    }

    #[test]
    fn emitted_tokens_follow_the_target_distribution() {
        let p = softmax(&TARGET);
        let (first, second) = first_tokens(|d, draw| verify_drafts(d, draw).unwrap());
        let (c1, c2) = (chi2(&first, &p), chi2(&second, &p));
        assert!(
            c1 < CHI2_BOUND,
            "first emitted token: chi2 {c1:.1} {first:?}"
        );
        // The second token (after an accepted first draft) is the target's too.
        assert!(
            c2 < CHI2_BOUND,
            "second emitted token: chi2 {c2:.1} {second:?}"
        );
    }

    /// A broken rule, the classic one: a rejected draft is replaced by a fresh draw from the whole of
    /// `p` (the draft included) instead of `p` without the draft. The same test must catch it.
    #[test]
    fn the_test_catches_a_rejection_that_resamples_the_whole_target() {
        let p = softmax(&TARGET);
        let broken = |drafts: &[u32], draw: &mut dyn FnMut(usize) -> Result<u32, ()>| {
            let mut emitted = Vec::new();
            for (i, &d) in drafts.iter().enumerate() {
                // Accept with probability p(d): a draw equal to d.
                if draw(i).unwrap() == d {
                    emitted.push(d);
                    continue;
                }
                emitted.push(draw(i).unwrap());
                let accepted = emitted.len() - 1;
                return Verdict { emitted, accepted };
            }
            emitted.push(draw(drafts.len()).unwrap());
            Verdict {
                accepted: drafts.len(),
                emitted,
            }
        };
        let (first, _) = first_tokens(broken);
        let c = chi2(&first, &p);
        assert!(
            c > CHI2_BOUND,
            "the broken rule passed: chi2 {c:.1} {first:?}"
        );
    }

    #[test]
    fn greedy_rows_accept_exactly_the_matching_prefix() {
        let target = [5u32, 6, 7, 8];
        let v = verify_drafts(&[5, 6, 9], |i| Ok::<_, ()>(target[i])).unwrap();
        assert_eq!(
            v,
            Verdict {
                emitted: vec![5, 6, 7],
                accepted: 2
            }
        );
        let v = verify_drafts(&[5, 6, 7], |i| Ok::<_, ()>(target[i])).unwrap();
        assert_eq!(
            v,
            Verdict {
                emitted: vec![5, 6, 7, 8],
                accepted: 3
            }
        );
        let v = verify_drafts(&[1], |i| Ok::<_, ()>(target[i])).unwrap();
        assert_eq!(
            v,
            Verdict {
                emitted: vec![5],
                accepted: 0
            }
        );
        // No drafts: one row, one token.
        let v = verify_drafts(&[], |i| Ok::<_, ()>(target[i])).unwrap();
        assert_eq!(
            v,
            Verdict {
                emitted: vec![5],
                accepted: 0
            }
        );
        // Rows past the first rejection are not drawn.
        let mut drawn = Vec::new();
        verify_drafts(&[5, 0, 7], |i| {
            drawn.push(i);
            Ok::<_, ()>(target[i])
        })
        .unwrap();
        assert_eq!(drawn, [0, 1]);
    }

    /// The same seed gives the same tokens with drafts as without: each emitted token takes the
    /// request's next uniform, whatever the drafts were.
    #[test]
    fn seeded_draws_are_the_draws_without_drafts() {
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(3),
            ..SamplingParams::greedy()
        };
        let mut scratch = Scratch::new();
        let mut plain_state = SamplerState::new(&params, &[]);
        let plain: Vec<u32> = (0..400)
            .map(|_| {
                let mut row = TARGET.to_vec();
                sample_row(&mut row, 8, &params, &mut plain_state, None, &mut scratch)
                    .unwrap()
                    .id
            })
            .collect();
        let mut state = SamplerState::new(&params, &[]);
        let mut drafter = crate::sampler::Rng::seeded(5);
        let mut out = Vec::new();
        while out.len() < plain.len() {
            let drafts = [
                draft(&mut drafter),
                draft(&mut drafter),
                draft(&mut drafter),
            ];
            let v = verify_drafts(&drafts, |_| {
                let mut row = TARGET.to_vec();
                sample_row(&mut row, 8, &params, &mut state, None, &mut scratch).map(|s| s.id)
            })
            .unwrap();
            out.extend(v.emitted);
        }
        assert_eq!(out[..plain.len()], plain[..]);
    }
}
