//! What the routed experts' launches share (`moe.rs` runs prefill-sized steps, `moe_decode.rs`
//! decode-sized ones): the device tables of expert addresses, the experts' formats, the routing
//! (router logits, top-k, pairs grouped by expert), and the kept pair buffers of fused decode steps.

use cudarc::driver::CudaSlice;
use sanmai_model::backend::MoeWeights;

use super::tensor::{CudaTensor, CudaWeight};
use super::CudaBackend;
use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::ops::{
    moe_max_tiles, DecodeRouting, Experts, Fp8Experts, PackedScheme, RouteDims, Routed,
};

/// One set of device tables: each expert's gate|up and down address and, for packed and FP8
/// experts, their scale addresses.
pub(crate) struct Tables {
    pub gate_up: CudaSlice<u64>,
    pub down: CudaSlice<u64>,
    pub gate_up_scales: CudaSlice<u64>,
    pub down_scales: CudaSlice<u64>,
}

impl Tables {
    /// `addrs`: every expert's gate|up, then down, gate|up scales and down scales address.
    fn upload(gpu: &Gpu, addrs: &[u64]) -> Result<Self> {
        let e = addrs.len() / 4;
        Ok(Tables {
            gate_up: gpu.upload(&addrs[..e])?,
            down: gpu.upload(&addrs[e..2 * e])?,
            gate_up_scales: gpu.upload(&addrs[2 * e..3 * e])?,
            down_scales: gpu.upload(&addrs[3 * e..])?,
        })
    }

    /// The gate|up (`[2I, H]`) and down (`[H, I]`) projections of every expert as the grouped
    /// kernels take them, of formats `gu` and `dn`.
    pub(super) fn experts(
        &self,
        gu: ExpertFormat,
        dn: ExpertFormat,
        h: usize,
        inter: usize,
    ) -> (Experts<'_, CudaSlice<u64>>, Experts<'_, CudaSlice<u64>>) {
        (
            Experts {
                weights: &self.gate_up,
                scales: &self.gate_up_scales,
                scheme: gu.scheme(),
                n: 2 * inter,
                k: h,
            },
            Experts {
                weights: &self.down,
                scales: &self.down_scales,
                scheme: dn.scheme(),
                n: h,
                k: inter,
            },
        )
    }

    /// The gate|up (`[2I, H]`) and down (`[H, I]`) projections of every expert as the FP8 grouped
    /// kernels take them, with blocks of `gu` and `dn` columns.
    pub(super) fn fp8_experts(
        &self,
        (gu, dn): (usize, usize),
        h: usize,
        inter: usize,
    ) -> (
        Fp8Experts<'_, CudaSlice<u64>>,
        Fp8Experts<'_, CudaSlice<u64>>,
    ) {
        (
            Fp8Experts {
                bytes: &self.gate_up,
                scales: &self.gate_up_scales,
                group: gu,
                n: 2 * inter,
                k: h,
            },
            Fp8Experts {
                bytes: &self.down,
                scales: &self.down_scales,
                group: dn,
                n: h,
                k: inter,
            },
        )
    }

    fn bytes(&self) -> usize {
        8 * (self.gate_up.len()
            + self.down.len()
            + self.gate_up_scales.len()
            + self.down_scales.len())
    }
}

/// The device tables of one MoE layer: the routed experts', and, when the shared expert has their
/// formats and shapes ([`shared_fits`]), the same with the shared expert appended as expert `e` (the
/// fused decode launches, [`CudaBackend::moe_fuses_shared_impl`]).
pub(crate) struct ExpertTable {
    /// The addresses, as uploaded (to notice reloaded weights).
    host: Vec<u64>,
    pub routed: Tables,
    pub with_shared: Option<Tables>,
}

impl ExpertTable {
    pub fn bytes(&self) -> usize {
        self.routed.bytes() + self.with_shared.as_ref().map_or(0, Tables::bytes)
    }
}

/// Every expert's gate|up, down, gate|up scales and down scales address (scales 0 for bf16), the
/// shared expert last when `shared`.
fn addresses(gpu: &Gpu, w: &MoeWeights<CudaWeight>, shared: bool) -> Vec<u64> {
    let all: Vec<_> = w
        .experts
        .iter()
        .chain(w.shared.as_ref().filter(|_| shared))
        .collect();
    let gu = all.iter().map(|e| e.gate_up.address(gpu));
    let dn = all.iter().map(|e| e.down.address(gpu));
    let gus = all.iter().map(|e| e.gate_up.scales_address(gpu));
    let dns = all.iter().map(|e| e.down.scales_address(gpu));
    gu.chain(dn).chain(gus).chain(dns).collect()
}

/// How one projection of a layer's experts is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExpertFormat {
    Bf16,
    Packed { bits: u32, group_size: usize },
    Fp8 { group: usize },
}

impl ExpertFormat {
    /// The scheme as the bf16 and packed grouped kernels take it: `None` for bf16 (and FP8, which
    /// takes its own kernels).
    pub(super) fn scheme(self) -> Option<PackedScheme> {
        match self {
            Self::Bf16 | Self::Fp8 { .. } => None,
            Self::Packed { bits, group_size } => Some(PackedScheme { bits, group_size }),
        }
    }

    /// The block columns of FP8 experts.
    pub(super) fn fp8_group(self) -> Option<usize> {
        match self {
            Self::Fp8 { group } => Some(group),
            Self::Bf16 | Self::Packed { .. } => None,
        }
    }

    /// Whether the tensor-core grouped GEMM takes this projection with `k` inputs.
    pub(super) fn gemm_supports(self, k: usize) -> bool {
        match self {
            Self::Fp8 { group } => Gpu::moe_gemm_fp8_supports(group, k),
            _ => Gpu::moe_gemm_supports(self.scheme().map(|s| (s.bits, s.group_size)), k),
        }
    }
}

/// The routing dims of `t` rows through the router of `w`.
pub(super) fn route_dims(t: usize, w: &MoeWeights<CudaWeight>) -> RouteDims {
    RouteDims {
        tokens: t,
        experts: w.experts.len(),
        top_k: w.top_k,
        renormalize: w.renormalize,
    }
}

pub(super) fn format_of(w: &CudaWeight) -> ExpertFormat {
    match w {
        CudaWeight::Bf16(_) => ExpertFormat::Bf16,
        CudaWeight::Packed(p) => ExpertFormat::Packed {
            bits: p.bits,
            group_size: p.group_size,
        },
        CudaWeight::Fp8(f) => ExpertFormat::Fp8 { group: f.group },
    }
}

/// The router's choice of the `t` tokens (`ids`, `wts` `[t, k]` over `e` experts) for the combine.
pub(super) fn routing_of<'a>(
    ids: &'a CudaSlice<u32>,
    wts: &'a CudaSlice<f32>,
    (t, e, k): (usize, usize, usize),
) -> Routed<'a, CudaSlice<u32>, CudaSlice<f32>> {
    Routed {
        ids,
        weights: wts,
        experts: e,
        top_k: k,
        tokens: t,
    }
}

/// The one format of the experts' `what` projection, or an error when they mix formats.
pub(crate) fn expert_format<'a>(
    what: &str,
    mut ws: impl Iterator<Item = &'a CudaWeight>,
) -> Result<ExpertFormat> {
    let Some(first) = ws.next() else {
        return Ok(ExpertFormat::Bf16);
    };
    let f = format_of(first);
    match ws.map(format_of).find(|g| *g != f) {
        None => Ok(f),
        Some(other) => Err(CudaError::Shape {
            op: "moe",
            msg: format!(
                "the experts' {what} weights mix formats ({f:?} and {other:?}); every expert of a \
                 layer must share one scheme"
            ),
        }),
    }
}

/// A step's routing: ids and weights `[t, k]`, and the router's logits when they hold a shared
/// expert's gate logits after the experts' (the one-launch decode routing with a gate row).
pub(super) type Routing = (CudaSlice<u32>, CudaSlice<f32>, Option<CudaSlice<f32>>);

/// A step's routing grouped by expert for the grouped GEMV: `ids` and `wts` `[t, k]` as the router
/// writes them, `perm` and `tiles` as [`Gpu::moe_sort`] lays them out.
pub(super) struct Grouped {
    pub ids: CudaSlice<u32>,
    pub wts: CudaSlice<f32>,
    pub perm: CudaSlice<u32>,
    pub tiles: CudaSlice<u32>,
    /// The logits with the shared expert's gate at `[e]`, when it was asked for and computed.
    pub gate_logits: Option<CudaSlice<f32>>,
}

impl CudaBackend {
    /// The routing of the `t` rows of `x`: router logits (f32), then each row's top `k` ids and
    /// weights (`[t, k]`), in two launches.
    pub(super) fn route(
        &self,
        x: &CudaTensor,
        w: &MoeWeights<CudaWeight>,
    ) -> Result<(CudaSlice<u32>, CudaSlice<f32>)> {
        let (t, k) = (x.rows, w.top_k);
        let logits = self.linear_f32(x, &w.router)?;
        let mut ids = self.gpu.stream().alloc_zeros::<u32>(t * k)?;
        let mut wts = self.scratch::<f32>(t * k)?;
        self.gpu
            .route_topk(&logits, route_dims(t, w), &mut ids, &mut wts)?;
        Ok((ids, wts))
    }

    /// The routing of the `t` rows of `x` grouped by expert. A one-token step with a bf16 router
    /// ([`Gpu::moe_route_decode_fits`]) takes one launch (router GEMV, top-k and grouping; its ids,
    /// every one written, need no zeroing); other steps take [`CudaBackend::route`] and
    /// [`Gpu::moe_sort`]. Both give the same ids, weights and tiles for the same logits; the logits
    /// themselves differ between the two only in summation order. The one launch is kept to one token
    /// because that is where it wins: on an H200 at the 80B's router (512 × 2048, top 10) it takes
    /// 9.1 µs against the separate launches' 12.2 µs at t = 1, but 27.7 µs against 12.6 µs at t = 8,
    /// where the separate GEMV runs on tensor cores and one block routing eight tokens is the tail
    /// (`bench_moe_route_decode`).
    /// With `gate` (the shared expert's gate row) the one launch computes its logit too.
    pub(super) fn route_grouped(
        &self,
        x: &CudaTensor,
        w: &MoeWeights<CudaWeight>,
        gate: Option<&CudaSlice<half::bf16>>,
    ) -> Result<Grouped> {
        let n = x.rows * w.top_k;
        let mut perm = self.scratch::<u32>(n)?;
        let mut tiles = self.scratch::<u32>(3 * moe_max_tiles(n, w.experts.len()))?;
        let (ids, wts, gate_logits) = self.route_grouped_into(x, w, gate, &mut perm, &mut tiles)?;
        Ok(Grouped {
            ids,
            wts,
            perm,
            tiles,
            gate_logits,
        })
    }

    /// [`CudaBackend::route_grouped`] into the caller's `perm` (at least `t·k`) and `tiles` (at least
    /// `3 · moe_max_tiles(t·k, e)`), of which it writes exactly those heads; returns the ids and
    /// weights.
    pub(super) fn route_grouped_into(
        &self,
        x: &CudaTensor,
        w: &MoeWeights<CudaWeight>,
        gate: Option<&CudaSlice<half::bf16>>,
        perm: &mut CudaSlice<u32>,
        tiles: &mut CudaSlice<u32>,
    ) -> Result<Routing> {
        let g = &self.gpu;
        let (t, h, e, k) = (x.rows, x.cols, w.experts.len(), w.top_k);
        let n = t * k;
        if let CudaWeight::Bf16(router) = &w.router {
            if Gpu::moe_route_decode_fits(t, h, e, k) && router.shape == [e, h] {
                let mut logits = self.scratch::<f32>(t * e + usize::from(gate.is_some()))?;
                let mut ids = self.scratch::<u32>(n)?;
                let mut wts = self.scratch::<f32>(n)?;
                let mut ticket = self.ticket.lock().unwrap_or_else(|p| p.into_inner());
                let out = DecodeRouting {
                    logits: &mut logits,
                    ids: &mut ids,
                    weights: &mut wts,
                    perm,
                    tiles,
                };
                let dims = route_dims(t, w);
                g.moe_route_decode_gate(&router.data, gate, &x.buf, h, dims, out, &mut *ticket)?;
                return Ok((ids, wts, gate.map(|_| logits)));
            }
        }
        let (ids, wts) = self.route(x, w)?;
        g.moe_sort(&ids, n, e, perm, tiles)?;
        Ok((ids, wts, None))
    }

    /// The expert tables of `w`, built on first use (keyed by the first expert's address).
    pub(super) fn expert_table<'a>(
        &self,
        tables: &'a mut std::collections::HashMap<u64, ExpertTable>,
        w: &MoeWeights<CudaWeight>,
    ) -> Result<&'a ExpertTable> {
        let g = &self.gpu;
        let fits = shared_fits(w);
        // One address list (the shared expert last in each of its four parts when it fits); the
        // routed tables are the same parts without it.
        let addrs = addresses(g, w, fits);
        let key = addrs[0];
        let fresh = tables.get(&key).is_none_or(|t| t.host != addrs);
        if fresh {
            let per = addrs.len() / 4;
            let routed: Vec<u64> = addrs
                .chunks_exact(per)
                .flat_map(|part| &part[..w.experts.len()])
                .copied()
                .collect();
            let t = ExpertTable {
                routed: Tables::upload(g, &routed)?,
                with_shared: if fits {
                    Some(Tables::upload(g, &addrs)?)
                } else {
                    None
                },
                host: addrs,
            };
            tables.insert(key, t);
        }
        Ok(&tables[&key])
    }
}

/// The pair buffers of fused MoE steps of `t` tokens, `k` choices and `e` routed experts, kept from
/// step to step (graph replays point at them): `perm` `[t·k + t]` and `tiles`
/// `[moe_max_tiles(t·k + t, e + 1), 3]`. Their tails are written once: the shared expert's pairs
/// `t·k + j` (`perm[t·k + j] = t·k + j`) as one tile `(e, t·k, t)` right after the routed tiles, then
/// empty tiles; each step's routing rewrites the heads (`perm[..t·k]`, the first
/// `moe_max_tiles(t·k, e)` tiles).
pub(crate) struct FusedPairs {
    pub perm: CudaSlice<u32>,
    pub tiles: CudaSlice<u32>,
}

impl FusedPairs {
    pub(super) fn new(gpu: &Gpu, t: usize, k: usize, e: usize) -> Result<Self> {
        let (perm, tiles) = fused_pair_layout(t, k, e);
        Ok(FusedPairs {
            perm: gpu.upload(&perm)?,
            tiles: gpu.upload(&tiles)?,
        })
    }
}

/// The initial contents of [`FusedPairs`]: `perm` with the shared pairs' numbers in its tail, `tiles`
/// with the shared tile right after the routed tiles' `moe_max_tiles(t·k, e)` rows and empty tiles
/// after it; the grouped kernels' grid, `moe_max_tiles(t·k + t, e + 1)` rows, covers it.
fn fused_pair_layout(t: usize, k: usize, e: usize) -> (Vec<u32>, Vec<u32>) {
    let n = t * k;
    let perm = (0..n + t)
        .map(|p| if p < n { 0 } else { p as u32 })
        .collect();
    let mut tiles = vec![0u32; 3 * moe_max_tiles(n + t, e + 1)];
    let at = 3 * moe_max_tiles(n, e);
    tiles[at..at + 3].copy_from_slice(&[e as u32, n as u32, t as u32]);
    (perm, tiles)
}

/// Whether `w`'s shared expert can run as one more expert of its routed experts' grouped kernels:
/// it and its gate exist, with the first routed expert's formats and shapes (the loader gives every
/// routed expert of a layer one format).
pub(super) fn shared_fits(w: &MoeWeights<CudaWeight>) -> bool {
    match (&w.shared, &w.shared_gate, w.experts.first()) {
        (Some(s), Some(_), Some(x)) => {
            s.inter == x.inter
                && s.gate_up.shape() == x.gate_up.shape()
                && s.down.shape() == x.down.shape()
                && format_of(&s.gate_up) == format_of(&x.gate_up)
                && format_of(&s.down) == format_of(&x.down)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::MOE_TILE;

    #[test]
    fn the_shared_tile_follows_the_routed_tiles_inside_the_grid() {
        for (k, e) in [(10usize, 512usize), (8, 64), (2, 8), (1, 4), (4, 3)] {
            for t in 1..=MOE_TILE {
                let n = t * k;
                let (perm, tiles) = fused_pair_layout(t, k, e);
                assert_eq!(perm.len(), n + t);
                let shared: Vec<u32> = (n..n + t).map(|p| p as u32).collect();
                assert_eq!(perm[n..], shared[..], "t {t} k {k} e {e}");
                // The routing writes the first moe_max_tiles(n, e) tiles; the shared one comes next,
                // inside the grid of moe_max_tiles(n + t, e + 1) tiles, then only empty tiles.
                let at = moe_max_tiles(n, e);
                assert!(at < moe_max_tiles(n + t, e + 1), "t {t} k {k} e {e}");
                assert_eq!(tiles.len(), 3 * moe_max_tiles(n + t, e + 1));
                assert_eq!(tiles[3 * at..3 * at + 3], [e as u32, n as u32, t as u32]);
                assert!(tiles[3 * at + 3..].iter().all(|&v| v == 0));
            }
        }
    }
}
