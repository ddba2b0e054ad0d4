//! Timing (ignored by default; `--ignored` runs it) of the one-launch MoE layer (`moe_layer.cu`) at
//! the 80B's shape (hidden 2048, 512 INT4 g128 experts of 512, top 10, an INT6 shared expert of 512)
//! and the 125B's (hidden 2560, experts and shared expert of 640): microseconds a launch (CUDA events
//! around back-to-back launches whose inputs rotate, so the chosen experts change), GB/s of the bytes
//! it must read, and block 0's phase times from the kernel's trace (medians over single launches).
//! Prints `BENCH` lines.

use half::bf16;
use sanmai_cuda::cudarc::driver::CudaSlice;
use sanmai_cuda::{
    CombineInto, Gpu, MoeLayer, MoeLayerBufs, MoeLayerShared, PackedMat, PackedScheme,
};

use crate::bench::{cold_launches, pattern, time, trace_medians};
use crate::bench_moe::{experts, E};
use crate::common::gpu;
use crate::launch::{expert_proj, packed_scheme};

const TOP_K: usize = 10;
/// Inputs the timed launches rotate through.
const INPUTS: usize = 8;

/// A packed `[n, k]` weight of `bits` with per-row scales, random words.
fn shared_proj(
    g: &Gpu,
    bits: u32,
    n: usize,
    k: usize,
    salt: u32,
) -> (CudaSlice<u32>, CudaSlice<f32>) {
    let wpr = k / 32 * bits as usize;
    let words: Vec<u32> = (0..n * wpr)
        .map(|i| (i as u32 ^ salt).wrapping_mul(2_654_435_761))
        .collect();
    let scales: Vec<f32> = (0..n).map(|i| 1e-3 * (1.0 + (i % 7) as f32)).collect();
    (g.upload(&words).unwrap(), g.upload(&scales).unwrap())
}

/// The buffers a launch writes.
struct Bufs {
    logits: CudaSlice<f32>,
    sgu: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
    sdn: CudaSlice<f32>,
    partials: CudaSlice<f32>,
    ids: CudaSlice<u32>,
    wts: CudaSlice<f32>,
    sync: CudaSlice<u32>,
    trace: CudaSlice<u64>,
    acc: CudaSlice<bf16>,
    nw: CudaSlice<bf16>,
    normed: CudaSlice<bf16>,
}

#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_moe_layer() {
    let Some(g) = gpu("bench_moe_layer") else {
        return;
    };
    for (h, inter) in [(2048usize, 512usize), (2560, 640)] {
        let si = inter;
        let gu = experts(g, 4, 128, 2 * inter, h, 3);
        let dn = experts(g, 4, 128, h, inter, 4);
        let int4 = packed_scheme(4, 128);
        let router = g.upload(&pattern(E * h, 7)).unwrap();
        let gate = g.upload(&pattern(h, 8)).unwrap();
        let (sgu_w, sgu_s) = shared_proj(g, 6, 2 * si, h, 9);
        let (sdn_w, sdn_s) = shared_proj(g, 6, h, si, 10);
        let int6 = PackedScheme {
            bits: 6,
            group_size: 0,
        };
        let mat = |words, scales, n, k| PackedMat {
            words,
            scales,
            scheme: int6,
            n,
            k,
        };
        let layer = MoeLayer {
            router: &router,
            gate_up: expert_proj(&gu.w_ptrs, &gu.s_ptrs, int4, 2 * inter, h),
            down: expert_proj(&dn.w_ptrs, &dn.s_ptrs, int4, h, inter),
            experts: E,
            top_k: TOP_K,
            renormalize: true,
            shared: Some(MoeLayerShared {
                gate: &gate,
                gate_up: mat(&sgu_w, &sgu_s, 2 * si, h),
                down: mat(&sdn_w, &sdn_s, h, si),
            }),
        };
        let xs: Vec<CudaSlice<bf16>> = (0..INPUTS)
            .map(|i| g.upload(&pattern(h, 100 + i as u32)).unwrap())
            .collect();
        let mut b = Bufs {
            logits: g.zeros(E + 1).unwrap(),
            sgu: g.zeros(2 * si).unwrap(),
            act: g.zeros(TOP_K * inter).unwrap(),
            sdn: g.zeros(h).unwrap(),
            partials: g.zeros(g.moe_layer_max_blocks()).unwrap(),
            ids: g.zeros(TOP_K).unwrap(),
            wts: g.zeros(TOP_K).unwrap(),
            sync: g.zeros(2).unwrap(),
            trace: g.zeros(16).unwrap(),
            acc: g.upload(&pattern(h, 11)).unwrap(),
            nw: g.upload(&pattern(h, 12)).unwrap(),
            normed: g.zeros(h).unwrap(),
        };
        let launch = |b: &mut Bufs, x: &CudaSlice<bf16>, traced: bool| {
            let bufs = MoeLayerBufs {
                logits: &mut b.logits,
                shared_gate_up: &mut b.sgu,
                shared_down: &mut b.sdn,
                act: &mut b.act,
                ids: &mut b.ids,
                weights: &mut b.wts,
                partials: &mut b.partials,
                sync: &mut b.sync,
                trace: traced.then_some(&mut b.trace),
            };
            let into = CombineInto::AddNorm {
                acc: &mut b.acc,
                w: &b.nw,
                normed: &mut b.normed,
                eps: 1e-6,
                offset: 1.0,
            };
            g.moe_layer_decode(&layer, x, h, bufs, into).unwrap();
        };
        let mut call = 0usize;
        let us = 1e6
            * time(g, INPUTS, 20 * INPUTS, || {
                launch(&mut b, &xs[call % INPUTS], false);
                call += 1;
            });
        // Router, shared expert, ten experts' gate|up and down (words and scales).
        let bytes = E * h * 2
            + h * 2
            + (2 * si * h + h * si) * 6 / 8
            + 3 * h * 4
            + TOP_K * (gu.bytes + dn.bytes);
        // Block 0's phases over single launches.
        let phases = trace_medians(40, "moe_layer", |i| {
            launch(&mut b, &xs[i % INPUTS], true);
            g.download(&b.trace).unwrap()
        });
        // The same after writing more than L2 (weights and code from DRAM, as in a decode step).
        let (cold, cold_phases) = cold_launches(g, "moe_layer", |i, traced| {
            if traced {
                launch(&mut b, &xs[i % INPUTS], true);
                g.download(&b.trace).unwrap()
            } else {
                launch(&mut b, &xs[i % INPUTS], false);
                Vec::new()
            }
        });
        // The counters are back at 0 after the launches.
        let sync_after = g.download(&b.sync).unwrap();
        assert_eq!(
            sync_after,
            [0, 0],
            "the grid barrier counters after the launches"
        );
        println!(
            "BENCH moe_layer h={h} inter={inter} e={E} k={TOP_K} bytes={bytes} us={us:.2} GB/s={:.0} phases_us: {phases} \
             cold_us={cold:.2} cold_phases_us: {cold_phases}",
            bytes as f64 / us / 1e3,
        );
    }
}
