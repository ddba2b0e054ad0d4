//! Timing (ignored by default; `--ignored` runs it) of the one-launch attention mixer
//! (`attn_layer.cu`) at the 80B's shape (hidden 2048, 16 query heads and 2 KV heads of 256, RoPE over
//! 64, INT8 per-row projections) at contexts of 528 and 16,400 positions: microseconds a launch (CUDA
//! events around back-to-back launches, the input rotating), GB/s of the bytes it must read, and block
//! 0's phase times from the kernel's trace (medians over single launches). Prints `BENCH` lines.

use half::bf16;
use sanmai_cuda::cudarc::driver::CudaSlice;
use sanmai_cuda::{
    AttnDims, AttnLayer, AttnLayerBufs, CombineInto, KvPools, LayerRope, LayerSeq, PackedMat,
    PackedScheme,
};

use crate::bench::{cold_launches_into, int8_proj as proj, pattern, time, trace_medians};
use crate::common::gpu;

/// Inputs the timed launches rotate through.
const INPUTS: usize = 8;
const BS: usize = 16;

#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_attn_layer() {
    let Some(g) = gpu("bench_attn_layer") else {
        return;
    };
    let (h, hq, hkv, d) = (2048usize, 16usize, 2usize, 256usize);
    let dims = AttnDims {
        hq,
        hkv,
        head_dim: d,
        block_size: BS,
    };
    let int8 = PackedScheme {
        bits: 8,
        group_size: 0,
    };
    let (qw, qs) = proj(g, 2 * hq * d, h, 1);
    let (kw, ks) = proj(g, hkv * d, h, 2);
    let (vw, vs) = proj(g, hkv * d, h, 3);
    let (ow, os) = proj(g, h, hq * d, 4);
    let mat = |words, scales, n, k| PackedMat {
        words,
        scales,
        scheme: int8,
        n,
        k,
    };
    let (q_norm, k_norm) = (
        g.upload(&pattern(d, 5)).unwrap(),
        g.upload(&pattern(d, 6)).unwrap(),
    );
    let layer = AttnLayer {
        dims,
        q: mat(&qw, &qs, 2 * hq * d, h),
        k: mat(&kw, &ks, hkv * d, h),
        v: mat(&vw, &vs, hkv * d, h),
        o: mat(&ow, &os, h, hq * d),
        q_norm: &q_norm,
        k_norm: &k_norm,
        head_eps: 1e-6,
    };
    let inv: Vec<f32> = (0..32).map(|j| 1e7f32.powf(-(j as f32) / 32.0)).collect();
    let inv_freq = g.upload(&inv).unwrap();
    let rope = LayerRope {
        inv_freq: &inv_freq,
        rot_dim: 64,
        mscale: 1.0,
    };
    let xs: Vec<CudaSlice<bf16>> = (0..INPUTS)
        .map(|i| g.upload(&pattern(h, 100 + i as u32)).unwrap())
        .collect();
    let splits = g.attn_layer_max_splits(hkv);
    for ctx in [528usize, 16_400] {
        let nb = ctx.div_ceil(BS);
        let mut k_pool = g.upload(&pattern(nb * BS * hkv * d, 7)).unwrap();
        let mut v_pool = g.upload(&pattern(nb * BS * hkv * d, 8)).unwrap();
        let table = g.upload(&(0..nb as u32).collect::<Vec<_>>()).unwrap();
        let lens = g.upload(&[ctx as u32]).unwrap();
        let positions = g.upload(&[ctx as u32 - 1]).unwrap();
        let kv_dst = g.upload(&[ctx as u32 - 1]).unwrap();
        let mut qkv = g.zeros::<bf16>(2 * hq * d + 2 * hkv * d).unwrap();
        let mut attn = g.zeros::<bf16>(hq * d).unwrap();
        let mut part_o = g.zeros::<f32>(hq * splits * d).unwrap();
        let mut part_ml = g.zeros::<f32>(hq * splits * 2).unwrap();
        let mut partials = g.zeros::<f32>(g.moe_layer_max_blocks()).unwrap();
        let mut sync = g.zeros::<u32>(2).unwrap();
        let mut trace = g.zeros::<u64>(16).unwrap();
        let mut acc = g.upload(&pattern(h, 11)).unwrap();
        let nw = g.upload(&pattern(h, 12)).unwrap();
        let mut normed = g.zeros::<bf16>(h).unwrap();
        let mut launch = |i: usize, trace: Option<&mut CudaSlice<u64>>| {
            let bufs = AttnLayerBufs {
                qkv: &mut qkv,
                attn: &mut attn,
                part_o: &mut part_o,
                part_ml: &mut part_ml,
                partials: &mut partials,
                sync: &mut sync,
                trace,
            };
            let seq = LayerSeq {
                pools: KvPools {
                    k: &mut k_pool,
                    v: &mut v_pool,
                },
                lens: &lens,
                positions: &positions,
                kv_dst: &kv_dst,
                table: &table,
                max_blocks: nb,
            };
            let into = CombineInto::AddNorm {
                acc: &mut acc,
                w: &nw,
                normed: &mut normed,
                eps: 1e-6,
                offset: 1.0,
            };
            g.attn_layer_decode(&layer, &xs[i % INPUTS], &rope, seq, bufs, into)
                .unwrap();
        };
        let mut call = 0usize;
        let us = 1e6
            * time(g, INPUTS, 20 * INPUTS, || {
                launch(call, None);
                call += 1;
            });
        // The four projections (words and scales) and the K/V rows of the context.
        let bytes = (2 * hq * d + 2 * hkv * d) * (h + 4) + h * (hq * d + 4) + 2 * ctx * hkv * d * 2;
        let phases = trace_medians(40, "attn_layer", |i| {
            launch(i, Some(&mut trace));
            g.download(&trace).unwrap()
        });
        // The same after writing more than L2 (weights and code from DRAM, as in a decode step).
        let (cold, cold_phases) = cold_launches_into(g, "attn_layer", &mut trace, &mut launch);
        let sync_after = g.download(&sync).unwrap();
        assert_eq!(
            sync_after,
            [0, 0],
            "the grid barrier counters after the launches"
        );
        println!(
            "BENCH attn_layer ctx={ctx} bytes={bytes} us={us:.2} GB/s={:.0} phases_us: {phases} \
             cold_us={cold:.2} cold_phases_us: {cold_phases}",
            bytes as f64 / us / 1e3,
        );
    }
}
