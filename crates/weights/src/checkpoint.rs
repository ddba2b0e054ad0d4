//! safetensors checkpoints through memmap2: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. Headers are validated up front, so a truncated file is an error
//! at open time, never a crash later.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype as StDtype, SafeTensors};

use crate::{DType, HostTensor, Init, Result, TensorData, TensorSource, WeightError};

struct Entry {
    file: usize,
    dtype: StDtype,
    shape: Vec<usize>,
    /// Byte range inside the mmapped file.
    start: usize,
    end: usize,
}

/// An opened checkpoint directory.
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<(PathBuf, Mmap)>,
    tensors: HashMap<String, Entry>,
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
        };
        for path in files {
            let file = File::open(&path).map_err(|e| file_err(&path, e.to_string()))?;
            // SAFETY: the file is opened read-only; the engine never writes to checkpoint files and treats a
            // concurrent external modification as undefined, as every mmap-based loader does.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| file_err(&path, e.to_string()))?;
            let (header_len, meta) = SafeTensors::read_metadata(&mmap).map_err(|e| {
                file_err(
                    &path,
                    format!("not a valid safetensors file (truncated?): {e}"),
                )
            })?;
            let base = 8 + header_len;
            let file_idx = ckpt.files.len();
            for (name, info) in meta.tensors() {
                let (s, e) = info.data_offsets;
                if base + e > mmap.len() {
                    return Err(file_err(
                        &path,
                        format!("tensor `{name}` runs past the end of the file (truncated)"),
                    ));
                }
                ckpt.tensors.insert(
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
            ckpt.files.push((path, mmap));
        }
        Ok(ckpt)
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
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| WeightError::Missing { name: name.into() })?;
        // A [n, 1, k] conv weight and a [n, k] one hold the same values; size-1 dims are layout, not data.
        let squeeze = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        if e.shape != shape && squeeze(&e.shape) != squeeze(shape) {
            return Err(WeightError::Shape {
                name: name.into(),
                expected: shape.to_vec(),
                found: e.shape.clone(),
            });
        }
        let dtype = match e.dtype {
            StDtype::BF16 => DType::BF16,
            StDtype::F16 => DType::F16,
            StDtype::F32 => DType::F32,
            other => {
                return Err(WeightError::DType {
                    name: name.into(),
                    found: format!("{other:?}").to_lowercase(),
                })
            }
        };
        let bytes = &self.files[e.file].1[e.start..e.end];
        Ok(HostTensor {
            name: name.into(),
            shape: shape.to_vec(),
            data: TensorData::Bytes(dtype, bytes),
        })
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}
