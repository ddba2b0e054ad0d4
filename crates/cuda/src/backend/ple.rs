//! The PLE mix on the device (spec §3.7): the value and per-stream key projections as f32 linears,
//! the per-stream gate and normed conv input (one kernel per stream), then per sequence the dilated
//! causal conv over its state slot's PLE state and the residual update. Not recorded into CUDA graphs
//! (the state slots are host-side launch arguments; see `CudaBackend::refuse_capture`).

use sanmai_model::backend::{PleShape, PleWeights, SeqChunk};

use super::cache::ple_len;
use super::tensor::{CudaTensor, CudaWeight};
use super::CudaBackend;
use crate::error::{CudaError, Result};
use crate::ops::{PleDims, PleGateWeights};

impl CudaBackend {
    pub(crate) fn ple_impl(
        &self,
        layer: usize,
        sh: &PleShape,
        streams: &mut CudaTensor,
        rows: &CudaTensor,
        w: &PleWeights<CudaWeight>,
        seqs: &[SeqChunk<'_>],
    ) -> Result<()> {
        self.refuse_capture("ple_mix")?;
        let g = &self.gpu;
        let (ns, h, e) = (sh.streams, sh.hidden, sh.row_width);
        let sc = ns * h;
        let bad = |msg: String| CudaError::Shape { op: "ple_mix", msg };
        if streams.cols != sc || rows.cols != e || rows.rows != streams.rows {
            return Err(bad(format!(
                "streams [{}, {}] / rows [{}, {}] do not match S = {ns}, H = {h}, E = {e}",
                streams.rows, streams.cols, rows.rows, rows.cols
            )));
        }
        let per_stream = [
            &w.key,
            &w.key_bias,
            &w.key_norm,
            &w.query_norm,
            &w.conv_norm,
        ];
        if per_stream.iter().any(|l| l.len() != ns) {
            return Err(bad(format!("per-stream weights are not {ns} each")));
        }
        if sh.conv_kernel == 0 || sh.conv_dilation == 0 {
            return Err(bad("conv kernel and dilation must be positive".into()));
        }
        let t = rows.rows;
        let dims = PleDims {
            streams: ns,
            hidden: h,
            kernel: sh.conv_kernel,
            dilation: sh.conv_dilation,
        };
        let v = self.linear_f32(rows, &w.value)?;
        let mut u = self.scratch::<f32>(t * sc)?;
        let mut z = self.scratch::<f32>(t * sc)?;
        for c in 0..ns {
            let k = self.linear_f32(rows, &w.key[c])?;
            let gw = PleGateWeights {
                value_bias: w.value_bias.bf16(),
                key_bias: w.key_bias[c].bf16(),
                key_norm: w.key_norm[c].bf16(),
                query_norm: w.query_norm[c].bf16(),
                conv_norm: w.conv_norm[c].bf16(),
            };
            g.ple_gate(dims, c, &v, &k, &gw, &streams.buf, &mut u, &mut z, t)?;
        }
        let mut st = self.lock();
        let st = &mut *st;
        for s in seqs.iter().filter(|s| s.len > 0) {
            st.states.check(s.state)?;
            if s.start + s.len > t {
                return Err(bad(format!(
                    "chunk rows {}..{} beyond {t} rows",
                    s.start,
                    s.start + s.len
                )));
            }
        }
        if st.states.ple_shape.map(|p| ple_len(&p)) != Some(ple_len(sh)) {
            return Err(bad("the state slots hold no PLE state of this shape".into()));
        }
        let pl = ple_len(sh);
        let pool = st
            .states
            .ple
            .get_mut(&layer)
            .ok_or_else(|| bad(format!("no PLE state for layer {layer}: init_cache first")))?;
        for s in seqs.iter().filter(|s| s.len > 0) {
            let (a, b) = (s.start * sc, (s.start + s.len) * sc);
            let mut state = pool.slice_mut(s.state * pl..(s.state + 1) * pl);
            g.ple_conv(
                dims,
                &z.slice(a..b),
                &u.slice(a..b),
                w.conv.bf16(),
                &mut state,
                &mut streams.buf.slice_mut(a..b),
                s.len,
            )?;
        }
        Ok(())
    }
}
