//! Causal conv1d + SiLU (prefill and the batched one-token update) against
//! `sanmai_cpu::ops::causal_conv1d_silu`.

use half::bf16;
use sanmai_cpu::ops;

use crate::common::{check_elementwise, from_bf16, gpu, to_bf16, Rng};

#[test]
fn conv1d_prefill_matches_cpu() {
    let Some(g) = gpu("conv1d_prefill_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(30);
    // Qwen3-Next's conv_dim 8192 with kernel 4; t < kernel − 1 exercises the state shift.
    for &(t, c, kk) in &[(9, 8192, 4), (2, 8192, 4), (1, 300, 4), (17, 64, 2)] {
        let (xb, xf) = to_bf16(&rng.normals(t * c, 0.0, 1.0));
        let (wb, wf) = to_bf16(&rng.normals(c * kk, 0.0, 0.5));
        let (sb, sf) = to_bf16(&rng.normals((kk - 1) * c, 0.0, 1.0));
        let mut want = vec![0f32; t * c];
        let mut want_state = sf.clone();
        ops::causal_conv1d_silu(&xf, &wf, &mut want_state, t, c, kk, &mut want);
        let (x, w) = (g.upload(&xb).unwrap(), g.upload(&wb).unwrap());
        let mut st = g.upload(&sb).unwrap();
        let mut out = g.zeros::<bf16>(t * c).unwrap();
        g.conv1d_prefill(&x, &w, &mut st, &mut out, t, c, kk)
            .unwrap();
        let got = from_bf16(&g.download(&out).unwrap());
        check_elementwise("conv1d_prefill", &format!("t{t}_c{c}_k{kk}"), &got, &want);
        // The state holds inputs, so it is exact.
        assert_eq!(
            from_bf16(&g.download(&st).unwrap()),
            want_state,
            "rolled state"
        );
    }
}

#[test]
fn conv1d_update_matches_cpu_per_slot() {
    let Some(g) = gpu("conv1d_update_matches_cpu_per_slot") else {
        return;
    };
    let mut rng = Rng::new(31);
    let (c, kk, slots_n) = (8192, 4, 5);
    let slots: Vec<u32> = vec![3, 0, 4, 9]; // 9 is out of range: zero output, nothing touched
    let b = slots.len();
    let (xb, xf) = to_bf16(&rng.normals(b * c, 0.0, 1.0));
    let (wb, wf) = to_bf16(&rng.normals(c * kk, 0.0, 0.5));
    let (pb, pf) = to_bf16(&rng.normals(slots_n * (kk - 1) * c, 0.0, 1.0));
    let mut want_pool = pf.clone();
    let mut want = vec![0f32; b * c];
    let sl = (kk - 1) * c;
    for (i, &s) in slots.iter().enumerate() {
        let s = s as usize;
        if s < slots_n {
            ops::causal_conv1d_silu(
                &xf[i * c..(i + 1) * c],
                &wf,
                &mut want_pool[s * sl..(s + 1) * sl],
                1,
                c,
                kk,
                &mut want[i * c..(i + 1) * c],
            );
        }
    }
    let (x, w, sd) = (
        g.upload(&xb).unwrap(),
        g.upload(&wb).unwrap(),
        g.upload(&slots).unwrap(),
    );
    let mut pool = g.upload(&pb).unwrap();
    let mut out = g.zeros::<bf16>(b * c).unwrap();
    g.conv1d_update(&x, &w, &mut pool, &sd, &mut out, b, c, kk)
        .unwrap();
    let got = from_bf16(&g.download(&out).unwrap());
    check_elementwise("conv1d_update", &format!("b{b}_c{c}_k{kk}"), &got, &want);
    assert_eq!(
        from_bf16(&g.download(&pool).unwrap()),
        want_pool,
        "state pool"
    );
}
