//! The vision tower on the GPU ([`sanmai_cuda::vision::CudaTower`]) against the CPU reference
//! (`sanmai_vision::tower`, f32 weights, f64 accumulation):
//!
//! - `tests/fixtures/qwen3_5_mm_tiny`'s tower over both fixture images in one call (two frames of
//!   different sizes: attention must stay within each), also against transformers' merged tokens
//!   in `reference.json`;
//! - a random tower of Qwen3.5's real vision shape (width 1152, 16 heads of 72, MLP 4304, patch
//!   16, merge 2, out 2048; 2 blocks) over a random image of 24×24 patches;
//! - timings (printed, not asserted) of the full 27-block tower over 1 MP (64×64 patches) and
//!   2 MP (90×90 patches) images.
//!
//! The GPU keeps the linears' matrices and the GEMM inputs in bf16 (8 significant bits), everything
//! else in f32, so the merged tokens are held to the relative rms error [`RMS_REL`] and the
//! max-norm relative error [`MAX_REL`] against the CPU's f32/f64 forward.
//!
//! Without a GPU every test prints `skipped: <test>: <reason>` and passes. Each check prints one
//! `VISION` line.

#[path = "support/options.rs"]
#[allow(dead_code)]
mod options;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use sanmai_config::ModelConfig;
use sanmai_cuda::vision::CudaTower;
use sanmai_cuda::Gpu;
use sanmai_model::vision::{Grid, Tower, Vision};
use sanmai_vision::tower::{Tensor, VisionConfig, VisionWeights};
use sanmai_weights::{Checkpoint, Dummy, Init};
use serde_json::Value;

/// `rms(gpu − cpu) / rms(cpu)` over the merged tokens.
const RMS_REL: f64 = 2e-2;
/// `max |gpu − cpu| / max |cpu|` over the merged tokens.
const MAX_REL: f64 = 5e-2;

/// One device shared by the tests (its kernels compiled once).
fn gpu(test: &str) -> Option<&'static Gpu> {
    static GPU: OnceLock<Result<Gpu, String>> = OnceLock::new();
    match GPU.get_or_init(|| Gpu::new(0, &options::gpu_options()).map_err(|e| e.to_string())) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("skipped: {test}: {e}");
            None
        }
    }
}

/// `qwen3_5_mm_tiny` under `$SANMAI_FIXTURES`, else `tests/fixtures` under the working directory (a
/// prebuilt binary run from the repository root), else the one next to this crate.
fn fixture() -> PathBuf {
    let name = "qwen3_5_mm_tiny";
    [
        std::env::var_os("SANMAI_FIXTURES").map(PathBuf::from),
        Some(PathBuf::from("tests/fixtures")),
        Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")),
    ]
    .into_iter()
    .flatten()
    .map(|d| d.join(name))
    .find(|d| d.is_dir())
    .unwrap_or_else(|| panic!("fixture {name} not found: set SANMAI_FIXTURES"))
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `(max abs error, max-norm relative, rms relative)` of `got` against `want`.
fn errors(got: &[f32], want: &[f64]) -> (f64, f64, f64) {
    assert_eq!(got.len(), want.len());
    assert!(got.iter().all(|v| v.is_finite()), "non-finite output");
    let (mut max_abs, mut max_ref, mut se, mut sr) = (0f64, 0f64, 0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let d = (g as f64 - w).abs();
        max_abs = max_abs.max(d);
        max_ref = max_ref.max(w.abs());
        se += d * d;
        sr += w * w;
    }
    (max_abs, max_abs / max_ref, (se / sr).sqrt())
}

fn check(what: &str, got: &[f32], want: &[f64]) {
    let (abs, max_rel, rms_rel) = errors(got, want);
    println!(
        "VISION {what}: {} values, max abs {abs:.3e}, max rel {max_rel:.3e}, rms rel {rms_rel:.3e}",
        got.len()
    );
    assert!(
        rms_rel <= RMS_REL && max_rel <= MAX_REL,
        "{what}: rms rel {rms_rel:.3e} (bound {RMS_REL:e}), max rel {max_rel:.3e} (bound {MAX_REL:e})"
    );
}

fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

#[test]
fn tiny_fixture_tower_matches_cpu_and_transformers() {
    let Some(gpu) = gpu("tiny_fixture_tower_matches_cpu_and_transformers") else {
        return;
    };
    let dir = fixture();
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let vision = Vision::load(&cfg, &Checkpoint::open(&dir).unwrap())
        .unwrap()
        .expect("a vision tower");
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let mut grids: Vec<Grid> = Vec::new();
    let mut pixels = Vec::new();
    let mut theirs = Vec::new();
    for im in r["images"].as_array().unwrap() {
        grids.push(serde_json::from_value(im["grid_thw"].clone()).unwrap());
        pixels.extend(read_f32(
            &dir.join(im["pixel_values_file"].as_str().unwrap()),
        ));
        let e: Vec<f64> = serde_json::from_value(im["embeds"].clone()).unwrap();
        theirs.extend(e);
    }
    let tower = CudaTower::new(&vision, gpu, false).unwrap();
    let got = Tower::forward(&tower, &pixels, &grids).unwrap();
    // Blocks streamed from pinned host memory: the same bits, twice (the slots are reused).
    let streamed = CudaTower::new(&vision, gpu, true).unwrap();
    assert!(Tower::blocks_on_host(&streamed) && !Tower::blocks_on_host(&tower));
    for _ in 0..2 {
        let again = streamed.run(&pixels, &grids).unwrap();
        assert!(
            again
                .iter()
                .zip(&got)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "the streamed tower differs from the resident one"
        );
    }
    let cpu = vision.forward(&pixels, &grids).unwrap();
    check("tiny fixture, 2 images, vs CPU", &got, &widen(&cpu));
    check("tiny fixture, 2 images, vs transformers", &got, &theirs);
    // Each image alone gives its rows of the two-image call (attention stays within an image).
    let split = grids[0].iter().product::<usize>() * vision.config.patch_len();
    let first = tower.run(&pixels[..split], &grids[..1]).unwrap();
    let second = tower.run(&pixels[split..], &grids[1..]).unwrap();
    let joined: Vec<f32> = first.into_iter().chain(second).collect();
    check("tiny fixture, images one by one", &joined, &widen(&got));
}

/// The shape of the tower parameter `name` (as `sanmai_vision::tower::VisionWeights` reads it).
fn shape(cfg: &VisionConfig, name: &str) -> Vec<usize> {
    let (h, i, o) = (cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size);
    let m = h * cfg.merge_unit();
    let (base, kind) = name.rsplit_once('.').unwrap();
    let part = base
        .strip_prefix("blocks.")
        .map(|rest| rest.split_once('.').unwrap().1)
        .unwrap_or(base);
    let (out, inp) = match part {
        "norm1" | "norm2" | "merger.norm" => (h, 0),
        "attn.qkv" => (3 * h, h),
        "attn.proj" => (h, h),
        "mlp.linear_fc1" => (i, h),
        "mlp.linear_fc2" => (h, i),
        "merger.linear_fc1" => (m, m),
        "merger.linear_fc2" => (o, m),
        "pos_embed" => return vec![cfg.num_position_embeddings, h],
        "patch_embed.proj" if kind == "weight" => return vec![h, cfg.patch_len()],
        "patch_embed.proj" => (h, 0),
        _ => panic!("unknown tower parameter {name}"),
    };
    if kind == "weight" && inp > 0 {
        vec![out, inp]
    } else {
        vec![out]
    }
}

/// A random tower of `cfg`'s shape from [`Dummy`] weights: matrices uniform with std
/// `fan_in^-½`, biases std 0.02, norm scales around 1 (std 0.1), the position table std 0.5.
fn dummy_vision(cfg: VisionConfig) -> Vision {
    let src = Dummy::new(7);
    let weights = VisionWeights::load(&cfg, |name| -> Option<Tensor> {
        let shape = shape(&cfg, name);
        let init = if name.ends_with("norm1.weight")
            || name.ends_with("norm2.weight")
            || name.ends_with("norm.weight")
        {
            Init::Random {
                mean: 1.0,
                std: 0.1,
            }
        } else if name.ends_with(".bias") {
            Init::std(0.02)
        } else if name == "pos_embed.weight" {
            Init::std(0.5)
        } else {
            Init::std((*shape.last().unwrap() as f32).powf(-0.5))
        };
        let mut v = vec![0f32; shape.iter().product()];
        src.fill(name, init, &mut v);
        Some((shape, v))
    })
    .unwrap();
    Vision {
        config: cfg,
        weights,
        image_token_id: 0,
        vision_start_token_id: 0,
        vision_end_token_id: 0,
    }
}

/// Qwen3.5's tower shape with `depth` blocks and a 2048-wide output.
fn real_shape(depth: usize) -> VisionConfig {
    VisionConfig {
        depth,
        out_hidden_size: 2048,
        ..VisionConfig::default()
    }
}

/// Random patch rows in [-1, 1) for `grid`.
fn random_pixels(cfg: &VisionConfig, grid: Grid, seed: u64) -> Vec<f32> {
    let n = grid.iter().product::<usize>() * cfg.patch_len();
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn real_shape_tower_matches_cpu() {
    let Some(gpu) = gpu("real_shape_tower_matches_cpu") else {
        return;
    };
    let vision = dummy_vision(real_shape(2));
    // 1,600 patches: the row-wise work in two pieces (TOWER_CHUNK_ROWS = 1024).
    let grid: Grid = [1, 40, 40];
    let pixels = random_pixels(&vision.config, grid, 1);
    let tower = CudaTower::new(&vision, gpu, false).unwrap();
    let t0 = Instant::now();
    let got = tower.run(&pixels, &[grid]).unwrap();
    let gpu_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let cpu = vision.forward(&pixels, &[grid]).unwrap();
    println!(
        "VISION real shape, 2 blocks, grid {grid:?}: GPU {:.1} ms (first call), CPU {:.1} s",
        gpu_s * 1e3,
        t0.elapsed().as_secs_f64()
    );
    check("real shape, 2 blocks, vs CPU", &got, &widen(&cpu));
}

/// The full 27-block tower with its blocks resident and streamed from pinned host memory
/// (`--vit-on-host`): outputs bit for bit equal, and each form's time per image size.
#[test]
fn full_tower_timings_resident_and_streamed() {
    let Some(gpu) = gpu("full_tower_timings_resident_and_streamed") else {
        return;
    };
    let vision = dummy_vision(real_shape(27));
    let resident = CudaTower::new(&vision, gpu, false).unwrap();
    let streamed = CudaTower::new(&vision, gpu, true).unwrap();
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    println!(
        "VISION full tower: 27 blocks, {:.1} MiB of weights on the device; streamed: {:.1} MiB on \
         the device, {:.1} MiB pinned on the host",
        mib(resident.weight_bytes()),
        mib(streamed.weight_bytes()),
        mib(streamed.host_bytes())
    );
    assert_eq!(resident.host_bytes(), 0);
    assert_eq!(
        streamed.weight_bytes() + streamed.host_bytes(),
        resident.weight_bytes() + 2 * streamed.host_bytes() / 27
    );
    // 0.26, 1.05 and 2.07 MP.
    for grid in [[1, 32, 32], [1, 64, 64], [1, 90, 90]] {
        let pixels = random_pixels(&vision.config, grid, 2);
        let out = resident.run(&pixels, &[grid]).unwrap();
        assert!(out.iter().all(|v| v.is_finite()));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let runs = 5;
        let mut times = [Vec::new(), Vec::new()];
        for _ in 0..runs {
            for (k, tower) in [&resident, &streamed].into_iter().enumerate() {
                let t0 = Instant::now();
                let got = tower.run(&pixels, &[grid]).unwrap();
                times[k].push(t0.elapsed().as_secs_f64() * 1e3);
                assert!(
                    bits(&got) == bits(&out),
                    "grid {grid:?}: the {} tower's output differs from the first resident run",
                    ["resident", "streamed"][k]
                );
            }
        }
        let mp = (grid[1] * grid[2] * 16 * 16) as f64 / 1e6;
        for (k, t) in times.iter_mut().enumerate() {
            t.sort_by(f64::total_cmp);
            println!(
                "VISION timing grid {grid:?} ({mp:.2} MP, {} patches, {} tokens), {}: median {:.1} ms, \
                 min {:.1} ms, max {:.1} ms over {runs} runs (bit-identical)",
                grid[1] * grid[2],
                out.len() / 2048,
                ["resident", "streamed"][k],
                t[runs / 2],
                t[0],
                t[runs - 1]
            );
        }
    }
}
