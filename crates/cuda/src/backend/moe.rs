//! Routed experts on the device ([`CudaBackend::moe_impl`]): router logits (f32), softmax top-k, the
//! pairs grouped by expert, the experts' gate|up and down projections (reading only the chosen
//! experts, through device tables of their addresses built once per layer, `moe_tables.rs`), SwiGLU
//! between them, and the weighted combine. No host round trip: the same launches serve decode and
//! prefill. Prefill-sized steps take the tensor-core grouped GEMM (here), decode-sized ones the
//! grouped GEMVs and, where they fit, the fused launches that run the shared expert with the routed
//! ones (`moe_decode.rs`). Packed integer experts (each projection's experts all of one scheme) and
//! FP8 experts carry a second table of scale addresses; a layer whose experts mix formats is refused.

use std::sync::atomic::Ordering;

use cudarc::driver::CudaSlice;
use sanmai_model::backend::{MoeCall, SharedExpert, SharedFusion};

use super::moe_decode::GemvStep;
use super::moe_tables::{expert_format, routing_of};
use super::norm_after::NormAfter;
use super::tensor::{CudaTensor, CudaWeight};
use super::CudaBackend;
use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::ops::{PairGroups, PairRows, Routed, SharedGate, SharedY};

impl CudaBackend {
    /// The combine that ends a MoE call: the rows into `out`, or (`after`) their add to the residual
    /// and the norm into `out`; returns `out`.
    pub(super) fn combine(
        &self,
        routed: &Routed<'_, CudaSlice<u32>, CudaSlice<f32>>,
        y: &CudaSlice<f32>,
        shared: Option<(SharedY<'_>, SharedGate<'_>)>,
        after: Option<NormAfter<'_>>,
        mut out: CudaTensor,
    ) -> Result<CudaTensor> {
        let h = out.cols;
        self.gpu.moe_combine(
            routed,
            y,
            shared,
            NormAfter::combine_into(after, &mut out),
            h,
        )?;
        Ok(out)
    }

    /// [`Backend::moe_experts_add_rms_norm`](sanmai_model::Backend::moe_experts_add_rms_norm): with
    /// the fused decode launches on, the combine adds to the residual and norms in its own launch
    /// (the same bits as the combine, then `add_rms_norm`).
    pub(crate) fn moe_add_rms_norm_impl(
        &self,
        c: &MoeCall<'_, CudaTensor, CudaWeight>,
        acc: &mut CudaTensor,
        w: &CudaWeight,
        eps: f32,
        offset: f32,
    ) -> Result<CudaTensor> {
        if !self.switches.fused_decode.load(Ordering::Relaxed) {
            let y = self.moe_impl(c, None)?;
            return self.add_rms_norm_impl(acc, &y, w, eps, offset);
        }
        let after = NormAfter::for_rows(acc, c.x, w, eps, offset)?;
        self.moe_impl(c, Some(after))
    }

    /// [`Backend::moe_experts`](sanmai_model::Backend::moe_experts): the shared expert's output and
    /// gate, when given, are added in the combine; with `after`, the combine's rows are added to the
    /// residual and the norm of it is returned instead.
    pub(super) fn moe_impl(
        &self,
        c: &MoeCall<'_, CudaTensor, CudaWeight>,
        after: Option<NormAfter<'_>>,
    ) -> Result<CudaTensor> {
        let g = &self.gpu;
        let (x, w) = (c.x, c.w);
        let (t, h, e, k) = (x.rows, x.cols, w.experts.len(), w.top_k);
        let bad = |msg: String| CudaError::Shape { op: "moe", msg };
        if e == 0 {
            return Err(bad("no experts".into()));
        }
        if let Some(SharedExpert { y, gate }) = &c.shared {
            let ys = y.map_or((t, h), |y| (y.rows, y.cols));
            let gs = gate.map_or((t, 1), |g| (g.rows, g.cols));
            if (ys, gs) != ((t, h), (t, 1)) {
                return Err(bad(format!(
                    "shared expert output {ys:?} and gate {gs:?} for {t} rows of {h}"
                )));
            }
        }
        // A call without the shared expert's output (and gate logits) leaves them to the fused
        // launches; check that this layer and step take them.
        let (fused, gate_folded) = match &c.shared {
            Some(SharedExpert { y, gate }) => (y.is_none(), gate.is_none()),
            None => (false, false),
        };
        let fusion = self.moe_fuses_shared_impl(w, t);
        let takes = match (fused, gate_folded) {
            (false, false) => true,
            (true, false) => fusion != SharedFusion::Apart,
            (true, true) => fusion == SharedFusion::ExpertAndGate,
            (false, true) => fusion == SharedFusion::Gate,
        };
        if !takes {
            return Err(bad(format!(
                "the shared expert's output or gate is missing, and this layer's step of {t} rows \
                 computes {fusion:?}"
            )));
        }
        let shared = c.shared.as_ref().map(|SharedExpert { y, gate }| {
            let y = match y {
                Some(y) => SharedY::Apart(&y.buf),
                None => SharedY::AfterRouted,
            };
            (y, gate.map(|g| &g.buf))
        });
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
        if (c.shared.is_none() || (fused && gate_folded)) && self.moe_layer_takes(w, t) {
            return self.moe_layer_step(c, after);
        }
        let gu_format = expert_format("gate|up", w.experts.iter().map(|x| &x.gate_up))?;
        let dn_format = expert_format("down", w.experts.iter().map(|x| &x.down))?;
        let out = self.alloc(t, h)?;
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
                    self.moe_gemm_fp8_gate_up(&gate_up, &token_rows, &groups, &mut gu.buf)?
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
                    self.moe_gemm_fp8_down(&down, &pair_rows, &groups, &mut y)?
                }
                None => {
                    let down = table.routed.experts(gu_format, dn_format, h, inter).1;
                    g.moe_gemm(&down, &pair_rows, &groups, &mut y)?
                }
            }
            let routed = routing_of(&ids, &wts, (t, e, k));
            let shared = shared.map(|(y, gate)| (y, gate.map(SharedGate::Bf16)));
            let shared = match shared {
                Some((y, Some(gate))) => Some((y, gate)),
                Some((_, None)) => return Err(bad("a prefill step without the gate".into())),
                None => None,
            };
            return self.combine(&routed, &y, shared, after, out);
        }
        let step = GemvStep {
            formats: (gu_format, dn_format, fp8),
            fused,
            shared,
        };
        self.moe_decode(c, &step, out, after)
    }
}
