//! Timing (ignored by default; `--ignored` runs it) of one GDN layer at Qwen3-Next-80B's shape: the
//! prefill (the multi-sequence causal conv and the chunked delta rule over 1 × 512 and 8 × 512 prompt
//! tokens) and the fused decode step (conv update, delta rule and gated RMSNorm in one launch) at
//! batch 1 and 8, a block a head. Prints `BENCH` lines.

use half::bf16;
use sanmai_cuda::{
    ConvWeight, DecodeSlots, GdnDecodeWeights, GdnDims, GdnGates, GdnPools, GdnProj, SeqRows,
};

use crate::bench::{pattern, time};
use crate::common::gpu;

/// Qwen3-Next's gated-delta-net layer and its conv kernel.
const GDN: GdnDims = GdnDims {
    hk: 16,
    hv: 32,
    dk: 128,
    dv: 128,
};
const CONV_KERNEL: usize = 4;

#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_gdn_prefill() {
    let Some(g) = gpu("bench_gdn_prefill") else {
        return;
    };
    let dims = GDN;
    let (cd, kk, t) = (dims.conv_dim(), CONV_KERNEL, 512usize);
    for n in [1usize, 8] {
        let rows = n * t;
        let x = g.upload(&pattern(rows * cd, 12)).unwrap();
        let w = g.upload(&pattern(cd * kk, 13)).unwrap();
        let a = g.upload(&pattern(rows * dims.hv, 14)).unwrap();
        let b = g.upload(&pattern(rows * dims.hv, 15)).unwrap();
        let a_log = g.upload(&vec![-1.0f32; dims.hv]).unwrap();
        let dt_bias = g.upload(&vec![0.5f32; dims.hv]).unwrap();
        let starts = g
            .upload(&(0..n as u32).map(|i| i * t as u32).collect::<Vec<_>>())
            .unwrap();
        let positions = g
            .upload(&(0..rows as u32).map(|r| r % t as u32).collect::<Vec<_>>())
            .unwrap();
        let lens = g.upload(&vec![t as u32; n]).unwrap();
        let slots = g.upload(&(0..n as u32).collect::<Vec<_>>()).unwrap();
        let mut conv_pool = g.zeros::<bf16>(n * kk * cd).unwrap();
        let mut ssm_pool = g.zeros::<f32>(n * dims.state_len()).unwrap();
        let mut mixed = g.zeros::<bf16>(rows * cd).unwrap();
        let mut out = g.zeros::<bf16>(rows * dims.hv * dims.dv).unwrap();
        let seqs = SeqRows {
            starts: &starts,
            lens: &lens,
            slots: &slots,
            rows,
            n_seq: n,
            max_len: t,
        };
        let conv = ConvWeight {
            w: &w,
            channels: cd,
            kernel: kk,
        };
        let gates = GdnGates {
            a: &a,
            b: &b,
            a_log: &a_log,
            dt_bias: &dt_bias,
        };
        let conv_s = time(g, 2, 20, || {
            g.conv1d_prefill(&x, &conv, &mut conv_pool, &positions, &seqs, &mut mixed)
                .unwrap()
        });
        let gdn_s = time(g, 2, 20, || {
            g.gdn_chunk_prefill(dims, &mixed, &gates, &mut ssm_pool, &seqs, &mut out)
                .unwrap()
        });
        let layer = conv_s + gdn_s;
        println!(
            "BENCH gdn_prefill seqs={n} tokens={rows} hk={} hv={} dk={} dv={} conv_us={:.1} chunk_us={:.1} us_per_layer={:.1} tokens_per_s={:.0}",
            dims.hk,
            dims.hv,
            dims.dk,
            dims.dv,
            conv_s * 1e6,
            gdn_s * 1e6,
            layer * 1e6,
            rows as f64 / layer
        );
    }
}

#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_gdn_decode() {
    let Some(g) = gpu("bench_gdn_decode") else {
        return;
    };
    let dims = GDN;
    let (cd, kk, hv, dv) = (dims.conv_dim(), CONV_KERNEL, dims.hv, dims.dv);
    for batch in [1usize, 8] {
        let qkv = g.upload(&pattern(batch * cd, 9)).unwrap();
        let z = g.upload(&pattern(batch * hv * dv, 16)).unwrap();
        let a = g.upload(&pattern(batch * hv, 10)).unwrap();
        let b = g.upload(&pattern(batch * hv, 11)).unwrap();
        let conv = g.upload(&pattern(cd * kk, 13)).unwrap();
        let a_log = g.upload(&vec![-1.0f32; hv]).unwrap();
        let dt_bias = g.upload(&vec![0.5f32; hv]).unwrap();
        let norm = g.upload(&vec![bf16::ONE; dv]).unwrap();
        let w = GdnDecodeWeights {
            conv: &conv,
            kernel: kk,
            a_log: &a_log,
            dt_bias: &dt_bias,
            norm: &norm,
            eps: 1e-6,
        };
        let proj = GdnProj {
            qkv: &qkv,
            z: &z,
            a: &a,
            b: &b,
        };
        let mut conv_pool = g.zeros::<bf16>(batch * kk * cd).unwrap();
        let mut ssm_pool = g.zeros::<f32>(batch * dims.state_len()).unwrap();
        let slots = g.upload(&(0..batch as u32).collect::<Vec<_>>()).unwrap();
        let positions = g.upload(&vec![1000u32; batch]).unwrap();
        let mut out = g.zeros::<bf16>(batch * hv * dv).unwrap();
        let secs = time(g, 3, 50, || {
            let pools = GdnPools {
                conv: &mut conv_pool,
                ssm: &mut ssm_pool,
            };
            let seqs = DecodeSlots {
                slots: &slots,
                positions: &positions,
                batch,
            };
            g.gdn_decode(dims, &proj, &w, pools, &seqs, &mut out)
                .unwrap()
        });
        // The recurrent state read and written once; the conv ring's K − 1 entries read and one
        // written, the projection rows, z and the output.
        let bytes = 2 * batch * dims.state_len() * 4 + batch * (kk * cd + cd + 2 * hv * dv) * 2;
        println!(
            "BENCH gdn_decode b={batch} hk={} hv={hv} dk={} dv={dv} k={kk} bytes={bytes} time_us={:.1} GB/s={:.0}",
            dims.hk,
            dims.dk,
            secs * 1e6,
            bytes as f64 / secs / 1e9
        );
    }
}
