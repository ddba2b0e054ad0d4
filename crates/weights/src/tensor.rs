//! A tensor on the host: borrowed bytes from an mmapped checkpoint or owned f32 values.

use half::{bf16, f16};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    BF16,
    F16,
    F32,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }
}

#[derive(Debug)]
pub enum TensorData<'a> {
    /// Little-endian bytes of the given dtype, straight from the file.
    Bytes(DType, &'a [u8]),
    F32(Vec<f32>),
}

#[derive(Debug)]
pub struct HostTensor<'a> {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: TensorData<'a>,
}

impl HostTensor<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn dtype(&self) -> DType {
        match &self.data {
            TensorData::Bytes(d, _) => *d,
            TensorData::F32(_) => DType::F32,
        }
    }

    /// The values as f32 (bf16/f16 widen exactly).
    pub fn to_f32(&self) -> Vec<f32> {
        match &self.data {
            TensorData::F32(v) => v.clone(),
            TensorData::Bytes(dtype, b) => match dtype {
                DType::BF16 => b
                    .chunks_exact(2)
                    .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                    .collect(),
                DType::F16 => b
                    .chunks_exact(2)
                    .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                    .collect(),
                DType::F32 => b
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            },
        }
    }

    /// Consumes the tensor into f32 values without copying when it already holds them.
    pub fn into_f32(self) -> Vec<f32> {
        match self.data {
            TensorData::F32(v) => v,
            _ => self.to_f32(),
        }
    }
}
