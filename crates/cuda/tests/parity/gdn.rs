//! The GDN recurrent decode step against the CPU gates + `sanmai_cpu::ops::gdn_recurrent` (t = 1), and
//! the GDN prefill against the CPU gates + `sanmai_cpu::ops::gdn_chunked` (chunk 64).

use half::bf16;
use sanmai_cpu::ops;
use sanmai_cuda::GdnDims;

use crate::common::{check_f32, check_reduction, from_bf16, gpu, to_bf16, Rng};

/// One decode step of `slots.len()` sequences over a pool of `num_slots` states; checks the output,
/// the state pool (slots not in the batch untouched) and the zero output of out-of-range slots.
fn step_case(g: &sanmai_cuda::Gpu, rng: &mut Rng, dims: GdnDims, slots: &[u32], num_slots: usize) {
    let GdnDims { hk, hv, dk, dv } = dims;
    let (cd, sl) = (dims.conv_dim(), dims.state_len());
    let b = slots.len();
    let (qkvb, qkvf) = to_bf16(&rng.normals(b * cd, 0.0, 1.0));
    let (ab, af) = to_bf16(&rng.normals(b * hv, 0.0, 1.0));
    let (bb, bf) = to_bf16(&rng.normals(b * hv, 0.0, 1.0));
    let a_log: Vec<f32> = (0..hv).map(|_| rng.unit() * 2.0 - 1.0).collect();
    let dt_bias: Vec<f32> = rng.normals(hv, 0.0, 0.5);
    let pool0 = rng.normals(num_slots * sl, 0.0, 0.3);

    let mut want_pool = pool0.clone();
    let mut want = vec![0f32; b * hv * dv];
    let key = hk * dk;
    for (i, &s) in slots.iter().enumerate() {
        let s = s as usize;
        if s >= num_slots {
            continue;
        }
        let row = &qkvf[i * cd..(i + 1) * cd];
        let beta: Vec<f32> = bf[i * hv..(i + 1) * hv]
            .iter()
            .map(|&x| ops::sigmoid(x))
            .collect();
        let gate: Vec<f32> = (0..hv)
            .map(|h| -a_log[h].exp() * ops::softplus(af[i * hv + h] + dt_bias[h]))
            .collect();
        ops::gdn_recurrent(
            &row[..key],
            &row[key..2 * key],
            &row[2 * key..],
            &gate,
            &beta,
            &mut want_pool[s * sl..(s + 1) * sl],
            &mut want[i * hv * dv..(i + 1) * hv * dv],
            1,
            hk,
            hv,
            dk,
            dv,
        );
    }

    let qkv = g.upload(&qkvb).unwrap();
    let (a, bg) = (g.upload(&ab).unwrap(), g.upload(&bb).unwrap());
    let (al, dt) = (g.upload(&a_log).unwrap(), g.upload(&dt_bias).unwrap());
    let sd = g.upload(slots).unwrap();
    let mut pool = g.upload(&pool0).unwrap();
    let mut out = g.zeros::<bf16>(b * hv * dv).unwrap();
    g.gdn_recurrent_step(dims, &qkv, &a, &bg, &al, &dt, &mut pool, &sd, &mut out, b)
        .unwrap();
    let got = from_bf16(&g.download(&out).unwrap());
    let shape = format!("b{b}_hk{hk}_hv{hv}_dk{dk}_dv{dv}");
    check_reduction("gdn_step_out", &shape, &got, &want);
    let got_pool = g.download(&pool).unwrap();
    check_f32("gdn_step_state", &shape, &got_pool, &want_pool);
    for s in 0..num_slots {
        if !slots.contains(&(s as u32)) {
            assert_eq!(
                got_pool[s * sl..(s + 1) * sl],
                pool0[s * sl..(s + 1) * sl],
                "{shape}: slot {s} is not in the batch and must be untouched"
            );
        }
    }
    for (i, &s) in slots.iter().enumerate() {
        if s as usize >= num_slots {
            assert!(
                got[i * hv * dv..(i + 1) * hv * dv]
                    .iter()
                    .all(|&v| v == 0.0),
                "{shape}: bad slot gives zeros"
            );
        }
    }
}

#[test]
fn gdn_recurrent_step_matches_cpu() {
    let Some(g) = gpu("gdn_recurrent_step_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(40);
    for dims in [
        // Qwen3-Next's shape; a small one with dv not a multiple of 32; dk above 128 (the dk256
        // kernel); dv not a multiple of 4 (scalar state access); the tiny configs' shape.
        GdnDims {
            hk: 16,
            hv: 32,
            dk: 128,
            dv: 128,
        },
        GdnDims {
            hk: 2,
            hv: 6,
            dk: 64,
            dv: 80,
        },
        GdnDims {
            hk: 2,
            hv: 4,
            dk: 192,
            dv: 40,
        },
        GdnDims {
            hk: 1,
            hv: 2,
            dk: 48,
            dv: 30,
        },
        GdnDims {
            hk: 2,
            hv: 4,
            dk: 16,
            dv: 24,
        },
    ] {
        // 11 is out of range: zero output, nothing touched; slot 1 is not in the batch.
        step_case(g, &mut rng, dims, &[2, 0, 3, 11], 4);
    }
}

#[test]
fn gdn_recurrent_step_decode_batches_match_cpu() {
    let Some(g) = gpu("gdn_recurrent_step_decode_batches_match_cpu") else {
        return;
    };
    let mut rng = Rng::new(42);
    // Qwen3-Next's GDN layer at decode batch 1 and 8 (slots scattered over a larger pool).
    let dims = GdnDims {
        hk: 16,
        hv: 32,
        dk: 128,
        dv: 128,
    };
    step_case(g, &mut rng, dims, &[5], 8);
    step_case(g, &mut rng, dims, &[7, 0, 3, 9, 1, 4, 10, 2], 12);
}

#[test]
fn gdn_recurrent_prefill_matches_cpu_chunked() {
    let Some(g) = gpu("gdn_recurrent_prefill_matches_cpu_chunked") else {
        return;
    };
    let mut rng = Rng::new(41);
    for (dims, t) in [
        // Qwen3-Next's shape over two full chunks of 64 and a partial one; a small odd shape.
        (
            GdnDims {
                hk: 16,
                hv: 32,
                dk: 128,
                dv: 128,
            },
            150usize,
        ),
        (
            GdnDims {
                hk: 2,
                hv: 6,
                dk: 64,
                dv: 80,
            },
            70,
        ),
    ] {
        let GdnDims { hk, hv, dk, dv } = dims;
        let (cd, sl) = (dims.conv_dim(), dims.state_len());
        let (qkvb, qkvf) = to_bf16(&rng.normals(t * cd, 0.0, 1.0));
        let (ab, af) = to_bf16(&rng.normals(t * hv, 0.0, 1.0));
        let (bb, bf) = to_bf16(&rng.normals(t * hv, 0.0, 1.0));
        let a_log: Vec<f32> = (0..hv).map(|_| rng.unit() * 2.0 - 1.0).collect();
        let dt_bias: Vec<f32> = rng.normals(hv, 0.0, 0.5);
        let state0 = rng.normals(sl, 0.0, 0.3);

        // The CPU backend's split of the conv rows and its gates, then the chunked form (chunk 64).
        let key = hk * dk;
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for row in qkvf.chunks_exact(cd) {
            q.extend_from_slice(&row[..key]);
            k.extend_from_slice(&row[key..2 * key]);
            v.extend_from_slice(&row[2 * key..]);
        }
        let beta: Vec<f32> = bf.iter().map(|&x| ops::sigmoid(x)).collect();
        let gate: Vec<f32> = af
            .iter()
            .enumerate()
            .map(|(i, &x)| -a_log[i % hv].exp() * ops::softplus(x + dt_bias[i % hv]))
            .collect();
        let mut want_state = state0.clone();
        let mut want = vec![0f32; t * hv * dv];
        ops::gdn_chunked(
            &q,
            &k,
            &v,
            &gate,
            &beta,
            &mut want_state,
            &mut want,
            t,
            hk,
            hv,
            dk,
            dv,
            64,
        );

        let qkv = g.upload(&qkvb).unwrap();
        let (a, bg) = (g.upload(&ab).unwrap(), g.upload(&bb).unwrap());
        let (al, dt) = (g.upload(&a_log).unwrap(), g.upload(&dt_bias).unwrap());
        let mut state = g.upload(&state0).unwrap();
        let mut out = g.zeros::<bf16>(t * hv * dv).unwrap();
        g.gdn_recurrent_prefill(dims, &qkv, &a, &bg, &al, &dt, &mut state, &mut out, t)
            .unwrap();
        let got = from_bf16(&g.download(&out).unwrap());
        let shape = format!("t{t}_hk{hk}_hv{hv}_dk{dk}_dv{dv}");
        check_reduction("gdn_prefill_out", &shape, &got, &want);
        check_f32(
            "gdn_prefill_state",
            &shape,
            &g.download(&state).unwrap(),
            &want_state,
        );
    }
}
