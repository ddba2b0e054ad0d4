//! The gated delta net mixer ([`Backend::gdn`](sanmai_model::Backend::gdn)) over the GDN state in
//! each sequence's state slot: causal conv + SiLU, decay and beta, the delta rule (chunked for
//! prefill, recurrent for decode), the gated RMSNorm.

use rayon::prelude::*;
use sanmai_model::backend::{Backend, GdnCall, GdnGates, OpResult, SeqChunk};

use super::cache::GdnState;
use super::{ensure, CpuBackend, CpuTensor, CpuWeight};
use crate::ops::{self, GdnInputs, GdnSizes};

/// Tokens per chunk of the chunked delta rule (transformers' and FLA's).
const CHUNK: usize = 64;

/// A call's gate projections `b`, `a` `[rows, hv]`.
type Gates<'a> = (&'a CpuTensor, &'a CpuTensor);

/// `Err` unless the call's projections and weights fit its shape and the step.
fn check(
    op: &'static str,
    c: &GdnCall<'_, CpuTensor, CpuWeight>,
    (b, a): Gates<'_>,
) -> OpResult<()> {
    let sh = c.shape;
    let (hk, hv, dk, dv) = (sh.num_k_heads, sh.num_v_heads, sh.k_head_dim, sh.v_head_dim);
    ensure(
        hk > 0 && dv > 0 && sh.conv_kernel > 0 && hv.is_multiple_of(hk),
        op,
        || {
            format!(
                "{hv} value heads over {hk} key heads, conv kernel {}",
                sh.conv_kernel
            )
        },
    )?;
    let conv_dim = 2 * hk * dk + hv * dv;
    c.qkv.check_step(op, "qkv", conv_dim, c.seqs)?;
    c.z.check_step(op, "z", hv * dv, c.seqs)?;
    b.check_step(op, "b", hv, c.seqs)?;
    a.check_step(op, "a", hv, c.seqs)?;
    let w = c.w;
    ensure(
        w.conv.data.len() == conv_dim * sh.conv_kernel
            && w.a_log.data.len() == hv
            && w.dt_bias.data.len() == hv
            && w.norm.data.len() == dv,
        op,
        || "conv, A_log, dt_bias or norm weights do not fit the shape".into(),
    )
}

/// One sequence's GDN output `[len, hv·dv]`, advancing its state.
fn run(
    s: &SeqChunk<'_>,
    c: &GdnCall<'_, CpuTensor, CpuWeight>,
    (b, a): Gates<'_>,
    state: &mut GdnState,
) -> Vec<f32> {
    let sh = c.shape;
    let (hk, hv, dk, dv, kk) = (
        sh.num_k_heads,
        sh.num_v_heads,
        sh.k_head_dim,
        sh.v_head_dim,
        sh.conv_kernel,
    );
    let key_dim = hk * dk;
    let conv_dim = 2 * key_dim + hv * dv;
    let w = c.w;
    let t = s.len;
    let mut mixed = vec![0f32; t * conv_dim];
    ops::causal_conv1d_silu(
        c.qkv.row_range(s.start, t),
        &w.conv.data,
        &mut state.conv,
        t,
        conv_dim,
        kk,
        &mut mixed,
    );
    let mut q = Vec::with_capacity(t * key_dim);
    let mut k = Vec::with_capacity(t * key_dim);
    let mut v = Vec::with_capacity(t * hv * dv);
    for row in mixed.chunks_exact(conv_dim) {
        q.extend_from_slice(&row[..key_dim]);
        k.extend_from_slice(&row[key_dim..2 * key_dim]);
        v.extend_from_slice(&row[2 * key_dim..]);
    }
    let mut beta = b.row_range(s.start, t).to_vec();
    beta.iter_mut().for_each(|x| *x = ops::sigmoid(*x));
    let mut g = a.row_range(s.start, t).to_vec();
    for row in g.chunks_exact_mut(hv) {
        for (h, x) in row.iter_mut().enumerate() {
            *x = -w.a_log.data[h].exp() * ops::softplus(*x + w.dt_bias.data[h]);
        }
    }
    let mut out = vec![0f32; t * hv * dv];
    let inputs = GdnInputs {
        q: &q,
        k: &k,
        v: &v,
        g: &g,
        beta: &beta,
    };
    let sizes = GdnSizes { t, hk, hv, dk, dv };
    if t == 1 {
        ops::gdn_recurrent(&inputs, sizes, &mut state.ssm, &mut out);
    } else {
        ops::gdn_chunked(&inputs, sizes, CHUNK, &mut state.ssm, &mut out);
    }
    ops::gated_rms_norm(&mut out, c.z.row_range(s.start, t), &w.norm.data, dv, c.eps);
    out
}

impl CpuBackend {
    pub(super) fn gdn_impl(&self, c: &GdnCall<'_, CpuTensor, CpuWeight>) -> OpResult<CpuTensor> {
        const OP: &str = "gdn";
        let projected;
        let gates = match c.gates {
            GdnGates::Given { b, a } => (b, a),
            GdnGates::FromInput(x) => {
                projected = self.linear_many(x, &[&c.w.in_proj_b, &c.w.in_proj_a])?;
                (&projected[0], &projected[1])
            }
        };
        check(OP, c, gates)?;
        let layer = c.layer;
        let what = format!("GDN state for layer {layer}");
        let outs = self.with_states(
            OP,
            c.seqs,
            &what,
            |st| st.gdn.get_mut(&layer),
            |states| -> Vec<Vec<f32>> {
                c.seqs
                    .par_iter()
                    .zip(states.par_iter_mut())
                    .map(|(s, st)| run(s, c, gates, st))
                    .collect()
            },
        )?;
        let sh = c.shape;
        Ok(Self::stack(c.seqs, sh.num_v_heads * sh.v_head_dim, outs))
    }
}
