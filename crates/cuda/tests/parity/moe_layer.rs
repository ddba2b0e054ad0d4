//! The one-launch MoE layer (`moe_layer.cu`, `CudaBackend::moe_layer_takes`): a MoE step of one row
//! (and of 2 and 8: the multi-row form) with INT4 experts and a packed shared expert in one persistent
//! launch, against the CPU backend running the same call, and against the GPU's separate launches
//! (the layer launch off), at small shapes and at the 80B's and the 125B's; with the residual add and
//! the next norm; without a shared expert; and launch after launch (its counters left at 0).

use sanmai_cpu::CpuBackend;
use sanmai_model::backend::{MoeCall, MoeWeights, SharedExpert, SharedFusion};
use sanmai_model::Backend;

use crate::common::{check_composite, to_bf16, Rng};
use crate::moe_fused::{fused_backend, layer, run, Format};

/// `moe_experts_add_rms_norm` on `x` `[t, h]` with the residual `acc0` and norm weight `nw` (`[h]`),
/// the shared expert left to the backend as `fusion` says: (the residual after, the normed rows).
fn run_add_norm<B: Backend>(
    b: &B,
    w: &MoeWeights<B::Weight>,
    x: &[f32],
    (acc0, nw): (&[f32], &[f32]),
    fusion: SharedFusion,
) -> (Vec<f32>, Vec<f32>) {
    let h = nw.len();
    let t = x.len() / h;
    let xt = b.upload(t, h, x.to_vec()).unwrap();
    let mut acc = b.upload(t, h, acc0.to_vec()).unwrap();
    let nw = b.weight(nw.to_vec(), &[h]).unwrap();
    let m = w.shared.as_ref();
    let gate = (w.shared.is_some() && matches!(fusion, SharedFusion::Apart | SharedFusion::Expert))
        .then(|| b.linear(&xt, w.shared_gate.as_ref().unwrap()).unwrap());
    let apart = m
        .filter(|_| matches!(fusion, SharedFusion::Apart | SharedFusion::Gate))
        .map(|m| {
            b.linear(
                &b.swiglu(&b.linear(&xt, &m.gate_up).unwrap()).unwrap(),
                &m.down,
            )
            .unwrap()
        });
    let call = MoeCall {
        x: &xt,
        w,
        shared: w.shared.as_ref().map(|_| SharedExpert {
            y: apart.as_ref(),
            gate: gate.as_ref(),
        }),
    };
    let normed = b
        .moe_experts_add_rms_norm(&call, &mut acc, &nw, 1e-6, 1.0)
        .unwrap();
    (b.to_host(acc).unwrap().2, b.to_host(normed).unwrap().2)
}

/// `w` without its shared expert.
fn strip_shared<W>(mut w: MoeWeights<W>) -> MoeWeights<W> {
    w.shared = None;
    w.shared_gate = None;
    w
}

/// `t` rows of `h` bf16 values.
fn x_rows(rng: &mut Rng, t: usize, h: usize) -> Vec<f32> {
    to_bf16(&rng.normals(t * h, 0.0, 1.0)).1
}

/// The layer launch on rows `x` (`wg` on the GPU backend `b`, layer launch on) against the CPU
/// backend (`wc`) and against the GPU's separate launches, without and with the residual add and
/// the next norm; and launched twice, the same bits.
fn check_rows(
    b: &sanmai_cuda::CudaBackend,
    (wg, wc): (
        &MoeWeights<sanmai_cuda::CudaWeight>,
        &MoeWeights<<CpuBackend as Backend>::Weight>,
    ),
    (x, h): (&[f32], usize),
    shape: &str,
    rng: &mut Rng,
) {
    let cpu = CpuBackend::default();
    let t = x.len() / h;
    let got = run(b, wg, t, x, SharedFusion::ExpertAndGate);
    // Launch after launch the same bits: the grid barriers' counters are back at 0.
    let again = run(b, wg, t, x, SharedFusion::ExpertAndGate);
    assert_eq!(got, again, "moe_layer relaunch {shape}");
    let want = run(&cpu, wc, t, x, SharedFusion::ExpertAndGate);
    check_composite("moe_layer", shape, &got, &want);
    b.set_moe_layer(false);
    let fusion = b.moe_fuses_shared(wg, t);
    let apart = run(b, wg, t, x, fusion);
    b.set_moe_layer(true);
    check_composite("moe_layer_vs_launches", shape, &got, &apart);

    // With the residual add and the next norm.
    let acc0 = to_bf16(&rng.normals(t * h, 0.0, 1.0)).1;
    let nw = to_bf16(&rng.normals(h, 0.0, 0.2)).1;
    let (acc, normed) = run_add_norm(b, wg, x, (&acc0, &nw), SharedFusion::ExpertAndGate);
    let (acc_c, normed_c) = run_add_norm(&cpu, wc, x, (&acc0, &nw), SharedFusion::ExpertAndGate);
    check_composite("moe_layer_add_norm_residual", shape, &acc, &acc_c);
    check_composite("moe_layer_add_norm", shape, &normed, &normed_c);
}

#[test]
fn backend_moe_layer_launch_matches_cpu() {
    let test = "backend_moe_layer_launch_matches_cpu";
    let Some(b) = fused_backend(test) else {
        return;
    };
    b.set_moe_layer(true);
    let cpu = CpuBackend::default();
    let int4 = Format::Packed(4, 128);
    // (shared expert's format, hidden, inter, experts, top_k): small shapes with an INT6 per-row,
    // an INT4 g128 and an INT8 per-row shared expert; 512 experts, top 10 (the top-k's widest); the
    // 80B's and the 125B's hidden and intermediate sizes (64 of their 512 experts, which the CPU
    // builds in a fraction of the time).
    let cases = [
        (Format::Packed(6, 0), 256, 128, 32, 4),
        (Format::Packed(4, 128), 512, 256, 64, 8),
        (Format::Packed(8, 0), 256, 128, 32, 4),
        (Format::Packed(6, 0), 256, 128, 512, 10),
        (Format::Packed(6, 0), 2048, 512, 64, 10),
        (Format::Packed(6, 0), 2560, 640, 64, 10),
    ];
    let mut rng = Rng::new(91);
    for (case, &(fs, h, i, e, k)) in cases.iter().enumerate() {
        let seed = 900 + case as u64;
        let wg = layer(&b, seed, (int4, fs), (h, i, e, k));
        let wc = layer(&cpu, seed, (int4, fs), (h, i, e, k));
        // One row, and the multi-row form at 2 rows and at its most, 8.
        for (t, runs) in [(1, 2), (2, 1), (8, 1)] {
            let shape = format!("int4_g128_shared{fs:?}_h{h}_i{i}_e{e}_k{k}_t{t}");
            assert_eq!(
                b.moe_fuses_shared(&wg, t),
                SharedFusion::ExpertAndGate,
                "{shape}"
            );
            for _ in 0..runs {
                check_rows(
                    &b,
                    (&wg, &wc),
                    (&x_rows(&mut rng, t, h), h),
                    &shape,
                    &mut rng,
                );
            }
        }
    }

    // A layer without a shared expert.
    let (h, i, e, k) = (256, 128, 32, 4);
    let wg = strip_shared(layer(&b, 990, (int4, int4), (h, i, e, k)));
    let wc = strip_shared(layer(&cpu, 990, (int4, int4), (h, i, e, k)));
    for t in [1, 8] {
        assert!(b.moe_layer_takes(&wg, t));
        let x = x_rows(&mut rng, t, h);
        let xg = b.upload(t, h, x.clone()).unwrap();
        let xc = cpu.upload(t, h, x.clone()).unwrap();
        let call_g = MoeCall {
            x: &xg,
            w: &wg,
            shared: None,
        };
        let call_c = MoeCall {
            x: &xc,
            w: &wc,
            shared: None,
        };
        let got = b.to_host(b.moe_experts(&call_g).unwrap()).unwrap().2;
        let want = cpu.to_host(cpu.moe_experts(&call_c).unwrap()).unwrap().2;
        check_composite(
            "moe_layer_no_shared",
            &format!("int4_g128_h256_i128_e32_k4_t{t}"),
            &got,
            &want,
        );
    }

    // Off, or past eight rows, the layer keeps its separate launches.
    let wg = layer(&b, 900, (int4, Format::Packed(6, 0)), (256, 128, 32, 4));
    assert!(b.moe_layer_takes(&wg, 8));
    assert!(!b.moe_layer_takes(&wg, 9));
    b.set_moe_layer(false);
    assert!(!b.moe_layer_takes(&wg, 1));
    assert_eq!(b.moe_fuses_shared(&wg, 1), SharedFusion::Gate);
    b.set_moe_layer(true);
}
