//! Routed experts ([`Backend::moe_experts`](sanmai_model::Backend::moe_experts)): the softmax
//! router's top-k, each expert's SwiGLU over the tokens routed to it, the weighted combine, and the
//! sigmoid-gated shared expert.

use rayon::prelude::*;
use sanmai_model::backend::{MoeCall, OpResult};
use sanmai_model::Backend;

use super::{ensure, matmul, CpuBackend, CpuTensor, CpuWeight};
use crate::ops;

/// `Err` unless the input, the router and the shared expert's output fit each other.
fn check(op: &'static str, c: &MoeCall<'_, CpuTensor, CpuWeight>) -> OpResult<()> {
    let (x, w) = (c.x, c.w);
    let e = w.experts.len();
    ensure(
        w.router.cols() == x.cols && w.router.rows() == e,
        op,
        || {
            format!(
                "a router {:?} for {e} experts and inputs {} wide",
                w.router.shape, x.cols
            )
        },
    )?;
    ensure(w.top_k <= e, op, || {
        format!("top-{} of {e} experts", w.top_k)
    })?;
    let h = x.cols;
    if let Some(i) = w.experts.iter().position(|ex| {
        (
            ex.gate_up.rows(),
            ex.gate_up.cols(),
            ex.down.rows(),
            ex.down.cols(),
        ) != (2 * ex.inter, h, h, ex.inter)
    }) {
        return Err(sanmai_model::BackendError::invalid(
            op,
            format!("expert {i}'s weights do not fit inputs {h} wide"),
        ));
    }
    if let Some(sh) = &c.shared {
        let y = sh.y.map_or((x.rows, x.cols), |y| (y.rows, y.cols));
        let g = sh.gate.map_or((x.rows, 1), |g| (g.rows, g.cols));
        ensure(y == (x.rows, x.cols) && g == (x.rows, 1), op, || {
            format!(
                "a shared expert of {y:?} with gate {g:?} for inputs [{}, {}]",
                x.rows, x.cols
            )
        })?;
        ensure(sh.y.is_some() || c.w.shared.is_some(), op, || {
            "no shared expert output and no shared expert weights".into()
        })?;
        ensure(sh.gate.is_some() || c.w.shared_gate.is_some(), op, || {
            "no shared expert gate logits and no gate weight".into()
        })?;
    }
    Ok(())
}

impl CpuBackend {
    pub(super) fn moe_impl(&self, c: &MoeCall<'_, CpuTensor, CpuWeight>) -> OpResult<CpuTensor> {
        check("moe_experts", c)?;
        let (x, w) = (c.x, c.w);
        let (t, h) = (x.rows, x.cols);
        let e = w.experts.len();
        let logits = matmul(&x.data, t, &w.router);
        let mut ids = vec![0u32; t * w.top_k];
        let mut weights = vec![0f32; t * w.top_k];
        ops::route_topk(
            &logits.data,
            t,
            e,
            w.top_k,
            w.renormalize,
            &mut ids,
            &mut weights,
        );
        if let Some(log) = self.routing.lock().unwrap().as_mut() {
            let mut seen = vec![false; e];
            ids.iter().for_each(|&i| seen[i as usize] = true);
            log.push(seen.iter().filter(|&&x| x).count());
        }
        // Tokens (and their routing weight) per expert.
        let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
        for (i, (&id, &wt)) in ids.iter().zip(&weights).enumerate() {
            routed[id as usize].push((i / w.top_k, wt));
        }
        let partial: Vec<(usize, CpuTensor)> = routed
            .par_iter()
            .enumerate()
            .filter(|(_, toks)| !toks.is_empty())
            .map(|(ei, toks)| {
                let ex = &w.experts[ei];
                let mut xs = Vec::with_capacity(toks.len() * h);
                for &(tok, _) in toks {
                    xs.extend_from_slice(x.row_range(tok, 1));
                }
                let gu = matmul(&xs, toks.len(), &ex.gate_up);
                let mut act = CpuTensor::zeros(toks.len(), ex.inter);
                ops::swiglu(&gu.data, toks.len(), ex.inter, &mut act.data);
                (ei, matmul(&act.data, toks.len(), &ex.down))
            })
            .collect();
        let mut out = CpuTensor::zeros(t, h);
        for (ei, y) in partial {
            for (&(tok, wt), yr) in routed[ei].iter().zip(y.data.chunks_exact(h)) {
                out.data[tok * h..(tok + 1) * h]
                    .iter_mut()
                    .zip(yr)
                    .for_each(|(o, v)| *o += wt * v);
            }
        }
        if let Some(sh) = &c.shared {
            // The shared expert's output, computed here when the call leaves it to the backend.
            let own;
            let y = match (sh.y, &c.w.shared) {
                (Some(y), _) => y,
                (None, Some(m)) => {
                    own = self.linear(&self.swiglu(&self.linear(c.x, &m.gate_up)?)?, &m.down)?;
                    &own
                }
                (None, None) => unreachable!("checked above"),
            };
            let own_gate;
            let gate = match (sh.gate, &c.w.shared_gate) {
                (Some(g), _) => g,
                (None, Some(w)) => {
                    own_gate = self.linear(c.x, w)?;
                    &own_gate
                }
                (None, None) => unreachable!("checked above"),
            };
            for ((o, yr), g) in out
                .data
                .chunks_exact_mut(h)
                .zip(y.data.chunks_exact(h))
                .zip(&gate.data)
            {
                let s = ops::sigmoid(*g);
                o.iter_mut().zip(yr).for_each(|(o, y)| *o += s * y);
            }
        }
        Ok(out)
    }
}
