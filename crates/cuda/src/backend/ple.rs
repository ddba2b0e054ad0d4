//! The PLE mix on the device (spec §3.7): the value and per-stream key projections as f32 linears,
//! the per-stream gate and normed conv input (one kernel per stream), then the dilated causal conv
//! over each sequence's PLE state and the residual update: one batched launch for a step of
//! one-token chunks (state slots read from the step metadata), one per chunk otherwise.
//!
//! Recorded decode steps: the model hands the step's rows over first ([`Backend::ple_step_rows`]),
//! copied here into a persistent buffer outside any recording; while a decode step that may be
//! recorded runs, the projections read that buffer, so a replay reads the rows of its own step.
//!
//! [`Backend::ple_step_rows`]: sanmai_model::Backend::ple_step_rows

use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

use sanmai_model::backend::{PleCall, PleWeights};

use super::cache::ple_len;
use super::tensor::{CudaTensor, CudaWeight};
use super::{all_decode, CudaBackend};
use crate::error::{CudaError, Result};
use crate::ops::{PleDims, PleGateWeights, PleGated, PleLin};

/// The PLE rows of the coming decode step in a persistent device buffer: `rows.rows` is the step's
/// row count, the buffer may hold more.
pub(crate) struct StagedRows {
    rows: CudaTensor,
    /// Staged for the step now running (cleared when it ends): a recorded step must not read the
    /// rows of an earlier one.
    live: bool,
}

impl CudaBackend {
    /// Copies the step's PLE rows into the persistent buffer (grown, dropping every recording, when
    /// too small), on the stream before the step's launches.
    pub(crate) fn ple_step_rows_impl(&self, rows: &CudaTensor) -> Result<()> {
        let mut staged = self.staged_ple();
        let n = rows.len();
        let s = match staged.take() {
            Some(s) if s.rows.cols == rows.cols && s.rows.buf.len() >= n.max(1) => staged.insert(s),
            _ => {
                // The old buffer goes: so do the recordings that read it.
                self.epoch.fetch_add(1, Ordering::Relaxed);
                // Room for the recorded batch sizes at once: a larger batch later grows it once more.
                let cap = rows.rows.next_power_of_two().max(8) * rows.cols;
                let buf = self.gpu.zeros(cap.max(1))?;
                staged.insert(StagedRows {
                    rows: CudaTensor {
                        rows: rows.rows,
                        cols: rows.cols,
                        buf,
                    },
                    live: false,
                })
            }
        };
        if n > 0 {
            self.gpu
                .stream()
                .memcpy_dtod(&rows.buf.slice(..n), &mut s.rows.buf.slice_mut(..n))?;
        }
        s.rows.rows = rows.rows;
        s.live = true;
        Ok(())
    }

    /// Marks the staged rows as used up (the decode step they were staged for has run).
    pub(crate) fn end_ple_step(&self) {
        if let Some(s) = self.staged_ple().as_mut() {
            s.live = false;
        }
    }

    fn staged_ple(&self) -> MutexGuard<'_, Option<StagedRows>> {
        self.ple_in.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn ple_impl(
        &self,
        streams: &mut CudaTensor,
        c: &PleCall<'_, CudaTensor, CudaWeight>,
    ) -> Result<()> {
        let PleCall {
            layer,
            shape: sh,
            rows,
            w,
            seqs,
        } = *c;
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
        let dims = PleDims {
            streams: ns,
            hidden: h,
            kernel: sh.conv_kernel,
            dilation: sh.conv_dilation,
        };
        let (u, z) = self.ple_gates(dims, streams, rows, w)?;
        let t = rows.rows;
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
        let g = &self.gpu;
        let conv = w.conv.bf16()?;
        if all_decode(seqs) {
            let bs = st.kv.block_size;
            let m = st.meta.seqs(g, seqs, t, bs)?;
            let slots = st.meta.view(m.slots, m.n_seq);
            let pool =
                st.states.ple.get_mut(&layer).ok_or_else(|| {
                    bad(format!("no PLE state for layer {layer}: init_cache first"))
                })?;
            let gated = PleGated {
                u: &u,
                z: &z,
                rows: t,
            };
            return g.ple_conv_decode(dims, &gated, conv, pool, &slots, &mut streams.buf);
        }
        let pool = st
            .states
            .ple
            .get_mut(&layer)
            .ok_or_else(|| bad(format!("no PLE state for layer {layer}: init_cache first")))?;
        for s in seqs.iter().filter(|s| s.len > 0) {
            let (a, b) = (s.start * sc, (s.start + s.len) * sc);
            let mut state = pool.slice_mut(s.state * pl..(s.state + 1) * pl);
            let gated = PleGated {
                u: &u.slice(a..b),
                z: &z.slice(a..b),
                rows: s.len,
            };
            g.ple_conv(
                dims,
                &gated,
                conv,
                &mut state,
                &mut streams.buf.slice_mut(a..b),
            )?;
        }
        Ok(())
    }

    /// The value and key projections of the rows and the per-stream gates: `(u, z)`, each `[rows,
    /// S·H]` f32. In a decode step that may be recorded the rows are read from the staged buffer.
    fn ple_gates(
        &self,
        dims: PleDims,
        streams: &CudaTensor,
        rows: &CudaTensor,
        w: &PleWeights<CudaWeight>,
    ) -> Result<(
        cudarc::driver::CudaSlice<f32>,
        cudarc::driver::CudaSlice<f32>,
    )> {
        let recording = self.lock().decode_span.is_some();
        let staged = self.staged_ple();
        let x = if recording {
            match staged.as_ref() {
                Some(s) if s.live && s.rows.rows == rows.rows && s.rows.cols == rows.cols => {
                    &s.rows
                }
                _ => {
                    return Err(CudaError::Shape {
                        op: "ple_mix",
                        msg: "a decode step's PLE rows were not staged: Backend::ple_step_rows \
                              comes before Backend::decode_step"
                            .into(),
                    })
                }
            }
        } else {
            rows
        };
        let t = x.rows;
        let sc = dims.streams * dims.hidden;
        let v = self.linear_f32(x, &w.value)?;
        let mut u = self.scratch::<f32>(t * sc)?;
        let mut z = self.scratch::<f32>(t * sc)?;
        for c in 0..dims.streams {
            let k = self.linear_f32(x, &w.key[c])?;
            let lin = PleLin { value: &v, key: &k };
            let out = PleGated {
                u: &mut u,
                z: &mut z,
                rows: t,
            };
            let gw = PleGateWeights {
                value_bias: w.value_bias.bf16()?,
                key_bias: w.key_bias[c].bf16()?,
                key_norm: w.key_norm[c].bf16()?,
                query_norm: w.query_norm[c].bf16()?,
                conv_norm: w.conv_norm[c].bf16()?,
            };
            self.gpu.ple_gate(dims, c, &lin, &gw, &streams.buf, out)?;
        }
        Ok((u, z))
    }
}
