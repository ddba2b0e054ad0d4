//! The decode-sized half of the routed experts (`moe.rs` has the routing, the tables and the prefill
//! GEMM): the grouped GEMVs, and the fused decode launches, in which a MoE layer's shared expert
//! runs as one more expert of its routed experts' GEMVs (and, at one row, its gate as one more
//! router row), so a decode step's shared expert takes no launch of its own. A shared expert of
//! another format than the routed experts' (the INT6 shared expert beside INT4 experts) still has
//! its gate computed as one more router row at one row.

use cudarc::driver::CudaSlice;
use sanmai_model::backend::{MoeCall, MoeWeights, SharedFusion};

use super::moe_tables::{routing_of, shared_fits, ExpertFormat, FusedPairs};
use super::norm_after::NormAfter;
use super::tensor::{CudaTensor, CudaWeight};
use super::CudaBackend;
use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::ops::{PairGroups, PairRows, SharedGate, SharedY, SWIGLU_FUSED_MAX_PAIRS};

/// Most rows of a step whose shared expert runs in the routed experts' grouped GEMVs. The shared
/// pairs form one tile, which one block walks pair after pair, while the unfused shared expert is a
/// dense GEMV over all rows at once; measured on an H200 with the shared expert fused up to 8 rows
/// (80B FP8, `sanmai bench --fused-decode` against `--no-fused-decode`, before the gate and the FP8
/// SwiGLU were fused too): 206.4 against 184.3 tok/s at batch 1, 489 against 477 at batch 4, but 634
/// against 668 at batch 8.
const FUSED_MAX_ROWS: usize = 4;

impl CudaBackend {
    /// The decode-sized part of [`CudaBackend::moe_impl`]: [`CudaBackend::moe_gemv_step`], a fused
    /// step with its kept pair buffers (taken out of the state for the step, put back after it).
    pub(super) fn moe_decode(
        &self,
        c: &MoeCall<'_, CudaTensor, CudaWeight>,
        step: &GemvStep<'_>,
        out: CudaTensor,
        after: Option<NormAfter<'_>>,
    ) -> Result<CudaTensor> {
        if !step.fused {
            return self.moe_gemv_step(c, step, None, out, after);
        }
        let key = (c.x.rows, c.w.top_k, c.w.experts.len());
        let kept = self.lock().fused_pairs.remove(&key);
        let mut pairs = match kept {
            Some(p) => p,
            None => FusedPairs::new(&self.gpu, key.0, key.1, key.2)?,
        };
        let res = self.moe_gemv_step(c, step, Some(&mut pairs), out, after);
        self.lock().fused_pairs.insert(key, pairs);
        res
    }

    /// What a call of `rows` rows on `w` fuses, with the fused launches on: the shared expert where
    /// it fits the routed experts' kernels ([`shared_fits`]) and the step is at most
    /// [`FUSED_MAX_ROWS`] rows (so it keeps the grouped GEMV, the shared pairs in one tile); the gate
    /// where the step takes the one-launch decode routing (one row, a bf16 router) and the gate is a
    /// bf16 row, whether or not the shared expert is fused.
    pub(crate) fn moe_fuses_shared_impl(
        &self,
        w: &MoeWeights<CudaWeight>,
        rows: usize,
    ) -> SharedFusion {
        if !self
            .switches
            .fused_decode
            .load(std::sync::atomic::Ordering::Relaxed)
            || Gpu::moe_gemm_wanted(rows, rows * w.top_k)
        {
            return SharedFusion::Apart;
        }
        if w.shared.is_some() && self.moe_layer_takes(w, rows) {
            return SharedFusion::ExpertAndGate;
        }
        let expert = (1..=FUSED_MAX_ROWS).contains(&rows) && shared_fits(w);
        let gate = match (&w.router, &w.shared_gate) {
            (CudaWeight::Bf16(r), Some(CudaWeight::Bf16(g))) => {
                rows == 1
                    && r.shape.len() == 2
                    && g.shape == [1, r.shape[1]]
                    && r.shape[0] == w.experts.len()
                    && Gpu::moe_route_decode_fits(1, r.shape[1], w.experts.len(), w.top_k)
            }
            _ => false,
        };
        match (expert, gate) {
            (true, true) => SharedFusion::ExpertAndGate,
            (true, false) => SharedFusion::Expert,
            (false, true) => SharedFusion::Gate,
            (false, false) => SharedFusion::Apart,
        }
    }

    /// The grouped-GEMV part of [`CudaBackend::moe_impl`] (decode-sized steps): routing grouped by
    /// expert, the gate|up GEMV over token rows, SwiGLU (fused into the INT4 down GEMV where it
    /// can), the down GEMV over pair rows, the combine. A fused step (`pairs`) routes into the kept
    /// pair buffers, whose shared tile makes both GEMVs compute the shared expert too (expert `e`
    /// of the tables `with_shared`, pairs `t·k + j` reading token row `j`), and the combine adds
    /// those rows times the gate's sigmoid.
    pub(super) fn moe_gemv_step(
        &self,
        c: &MoeCall<'_, CudaTensor, CudaWeight>,
        step: &GemvStep<'_>,
        mut pairs: Option<&mut FusedPairs>,
        out: CudaTensor,
        after: Option<NormAfter<'_>>,
    ) -> Result<CudaTensor> {
        let g = &self.gpu;
        let (x, w) = (c.x, c.w);
        let (t, h, e, k) = (x.rows, x.cols, w.experts.len(), w.top_k);
        let (gu_format, dn_format, fp8) = step.formats;
        let inter = w.experts[0].inter;
        let n = t * k;
        let np = if step.fused { n + t } else { n };
        // The gate's row, when the routing computes its logits (`logits[e]`).
        let gate_row = match (&step.shared, &w.shared_gate) {
            (Some((_, None)), Some(CudaWeight::Bf16(gw))) => Some(&gw.data),
            _ => None,
        };
        let (ids, wts, gate_logits, owned) = match pairs.as_deref_mut() {
            Some(p) => {
                let (ids, wts, logits) =
                    self.route_grouped_into(x, w, gate_row, &mut p.perm, &mut p.tiles)?;
                (ids, wts, logits, None)
            }
            None => {
                let gr = self.route_grouped(x, w, gate_row)?;
                (gr.ids, gr.wts, gr.gate_logits, Some((gr.perm, gr.tiles)))
            }
        };
        if step.shared.as_ref().is_some_and(|(_, g)| g.is_none()) && gate_logits.is_none() {
            return Err(CudaError::Shape {
                op: "moe",
                msg: "the routing did not compute the shared expert's gate".into(),
            });
        }
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
        match fp8 {
            Some(blocks) => {
                let gate_up = tables.fp8_experts(blocks, h, inter).0;
                g.moe_gemv_fp8(&gate_up, &token_rows, &groups, &mut gu.buf)?
            }
            None => {
                let gate_up = tables.experts(gu_format, dn_format, h, inter).0;
                match gu_format.scheme() {
                    None => g.moe_gemv(&gate_up, &token_rows, &groups, &mut gu.buf)?,
                    Some(_) => g.moe_gemv_packed(&gate_up, &token_rows, &groups, &mut gu.buf)?,
                }
            }
        }
        // The down GEMV computes silu(g) · u while staging its input where it can (INT4 on tensor
        // cores up to SWIGLU_FUSED_MAX_PAIRS pairs; FP8 in fused steps): no activation launch.
        let fuse_swiglu = match (fp8, dn_format) {
            (Some(_), _) => step.fused && Gpu::moe_gemv_fp8_fuses_swiglu(inter),
            (None, ExpertFormat::Packed { bits, group_size }) => {
                np <= SWIGLU_FUSED_MAX_PAIRS && Gpu::moe_gemv_fuses_swiglu(bits, group_size, inter)
            }
            (None, _) => false,
        };
        let act = if fuse_swiglu {
            None
        } else {
            let mut act = self.alloc(np, inter)?;
            g.swiglu(&gu.buf, &mut act.buf, np, inter)?;
            Some(act)
        };
        let down_rows = PairRows {
            x: act.as_ref().map_or(&gu.buf, |a| &a.buf),
            rows: np,
            div: 1,
            tail: None,
        };
        let mut y = self.scratch::<f32>(np * h)?;
        match (fp8, fuse_swiglu) {
            (Some(blocks), true) => {
                let down = tables.fp8_experts(blocks, h, inter).1;
                g.moe_gemv_fp8_swiglu(&down, &down_rows, &groups, &mut y)?
            }
            (Some(blocks), false) => {
                let down = tables.fp8_experts(blocks, h, inter).1;
                g.moe_gemv_fp8(&down, &down_rows, &groups, &mut y)?
            }
            (None, true) => {
                let down = tables.experts(gu_format, dn_format, h, inter).1;
                g.moe_gemv_packed_swiglu(&down, &down_rows, &groups, &mut y)?
            }
            (None, false) => {
                let down = tables.experts(gu_format, dn_format, h, inter).1;
                match dn_format.scheme() {
                    None => g.moe_gemv(&down, &down_rows, &groups, &mut y)?,
                    Some(_) => g.moe_gemv_packed(&down, &down_rows, &groups, &mut y)?,
                }
            }
        }
        let shared = step.shared(gate_logits.as_ref(), e);
        self.combine(&routed, &y, shared, after, out)
    }
}

/// What [`CudaBackend::moe_gemv_step`] runs: the experts' formats (gate|up, down, and the FP8
/// blocks when both are FP8), whether the shared expert is fused, and the combine's shared part.
pub(super) struct GemvStep<'a> {
    pub formats: (ExpertFormat, ExpertFormat, Option<(usize, usize)>),
    pub fused: bool,
    /// The shared expert's output and gate logits (`None`: the routing computes them).
    pub shared: Option<(SharedY<'a>, Option<&'a CudaSlice<half::bf16>>)>,
}

impl GemvStep<'_> {
    /// The combine's shared part, the gate from `logits[at..]` when the routing computed it.
    fn shared<'b>(
        &'b self,
        logits: Option<&'b CudaSlice<f32>>,
        at: usize,
    ) -> Option<(SharedY<'b>, SharedGate<'b>)> {
        let (y, gate) = self.shared.as_ref()?;
        let y = match y {
            SharedY::Apart(b) => SharedY::Apart(b),
            SharedY::AfterRouted => SharedY::AfterRouted,
        };
        let gate = match (gate, logits) {
            (Some(g), _) => SharedGate::Bf16(g),
            (None, Some(logits)) => SharedGate::F32 { logits, at },
            (None, None) => return None,
        };
        Some((y, gate))
    }
}
