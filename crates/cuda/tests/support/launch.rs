//! One-line builders of the grouped expert launches' arguments ([`Experts`], [`PairRows`],
//! [`PairGroups`]), shared by the parity and packed tests.

use half::bf16;
use sanmai_cuda::cudarc::driver::DevicePtr;
use sanmai_cuda::{Experts, PackedScheme, PairGroups, PairRows};

/// A packed scheme of `bits` with groups of `group_size` values (0: one scale per row).
pub fn packed_scheme(bits: u32, group_size: usize) -> Option<PackedScheme> {
    Some(PackedScheme { bits, group_size })
}

/// One projection of every expert, `[n, k]` each, through the address tables `weights` and `scales`.
pub fn expert_proj<'a, P: DevicePtr<u64>>(
    weights: &'a P,
    scales: &'a P,
    scheme: Option<PackedScheme>,
    n: usize,
    k: usize,
) -> Experts<'a, P> {
    Experts {
        weights,
        scales,
        scheme,
        n,
        k,
    }
}

/// The rows `x` `[rows, ·]` the pairs read, pair `p` reading row `p / div`.
pub fn pair_rows<X: DevicePtr<bf16>>(x: &X, rows: usize, div: usize) -> PairRows<'_, X> {
    PairRows {
        x,
        rows,
        div,
        tail: None,
    }
}

/// The pairs grouped by expert: the sort's `perm` and `tiles` over `n_pairs` pairs.
pub fn pair_groups<'a, U: DevicePtr<u32>>(
    perm: &'a U,
    tiles: &'a U,
    n_pairs: usize,
) -> PairGroups<'a, U> {
    PairGroups {
        perm,
        tiles,
        n_pairs,
    }
}
