//! The tensor-core grouped expert GEMM (`moe_gemm_plan`, `moe_gemm_*`) against the CPU twin: each
//! pair's expert weight (packed experts dequantised exactly as `PackedTensor::dequantize` does, q·s in
//! f32) times its input row with `sanmai_cpu::ops::matmul_t`, as the grouped GEMV's tests check it; and
//! the backend's MoE on a prefill-sized step (which takes the GEMM) against the CPU backend.
//!
//! The address tables hold 512 experts over a pool of a few distinct weights (expert x uses pool entry
//! x % pool), so full-size routing runs without gigabytes of random weights.

use half::bf16;
use sanmai_config::{Fp8Config, QuantScheme};
use sanmai_cpu::{ops, CpuBackend};
use sanmai_cuda::cudarc::driver::{CudaSlice, DevicePtr};
use sanmai_cuda::Gpu;
use sanmai_model::backend::{MlpWeights, MoeCall, MoeWeights};
use sanmai_model::Backend;
use sanmai_weights::fp8;
use sanmai_weights::quant::{pack, quantize};

use crate::common::{
    check_composite, check_composite_e4m3, check_f32, check_reduction, from_bf16, gpu, to_bf16, Rng,
};
use crate::launch::{expert_proj, packed_scheme, pair_groups, pair_rows};

/// A pool of expert weights `[n, k]` of one scheme on the device, with the f32 values they stand for.
pub struct Pool {
    _words: Vec<CudaSlice<u32>>,
    _values: Vec<CudaSlice<bf16>>,
    _scales: Vec<CudaSlice<f32>>,
    pub ptrs: Vec<u64>,
    pub scale_ptrs: Vec<u64>,
    pub dense: Vec<Vec<f32>>,
}

/// `d` random `[n, k]` weights: bf16 normals (`scheme` `None`), or random codes over the whole signed
/// range with random positive scales per group (`Some((bits, group_size))`, 0 = per row).
pub fn pool(
    g: &Gpu,
    rng: &mut Rng,
    scheme: Option<(u32, usize)>,
    n: usize,
    k: usize,
    d: usize,
) -> Pool {
    let s = g.stream();
    let mut p = Pool {
        _words: vec![],
        _values: vec![],
        _scales: vec![],
        ptrs: vec![],
        scale_ptrs: vec![],
        dense: vec![],
    };
    for _ in 0..d {
        match scheme {
            None => {
                let (b, f) = to_bf16(&rng.normals(n * k, 0.0, (k as f32).powf(-0.5)));
                let buf = g.upload(&b).unwrap();
                p.ptrs.push(buf.device_ptr(s).0);
                p.scale_ptrs.push(0);
                p._values.push(buf);
                p.dense.push(f);
            }
            Some((bits, group)) => {
                let gl = if group == 0 { k } else { group };
                let sc = k.div_ceil(gl);
                let half = 1i32 << (bits - 1);
                let q: Vec<i8> = (0..n * k)
                    .map(|_| (rng.below(2 * half as u32) as i32 - half) as i8)
                    .collect();
                let base = (k as f32).powf(-0.5) / half as f32;
                let scales: Vec<f32> = (0..n * sc).map(|_| base * (0.5 + rng.unit())).collect();
                let dense: Vec<f32> = (0..n * k)
                    .map(|i| q[i] as f32 * scales[(i / k) * sc + (i % k) / gl])
                    .collect();
                let words = g.upload(&pack(&q, n, k, bits)).unwrap();
                let sbuf = g.upload(&scales).unwrap();
                p.ptrs.push(words.device_ptr(s).0);
                p.scale_ptrs.push(sbuf.device_ptr(s).0);
                p._words.push(words);
                p._scales.push(sbuf);
                p.dense.push(dense);
            }
        }
    }
    p
}

/// How the pairs pick experts.
#[derive(Clone, Copy, Debug)]
pub enum Routing {
    /// Each token picks top_k distinct experts uniformly.
    Uniform,
    /// Every pair on one of 3 experts.
    Skewed,
    /// Uniform, with every 7th pair dropped (id = e).
    Dropped,
}

pub fn route(rng: &mut Rng, routing: Routing, t: usize, k: usize, e: usize) -> Vec<u32> {
    let hot = [
        rng.below(e as u32),
        rng.below(e as u32),
        rng.below(e as u32),
    ];
    let mut ids = Vec::with_capacity(t * k);
    for _ in 0..t {
        let mut row: Vec<u32> = Vec::with_capacity(k);
        while row.len() < k {
            let x = match routing {
                Routing::Skewed => hot[rng.below(3) as usize],
                _ => rng.below(e as u32),
            };
            if matches!(routing, Routing::Skewed) || !row.contains(&x) {
                row.push(x);
            }
        }
        ids.extend(row);
    }
    if matches!(routing, Routing::Dropped) {
        for p in (3..ids.len()).step_by(7) {
            ids[p] = e as u32;
        }
    }
    ids
}

/// `want[p, :] = dense[ids[p] % pool] · x[p / x_div, :]` for the pairs with a valid id, one
/// `matmul_t` per pool entry.
fn reference(
    dense: &[Vec<f32>],
    ids: &[u32],
    e: usize,
    x: &[f32],
    x_div: usize,
    n: usize,
    k: usize,
) -> Vec<f32> {
    let mut want = vec![0f32; ids.len() * n];
    for (d, w) in dense.iter().enumerate() {
        let pairs: Vec<usize> = (0..ids.len())
            .filter(|&p| (ids[p] as usize) < e && ids[p] as usize % dense.len() == d)
            .collect();
        if pairs.is_empty() {
            continue;
        }
        let rows: Vec<f32> = pairs
            .iter()
            .flat_map(|&p| x[(p / x_div) * k..(p / x_div + 1) * k].iter().copied())
            .collect();
        let mut y = vec![0f32; pairs.len() * n];
        ops::matmul_t(&rows, w, pairs.len(), k, n, &mut y);
        for (m, &p) in pairs.iter().enumerate() {
            want[p * n..(p + 1) * n].copy_from_slice(&y[m * n..(m + 1) * n]);
        }
    }
    want
}

/// The rows of the pairs with a valid id.
fn valid_rows(v: &[f32], ids: &[u32], e: usize, n: usize) -> Vec<f32> {
    (0..ids.len())
        .filter(|&p| (ids[p] as usize) < e)
        .flat_map(|p| v[p * n..(p + 1) * n].iter().copied())
        .collect()
}

fn scheme_name(s: Option<(u32, usize)>) -> String {
    match s {
        None => "bf16".into(),
        Some((0, b)) => format!("fp8_b{b}"),
        Some((b, g)) => format!("int{b}_g{g}"),
    }
}

#[test]
fn moe_gemm_plan_groups_pairs() {
    let Some(g) = gpu("moe_gemm_plan_groups_pairs") else {
        return;
    };
    let mut rng = Rng::new(60);
    for &(t, k, e, routing) in &[
        (1usize, 1usize, 8usize, Routing::Uniform),
        (64, 10, 512, Routing::Uniform),
        (512, 10, 512, Routing::Uniform),
        (512, 10, 512, Routing::Skewed),
        (37, 4, 64, Routing::Dropped),
        (3000, 8, 2000, Routing::Uniform),
    ] {
        let n = t * k;
        let ids = route(&mut rng, routing, t, k, e);
        let max_tiles = Gpu::moe_gemm_max_tiles(n, e);
        let di = g.upload(&ids).unwrap();
        let mut perm = g.zeros::<u32>(n).unwrap();
        let mut tiles = g.zeros::<u32>(3 * max_tiles).unwrap();
        g.moe_gemm_plan(&di, n, e, &mut perm, &mut tiles).unwrap();
        let perm = g.download(&perm).unwrap();
        let tiles = g.download(&tiles).unwrap();
        let mut seen = vec![false; n];
        let (mut covered, mut next_start, mut last_x) = (0, 0usize, 0u32);
        for tl in tiles.chunks_exact(3) {
            let (x, start, cnt) = (tl[0], tl[1] as usize, tl[2] as usize);
            if cnt == 0 {
                continue;
            }
            assert!(cnt <= Gpu::MOE_GEMM_TILE, "tile of {cnt} pairs");
            assert_eq!(start, next_start, "tiles cover perm in order");
            assert!(x >= last_x, "experts in increasing order");
            (next_start, last_x) = (start + cnt, x);
            for &p in &perm[start..start + cnt] {
                assert_eq!(ids[p as usize], x, "pair {p} in a tile of expert {x}");
                assert!(!seen[p as usize], "pair {p} twice");
                seen[p as usize] = true;
                covered += 1;
            }
        }
        let valid = ids.iter().filter(|&&x| (x as usize) < e).count();
        assert_eq!(covered, valid, "every valid pair in exactly one tile");
        println!("PARITY op=moe_gemm_plan shape=t{t}_k{k}_e{e}_{routing:?} exact=true");
    }
}

/// (scheme, hidden, inter, experts, top_k, tokens, routing, distinct weights in the pool).
type Case = (
    Option<(u32, usize)>,
    usize,
    usize,
    usize,
    usize,
    usize,
    Routing,
    usize,
);

#[test]
fn moe_gemm_matches_cpu() {
    let Some(g) = gpu("moe_gemm_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(61);
    // (scheme, hidden, inter, experts, top_k, tokens, routing, distinct weights in the pool)
    let cases: &[Case] = &[
        (Some((4, 128)), 2048, 512, 512, 10, 64, Routing::Uniform, 16),
        (
            Some((4, 128)),
            2048,
            512,
            512,
            10,
            512,
            Routing::Uniform,
            16,
        ),
        (Some((4, 128)), 2048, 512, 512, 10, 512, Routing::Skewed, 16),
        (None, 2048, 512, 512, 10, 64, Routing::Uniform, 8),
        (Some((8, 0)), 2048, 512, 512, 10, 64, Routing::Uniform, 8),
        (Some((6, 0)), 2048, 512, 512, 10, 64, Routing::Uniform, 8),
        (Some((4, 128)), 2560, 768, 512, 10, 64, Routing::Uniform, 8),
        (Some((8, 128)), 256, 128, 16, 4, 40, Routing::Uniform, 16),
        (Some((6, 64)), 256, 192, 16, 4, 40, Routing::Uniform, 16),
        (Some((4, 32)), 320, 64, 8, 2, 40, Routing::Dropped, 8),
        (Some((4, 16)), 256, 128, 16, 4, 33, Routing::Uniform, 16),
        (None, 320, 128, 8, 3, 50, Routing::Skewed, 8),
    ];
    for &(scheme, h, i, e, k, t, routing, d) in cases {
        let n = t * k;
        let gu_pool = pool(g, &mut rng, scheme, 2 * i, h, d);
        let dn_pool = pool(g, &mut rng, scheme, h, i, d);
        let (xb, xf) = to_bf16(&rng.normals(t * h, 0.0, 1.0));
        let (ab, af) = to_bf16(&rng.normals(n * i, 0.0, 1.0));
        let ids = route(&mut rng, routing, t, k, e);
        let want_gu = reference(&gu_pool.dense, &ids, e, &xf, k, 2 * i, h);
        let want_dn = reference(&dn_pool.dense, &ids, e, &af, 1, h, i);

        let table = |p: &Pool, s: bool| {
            let v: Vec<u64> = (0..e)
                .map(|x| {
                    if s {
                        p.scale_ptrs[x % d]
                    } else {
                        p.ptrs[x % d]
                    }
                })
                .collect();
            g.upload(&v).unwrap()
        };
        let (gu_w, gu_s) = (table(&gu_pool, false), table(&gu_pool, true));
        let (dn_w, dn_s) = (table(&dn_pool, false), table(&dn_pool, true));
        let (dx, da, di) = (
            g.upload(&xb).unwrap(),
            g.upload(&ab).unwrap(),
            g.upload(&ids).unwrap(),
        );
        let mut perm = g.zeros::<u32>(n).unwrap();
        let mut tiles = g.zeros::<u32>(3 * Gpu::moe_gemm_max_tiles(n, e)).unwrap();
        g.moe_gemm_plan(&di, n, e, &mut perm, &mut tiles).unwrap();
        let mut y_gu = g.zeros::<bf16>(n * 2 * i).unwrap();
        g.moe_gemm(
            &expert_proj(
                &gu_w,
                &gu_s,
                scheme.and_then(|(bits, group)| packed_scheme(bits, group)),
                2 * i,
                h,
            ),
            &pair_rows(&dx, t, k),
            &pair_groups(&perm, &tiles, n),
            &mut y_gu,
        )
        .unwrap();
        let mut y_dn = g.zeros::<f32>(n * h).unwrap();
        g.moe_gemm(
            &expert_proj(
                &dn_w,
                &dn_s,
                scheme.and_then(|(bits, group)| packed_scheme(bits, group)),
                h,
                i,
            ),
            &pair_rows(&da, n, 1),
            &pair_groups(&perm, &tiles, n),
            &mut y_dn,
        )
        .unwrap();
        let got_gu = from_bf16(&g.download(&y_gu).unwrap());
        let got_dn = g.download(&y_dn).unwrap();
        let shape = format!(
            "{}_h{h}_i{i}_e{e}_k{k}_t{t}_{routing:?}",
            scheme_name(scheme)
        );
        check_reduction(
            "moe_gemm_gate_up",
            &shape,
            &valid_rows(&got_gu, &ids, e, 2 * i),
            &valid_rows(&want_gu, &ids, e, 2 * i),
        );
        check_f32(
            "moe_gemm_down_f32",
            &shape,
            &valid_rows(&got_dn, &ids, e, h),
            &valid_rows(&want_dn, &ids, e, h),
        );
    }
}

#[test]
fn moe_gemm_refuses_bad_shapes() {
    let Some(g) = gpu("moe_gemm_refuses_bad_shapes") else {
        return;
    };
    let z64 = g.zeros::<u64>(2).unwrap();
    let x = g.zeros::<bf16>(4 * 96).unwrap();
    let perm = g.zeros::<u32>(4).unwrap();
    let tiles = g.zeros::<u32>(3 * Gpu::moe_gemm_max_tiles(4, 2)).unwrap();
    let mut y = g.zeros::<bf16>(4 * 8).unwrap();
    // k % 64, the bit widths served and the groups the pipeline can scale.
    for (scheme, k) in [
        (None, 96usize),
        (Some((4u32, 128usize)), 96),
        (Some((5, 0)), 64),
        (Some((4, 48)), 64),
    ] {
        let r = g.moe_gemm(
            &expert_proj(
                &z64,
                &z64,
                scheme.and_then(|(bits, group)| packed_scheme(bits, group)),
                8,
                k,
            ),
            &pair_rows(&x, 4, 1),
            &pair_groups(&perm, &tiles, 4),
            &mut y,
        );
        assert!(r.is_err(), "{scheme:?} k {k} accepted");
        assert!(!Gpu::moe_gemm_supports(scheme, k));
    }
    assert!(!Gpu::moe_gemm_wanted(8, 80), "a decode step of 8 tokens");
    assert!(
        !Gpu::moe_gemm_wanted(64, 640),
        "a short chunk keeps the GEMV"
    );
    assert!(Gpu::moe_gemm_wanted(512, 5120));
}

/// Random e4m3 bytes of an `[n, k]` weight (no NaN codes) and its `block × block` scales, around
/// 1 / (448 · sqrt(k)): values of a Linear's size.
pub fn fp8_random(rng: &mut Rng, n: usize, k: usize, block: usize) -> (Vec<u8>, Vec<f32>) {
    let q = (0..n * k)
        .map(|_| match rng.below(256) as u8 {
            b if b & 0x7f == 0x7f => b - 1,
            b => b,
        })
        .collect();
    let base = 1.0 / (448.0 * (k as f32).sqrt());
    let scales = (0..n.div_ceil(block) * k.div_ceil(block))
        .map(|_| base * (0.5 + rng.unit()))
        .collect();
    (q, scales)
}

/// The routed experts of `w` on backend `b` over `x` `[t, H]` (no shared expert), on the host.
fn routed<B: Backend>(b: &B, (t, x): (usize, &[f32]), w: &MoeWeights<B::Weight>) -> Vec<f32> {
    let x = b.upload(t, x.len() / t, x.to_vec()).unwrap();
    let y = b
        .moe_experts(&MoeCall {
            x: &x,
            w,
            shared: None,
        })
        .unwrap();
    b.to_host(y).unwrap().2
}

/// The backend's routed experts on a prefill-sized step (the grouped GEMM path) and a decode-sized
/// one (the GEMV path) against the CPU backend, bf16, INT4 and FP8 experts.
#[test]
fn backend_moe_prefill_matches_cpu() {
    let test = "backend_moe_prefill_matches_cpu";
    let Some(b) = crate::options::backend(test) else {
        return;
    };
    let cpu = CpuBackend::default();
    let mut rng = Rng::new(62);
    let (h, i, e, k) = (256usize, 128usize, 32usize, 4usize);
    // bits 0: FP8 experts (random e4m3 bytes, 128 × 128 block scales).
    for scheme in [None, Some((4u32, 32usize)), Some((0, 128))] {
        let router = rng.normals(e * h, 0.0, 0.3);
        let mut experts_g = vec![];
        let mut experts_c = vec![];
        for _ in 0..e {
            let gu = rng.normals(2 * i * h, 0.0, (h as f32).powf(-0.5));
            let dn = rng.normals(h * i, 0.0, (i as f32).powf(-0.5));
            let (gg, gc, dg, dc) = match scheme {
                None => {
                    let (gu, dn) = (to_bf16(&gu).1, to_bf16(&dn).1);
                    (
                        b.weight(gu.clone(), &[2 * i, h]).unwrap(),
                        cpu.weight(gu, &[2 * i, h]).unwrap(),
                        b.weight(dn.clone(), &[h, i]).unwrap(),
                        cpu.weight(dn, &[h, i]).unwrap(),
                    )
                }
                Some((0, block)) => {
                    let (qg, sg) = fp8_random(&mut rng, 2 * i, h, block);
                    let (qd, sd) = fp8_random(&mut rng, h, i, block);
                    let c = Fp8Config {
                        block: [block, block],
                        not_converted: Vec::new(),
                    };
                    let pg = fp8::packed("gu", &qg, &sg, &[2 * i, h], &c).unwrap();
                    let pd = fp8::packed("dn", &qd, &sd, &[h, i], &c).unwrap();
                    (
                        b.packed_weight(&pg).unwrap(),
                        cpu.packed_weight(&pg).unwrap(),
                        b.packed_weight(&pd).unwrap(),
                        cpu.packed_weight(&pd).unwrap(),
                    )
                }
                Some((bits, group_size)) => {
                    let s = QuantScheme { bits, group_size };
                    let pg = quantize("gu", &gu, 2 * i, h, s).unwrap();
                    let pd = quantize("dn", &dn, h, i, s).unwrap();
                    (
                        b.packed_weight(&pg).unwrap(),
                        cpu.packed_weight(&pg).unwrap(),
                        b.packed_weight(&pd).unwrap(),
                        cpu.packed_weight(&pd).unwrap(),
                    )
                }
            };
            experts_g.push(MlpWeights {
                gate_up: gg,
                down: dg,
                inter: i,
            });
            experts_c.push(MlpWeights {
                gate_up: gc,
                down: dc,
                inter: i,
            });
        }
        let router_b = to_bf16(&router).1;
        let wg = MoeWeights {
            router: b.weight(router_b.clone(), &[e, h]).unwrap(),
            experts: experts_g,
            top_k: k,
            renormalize: true,
            shared: None,
            shared_gate: None,
        };
        let wc = MoeWeights {
            router: cpu.weight(router_b, &[e, h]).unwrap(),
            experts: experts_c,
            top_k: k,
            renormalize: true,
            shared: None,
            shared_gate: None,
        };
        for t in [4usize, 1024] {
            assert_eq!(Gpu::moe_gemm_wanted(t, t * k), t == 1024);
            let x = to_bf16(&rng.normals(t * h, 0.0, 1.0)).1;
            let got = routed(&b, (t, &x), &wg);
            let want = routed(&cpu, (t, &x), &wc);
            let shape = format!("{}_h{h}_i{i}_e{e}_k{k}_t{t}", scheme_name(scheme));
            // The grouped GEMM of FP8 experts on the FP8 tensor cores (SANMAI_FP8_TENSOR_CORES=1)
            // quantises its inputs to e4m3; the CPU oracle keeps them in f32.
            if scheme == Some((0, 128)) && t == 1024 && crate::options::fp8_tensor_cores() {
                check_composite_e4m3("backend_moe", &shape, &got, &want);
            } else {
                check_composite("backend_moe", &shape, &got, &want);
            }
        }
    }
}
