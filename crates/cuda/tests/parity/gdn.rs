//! The multi-sequence chunked GDN prefill against the CPU backend's choice per sequence: the CPU gates
//! and `sanmai_cpu::ops::gdn_chunked` (chunk 64), or `gdn_recurrent` for one-token chunks. The fused
//! decode step is in `gdn_decode.rs`.
//!
//! The prefill's final state is an f32 result from sums taken in another order than the CPU's (chunks
//! of 32 or 16 tokens against 64, the UT solve applied to `β(v − e^G·K·S)` instead of forming `U` and
//! `W`, dot products split four ways): each state element is a sum of O(dk + chunk) products of terms
//! bounded by the state's scale, so its rounding error is a few hundred f32 ulps of that scale at most,
//! well inside the `max|gpu − ref| / max|ref| ≤ 1e-4` of every f32 result (measured: about 1e-6). The
//! CPU references mirror where the GPU rounds to bf16: the prefill path rounds the conv output and the
//! delta-rule output.

use half::bf16;
use sanmai_cpu::ops;
use sanmai_cuda::{GdnDims, GdnGates, SeqRows};

use crate::common::{check_f32, check_reduction, from_bf16, gpu, to_bf16, Rng};

/// Splits conv output rows `[q | k | v]` into q, k and v and computes the CPU backend's gates.
#[allow(clippy::type_complexity)]
pub(crate) fn cpu_inputs(
    dims: GdnDims,
    qkv: &[f32],
    a: &[f32],
    b: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let GdnDims { hk, hv, dk, .. } = dims;
    let key = hk * dk;
    let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
    for row in qkv.chunks_exact(dims.conv_dim()) {
        q.extend_from_slice(&row[..key]);
        k.extend_from_slice(&row[key..2 * key]);
        v.extend_from_slice(&row[2 * key..]);
    }
    let beta: Vec<f32> = b.iter().map(|&x| ops::sigmoid(x)).collect();
    let gate: Vec<f32> = a
        .iter()
        .enumerate()
        .map(|(i, &x)| -a_log[i % hv].exp() * ops::softplus(x + dt_bias[i % hv]))
        .collect();
    (q, k, v, gate, beta)
}

/// One prefill step of `lens.len()` sequences (laid out in order with one row of no sequence between
/// neighbours), sequence `i` in slot `slots[i]` of a pool of `num_slots` random states. Checks every
/// output row (rows of no sequence and of out-of-range slots zero), the state pool (slots not in the
/// step untouched).
fn prefill_case(
    g: &sanmai_cuda::Gpu,
    rng: &mut Rng,
    dims: GdnDims,
    lens: &[usize],
    slots: &[u32],
    num_slots: usize,
) {
    let GdnDims { hk, hv, dk, dv } = dims;
    let (cd, sl) = (dims.conv_dim(), dims.state_len());
    let starts: Vec<usize> = lens
        .iter()
        .scan(0, |next, &l| {
            let s = *next;
            *next += l + 1;
            Some(s)
        })
        .collect();
    let rows = starts.last().map_or(0, |&s| s + lens[lens.len() - 1] + 1);
    let (qkvb, qkvf) = to_bf16(&rng.normals(rows * cd, 0.0, 1.0));
    let (ab, af) = to_bf16(&rng.normals(rows * hv, 0.0, 1.0));
    let (bb, bf) = to_bf16(&rng.normals(rows * hv, 0.0, 1.0));
    let a_log: Vec<f32> = (0..hv).map(|_| rng.unit() * 2.0 - 1.0).collect();
    let dt_bias: Vec<f32> = rng.normals(hv, 0.0, 0.5);
    let pool0 = rng.normals(num_slots * sl, 0.0, 0.3);

    let mut want_pool = pool0.clone();
    let mut want = vec![0f32; rows * hv * dv];
    for ((&s0, &t), &slot) in starts.iter().zip(lens).zip(slots) {
        let slot = slot as usize;
        if slot >= num_slots || t == 0 {
            continue;
        }
        let (q, k, v, gate, beta) = cpu_inputs(
            dims,
            &qkvf[s0 * cd..(s0 + t) * cd],
            &af[s0 * hv..(s0 + t) * hv],
            &bf[s0 * hv..(s0 + t) * hv],
            &a_log,
            &dt_bias,
        );
        let state = &mut want_pool[slot * sl..(slot + 1) * sl];
        let out = &mut want[s0 * hv * dv..(s0 + t) * hv * dv];
        let x = ops::GdnInputs {
            q: &q,
            k: &k,
            v: &v,
            g: &gate,
            beta: &beta,
        };
        let sizes = ops::GdnSizes { t, hk, hv, dk, dv };
        if t == 1 {
            ops::gdn_recurrent(&x, sizes, state, out);
        } else {
            ops::gdn_chunked(&x, sizes, 64, state, out);
        }
    }

    let as_u32 = |x: &[usize]| x.iter().map(|&v| v as u32).collect::<Vec<_>>();
    let qkv = g.upload(&qkvb).unwrap();
    let (a, bg) = (g.upload(&ab).unwrap(), g.upload(&bb).unwrap());
    let (al, dt) = (g.upload(&a_log).unwrap(), g.upload(&dt_bias).unwrap());
    let (st, ln, sd) = (
        g.upload(&as_u32(&starts)).unwrap(),
        g.upload(&as_u32(lens)).unwrap(),
        g.upload(slots).unwrap(),
    );
    let mut pool = g.upload(&pool0).unwrap();
    let mut out = g.zeros::<bf16>(rows * hv * dv).unwrap();
    let gates = GdnGates {
        a: &a,
        b: &bg,
        a_log: &al,
        dt_bias: &dt,
    };
    let seqs = SeqRows {
        starts: &st,
        lens: &ln,
        slots: &sd,
        rows,
        n_seq: lens.len(),
        max_len: lens.iter().copied().max().unwrap_or(0),
    };
    g.gdn_chunk_prefill(dims, &qkv, &gates, &mut pool, &seqs, &mut out)
        .unwrap();
    let got = from_bf16(&g.download(&out).unwrap());
    let lens_s: Vec<String> = lens.iter().map(|l| l.to_string()).collect();
    let shape = format!("t{}_hk{hk}_hv{hv}_dk{dk}_dv{dv}", lens_s.join("+"));
    check_reduction("gdn_chunk_out", &shape, &got, &want);
    for (r, (gr, wr)) in got
        .chunks_exact(hv * dv)
        .zip(want.chunks_exact(hv * dv))
        .enumerate()
    {
        if wr.iter().all(|&v| v == 0.0) {
            assert!(
                gr.iter().all(|&v| v == 0.0),
                "{shape}: row {r} of no sequence (or of a bad slot) must stay zero"
            );
        }
    }
    let got_pool = g.download(&pool).unwrap();
    check_f32("gdn_chunk_state", &shape, &got_pool, &want_pool);
    for s in 0..num_slots {
        if !slots.contains(&(s as u32)) {
            assert_eq!(
                got_pool[s * sl..(s + 1) * sl],
                pool0[s * sl..(s + 1) * sl],
                "{shape}: slot {s} is not in the step and must be untouched"
            );
        }
    }
}

/// Qwen3-Next-80B's (and Qwen3.5-35B's) gated-delta-net layer.
pub(crate) const NEXT: GdnDims = GdnDims {
    hk: 16,
    hv: 32,
    dk: 128,
    dv: 128,
};

#[test]
fn gdn_chunk_prefill_single_sequences_match_cpu() {
    let Some(g) = gpu("gdn_chunk_prefill_single_sequences_match_cpu") else {
        return;
    };
    let mut rng = Rng::new(41);
    // Around the chunk lengths (32 and 64) and the CPU's chunk of 64; one token (a decode row).
    for t in [1usize, 5, 63, 64, 65, 300] {
        prefill_case(g, &mut rng, NEXT, &[t], &[2], 4);
    }
}

#[test]
fn gdn_chunk_prefill_many_sequences_match_cpu() {
    let Some(g) = gpu("gdn_chunk_prefill_many_sequences_match_cpu") else {
        return;
    };
    let mut rng = Rng::new(43);
    // Prefill chunks of several lengths mixed with one-token decode rows and an empty chunk, slots
    // scattered over a larger pool (1 and 4 not in the step); 11 is out of range: zero output rows.
    prefill_case(
        g,
        &mut rng,
        NEXT,
        &[65, 1, 300, 5, 0, 64, 1, 63, 7],
        &[5, 0, 3, 7, 8, 2, 9, 6, 11],
        10,
    );
}

#[test]
fn gdn_chunk_prefill_shapes_match_cpu() {
    let Some(g) = gpu("gdn_chunk_prefill_shapes_match_cpu") else {
        return;
    };
    let mut rng = Rng::new(44);
    for (dims, lens) in [
        // Three value heads per key head (the qwen4-exp-125b layer).
        (
            GdnDims {
                hk: 16,
                hv: 48,
                dk: 128,
                dv: 128,
            },
            &[64usize, 65, 1][..],
        ),
        // hv = hk, dk = dv = 64.
        (
            GdnDims {
                hk: 4,
                hv: 4,
                dk: 64,
                dv: 64,
            },
            &[1, 5, 63, 64, 65, 300][..],
        ),
        // dv not a multiple of 32.
        (
            GdnDims {
                hk: 2,
                hv: 6,
                dk: 64,
                dv: 80,
            },
            &[70, 3][..],
        ),
        // dk above 128 (chunks of 16).
        (
            GdnDims {
                hk: 2,
                hv: 4,
                dk: 192,
                dv: 40,
            },
            &[50, 1, 17][..],
        ),
        (
            GdnDims {
                hk: 1,
                hv: 2,
                dk: 256,
                dv: 32,
            },
            &[33][..],
        ),
        // dk not a multiple of 4 (zero padding of the key rows), dv below 32.
        (
            GdnDims {
                hk: 1,
                hv: 2,
                dk: 30,
                dv: 20,
            },
            &[37, 2][..],
        ),
        // The tiny configs' shape.
        (
            GdnDims {
                hk: 2,
                hv: 4,
                dk: 16,
                dv: 24,
            },
            &[17, 40][..],
        ),
    ] {
        // Slots in reverse order, 0 and 1 not in the step.
        let n = lens.len() as u32;
        let slots: Vec<u32> = (0..n).map(|i| n + 1 - i).collect();
        prefill_case(g, &mut rng, dims, lens, &slots, n as usize + 2);
    }
}
