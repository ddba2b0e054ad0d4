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
    // Qwen3-Next's conv_dim 8192 with kernel 4, small widths, kernel 2; chunks shorter than kernel − 1
    // exercise the state shift, an empty chunk and an out-of-range slot (7: zero output) are skipped.
    let lens = [9usize, 2, 1, 0, 17, 3];
    let slots = [3u32, 0, 5, 1, 7, 2];
    let slots_n = 6;
    for &(c, kk) in &[(8192usize, 4usize), (300, 4), (64, 2)] {
        // Sequences in order, one row of no sequence between neighbours.
        let mut starts = Vec::new();
        let mut rows = 0;
        for &l in &lens {
            starts.push(rows);
            rows += l + 1;
        }
        let sl = (kk - 1) * c;
        let (xb, xf) = to_bf16(&rng.normals(rows * c, 0.0, 1.0));
        let (wb, wf) = to_bf16(&rng.normals(c * kk, 0.0, 0.5));
        let (pb, pf) = to_bf16(&rng.normals(slots_n * sl, 0.0, 1.0));
        let mut want = vec![0f32; rows * c];
        let mut want_pool = pf.clone();
        for ((&s0, &t), &slot) in starts.iter().zip(&lens).zip(&slots) {
            let slot = slot as usize;
            if slot < slots_n && t > 0 {
                ops::causal_conv1d_silu(
                    &xf[s0 * c..(s0 + t) * c],
                    &wf,
                    &mut want_pool[slot * sl..(slot + 1) * sl],
                    t,
                    c,
                    kk,
                    &mut want[s0 * c..(s0 + t) * c],
                );
            }
        }
        let as_u32 = |x: &[usize]| x.iter().map(|&v| v as u32).collect::<Vec<_>>();
        let (x, w) = (g.upload(&xb).unwrap(), g.upload(&wb).unwrap());
        let (st, ln, sd) = (
            g.upload(&as_u32(&starts)).unwrap(),
            g.upload(&as_u32(&lens)).unwrap(),
            g.upload(&slots).unwrap(),
        );
        let mut pool = g.upload(&pb).unwrap();
        let mut out = g.zeros::<bf16>(rows * c).unwrap();
        let max_len = lens.iter().copied().max().unwrap();
        g.conv1d_prefill(
            &x,
            &w,
            &mut pool,
            &st,
            &ln,
            &sd,
            &mut out,
            rows,
            lens.len(),
            max_len,
            c,
            kk,
        )
        .unwrap();
        let got = from_bf16(&g.download(&out).unwrap());
        // Rows of no sequence and of the bad slot stay zero: `want` holds zeros there.
        check_elementwise(
            "conv1d_prefill",
            &format!("t9+2+1+0+17+3_c{c}_k{kk}"),
            &got,
            &want,
        );
        // The states hold inputs, so they are exact; the slot of the empty chunk and slot 4 (not in
        // the step) untouched.
        assert_eq!(
            from_bf16(&g.download(&pool).unwrap()),
            want_pool,
            "rolled states"
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
