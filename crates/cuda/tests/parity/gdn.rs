//! The GDN recurrent decode step against the CPU gates + `sanmai_cpu::ops::gdn_recurrent` (t = 1).

use half::bf16;
use sanmai_cpu::ops;
use sanmai_cuda::GdnDims;

use crate::common::{check_f32, check_reduction, from_bf16, gpu, to_bf16, Rng};

#[test]
fn gdn_recurrent_step_matches_cpu() {
    let Some(g) = gpu("gdn_recurrent_step_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(40);
    for dims in [
        // Qwen3-Next's shape, then a small one with dv not a multiple of 32.
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
    ] {
        let GdnDims { hk, hv, dk, dv } = dims;
        let (cd, sl, num_slots) = (dims.conv_dim(), dims.state_len(), 4usize);
        let slots: Vec<u32> = vec![2, 0, 3, 11]; // 11 is out of range: zero output, nothing touched
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
        let sd = g.upload(&slots).unwrap();
        let mut pool = g.upload(&pool0).unwrap();
        let mut out = g.zeros::<bf16>(b * hv * dv).unwrap();
        g.gdn_recurrent_step(dims, &qkv, &a, &bg, &al, &dt, &mut pool, &sd, &mut out, b)
            .unwrap();
        let got = from_bf16(&g.download(&out).unwrap());
        let shape = format!("b{b}_hk{hk}_hv{hv}_dk{dk}_dv{dv}");
        check_reduction("gdn_step_out", &shape, &got, &want);
        let got_pool = g.download(&pool).unwrap();
        check_f32("gdn_step_state", &shape, &got_pool, &want_pool);
        assert_eq!(
            got_pool[sl..2 * sl],
            pool0[sl..2 * sl],
            "slot 1 is not in the batch and must be untouched"
        );
        assert!(
            got[3 * hv * dv..].iter().all(|&v| v == 0.0),
            "bad slot gives zeros"
        );
    }
}
