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
    RouteDims, Routed,
};

/// The device tables of one MoE layer's expert weight addresses (bf16 values or packed words) and,
/// for packed experts, their scale addresses.
pub(crate) struct ExpertTable {
    /// The addresses, as uploaded (to notice reloaded weights).
    host: Vec<u64>,
    pub gate_up: CudaSlice<u64>,
    pub down: CudaSlice<u64>,
    pub gate_up_scales: CudaSlice<u64>,
    pub down_scales: CudaSlice<u64>,
}

impl ExpertTable {
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
    /// GEMV takes them, with blocks of `gu` and `dn` columns.
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

    pub fn bytes(&self) -> usize {
        8 * (self.gate_up.len()
            + self.down.len()
            + self.gate_up_scales.len()
            + self.down_scales.len())
    }
}

/// Every expert's gate|up, down, gate|up scales and down scales address (scales 0 for bf16).
fn addresses(gpu: &Gpu, w: &MoeWeights<CudaWeight>) -> Vec<u64> {
    let gu = w.experts.iter().map(|e| e.gate_up.address(gpu));
    let dn = w.experts.iter().map(|e| e.down.address(gpu));
    let gus = w.experts.iter().map(|e| e.gate_up.scales_address(gpu));
    let dns = w.experts.iter().map(|e| e.down.scales_address(gpu));
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
        let g = &self.gpu;
        let (t, h, e, k) = (x.rows, x.cols, w.experts.len(), w.top_k);
        let n = t * k;
        let mut perm = self.scratch::<u32>(n)?;
        let mut tiles = self.scratch::<u32>(3 * moe_max_tiles(n, e))?;
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
                    perm: &mut perm,
                    tiles: &mut tiles,
                };
                g.moe_route_decode(&router.data, &x.buf, h, route_dims(t, w), out, &mut *ticket)?;
                return Ok(Grouped {
                    ids,
                    wts,
                    perm,
                    tiles,
                });
            }
        }
        let (ids, wts) = self.route(x, w)?;
        g.moe_sort(&ids, n, e, &mut perm, &mut tiles)?;
        Ok(Grouped {
            ids,
            wts,
            perm,
            tiles,
        })
    }

    /// The expert tables of `w`, built on first use (keyed by the first expert's address).
    fn expert_table<'a>(
        &self,
        tables: &'a mut std::collections::HashMap<u64, ExpertTable>,
        w: &MoeWeights<CudaWeight>,
    ) -> Result<&'a ExpertTable> {
        let g = &self.gpu;
        let addrs = addresses(g, w);
        let key = addrs[0];
        let fresh = tables.get(&key).is_none_or(|t| t.host != addrs);
        if fresh {
            let e = w.experts.len();
            let t = ExpertTable {
                gate_up: g.upload(&addrs[..e])?,
                down: g.upload(&addrs[e..2 * e])?,
                gate_up_scales: g.upload(&addrs[2 * e..3 * e])?,
                down_scales: g.upload(&addrs[3 * e..])?,
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
            if (y.rows, y.cols, gate.rows, gate.cols) != (t, h, t, 1) {
                return Err(bad(format!(
                    "shared expert output [{}, {}] and gate [{}, {}] for {t} rows of {h}",
                    y.rows, y.cols, gate.rows, gate.cols
                )));
            }
        }
        let shared = c.shared.as_ref().map(|s| (&s.y.buf, &s.gate.buf));
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
                    let gate_up = table.fp8_experts(blocks, h, inter).0;
                    g.moe_gemm_fp8(&gate_up, &token_rows, &groups, &mut gu.buf)?
                }
                None => {
                    let gate_up = table.experts(gu_format, dn_format, h, inter).0;
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
            };
            match fp8 {
                Some(blocks) => {
                    let down = table.fp8_experts(blocks, h, inter).1;
                    g.moe_gemm_fp8(&down, &pair_rows, &groups, &mut y)?
                }
                None => {
                    let down = table.experts(gu_format, dn_format, h, inter).1;
                    g.moe_gemm(&down, &pair_rows, &groups, &mut y)?
                }
            }
            let routed = routing_of(&ids, &wts, (t, e, k));
            g.moe_combine(&routed, &y, shared, &mut out.buf, h)?;
            return Ok(out);
        }
        if let Some(blocks) = fp8 {
            return self.moe_fp8(c, blocks, shared, out);
        }
        let Grouped {
            ids,
            wts,
            perm,
            tiles,
        } = self.route_grouped(x, w)?;
        self.log_routing(&ids, n, e)?;
        let groups = PairGroups {
            perm: &perm,
            tiles: &tiles,
            n_pairs: n,
        };
        let routed = routing_of(&ids, &wts, (t, e, k));
        let mut st = self.lock();
        let table = self.expert_table(&mut st.experts, w)?;
        let (gate_up, down) = table.experts(gu_format, dn_format, h, inter);
        let mut gu = self.alloc(n, 2 * inter)?;
        // FP8 experts took `moe_fp8` above: bf16 or packed here.
        match gu_format.scheme() {
            None => g.moe_gemv(&gate_up, &token_rows, &groups, &mut gu.buf)?,
            Some(_) => g.moe_gemv_packed(&gate_up, &token_rows, &groups, &mut gu.buf)?,
        }
        let mut y = self.scratch::<f32>(n * h)?;
        if let ExpertFormat::Packed { bits, group_size } = dn_format {
            if Gpu::moe_gemv_fuses_swiglu(bits, group_size, inter) {
                // The down GEMV computes silu(g) · u while staging its input: no activation launch.
                let gate_up_rows = PairRows {
                    x: &gu.buf,
                    rows: n,
                    div: 1,
                };
                g.moe_gemv_packed_swiglu(&down, &gate_up_rows, &groups, &mut y)?;
                g.moe_combine(&routed, &y, shared, &mut out.buf, h)?;
                return Ok(out);
            }
        }
        let mut act = self.alloc(n, inter)?;
        g.swiglu(&gu.buf, &mut act.buf, n, inter)?;
        let pair_rows = PairRows {
            x: &act.buf,
            rows: n,
            div: 1,
        };
        match dn_format.scheme() {
            None => g.moe_gemv(&down, &pair_rows, &groups, &mut y)?,
            Some(_) => g.moe_gemv_packed(&down, &pair_rows, &groups, &mut y)?,
        }
        g.moe_combine(&routed, &y, shared, &mut out.buf, h)?;
        Ok(out)
    }

    /// [`CudaBackend::moe_impl`] for FP8 experts (both projections) on steps that keep the grouped
    /// GEMV: the grouped FP8 GEMV for gate|up (token rows) and down (pair rows), SwiGLU between them,
    /// then the combine.
    fn moe_fp8(
        &self,
        c: &MoeCall<'_, CudaTensor, CudaWeight>,
        groups_fp8: (usize, usize),
        shared: Option<(&CudaSlice<half::bf16>, &CudaSlice<half::bf16>)>,
        mut out: CudaTensor,
    ) -> Result<CudaTensor> {
        let g = &self.gpu;
        let (x, w) = (c.x, c.w);
        let (t, h, e, k) = (x.rows, x.cols, w.experts.len(), w.top_k);
        let inter = w.experts[0].inter;
        let n = t * k;
        let Grouped {
            ids,
            wts,
            perm,
            tiles,
        } = self.route_grouped(x, w)?;
        self.log_routing(&ids, n, e)?;
        let groups = PairGroups {
            perm: &perm,
            tiles: &tiles,
            n_pairs: n,
        };
        let routed = routing_of(&ids, &wts, (t, e, k));
        let mut st = self.lock();
        let table = self.expert_table(&mut st.experts, w)?;
        let (gate_up, down) = table.fp8_experts(groups_fp8, h, inter);
        let token_rows = PairRows {
            x: &x.buf,
            rows: t,
            div: k,
        };
        let mut gu = self.alloc(n, 2 * inter)?;
        g.moe_gemv_fp8(&gate_up, &token_rows, &groups, &mut gu.buf)?;
        let mut act = self.alloc(n, inter)?;
        g.swiglu(&gu.buf, &mut act.buf, n, inter)?;
        let pair_rows = PairRows {
            x: &act.buf,
            rows: n,
            div: 1,
        };
        let mut y = self.scratch::<f32>(n * h)?;
        g.moe_gemv_fp8(&down, &pair_rows, &groups, &mut y)?;
        g.moe_combine(&routed, &y, shared, &mut out.buf, h)?;
        Ok(out)
    }
}
