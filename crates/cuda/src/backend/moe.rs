//! Routed experts on the device: router logits (f32), softmax top-k, the pairs grouped by expert, a
//! grouped GEMV for the experts' gate|up rows and one for their down rows (reading only the chosen
//! experts, through a device table of expert weight addresses built once per layer), SwiGLU between
//! them, and the weighted combine. No host round trip: the same launches serve decode and prefill,
//! except that a decode-sized step with a bf16 router does its routing (logits, top-k, grouping) in one
//! launch ([`Gpu::moe_route_decode`]) where larger steps take several.
//! Packed integer experts (each projection's experts all of one scheme) go through the packed grouped
//! GEMV, FP8 experts through the FP8 grouped GEMV, each with a second table of scale addresses;
//! prefill-sized steps of every format take the tensor-core grouped GEMM. A layer whose experts mix
//! formats is refused.

use cudarc::driver::CudaSlice;
use sanmai_model::backend::{MoeCall, MoeWeights, SharedExpert};

use super::tensor::{CudaTensor, CudaWeight};
use super::CudaBackend;
use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::ops::{
    moe_max_tiles, DecodeRouting, Experts, Fp8Experts, PackedScheme, PairGroups, PairRows,
    RouteDims, Routed, SharedY, MOE_TILE,
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
    fn experts(
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
    fn fp8_experts(
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
    routed: Tables,
    with_shared: Option<Tables>,
}

impl ExpertTable {
    pub fn bytes(&self) -> usize {
        self.routed.bytes() + self.with_shared.as_ref().map_or(0, Tables::bytes)
    }
}

/// The pair buffers of fused MoE steps of `t` tokens, `k` choices and `e` routed experts, kept from
/// step to step (graph replays point at them): `perm` `[t·k + t]` and `tiles`
/// `[moe_max_tiles(t·k + t, e + 1), 3]`. Their tails are written once: the shared expert's pairs
/// `t·k + j` (`perm[t·k + j] = t·k + j`) as one tile `(e, t·k, t)` right after the routed tiles, then
/// empty tiles; each step's routing rewrites the heads (`perm[..t·k]`, the first
/// `moe_max_tiles(t·k, e)` tiles).
pub(crate) struct FusedPairs {
    perm: CudaSlice<u32>,
    tiles: CudaSlice<u32>,
}

impl FusedPairs {
    fn new(gpu: &Gpu, t: usize, k: usize, e: usize) -> Result<Self> {
        let n = t * k;
        let perm: Vec<u32> = (0..n + t)
            .map(|p| if p < n { 0 } else { p as u32 })
            .collect();
        let mut tiles = vec![0u32; 3 * moe_max_tiles(n + t, e + 1)];
        let at = 3 * moe_max_tiles(n, e);
        tiles[at..at + 3].copy_from_slice(&[e as u32, n as u32, t as u32]);
        Ok(FusedPairs {
            perm: gpu.upload(&perm)?,
            tiles: gpu.upload(&tiles)?,
        })
    }
}

/// Whether `w`'s shared expert can run as one more expert of its routed experts' grouped kernels:
/// it and its gate exist, with the first routed expert's formats and shapes (the loader gives every
/// routed expert of a layer one format).
fn shared_fits(w: &MoeWeights<CudaWeight>) -> bool {
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
    fn scheme(self) -> Option<PackedScheme> {
        match self {
            Self::Bf16 | Self::Fp8 { .. } => None,
            Self::Packed { bits, group_size } => Some(PackedScheme { bits, group_size }),
        }
    }

    /// The block columns of FP8 experts.
    fn fp8_group(self) -> Option<usize> {
        match self {
            Self::Fp8 { group } => Some(group),
            Self::Bf16 | Self::Packed { .. } => None,
        }
    }

    /// Whether the tensor-core grouped GEMM takes this projection with `k` inputs.
    fn gemm_supports(self, k: usize) -> bool {
        match self {
            Self::Fp8 { group } => Gpu::moe_gemm_fp8_supports(group, k),
            _ => Gpu::moe_gemm_supports(self.scheme().map(|s| (s.bits, s.group_size)), k),
        }
    }
}

/// The routing dims of `t` rows through the router of `w`.
fn route_dims(t: usize, w: &MoeWeights<CudaWeight>) -> RouteDims {
    RouteDims {
        tokens: t,
        experts: w.experts.len(),
        top_k: w.top_k,
        renormalize: w.renormalize,
    }
}

fn format_of(w: &CudaWeight) -> ExpertFormat {
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
fn routing_of<'a>(
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

/// A step's routing grouped by expert for the grouped GEMV: `ids` and `wts` `[t, k]` as the router
/// writes them, `perm` and `tiles` as [`Gpu::moe_sort`] lays them out.
struct Grouped {
    ids: CudaSlice<u32>,
    wts: CudaSlice<f32>,
    perm: CudaSlice<u32>,
    tiles: CudaSlice<u32>,
}

impl CudaBackend {
    /// The routing of the `t` rows of `x`: router logits (f32), then each row's top `k` ids and
    /// weights (`[t, k]`), in two launches.
    fn route(
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
    fn route_grouped(&self, x: &CudaTensor, w: &MoeWeights<CudaWeight>) -> Result<Grouped> {
        let n = x.rows * w.top_k;
        let mut perm = self.scratch::<u32>(n)?;
        let mut tiles = self.scratch::<u32>(3 * moe_max_tiles(n, w.experts.len()))?;
        let (ids, wts) = self.route_grouped_into(x, w, &mut perm, &mut tiles)?;
        Ok(Grouped {
            ids,
            wts,
            perm,
            tiles,
        })
    }

    /// [`CudaBackend::route_grouped`] into the caller's `perm` (at least `t·k`) and `tiles` (at least
    /// `3 · moe_max_tiles(t·k, e)`), of which it writes exactly those heads; returns the ids and
    /// weights.
    fn route_grouped_into(
        &self,
        x: &CudaTensor,
        w: &MoeWeights<CudaWeight>,
        perm: &mut CudaSlice<u32>,
        tiles: &mut CudaSlice<u32>,
    ) -> Result<(CudaSlice<u32>, CudaSlice<f32>)> {
        let g = &self.gpu;
        let (t, h, e, k) = (x.rows, x.cols, w.experts.len(), w.top_k);
        let n = t * k;
        if let CudaWeight::Bf16(router) = &w.router {
            if Gpu::moe_route_decode_fits(t, h, e, k) && router.shape == [e, h] {
                let mut logits = self.scratch::<f32>(t * e)?;
                let mut ids = self.scratch::<u32>(n)?;
                let mut wts = self.scratch::<f32>(n)?;
                let mut ticket = self.route_ticket.lock().unwrap_or_else(|p| p.into_inner());
                let out = DecodeRouting {
                    logits: &mut logits,
                    ids: &mut ids,
                    weights: &mut wts,
                    perm,
                    tiles,
                };
                g.moe_route_decode(&router.data, &x.buf, h, route_dims(t, w), out, &mut *ticket)?;
                return Ok((ids, wts));
            }
        }
        let (ids, wts) = self.route(x, w)?;
        g.moe_sort(&ids, n, e, perm, tiles)?;
        Ok((ids, wts))
    }

    /// The expert tables of `w`, built on first use (keyed by the first expert's address).
    fn expert_table<'a>(
        &self,
        tables: &'a mut std::collections::HashMap<u64, ExpertTable>,
        w: &MoeWeights<CudaWeight>,
    ) -> Result<&'a ExpertTable> {
        let g = &self.gpu;
        let fits = shared_fits(w);
        let mut addrs = addresses(g, w, false);
        if fits {
            addrs.extend(addresses(g, w, true));
        }
        let key = addrs[0];
        let fresh = tables.get(&key).is_none_or(|t| t.host != addrs);
        if fresh {
            let routed_len = 4 * w.experts.len();
            let t = ExpertTable {
                routed: Tables::upload(g, &addrs[..routed_len])?,
                with_shared: if fits {
                    Some(Tables::upload(g, &addrs[routed_len..])?)
                } else {
                    None
                },
                host: addrs,
            };
            tables.insert(key, t);
        }
        Ok(&tables[&key])
    }

    /// [`Backend::moe_experts`](sanmai_model::Backend::moe_experts): the shared expert's output and
    /// gate, when given, are added in the combine.
    pub(crate) fn moe_impl(&self, c: &MoeCall<'_, CudaTensor, CudaWeight>) -> Result<CudaTensor> {
        let g = &self.gpu;
        let (x, w) = (c.x, c.w);
        let (t, h, e, k) = (x.rows, x.cols, w.experts.len(), w.top_k);
        let bad = |msg: String| CudaError::Shape { op: "moe", msg };
        if e == 0 {
            return Err(bad("no experts".into()));
        }
        if let Some(SharedExpert { y, gate }) = &c.shared {
            let ys = y.map_or((t, h), |y| (y.rows, y.cols));
            if (ys.0, ys.1, gate.rows, gate.cols) != (t, h, t, 1) {
                return Err(bad(format!(
                    "shared expert output {ys:?} and gate [{}, {}] for {t} rows of {h}",
                    gate.rows, gate.cols
                )));
            }
        }
        // A call without the shared expert's output leaves it to the fused launches.
        let fused = matches!(c.shared, Some(SharedExpert { y: None, .. }));
        if fused && !self.moe_fuses_shared_impl(w, t) {
            return Err(bad(format!(
                "the shared expert is not fused for this layer at {t} rows: its output is needed"
            )));
        }
        let shared = match &c.shared {
            Some(SharedExpert { y: Some(y), gate }) => Some((SharedY::Apart(&y.buf), &gate.buf)),
            Some(SharedExpert { y: None, gate }) => Some((SharedY::AfterRouted, &gate.buf)),
            None => None,
        };
        let inter = w.experts[0].inter;
        for ex in &w.experts {
            if ex.inter != inter
                || ex.gate_up.shape() != [2 * inter, h]
                || ex.down.shape() != [h, inter]
            {
                return Err(bad(
                    "experts must share one [2I, H] gate|up and [H, I] down shape".into(),
                ));
            }
        }
        let gu_format = expert_format("gate|up", w.experts.iter().map(|x| &x.gate_up))?;
        let dn_format = expert_format("down", w.experts.iter().map(|x| &x.down))?;
        let mut out = self.alloc(t, h)?;
        if t == 0 {
            return Ok(out);
        }
        let n = t * k;
        let fp8 = match (gu_format.fp8_group(), dn_format.fp8_group()) {
            (Some(gu), Some(dn)) => Some((gu, dn)),
            (None, None) => None,
            _ => {
                return Err(bad(format!(
                    "FP8 experts need both projections in FP8 (gate|up {gu_format:?}, down \
                     {dn_format:?})"
                )))
            }
        };
        // Prefill-sized steps take the tensor-core grouped GEMM (tiles of up to 64 pairs), decode steps
        // the grouped GEMV; the choice depends on the step's shape only.
        let gemm = Gpu::moe_gemm_wanted(t, n)
            && gu_format.gemm_supports(h)
            && dn_format.gemm_supports(inter);
        // The gate|up projection reads token rows, the down projection pair rows.
        let token_rows = PairRows {
            x: &x.buf,
            rows: t,
            div: k,
            tail: None,
        };
        if gemm {
            let (ids, wts) = self.route(x, w)?;
            self.log_routing(&ids, n, e)?;
            let mut perm = self.scratch::<u32>(n)?;
            let mut tiles = self.scratch::<u32>(3 * Gpu::moe_gemm_max_tiles(n, e))?;
            g.moe_gemm_plan(&ids, n, e, &mut perm, &mut tiles)?;
            let groups = PairGroups {
                perm: &perm,
                tiles: &tiles,
                n_pairs: n,
            };
            let mut st = self.lock();
            let table = self.expert_table(&mut st.experts, w)?;
            let mut gu = self.alloc(n, 2 * inter)?;
            match fp8 {
                Some(blocks) => {
                    let gate_up = table.routed.fp8_experts(blocks, h, inter).0;
                    g.moe_gemm_fp8(&gate_up, &token_rows, &groups, &mut gu.buf)?
                }
                None => {
                    let gate_up = table.routed.experts(gu_format, dn_format, h, inter).0;
                    g.moe_gemm(&gate_up, &token_rows, &groups, &mut gu.buf)?
                }
            }
            let mut act = self.alloc(n, inter)?;
            g.swiglu(&gu.buf, &mut act.buf, n, inter)?;
            let mut y = self.scratch::<f32>(n * h)?;
            let pair_rows = PairRows {
                x: &act.buf,
                rows: n,
                div: 1,
                tail: None,
            };
            match fp8 {
                Some(blocks) => {
                    let down = table.routed.fp8_experts(blocks, h, inter).1;
                    g.moe_gemm_fp8(&down, &pair_rows, &groups, &mut y)?
                }
                None => {
                    let down = table.routed.experts(gu_format, dn_format, h, inter).1;
                    g.moe_gemm(&down, &pair_rows, &groups, &mut y)?
                }
            }
            let routed = routing_of(&ids, &wts, (t, e, k));
            g.moe_combine(&routed, &y, shared, &mut out.buf, h)?;
            return Ok(out);
        }
        let step = GemvStep {
            formats: (gu_format, dn_format, fp8),
            fused,
            shared,
        };
        if !fused {
            return self.moe_gemv_step(c, &step, None, out);
        }
        // The fused step's pair buffers, taken out of the state for the step and put back after it.
        let key = (t, k, e);
        let kept = self.lock().fused_pairs.remove(&key);
        let mut pairs = match kept {
            Some(p) => p,
            None => FusedPairs::new(g, t, k, e)?,
        };
        let res = self.moe_gemv_step(c, &step, Some(&mut pairs), out);
        self.lock().fused_pairs.insert(key, pairs);
        res
    }

    /// Whether a call of `rows` rows on `w` takes the fused launches: they are on, the shared expert
    /// fits the routed experts' kernels ([`shared_fits`]), and the step keeps the grouped GEMV with
    /// the shared pairs in one tile (at most `MOE_TILE` rows).
    pub(crate) fn moe_fuses_shared_impl(&self, w: &MoeWeights<CudaWeight>, rows: usize) -> bool {
        self.fused_decode.load(std::sync::atomic::Ordering::Relaxed)
            && (1..=MOE_TILE).contains(&rows)
            && !Gpu::moe_gemm_wanted(rows, rows * w.top_k)
            && shared_fits(w)
    }

    /// The grouped-GEMV part of [`CudaBackend::moe_impl`] (decode-sized steps): routing grouped by
    /// expert, the gate|up GEMV over token rows, SwiGLU (fused into the INT4 down GEMV where it
    /// can), the down GEMV over pair rows, the combine. A fused step (`pairs`) routes into the kept
    /// pair buffers, whose shared tile makes both GEMVs compute the shared expert too (expert `e`
    /// of the tables `with_shared`, pairs `t·k + j` reading token row `j`), and the combine adds
    /// those rows times the gate's sigmoid.
    fn moe_gemv_step(
        &self,
        c: &MoeCall<'_, CudaTensor, CudaWeight>,
        step: &GemvStep<'_>,
        mut pairs: Option<&mut FusedPairs>,
        mut out: CudaTensor,
    ) -> Result<CudaTensor> {
        let g = &self.gpu;
        let (x, w) = (c.x, c.w);
        let (t, h, e, k) = (x.rows, x.cols, w.experts.len(), w.top_k);
        let (gu_format, dn_format, fp8) = step.formats;
        let inter = w.experts[0].inter;
        let n = t * k;
        let np = if step.fused { n + t } else { n };
        let (ids, wts, owned) = match pairs.as_deref_mut() {
            Some(p) => {
                let (ids, wts) = self.route_grouped_into(x, w, &mut p.perm, &mut p.tiles)?;
                (ids, wts, None)
            }
            None => {
                let gr = self.route_grouped(x, w)?;
                (gr.ids, gr.wts, Some((gr.perm, gr.tiles)))
            }
        };
        self.log_routing(&ids, n, e)?;
        let (perm, tiles) = match (&owned, pairs.as_deref()) {
            (Some((perm, tiles)), _) => (perm, tiles),
            (None, Some(p)) => (&p.perm, &p.tiles),
            (None, None) => unreachable!("a step routes into its own buffers or the kept ones"),
        };
        let groups = PairGroups {
            perm,
            tiles,
            n_pairs: np,
        };
        let routed = routing_of(&ids, &wts, (t, e, k));
        let mut st = self.lock();
        let table = self.expert_table(&mut st.experts, w)?;
        let tables = if step.fused {
            table.with_shared.as_ref().ok_or_else(|| CudaError::Shape {
                op: "moe",
                msg: "no shared-expert tables for a fused step".into(),
            })?
        } else {
            &table.routed
        };
        let token_rows = PairRows {
            x: &x.buf,
            rows: t,
            div: k,
            tail: step.fused.then_some(n),
        };
        let mut gu = self.alloc(np, 2 * inter)?;
        let mut y = self.scratch::<f32>(np * h)?;
        if let Some(blocks) = fp8 {
            let (gate_up, down) = tables.fp8_experts(blocks, h, inter);
            g.moe_gemv_fp8(&gate_up, &token_rows, &groups, &mut gu.buf)?;
            let mut act = self.alloc(np, inter)?;
            g.swiglu(&gu.buf, &mut act.buf, np, inter)?;
            let pair_rows = PairRows {
                x: &act.buf,
                rows: np,
                div: 1,
                tail: None,
            };
            g.moe_gemv_fp8(&down, &pair_rows, &groups, &mut y)?;
            g.moe_combine(&routed, &y, step.shared(), &mut out.buf, h)?;
            return Ok(out);
        }
        let (gate_up, down) = tables.experts(gu_format, dn_format, h, inter);
        match gu_format.scheme() {
            None => g.moe_gemv(&gate_up, &token_rows, &groups, &mut gu.buf)?,
            Some(_) => g.moe_gemv_packed(&gate_up, &token_rows, &groups, &mut gu.buf)?,
        }
        if let ExpertFormat::Packed { bits, group_size } = dn_format {
            if Gpu::moe_gemv_fuses_swiglu(bits, group_size, inter) {
                // The down GEMV computes silu(g) · u while staging its input: no activation launch.
                let gate_up_rows = PairRows {
                    x: &gu.buf,
                    rows: np,
                    div: 1,
                    tail: None,
                };
                g.moe_gemv_packed_swiglu(&down, &gate_up_rows, &groups, &mut y)?;
                g.moe_combine(&routed, &y, step.shared(), &mut out.buf, h)?;
                return Ok(out);
            }
        }
        let mut act = self.alloc(np, inter)?;
        g.swiglu(&gu.buf, &mut act.buf, np, inter)?;
        let pair_rows = PairRows {
            x: &act.buf,
            rows: np,
            div: 1,
            tail: None,
        };
        match dn_format.scheme() {
            None => g.moe_gemv(&down, &pair_rows, &groups, &mut y)?,
            Some(_) => g.moe_gemv_packed(&down, &pair_rows, &groups, &mut y)?,
        }
        g.moe_combine(&routed, &y, step.shared(), &mut out.buf, h)?;
        Ok(out)
    }
}

/// What [`CudaBackend::moe_gemv_step`] runs: the experts' formats (gate|up, down, and the FP8
/// blocks when both are FP8), whether the shared expert is fused, and the combine's shared part.
struct GemvStep<'a> {
    formats: (ExpertFormat, ExpertFormat, Option<(usize, usize)>),
    fused: bool,
    shared: Option<(SharedY<'a>, &'a CudaSlice<half::bf16>)>,
}

impl GemvStep<'_> {
    fn shared(&self) -> Option<(SharedY<'_>, &CudaSlice<half::bf16>)> {
        self.shared.as_ref().map(|(y, gate)| {
            let y = match y {
                SharedY::Apart(b) => SharedY::Apart(b),
                SharedY::AfterRouted => SharedY::AfterRouted,
            };
            (y, *gate)
        })
    }
}
