//! The FP8 decode GEMV (`Gpu::gemv_fp8`) at the projection shapes of Qwen3-Next-80B-A3B-FP8 (hidden
//! 2048, blocks of 128 x 128): the GDN in_proj_qkvz and out_proj, attention q, k/v and o, the shared
//! expert's and one routed expert's gate|up and down, at 1, 4 and 8 rows of x (1: the FMA GEMV; 4 and
//! 8: the tensor cores).
//!
//! As `benches/gemv.rs` times the packed GEMV: CUDA events around many back-to-back launches whose
//! weights rotate through copies spanning 512 MiB (every launch reads its weights from HBM, as a decode
//! step does); the table gives the weight bytes read per second (scales and x not counted) and that as
//! a share of the device-to-device copy bandwidth measured first (bytes read plus written per second,
//! as `sanmai bench` counts it).
//!
//!   cargo bench -p sanmai-cuda --bench fp8_gemv
//!
//! Without a CUDA device it prints a note and exits.

#[path = "support/timing.rs"]
mod timing;

use cudarc::driver::{CudaSlice, CudaView};
use half::bf16;
use sanmai_cuda::registry::CompileOptions;
use sanmai_cuda::{gpu_present, Fp8Mat, Gpu, GpuOptions};

/// Bytes of the rotating weight pool.
const POOL_BYTES: usize = 512 << 20;
/// Launches per timing.
const LAUNCHES: usize = 400;
/// Columns a scale covers (the releases' 128 x 128 blocks, repeated per row).
const GROUP: usize = 128;

/// The 80B's FP8 projections: a name, n, k.
const CASES: &[(&str, usize, usize)] = &[
    ("gdn.in_proj_qkvz", 12288, 2048),
    ("gdn.out_proj / attn.o_proj", 2048, 4096),
    ("attn.q_proj", 8192, 2048),
    ("attn.k_proj / v_proj", 512, 2048),
    ("shared.gate_up / expert.gate_up", 1024, 2048),
    ("shared.down / expert.down", 2048, 512),
];

/// A xorshift stream of bytes, none of them an e4m3 NaN code.
fn codes(n: usize, mut s: u64) -> Vec<u8> {
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let b = (s >> 24) as u8;
            if b & 0x7f == 0x7f {
                b - 1
            } else {
                b
            }
        })
        .collect()
}

/// One case's rotating weights (copies through the pool, 256-byte aligned), scales, x and y.
struct Setup<'a> {
    pool: &'a CudaSlice<u8>,
    scales: CudaSlice<f32>,
    x: CudaSlice<bf16>,
    y: CudaSlice<bf16>,
    n: usize,
    k: usize,
    m: usize,
    copies: usize,
}

impl<'a> Setup<'a> {
    fn new(g: &Gpu, pool: &'a CudaSlice<u8>, (n, k): (usize, usize), m: usize) -> Self {
        let stride = (n * k).next_multiple_of(256);
        let scales: Vec<f32> = codes(n * k.div_ceil(GROUP), 7)
            .iter()
            .map(|&b| 1e-3 + b as f32 * 1e-6)
            .collect();
        let x: Vec<bf16> = codes(m * k, 11)
            .iter()
            .map(|&b| bf16::from_f32(b as f32 / 128.0 - 1.0))
            .collect();
        Setup {
            pool,
            scales: g.upload(&scales).expect("scales"),
            x: g.upload(&x).expect("x"),
            y: g.zeros::<bf16>(m * n).expect("y"),
            n,
            k,
            m,
            copies: (pool.len() / stride).max(1),
        }
    }

    fn view(&self, i: usize) -> CudaView<'a, u8> {
        let stride = (self.n * self.k).next_multiple_of(256);
        let off = (i % self.copies) * stride;
        self.pool.slice(off..off + self.n * self.k)
    }

    fn launch(&mut self, g: &Gpu, i: usize) {
        let w = self.view(i);
        let mat = Fp8Mat {
            bytes: &w,
            scales: &self.scales,
            group: GROUP,
            n: self.n,
            k: self.k,
        };
        g.gemv_fp8(&mat, &self.x, &mut self.y, self.m)
            .expect("gemv_fp8");
    }

    /// Seconds per launch over `launches` back-to-back launches (CUDA events).
    fn time(&mut self, g: &Gpu, launches: usize) -> f64 {
        timing::seconds_per_launch(g, launches, |i| self.launch(g, i))
    }
}

fn main() {
    if !gpu_present() {
        println!("fp8_gemv bench: no CUDA device found, skipped");
        return;
    }
    let options = GpuOptions {
        pdl: !std::env::var("SANMAI_PDL").is_ok_and(|v| matches!(v.trim(), "0" | "off" | "false")),
        fp8_tensor_cores: true,
        row_gemv: true,
        compile: CompileOptions::from_vars(|v| std::env::var_os(v)),
    };
    let g = match Gpu::new(0, &options) {
        Ok(g) => g,
        Err(e) => {
            println!("fp8_gemv bench: no usable CUDA device ({e}), skipped");
            return;
        }
    };
    let copy = g.copy_bandwidth().expect("copy bandwidth");
    println!(
        "device: {}; copy bandwidth {:.0} GB/s (read + written); PDL {}",
        g.info().name,
        copy / 1e9,
        options.pdl
    );
    let pool = g
        .upload(&codes(POOL_BYTES, 0x9E37_79B9_7F4A_7C15))
        .expect("pool");
    println!(
        "| case | n x k | m | kernel | us/launch | GB/s | % of copy |\n| --- | --- | --- | --- | --- | --- | --- |"
    );
    for &(name, n, k) in CASES {
        for m in [1usize, 4, 8] {
            let mut setup = Setup::new(&g, &pool, (n, k), m);
            let t = setup.time(&g, LAUNCHES);
            let gbs = (n * k) as f64 / t;
            let kernel = if m == 1 { "FMA" } else { "tensor cores" };
            println!(
                "| {name} | {n} x {k} | {m} | {kernel} | {:.2} | {:.0} | {:.1} |",
                t * 1e6,
                gbs / 1e9,
                100.0 * gbs / copy
            );
        }
    }
}
