//! Random weights of the right shapes (`--load-format dummy`, the built-in model): deterministic per
//! (seed, tensor name), generated in parallel chunks so even a 16M-value embedding takes milliseconds.

use rayon::prelude::*;

use crate::quant::{quant_module, random_packed, PackedTensor};
use crate::{HostTensor, Init, Result, TensorData, TensorSource};

/// A source that makes up every tensor it is asked for.
pub struct Dummy {
    seed: u64,
    /// Linears this config quantizes come out packed (and `tensor` returns their dequantised values).
    quant: Option<sanmai_config::QuantConfig>,
    /// An FP8 config's converted Linears come out as FP8 weights ([`crate::fp8::random_packed`]; a
    /// constant one as its values rounded to FP8 blocks).
    fp8: Option<sanmai_config::Fp8Config>,
}

const CHUNK: usize = 1 << 16;

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

impl Dummy {
    pub fn new(seed: u64) -> Self {
        Dummy {
            seed,
            quant: None,
            fp8: None,
        }
    }

    /// Makes the Linears `quant` targets packed, so a quantized config's dummy weights have its bytes.
    pub fn with_quantization(mut self, quant: Option<sanmai_config::QuantConfig>) -> Self {
        self.quant = quant;
        self
    }

    /// Random weights as a block-scaled FP8 checkpoint of `fp8` holds them: every converted Linear's
    /// values are e4m3 values times one scale a block ([`crate::fp8::round_blocks`]).
    pub fn with_fp8(mut self, fp8: Option<sanmai_config::Fp8Config>) -> Self {
        self.fp8 = fp8;
        self
    }

    /// Fills `out` deterministically from the seed and `name`.
    pub fn fill(&self, name: &str, init: Init, out: &mut [f32]) {
        match init {
            Init::Const(c) => out.fill(c),
            Init::Random { mean, std } => {
                // Uniform on [-√3·std, √3·std] has standard deviation `std`.
                let half_width = std * 3f32.sqrt();
                let base = self.seed ^ fnv1a(name);
                out.par_chunks_mut(CHUNK)
                    .enumerate()
                    .for_each(|(ci, chunk)| {
                        let mut s =
                            base.wrapping_add((ci as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
                        for v in chunk.iter_mut() {
                            let u = (splitmix(&mut s) >> 40) as f32 * (1.0 / (1u64 << 24) as f32);
                            *v = mean + (2.0 * u - 1.0) * half_width;
                        }
                    });
            }
        }
    }
}

impl TensorSource for Dummy {
    fn tensor(&self, name: &str, shape: &[usize], init: Init) -> Result<HostTensor<'_>> {
        if let Some(p) = self.packed(name, shape, init)? {
            let data = TensorData::F32(p.dequantize());
            let (name, shape) = (name.into(), shape.to_vec());
            return Ok(HostTensor { name, shape, data });
        }
        let mut data = vec![0f32; shape.iter().product()];
        self.fill(name, init, &mut data);
        let converted = quant_module(name, shape)
            .filter(|&(m, linear)| linear && self.fp8.as_ref().is_some_and(|f| f.converts(m)));
        if let (Some(_), Some(f)) = (converted, &self.fp8) {
            crate::fp8::round_blocks(&mut data, shape, f);
        }
        Ok(HostTensor {
            name: name.into(),
            shape: shape.to_vec(),
            data: TensorData::F32(data),
        })
    }

    fn contains(&self, _name: &str) -> bool {
        true
    }

    fn packed(&self, name: &str, shape: &[usize], init: Init) -> Result<Option<PackedTensor<'_>>> {
        let fp8 = quant_module(name, shape)
            .filter(|&(m, linear)| linear && self.fp8.as_ref().is_some_and(|f| f.converts(m)));
        if let (Some(_), Some(f)) = (fp8, &self.fp8) {
            return crate::fp8::random_packed(self.seed ^ fnv1a(name), name, shape, f, init);
        }
        let scheme = quant_module(name, shape)
            .and_then(|(m, linear)| self.quant.as_ref()?.scheme_for_module(m, linear));
        scheme
            .map(|s| random_packed(self.seed ^ fnv1a(name), name, shape, s, init))
            .transpose()
    }
}
