//! Each FP8 kernel against its CPU twin: the weight as the CPU oracle dequantises it
//! (`sanmai_weights::fp8::dequantize`: `fp8(q) · scale_inv[block]` in f32), multiplied by `matmul_t`.

use half::bf16;
use sanmai_config::Fp8Config;
use sanmai_cpu::ops;
use sanmai_cuda::cudarc::driver::{CudaSlice, DevicePtr};
use sanmai_cuda::{moe_max_tiles, Fp8Experts, Fp8Mat, Gpu, GpuOptions, PairGroups, PairRows};
use sanmai_weights::fp8;

use crate::{bf16_round, rel_errors, Rng};

/// The device, with the FP8 tensor cores on whatever the run's default: these tests are the
/// tensor-core kernels' own.
pub(crate) fn gpu(test: &str) -> Option<Gpu> {
    let options = GpuOptions {
        fp8_tensor_cores: true,
        ..crate::options::gpu_options()
    };
    match Gpu::new(0, &options) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("skipped: {test}: {e}");
            None
        }
    }
}

pub(crate) fn cfg(block: [usize; 2]) -> Fp8Config {
    Fp8Config {
        block,
        not_converted: Vec::new(),
    }
}

/// A random FP8 weight `[n, k]`: its bytes (no NaN codes), its block scales (varied, so every block
/// has its own) and the CPU oracle's f32 values.
pub(crate) struct Weight {
    pub bytes: Vec<u8>,
    pub block_scales: Vec<f32>,
    pub dense: Vec<f32>,
    pub n: usize,
    pub k: usize,
    pub block: [usize; 2],
}

impl Weight {
    pub fn new(rng: &mut Rng, n: usize, k: usize, block: [usize; 2]) -> Self {
        let c = cfg(block);
        let bytes: Vec<u8> = (0..n * k)
            .map(|_| {
                let b = rng.below(256) as u8;
                if b & 0x7f == 0x7f {
                    b - 1
                } else {
                    b
                }
            })
            .collect();
        let [sr, sc] = c.scale_shape(n, k);
        // Around 1 / (448 · sqrt(k)): values of a Linear's size.
        let base = 1.0 / (448.0 * (k as f32).sqrt());
        let block_scales: Vec<f32> = (0..sr * sc).map(|_| base * (0.5 + rng.unit())).collect();
        let dense = fp8::dequantize(&bytes, &block_scales, &[n, k], &c);
        Weight {
            bytes,
            block_scales,
            dense,
            n,
            k,
            block,
        }
    }

    /// The weight on the device as the backend keeps it: its bytes and per-row scales (through
    /// `fp8::packed`, whose dequantisation must equal the oracle's bit for bit).
    pub fn upload(&self, g: &Gpu) -> (CudaSlice<u8>, CudaSlice<f32>) {
        let p = fp8::packed(
            "w",
            &self.bytes,
            &self.block_scales,
            &[self.n, self.k],
            &cfg(self.block),
        )
        .unwrap();
        assert!(p.fp8 && p.group_size == self.block[1]);
        let same = p
            .dequantize()
            .iter()
            .zip(&self.dense)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "packed FP8 dequantises as the oracle");
        let raw = p.packed_bytes();
        (
            g.upload(&raw[..self.n * self.k]).unwrap(),
            g.upload(&p.scales).unwrap(),
        )
    }
}

pub(crate) fn to_bf16(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

#[test]
fn fp8_gemv_matches_cpu() {
    let Some(g) = gpu("fp8_gemv_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(801);
    // (n, k, block): partial edge blocks (k = 160: a 32-column last group; n = 300), the 80B's
    // projection shapes (in_proj_qkvz 12288 x 2048 as 2048 rows here, o_proj k = 4096), a small block.
    let cases = [
        (300, 160, [128, 128]),
        (2048, 2048, [128, 128]),
        (77, 4096, [128, 128]),
        (40, 96, [32, 16]),
    ];
    for (n, k, block) in cases {
        let w = Weight::new(&mut rng, n, k, block);
        let (db, ds) = w.upload(&g);
        let mat = Fp8Mat {
            bytes: &db,
            scales: &ds,
            group: block[1],
            n,
            k,
        };
        for m in 1..=8 {
            let x = bf16_round(&rng.normals(m * k));
            let mut want = vec![0f32; m * n];
            ops::matmul_t(&x, &w.dense, m, k, n, &mut want);
            let dx = g.upload(&to_bf16(&x)).unwrap();
            let mut y = g.zeros::<bf16>(m * n).unwrap();
            g.gemv_fp8(&mat, &dx, &mut y, m).unwrap();
            let got: Vec<f32> = g.download(&y).unwrap().iter().map(|v| v.to_f32()).collect();
            let mut yf = g.zeros::<f32>(m * n).unwrap();
            g.gemv_fp8_f32(&mat, &dx, &mut yf, m).unwrap();
            let got_f = g.download(&yf).unwrap();
            let (bmax, brms) = rel_errors(&got, &want);
            let (fmax, _) = rel_errors(&got_f, &want);
            println!(
                "FP8 check=gemv n={n} k={k} block={block:?} m={m} bf16_max_rel={bmax:.3e} bf16_rms_rel={brms:.3e} f32_max_rel={fmax:.3e} tol=bf16:1e-2/4e-3,f32:1e-4"
            );
            assert!(
                bmax <= 1e-2 && brms <= 4e-3,
                "n {n} k {k} m {m}: {bmax} {brms}"
            );
            assert!(fmax <= 1e-4, "n {n} k {k} m {m}: f32 {fmax}");
        }
    }
}

#[test]
fn fp8_gemv_many_equals_one_weight_at_a_time() {
    let Some(g) = gpu("fp8_gemv_many_equals_one_weight_at_a_time") else {
        return;
    };
    let mut rng = Rng::new(802);
    let (k, m) = (256, 3);
    let ns = [512, 64, 33];
    let ws: Vec<Weight> = ns
        .iter()
        .map(|&n| Weight::new(&mut rng, n, k, [128, 128]))
        .collect();
    let up: Vec<_> = ws.iter().map(|w| w.upload(&g)).collect();
    let x = bf16_round(&rng.normals(m * k));
    let dx = g.upload(&to_bf16(&x)).unwrap();
    let mut ys: Vec<CudaSlice<bf16>> = ns.iter().map(|&n| g.zeros(m * n).unwrap()).collect();
    let mut parts: Vec<_> = up
        .iter()
        .zip(ys.iter_mut())
        .zip(ns)
        .map(|(((b, s), y), n)| (b, s, y, n))
        .collect();
    g.gemv_fp8_many(128, &dx, &mut parts, m, k).unwrap();
    for ((w, (b, s)), y) in ws.iter().zip(&up).zip(&ys) {
        let mat = Fp8Mat {
            bytes: b,
            scales: s,
            group: 128,
            n: w.n,
            k,
        };
        let mut one = g.zeros::<bf16>(m * w.n).unwrap();
        g.gemv_fp8(&mat, &dx, &mut one, m).unwrap();
        let (a, b) = (g.download(y).unwrap(), g.download(&one).unwrap());
        assert!(a == b, "n {}: one launch of three equals its own", w.n);
    }
    println!("FP8 check=gemv_many weights=3 k={k} m={m} identical=true");
}

#[test]
fn fp8_dequant_and_prefill_gemm_match_cpu() {
    let Some(g) = gpu("fp8_dequant_and_prefill_gemm_match_cpu") else {
        return;
    };
    let mut rng = Rng::new(803);
    for (n, k, m) in [(300, 160, 40), (1000, 2048, 300), (512, 512, 9)] {
        let w = Weight::new(&mut rng, n, k, [128, 128]);
        let (db, ds) = w.upload(&g);
        let mat = Fp8Mat {
            bytes: &db,
            scales: &ds,
            group: 128,
            n,
            k,
        };
        // The tile dequantisation: bf16(fp8 · scale), bit for bit.
        let mut tile = g.zeros::<bf16>(n * k).unwrap();
        g.dequant_fp8(&mat, &mut tile, 0, n).unwrap();
        let got = g.download(&tile).unwrap();
        let want = to_bf16(&w.dense);
        let exact = got
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(exact, "n {n} k {k}: dequantised tile");
        // The GEMM through a workspace of 100 rows (several tiles), against the bf16 weights it
        // multiplies.
        let x = bf16_round(&rng.normals(m * k));
        let mut want_y = vec![0f32; m * n];
        ops::matmul_t(&x, &bf16_round(&w.dense), m, k, n, &mut want_y);
        let dx = g.upload(&to_bf16(&x)).unwrap();
        let mut ws = g.zeros::<bf16>(100 * k).unwrap();
        let mut y = g.zeros::<bf16>(m * n).unwrap();
        g.gemm_fp8(&dx, &mat, &mut y, &mut ws, m).unwrap();
        let got_y: Vec<f32> = g.download(&y).unwrap().iter().map(|v| v.to_f32()).collect();
        let (max, rms) = rel_errors(&got_y, &want_y);
        println!(
            "FP8 check=gemm n={n} k={k} m={m} dequant_exact={exact} max_rel={max:.3e} rms_rel={rms:.3e} tol=1e-2/4e-3"
        );
        assert!(max <= 1e-2 && rms <= 4e-3, "n {n} k {k} m {m}: {max} {rms}");
    }
}

#[test]
fn fp8_grouped_gemv_and_gemm_match_cpu() {
    let Some(g) = gpu("fp8_grouped_gemv_and_gemm_match_cpu") else {
        return;
    };
    let mut rng = Rng::new(804);
    // (hidden, inter, experts, top_k, tokens, pool): the 80B's decode at batch 1 and 8 (512 experts,
    // top 10, gate|up n 1024 k 2048, down n 2048 k 512) and a 64-token prefill, prefill-sized tiles (plain kernels, every
    // pass size), the tiny fixtures' shapes (k = 160 with a partial group, k = 32).
    let cases = [
        (2048, 512, 512, 10, 1, 10),
        (2048, 512, 512, 10, 8, 40),
        (2048, 512, 512, 10, 64, 40),
        (256, 96, 16, 4, 20, 0),
        (160, 32, 8, 2, 40, 0),
        (160, 32, 8, 2, 1, 0),
    ];
    for (h, i, e, k, t, pool) in cases {
        let n = t * k;
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
        let gus: Vec<Weight> = used
            .iter()
            .map(|_| Weight::new(&mut rng, 2 * i, h, [128, 128]))
            .collect();
        let dns: Vec<Weight> = used
            .iter()
            .map(|_| Weight::new(&mut rng, h, i, [128, 128]))
            .collect();
        let x = bf16_round(&rng.normals(t * h));
        let act = bf16_round(&rng.normals(n * i));
        let mut want_gu = vec![0f32; n * 2 * i];
        let mut want_dn = vec![0f32; n * h];
        for p in 0..n {
            let ex = slot[ids[p] as usize];
            let x_row = &x[(p / k) * h..(p / k + 1) * h];
            ops::matmul_t(
                x_row,
                &gus[ex].dense,
                1,
                h,
                2 * i,
                &mut want_gu[p * 2 * i..(p + 1) * 2 * i],
            );
            ops::matmul_t(
                &act[p * i..(p + 1) * i],
                &dns[ex].dense,
                1,
                i,
                h,
                &mut want_dn[p * h..(p + 1) * h],
            );
        }
        let (_gu_bufs, gu_b, gu_s) = expert_tables(&g, &gus, &slot);
        let (_dn_bufs, dn_b, dn_s) = expert_tables(&g, &dns, &slot);
        let dx = g.upload(&to_bf16(&x)).unwrap();
        let da = g.upload(&to_bf16(&act)).unwrap();
        let di = g.upload(&ids).unwrap();
        let mut perm = g.zeros::<u32>(n).unwrap();
        let mut tiles = g.zeros::<u32>(3 * moe_max_tiles(n, e)).unwrap();
        g.moe_sort(&di, n, e, &mut perm, &mut tiles).unwrap();
        let groups = PairGroups {
            perm: &perm,
            tiles: &tiles,
            n_pairs: n,
        };
        let mut y_gu = g.zeros::<bf16>(n * 2 * i).unwrap();
        let gate_up = Fp8Experts {
            bytes: &gu_b,
            scales: &gu_s,
            group: 128,
            n: 2 * i,
            k: h,
        };
        let token_rows = PairRows {
            x: &dx,
            rows: t,
            div: k,
            tail: None,
        };
        g.moe_gemv_fp8(&gate_up, &token_rows, &groups, &mut y_gu)
            .unwrap();
        let mut y_dn = g.zeros::<f32>(n * h).unwrap();
        let down = Fp8Experts {
            bytes: &dn_b,
            scales: &dn_s,
            group: 128,
            n: h,
            k: i,
        };
        let pair_rows = PairRows {
            x: &da,
            rows: n,
            div: 1,
            tail: None,
        };
        g.moe_gemv_fp8(&down, &pair_rows, &groups, &mut y_dn)
            .unwrap();
        let kind = if n <= 4 * e {
            "moe_gemv_m1"
        } else {
            "moe_gemv"
        };
        let shape = format!("h={h} i={i} e={e} k={k} t={t} pool={pool}");
        check_grouped(&g, (kind, &shape), (&y_gu, &y_dn), (&want_gu, &want_dn));
        if Gpu::moe_gemv_fp8_fuses_swiglu(i) {
            // The down GEMV with the SwiGLU staged in its blocks equals SwiGLU then the GEMV, bit for
            // bit, on gate|up rows [n, 2i].
            let gu_in = g.upload(&to_bf16(&rng.normals(n * 2 * i))).unwrap();
            let mut act_buf = g.zeros::<bf16>(n * i).unwrap();
            g.swiglu(&gu_in, &mut act_buf, n, i).unwrap();
            let rows = |x| PairRows {
                x,
                rows: n,
                div: 1,
                tail: None,
            };
            let mut y_two = g.zeros::<f32>(n * h).unwrap();
            g.moe_gemv_fp8(&down, &rows(&act_buf), &groups, &mut y_two)
                .unwrap();
            let mut y_one = g.zeros::<f32>(n * h).unwrap();
            g.moe_gemv_fp8_swiglu(&down, &rows(&gu_in), &groups, &mut y_one)
                .unwrap();
            let (a, b) = (g.download(&y_one).unwrap(), g.download(&y_two).unwrap());
            let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
            println!("FP8 check=moe_gemv_swiglu h={h} i={i} t={t} equal_to_unfused={same}");
            assert!(same, "the fused SwiGLU changed the down projection");
        }
        if !(Gpu::moe_gemm_fp8_supports(128, h) && Gpu::moe_gemm_fp8_supports(128, i)) {
            continue;
        }
        // The tensor-core grouped GEMM (prefill) on the same pairs, tables and inputs.
        let mut tiles = g.zeros::<u32>(3 * Gpu::moe_gemm_max_tiles(n, e)).unwrap();
        g.moe_gemm_plan(&di, n, e, &mut perm, &mut tiles).unwrap();
        let groups = PairGroups {
            perm: &perm,
            tiles: &tiles,
            n_pairs: n,
        };
        let mut y_gu = g.zeros::<bf16>(n * 2 * i).unwrap();
        g.moe_gemm_fp8(&gate_up, &token_rows, &groups, &mut y_gu)
            .unwrap();
        let mut y_dn = g.zeros::<f32>(n * h).unwrap();
        g.moe_gemm_fp8(&down, &pair_rows, &groups, &mut y_dn)
            .unwrap();
        check_grouped(
            &g,
            ("moe_gemm", &shape),
            (&y_gu, &y_dn),
            (&want_gu, &want_dn),
        );
    }
}

/// Device copies of FP8 weights (bytes, per-row scales) and their bytes' and scales' address tables.
pub(crate) type ExpertTables = (
    Vec<(CudaSlice<u8>, CudaSlice<f32>)>,
    CudaSlice<u64>,
    CudaSlice<u64>,
);

/// The device copies of `ws` (bytes and per-row scales) and the address tables of the experts, expert
/// `x` taking `ws[slot[x]]`.
pub(crate) fn expert_tables(g: &Gpu, ws: &[Weight], slot: &[usize]) -> ExpertTables {
    let up: Vec<_> = ws.iter().map(|w| w.upload(g)).collect();
    let s = g.stream();
    let bp: Vec<u64> = slot.iter().map(|&j| up[j].0.device_ptr(s).0).collect();
    let sp: Vec<u64> = slot.iter().map(|&j| up[j].1.device_ptr(s).0).collect();
    (up, g.upload(&bp).unwrap(), g.upload(&sp).unwrap())
}

/// A grouped kernel's gate|up (bf16) and down (f32) outputs against the CPU's, within the packed
/// formats' bounds, with one `FP8` line.
pub(crate) fn check_grouped(
    g: &Gpu,
    (kind, shape): (&str, &str),
    (y_gu, y_dn): (&CudaSlice<bf16>, &CudaSlice<f32>),
    (want_gu, want_dn): (&[f32], &[f32]),
) {
    let got_gu: Vec<f32> = g
        .download(y_gu)
        .unwrap()
        .iter()
        .map(|v| v.to_f32())
        .collect();
    let got_dn = g.download(y_dn).unwrap();
    let (gmax, grms) = rel_errors(&got_gu, want_gu);
    let (dmax, drms) = rel_errors(&got_dn, want_dn);
    println!(
        "FP8 check={kind} {shape} gate_up_max_rel={gmax:.3e} gate_up_rms_rel={grms:.3e} down_f32_max_rel={dmax:.3e} down_f32_rms_rel={drms:.3e} tol=bf16:1e-2/4e-3,f32:1e-4"
    );
    assert!(gmax <= 1e-2 && grms <= 4e-3, "{kind} gate|up {gmax} {grms}");
    assert!(dmax <= 1e-4, "{kind} down {dmax}");
}

impl Rng {
    /// `n` standard normals.
    pub(crate) fn normals(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.normal()).collect()
    }
}
