//! The fused decode MoE (`CudaBackend::moe_fuses_shared`): the shared expert as one more expert of the
//! routed experts' grouped GEMVs (and at one row its gate as one more router row), against the CPU
//! backend running the same call (which computes what the call leaves out itself), and against the
//! GPU's unfused launches (the shared expert's output and gate computed apart, in bf16), for bf16,
//! INT4, INT8 and FP8 experts at decode batch sizes; and the gate alone as a router row beside a
//! shared expert of another format (INT4 experts, an INT6 shared expert: the 80B dummy mix).

use sanmai_config::{Fp8Config, QuantScheme};
use sanmai_cpu::CpuBackend;
use sanmai_cuda::CudaBackend;
use sanmai_model::backend::{MlpWeights, MoeCall, MoeWeights, SharedExpert, SharedFusion};
use sanmai_model::Backend;
use sanmai_weights::fp8;
use sanmai_weights::quant::quantize;

use crate::common::{check_composite, to_bf16, Rng};
use crate::moe_gemm::fp8_random;

/// Experts' and the shared expert's format: bf16, packed `(bits, group)`, or FP8 with square blocks.
#[derive(Clone, Copy, Debug)]
pub enum Format {
    Bf16,
    Packed(u32, usize),
    Fp8(usize),
}

/// One `[n, k]` weight of `format` on both backends (the same values).
fn weight<B: Backend>(b: &B, rng: &mut Rng, format: Format, n: usize, k: usize) -> B::Weight {
    let scale = (k as f32).powf(-0.5);
    match format {
        Format::Bf16 => b
            .weight(to_bf16(&rng.normals(n * k, 0.0, scale)).1, &[n, k])
            .unwrap(),
        Format::Packed(bits, group_size) => {
            let v = rng.normals(n * k, 0.0, scale);
            let p = quantize("w", &v, n, k, QuantScheme { bits, group_size }).unwrap();
            b.packed_weight(&p).unwrap()
        }
        Format::Fp8(block) => {
            let (q, s) = fp8_random(rng, n, k, block);
            let c = Fp8Config {
                block: [block, block],
                not_converted: Vec::new(),
            };
            b.packed_weight(&fp8::packed("w", &q, &s, &[n, k], &c).unwrap())
                .unwrap()
        }
    }
}

/// A MoE layer of `e` experts (top `k`, hidden `h`, intermediate `i`) of format `f` with a shared
/// expert of format `fs` and a gate, built twice from the same seed: once per backend.
pub fn layer<B: Backend>(
    b: &B,
    seed: u64,
    (f, fs): (Format, Format),
    (h, i, e, k): (usize, usize, usize, usize),
) -> MoeWeights<B::Weight> {
    let mut rng = Rng::new(seed);
    let mlp = |rng: &mut Rng, f| MlpWeights {
        gate_up: weight(b, rng, f, 2 * i, h),
        down: weight(b, rng, f, h, i),
        inter: i,
    };
    let experts = (0..e).map(|_| mlp(&mut rng, f)).collect();
    let shared = Some(mlp(&mut rng, fs));
    let router = to_bf16(&rng.normals(e * h, 0.0, 0.3)).1;
    let gate = to_bf16(&rng.normals(h, 0.0, 0.3)).1;
    MoeWeights {
        router: b.weight(router, &[e, h]).unwrap(),
        experts,
        top_k: k,
        renormalize: true,
        shared,
        shared_gate: Some(b.weight(gate, &[1, h]).unwrap()),
    }
}

/// `moe_experts` on `x` `[t, h]` with the shared expert, leaving to the backend what `fusion` says
/// (the output, the gate logits) and computing the rest as the model does.
pub fn run<B: Backend>(
    b: &B,
    w: &MoeWeights<B::Weight>,
    t: usize,
    x: &[f32],
    fusion: SharedFusion,
) -> Vec<f32> {
    let xt = b.upload(t, x.len() / t, x.to_vec()).unwrap();
    let m = w.shared.as_ref().unwrap();
    let gate = matches!(fusion, SharedFusion::Apart | SharedFusion::Expert)
        .then(|| b.linear(&xt, w.shared_gate.as_ref().unwrap()).unwrap());
    let apart = matches!(fusion, SharedFusion::Apart | SharedFusion::Gate).then(|| {
        b.linear(
            &b.swiglu(&b.linear(&xt, &m.gate_up).unwrap()).unwrap(),
            &m.down,
        )
        .unwrap()
    });
    let y = b
        .moe_experts(&MoeCall {
            x: &xt,
            w,
            shared: Some(SharedExpert {
                y: apart.as_ref(),
                gate: gate.as_ref(),
            }),
        })
        .unwrap();
    b.to_host(y).unwrap().2
}

/// The CUDA backend with the fused decode launches on (`None`, said, without a GPU).
pub fn fused_backend(test: &str) -> Option<CudaBackend> {
    match CudaBackend::new(0, &crate::options::cuda_options()) {
        Ok(b) => {
            b.set_fused_decode(true);
            Some(b)
        }
        Err(e) => {
            eprintln!("skipped: {test}: {e}");
            None
        }
    }
}

#[test]
fn backend_moe_fused_shared_matches_cpu() {
    let test = "backend_moe_fused_shared_matches_cpu";
    let Some(b) = fused_backend(test) else {
        return;
    };
    let cpu = CpuBackend::default();
    // (format, hidden, inter, experts, top_k): INT4 g128 takes the tensor-core GEMVs with the fused
    // SwiGLU, INT8 per row and bf16 the plain ones, FP8 its own.
    let cases = [
        (Format::Packed(4, 128), 256, 128, 32, 4),
        (Format::Packed(8, 0), 256, 128, 32, 4),
        (Format::Bf16, 256, 128, 16, 2),
        (Format::Fp8(128), 256, 128, 32, 4),
    ];
    let mut rng = Rng::new(71);
    for (case, &(f, h, i, e, k)) in cases.iter().enumerate() {
        let seed = 700 + case as u64;
        let wg = layer(&b, seed, (f, f), (h, i, e, k));
        let wc = layer(&cpu, seed, (f, f), (h, i, e, k));
        for t in [1usize, 3, 4] {
            // One row takes the one-launch decode routing, which computes the gate's logit too.
            let fusion = b.moe_fuses_shared(&wg, t);
            let expect = if t == 1 {
                SharedFusion::ExpertAndGate
            } else {
                SharedFusion::Expert
            };
            assert_eq!(fusion, expect, "{f:?} t {t}");
            assert_eq!(cpu.moe_fuses_shared(&wc, t), SharedFusion::Apart);
            let x = to_bf16(&rng.normals(t * h, 0.0, 1.0)).1;
            let fused = run(&b, &wg, t, &x, fusion);
            let want = run(&cpu, &wc, t, &x, fusion);
            let apart = run(&b, &wg, t, &x, SharedFusion::Apart);
            if t == 1 {
                // The gate alone fused, the shared expert's output computed by the GEMVs.
                let expert_only = run(&b, &wg, t, &x, SharedFusion::Expert);
                let shape = format!("{f:?}_h{h}_i{i}_e{e}_k{k}_t{t}");
                check_composite(
                    "moe_fused_gate_vs_expert_only",
                    &shape,
                    &fused,
                    &expert_only,
                );
            }
            let shape = format!("{f:?}_h{h}_i{i}_e{e}_k{k}_t{t}");
            check_composite("moe_fused_shared", &shape, &fused, &want);
            check_composite("moe_fused_vs_apart", &shape, &fused, &apart);
        }
        // Off, the backend asks for the shared expert's output.
        b.set_fused_decode(false);
        assert_eq!(b.moe_fuses_shared(&wg, 1), SharedFusion::Apart);
        b.set_fused_decode(true);
    }
    // Batches past 4 rows and prefill-sized steps keep the shared expert apart.
    let f = Format::Packed(4, 128);
    let w = layer(&b, 1, (f, f), (256, 128, 32, 4));
    assert_eq!(b.moe_fuses_shared(&w, 5), SharedFusion::Apart);
    assert_eq!(b.moe_fuses_shared(&w, 9), SharedFusion::Apart);
}

/// A shared expert the routed experts' launches do not take (INT6 per row beside INT4 g128 experts,
/// as in the 80B dummy mix): at one row its gate is one more row of the one-launch decode routing
/// (its logit rounded to bf16 as the gate's own GEMV rounds it, its sum taken in the routing's
/// order), its output computed apart; past one row everything is apart.
#[test]
fn backend_moe_gate_fused_beside_an_apart_shared_expert_matches_cpu() {
    let test = "backend_moe_gate_fused_beside_an_apart_shared_expert_matches_cpu";
    let Some(b) = fused_backend(test) else {
        return;
    };
    // The one-launch MoE layer (moe_layer.rs) takes this layer at one row when it is on.
    b.set_moe_layer(false);
    let cpu = CpuBackend::default();
    let formats = (Format::Packed(4, 128), Format::Packed(6, 0));
    let dims = (256, 128, 32, 4);
    let wg = layer(&b, 801, formats, dims);
    let wc = layer(&cpu, 801, formats, dims);
    assert_eq!(b.moe_fuses_shared(&wg, 1), SharedFusion::Gate);
    assert_eq!(b.moe_fuses_shared(&wg, 2), SharedFusion::Apart);
    let mut rng = Rng::new(81);
    for _ in 0..3 {
        let x = to_bf16(&rng.normals(256, 0.0, 1.0)).1;
        let fused = run(&b, &wg, 1, &x, SharedFusion::Gate);
        let want = run(&cpu, &wc, 1, &x, SharedFusion::Gate);
        let apart = run(&b, &wg, 1, &x, SharedFusion::Apart);
        let shape = "int4_g128_experts_int6_shared_h256_i128_e32_k4_t1";
        check_composite("moe_gate_fused", shape, &fused, &want);
        check_composite("moe_gate_fused_vs_apart", shape, &fused, &apart);
    }
    b.set_fused_decode(false);
    assert_eq!(b.moe_fuses_shared(&wg, 1), SharedFusion::Apart);
}
