//! The packed grouped GEMV of the routed experts and the backend's packed `linear`, against the CPU.

use cudarc::driver::DevicePtr;
use half::bf16;
use sanmai_config::QuantScheme;
use sanmai_cpu::{ops, CpuBackend};
use sanmai_cuda::{cudarc, CudaBackend, CudaWeight, Gpu, PACKED_WORKSPACE_BYTES};
use sanmai_model::Backend;
use sanmai_weights::quant::{quantize, PackedTensor};

use crate::launch::{expert_proj, packed_scheme, pair_groups, pair_rows};
use crate::{bf16_round, rel_errors, Rng};

fn gpu(test: &str) -> Option<Gpu> {
    match Gpu::new(0, &crate::options::gpu_options()) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("skipped: {test}: {e}");
            None
        }
    }
}

use crate::options::backend;

/// `p` as a weight of the GPU backend (which keeps it packed) and of the CPU backend.
fn packed_weights(
    b: &CudaBackend,
    cpu: &CpuBackend,
    p: &PackedTensor<'_>,
) -> (CudaWeight, <CpuBackend as Backend>::Weight) {
    let wg = b.packed_weight(p).unwrap();
    let wc = cpu.packed_weight(p).unwrap();
    assert!(matches!(wg, CudaWeight::Packed(_)));
    (wg, wc)
}

fn scheme(bits: u32, group_size: usize) -> QuantScheme {
    QuantScheme { bits, group_size }
}

/// A random `[n, k]` weight quantized with `s` (the compressed-tensors quantiser).
fn packed(rng: &mut Rng, s: QuantScheme, n: usize, k: usize) -> PackedTensor<'static> {
    let w = rng.normals(n * k, (k as f32).powf(-0.5));
    quantize("w", &w, n, k, s).unwrap()
}

/// The experts' words and scales on the device with their address tables. Table entry `x` points at
/// `ps[slot[x]]`: the experts a case routes to are real, the others share one of them (their
/// addresses must be live, their values are never used).
struct Table {
    _words: Vec<cudarc::driver::CudaSlice<u32>>,
    _scales: Vec<cudarc::driver::CudaSlice<f32>>,
    w_ptrs: cudarc::driver::CudaSlice<u64>,
    s_ptrs: cudarc::driver::CudaSlice<u64>,
}

fn table(g: &Gpu, ps: &[PackedTensor<'_>], slot: &[usize]) -> Table {
    let words: Vec<_> = ps.iter().map(|p| g.upload(&p.words()).unwrap()).collect();
    let scales: Vec<_> = ps.iter().map(|p| g.upload(&p.scales).unwrap()).collect();
    let s = g.stream();
    let wp: Vec<u64> = slot.iter().map(|&i| words[i].device_ptr(s).0).collect();
    let sp: Vec<u64> = slot.iter().map(|&i| scales[i].device_ptr(s).0).collect();
    Table {
        w_ptrs: g.upload(&wp).unwrap(),
        s_ptrs: g.upload(&sp).unwrap(),
        _words: words,
        _scales: scales,
    }
}

#[test]
fn packed_grouped_gemv_matches_cpu() {
    let Some(g) = gpu("packed_grouped_gemv_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(71);
    // (bits, group, hidden, inter, experts, top_k, tokens, pool): the pairs route to `pool` distinct
    // experts (0: any of the `experts`). INT4 with groups of a multiple of 128 (and k % 128 == 0)
    // runs the tensor-core kernel (any batch; its down projection also with SwiGLU fused), other
    // schemes the CUDA-core ones. At most 4 pairs per expert on average take the decode
    // kernels (`_m1`, one pair per pass), beyond the plain ones (up to 8 pairs per pass).
    let cases = [
        (4, 128, 2048, 512, 16, 4, 1, 0),
        (4, 128, 2048, 512, 64, 10, 33, 0),
        (4, 32, 64, 32, 8, 2, 5, 0),
        (8, 0, 256, 96, 8, 2, 40, 0),
        (6, 0, 128, 48, 8, 2, 3, 0),
        (6, 0, 96, 40, 4, 3, 17, 0),
        // Decode kernels with tiles of several pairs, a group of 16 (two scales a unit), a group of
        // 48 (units across groups), INT6 with a partial last unit (k = 40) and groups not of whole
        // units, INT8 channel.
        (4, 16, 256, 64, 8, 4, 6, 0),
        (8, 48, 192, 96, 8, 2, 12, 0),
        (6, 0, 96, 40, 4, 3, 5, 0),
        (8, 0, 256, 96, 16, 2, 24, 0),
        // Plain kernels with every pass size (1..8 pairs a tile) and a group of 16.
        (4, 16, 256, 64, 16, 4, 20, 0),
        // Qwen3-Next-80B-A3B decode: 512 experts, top 10, hidden 2048, intermediate 512 (gate|up
        // n 1024 k 2048, down n 2048 k 512); batch 1 (10 pairs, 10 experts) and batch 8 (80 pairs over
        // 40 experts: tiles of one to several pairs).
        (4, 128, 2048, 512, 512, 10, 1, 10),
        (4, 128, 2048, 512, 512, 10, 8, 40),
        (8, 0, 2048, 512, 512, 10, 1, 10),
        (8, 0, 2048, 512, 512, 10, 8, 40),
        (6, 0, 2048, 512, 512, 10, 1, 10),
        (6, 0, 2048, 512, 512, 10, 8, 40),
        // qwen4-exp-125b-a6b: hidden 2560, intermediate 768 (gate|up n 1536 k 2560, down n 2560
        // k 768: 24 units a row).
        (4, 128, 2560, 768, 512, 10, 1, 10),
        (4, 128, 2560, 768, 512, 10, 8, 40),
        // Prefill-sized: 64 tokens over 16 experts (40 pairs an expert: full tiles, plain kernels).
        (4, 128, 2048, 512, 16, 10, 64, 0),
        // Tensor-core kernel edges: one scale per row (group 0, k = 256 and 384: 2 and 3 spans, so
        // warps without spans), group 256 (one scale per two spans), one span (k = 128) with tiles
        // of 1..8 pairs.
        (4, 0, 256, 384, 8, 4, 6, 0),
        (4, 256, 512, 256, 8, 2, 20, 0),
        (4, 128, 256, 128, 4, 3, 9, 0),
    ];
    for (bits, group, h, i, e, k, t, pool) in cases {
        let s = scheme(bits, group);
        let n = t * k;
        // The experts in use and each pair's expert.
        let used: Vec<u32> = if pool == 0 {
            (0..e as u32).collect()
        } else {
            let mut all: Vec<u32> = (0..e as u32).collect();
            for j in 0..pool {
                let r = j + rng.below((e - j) as u32) as usize;
                all.swap(j, r);
            }
            all.truncate(pool);
            all
        };
        let ids: Vec<u32> = (0..n)
            .map(|_| used[rng.below(used.len() as u32) as usize])
            .collect();
        let mut slot = vec![0usize; e];
        for (j, &x) in used.iter().enumerate() {
            slot[x as usize] = j;
        }
        let gus: Vec<_> = used.iter().map(|_| packed(&mut rng, s, 2 * i, h)).collect();
        let dns: Vec<_> = used.iter().map(|_| packed(&mut rng, s, h, i)).collect();
        let gu_dense: Vec<Vec<f32>> = gus.iter().map(|p| p.dequantize()).collect();
        let dn_dense: Vec<Vec<f32>> = dns.iter().map(|p| p.dequantize()).collect();
        let x = bf16_round(&rng.normals(t * h, 1.0));
        let act = bf16_round(&rng.normals(n * i, 1.0));

        // CPU: each pair's expert, dequantised, times its row.
        let mut want_gu = vec![0f32; n * 2 * i];
        let mut want_dn = vec![0f32; n * h];
        for p in 0..n {
            let x_row = &x[(p / k) * h..(p / k + 1) * h];
            let ex = slot[ids[p] as usize];
            ops::matmul_t(
                x_row,
                &gu_dense[ex],
                1,
                h,
                2 * i,
                &mut want_gu[p * 2 * i..(p + 1) * 2 * i],
            );
            ops::matmul_t(
                &act[p * i..(p + 1) * i],
                &dn_dense[ex],
                1,
                i,
                h,
                &mut want_dn[p * h..(p + 1) * h],
            );
        }

        // GPU: sort the pairs, then the packed grouped GEMVs.
        let gu_t = table(&g, &gus, &slot);
        let dn_t = table(&g, &dns, &slot);
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let ab: Vec<bf16> = act.iter().map(|&v| bf16::from_f32(v)).collect();
        let (dx, da, di) = (
            g.upload(&xb).unwrap(),
            g.upload(&ab).unwrap(),
            g.upload(&ids).unwrap(),
        );
        let mut perm = g.zeros::<u32>(n).unwrap();
        let mut tiles = g
            .zeros::<u32>(3 * sanmai_cuda::moe_max_tiles(n, e))
            .unwrap();
        g.moe_sort(&di, n, e, &mut perm, &mut tiles).unwrap();
        let mut y_gu = g.zeros::<bf16>(n * 2 * i).unwrap();
        g.moe_gemv_packed(
            &expert_proj(
                &gu_t.w_ptrs,
                &gu_t.s_ptrs,
                packed_scheme(bits, group),
                2 * i,
                h,
            ),
            &pair_rows(&dx, t, k),
            &pair_groups(&perm, &tiles, n),
            &mut y_gu,
        )
        .unwrap();
        let mut y_dn = g.zeros::<f32>(n * h).unwrap();
        g.moe_gemv_packed(
            &expert_proj(&dn_t.w_ptrs, &dn_t.s_ptrs, packed_scheme(bits, group), h, i),
            &pair_rows(&da, n, 1),
            &pair_groups(&perm, &tiles, n),
            &mut y_dn,
        )
        .unwrap();
        let got_gu: Vec<f32> = g
            .download(&y_gu)
            .unwrap()
            .iter()
            .map(|v| v.to_f32())
            .collect();
        let got_dn = g.download(&y_dn).unwrap();
        let kind = if n <= 4 * e { "m1" } else { "plain" };
        let shape = format!("int{bits}_g{group}_h{h}_i{i}_e{e}_k{k}_t{t}_pool{pool}_{kind}");
        let (gu_max, gu_rms) = rel_errors(&got_gu, &want_gu);
        let (dn_max, dn_rms) = rel_errors(&got_dn, &want_dn);
        println!(
            "PACKED check=moe_gemv_packed shape={shape} gate_up_max_rel={gu_max:.3e} gate_up_rms_rel={gu_rms:.3e} down_f32_max_rel={dn_max:.3e} down_f32_rms_rel={dn_rms:.3e} tol=bf16:1e-2/4e-3,f32:1e-4"
        );
        assert!(
            gu_max <= 1e-2 && gu_rms <= 4e-3,
            "{shape}: gate|up {gu_max} {gu_rms}"
        );
        assert!(dn_max <= 1e-4, "{shape}: down {dn_max}");

        // Decode steps fuse SwiGLU into the down GEMV where the tensor-core kernel runs: the same
        // activation bits as the swiglu launch, so the same result bit for bit.
        if Gpu::moe_gemv_fuses_swiglu(bits, group, i) {
            let mut act_g = g.zeros::<bf16>(n * i).unwrap();
            g.swiglu(&y_gu, &mut act_g, n, i).unwrap();
            let mut y_two = g.zeros::<f32>(n * h).unwrap();
            g.moe_gemv_packed(
                &expert_proj(&dn_t.w_ptrs, &dn_t.s_ptrs, packed_scheme(bits, group), h, i),
                &pair_rows(&act_g, n, 1),
                &pair_groups(&perm, &tiles, n),
                &mut y_two,
            )
            .unwrap();
            let mut y_fused = g.zeros::<f32>(n * h).unwrap();
            g.moe_gemv_packed_swiglu(
                &expert_proj(&dn_t.w_ptrs, &dn_t.s_ptrs, packed_scheme(bits, group), h, i),
                &pair_rows(&y_gu, n, 1),
                &pair_groups(&perm, &tiles, n),
                &mut y_fused,
            )
            .unwrap();
            let (a, b) = (g.download(&y_two).unwrap(), g.download(&y_fused).unwrap());
            let differ = a
                .iter()
                .zip(&b)
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count();
            println!("PACKED check=moe_gemv_packed_swiglu shape={shape} differing={differ}");
            assert_eq!(
                differ, 0,
                "{shape}: fused SwiGLU down differs from swiglu + down"
            );
        }
    }
}

#[test]
fn packed_grouped_gemv_refuses_bad_shapes() {
    let Some(g) = gpu("packed_grouped_gemv_refuses_bad_shapes") else {
        return;
    };
    let z64 = g.zeros::<u64>(2).unwrap();
    let x = g.zeros::<bf16>(4 * 40).unwrap();
    let perm = g.zeros::<u32>(4).unwrap();
    let tiles = g
        .zeros::<u32>(3 * sanmai_cuda::moe_max_tiles(4, 2))
        .unwrap();
    let mut y = g.zeros::<bf16>(4 * 8).unwrap();
    // INT4 needs k % 32 == 0; 5 bits are not served; the scale table must match.
    for (bits, group, k, s_len) in [
        (4u32, 0usize, 40usize, 2usize),
        (5, 0, 32, 2),
        (4, 12, 32, 2),
    ] {
        let s = g.zeros::<u64>(s_len).unwrap();
        let r = g.moe_gemv_packed(
            &expert_proj(&z64, &s, packed_scheme(bits, group), 8, k),
            &pair_rows(&x, 4, 1),
            &pair_groups(&perm, &tiles, 4),
            &mut y,
        );
        assert!(r.is_err(), "bits {bits} group {group} k {k} accepted");
    }
    let s1 = g.zeros::<u64>(1).unwrap();
    let r = g.moe_gemv_packed(
        &expert_proj(&z64, &s1, packed_scheme(8, 0), 8, 32),
        &pair_rows(&x, 4, 1),
        &pair_groups(&perm, &tiles, 4),
        &mut y,
    );
    assert!(
        r.is_err(),
        "a scale table shorter than the word table accepted"
    );
}

#[test]
fn backend_linear_on_packed_weights_matches_cpu() {
    let test = "backend_linear_on_packed_weights_matches_cpu";
    let Some(b) = backend(test) else {
        return;
    };
    let cpu = CpuBackend::default();
    let mut rng = Rng::new(72);
    for (bits, group, n, k) in [(4, 128, 300, 512), (8, 0, 1000, 256), (6, 0, 96, 136)] {
        let p = packed(&mut rng, scheme(bits, group), n, k);
        let (wg, wc) = packed_weights(&b, &cpu, &p);
        assert_eq!(
            b.weight_bytes(&wg),
            p.nbytes(),
            "weight_bytes = packed size"
        );
        for m in [1usize, 5, 8, 9, 40] {
            let x = bf16_round(&rng.normals(m * k, 1.0));
            let xg = b.upload(m, k, x.clone()).unwrap();
            let (_, _, got) = b.to_host(b.linear(&xg, &wg).unwrap()).unwrap();
            let xc = cpu.upload(m, k, x).unwrap();
            let (_, _, want) = cpu.to_host(cpu.linear(&xc, &wc).unwrap()).unwrap();
            let (max_rel, rms_rel) = rel_errors(&got, &want);
            println!(
                "PACKED check=linear shape=int{bits}_g{group}_n{n}_k{k}_m{m} max_rel={max_rel:.3e} rms_rel={rms_rel:.3e} tol=1e-2/4e-3"
            );
            assert!(
                max_rel <= 1e-2 && rms_rel <= 4e-3,
                "int{bits} m {m}: {max_rel} {rms_rel}"
            );
        }
    }
    let mem = b.memory();
    assert!(mem.workspace >= PACKED_WORKSPACE_BYTES, "{mem:?}");
    assert!(mem.weights > 0);
}

#[test]
fn backend_embedding_on_packed_table_matches_cpu() {
    let test = "backend_embedding_on_packed_table_matches_cpu";
    let Some(b) = backend(test) else {
        return;
    };
    let cpu = CpuBackend::default();
    let mut rng = Rng::new(73);
    for (bits, group, v, h) in [(8, 0, 1000, 256), (4, 128, 300, 512), (6, 0, 50, 136)] {
        let p = packed(&mut rng, scheme(bits, group), v, h);
        let (wg, wc) = packed_weights(&b, &cpu, &p);
        let ids: Vec<u32> = (0..37).map(|_| rng.below(v as u32)).collect();
        let (_, _, got) = b.to_host(b.embed(&wg, &ids).unwrap()).unwrap();
        let (_, _, want) = cpu.to_host(cpu.embed(&wc, &ids).unwrap()).unwrap();
        // The GPU rounds each dequantised value to bf16 once.
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs() / (w.abs() / 256.0 + 1e-30))
            .fold(0f32, f32::max);
        println!(
            "PACKED check=embed shape=int{bits}_g{group}_v{v}_h{h}_t37 elem_ratio={worst:.3} tol=1"
        );
        assert!(worst <= 1.0, "int{bits}: {worst} bf16 roundings");
    }
}
