//! Timing (ignored by default; `--ignored` runs it) of the one-launch GDN mixer (`gdn_layer.cu`) at
//! the 80B's shape (hidden 2048, 16 key and 32 value heads of 128, INT8 per-row projections) and the
//! 125B's (hidden 2560, 48 value heads): microseconds a launch (CUDA events around back-to-back
//! launches, the position and input rotating), GB/s of the bytes it must read and write, and block
//! 0's phase times from the kernel's trace (medians over single launches). Prints `BENCH` lines.

use half::bf16;
use sanmai_cuda::cudarc::driver::CudaSlice;
use sanmai_cuda::{
    CombineInto, DecodeSlots, GdnDecodeWeights, GdnDims, GdnLayer, GdnLayerBufs, GdnPools,
    PackedMat, PackedScheme,
};

use crate::bench::{cold_launches_into, int8_proj as proj, pattern, time, trace_medians};
use crate::common::gpu;

/// Inputs the timed launches rotate through.
const INPUTS: usize = 8;
/// Conv taps.
const CONV: usize = 4;

#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_gdn_layer() {
    let Some(g) = gpu("bench_gdn_layer") else {
        return;
    };
    for (h, hv) in [(2048usize, 32usize), (2560, 48)] {
        let dims = GdnDims {
            hk: 16,
            hv,
            dk: 128,
            dv: 128,
        };
        let (cd, ko) = (dims.conv_dim(), hv * dims.dv);
        let int8 = PackedScheme {
            bits: 8,
            group_size: 0,
        };
        let (qw, qs) = proj(g, cd, h, 1);
        let (zw, zs) = proj(g, ko, h, 2);
        let (ow, os) = proj(g, h, ko, 3);
        let mat = |words, scales, n, k| PackedMat {
            words,
            scales,
            scheme: int8,
            n,
            k,
        };
        let w_b = g.upload(&pattern(hv * h, 4)).unwrap();
        let w_a = g.upload(&pattern(hv * h, 5)).unwrap();
        let conv = g.upload(&pattern(cd * CONV, 6)).unwrap();
        let a_log = g.upload(&vec![0.5f32; hv]).unwrap();
        let dt_bias = g.upload(&vec![1.0f32; hv]).unwrap();
        let norm = g.upload(&pattern(dims.dv, 7)).unwrap();
        let layer = GdnLayer {
            dims,
            qkv: mat(&qw, &qs, cd, h),
            z: mat(&zw, &zs, ko, h),
            w_b: &w_b,
            w_a: &w_a,
            step: GdnDecodeWeights {
                conv: &conv,
                kernel: CONV,
                a_log: &a_log,
                dt_bias: &dt_bias,
                norm: &norm,
                eps: 1e-6,
            },
            out: mat(&ow, &os, h, ko),
        };
        let mut conv_pool = g.zeros::<bf16>(CONV * cd).unwrap();
        let mut ssm = g.zeros::<f32>(dims.state_len()).unwrap();
        let slots = g.upload(&[0u32]).unwrap();
        let positions: Vec<CudaSlice<u32>> = (0..INPUTS as u32)
            .map(|p| g.upload(&[p]).unwrap())
            .collect();
        let xs: Vec<CudaSlice<bf16>> = (0..INPUTS)
            .map(|i| g.upload(&pattern(h, 100 + i as u32)).unwrap())
            .collect();
        let mut qkv = g.zeros::<bf16>(cd).unwrap();
        let mut z = g.zeros::<bf16>(ko).unwrap();
        let mut ab = g.zeros::<f32>(2 * hv).unwrap();
        let mut o = g.zeros::<f32>(ko).unwrap();
        let mut partials = g.zeros::<f32>(g.moe_layer_max_blocks()).unwrap();
        let mut sync = g.zeros::<u32>(2).unwrap();
        let mut trace = g.zeros::<u64>(16).unwrap();
        let mut acc = g.upload(&pattern(h, 11)).unwrap();
        let nw = g.upload(&pattern(h, 12)).unwrap();
        let mut normed = g.zeros::<bf16>(h).unwrap();
        let mut launch = |i: usize, trace: Option<&mut CudaSlice<u64>>| {
            let bufs = GdnLayerBufs {
                qkv: &mut qkv,
                z: &mut z,
                ab: &mut ab,
                o: &mut o,
                partials: &mut partials,
                sync: &mut sync,
                trace,
            };
            let pools = GdnPools {
                conv: &mut conv_pool,
                ssm: &mut ssm,
            };
            let seq = DecodeSlots {
                slots: &slots,
                positions: &positions[i % INPUTS],
                batch: 1,
            };
            let into = CombineInto::AddNorm {
                acc: &mut acc,
                w: &nw,
                normed: &mut normed,
                eps: 1e-6,
                offset: 1.0,
            };
            g.gdn_layer_decode(&layer, &xs[i % INPUTS], pools, &seq, bufs, into)
                .unwrap();
        };
        let mut call = 0usize;
        let us = 1e6
            * time(g, INPUTS, 20 * INPUTS, || {
                launch(call, None);
                call += 1;
            });
        // The three projections (words and scales), the gates, the state read and written.
        let bytes = (cd + ko) * (h + 4) + h * (ko + 4) + 2 * hv * h * 2 + 2 * 4 * dims.state_len();
        // Block 0's phases over single launches.
        let phases = trace_medians(40, "gdn_layer", |i| {
            launch(i, Some(&mut trace));
            g.download(&trace).unwrap()
        });
        // The same after writing more than L2 (weights and code from DRAM, as in a decode step).
        let (cold, cold_phases) = cold_launches_into(g, "gdn_layer", &mut trace, &mut launch);
        // The counters are back at 0 after the launches.
        let sync_after = g.download(&sync).unwrap();
        assert_eq!(
            sync_after,
            [0, 0],
            "the grid barrier counters after the launches"
        );
        println!(
            "BENCH gdn_layer h={h} hv={hv} bytes={bytes} us={us:.2} GB/s={:.0} phases_us: {phases} \
             cold_us={cold:.2} cold_phases_us: {cold_phases}",
            bytes as f64 / us / 1e3,
        );
    }
}
