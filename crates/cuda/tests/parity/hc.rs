//! The hyper-connections' gated residual (`Backend::hc_residual`, spec §4) on the CUDA backend against
//! the CPU backend's op sequence (`hc_residual_ops`): decode-sized steps take the two fused kernels
//! (`hc_down_inject_silu`, `hc_up_gate_mix`), a larger step the same op sequence on the device. The
//! updated streams are compared. A decode step's gated residual with the next sublayer's pre-mix and
//! norm (`Backend::hc_residual_premix_norm`) pre-mixes in the second fused kernel: bit for bit the
//! device's three calls, and near the CPU's. `bench_hc_residual` (ignored) times the paths at the real
//! shape.

use sanmai_config::QuantScheme;
use sanmai_cpu::CpuBackend;
use sanmai_cuda::CudaWeight;
use sanmai_model::backend::{hc_residual_ops, hc_residual_premix_norm_ops, HcNext, HcWeights};
use sanmai_model::Backend;
use sanmai_weights::quant::quantize;

use crate::bench::time;
use crate::common::{check_reduction, to_bf16, Rng};

/// One sublayer's random hyper-connection weights on a backend: `down` `[rank, h]` and `up`
/// `[s·h, rank]` INT8 with one scale per row, `inject` `[rank, h]` bf16 (values given as f32).
fn weights<B: Backend>(
    b: &B,
    down: &[f32],
    inject: &[f32],
    up: &[f32],
    (s, h, rank): (usize, usize, usize),
) -> HcWeights<B::Weight> {
    let int8 = QuantScheme {
        bits: 8,
        group_size: 0,
    };
    HcWeights {
        pre: b.weight(vec![0.0; s], &[s]).unwrap(),
        down: b
            .packed_weight(&quantize("down", down, rank, h, int8).unwrap())
            .unwrap(),
        inject: b.weight(inject.to_vec(), &[rank, h]).unwrap(),
        up: b
            .packed_weight(&quantize("up", up, s * h, rank, int8).unwrap())
            .unwrap(),
    }
}

/// The gated residual on backend `b`: the streams `r0` `[rows, S·H]`, `x` and `y` `[rows, H]`
/// uploaded, the updated streams on the host.
fn residual<B: Backend>(
    b: &B,
    (rows, s): (usize, usize),
    (r0, x, y): (&[f32], &[f32], &[f32]),
    w: &HcWeights<B::Weight>,
) -> Vec<f32> {
    let h = x.len() / rows;
    let mut r = b.upload(rows, s * h, r0.to_vec()).unwrap();
    let x = b.upload(rows, h, x.to_vec()).unwrap();
    let y = b.upload(rows, h, y.to_vec()).unwrap();
    b.hc_residual(&mut r, &x, &y, w).unwrap();
    b.to_host(r).unwrap().2
}

/// The real shape (S 4, H 2560, rank 256) and a small odd one, at 1, 2, 5 and 8 rows (the fused
/// kernels) and 12 rows (the op sequence).
#[test]
fn hc_residual_matches_cpu() {
    let test = "hc_residual_matches_cpu";
    let Some(b) = crate::options::backend(test) else {
        return;
    };
    let cpu = CpuBackend::default();
    let mut rng = Rng::new(73);
    for (s, h, rank) in [(4usize, 2560usize, 256usize), (2, 96, 32)] {
        let down = rng.normals(rank * h, 0.0, (h as f32).powf(-0.5));
        let inject = to_bf16(&rng.normals(rank * h, 0.0, (h as f32).powf(-0.5))).1;
        let up = rng.normals(s * h * rank, 0.0, 2.0 * (rank as f32).powf(-0.5));
        let wg = weights(&b, &down, &inject, &up, (s, h, rank));
        let wc = weights(&cpu, &down, &inject, &up, (s, h, rank));
        assert!(
            matches!(
                (&wg.down, &wg.inject, &wg.up),
                (
                    CudaWeight::Packed(_),
                    CudaWeight::Bf16(_),
                    CudaWeight::Packed(_)
                )
            ),
            "weights not in the fused kernels' formats"
        );
        for rows in [1usize, 2, 5, 8, 12] {
            let x = to_bf16(&rng.normals(rows * h, 0.0, 1.0)).1;
            let y = to_bf16(&rng.normals(rows * h, 0.0, 1.0)).1;
            let r0 = to_bf16(&rng.normals(rows * s * h, 0.0, 0.5)).1;
            let got = residual(&b, (rows, s), (&r0, &x, &y), &wg);
            let want = residual(&cpu, (rows, s), (&r0, &x, &y), &wc);
            let shape = format!("s{s}_h{h}_rank{rank}_rows{rows}");
            check_reduction("hc_residual", &shape, &got, &want);
        }
    }
}

/// The inputs of a gated residual and the next sublayer's pre-mix and norm: `rows` rows of streams
/// `[S·h]`, `x` and `y` `[h]`, the norm weight `[h]` and the pre-mix logits `[S]`.
struct StepInputs {
    rows: usize,
    r0: Vec<f32>,
    x: Vec<f32>,
    y: Vec<f32>,
    pre: Vec<f32>,
    norm: Vec<f32>,
}

/// The inputs uploaded to backend `b`: streams, x, y, then the pre-mix logits and the norm weight.
fn uploads<B: Backend>(b: &B, i: &StepInputs) -> ([B::Tensor; 3], [B::Weight; 2]) {
    let (h, s) = (i.norm.len(), i.pre.len());
    let up = |cols, v: &Vec<f32>| b.upload(i.rows, cols, v.clone()).unwrap();
    (
        [up(s * h, &i.r0), up(h, &i.x), up(h, &i.y)],
        [
            b.weight(i.pre.clone(), &[s]).unwrap(),
            b.weight(i.norm.clone(), &[h]).unwrap(),
        ],
    )
}

/// The next sublayer of weights `[pre, norm]`.
fn next<W>([pre, norm]: &[W; 2]) -> HcNext<'_, W> {
    HcNext {
        pre,
        norm,
        eps: 1e-6,
        offset: 1.0,
    }
}

/// `hc_residual_premix_norm` on backend `b` (`ops`: the trait's three calls, else the backend's
/// own): the updated streams, the pre-mixed input and its norm, on the host.
fn step<B: Backend>(b: &B, i: &StepInputs, w: &HcWeights<B::Weight>, ops: bool) -> [Vec<f32>; 3] {
    let ([mut r, x, y], nw) = uploads(b, i);
    let (xn, hn) = match ops {
        true => hc_residual_premix_norm_ops(b, &mut r, (&x, &y), w, next(&nw)),
        false => b.hc_residual_premix_norm(&mut r, (&x, &y), w, next(&nw)),
    }
    .unwrap();
    [r, xn, hn].map(|t| b.to_host(t).unwrap().2)
}

/// The real shape (S 4, H 2560, rank 256), the 80B's width with 3 streams and a small one, at 1 and 5
/// rows: the pre-mix in the gated residual's kernel (`hc_residual_premixed` takes each) against the
/// device's three calls bit for bit, and against the CPU's.
#[test]
fn hc_residual_premix_norm_matches_ops() {
    let test = "hc_residual_premix_norm_matches_ops";
    let Some(b) = crate::options::backend(test) else {
        return;
    };
    let cpu = CpuBackend::default();
    let mut rng = Rng::new(83);
    for (s, h, rank) in [(4usize, 2560usize, 256usize), (3, 2048, 256), (2, 96, 32)] {
        let down = rng.normals(rank * h, 0.0, (h as f32).powf(-0.5));
        let inject = to_bf16(&rng.normals(rank * h, 0.0, (h as f32).powf(-0.5))).1;
        let up = rng.normals(s * h * rank, 0.0, 2.0 * (rank as f32).powf(-0.5));
        let wg = weights(&b, &down, &inject, &up, (s, h, rank));
        let wc = weights(&cpu, &down, &inject, &up, (s, h, rank));
        for rows in [1usize, 5] {
            let i = StepInputs {
                rows,
                r0: to_bf16(&rng.normals(rows * s * h, 0.0, 0.5)).1,
                x: to_bf16(&rng.normals(rows * h, 0.0, 1.0)).1,
                y: to_bf16(&rng.normals(rows * h, 0.0, 1.0)).1,
                pre: rng.normals(s, 0.0, 1.0),
                norm: to_bf16(&rng.normals(h, 0.0, 0.1)).1,
            };
            let shape = format!("s{s}_h{h}_rank{rank}_rows{rows}");
            // The fused kernels take the step (not the three calls' fallback).
            let ([mut r, x, y], nw) = uploads(&b, &i);
            let fused = b.hc_residual_premixed(&mut r, (&x, &y), &wg, &next(&nw));
            assert!(fused.unwrap().is_some(), "{test}: {shape} not fused");
            let got = step(&b, &i, &wg, false);
            let ops = step(&b, &i, &wg, true);
            let want = step(&cpu, &i, &wc, true);
            for (k, name) in ["streams", "x", "hn"].iter().enumerate() {
                let differ = got[k]
                    .iter()
                    .zip(&ops[k])
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(
                    differ, 0,
                    "{test}: {shape} {name}: {differ} values differ from the device's three calls"
                );
                check_reduction(
                    "hc_residual_premix_norm",
                    &format!("{shape}_{name}"),
                    &got[k],
                    &want[k],
                );
            }
        }
    }
}

/// Timing of the gated residual at the real shape (S 4, H 2560, rank 256) for 1 and 8 rows: the two
/// fused kernels against the six-op sequence, with the weight bytes one pass reads.
#[test]
#[ignore]
fn bench_hc_residual() {
    let test = "bench_hc_residual";
    let Some(b) = crate::options::backend(test) else {
        return;
    };
    let (s, h, rank) = (4usize, 2560usize, 256usize);
    let mut rng = Rng::new(79);
    let down = rng.normals(rank * h, 0.0, (h as f32).powf(-0.5));
    let inject = to_bf16(&rng.normals(rank * h, 0.0, (h as f32).powf(-0.5))).1;
    let up = rng.normals(s * h * rank, 0.0, (rank as f32).powf(-0.5));
    let w = weights(&b, &down, &inject, &up, (s, h, rank));
    // INT8 down and up with one f32 scale a row, bf16 inject.
    let bytes = rank * h + 4 * rank + 2 * rank * h + s * h * rank + 4 * s * h;
    for rows in [1usize, 8] {
        let x = b.upload(rows, h, rng.normals(rows * h, 0.0, 1.0)).unwrap();
        let y = b.upload(rows, h, rng.normals(rows * h, 0.0, 1.0)).unwrap();
        let mut r = b
            .upload(rows, s * h, rng.normals(rows * s * h, 0.0, 0.5))
            .unwrap();
        let fused = time(b.gpu(), 20, 200, || {
            b.hc_residual(&mut r, &x, &y, &w).unwrap()
        });
        let ops = time(b.gpu(), 20, 200, || {
            hc_residual_ops(&b, &mut r, &x, &y, &w).unwrap()
        });
        println!(
            "BENCH hc_residual s={s} h={h} rank={rank} rows={rows} bytes={bytes} fused_us={:.2} \
             ops_us={:.2} fused_GB/s={:.0}",
            fused * 1e6,
            ops * 1e6,
            bytes as f64 / fused / 1e9
        );
    }
    // One row's gated residual with the next pre-mix and norm: the pre-mix in the residual's kernel
    // against the three calls.
    let nw = [
        b.weight(rng.normals(s, 0.0, 1.0), &[s]).unwrap(),
        b.weight(rng.normals(h, 0.0, 0.1), &[h]).unwrap(),
    ];
    let x = b.upload(1, h, rng.normals(h, 0.0, 1.0)).unwrap();
    let y = b.upload(1, h, rng.normals(h, 0.0, 1.0)).unwrap();
    let mut r = b.upload(1, s * h, rng.normals(s * h, 0.0, 0.5)).unwrap();
    let one = time(b.gpu(), 20, 200, || {
        b.hc_residual_premix_norm(&mut r, (&x, &y), &w, next(&nw))
            .unwrap();
    });
    let three = time(b.gpu(), 20, 200, || {
        hc_residual_premix_norm_ops(&b, &mut r, (&x, &y), &w, next(&nw)).unwrap();
    });
    println!(
        "BENCH hc_residual_premix_norm s={s} h={h} rank={rank} bytes={bytes} premixed_us={:.2} three_calls_us={:.2}",
        one * 1e6,
        three * 1e6
    );
}
