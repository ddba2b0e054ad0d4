//! The PLE mix ([`Backend::ple_mix`](sanmai_model::Backend::ple_mix)) on the residual streams, with
//! its dilated conv's past inputs in each sequence's state slot.

use rayon::prelude::*;
use sanmai_model::backend::{OpResult, PleCall};

use super::{ensure, matmul, CpuBackend, CpuTensor, CpuWeight};
use crate::ops;

fn add_bias(x: &mut CpuTensor, b: &CpuWeight) {
    for row in x.data.chunks_exact_mut(x.cols) {
        row.iter_mut().zip(&b.data).for_each(|(v, b)| *v += b);
    }
}

/// `Err` unless the streams, the table rows and the weights fit the call's shape and the step.
fn check(
    op: &'static str,
    streams: &CpuTensor,
    c: &PleCall<'_, CpuTensor, CpuWeight>,
) -> OpResult<()> {
    let sh = c.shape;
    let (ns, h, e) = (sh.streams, sh.hidden, sh.row_width);
    ensure(ns > 0 && h > 0 && sh.conv_kernel > 0, op, || {
        format!("{ns} streams of {h}, conv kernel {}", sh.conv_kernel)
    })?;
    streams.check_step(op, "streams", ns * h, c.seqs)?;
    c.rows.check_step(op, "rows", e, c.seqs)?;
    ensure(c.rows.rows == streams.rows, op, || {
        format!(
            "{} rows of E for {} tokens: one per token",
            c.rows.rows, streams.rows
        )
    })?;
    let w = c.w;
    let per_stream = [
        &w.key,
        &w.key_bias,
        &w.key_norm,
        &w.query_norm,
        &w.conv_norm,
    ];
    ensure(
        per_stream.iter().all(|l| l.len() == ns)
            && w.value.cols() == e
            && w.value.rows() == h
            && w.key.iter().all(|k| (k.rows(), k.cols()) == (h, e))
            && w.conv.data.len() == ns * h * sh.conv_kernel,
        op,
        || format!("PLE weights that do not fit {ns} streams of {h} and rows of {e}"),
    )
}

impl CpuBackend {
    pub(super) fn ple_mix_impl(
        &self,
        streams: &mut CpuTensor,
        c: &PleCall<'_, CpuTensor, CpuWeight>,
    ) -> OpResult<()> {
        const OP: &str = "ple_mix";
        check(OP, streams, c)?;
        let (sh, w, rows, layer) = (c.shape, c.w, c.rows, c.layer);
        let (ns, h) = (sh.streams, sh.hidden);
        let sc = ns * h;
        let t = rows.rows;
        let mut v = matmul(&rows.data, t, &w.value);
        add_bias(&mut v, &w.value_bias);
        let keys: Vec<CpuTensor> = (0..ns)
            .map(|c| {
                let mut k = matmul(&rows.data, t, &w.key[c]);
                add_bias(&mut k, &w.key_bias[c]);
                ops::rms_norm(&mut k.data, &w.key_norm[c].data, h, ops::PLE_EPS, 0.0);
                k
            })
            .collect();
        // u and its per-stream normed copy z, [t, S·H].
        let mut u = vec![0f32; t * sc];
        for r in 0..t {
            let rs = streams.row_range(r, 1);
            for c in 0..ns {
                ops::ple_gate(
                    keys[c].row_range(r, 1),
                    &rs[c * h..(c + 1) * h],
                    &w.query_norm[c].data,
                    v.row_range(r, 1),
                    &mut u[r * sc + c * h..r * sc + (c + 1) * h],
                );
            }
        }
        let mut z = u.clone();
        for zr in z.chunks_exact_mut(sc) {
            for c in 0..ns {
                ops::rms_norm(
                    &mut zr[c * h..(c + 1) * h],
                    &w.conv_norm[c].data,
                    h,
                    ops::PLE_EPS,
                    0.0,
                );
            }
        }
        let what = format!("PLE state for layer {layer}");
        let ys = self.with_states(
            OP,
            c.seqs,
            &what,
            |st| st.ple.get_mut(&layer),
            |states| -> Vec<Vec<f32>> {
                c.seqs
                    .par_iter()
                    .zip(states.par_iter_mut())
                    .map(|(s, state)| {
                        let mut y = vec![0f32; s.len * sc];
                        ops::dilated_conv_silu(
                            &z[s.start * sc..(s.start + s.len) * sc],
                            &w.conv.data,
                            state,
                            sc,
                            sh.conv_kernel,
                            sh.conv_dilation,
                            &mut y,
                        );
                        y
                    })
                    .collect()
            },
        )?;
        for (s, y) in c.seqs.iter().zip(ys) {
            let dst = &mut streams.data[s.start * sc..(s.start + s.len) * sc];
            let us = &u[s.start * sc..(s.start + s.len) * sc];
            for ((r, u), y) in dst.iter_mut().zip(us).zip(&y) {
                *r += u + y;
            }
        }
        Ok(())
    }
}
