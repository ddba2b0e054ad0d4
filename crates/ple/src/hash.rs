//! The row-index hash of spec §3: context cleaning at document boundaries, SplitMix64 multipliers,
//! the order-n XOR mix of wrapping i64 products, and `mix mod P` with the divisor's sign. Every path
//! (gather, prefetch, the model, `sanmai ple hash`) goes through [`PleHasher::fill_indices`].

use crate::error::PleError;
use sanmai_config::PleConfig;
use std::ops::Range;

/// The first `n` outputs of the standard SplitMix64 generator started at state `seed`.
pub fn splitmix64_outputs(seed: u64, n: usize) -> Vec<u64> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        })
        .collect()
}

/// Precomputed multipliers and sizes for one `ple` config.
#[derive(Debug, Clone)]
pub struct PleHasher {
    orders: Vec<usize>,
    heads: usize,
    /// `m_k = splitmix64_k(seed) | 1` as i64.
    mults: Vec<i64>,
    /// Sub-table sizes in (order, head) order.
    sizes: Vec<i64>,
    eos: i64,
}

impl PleHasher {
    /// Builds the hasher for a config with its own table sizes.
    pub fn new(cfg: &PleConfig) -> Self {
        Self::with_sizes(cfg, &cfg.flat_sizes()).expect("config sizes match their own shape")
    }

    /// Builds the hasher for a config with other sizes (a table written with `--rows-scale`).
    pub fn with_sizes(cfg: &PleConfig, sizes: &[u64]) -> Result<Self, PleError> {
        if sizes.len() != cfg.num_tables() {
            return Err(PleError::Input(format!(
                "{} table sizes for {} sub-tables",
                sizes.len(),
                cfg.num_tables()
            )));
        }
        let max_order = cfg.orders.iter().copied().max().unwrap_or(0);
        let mults = splitmix64_outputs(cfg.seed, max_order)
            .into_iter()
            .map(|x| (x | 1) as i64)
            .collect();
        let sizes = sizes
            .iter()
            .map(|&p| {
                i64::try_from(p)
                    .ok()
                    .filter(|&p| p > 0)
                    .ok_or_else(|| PleError::Input(format!("table size {p} out of range")))
            })
            .collect::<Result<_, _>>()?;
        Ok(PleHasher {
            orders: cfg.orders.clone(),
            heads: cfg.heads,
            mults,
            sizes,
            eos: cfg.eos_token_id,
        })
    }

    /// The multipliers `m_0..m_{max order − 1}`.
    pub fn multipliers(&self) -> &[i64] {
        &self.mults
    }

    /// Rows gathered per token (`len(orders) · heads`).
    pub fn num_tables(&self) -> usize {
        self.sizes.len()
    }

    /// For each position `t` in `positions`, writes the row index inside each sub-table ((order,
    /// head) order, `num_tables()` per position) into `out`. `tokens` (any integer id type) is the whole sequence up to at
    /// least `positions.end`, so the context of every position is visible; the document boundary is
    /// the last `eos_token_id` at or before `t`, and positions before it or before 0 read as EOS.
    pub fn fill_indices<T: Copy + Into<i64>>(
        &self,
        tokens: &[T],
        positions: Range<usize>,
        out: &mut [u64],
    ) -> Result<(), PleError> {
        let nt = self.num_tables();
        if positions.end > tokens.len() || positions.start > positions.end {
            return Err(PleError::Input(format!(
                "positions {positions:?} outside a sequence of {} tokens",
                tokens.len()
            )));
        }
        if out.len() != positions.len() * nt {
            return Err(PleError::Input(format!(
                "output holds {} indices, {} positions need {}",
                out.len(),
                positions.len(),
                positions.len() * nt
            )));
        }
        let max_order = self.mults.len();
        // Last EOS strictly before positions.start (as a signed position; -1 = none). Only the
        // max_order − 1 positions before the start can fall inside an n-gram, so an EOS further
        // back cleans nothing and the scan stops there (decode stays O(order) per token).
        let lo = positions.start.saturating_sub(max_order.saturating_sub(1));
        let mut last_eos: i64 = tokens[lo..positions.start]
            .iter()
            .rposition(|&x| x.into() == self.eos)
            .map_or(-1, |p| (lo + p) as i64);
        let mut ctx = vec![0i64; max_order];
        for (i, t) in positions.enumerate() {
            if tokens[t].into() == self.eos {
                last_eos = t as i64;
            }
            // ctx[j] = cleaned c_{t-j}
            for (j, c) in ctx.iter_mut().enumerate() {
                let p = t as i64 - j as i64;
                *c = if p < 0 || p < last_eos {
                    self.eos
                } else {
                    tokens[p as usize].into()
                };
            }
            let row = &mut out[i * nt..(i + 1) * nt];
            for (o, &n) in self.orders.iter().enumerate() {
                let mix = ctx[..n]
                    .iter()
                    .zip(&self.mults)
                    .fold(0i64, |acc, (&c, &m)| acc ^ c.wrapping_mul(m));
                for h in 0..self.heads {
                    let k = o * self.heads + h;
                    row[k] = mix.rem_euclid(self.sizes[k]) as u64;
                }
            }
        }
        Ok(())
    }

    /// Convenience over [`Self::fill_indices`]: the indices of every position of `tokens`.
    pub fn indices<T: Copy + Into<i64>>(&self, tokens: &[T]) -> Vec<u64> {
        let mut out = vec![0u64; tokens.len() * self.num_tables()];
        self.fill_indices(tokens, 0..tokens.len(), &mut out)
            .expect("whole-sequence ranges are valid");
        out
    }
}
