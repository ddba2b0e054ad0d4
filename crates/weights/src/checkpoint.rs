//! safetensors checkpoints through memmap2: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. Headers are validated up front, so a truncated file is an error
//! at open time, never a crash later.
//!
//! A compressed-tensors checkpoint stores a quantized Linear `X` as `X.weight_packed`, `X.weight_scale`
//! and `X.weight_shape` instead of `X.weight`; the scheme of each comes from the `quantization_config` of
//! the `config.json` beside the weights. Asking for `X.weight` then yields the dequantised values, and
//! [`TensorSource::packed`] the packed form, borrowed from the mmap.
//!
//! A block-scaled FP8 checkpoint (`quant_method: fp8`) stores a converted Linear's `X.weight` as
//! float8_e4m3fn beside `X.weight_scale_inv`; asking for `X.weight` yields `fp8(q) · scale_inv[block]`
//! in f32 (see [`crate::fp8`]).

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype as StDtype, SafeTensors};
use sanmai_config::{Fp8Config, QuantConfig};

use crate::quant::{quant_module, PackedTensor, PackedWords};
use crate::{DType, HostTensor, Init, Result, TensorData, TensorSource, WeightError};

struct Entry {
    file: usize,
    dtype: StDtype,
    shape: Vec<usize>,
    /// Byte range inside the mmapped file.
    start: usize,
    end: usize,
}

/// A safetensors file's bytes: mapped from disk, or embedded in the binary.
enum FileBytes {
    Mapped(Mmap),
    Static(&'static [u8]),
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(m) => m,
            FileBytes::Static(b) => b,
        }
    }
}

/// An opened checkpoint directory.
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<(PathBuf, FileBytes)>,
    tensors: HashMap<String, Entry>,
    quant: Option<QuantConfig>,
    fp8: Option<Fp8Config>,
}

fn file_err(path: &Path, message: impl Into<String>) -> WeightError {
    WeightError::File {
        path: path.display().to_string(),
        message: message.into(),
    }
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` (sharded) or `dir/model.safetensors`, or, failing both, every
    /// `*.safetensors` file in `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let files: Vec<PathBuf> = if index.exists() {
            let text =
                std::fs::read_to_string(&index).map_err(|e| file_err(&index, e.to_string()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| file_err(&index, format!("not valid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| {
                    file_err(&index, "field `weight_map` is missing or not an object")
                })?;
            let mut names: Vec<String> = map
                .values()
                .map(|f| {
                    f.as_str().map(str::to_string).ok_or_else(|| {
                        file_err(&index, "field `weight_map`: values must be file names")
                    })
                })
                .collect::<Result<_>>()?;
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if single.exists() {
            vec![single]
        } else {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| file_err(dir, e.to_string()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            found.sort();
            if found.is_empty() {
                return Err(file_err(
                    dir,
                    "no model.safetensors, model.safetensors.index.json or *.safetensors file",
                ));
            }
            found
        };

        let mut ckpt = Checkpoint {
            dir: dir.to_path_buf(),
            files: Vec::new(),
            tensors: HashMap::new(),
            quant: None,
            fp8: None,
        };
        for path in files {
            let file = File::open(&path).map_err(|e| file_err(&path, e.to_string()))?;
            // SAFETY: the file is opened read-only; the engine never writes to checkpoint files and treats a
            // concurrent external modification as undefined, as every mmap-based loader does.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| file_err(&path, e.to_string()))?;
            ckpt.add_file(path, FileBytes::Mapped(mmap))?;
        }
        let packed = ckpt.tensors.keys().any(|n| n.ends_with("_packed"));
        let fp8 = ckpt.tensors.values().any(|e| e.dtype == StDtype::F8_E4M3);
        if packed || fp8 {
            (ckpt.quant, ckpt.fp8) = read_quant_config(&dir.join("config.json"))?;
        }
        Ok(ckpt)
    }

    /// A checkpoint of one safetensors file held in memory for the life of the program (embedded in
    /// the binary), with its `config.json` text; `name` stands for its path in messages.
    pub fn from_static(name: &str, bytes: &'static [u8], config_json: &str) -> Result<Self> {
        let path = PathBuf::from(name);
        let mut ckpt = Checkpoint {
            dir: path.clone(),
            files: Vec::new(),
            tensors: HashMap::new(),
            quant: None,
            fp8: None,
        };
        ckpt.add_file(path.clone(), FileBytes::Static(bytes))?;
        (ckpt.quant, ckpt.fp8) = quant_config_of(config_json, &path)?;
        Ok(ckpt)
    }

    /// Reads the header of one safetensors file and records its tensors.
    fn add_file(&mut self, path: PathBuf, bytes: FileBytes) -> Result<()> {
        let (header_len, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| {
            file_err(
                &path,
                format!("not a valid safetensors file (truncated?): {e}"),
            )
        })?;
        let base = 8 + header_len;
        let file_idx = self.files.len();
        for (name, info) in meta.tensors() {
            let (s, e) = info.data_offsets;
            if base + e > bytes.len() {
                return Err(file_err(
                    &path,
                    format!("tensor `{name}` runs past the end of the file (truncated)"),
                ));
            }
            self.tensors.insert(
                name,
                Entry {
                    file: file_idx,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: base + s,
                    end: base + e,
                },
            );
        }
        self.files.push((path, bytes));
        Ok(())
    }

    /// The quantization the packed tensors follow (read from `config.json` when the checkpoint has any).
    pub fn quantization(&self) -> Option<&QuantConfig> {
        self.quant.as_ref()
    }

    /// The FP8 quantization config its float8_e4m3fn tensors follow (read from `config.json` when the
    /// checkpoint has any).
    pub fn fp8(&self) -> Option<&Fp8Config> {
        self.fp8.as_ref()
    }

    /// Sets the quantization config, for a checkpoint whose `config.json` lives elsewhere.
    pub fn set_quantization(&mut self, quant: Option<QuantConfig>) {
        self.quant = quant;
    }

    /// The FP8 config and the block scales (`weight_scale_inv`) of the FP8 weight `name` (entry `e`).
    fn fp8_scales(&self, name: &str, e: &Entry) -> Result<(&Fp8Config, Vec<f32>)> {
        let qerr = |message: String| WeightError::Quant {
            name: name.into(),
            message,
        };
        let cfg = self.fp8.as_ref().ok_or_else(|| {
            qerr(
                "float8_e4m3fn, but config.json has no quantization_config with quant_method fp8"
                    .into(),
            )
        })?;
        let scale_name = match name.strip_suffix("weight") {
            Some(module) => format!("{module}weight_scale_inv"),
            None => format!("{name}_scale_inv"),
        };
        let se = self
            .tensors
            .get(&scale_name)
            .ok_or_else(|| WeightError::Missing {
                name: scale_name.clone(),
            })?;
        let want = crate::fp8::scale_shape(&e.shape, cfg);
        if squeeze(&se.shape) != squeeze(&want) {
            return Err(WeightError::Shape {
                name: scale_name,
                expected: want,
                found: se.shape.clone(),
            });
        }
        Ok((cfg, self.float_values(&scale_name, se)?))
    }

    /// The f32 values of the FP8 weight `name` (entry `e`) from its bytes and `weight_scale_inv`.
    fn fp8_values(&self, name: &str, e: &Entry) -> Result<Vec<f32>> {
        let (cfg, scales) = self.fp8_scales(name, e)?;
        Ok(crate::fp8::dequantize(
            self.bytes(e),
            &scales,
            &e.shape,
            cfg,
        ))
    }

    fn bytes(&self, e: &Entry) -> &[u8] {
        &self.files[e.file].1[e.start..e.end]
    }

    fn float_values(&self, name: &str, e: &Entry) -> Result<Vec<f32>> {
        let dtype = float_dtype(name, e.dtype)?;
        Ok(HostTensor {
            name: name.into(),
            shape: e.shape.clone(),
            data: TensorData::Bytes(dtype, self.bytes(e)),
        }
        .into_f32())
    }

    /// The packed triplet `{name}_packed`, `{name}_scale`, `{name}_shape` of `name`, if present; checks
    /// the stored shape against `shape` (size-1 dims aside).
    fn load_packed(&self, name: &str, shape: &[usize]) -> Result<Option<PackedTensor<'_>>> {
        let Some(packed) = self.tensors.get(&format!("{name}_packed")) else {
            return Ok(None);
        };
        let qerr = |message: String| WeightError::Quant {
            name: name.into(),
            message,
        };
        let get = |suffix: &str| {
            self.tensors
                .get(&format!("{name}{suffix}"))
                .ok_or_else(|| WeightError::Missing {
                    name: format!("{name}{suffix}"),
                })
        };
        let (scale_e, shape_e) = (get("_scale")?, get("_shape")?);
        let sb = self.bytes(shape_e);
        let stored: Vec<usize> = match shape_e.dtype {
            StDtype::I32 => sb
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize)
                .collect(),
            StDtype::I64 => sb
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as usize)
                .collect(),
            other => {
                return Err(qerr(format!(
                    "`{name}_shape` has dtype {other:?}, expected int32"
                )))
            }
        };
        if squeeze(&stored) != squeeze(shape) {
            return Err(WeightError::Shape {
                name: name.into(),
                expected: shape.to_vec(),
                found: stored,
            });
        }
        if packed.dtype != StDtype::I32 && packed.dtype != StDtype::U32 {
            return Err(qerr(format!(
                "`{name}_packed` has dtype {:?}, expected int32",
                packed.dtype
            )));
        }
        let (module, linear) = quant_module(name, shape)
            .ok_or_else(|| qerr("only 2-D Linear weights may be packed".into()))?;
        let scheme = self
            .quant
            .as_ref()
            .ok_or_else(|| qerr("packed, but config.json has no quantization_config".into()))?
            .scheme_for_module(module, linear)
            .ok_or_else(|| {
                qerr(format!(
                    "packed, but no quantization_config group targets `{module}`"
                ))
            })?;
        let k = *shape.last().unwrap_or(&0);
        let n = shape.iter().product::<usize>() / k.max(1);
        let scales = self.float_values(&format!("{name}_scale"), scale_e)?;
        PackedTensor::new(
            name,
            scheme,
            n,
            k,
            PackedWords::Bytes(self.bytes(packed)),
            scales,
        )
        .map(Some)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Names of every tensor in the checkpoint.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The shape of a tensor, if present.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|e| e.shape.as_slice())
    }
}

impl TensorSource for Checkpoint {
    fn tensor(&self, name: &str, shape: &[usize], _init: Init) -> Result<HostTensor<'_>> {
        let Some(e) = self.tensors.get(name) else {
            return match self.load_packed(name, shape)? {
                Some(p) => Ok(HostTensor {
                    name: name.into(),
                    shape: shape.to_vec(),
                    data: TensorData::F32(p.dequantize()),
                }),
                None => Err(WeightError::Missing { name: name.into() }),
            };
        };
        // A [n, 1, k] conv weight and a [n, k] one hold the same values; size-1 dims are layout, not data.
        if e.shape != shape && squeeze(&e.shape) != squeeze(shape) {
            return Err(WeightError::Shape {
                name: name.into(),
                expected: shape.to_vec(),
                found: e.shape.clone(),
            });
        }
        if e.dtype == StDtype::F8_E4M3 {
            return Ok(HostTensor {
                name: name.into(),
                shape: shape.to_vec(),
                data: TensorData::F32(self.fp8_values(name, e)?),
            });
        }
        let dtype = float_dtype(name, e.dtype)?;
        Ok(HostTensor {
            name: name.into(),
            shape: shape.to_vec(),
            data: TensorData::Bytes(dtype, self.bytes(e)),
        })
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name) || self.tensors.contains_key(&format!("{name}_packed"))
    }

    /// A packed triplet, or an FP8 weight (its bytes and block scales, see [`crate::fp8::packed`]).
    fn packed(&self, name: &str, shape: &[usize], _init: Init) -> Result<Option<PackedTensor<'_>>> {
        if let Some(e) = self.tensors.get(name) {
            if e.dtype != StDtype::F8_E4M3 {
                return Ok(None);
            }
            if squeeze(&e.shape) != squeeze(shape) {
                return Err(WeightError::Shape {
                    name: name.into(),
                    expected: shape.to_vec(),
                    found: e.shape.clone(),
                });
            }
            let (cfg, scales) = self.fp8_scales(name, e)?;
            return crate::fp8::packed(name, self.bytes(e), &scales, &e.shape, cfg).map(Some);
        }
        self.load_packed(name, shape)
    }
}

fn squeeze(s: &[usize]) -> Vec<usize> {
    s.iter().copied().filter(|&d| d != 1).collect()
}

fn float_dtype(name: &str, dtype: StDtype) -> Result<DType> {
    match dtype {
        StDtype::BF16 => Ok(DType::BF16),
        StDtype::F16 => Ok(DType::F16),
        StDtype::F32 => Ok(DType::F32),
        other => Err(WeightError::DType {
            name: name.into(),
            found: format!("{other:?}").to_lowercase(),
        }),
    }
}

/// The `quantization_config` of a `config.json` (at the top level or under `text_config`): a
/// compressed-tensors one or an FP8 one, by its `quant_method`.
fn read_quant_config(path: &Path) -> Result<(Option<QuantConfig>, Option<Fp8Config>)> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok((None, None));
    };
    quant_config_of(&text, path)
}

/// The `quantization_config` of the `config.json` text read from `path`.
fn quant_config_of(text: &str, path: &Path) -> Result<(Option<QuantConfig>, Option<Fp8Config>)> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| file_err(path, format!("not valid JSON: {e}")))?;
    let q = v.get("quantization_config").or_else(|| {
        v.get("text_config")
            .and_then(|t| t.get("quantization_config"))
    });
    let file = path.display().to_string();
    match q {
        None | Some(serde_json::Value::Null) => Ok((None, None)),
        Some(q) if q.get("quant_method").and_then(|m| m.as_str()) == Some("fp8") => {
            Fp8Config::from_value(q, &file)
                .map(|c| (None, Some(c)))
                .map_err(|e| file_err(path, e.to_string()))
        }
        Some(q) => QuantConfig::from_value(q, &file)
            .map(|c| (Some(c), None))
            .map_err(|e| file_err(path, e.to_string())),
    }
}
