//! The PLE mix on the device against the CPU oracle: the conv's decode form and the backend's `ple_mix`.

use super::*;

#[test]
fn ple_conv_decode_matches_cpu() {
    let Some(b) = backend("ple_conv_decode_matches_cpu") else {
        return;
    };
    let g = b.gpu();
    let mut rng = Rng::new(7);
    for (ns, h, kernel, dil) in [
        (4usize, 64usize, 4usize, 3usize),
        (2, 256, 3, 2),
        (1, 40, 1, 1),
    ] {
        let dims = PleDims {
            streams: ns,
            hidden: h,
            kernel,
            dilation: dil,
        };
        let c = ns * h;
        let past = dims.past();
        let (rows, n_slots) = (5, 8);
        // Distinct slots in a scattered order.
        let slots: Vec<u32> = vec![6, 1, 4, 7, 2];
        let state: Vec<f32> = (0..n_slots * past * c).map(|_| rng.normal()).collect();
        let z: Vec<f32> = (0..rows * c).map(|_| rng.normal()).collect();
        let u: Vec<f32> = (0..rows * c).map(|_| rng.normal()).collect();
        let w = rng.bf16s(c * kernel, 0.0, 0.5);
        let r = rng.bf16s(rows * c, 0.0, 1.0);
        // Without past rows (kernel 1) the pool is a placeholder value.
        let mut pool_d = g
            .upload(if state.is_empty() {
                &[0.0f32][..]
            } else {
                &state
            })
            .unwrap();
        let mut r_d = to_dev(&b, &r);
        let (zd, ud) = (g.upload(&z).unwrap(), g.upload(&u).unwrap());
        let gated = PleGated {
            u: &ud,
            z: &zd,
            rows,
        };
        let slots_d = g.upload(&slots).unwrap();
        g.ple_conv_decode(
            dims,
            &gated,
            &to_dev(&b, &w),
            &mut pool_d,
            &slots_d,
            &mut r_d,
        )
        .unwrap();
        let got_r: Vec<f32> = g
            .download(&r_d)
            .unwrap()
            .iter()
            .map(|x| x.to_f32())
            .collect();
        let got_state = g.download(&pool_d).unwrap();
        let mut want_state = state.clone();
        let mut want_r = vec![0f32; rows * c];
        for (i, &slot) in slots.iter().enumerate() {
            let st = &mut want_state[slot as usize * past * c..(slot as usize + 1) * past * c];
            let mut y = vec![0f32; c];
            cpu::dilated_conv_silu(&z[i * c..(i + 1) * c], &w, st, c, kernel, dil, &mut y);
            for (ch, y) in y.iter().enumerate() {
                let at = i * c + ch;
                want_r[at] = bf16::from_f32(r[at] + (u[at] + y)).to_f32();
            }
        }
        let rel = max_rel(&got_r, &want_r);
        let state_diff = got_state[..want_state.len()]
            .iter()
            .zip(&want_state)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        println!(
            "PARITY op=ple_conv_decode shape=S{ns}_H{h}_k{kernel}_d{dil}_rows{rows} max_rel={rel:.2e} state_values_differing={state_diff} tol=1e-2,exact"
        );
        assert!(rel <= 1e-2, "PLE conv decode off by {rel}");
        assert_eq!(state_diff, 0, "PLE conv states differ");
    }
}

#[test]
fn ple_backend_matches_cpu() {
    let Some(gpu) = backend("ple_backend_matches_cpu") else {
        return;
    };
    let p = Pair {
        gpu,
        cpu: CpuBackend::new(),
    };
    let mut rng = Rng::new(5);
    for (ns, h, e, kernel, dil) in [(1, 64, 64, 4, 3), (4, 64, 64, 4, 3), (2, 256, 320, 3, 2)] {
        let sh = PleShape {
            streams: ns,
            hidden: h,
            row_width: e,
            conv_kernel: kernel,
            conv_dilation: dil,
        };
        p.init(&spec(false, 0, Some(sh)));
        let vec_w = |rng: &mut Rng, mean: f32| p.weight(rng.bf16s(h, mean, 0.2), &[h]);
        let (vw_g, vw_c) = p.weight(rng.bf16s(h * e, 0.0, 0.1), &[h, e]);
        let (vb_g, vb_c) = vec_w(&mut rng, 0.0);
        let (mut key_g, mut key_c, mut kb_g, mut kb_c) = (vec![], vec![], vec![], vec![]);
        let (mut kn_g, mut kn_c, mut qn_g, mut qn_c, mut cn_g, mut cn_c) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        for _ in 0..ns {
            let (a, b) = p.weight(rng.bf16s(h * e, 0.0, 0.1), &[h, e]);
            key_g.push(a);
            key_c.push(b);
            let (a, b) = vec_w(&mut rng, 0.0);
            kb_g.push(a);
            kb_c.push(b);
            let (a, b) = vec_w(&mut rng, 1.0);
            kn_g.push(a);
            kn_c.push(b);
            let (a, b) = vec_w(&mut rng, 1.0);
            qn_g.push(a);
            qn_c.push(b);
            let (a, b) = vec_w(&mut rng, 1.0);
            cn_g.push(a);
            cn_c.push(b);
        }
        let (cw_g, cw_c) = p.weight(rng.bf16s(ns * h * kernel, 0.0, 0.5), &[ns * h, kernel]);
        let w_g = PleWeights {
            value: vw_g,
            value_bias: vb_g,
            key: key_g,
            key_bias: kb_g,
            key_norm: kn_g,
            query_norm: qn_g,
            conv_norm: cn_g,
            conv: cw_g,
        };
        let w_c = PleWeights {
            value: vw_c,
            value_bias: vb_c,
            key: key_c,
            key_bias: kb_c,
            key_norm: kn_c,
            query_norm: qn_c,
            conv_norm: cn_c,
            conv: cw_c,
        };
        // Slot ids per backend (their free lists may differ after the re-init).
        let slots_g = (p.gpu.alloc_state().unwrap(), p.gpu.alloc_state().unwrap());
        let slots_c = (p.cpu.alloc_state().unwrap(), p.cpu.alloc_state().unwrap());
        // One block each: the chunks' positions (from 0, at most 16) fit it.
        let (blocks_a, blocks_b) = (vec![0u32], vec![1u32]);
        let mut worst = 0f32;
        // (a_len, b_len) per step; after step 2, b is forked from a with copy_state.
        let steps: [(usize, usize); 6] = [(13, 5), (1, 2), (7, 0), (1, 1), (1, 9), (2, 1)];
        for (i, (la, lb)) in steps.into_iter().enumerate() {
            if i == 3 {
                p.gpu.copy_state(slots_g.0, slots_g.1).unwrap();
                p.cpu.copy_state(slots_c.0, slots_c.1).unwrap();
            }
            let rows = la + lb;
            let seqs = |(sa, sb): (usize, usize)| {
                [
                    SeqChunk {
                        start: 0,
                        len: la,
                        pos0: 0,
                        state: sa,
                        blocks: &blocks_a,
                    },
                    SeqChunk {
                        start: la,
                        len: lb,
                        pos0: 0,
                        state: sb,
                        blocks: &blocks_b,
                    },
                ]
            };
            let r = rng.bf16s(rows * ns * h, 0.0, 1.0);
            let x = rng.bf16s(rows * e, 0.0, 1.0);
            let g = ple_mix(&p.gpu, &sh, (rows, &r, &x), &w_g, &seqs(slots_g));
            let c = ple_mix(&p.cpu, &sh, (rows, &r, &x), &w_c, &seqs(slots_c));
            worst = worst.max(max_rel(&g, &c));
        }
        println!(
            "PARITY op=ple_mix shape=S{ns}_H{h}_E{e}_k{kernel}_d{dil} max_rel={worst:.2e} tol=1e-2"
        );
        assert!(worst <= 1e-2, "PLE mix off by {worst}");
        p.gpu.free_state(slots_g.0);
        p.gpu.free_state(slots_g.1);
        p.cpu.free_state(slots_c.0);
        p.cpu.free_state(slots_c.1);
    }
}

/// Layer 0's PLE mix on backend `b`: the streams `r` `[rows, S·H]` and table rows `x` `[rows, E]`
/// uploaded, the mixed streams on the host.
fn ple_mix<B: Backend>(
    b: &B,
    shape: &PleShape,
    (rows, r, x): (usize, &[f32], &[f32]),
    w: &PleWeights<B::Weight>,
    seqs: &[SeqChunk<'_>],
) -> Vec<f32> {
    let mut streams = b.upload(rows, shape.channels(), r.to_vec()).unwrap();
    let table_rows = b.upload(rows, shape.row_width, x.to_vec()).unwrap();
    b.ple_mix(
        &mut streams,
        &PleCall {
            layer: 0,
            shape,
            rows: &table_rows,
            w,
            seqs,
        },
    )
    .unwrap();
    b.to_host(streams).unwrap().2
}
