//! RMSNorm (both kinds), the gated RMSNorm and NeoX partial RoPE against the CPU ops.

use sanmai_cpu::ops;
use sanmai_cuda::{HeadLayout, NormRows, RopeArgs};

use crate::common::{check_elementwise, from_bf16, gpu, to_bf16, Rng};

#[test]
fn rms_norm_matches_cpu() {
    let Some(g) = gpu("rms_norm_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(1);
    // Vector kernels: one decode row of 2048 and 2560, batch 8, prefill rows, small heads (several rows a
    // block, slots narrower than a warp), the widest vector row (8192); the `_any` kernel: d = 100, 2, and
    // d = 8200 (past the vector kernels' limit).
    for &(rows, d) in &[
        (1, 2048),
        (7, 4096),
        (33, 128),
        (5, 100),
        (3, 2),
        (1, 2560),
        (8, 2048),
        (300, 2048),
        (2, 8),
        (65, 256),
        (3, 8192),
        (2, 8200),
    ] {
        for (offset, w_mean) in [(1.0f32, 0.0f32), (0.0, 1.0)] {
            let (xb, xf) = to_bf16(&rng.normals(rows * d, 0.0, 2.0));
            let (wb, wf) = to_bf16(&rng.normals(d, w_mean, 0.2));
            let eps = 1e-6;
            let mut want = xf.clone();
            ops::rms_norm(&mut want, &wf, d, eps, offset);
            let (x, w) = (g.upload(&xb).unwrap(), g.upload(&wb).unwrap());
            let mut y = g.zeros(rows * d).unwrap();
            g.rms_norm(&x, &w, &mut y, NormRows { rows, d, eps }, offset)
                .unwrap();
            let got = from_bf16(&g.download(&y).unwrap());
            let kind = if offset == 1.0 {
                "zero_centred"
            } else {
                "plain"
            };
            check_elementwise(
                &format!("rms_norm_{kind}"),
                &format!("{rows}x{d}"),
                &got,
                &want,
            );
        }
    }
}

#[test]
fn gated_rms_norm_matches_cpu() {
    let Some(g) = gpu("gated_rms_norm_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(2);
    // Vector kernel: a decode step's 32 heads of 128, batch 8, prefill; the `_any` kernel: d = 100.
    for &(rows, d) in &[
        (96, 128),
        (5, 256),
        (3, 100),
        (32, 128),
        (256, 128),
        (4099, 128),
        (2, 2048),
    ] {
        let (xb, xf) = to_bf16(&rng.normals(rows * d, 0.0, 1.5));
        let (zb, zf) = to_bf16(&rng.normals(rows * d, 0.0, 2.0));
        let (wb, wf) = to_bf16(&rng.normals(d, 1.0, 0.2));
        let mut want = xf.clone();
        ops::gated_rms_norm(&mut want, &zf, &wf, d, 1e-6);
        let (x, z, w) = (
            g.upload(&xb).unwrap(),
            g.upload(&zb).unwrap(),
            g.upload(&wb).unwrap(),
        );
        let mut y = g.zeros(rows * d).unwrap();
        let shape = NormRows { rows, d, eps: 1e-6 };
        g.gated_rms_norm(&x, &z, &w, &mut y, shape).unwrap();
        let got = from_bf16(&g.download(&y).unwrap());
        check_elementwise("gated_rms_norm", &format!("{rows}x{d}"), &got, &want);
    }
}

fn inv_freq(rot_dim: usize, theta: f64) -> Vec<f32> {
    (0..rot_dim / 2)
        .map(|j| theta.powf(-(2.0 * j as f64) / rot_dim as f64) as f32)
        .collect()
}

#[test]
fn rope_neox_matches_cpu() {
    let Some(g) = gpu("rope_neox_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(3);
    // (tokens, heads, head_dim, rot_dim, mscale): Qwen3-Next's partial rotary (64 of 256), full rotary.
    for &(t, nh, hd, rot, mscale) in &[
        (5, 16, 256, 64, 1.0f32),
        (9, 2, 256, 64, 1.0),
        (3, 4, 128, 128, 1.1),
    ] {
        let width = nh * hd;
        let (xb, xf) = to_bf16(&rng.normals(t * width, 0.0, 1.0));
        let pos: Vec<u32> = (0..t).map(|_| rng.below(200_000)).collect();
        let freqs = inv_freq(rot, 1e7);
        let mut want = xf.clone();
        ops::rope_neox(&mut want, nh, hd, rot, &pos, &freqs, mscale);
        let mut x = g.upload(&xb).unwrap();
        let (p, f) = (g.upload(&pos).unwrap(), g.upload(&freqs).unwrap());
        let layout = HeadLayout {
            rows: t,
            n_heads: nh,
            head_dim: hd,
            row_stride: width,
            head_stride: hd,
        };
        let rope = RopeArgs {
            positions: &p,
            inv_freq: &f,
            rot_dim: rot,
            mscale,
        };
        g.rope_neox(&mut x, layout, &rope).unwrap();
        let got = from_bf16(&g.download(&x).unwrap());
        check_elementwise(
            "rope_neox",
            &format!("t{t}_h{nh}_d{hd}_r{rot}"),
            &got,
            &want,
        );
    }
}

#[test]
fn rope_neox_strided_rotates_only_the_query_half() {
    let Some(g) = gpu("rope_neox_strided_rotates_only_the_query_half") else {
        return;
    };
    let mut rng = Rng::new(4);
    let (t, nh, hd, rot) = (4, 8, 256, 64);
    // [t, nh, (q | gate)] as q_proj of the gated attention produces.
    let (xb, xf) = to_bf16(&rng.normals(t * nh * 2 * hd, 0.0, 1.0));
    let pos: Vec<u32> = (0..t as u32).map(|i| 1000 + 17 * i).collect();
    let freqs = inv_freq(rot, 1e7);
    let mut q: Vec<f32> = xf
        .chunks_exact(2 * hd)
        .flat_map(|h| h[..hd].to_vec())
        .collect();
    ops::rope_neox(&mut q, nh, hd, rot, &pos, &freqs, 1.0);
    let mut x = g.upload(&xb).unwrap();
    let (p, f) = (g.upload(&pos).unwrap(), g.upload(&freqs).unwrap());
    // q heads inside fused [q | gate] rows.
    let layout = HeadLayout {
        rows: t,
        n_heads: nh,
        head_dim: hd,
        row_stride: nh * 2 * hd,
        head_stride: 2 * hd,
    };
    let rope = RopeArgs {
        positions: &p,
        inv_freq: &f,
        rot_dim: rot,
        mscale: 1.0,
    };
    g.rope_neox(&mut x, layout, &rope).unwrap();
    let got = from_bf16(&g.download(&x).unwrap());
    let got_q: Vec<f32> = got
        .chunks_exact(2 * hd)
        .flat_map(|h| h[..hd].to_vec())
        .collect();
    check_elementwise(
        "rope_neox_strided",
        &format!("t{t}_h{nh}_d{hd}_r{rot}"),
        &got_q,
        &q,
    );
    for (a, b) in got.chunks_exact(2 * hd).zip(xf.chunks_exact(2 * hd)) {
        assert_eq!(&a[hd..], &b[hd..], "the gate half must be untouched");
    }
    // A buffer one element short of the strided extent (the last head's query half) is an error,
    // not an out-of-bounds write; exactly the extent is enough.
    let extent = (t - 1) * nh * 2 * hd + (nh - 1) * 2 * hd + hd;
    let mut exact = g.zeros::<half::bf16>(extent).unwrap();
    assert!(g.rope_neox(&mut exact, layout, &rope).is_ok());
    let mut short = g.zeros::<half::bf16>(extent - 1).unwrap();
    assert!(g.rope_neox(&mut short, layout, &rope).is_err());
}
