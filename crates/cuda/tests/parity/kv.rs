//! Attention input preparation (`qk_norm_rope`: per-head RMSNorm + partial NeoX RoPE, gate split) against
//! `sanmai_cpu::ops::rms_norm` + `rope_neox`, and the K/V pool write against an index copy.

use half::bf16;
use sanmai_cpu::ops;
use sanmai_cuda::{HeadLayout, HeadNorm, KvPools, RopeArgs};

use crate::common::{check_elementwise, from_bf16, gpu, to_bf16, Rng};

#[test]
fn qk_norm_rope_matches_cpu() {
    let Some(g) = gpu("qk_norm_rope_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(40);
    // (rows, heads, head_dim, rot_dim, fused [q | gate] input)
    for &(t, nh, d, rot, fused) in &[
        (5, 4, 32, 8, true),
        (7, 2, 32, 8, false),
        (3, 16, 256, 64, true),
        (2, 2, 128, 128, false),
        (4, 3, 64, 0, true),
    ] {
        let hs = if fused { 2 * d } else { d };
        let (xb, xf) = to_bf16(&rng.normals(t * nh * hs, 0.0, 2.0));
        let (wb, wf) = to_bf16(&rng.normals(d, 0.0, 0.3));
        let pos: Vec<u32> = (0..t).map(|_| rng.below(100_000)).collect();
        let inv_freq: Vec<f32> = (0..rot / 2)
            .map(|j| 10_000f32.powf(-(2.0 * j as f32) / rot as f32))
            .collect();
        let (eps, mscale) = (1e-6, 1.1f32);
        // CPU: split, norm, rope in f32.
        let mut q = vec![0f32; t * nh * d];
        let mut gate = vec![0f32; t * nh * d];
        for r in 0..t {
            for h in 0..nh {
                let src = &xf[(r * nh + h) * hs..];
                q[(r * nh + h) * d..(r * nh + h + 1) * d].copy_from_slice(&src[..d]);
                if fused {
                    gate[(r * nh + h) * d..(r * nh + h + 1) * d].copy_from_slice(&src[d..2 * d]);
                }
            }
        }
        ops::rms_norm(&mut q, &wf, d, eps, 1.0);
        ops::rope_neox(&mut q, nh, d, rot, &pos, &inv_freq, mscale);

        let x = g.upload(&xb).unwrap();
        let w = g.upload(&wb).unwrap();
        let p = g.upload(&pos).unwrap();
        let f = g
            .upload(if inv_freq.is_empty() {
                &[0.0f32][..]
            } else {
                &inv_freq
            })
            .unwrap();
        let mut out = g.zeros::<bf16>(t * nh * d).unwrap();
        let mut gout = g.zeros::<bf16>(t * nh * d).unwrap();
        let layout = HeadLayout {
            rows: t,
            n_heads: nh,
            head_dim: d,
            row_stride: nh * hs,
            head_stride: hs,
        };
        let rope = RopeArgs {
            positions: &p,
            inv_freq: &f,
            rot_dim: rot,
            mscale,
        };
        let mut gv = gout.slice_mut(..);
        g.qk_norm_rope(
            &x,
            layout,
            &HeadNorm { w: &w, eps },
            &rope,
            &mut out,
            fused.then_some(&mut gv),
        )
        .unwrap();
        let shape = format!("t{t}_h{nh}_d{d}_rot{rot}_fused{fused}");
        check_elementwise(
            "qk_norm_rope",
            &shape,
            &from_bf16(&g.download(&out).unwrap()),
            &q,
        );
        if fused {
            let got = from_bf16(&g.download(&gout).unwrap());
            assert_eq!(got, gate, "gate split {shape}");
        }
    }
}

#[test]
fn kv_write_places_rows() {
    let Some(g) = gpu("kv_write_places_rows") else {
        return;
    };
    let mut rng = Rng::new(41);
    let (rows, row_elems, pool_rows) = (9, 64, 40);
    let (kb, _) = to_bf16(&rng.normals(rows * row_elems, 0.0, 1.0));
    let (vb, _) = to_bf16(&rng.normals(rows * row_elems, 0.0, 1.0));
    let (pk0, _) = to_bf16(&rng.normals(pool_rows * row_elems, 0.0, 1.0));
    // Distinct destinations; two rows skipped (u32::MAX and one beyond the pool).
    let mut dst: Vec<u32> = (0..rows as u32)
        .map(|i| (i * 7 + 3) % pool_rows as u32)
        .collect();
    dst[2] = u32::MAX;
    dst[5] = pool_rows as u32;
    let k = g.upload(&kb).unwrap();
    let v = g.upload(&vb).unwrap();
    let mut kp = g.upload(&pk0).unwrap();
    let mut vp = g.upload(&pk0).unwrap();
    let d = g.upload(&dst).unwrap();
    let pools = KvPools {
        k: &mut kp,
        v: &mut vp,
    };
    g.kv_write(&k, &v, pools, &d, rows, row_elems).unwrap();
    let (mut wk, mut wv) = (pk0.clone(), pk0.clone());
    for (r, &t) in dst.iter().enumerate() {
        if (t as usize) < pool_rows {
            let t = t as usize;
            wk[t * row_elems..(t + 1) * row_elems]
                .copy_from_slice(&kb[r * row_elems..(r + 1) * row_elems]);
            wv[t * row_elems..(t + 1) * row_elems]
                .copy_from_slice(&vb[r * row_elems..(r + 1) * row_elems]);
        }
    }
    assert_eq!(g.download(&kp).unwrap(), wk);
    assert_eq!(g.download(&vp).unwrap(), wv);
    println!("PARITY op=kv_write shape=rows{rows}_row{row_elems}_pool{pool_rows} exact=true");
}
