//! The packed decode GEMV (`Gpu::gemv_packed`) at the projection shapes of Qwen3-Next-80B-A3B (hidden
//! 2048): INT8 per-row (GDN in_proj_qkvz and out_proj, attention q, k/v and o), INT6 per-row (the shared
//! expert's gate|up and down) and INT4 groups of 128 (an expert's gate|up and down), one large matrix
//! of INT4 and of INT6, and the 125B qwen4_exp QSA layers' INT8 q|k|v and o_proj (hidden 2560), at one
//! and eight rows of x.
//!
//! Each case is timed with CUDA events around many back-to-back launches whose weights rotate through
//! copies spanning 512 MiB, so that every launch reads its weights from HBM (the GPU's L2 holds one
//! projection), as a decode step does. The table gives the weight bytes read per second and that as a
//! share of the device-to-device copy bandwidth measured first (bytes read plus written per second,
//! as `sanmai bench` counts it). One-row cases run every kernel choice of `Gpu::set_packed_gemv_m1`
//! that takes them (`PackedM1`: the 32-value unit GEMV; for INT8 and INT4 the 16-byte chunk GEMV with
//! 1, 2 or 4 rows a slot; for INT8 with 1024 ≤ k ≤ 6144 the row-phase GEMV, a warp a row). Criterion then
//! times the default choice of each case.
//!
//!   cargo bench -p sanmai-cuda --bench gemv
//!
//! Without a CUDA device it prints a note and exits.

#[path = "support/timing.rs"]
mod timing;

use std::time::Duration;

use criterion::Criterion;
use cudarc::driver::{CudaSlice, CudaView};
use half::bf16;
use sanmai_cuda::registry::CompileOptions;
use sanmai_cuda::{gpu_present, Gpu, GpuOptions, PackedM1, PackedMat, PackedScheme};

/// Bytes of the rotating weight pool.
const POOL_BYTES: usize = 512 << 20;
/// Launches per timing.
const LAUNCHES: usize = 400;

/// One GEMV shape: a name, bits, group (0: per row), n, k.
struct Case {
    name: &'static str,
    bits: u32,
    group: usize,
    n: usize,
    k: usize,
}

const CASES: &[Case] = &[
    Case {
        name: "gdn.in_proj_qkvz",
        bits: 8,
        group: 0,
        n: 12288,
        k: 2048,
    },
    Case {
        name: "gdn.out_proj",
        bits: 8,
        group: 0,
        n: 2048,
        k: 4096,
    },
    Case {
        name: "attn.q_proj",
        bits: 8,
        group: 0,
        n: 8192,
        k: 2048,
    },
    Case {
        name: "attn.k_proj",
        bits: 8,
        group: 0,
        n: 512,
        k: 2048,
    },
    Case {
        name: "attn.o_proj",
        bits: 8,
        group: 0,
        n: 2048,
        k: 4096,
    },
    Case {
        name: "shared.gate_up",
        bits: 6,
        group: 0,
        n: 1024,
        k: 2048,
    },
    Case {
        name: "shared.down",
        bits: 6,
        group: 0,
        n: 2048,
        k: 512,
    },
    Case {
        name: "expert.gate_up",
        bits: 4,
        group: 128,
        n: 1024,
        k: 2048,
    },
    Case {
        name: "expert.down",
        bits: 4,
        group: 128,
        n: 2048,
        k: 512,
    },
    Case {
        name: "int4.large",
        bits: 4,
        group: 128,
        n: 12288,
        k: 2048,
    },
    Case {
        name: "int6.large",
        bits: 6,
        group: 0,
        n: 12288,
        k: 2048,
    },
    Case {
        name: "125b.qsa.q_k_v",
        bits: 8,
        group: 0,
        n: 13312,
        k: 2560,
    },
    Case {
        name: "125b.qsa.o_proj",
        bits: 8,
        group: 0,
        n: 2560,
        k: 6144,
    },
];

fn words_per_row(bits: u32, k: usize) -> usize {
    if bits == 6 {
        k.div_ceil(32) * 6
    } else {
        k.div_ceil(32 / bits as usize)
    }
}

/// A xorshift stream of u32 words.
fn words(n: usize, mut s: u64) -> Vec<u32> {
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 16) as u32
        })
        .collect()
}

/// The weights of one case: `copies` rotations through the pool, their scales, x and y.
struct Setup<'a> {
    case: &'a Case,
    pool: &'a CudaSlice<u32>,
    scales: CudaSlice<f32>,
    x: CudaSlice<bf16>,
    y: CudaSlice<bf16>,
    m: usize,
    wpm: usize,
    copies: usize,
}

impl<'a> Setup<'a> {
    fn new(g: &Gpu, pool: &'a CudaSlice<u32>, case: &'a Case, m: usize) -> Self {
        let wpm = case.n * words_per_row(case.bits, case.k);
        // Copies start 256-byte aligned.
        let stride = wpm.next_multiple_of(64);
        let copies = (pool.len() / stride).max(1);
        let cols = if case.group == 0 {
            1
        } else {
            case.k.div_ceil(case.group)
        };
        let scales: Vec<f32> = words(case.n * cols, 7)
            .iter()
            .map(|&w| 1e-3 + (w % 1000) as f32 * 1e-5)
            .collect();
        let x: Vec<bf16> = words(m * case.k, 11)
            .iter()
            .map(|&w| bf16::from_f32((w % 2001) as f32 / 1000.0 - 1.0))
            .collect();
        Setup {
            case,
            pool,
            scales: g.upload(&scales).expect("scales"),
            x: g.upload(&x).expect("x"),
            y: g.zeros::<bf16>(m * case.n).expect("y"),
            m,
            wpm,
            copies,
        }
    }

    fn view(&self, i: usize) -> CudaView<'a, u32> {
        let stride = self.wpm.next_multiple_of(64);
        let off = (i % self.copies) * stride;
        self.pool.slice(off..off + self.wpm)
    }

    fn launch(&mut self, g: &Gpu, i: usize) {
        let w = self.view(i);
        let mat = PackedMat {
            words: &w,
            scales: &self.scales,
            scheme: PackedScheme {
                bits: self.case.bits,
                group_size: self.case.group,
            },
            n: self.case.n,
            k: self.case.k,
        };
        g.gemv_packed(&mat, &self.x, &mut self.y, self.m)
            .expect("gemv_packed");
    }

    /// Seconds per launch over `launches` back-to-back launches (CUDA events).
    fn time(&mut self, g: &Gpu, launches: usize) -> f64 {
        timing::seconds_per_launch(g, launches, |i| self.launch(g, i))
    }

    fn bytes(&self) -> f64 {
        (self.wpm * 4) as f64
    }
}

fn main() {
    if !gpu_present() {
        println!("gemv bench: no CUDA device found, skipped");
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
            println!("gemv bench: no usable CUDA device ({e}), skipped");
            return;
        }
    };
    let default_m1 = g.packed_gemv_m1();
    let copy = g.copy_bandwidth().expect("copy bandwidth");
    println!(
        "device: {}; copy bandwidth {:.0} GB/s (read + written); PDL {}",
        g.info().name,
        copy / 1e9,
        options.pdl
    );
    let pool = g
        .upload(&words(POOL_BYTES / 4, 0x9E37_79B9_7F4A_7C15))
        .expect("pool");
    println!(
        "| case | format | n x k | m | kernel | us/launch | GB/s | % of copy |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    for case in CASES {
        for m in [1usize, 8] {
            let mut setup = Setup::new(&g, &pool, case, m);
            let choices: Vec<PackedM1> = if m == 1 {
                let mut c = vec![PackedM1::Units];
                if case.bits != 6 {
                    c.extend([1, 2, 4].map(PackedM1::Chunks));
                }
                if case.bits == 8 && (1024..=6144).contains(&case.k) {
                    c.push(PackedM1::Rows);
                }
                c
            } else {
                vec![default_m1]
            };
            for &choice in &choices {
                g.set_packed_gemv_m1(choice);
                let kernel = match (m, choice) {
                    (1, PackedM1::Units) => "unit".to_string(),
                    (1, PackedM1::Chunks(r)) => format!("chunk R={r}"),
                    (1, PackedM1::Rows) => "rows".to_string(),
                    _ => "tensor cores".to_string(),
                };
                let t = setup.time(&g, LAUNCHES);
                let gbs = setup.bytes() / t;
                let fmt = if case.group == 0 {
                    format!("INT{} per row", case.bits)
                } else {
                    format!("INT{} g{}", case.bits, case.group)
                };
                println!(
                    "| {} | {fmt} | {} x {} | {m} | {kernel} | {:.2} | {:.0} | {:.1} |",
                    case.name,
                    case.n,
                    case.k,
                    t * 1e6,
                    gbs / 1e9,
                    100.0 * gbs / copy
                );
            }
        }
    }
    g.set_packed_gemv_m1(default_m1);

    let mut c = Criterion::default()
        .configure_from_args()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    for case in CASES {
        for m in [1usize, 8] {
            let mut setup = Setup::new(&g, &pool, case, m);
            let id = format!("gemv_packed/{}/q{}/m{m}", case.name, case.bits);
            c.bench_function(&id, |b| {
                b.iter_custom(|iters| {
                    Duration::from_secs_f64(setup.time(&g, iters as usize) * iters as f64)
                })
            });
        }
    }
    c.final_summary();
}
