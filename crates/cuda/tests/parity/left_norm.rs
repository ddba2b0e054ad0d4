//! Norms a one-launch layer leaves to the next launch (`CudaBackend::set_left_norm`, `MlNormIn` in
//! layer.cuh): a decode chain of a GDN mixer, a MoE layer and a second GDN mixer, each adding to one
//! residual and norming it for the next, gives the same bits with the norms left to the next launch
//! (the MoE and second GDN launches norm their input rows as they stage them; the last row is written
//! out before it is read) as with every launch norming its own output; and so does every row of the
//! chain read back afterwards. The norm the fused gated residual of hyper-connections leaves at one
//! row (`Backend::hc_residual_premix_norm`) is taken the same way by the GDN mixer and the MoE layer
//! after it, with `rms_norm_bf16`'s sum: the same bits as that launch.

use sanmai_model::backend::{GdnMixerCall, GdnShape, HcNext, MoeCall, SeqChunk, SharedExpert};
use sanmai_model::Backend;

use crate::common::{to_bf16, Rng};
use crate::moe_fused::{fused_backend, Format};

#[test]
fn left_norms_give_the_same_bits() {
    let test = "left_norms_give_the_same_bits";
    let Some(b) = fused_backend(test) else {
        return;
    };
    // The 80B's widths (INT8 GDN projections, h 2048; INT4 experts of 512, top 10, 64 of them, an
    // INT6 shared expert), and a small one.
    let cases = [
        (2048, (16, 32, 128, 128), 512, 64, 10),
        (256, (2, 4, 64, 32), 128, 32, 4),
    ];
    for (case, &(h, (hk, hv, dk, dv), inter, e, k)) in cases.iter().enumerate() {
        let sh = GdnShape {
            num_k_heads: hk,
            num_v_heads: hv,
            k_head_dim: dk,
            v_head_dim: dv,
            conv_kernel: 4,
        };
        b.init_cache(&crate::gdn_layer::spec(&sh)).unwrap();
        let seed = 1300 + case as u64;
        let gdn = [
            crate::gdn_layer::layer(&b, seed, (8, 0), h, &sh),
            crate::gdn_layer::layer(&b, seed + 1, (8, 0), h, &sh),
        ];
        let moe = crate::moe_fused::layer(
            &b,
            seed + 2,
            (Format::Packed(4, 128), Format::Packed(6, 0)),
            (h, inter, e, k),
        );
        let mut rng = Rng::new(seed + 3);
        let nw: Vec<_> = (0..3)
            .map(|_| {
                b.weight(to_bf16(&rng.normals(h, 1.0, 0.2)).1, &[h])
                    .unwrap()
            })
            .collect();
        let slots = [b.alloc_state().unwrap(), b.alloc_state().unwrap()];
        for pos in 0..4 {
            let x = to_bf16(&rng.normals(h, 0.0, 1.0)).1;
            let acc0 = to_bf16(&rng.normals(h, 0.0, 1.0)).1;
            let mut runs = Vec::new();
            for (left, &slot) in [true, false].iter().zip(&slots) {
                b.set_left_norm(*left);
                let blocks = [0u32];
                let seqs = [SeqChunk {
                    start: 0,
                    len: 1,
                    pos0: pos,
                    state: slot,
                    blocks: &blocks,
                }];
                let call = |layer: usize, x| GdnMixerCall {
                    layer,
                    shape: &sh,
                    x,
                    w: &gdn[layer],
                    eps: 1e-6,
                    seqs: &seqs,
                };
                let mut acc = b.upload(1, h, acc0.clone()).unwrap();
                let x0 = b.upload(1, h, x.clone()).unwrap();
                assert!(b.gdn_mixer_whole(&gdn[0], &sh, 1), "{test}: one launch");
                let hn1 = b
                    .gdn_mixer_add_rms_norm(&call(0, &x0), &mut acc, &nw[0], 1e-6, 1.0)
                    .unwrap();
                let moe_call = MoeCall {
                    x: &hn1,
                    w: &moe,
                    shared: Some(SharedExpert {
                        y: None,
                        gate: None,
                    }),
                };
                let hn2 = b
                    .moe_experts_add_rms_norm(&moe_call, &mut acc, &nw[1], 1e-6, 1.0)
                    .unwrap();
                let hn3 = b
                    .gdn_mixer_add_rms_norm(&call(1, &hn2), &mut acc, &nw[2], 1e-6, 1.0)
                    .unwrap();
                let mut rows = vec![b.to_host(hn3).unwrap().2, b.to_host(acc).unwrap().2];
                rows.push(b.to_host(hn2).unwrap().2);
                rows.push(b.to_host(hn1).unwrap().2);
                runs.push(rows);
            }
            b.set_left_norm(true);
            let names = [
                "last normed row",
                "residual",
                "MoE's normed row",
                "first normed row",
            ];
            for (i, name) in names.iter().enumerate() {
                assert!(
                    runs[0][i] == runs[1][i],
                    "{test}: h {h} pos {pos}: the {name} differs with the norms left"
                );
                assert!(
                    runs[0][i].iter().any(|v| *v != 0.0),
                    "{test}: {name} is all zeros"
                );
            }
            println!("PARITY left_norm h{h}_pos{pos} identical");
        }
    }
}

/// A 125B-shaped chain (h 2560, 4 streams, rank 256; GDN heads 16/48 of 128, INT4 experts of 640) and
/// a small one: a gated residual whose norm a GDN mixer takes, then one whose norm a MoE layer
/// takes. Every row of the chain (the normed rows too, written by the launches that took them) is
/// the same with the norms left as with the norm launched apart.
#[test]
fn hc_left_norms_give_the_same_bits() {
    let test = "hc_left_norms_give_the_same_bits";
    let Some(b) = fused_backend(test) else {
        return;
    };
    let cases = [
        (2560, 4, 256, (16, 48, 128, 128), 640, 64, 10),
        (256, 4, 32, (2, 4, 64, 32), 128, 32, 4),
    ];
    for (case, &(h, s, rank, (hk, hv, dk, dv), inter, e, k)) in cases.iter().enumerate() {
        let sh = GdnShape {
            num_k_heads: hk,
            num_v_heads: hv,
            k_head_dim: dk,
            v_head_dim: dv,
            conv_kernel: 4,
        };
        b.init_cache(&crate::gdn_layer::spec(&sh)).unwrap();
        let seed = 1400 + case as u64;
        let gdn = crate::gdn_layer::layer(&b, seed, (8, 0), h, &sh);
        let moe = crate::moe_fused::layer(
            &b,
            seed + 1,
            (Format::Packed(4, 128), Format::Packed(6, 0)),
            (h, inter, e, k),
        );
        let mut rng = Rng::new(seed + 2);
        let hc: Vec<_> = (0..2)
            .map(|_| {
                let down = rng.normals(rank * h, 0.0, 0.05);
                let inject = rng.normals(rank * h, 0.0, 0.05);
                let up = rng.normals(s * h * rank, 0.0, 0.05);
                crate::hc::weights(&b, &down, &inject, &up, (s, h, rank))
            })
            .collect();
        let pre = b.weight(rng.normals(s, 0.0, 1.0), &[s]).unwrap();
        let nw: Vec<_> = (0..2)
            .map(|_| {
                b.weight(to_bf16(&rng.normals(h, 1.0, 0.2)).1, &[h])
                    .unwrap()
            })
            .collect();
        let next = |norm| HcNext {
            pre: &pre,
            norm,
            eps: 1e-6,
            offset: 1.0,
        };
        let slots = [b.alloc_state().unwrap(), b.alloc_state().unwrap()];
        for pos in 0..3 {
            let r0 = to_bf16(&rng.normals(s * h, 0.0, 1.0)).1;
            let x = to_bf16(&rng.normals(h, 0.0, 1.0)).1;
            let y = to_bf16(&rng.normals(h, 0.0, 1.0)).1;
            let mut runs = Vec::new();
            for (left, &slot) in [true, false].iter().zip(&slots) {
                b.set_left_norm(*left);
                let blocks = [0u32];
                let seqs = [SeqChunk {
                    start: 0,
                    len: 1,
                    pos0: pos,
                    state: slot,
                    blocks: &blocks,
                }];
                let mut r = b.upload(1, s * h, r0.clone()).unwrap();
                let x0 = b.upload(1, h, x.clone()).unwrap();
                let y0 = b.upload(1, h, y.clone()).unwrap();
                let (xn1, hn1) = b
                    .hc_residual_premix_norm(&mut r, (&x0, &y0), &hc[0], next(&nw[0]))
                    .unwrap();
                assert!(b.gdn_mixer_whole(&gdn, &sh, 1), "{test}: one launch");
                let y1 = b
                    .gdn_mixer(&GdnMixerCall {
                        layer: 0,
                        shape: &sh,
                        x: &hn1,
                        w: &gdn,
                        eps: 1e-6,
                        seqs: &seqs,
                    })
                    .unwrap();
                let (xn2, hn2) = b
                    .hc_residual_premix_norm(&mut r, (&xn1, &y1), &hc[1], next(&nw[1]))
                    .unwrap();
                let moe_call = MoeCall {
                    x: &hn2,
                    w: &moe,
                    shared: Some(SharedExpert {
                        y: None,
                        gate: None,
                    }),
                };
                let y2 = b.moe_experts(&moe_call).unwrap();
                runs.push([y2, hn2, xn2, y1, hn1, xn1, r].map(|t| b.to_host(t).unwrap().2));
            }
            b.set_left_norm(true);
            let names = [
                "MoE output",
                "second normed row",
                "second pre-mixed row",
                "GDN output",
                "first normed row",
                "first pre-mixed row",
                "streams",
            ];
            for (i, name) in names.iter().enumerate() {
                assert!(
                    runs[0][i] == runs[1][i],
                    "{test}: h {h} pos {pos}: the {name} differs with the norms left"
                );
                assert!(
                    runs[0][i].iter().any(|v| *v != 0.0),
                    "{test}: {name} is all zeros"
                );
            }
            println!("PARITY hc_left_norm h{h}_pos{pos} identical");
        }
    }
}
