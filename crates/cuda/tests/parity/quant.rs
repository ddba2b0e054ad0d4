//! Packed-integer weights (INT4 / INT8 pack-quantized, INT6 gapless): the decode GEMV, the tile
//! dequantiser and the prefill GEMM against the CPU twin (dequantise, then `sanmai_cpu::ops::matmul_t`),
//! plus (ignored by default) the GEMV timing in GB/s of packed bytes.
//!
//! The packer here is written from the format description alone (a bit stream per row), independent of
//! `sanmai_weights::quant`, whose own tests pin it to the Python quantiser.

use half::bf16;
use sanmai_cpu::ops;
use sanmai_cuda::{Gpu, NormRows, PackedM1, PackedScheme, RowAddNorm};

use crate::common::{check_reduction, from_bf16, gpu, packed_mat, stats, to_bf16, Rng};

/// A packed matrix on the host: words, f32 scales and the f32 weights they stand for.
struct Packed {
    bits: u32,
    group: usize,
    n: usize,
    k: usize,
    words: Vec<u32>,
    scales: Vec<f32>,
    dense: Vec<f32>,
}

fn words_per_row(bits: u32, k: usize) -> usize {
    if bits == 6 {
        k.div_ceil(32) * 6
    } else {
        k.div_ceil(32 / bits as usize)
    }
}

/// Random codes over the whole range and random positive scales, packed LSB-first: INT4/INT8 whole
/// codes per word, INT6 as one bit stream per row padded to 32 values.
fn make(rng: &mut Rng, bits: u32, group: usize, n: usize, k: usize) -> Packed {
    let wpr = words_per_row(bits, k);
    let g = if group == 0 { k } else { group };
    let sc = k.div_ceil(g);
    let scales: Vec<f32> = (0..n * sc).map(|_| 0.002 + 0.01 * rng.unit()).collect();
    let mut words = vec![0u32; n * wpr];
    let mut dense = vec![0f32; n * k];
    let off = 1i32 << (bits - 1);
    for r in 0..n {
        let mut bitpos = 0usize;
        for j in 0..k {
            let code = rng.below(1 << bits);
            dense[r * k + j] = (code as i32 - off) as f32 * scales[r * sc + j / g];
            let (word, shift) = if bits == 6 {
                (bitpos / 32, bitpos % 32)
            } else {
                let per = 32 / bits as usize;
                (j / per, (j % per) * bits as usize)
            };
            let row = &mut words[r * wpr..(r + 1) * wpr];
            row[word] |= code << shift;
            if shift + bits as usize > 32 {
                row[word + 1] |= code >> (32 - shift);
            }
            bitpos += bits as usize;
        }
    }
    Packed {
        bits,
        group,
        n,
        k,
        words,
        scales,
        dense,
    }
}

fn name(p: &Packed, m: usize) -> String {
    format!("q{}_g{}_m{m}_n{}_k{}", p.bits, p.group, p.n, p.k)
}

fn gemv_case(g: &Gpu, rng: &mut Rng, p: &Packed, m: usize, f32_out: bool) {
    let (xb, xf) = to_bf16(&rng.normals(m * p.k, 0.0, 1.0));
    let mut want = vec![0f32; m * p.n];
    ops::matmul_t(&xf, &p.dense, m, p.k, p.n, &mut want);
    let (w, s, x) = (
        g.upload(&p.words).unwrap(),
        g.upload(&p.scales).unwrap(),
        g.upload(&xb).unwrap(),
    );
    let mut y = g.zeros::<bf16>(m * p.n).unwrap();
    g.gemv_packed(
        &packed_mat(&w, &s, (p.bits, p.group), (p.n, p.k)),
        &x,
        &mut y,
        m,
    )
    .unwrap();
    let got = from_bf16(&g.download(&y).unwrap());
    check_reduction("gemv_packed", &name(p, m), &got, &want);
    if f32_out {
        let mut y = g.zeros::<f32>(m * p.n).unwrap();
        g.gemv_packed_f32(
            &packed_mat(&w, &s, (p.bits, p.group), (p.n, p.k)),
            &x,
            &mut y,
            m,
        )
        .unwrap();
        let got = g.download(&y).unwrap();
        check_reduction("gemv_packed_f32", &name(p, m), &got, &want);
    }
}

#[test]
fn gemv_packed_matches_cpu() {
    let Some(g) = gpu("gemv_packed_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(40);
    // Every row count 1..8 on one shape per format.
    for (bits, group, n, k) in [(4, 128, 1003, 2560), (8, 0, 515, 1024), (6, 0, 300, 1000)] {
        let p = make(&mut rng, bits, group, n, k);
        for m in 1..=8 {
            gemv_case(g, &mut rng, &p, m, m == 1);
        }
    }
    for (m, bits, group, n, k) in [
        (1, 4, 128, 4096, 2048),
        (2, 4, 32, 100, 64),
        (5, 4, 0, 64, 256),
        (8, 4, 128, 257, 512),
        (1, 8, 0, 2048, 2048),
        (8, 8, 32, 300, 96),
        (3, 8, 128, 77, 4096),
        (1, 6, 0, 512, 2048),
        (2, 6, 0, 2048, 512),
        (8, 6, 0, 77, 48),
        (6, 6, 0, 129, 2056),
        (7, 6, 8, 64, 40),
        (4, 6, 128, 33, 520),
    ] {
        let p = make(&mut rng, bits, group, n, k);
        gemv_case(g, &mut rng, &p, m, false);
    }
    // Per-chunk scales (groups of 8 and 16 values) at M > 4, and INT6 per-row scales on a k that is
    // not a multiple of 32 (the GEMV's rarer path) on a wide cut.
    for (m, bits, group, n, k) in [
        (8, 4, 16, 515, 512),
        (6, 8, 8, 64, 2048),
        (8, 6, 0, 33, 2056),
        (1, 6, 0, 1, 4072),
    ] {
        let p = make(&mut rng, bits, group, n, k);
        gemv_case(g, &mut rng, &p, m, true);
    }
    // An INT8 lm_head (logits in f32).
    let p = make(&mut rng, 8, 0, 151_936, 2048);
    gemv_case(g, &mut rng, &p, 1, true);
}

/// The one-row GEMV under every `Gpu::set_packed_gemv_m1` choice (units; chunks of 1, 2, 4 rows a
/// slot; INT8 rows): per-row scales and groups, n off every cut, k from one chunk to each row-phase
/// width and its edges, bf16 and f32 outputs, on a device of its own (the others keep the default).
#[test]
fn gemv_packed_m1_kernels_match_cpu() {
    if gpu("gemv_packed_m1_kernels_match_cpu").is_none() {
        return;
    }
    let g = Gpu::new(0, &crate::options::gpu_options()).expect("a second device context");
    let mut rng = Rng::new(46);
    let shapes = [
        (8, 0, 12288, 2048),
        (8, 0, 2048, 4096),
        (8, 0, 515, 2048),
        (8, 0, 1, 32),
        (8, 0, 3, 96),
        (8, 16, 77, 1024),
        (8, 32, 300, 8192),
        (8, 0, 13312, 2560),
        (8, 0, 2560, 6144),
        (8, 0, 97, 6176),
        (8, 32, 1, 1024),
        (4, 128, 1024, 2048),
        (4, 128, 2048, 512),
        (4, 32, 5, 4128),
        (4, 0, 129, 64),
        (4, 128, 1000, 6144),
        (6, 0, 777, 2048),
        (6, 32, 130, 3072),
    ];
    let mats: Vec<Packed> = shapes
        .iter()
        .map(|&(bits, group, n, k)| make(&mut rng, bits, group, n, k))
        .collect();
    let choices = [
        PackedM1::Units,
        PackedM1::Chunks(1),
        PackedM1::Chunks(2),
        PackedM1::Chunks(4),
        PackedM1::Rows,
    ];
    for choice in choices {
        g.set_packed_gemv_m1(choice);
        assert_eq!(g.packed_gemv_m1(), choice);
        for p in &mats {
            gemv_case(&g, &mut rng, p, 1, true);
        }
    }
}

/// The one-row GEMV with the SwiGLU staged (`gemv_packed_swiglu`: an MLP's down projection of a
/// gate|up row) against `swiglu` then `gemv_packed`, bit for bit (while the one-row kernel choice is
/// the unit GEMV, as `gemv_packed_m1_kernels_match_cpu` leaves it), and against the CPU oracle: INT6,
/// INT4 g128 and INT8 per row at the 80B shared expert's down shape (2048 x 512), INT6 with a partial
/// last unit (k = 520), INT8 groups of 32.
#[test]
fn gemv_packed_swiglu_equals_swiglu_then_gemv() {
    let Some(g) = gpu("gemv_packed_swiglu_equals_swiglu_then_gemv") else {
        return;
    };
    let mut rng = Rng::new(48);
    for (bits, group, n, k) in [
        (6u32, 0usize, 2048usize, 512usize),
        (4, 128, 2048, 512),
        (8, 0, 2048, 512),
        (6, 0, 300, 520),
        (8, 32, 257, 1024),
    ] {
        let p = make(&mut rng, bits, group, n, k);
        let (gub, guf) = to_bf16(&rng.normals(2 * k, 0.0, 1.0));
        let (w, s, gu) = (
            g.upload(&p.words).unwrap(),
            g.upload(&p.scales).unwrap(),
            g.upload(&gub).unwrap(),
        );
        let mat = packed_mat(&w, &s, (bits, group), (n, k));
        let mut act = g.zeros::<bf16>(k).unwrap();
        g.swiglu(&gu, &mut act, 1, k).unwrap();
        let mut apart = g.zeros::<bf16>(n).unwrap();
        g.gemv_packed(&mat, &act, &mut apart, 1).unwrap();
        let mut staged = g.zeros::<bf16>(n).unwrap();
        g.gemv_packed_swiglu(&mat, &gu, &mut staged).unwrap();
        let (apart, staged) = (g.download(&apart).unwrap(), g.download(&staged).unwrap());
        let shape = name(&p, 1);
        if bits == 6 || g.packed_gemv_m1() == PackedM1::Units {
            let differ = apart
                .iter()
                .zip(&staged)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            println!("PARITY op=gemv_packed_swiglu_vs_apart shape={shape} differing={differ}");
            assert_eq!(
                differ, 0,
                "{shape}: {differ} outputs differ from swiglu then gemv"
            );
        }
        let mut x = vec![0f32; k];
        ops::swiglu(&guf, 1, k, &mut x);
        let x = to_bf16(&x).1;
        let mut want = vec![0f32; n];
        ops::matmul_t(&x, &p.dense, 1, k, n, &mut want);
        check_reduction("gemv_packed_swiglu", &shape, &from_bf16(&staged), &want);
    }
}

/// The one-row GEMV with the residual add and the next norm in its launch
/// (`gemv_packed_add_rms_norm`, a mixer's output projection) against `gemv_packed` then
/// `add_rms_norm`, bit for bit: the output row, the residual and the normed row. The 80B's INT8
/// out_proj (2048 x 4096), INT4 g128 and INT6, a row of 200 (fewer blocks than a GEMV of 2048), and
/// each launch twice in a row (the last-block counter left at 0).
#[test]
fn gemv_packed_add_rms_norm_equals_gemv_then_add_rms_norm() {
    let Some(g) = gpu("gemv_packed_add_rms_norm_equals_gemv_then_add_rms_norm") else {
        return;
    };
    let mut rng = Rng::new(49);
    let mut ticket = g.zeros::<u32>(1).unwrap();
    for (bits, group, n, k) in [
        (8u32, 0usize, 2048usize, 4096usize),
        (4, 128, 2048, 512),
        (6, 0, 2048, 512),
        (8, 0, 200, 1024),
    ] {
        let p = make(&mut rng, bits, group, n, k);
        let scheme = PackedScheme {
            bits,
            group_size: group,
        };
        if !g.gemv_packed_norm_fits(scheme, n, k) {
            println!(
                "PARITY op=gemv_packed_add_rms_norm shape={} skipped=chunk_gemv",
                name(&p, 1)
            );
            continue;
        }
        let (w, s) = (g.upload(&p.words).unwrap(), g.upload(&p.scales).unwrap());
        let mat = packed_mat(&w, &s, (bits, group), (n, k));
        let (eps, offset) = (1e-6, if bits == 8 { 1.0 } else { 0.0 });
        let nw = g.upload(&to_bf16(&rng.normals(n, 0.0, 0.2)).0).unwrap();
        let bits_of = |b: &sanmai_cuda::cudarc::driver::CudaSlice<bf16>| -> Vec<u16> {
            g.download(b).unwrap().iter().map(|v| v.to_bits()).collect()
        };
        for round in 0..2 {
            let x = g.upload(&to_bf16(&rng.normals(k, 0.0, 1.0)).0).unwrap();
            let acc0 = to_bf16(&rng.normals(n, 0.0, 1.0)).0;
            let mut y_want = g.zeros::<bf16>(n).unwrap();
            g.gemv_packed(&mat, &x, &mut y_want, 1).unwrap();
            let mut acc_want = g.upload(&acc0).unwrap();
            let mut normed_want = g.zeros::<bf16>(n).unwrap();
            let rows = NormRows { rows: 1, d: n, eps };
            g.add_rms_norm(&mut acc_want, &y_want, &nw, &mut normed_want, rows, offset)
                .unwrap();
            let mut y = g.zeros::<bf16>(n).unwrap();
            let mut acc = g.upload(&acc0).unwrap();
            let mut normed = g.zeros::<bf16>(n).unwrap();
            let then = RowAddNorm {
                acc: &mut acc,
                w: &nw,
                normed: &mut normed,
                eps,
                offset,
                ticket: &mut ticket,
            };
            g.gemv_packed_add_rms_norm(&mat, &x, &mut y, then).unwrap();
            let shape = format!("{}_round{round}", name(&p, 1));
            assert_eq!(bits_of(&y), bits_of(&y_want), "{shape}: the GEMV's row");
            assert_eq!(bits_of(&acc), bits_of(&acc_want), "{shape}: the residual");
            assert_eq!(bits_of(&normed), bits_of(&normed_want), "{shape}: the norm");
            assert_eq!(g.download(&ticket).unwrap(), [0], "{shape}: the counter");
            println!("PARITY op=gemv_packed_add_rms_norm shape={shape} exact=true");
        }
    }
}

/// Several packed weights of one format that read one x in one launch (`gemv_packed_many`): each output
/// against the CPU product with its own weight. INT4 (group 128), INT8 (per row, as in_proj_qkv /
/// in_proj_z, and as the 125B's QSA q|k|v), INT6 (per row, k off the 32 grid), and INT8 groups of 32
/// (the row-slot GEMV at every m); 2, 3 and 4 segments of different n (n = 1, n off the 16-row tiles
/// and the slot blocks) at m = 1, 2, 5 and 8.
#[test]
fn gemv_packed_many_matches_cpu() {
    let Some(g) = gpu("gemv_packed_many_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(46);
    let sets: [&[usize]; 3] = [&[2048, 32], &[1, 513, 64], &[4096, 1024, 32, 7]];
    for (bits, group, k) in [
        (4u32, 128usize, 2048usize),
        (8, 0, 2048),
        (6, 0, 1000),
        (8, 32, 512),
        (8, 0, 2560),
    ] {
        for ns in sets {
            let ps: Vec<Packed> = ns
                .iter()
                .map(|&n| make(&mut rng, bits, group, n, k))
                .collect();
            for m in [1usize, 2, 5, 8] {
                gemv_packed_many_case(g, &mut rng, &ps, m);
            }
        }
    }
}

fn gemv_packed_many_case(g: &Gpu, rng: &mut Rng, ps: &[Packed], m: usize) {
    let (bits, group, k) = (ps[0].bits, ps[0].group, ps[0].k);
    let (xb, xf) = to_bf16(&rng.normals(m * k, 0.0, 1.0));
    let x = g.upload(&xb).unwrap();
    let ws: Vec<_> = ps.iter().map(|p| g.upload(&p.words).unwrap()).collect();
    let ss: Vec<_> = ps.iter().map(|p| g.upload(&p.scales).unwrap()).collect();
    let mut ys: Vec<_> = ps
        .iter()
        .map(|p| g.zeros::<bf16>(m * p.n).unwrap())
        .collect();
    let mut parts: Vec<_> = ws
        .iter()
        .zip(&ss)
        .zip(ys.iter_mut())
        .zip(ps)
        .map(|(((w, s), y), p)| (w, s, y, p.n))
        .collect();
    g.gemv_packed_many(
        PackedScheme {
            bits,
            group_size: group,
        },
        &x,
        &mut parts,
        m,
        k,
    )
    .unwrap();
    drop(parts);
    for (i, (y, p)) in ys.iter().zip(ps).enumerate() {
        let mut want = vec![0f32; m * p.n];
        ops::matmul_t(&xf, &p.dense, m, k, p.n, &mut want);
        let got = from_bf16(&g.download(y).unwrap());
        let shape = format!("{}_segs{}_seg{i}", name(p, m), ps.len());
        check_reduction("gemv_packed_many", &shape, &got, &want);
    }
}

/// The tensor-core GEMV (INT8 and INT4, 2 ≤ m ≤ 8, any n, k a whole number of 64 / 128-value
/// blocks, per-row scales or groups of whole blocks): every batch size at in_proj_qkv (INT8 8192 x 2048)
/// and at INT4 group 128; in_proj_z, out_proj and o_proj at batch 8 and 2; grouped INT8 (group 128:
/// scales per k-block), per-row INT4, partial 16-row tiles (255, 257, 513), f32 outputs,
/// and shapes that stay on the FMA GEMV at batch 8 (INT8 k = 96, INT4 group 32). INT6: see
/// `gemv_packed_int6_batches_match_cpu`.
#[test]
fn gemv_packed_tensor_core_matches_cpu() {
    let Some(g) = gpu("gemv_packed_tensor_core_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(44);
    for (bits, group, n, k) in [(8u32, 0usize, 8192usize, 2048usize), (4, 128, 4096, 2048)] {
        let p = make(&mut rng, bits, group, n, k);
        for m in 2..=8 {
            gemv_case(g, &mut rng, &p, m, m == 5);
        }
    }
    for (m, bits, group, n, k) in [
        (8, 8, 0, 4096, 2048),
        (2, 8, 0, 2048, 4096),
        (8, 8, 0, 2048, 4096),
        (8, 8, 0, 2048, 512),
        (3, 8, 128, 300, 4096),
        (8, 8, 64, 1000, 512),
        (5, 4, 0, 300, 256),
        (8, 4, 256, 513, 1024),
        (8, 8, 0, 255, 2048),
        (8, 8, 0, 256, 2048),
        (4, 4, 128, 257, 128),
        (8, 8, 0, 300, 96),
        (8, 4, 32, 300, 512),
        (8, 6, 0, 4096, 2048),
    ] {
        let p = make(&mut rng, bits, group, n, k);
        gemv_case(g, &mut rng, &p, m, true);
    }
    // An INT8 lm_head at batch 8 (f32 logits).
    let p = make(&mut rng, 8, 0, 151_936, 2048);
    gemv_case(g, &mut rng, &p, 8, true);
}

/// INT6 batches (m = 2, 3, 5, 8): the tensor-core GEMV with per-row scales from one row to 12288 (the
/// shared expert's gate-up 512 x 2048 and down 2048 x 512, 2048 x 2048, 12288 x 2048, partial 16-row
/// tiles), on k off the 128-value k-block and off the 32-value unit (partial last k-blocks and units:
/// k = 1000, 2056, 40, 520), with groups of whole k-blocks (128, 256); and the FMA GEMV with groups
/// that split a k-block (8, 64). f32 outputs at m = 8.
#[test]
fn gemv_packed_int6_batches_match_cpu() {
    let Some(g) = gpu("gemv_packed_int6_batches_match_cpu") else {
        return;
    };
    let mut rng = Rng::new(45);
    for (group, n, k) in [
        (0usize, 1usize, 2048usize),
        (0, 64, 2048),
        (0, 255, 2048),
        (0, 512, 2048),
        (0, 2048, 512),
        (0, 2048, 2048),
        (0, 12_288, 2048),
        (0, 300, 1000),
        (0, 257, 2056),
        (0, 256, 40),
        (0, 513, 520),
        (0, 33, 1000),
        (128, 2048, 2048),
        (128, 300, 1000),
        (256, 513, 2048),
        (64, 300, 512),
        (8, 256, 96),
    ] {
        let p = make(&mut rng, 6, group, n, k);
        for m in [2usize, 3, 5, 8] {
            gemv_case(g, &mut rng, &p, m, m == 8);
        }
    }
}

/// Small n at batch 8 for each format: one row, the GDN b / a projections (32, 64) and 100 rows on the
/// tensor cores, and on the FMA GEMV (groups of 32 values split the INT4 and INT8 k-blocks, INT6 groups
/// of 8) with k split over a whole block.
#[test]
fn gemv_packed_small_n_batches_match_cpu() {
    let Some(g) = gpu("gemv_packed_small_n_batches_match_cpu") else {
        return;
    };
    let mut rng = Rng::new(46);
    for (bits, group) in [(8u32, 0usize), (6, 0), (4, 128), (8, 32), (4, 32), (6, 8)] {
        for (n, k) in [(1usize, 2048usize), (32, 2048), (64, 2048), (100, 4096)] {
            let p = make(&mut rng, bits, group, n, k);
            gemv_case(g, &mut rng, &p, 8, true);
        }
    }
}

/// The decode shapes of a full-size model at batch 1 and 8 for each format (INT4 group 128, INT6 and
/// INT8 per-row scales), bf16 and f32 outputs: n from one row to 12288, k = 512, 2048, 4096, so every
/// cut of the GEMV (slots narrower than a warp, of a warp, of a whole block; one or two rows) runs.
#[test]
fn gemv_packed_matches_cpu_at_decode_shapes() {
    let Some(g) = gpu("gemv_packed_matches_cpu_at_decode_shapes") else {
        return;
    };
    let mut rng = Rng::new(43);
    for (bits, group) in [(4u32, 128usize), (6, 0), (8, 0)] {
        for n in [1usize, 64, 512, 2048, 12_288] {
            for k in [512usize, 2048, 4096] {
                if n == 12_288 && k != 2048 {
                    continue;
                }
                let p = make(&mut rng, bits, group, n, k);
                for m in [1usize, 8] {
                    gemv_case(g, &mut rng, &p, m, true);
                }
            }
        }
    }
}

#[test]
fn dequant_and_gemm_packed_match_cpu() {
    let Some(g) = gpu("dequant_and_gemm_packed_match_cpu") else {
        return;
    };
    let mut rng = Rng::new(41);
    for (m, bits, group, n, k, tile_rows) in [
        (64, 4, 128, 1024, 2048, 1024),
        (300, 8, 0, 512, 768, 100),
        (129, 6, 0, 100, 1000, 33),
        (1, 4, 32, 256, 64, 7),
        (37, 6, 0, 515, 48, 515),
    ] {
        let p = make(&mut rng, bits, group, n, k);
        let (w, s) = (g.upload(&p.words).unwrap(), g.upload(&p.scales).unwrap());
        // The dequantised tile is each weight rounded once to bf16.
        let (r0, rows) = (n / 3, n - n / 3);
        let mut tile = g.zeros::<bf16>(rows * k).unwrap();
        g.dequant_packed(
            &packed_mat(&w, &s, (bits, group), (n, k)),
            &mut tile,
            r0,
            rows,
        )
        .unwrap();
        let got = from_bf16(&g.download(&tile).unwrap());
        let want = to_bf16(&p.dense[r0 * k..n * k]).1;
        assert_eq!(got, want, "dequant_packed {}", name(&p, 0));
        println!(
            "PARITY op=dequant_packed shape={} exact=true",
            name(&p, rows)
        );

        let (xb, xf) = to_bf16(&rng.normals(m * k, 0.0, 1.0));
        let mut want = vec![0f32; m * n];
        ops::matmul_t(&xf, &p.dense, m, k, n, &mut want);
        let x = g.upload(&xb).unwrap();
        let mut y = g.zeros::<bf16>(m * n).unwrap();
        let mut ws = g.zeros::<bf16>(tile_rows * k).unwrap();
        g.gemm_packed(
            &x,
            &packed_mat(&w, &s, (bits, group), (n, k)),
            &mut y,
            &mut ws,
            m,
        )
        .unwrap();
        let got = from_bf16(&g.download(&y).unwrap());
        check_reduction(
            "gemm_packed",
            &format!("{}_tile{tile_rows}", name(&p, m)),
            &got,
            &want,
        );
    }
    // Against the oracle on the bf16-rounded weights (what cuBLAS multiplies) the GEMM differs only by
    // summation order and the output rounding.
    let p = make(&mut rng, 4, 128, 64, 256);
    let (xb, xf) = to_bf16(&rng.normals(4 * 256, 0.0, 1.0));
    let wq = to_bf16(&p.dense).1;
    let mut want = vec![0f32; 4 * 64];
    ops::matmul_t(&xf, &wq, 4, 256, 64, &mut want);
    let (w, s, x) = (
        g.upload(&p.words).unwrap(),
        g.upload(&p.scales).unwrap(),
        g.upload(&xb).unwrap(),
    );
    let mut y = g.zeros::<bf16>(4 * 64).unwrap();
    let mut ws = g.zeros::<bf16>(32 * 256).unwrap();
    g.gemm_packed(
        &x,
        &packed_mat(&w, &s, (4, 128), (64, 256)),
        &mut y,
        &mut ws,
        4,
    )
    .unwrap();
    let got = from_bf16(&g.download(&y).unwrap());
    let s = stats(&got, &want);
    println!(
        "PARITY op=gemm_packed_vs_bf16_weights shape=q4_m4_n64_k256 max_rel={:.3e} rms_rel={:.3e}",
        s.max_rel, s.rms_rel
    );
    assert!(s.rms_rel <= 4e-3);
}

#[test]
fn packed_ops_reject_bad_shapes() {
    let Some(g) = gpu("packed_ops_reject_bad_shapes") else {
        return;
    };
    let w = g.zeros::<u32>(64 * 64).unwrap();
    let s = g.zeros::<f32>(64 * 8).unwrap();
    let x = g.zeros::<bf16>(9 * 256).unwrap();
    let mut y = g.zeros::<bf16>(9 * 64).unwrap();
    assert!(
        g.gemv_packed(&packed_mat(&w, &s, (4, 0), (64, 256)), &x, &mut y, 9)
            .is_err(),
        "m > 8"
    );
    assert!(
        g.gemv_packed(&packed_mat(&w, &s, (4, 0), (64, 40)), &x, &mut y, 1)
            .is_err(),
        "INT4 k % 32"
    );
    assert!(
        g.gemv_packed(&packed_mat(&w, &s, (6, 0), (64, 36)), &x, &mut y, 1)
            .is_err(),
        "INT6 k % 8"
    );
    assert!(
        g.gemv_packed(&packed_mat(&w, &s, (5, 0), (64, 256)), &x, &mut y, 1)
            .is_err(),
        "5 bits"
    );
    assert!(
        g.gemv_packed(&packed_mat(&w, &s, (4, 12), (64, 256)), &x, &mut y, 1)
            .is_err(),
        "group % 8"
    );
    assert!(
        g.gemv_packed(&packed_mat(&w, &s, (8, 0), (65, 256)), &x, &mut y, 1)
            .is_err(),
        "W too short"
    );
    assert!(
        g.gemv_packed(&packed_mat(&w, &s, (4, 16), (64, 256)), &x, &mut y, 1)
            .is_err(),
        "scales too short"
    );
    let mut ws = g.zeros::<bf16>(100).unwrap();
    assert!(
        g.gemm_packed(
            &x,
            &packed_mat(&w, &s, (4, 0), (64, 256)),
            &mut y,
            &mut ws,
            2
        )
        .is_err(),
        "workspace below one row"
    );
    let mut tile = g.zeros::<bf16>(256).unwrap();
    assert!(
        g.dequant_packed(&packed_mat(&w, &s, (4, 0), (64, 256)), &mut tile, 64, 1)
            .is_err(),
        "rows past n"
    );
}

/// Mean seconds per call of `f` over `iters` calls after `warm` warm-up calls.
fn time(g: &Gpu, warm: usize, iters: usize, mut f: impl FnMut(usize)) -> f64 {
    use sanmai_cuda::cudarc::driver::sys::CUevent_flags;
    for i in 0..warm {
        f(i);
    }
    let s = g.stream();
    let start = s
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    for i in 0..iters {
        f(i);
    }
    let end = s
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    start.elapsed_ms(&end).unwrap() as f64 / 1e3 / iters as f64
}

#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_packed_gemv_gemm() {
    let Some(g) = gpu("bench_packed_gemv_gemm") else {
        return;
    };
    let mut rng = Rng::new(42);
    // Enough copies that one pass (> 320 MB) cannot sit in the 50 MB L2: every call streams from HBM.
    for (bits, group, n, k) in [
        (4u32, 128usize, 8192usize, 2560usize),
        (8, 0, 8192, 2560),
        (6, 0, 8192, 2560),
        (4, 128, 32768, 2560),
        (8, 0, 151_936, 2048),
    ] {
        let p = make(&mut rng, bits, group, n, k);
        let wb = (p.words.len() + p.scales.len()) * 4;
        let copies = (320 << 20) / wb + 1;
        let ws: Vec<_> = (0..copies).map(|_| g.upload(&p.words).unwrap()).collect();
        let s = g.upload(&p.scales).unwrap();
        for m in [1usize, 4, 8] {
            let x = g.upload(&to_bf16(&rng.normals(m * k, 0.0, 1.0)).0).unwrap();
            let mut y = g.zeros::<bf16>(m * n).unwrap();
            let t_cold = time(g, copies, 4 * copies, |i| {
                g.gemv_packed(
                    &packed_mat(&ws[i % copies], &s, (bits, group), (n, k)),
                    &x,
                    &mut y,
                    m,
                )
                .unwrap()
            });
            let t_hot = time(g, 10, 200, |_| {
                g.gemv_packed(
                    &packed_mat(&ws[0], &s, (bits, group), (n, k)),
                    &x,
                    &mut y,
                    m,
                )
                .unwrap()
            });
            println!(
                "BENCH gemv_packed bits={bits} group={group} m={m} n={n} k={k} packed_bytes={wb} \
                 hbm_time_us={:.2} hbm_GB/s={:.0} l2_time_us={:.2} l2_GB/s={:.0} \
                 bf16_equiv_GB/s={:.0}",
                t_cold * 1e6,
                wb as f64 / t_cold / 1e9,
                t_hot * 1e6,
                wb as f64 / t_hot / 1e9,
                (n * k * 2) as f64 / t_cold / 1e9,
            );
        }
    }
    let (n, k) = (8192usize, 2560usize);
    // The bf16 GEMV on the same shape, streamed from HBM the same way, for comparison.
    let wb = n * k * 2;
    let copies = (320 << 20) / wb + 1;
    let dense: Vec<_> = (0..copies)
        .map(|_| {
            g.upload(&to_bf16(&rng.normals(n * k, 0.0, 0.05)).0)
                .unwrap()
        })
        .collect();
    let x = g.upload(&to_bf16(&rng.normals(k, 0.0, 1.0)).0).unwrap();
    let mut y = g.zeros::<bf16>(n).unwrap();
    let t = time(g, copies, 4 * copies, |i| {
        g.gemv_bf16(&dense[i % copies], &x, &mut y, 1, n, k)
            .unwrap()
    });
    println!(
        "BENCH gemv_bf16 m=1 n={n} k={k} bytes={wb} hbm_time_us={:.2} hbm_GB/s={:.0}",
        t * 1e6,
        wb as f64 / t / 1e9
    );
    drop(dense);

    // Prefill: packed GEMM (dequantise tiles into a 32 MiB workspace + cuBLAS) against bf16 cuBLAS.
    let (m, n, k) = (4096usize, 8192usize, 2048usize);
    let x = g.upload(&to_bf16(&rng.normals(m * k, 0.0, 1.0)).0).unwrap();
    let mut y = g.zeros::<bf16>(m * n).unwrap();
    let mut ws = g.zeros::<bf16>(16 << 20).unwrap();
    for (bits, group) in [(4u32, 128usize), (8, 0), (6, 0)] {
        let p = make(&mut rng, bits, group, n, k);
        let (w, s) = (g.upload(&p.words).unwrap(), g.upload(&p.scales).unwrap());
        let t = time(g, 3, 20, |_| {
            g.gemm_packed(
                &x,
                &packed_mat(&w, &s, (bits, group), (n, k)),
                &mut y,
                &mut ws,
                m,
            )
            .unwrap()
        });
        println!(
            "BENCH gemm_packed bits={bits} group={group} m={m} n={n} k={k} ws_rows={} time_us={:.1} TFLOP/s={:.0}",
            Gpu::packed_tile_rows(16 << 20, n, k),
            t * 1e6,
            2.0 * (m * n * k) as f64 / t / 1e12
        );
    }
    let wd = g
        .upload(&to_bf16(&rng.normals(n * k, 0.0, 0.05)).0)
        .unwrap();
    let t = time(g, 3, 20, |_| g.gemm_bf16(&x, &wd, &mut y, m, n, k).unwrap());
    println!(
        "BENCH gemm_bf16 m={m} n={n} k={k} time_us={:.1} TFLOP/s={:.0}",
        t * 1e6,
        2.0 * (m * n * k) as f64 / t / 1e12
    );
}
