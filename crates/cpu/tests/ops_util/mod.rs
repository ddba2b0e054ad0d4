//! Shared helpers of the op tests: a tiny seeded PRNG and error measures.
#![allow(dead_code)]

/// SplitMix64: small, fast and good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [lo, hi).
    pub fn range(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit()
    }

    /// Uniform integer in [0, n).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    pub fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.range(lo, hi)).collect()
    }
}

/// Largest |a − b| over the largest |b| (1 when b is all zeros): a relative error for a whole tensor.
pub fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "compared tensors differ in length");
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - y).abs())
        .fold(0f64, f64::max)
        / scale
}

/// `rel_err` of two f32 tensors.
pub fn rel_err32(a: &[f32], b: &[f32]) -> f64 {
    let b: Vec<f64> = b.iter().map(|&x| x as f64).collect();
    rel_err(a, &b)
}

/// Largest elementwise |a − b| / max(|b|, floor).
pub fn max_elem_rel(a: &[f32], b: &[f64], floor: f64) -> f64 {
    assert_eq!(a.len(), b.len(), "compared tensors differ in length");
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - y).abs() / y.abs().max(floor))
        .fold(0f64, f64::max)
}

pub fn to64(a: &[f32]) -> Vec<f64> {
    a.iter().map(|&x| x as f64).collect()
}
