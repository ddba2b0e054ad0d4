//! `sanmai quantize --mtp-int4 DIR OUT`: a checkpoint's MTP head as a checkpoint of its own, its routed
//! experts in INT4, for `--speculative-config '{"method": "mtp", "model": "OUT"}'` (the head's
//! tensors come from OUT, everything else from the main checkpoint).
//!
//! OUT gets `model.safetensors` with only the `mtp.*` tensors and `config.json` (DIR's, with a
//! `quantization_config` that describes them). Each routed-expert Linear `X.weight` (per expert
//! `mtp.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, or the fused 3-D
//! `mtp.layers.N.mlp.experts.{gate_up,down}_proj`) is written in the compressed-tensors
//! `pack-quantized` layout that [`sanmai_weights::Checkpoint`] reads ([`sanmai_weights::quant`]):
//! `X.weight_packed` (int32, 8 codes a word, LSB first, rows padded to whole words), `X.weight_scale`
//! (one scale per 128 inputs, the last group of a row shorter when the input width is not a multiple
//! of 128, as the reader takes it; bf16 for a bf16 weight, else f32) and `X.weight_shape` (int32).
//! Codes are round-to-nearest (ties to even) of `w / s`, clamped to [−8, 7]; each group's scale
//! `s = max|w| · c / 7` takes the clip ratio `c` from 1.00, 0.98, …, 0.80 with the least squared
//! error of the dequantised group (its scale rounded to the stored dtype first). Every other tensor
//! (the fc, attention, shared expert, router and norms: a few percent of the head's bytes) is copied
//! in its own dtype.
//!
//! The safetensors file is written here (8-byte header length, JSON header padded to 8 bytes, the data
//! with 4-byte tensors first so every tensor is aligned) and read back with `Checkpoint::open`
//! before the command reports success.

use std::collections::HashMap;
use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use rayon::prelude::*;
use sanmai_config::{QuantConfig, QuantScheme};
use sanmai_weights::quant::{pack, scale_cols, words_per_row};
use sanmai_weights::{Checkpoint, DType, Init, TensorData, TensorSource};
use serde_json::{json, Map, Value};

/// Inputs per scale.
pub const GROUP_SIZE: usize = 128;
/// The clip ratios tried for each group's scale.
const CLIPS: [f32; 11] = [
    1.0, 0.98, 0.96, 0.94, 0.92, 0.90, 0.88, 0.86, 0.84, 0.82, 0.80,
];
/// The config group of the INT4 experts, and what it targets.
const GROUP_NAME: &str = "mtp_routed_experts";
const TARGET: &str = r"re:mtp\.layers\.\d+\.mlp\.experts\.(\d+\.)?(gate|up|down|gate_up)_proj$";

#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// Write DIR's MTP head (its `mtp.*` tensors) to OUT with the routed experts' Linears in INT4
    /// (round to nearest, symmetric, a scale per 128 inputs chosen by a clip search, compressed-tensors
    /// pack-quantized); the fc, attention, shared expert, router gate and norms keep their dtype.
    /// Serve it with --speculative-config '{"method": "mtp", "model": "OUT"}'.
    #[arg(long, required = true)]
    pub mtp_int4: bool,
    /// The checkpoint to read (config.json and safetensors with bf16, f16 or f32 `mtp.*` tensors).
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
    /// The directory to write config.json and model.safetensors to (created; refused when it exists
    /// and is not empty).
    #[arg(value_name = "OUT")]
    pub out: PathBuf,
}

/// A tensor of OUT's safetensors file.
struct Out {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    len: usize,
    data: OutData,
}

enum OutData {
    /// Bytes of the source tensor `name`, copied.
    Copy(String),
    /// The packed codes of the source weight `name`, quantized when written.
    Packed(String),
    /// The scales of the source weight `name` (computed with its codes).
    Scale(String),
    /// A weight's shape as int32.
    Shape(Vec<usize>),
}

/// A source MTP tensor: its shape, dtype and whether it is quantized.
struct Item {
    name: String,
    shape: Vec<usize>,
    dtype: DType,
    bytes: usize,
    int4: bool,
}

/// What was written, for the report.
#[derive(Default)]
struct Totals {
    int4_before: usize,
    int4_after: usize,
    kept: usize,
    /// Squared error of the dequantised weights, and squared norm of the weights.
    err2: f64,
    norm2: f64,
}

pub fn run(args: QuantizeArgs) -> Result<()> {
    if !args.mtp_int4 {
        bail!("say what to quantize: --mtp-int4 (the MTP head's routed experts to INT4)");
    }
    let (dir, out) = (&args.dir, &args.out);
    let ckpt = Checkpoint::open(dir).with_context(|| format!("DIR {}", dir.display()))?;
    check_out(out)?;
    let config_path = dir.join("config.json");
    let config: Value = serde_json::from_str(
        &fs::read_to_string(&config_path)
            .with_context(|| format!("reading {}", config_path.display()))?,
    )
    .with_context(|| format!("{}: not valid JSON", config_path.display()))?;
    if !config.is_object() {
        bail!("{}: expected a JSON object", config_path.display());
    }
    let items = mtp_items(&ckpt, dir)?;

    let created = !out.exists();
    fs::create_dir_all(out).with_context(|| format!("OUT {}: creating it", out.display()))?;
    let result = write_out(&ckpt, &items, config, out);
    if result.is_err() {
        for f in [
            "model.safetensors.partial",
            "model.safetensors",
            "config.json",
        ] {
            let _ = fs::remove_file(out.join(f));
        }
        if created {
            let _ = fs::remove_dir(out);
        }
    }
    let (t, file_bytes, tensors) = result?;
    let before: usize = items.iter().map(|i| i.bytes).sum();
    let after = t.int4_after + t.kept;
    let n4 = items.iter().filter(|i| i.int4).count();
    println!(
        "{} -> {}: {} MTP tensors, {before} bytes -> {after} bytes ({:.2}x smaller)",
        dir.display(),
        out.display(),
        items.len(),
        before as f64 / after.max(1) as f64
    );
    println!(
        "  {n4} routed-expert Linears to INT4 (symmetric, group {GROUP_SIZE}, clip-searched scales): \
         {} bytes -> {} bytes (packed words, scales, shapes); relative RMS error {:.4}",
        t.int4_before,
        t.int4_after,
        (t.err2 / t.norm2.max(f64::MIN_POSITIVE)).sqrt()
    );
    println!(
        "  {} tensors kept in their dtype (fc, attention, shared expert, router gate, norms): {} bytes",
        items.len() - n4,
        t.kept
    );
    println!(
        "  wrote {} ({tensors} tensors, {file_bytes} bytes) and {}",
        out.join("model.safetensors").display(),
        out.join("config.json").display()
    );
    Ok(())
}

/// Refuses an OUT that is a file or a non-empty directory.
fn check_out(out: &Path) -> Result<()> {
    if !out.exists() {
        return Ok(());
    }
    if !out.is_dir() {
        bail!("OUT {}: exists and is not a directory", out.display());
    }
    let mut entries =
        fs::read_dir(out).with_context(|| format!("OUT {}: reading it", out.display()))?;
    if entries.next().is_some() {
        bail!(
            "OUT {} exists and is not empty: refusing to write into it (give a new or empty directory)",
            out.display()
        );
    }
    Ok(())
}

/// Whether `name` of `shape` is a routed expert's Linear weight of the MTP head: per expert
/// `mtp.layers.N.mlp.experts.E.{gate,up,down}_proj.weight` `[out, in]`, or fused
/// `mtp.layers.N.mlp.experts.{gate_up,down}_proj` `[E, out, in]`.
pub fn routed_expert(name: &str, shape: &[usize]) -> bool {
    let number = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let Some((layer, rest)) = name
        .strip_prefix("mtp.layers.")
        .and_then(|r| r.split_once('.'))
    else {
        return false;
    };
    let Some(rest) = rest.strip_prefix("mlp.experts.") else {
        return false;
    };
    number(layer)
        && match shape.len() {
            2 => rest.split_once('.').is_some_and(|(e, proj)| {
                number(e)
                    && matches!(
                        proj,
                        "gate_proj.weight" | "up_proj.weight" | "down_proj.weight"
                    )
            }),
            3 => matches!(rest, "gate_up_proj" | "down_proj"),
            _ => false,
        }
}

/// DIR's `mtp.*` tensors, sorted by name; refuses quantized ones.
fn mtp_items(ckpt: &Checkpoint, dir: &Path) -> Result<Vec<Item>> {
    let mut names: Vec<&str> = ckpt.names().filter(|n| n.starts_with("mtp.")).collect();
    names.sort_unstable();
    if names.is_empty() {
        bail!("DIR {} has no MTP tensors (mtp.*)", dir.display());
    }
    names
        .into_iter()
        .map(|name| {
            let quantized = ["_packed", "_scale", "_shape", "_scale_inv"]
                .iter()
                .any(|s| name.ends_with(s));
            if quantized {
                bail!(
                    "DIR {}: tensor `{name}` is part of a quantized weight: quantize --mtp-int4 \
                     reads bf16, f16 or f32 MTP weights",
                    dir.display()
                );
            }
            let shape = ckpt.shape(name).unwrap_or_default().to_vec();
            let t = ckpt
                .tensor(name, &shape, Init::ZEROS)
                .with_context(|| format!("DIR {}", dir.display()))?;
            let TensorData::Bytes(dtype, bytes) = t.data else {
                bail!(
                    "DIR {}: tensor `{name}` is float8 (already quantized): quantize --mtp-int4 \
                     reads bf16, f16 or f32 MTP weights",
                    dir.display()
                );
            };
            let k = shape.last().copied().unwrap_or(0);
            let int4 = routed_expert(name, &shape) && k > 0 && !bytes.is_empty();
            Ok(Item {
                name: name.to_string(),
                shape,
                dtype,
                bytes: bytes.len(),
                int4,
            })
        })
        .collect()
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "BF16",
        DType::F16 => "F16",
        DType::F32 => "F32",
    }
}

fn dtype_size(name: &str) -> usize {
    match name {
        "BF16" | "F16" => 2,
        _ => 4,
    }
}

/// OUT's tensors: each quantized weight's packed words, scales and shape, every other tensor as is;
/// 4-byte dtypes first, then 2-byte ones, each by name, so every tensor is aligned to its dtype.
fn layout(items: &[Item]) -> Vec<Out> {
    let mut outs = Vec::new();
    for it in items {
        if !it.int4 {
            outs.push(Out {
                name: it.name.clone(),
                dtype: dtype_name(it.dtype),
                shape: it.shape.clone(),
                len: it.bytes,
                data: OutData::Copy(it.name.clone()),
            });
            continue;
        }
        let (lead, k) = it.shape.split_at(it.shape.len() - 1);
        let rows: usize = lead.iter().product();
        let (wpr, sc) = (words_per_row(4, k[0]), scale_cols(GROUP_SIZE, k[0]));
        let scale_dtype = match it.dtype {
            DType::BF16 => "BF16",
            _ => "F32",
        };
        let with = |last: usize| [lead, &[last]].concat();
        outs.push(Out {
            name: format!("{}_packed", it.name),
            dtype: "I32",
            shape: with(wpr),
            len: 4 * rows * wpr,
            data: OutData::Packed(it.name.clone()),
        });
        outs.push(Out {
            name: format!("{}_scale", it.name),
            dtype: scale_dtype,
            shape: with(sc),
            len: dtype_size(scale_dtype) * rows * sc,
            data: OutData::Scale(it.name.clone()),
        });
        outs.push(Out {
            name: format!("{}_shape", it.name),
            dtype: "I32",
            shape: vec![it.shape.len()],
            len: 4 * it.shape.len(),
            data: OutData::Shape(it.shape.clone()),
        });
    }
    outs.sort_by(|a, b| {
        dtype_size(b.dtype)
            .cmp(&dtype_size(a.dtype))
            .then_with(|| a.name.cmp(&b.name))
    });
    outs
}

/// The safetensors header of `outs` in order, padded with spaces to a multiple of 8 bytes.
fn header(outs: &[Out]) -> Result<Vec<u8>> {
    let mut h = Map::new();
    h.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut at = 0;
    for o in outs {
        h.insert(
            o.name.clone(),
            json!({"dtype": o.dtype, "shape": o.shape, "data_offsets": [at, at + o.len]}),
        );
        at += o.len;
    }
    let mut bytes = serde_json::to_vec(&Value::Object(h))?;
    while bytes.len() % 8 != 0 {
        bytes.push(b' ');
    }
    Ok(bytes)
}

/// f32 rounded to the nearest bf16 (ties to even), as its bits.
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

fn round_bf16(x: f32) -> f32 {
    f32::from_bits((bf16_bits(x) as u32) << 16)
}

/// The code of `x` at scale `s`.
#[inline]
fn code(x: f32, s: f32) -> i8 {
    (x / s).round_ties_even().clamp(-8.0, 7.0) as i8
}

/// One row's codes and scales (one per group of [`GROUP_SIZE`]), each scale rounded by `round` (to
/// its stored dtype) before the codes are taken. Returns the row's squared error and squared norm.
fn quantize_row(w: &[f32], q: &mut [i8], scales: &mut [f32], round: fn(f32) -> f32) -> (f64, f64) {
    let (mut err2, mut norm2) = (0f64, 0f64);
    for ((wg, qg), scale) in w
        .chunks(GROUP_SIZE)
        .zip(q.chunks_mut(GROUP_SIZE))
        .zip(scales.iter_mut())
    {
        let amax = wg.iter().fold(0f32, |m, x| m.max(x.abs()));
        let group_err = |s: f32| {
            wg.iter()
                .map(|&x| {
                    let d = x as f64 - code(x, s) as f64 * s as f64;
                    d * d
                })
                .sum::<f64>()
        };
        let mut best = (f64::INFINITY, 1.0f32);
        for c in CLIPS {
            let s = round(amax * c / 7.0);
            if s > 0.0 && s.is_finite() {
                let e = group_err(s);
                if e < best.0 {
                    best = (e, s);
                }
            }
        }
        // An all-zero group (or one too small for a nonzero scale) keeps zero codes at scale 1.
        let s = best.1;
        *scale = s;
        for (x, c) in wg.iter().zip(qg.iter_mut()) {
            *c = code(*x, s);
        }
        err2 += group_err(s);
        norm2 += wg.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
    }
    (err2, norm2)
}

/// The packed words (little-endian bytes) and scales of weight `it`.
fn quantize_weight(ckpt: &Checkpoint, it: &Item, t: &mut Totals) -> Result<(Vec<u8>, Vec<f32>)> {
    let w = ckpt.tensor(&it.name, &it.shape, Init::ZEROS)?.into_f32();
    if let Some(i) = w.iter().position(|x| !x.is_finite()) {
        bail!(
            "tensor `{}` has a non-finite value ({}) at flat index {i}",
            it.name,
            w[i]
        );
    }
    let k = *it.shape.last().expect("a weight has dimensions");
    let rows = w.len() / k;
    let sc = scale_cols(GROUP_SIZE, k);
    let round: fn(f32) -> f32 = match it.dtype {
        DType::BF16 => round_bf16,
        _ => |x| x,
    };
    let mut q = vec![0i8; w.len()];
    let mut scales = vec![0f32; rows * sc];
    let (err2, norm2) = w
        .par_chunks(k)
        .zip(q.par_chunks_mut(k))
        .zip(scales.par_chunks_mut(sc))
        .map(|((wr, qr), sr)| quantize_row(wr, qr, sr, round))
        .reduce(|| (0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
    t.err2 += err2;
    t.norm2 += norm2;
    let words = pack(&q, rows, k, 4);
    Ok((words.iter().flat_map(|x| x.to_le_bytes()).collect(), scales))
}

/// OUT's `config.json`: DIR's with a `quantization_config` for the INT4 experts (replacing any DIR
/// has, at the top or under `text_config`), its `ignore` naming the Linears kept unquantized.
fn out_config(mut config: Value, items: &[Item]) -> Result<Value> {
    let ignore: Vec<String> = items
        .iter()
        .filter(|i| !i.int4 && i.shape.len() == 2)
        .filter_map(|i| i.name.strip_suffix(".weight").map(str::to_string))
        .collect();
    let quant = json!({
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            GROUP_NAME: {
                "targets": [TARGET],
                "weights": {
                    "num_bits": 4, "type": "int", "symmetric": true,
                    "strategy": "group", "group_size": GROUP_SIZE
                }
            }
        },
        "ignore": ignore,
    });
    // What the reader will make of it: the INT4 experts at group 128, nothing else.
    let parsed = QuantConfig::from_value(&quant, "config.json")?;
    let int4 = QuantScheme {
        bits: 4,
        group_size: GROUP_SIZE,
    };
    for it in items {
        let module = it.name.strip_suffix(".weight").unwrap_or(&it.name);
        let want = it.int4.then_some(int4);
        if it.int4 || it.shape.len() == 2 {
            let got = parsed.scheme_for(module);
            if got != want {
                bail!("internal: the quantization_config gives `{module}` {got:?}, not {want:?}");
            }
        }
    }
    let obj = config.as_object_mut().expect("checked to be an object");
    if let Some(text) = obj.get_mut("text_config").and_then(Value::as_object_mut) {
        text.shift_remove("quantization_config");
    }
    obj.insert("quantization_config".into(), quant);
    Ok(config)
}

/// Writes OUT's files and reads them back; returns the totals, the safetensors file's size and its
/// tensor count.
fn write_out(
    ckpt: &Checkpoint,
    items: &[Item],
    config: Value,
    out: &Path,
) -> Result<(Totals, usize, usize)> {
    let config = out_config(config, items)?;
    let outs = layout(items);
    let head = header(&outs)?;
    let by_name: HashMap<&str, &Item> = items.iter().map(|i| (i.name.as_str(), i)).collect();
    let partial = out.join("model.safetensors.partial");
    let file = out.join("model.safetensors");
    let mut t = Totals::default();
    let mut scales: HashMap<String, Vec<f32>> = HashMap::new();
    {
        let f = fs::File::create(&partial)
            .with_context(|| format!("creating {}", partial.display()))?;
        let mut w = BufWriter::new(f);
        let io = |e: std::io::Error| anyhow!("writing {}: {e}", partial.display());
        w.write_all(&(head.len() as u64).to_le_bytes())
            .map_err(io)?;
        w.write_all(&head).map_err(io)?;
        for o in &outs {
            let bytes: Vec<u8> = match &o.data {
                OutData::Copy(name) => {
                    let it = by_name[name.as_str()];
                    t.kept += it.bytes;
                    match ckpt.tensor(name, &it.shape, Init::ZEROS)?.data {
                        TensorData::Bytes(_, b) => b.to_vec(),
                        TensorData::F32(_) => bail!("tensor `{name}` changed while being read"),
                    }
                }
                OutData::Packed(name) => {
                    let it = by_name[name.as_str()];
                    t.int4_before += it.bytes;
                    let (words, s) = quantize_weight(ckpt, it, &mut t)?;
                    scales.insert(name.clone(), s);
                    words
                }
                OutData::Scale(name) => {
                    let s = scales.remove(name).ok_or_else(|| {
                        anyhow!("internal: `{name}`'s scales come before its codes")
                    })?;
                    match o.dtype {
                        "BF16" => s.iter().flat_map(|x| bf16_bits(*x).to_le_bytes()).collect(),
                        _ => s.iter().flat_map(|x| x.to_le_bytes()).collect(),
                    }
                }
                OutData::Shape(shape) => shape
                    .iter()
                    .flat_map(|&d| (d as i32).to_le_bytes())
                    .collect(),
            };
            if bytes.len() != o.len {
                bail!(
                    "internal: tensor `{}` has {} bytes, its header says {}",
                    o.name,
                    bytes.len(),
                    o.len
                );
            }
            if !matches!(o.data, OutData::Copy(_)) {
                t.int4_after += bytes.len();
            }
            w.write_all(&bytes).map_err(io)?;
        }
        w.flush().map_err(io)?;
    }
    fs::rename(&partial, &file).with_context(|| format!("renaming to {}", file.display()))?;
    let config_path = out.join("config.json");
    fs::write(&config_path, serde_json::to_string_pretty(&config)? + "\n")
        .with_context(|| format!("writing {}", config_path.display()))?;

    // Read back: every tensor where the server will look for it, each INT4 weight in the packed form.
    let back = Checkpoint::open(out).with_context(|| format!("reading back {}", out.display()))?;
    for it in items {
        if it.int4 {
            let p = back
                .packed(&it.name, &it.shape, Init::ZEROS)
                .with_context(|| format!("reading back {}", out.display()))?
                .ok_or_else(|| anyhow!("reading back: `{}` is not packed", it.name))?;
            if (p.bits, p.group_size) != (4, GROUP_SIZE) {
                bail!(
                    "reading back: `{}` is {}-bit, group {}",
                    it.name,
                    p.bits,
                    p.group_size
                );
            }
        } else if !back.contains(&it.name) {
            bail!("reading back: `{}` is missing", it.name);
        }
    }
    let size = fs::metadata(&file)
        .with_context(|| format!("{}", file.display()))?
        .len() as usize;
    Ok((t, size, outs.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routed_experts_are_recognised_by_name_and_rank() {
        let e = "mtp.layers.0.mlp.experts.17.down_proj.weight";
        assert!(routed_expert(e, &[64, 32]));
        assert!(!routed_expert(e, &[64]));
        assert!(routed_expert(
            "mtp.layers.2.mlp.experts.gate_up_proj",
            &[8, 64, 64]
        ));
        assert!(routed_expert(
            "mtp.layers.0.mlp.experts.down_proj",
            &[8, 64, 32]
        ));
        for other in [
            "mtp.layers.0.mlp.shared_expert.down_proj.weight",
            "mtp.layers.0.mlp.gate.weight",
            "mtp.layers.0.self_attn.q_proj.weight",
            "mtp.fc.weight",
            "model.layers.0.mlp.experts.0.up_proj.weight",
            "mtp.layers.x.mlp.experts.0.up_proj.weight",
            "mtp.layers.0.mlp.experts.a.up_proj.weight",
            "mtp.layers.0.mlp.experts.0.up_proj.bias",
        ] {
            assert!(!routed_expert(other, &[8, 64]), "{other}");
        }
    }

    #[test]
    fn bf16_rounding_is_to_nearest_even() {
        assert_eq!(round_bf16(1.0), 1.0);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even 1.
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 4.0 / 256.0);
        assert_eq!(round_bf16(1.0 + 1.5 / 256.0), 1.0 + 2.0 / 256.0);
        assert_eq!(bf16_bits(-2.0), 0xC000);
    }

    #[test]
    fn clip_search_keeps_the_best_scale_and_bounds_the_error() {
        // One outlier: clipping it lowers the group's error below max-abs scaling's.
        let mut w: Vec<f32> = (0..200)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 40.0)
            .collect();
        w[5] = 1.3;
        let mut q = vec![0i8; w.len()];
        let mut s = vec![0f32; 2];
        let (err2, _) = quantize_row(&w, &mut q, &mut s, round_bf16);
        let plain: f64 = w[..128]
            .iter()
            .map(|&x| {
                let s = round_bf16(1.3 / 7.0);
                (x as f64 - code(x, s) as f64 * s as f64).powi(2)
            })
            .sum();
        let first: f64 = w[..128]
            .iter()
            .zip(&q)
            .map(|(&x, &c)| (x as f64 - c as f64 * s[0] as f64).powi(2))
            .sum();
        assert!(first <= plain, "{first} > {plain}");
        assert!(err2 >= first);
        for (g, (wg, qg)) in w.chunks(128).zip(q.chunks(128)).enumerate() {
            assert_eq!(s[g], round_bf16(s[g]), "scales are bf16 values");
            let amax = wg.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert!(s[g] <= round_bf16(amax / 7.0) && s[g] >= round_bf16(amax * 0.8 / 7.0));
            for (&x, &c) in wg.iter().zip(qg) {
                let d = (x - c as f32 * s[g]).abs();
                // Within half a step, or clipped at the end of the code range.
                assert!(
                    d <= s[g] / 2.0 * (1.0 + 1e-5) || c == 7 || c == -8,
                    "{x} {c} {}",
                    s[g]
                );
            }
        }
        // An all-zero group: zero codes.
        let mut q = vec![1i8; 8];
        let mut s = vec![0f32; 1];
        quantize_row(&[0.0; 8], &mut q, &mut s, |x| x);
        assert_eq!((q, s), (vec![0; 8], vec![1.0]));
    }
}
