//! The one-launch MoE layer (`moe_layer.cu`, `CudaBackend::moe_layer_takes`): a one-row MoE step with
//! INT4 experts and a packed shared expert in one persistent launch, against the CPU backend running
//! the same call, and against the GPU's separate launches (the layer launch off), at small shapes and
//! at the 80B's and the 125B's; with the residual add and the next norm; without a shared expert; and
//! launch after launch (its counters left at 0).

use sanmai_cpu::CpuBackend;
use sanmai_model::backend::{MoeCall, MoeWeights, SharedExpert, SharedFusion};
use sanmai_model::Backend;

use crate::common::{check_composite, to_bf16, Rng};
use crate::moe_fused::{fused_backend, layer, run, Format};

/// `moe_experts_add_rms_norm` on `x` `[1, h]` with the residual `acc0` and norm weight `nw`, the
/// shared expert left to the backend as `fusion` says: (the residual after, the normed row).
fn run_add_norm<B: Backend>(
    b: &B,
    w: &MoeWeights<B::Weight>,
    x: &[f32],
    (acc0, nw): (&[f32], &[f32]),
    fusion: SharedFusion,
) -> (Vec<f32>, Vec<f32>) {
    let h = x.len();
    let xt = b.upload(1, h, x.to_vec()).unwrap();
    let mut acc = b.upload(1, h, acc0.to_vec()).unwrap();
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
    // builds in a fraction of the time; the 125B's rows outnumber an H100's warps, so some warps
    // take two); top 16 (the most a token takes: two rounds of down rows a row).
    let cases = [
        (Format::Packed(6, 0), 256, 128, 32, 4),
        (Format::Packed(4, 128), 512, 256, 64, 8),
        (Format::Packed(8, 0), 256, 128, 32, 4),
        (Format::Packed(6, 0), 256, 128, 512, 10),
        (Format::Packed(6, 0), 2048, 512, 64, 10),
        (Format::Packed(6, 0), 2560, 640, 64, 10),
        (Format::Packed(4, 128), 256, 128, 64, 16),
    ];
    let mut rng = Rng::new(91);
    for (case, &(fs, h, i, e, k)) in cases.iter().enumerate() {
        let seed = 900 + case as u64;
        let wg = layer(&b, seed, (int4, fs), (h, i, e, k));
        let wc = layer(&cpu, seed, (int4, fs), (h, i, e, k));
        let shape = format!("int4_g128_shared{fs:?}_h{h}_i{i}_e{e}_k{k}_t1");
        assert_eq!(
            b.moe_fuses_shared(&wg, 1),
            SharedFusion::ExpertAndGate,
            "{shape}"
        );
        for _ in 0..2 {
            let x = to_bf16(&rng.normals(h, 0.0, 1.0)).1;
            let got = run(&b, &wg, 1, &x, SharedFusion::ExpertAndGate);
            // Launch after launch the same bits: the grid barriers' counters are back at 0.
            let again = run(&b, &wg, 1, &x, SharedFusion::ExpertAndGate);
            assert_eq!(got, again, "moe_layer relaunch {shape}");
            let want = run(&cpu, &wc, 1, &x, SharedFusion::ExpertAndGate);
            check_composite("moe_layer", &shape, &got, &want);
            b.set_moe_layer(false);
            let fusion = b.moe_fuses_shared(&wg, 1);
            let apart = run(&b, &wg, 1, &x, fusion);
            b.set_moe_layer(true);
            check_composite("moe_layer_vs_launches", &shape, &got, &apart);

            // With the residual add and the next norm.
            let acc0 = to_bf16(&rng.normals(h, 0.0, 1.0)).1;
            let nw = to_bf16(&rng.normals(h, 0.0, 0.2)).1;
            let (acc, normed) =
                run_add_norm(&b, &wg, &x, (&acc0, &nw), SharedFusion::ExpertAndGate);
            let (acc_c, normed_c) =
                run_add_norm(&cpu, &wc, &x, (&acc0, &nw), SharedFusion::ExpertAndGate);
            check_composite("moe_layer_add_norm_residual", &shape, &acc, &acc_c);
            check_composite("moe_layer_add_norm", &shape, &normed, &normed_c);
        }
    }

    // A layer without a shared expert.
    let (h, i, e, k) = (256, 128, 32, 4);
    let wg = strip_shared(layer(&b, 990, (int4, int4), (h, i, e, k)));
    let wc = strip_shared(layer(&cpu, 990, (int4, int4), (h, i, e, k)));
    assert!(b.moe_layer_takes(&wg, 1));
    for _ in 0..2 {
        let x = to_bf16(&rng.normals(h, 0.0, 1.0)).1;
        let xg = b.upload(1, h, x.clone()).unwrap();
        let xc = cpu.upload(1, h, x.clone()).unwrap();
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
            "int4_g128_h256_i128_e32_k4_t1",
            &got,
            &want,
        );
    }

    // Off, or past one row, the layer keeps its separate launches.
    let wg = layer(&b, 900, (int4, Format::Packed(6, 0)), (256, 128, 32, 4));
    assert!(!b.moe_layer_takes(&wg, 2));
    b.set_moe_layer(false);
    assert!(!b.moe_layer_takes(&wg, 1));
    assert_eq!(b.moe_fuses_shared(&wg, 1), SharedFusion::Gate);
    b.set_moe_layer(true);
}
