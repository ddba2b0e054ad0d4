//! Timing (ignored by default; `--ignored` runs it): the decode GEMV at the lm_head shape against the
//! HBM roofline, a device-to-device copy for the measured bandwidth, and one cuBLAS prefill GEMM.
//! Prints `BENCH` lines.

use cudarc::driver::sys::CUevent_flags;
use half::bf16;
use sanmai_cuda::cudarc::driver::CudaSlice;
use sanmai_cuda::{cudarc, Gpu};

use crate::common::gpu;

/// Datasheet HBM3e bandwidth of the H200, bytes/s.
const H200_BW: f64 = 4.8e12;

/// Mean seconds per call of `f` over `iters` calls after `warm` warm-up calls, timed with events.
pub fn time(g: &Gpu, warm: usize, iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..warm {
        f();
    }
    let s = g.stream();
    let start = s
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    for _ in 0..iters {
        f();
    }
    let end = s
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    start.elapsed_ms(&end).unwrap() as f64 / 1e3 / iters as f64
}

/// Bytes [`L2Flush`] writes: more than the L2 of the GPUs the benches run on (50 MB on an H100 or H200).
const FLUSH_BYTES: usize = 128 << 20;

/// A buffer larger than L2, written before a launch so that the launch finds its weights and code in
/// DRAM, as a layer launch inside a decode step does (the other layers' weights passed through L2
/// since its last run). A layer bench's launches one after another on the same weights keep part of
/// them, and the kernel's code, in L2: faster than the step.
struct L2Flush(CudaSlice<u8>);

impl L2Flush {
    fn new(g: &Gpu) -> Self {
        Self(g.zeros(FLUSH_BYTES).unwrap())
    }

    /// Writes the buffer (queued on the GPU's stream, before what is queued next).
    fn run(&mut self, g: &Gpu) {
        g.stream().memset_zeros(&mut self.0).unwrap();
    }
}

/// A layer kernel's launches each after [`L2Flush`]: the median µs of 20 single launches (`launch(i,
/// false)`, events around the launch alone) and its trace medians over 40 (`launch(i, true)` returns
/// the launch's trace; [`trace_medians`]).
pub fn cold_launches(
    g: &Gpu,
    kernel: &str,
    mut launch: impl FnMut(usize, bool) -> Vec<u64>,
) -> (f64, String) {
    let mut flush = L2Flush::new(g);
    let mut us: Vec<f64> = (0..20)
        .map(|i| {
            flush.run(g);
            1e6 * time(g, 0, 1, || {
                launch(i, false);
            })
        })
        .collect();
    us.sort_by(f64::total_cmp);
    let phases = trace_medians(40, kernel, |i| {
        flush.run(g);
        launch(i, true)
    });
    (us[us.len() / 2], phases)
}

/// [`cold_launches`] of a launch that takes its trace buffer (`launch(i, Some(trace))` writes it).
pub fn cold_launches_into(
    g: &Gpu,
    kernel: &str,
    trace: &mut CudaSlice<u64>,
    mut launch: impl FnMut(usize, Option<&mut CudaSlice<u64>>),
) -> (f64, String) {
    cold_launches(g, kernel, |i, traced| {
        if traced {
            launch(i, Some(&mut *trace));
            g.download(&*trace).unwrap()
        } else {
            launch(i, None);
            Vec::new()
        }
    })
}

/// Cheap deterministic bf16 filler in about [-0.5, 0.5).
pub fn pattern(n: usize, salt: u32) -> Vec<bf16> {
    (0..n as u32)
        .map(|i| {
            let h = (i ^ salt).wrapping_mul(2_654_435_761) >> 16;
            bf16::from_f32(h as f32 / 65536.0 - 0.5)
        })
        .collect()
}

/// The medians over `n` traced launches of a persistent layer kernel's trace spans
/// (`sanmai_cuda::layer_phases` of `kernel`: name, from slot, to slot; the device's global timer in
/// ns), as `name=µs` words: `traced(i)` runs launch `i` and returns its trace.
pub fn trace_medians(n: usize, kernel: &str, mut traced: impl FnMut(usize) -> Vec<u64>) -> String {
    let spans =
        sanmai_cuda::layer_phases(kernel).unwrap_or_else(|| panic!("{kernel} has no trace phases"));
    let mut us: Vec<Vec<f64>> = vec![Vec::new(); spans.len()];
    for i in 0..n {
        let t = traced(i);
        for (s, &(_, a, b)) in us.iter_mut().zip(spans) {
            s.push((t[b] as f64 - t[a] as f64) / 1e3);
        }
    }
    us.iter_mut()
        .zip(spans)
        .map(|(s, (name, _, _))| {
            s.sort_by(f64::total_cmp);
            format!("{name}={:.2}", s[s.len() / 2])
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_gemv_gemm_copy() {
    let t0 = std::time::Instant::now();
    let Some(g) = gpu("bench_gemv_gemm_copy") else {
        return;
    };
    println!(
        "BENCH startup gpu_new_ms={:.0} (context, kernels from the disk cache, cuBLAS handle)",
        t0.elapsed().as_secs_f64() * 1e3
    );
    let info = g.info();
    println!(
        "BENCH device name=\"{}\" arch={} sms={} mem_gib={:.1} driver={}",
        info.name,
        info.arch(),
        info.multiprocessors,
        info.total_memory as f64 / (1u64 << 30) as f64,
        info.driver_version
    );

    // Device copy bandwidth (read + write), 2 GiB.
    let len = 1usize << 30;
    let src = g.zeros::<bf16>(len).unwrap();
    let mut dst = g.zeros::<bf16>(len).unwrap();
    let t = time(g, 2, 10, || g.stream().memcpy_dtod(&src, &mut dst).unwrap());
    let copy_bw = 2.0 * (len * 2) as f64 / t;
    println!(
        "BENCH copy bytes={} time_us={:.1} GB/s={:.0}",
        2 * len * 2,
        t * 1e6,
        copy_bw / 1e9
    );
    drop((src, dst));

    // Decode GEMV at the lm_head shape (vocab 248320, hidden 2560).
    let (n, k) = (248_320usize, 2560usize);
    let w = g.upload(&pattern(n * k, 1)).unwrap();
    for m in [1usize, 2, 4, 8] {
        let x = g.upload(&pattern(m * k, 7)).unwrap();
        let mut y = g.zeros::<bf16>(m * n).unwrap();
        let t = time(g, 5, 50, || g.gemv_bf16(&w, &x, &mut y, m, n, k).unwrap());
        let bytes = (n * k + m * k + m * n) * 2;
        let bw = bytes as f64 / t;
        println!(
            "BENCH gemv_bf16 m={m} n={n} k={k} bytes={bytes} time_us={:.1} GB/s={:.0} \
             frac_of_4.8TB/s={:.3} frac_of_copy={:.3}",
            t * 1e6,
            bw / 1e9,
            bw / H200_BW,
            bw / copy_bw
        );
    }
    let x = g.upload(&pattern(k, 7)).unwrap();
    let mut y = g.zeros::<f32>(n).unwrap();
    let t = time(g, 5, 50, || {
        g.gemv_bf16_f32(&w, &x, &mut y, 1, n, k).unwrap()
    });
    let bytes = (n * k + k) * 2 + n * 4;
    println!(
        "BENCH gemv_bf16_f32 m=1 n={n} k={k} time_us={:.1} GB/s={:.0} frac_of_4.8TB/s={:.3}",
        t * 1e6,
        bytes as f64 / t / 1e9,
        bytes as f64 / t / H200_BW
    );
    drop(w);

    // Smaller decode GEMVs (one dense projection of Qwen3-Next: 2048 → 8192 rows).
    for (n, k) in [(8192usize, 2048usize), (2048, 4096)] {
        let w = g.upload(&pattern(n * k, 3)).unwrap();
        let x = g.upload(&pattern(k, 5)).unwrap();
        let mut y = g.zeros::<bf16>(n).unwrap();
        let t = time(g, 5, 200, || g.gemv_bf16(&w, &x, &mut y, 1, n, k).unwrap());
        let bytes = (n * k + k + n) * 2;
        println!(
            "BENCH gemv_bf16 m=1 n={n} k={k} bytes={bytes} time_us={:.2} GB/s={:.0} frac_of_4.8TB/s={:.3}",
            t * 1e6,
            bytes as f64 / t / 1e9,
            bytes as f64 / t / H200_BW
        );
    }

    // Prefill GEMM through cuBLAS.
    for (m, n, k) in [(4096usize, 8192usize, 2048usize), (2048, 2048, 4096)] {
        let x = g.upload(&pattern(m * k, 9)).unwrap();
        let w = g.upload(&pattern(n * k, 11)).unwrap();
        let mut y = g.zeros::<bf16>(m * n).unwrap();
        let t = time(g, 3, 20, || g.gemm_bf16(&x, &w, &mut y, m, n, k).unwrap());
        println!(
            "BENCH gemm_bf16 m={m} n={n} k={k} time_us={:.1} TFLOP/s={:.0}",
            t * 1e6,
            2.0 * (m * n * k) as f64 / t / 1e12
        );
    }
}

/// A packed INT8 `[n, k]` weight with per-row scales, random words (the persistent layers' benches).
pub fn int8_proj(g: &Gpu, n: usize, k: usize, salt: u32) -> (CudaSlice<u32>, CudaSlice<f32>) {
    let words: Vec<u32> = (0..n * k / 4)
        .map(|i| (i as u32 ^ salt).wrapping_mul(2_654_435_761))
        .collect();
    let scales: Vec<f32> = (0..n).map(|i| 1e-3 * (1.0 + (i % 7) as f32)).collect();
    (g.upload(&words).unwrap(), g.upload(&scales).unwrap())
}
