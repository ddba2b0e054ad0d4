//! Token sampling next to the logits (`kernels/sample.cu`): one block per row picks the row's token as
//! `sanmai_model::sample::sample_row` does and writes only its id and log-probability.

use cudarc::driver::{DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;
use sanmai_model::sample::{collect_edits, RowError, RowSampling, Sampled};

use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// The widest vocabulary the kernel samples (its bitmap of edited ids lives in shared memory).
pub const SAMPLE_MAX_VOCAB: usize = 262_144;
/// Threads per row (one block).
const THREADS: u32 = 1024;
/// Words per row of the packed parameters.
pub const SAMPLE_PARAM_WORDS: usize = 16;
/// Words per packed edit.
pub const SAMPLE_EDIT_WORDS: usize = 4;
const NO_CANDIDATES: u32 = 0xffff_ffff;
const INFINITE_LOGIT: u32 = 0xffff_fffe;

/// A batch's sampling parameters in the kernel's layout.
///
/// Per row, `SAMPLE_PARAM_WORDS` words: `[0]` flags (bit 0 greedy, bit 1 has a mask), `[1]` `1/T` (f32
/// bits), `[2]` top-k (0 off, else below the vocabulary), `[3]` top-p, `[4]` min-p, `[5..8]` repetition,
/// frequency, presence penalties (f32 bits), `[8..10]` the uniform (f64, low word first), `[10]` the
/// mask's first word in `masks`, `[11]` the first edit in `edits`, `[12]` the edit count. A mask is
/// `ceil(vocab / 32)` words; an edit is `[id, flags (bit 0 penalised, bit 1 biased), output count,
/// bias (f32 bits)]`, a row's edits by ascending id (see `sanmai_model::sample::Edit`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SampleBatch {
    pub rows: usize,
    pub vocab: usize,
    pub params: Vec<u32>,
    pub masks: Vec<u32>,
    pub edits: Vec<u32>,
}

impl SampleBatch {
    /// Packs `rows` for a vocabulary of `vocab` tokens.
    pub fn pack(rows: &[RowSampling<'_>], vocab: usize) -> Self {
        let words = vocab.div_ceil(32);
        let mut b = SampleBatch {
            rows: rows.len(),
            vocab,
            params: Vec::with_capacity(rows.len() * SAMPLE_PARAM_WORDS),
            ..Self::default()
        };
        let mut edits = Vec::new();
        for p in rows {
            let greedy = p.is_greedy();
            let mask_at = b.masks.len() as u32;
            if let Some(m) = p.allowed {
                let n = m.len().min(words);
                b.masks.extend_from_slice(&m[..n]);
                b.masks.resize(mask_at as usize + words, 0);
            }
            collect_edits(p, vocab, true, &mut edits);
            let edit_at = (b.edits.len() / SAMPLE_EDIT_WORDS) as u32;
            for e in &edits {
                b.edits.extend_from_slice(&[
                    e.id,
                    u32::from(e.penalized) | (u32::from(e.bias.is_some()) << 1),
                    e.output,
                    e.bias.unwrap_or(0.0).to_bits(),
                ]);
            }
            let u = p.uniform.to_bits();
            b.params.extend_from_slice(&[
                u32::from(greedy) | (u32::from(p.allowed.is_some()) << 1),
                if greedy { 1.0f32 } else { p.scale() }.to_bits(),
                p.top_k_limit(vocab).unwrap_or(0) as u32,
                p.top_p.to_bits(),
                p.min_p.to_bits(),
                p.repetition_penalty.to_bits(),
                p.frequency_penalty.to_bits(),
                p.presence_penalty.to_bits(),
                u as u32,
                (u >> 32) as u32,
                mask_at,
                edit_at,
                edits.len() as u32,
                0,
                0,
                0,
            ]);
        }
        b
    }

    /// Edits over all rows.
    pub fn num_edits(&self) -> usize {
        self.edits.len() / SAMPLE_EDIT_WORDS
    }
}

/// The kernel's `[rows, 2]` output as results.
pub fn unpack_samples(out: &[u32]) -> Vec<std::result::Result<Sampled, RowError>> {
    out.chunks_exact(2)
        .map(|o| match o[0] {
            NO_CANDIDATES => Err(RowError::NoCandidates),
            INFINITE_LOGIT => Err(RowError::InfiniteLogit),
            id => Ok(Sampled {
                id,
                logprob: f32::from_bits(o[1]),
            }),
        })
        .collect()
}

impl Gpu {
    /// Samples one token per row of `logits` `[rows, cols]` (bf16; the first `b.vocab` columns are
    /// tokens) with the packed batch `b` uploaded as `params`, `masks` and `edits`; `vals` is scratch of
    /// `b.num_edits()` values; `out` `[rows, 2]` receives each row's id and log-probability bits (see
    /// [`unpack_samples`]).
    #[allow(clippy::too_many_arguments)]
    pub fn sample_bf16(
        &self,
        logits: &impl DevicePtr<bf16>,
        cols: usize,
        b: &SampleBatch,
        params: &impl DevicePtr<u32>,
        masks: &impl DevicePtr<u32>,
        edits: &impl DevicePtr<u32>,
        vals: &mut impl DevicePtrMut<f32>,
        out: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        const OP: &str = "sample";
        let rows = b.rows;
        ensure(b.vocab >= 1 && b.vocab <= cols, OP, || {
            format!("vocabulary {} does not fit rows of {cols}", b.vocab)
        })?;
        ensure(b.vocab <= SAMPLE_MAX_VOCAB, OP, || {
            format!("vocabulary {} exceeds {SAMPLE_MAX_VOCAB}", b.vocab)
        })?;
        check_len(OP, "logits", logits, rows * cols)?;
        check_len(OP, "params", params, rows * SAMPLE_PARAM_WORDS)?;
        check_len(OP, "masks", masks, b.masks.len())?;
        check_len(OP, "edits", edits, b.edits.len())?;
        check_len(OP, "vals", vals, b.num_edits())?;
        check_len(OP, "out", out, rows * 2)?;
        if rows == 0 {
            return Ok(());
        }
        let (ci, vi) = (int(OP, "cols", cols)?, int(OP, "vocab", b.vocab)?);
        let s = self.stream();
        let (lp, _gl) = logits.device_ptr(s);
        let (pp, _gp) = params.device_ptr(s);
        let (mp, _gm) = masks.device_ptr(s);
        let (ep, _ge) = edits.device_ptr(s);
        let (vp, _gv) = vals.device_ptr_mut(s);
        let (op, _go) = out.device_ptr_mut(s);
        let mut lb = s.launch_builder(self.kernel("sample_bf16")?);
        lb.arg(&lp)
            .arg(&ci)
            .arg(&vi)
            .arg(&pp)
            .arg(&mp)
            .arg(&ep)
            .arg(&vp)
            .arg(&op);
        // SAFETY: argument types match the kernel; buffer lengths and the vocabulary limit checked above.
        unsafe { lb.launch(cfg((grid_u32(OP, rows)?, 1, 1), THREADS, 0)) }?;
        Ok(())
    }

    /// Samples `specs.len()` rows of `logits` `[rows, cols]` over the first `vocab` columns: packs and
    /// uploads the parameters, launches [`Gpu::sample_bf16`] and downloads the ids and log-probabilities
    /// (the only transfer back, 8 bytes a row).
    pub fn sample_rows(
        &self,
        logits: &impl DevicePtr<bf16>,
        cols: usize,
        vocab: usize,
        specs: &[RowSampling<'_>],
    ) -> Result<Vec<std::result::Result<Sampled, RowError>>> {
        let b = SampleBatch::pack(specs, vocab);
        let one = |v: &[u32]| -> Result<_> {
            if v.is_empty() {
                self.zeros::<u32>(1)
            } else {
                self.upload(v)
            }
        };
        let params = one(&b.params)?;
        let masks = one(&b.masks)?;
        let edits = one(&b.edits)?;
        // SAFETY: the kernel writes every edited value before reading it.
        let mut vals = unsafe { self.stream().alloc::<f32>(b.num_edits().max(1)) }?;
        // SAFETY: the kernel writes both words of every row.
        let mut out = unsafe { self.stream().alloc::<u32>((2 * b.rows).max(1)) }?;
        self.sample_bf16(
            logits, cols, &b, &params, &masks, &edits, &mut vals, &mut out,
        )?;
        let host = self.download(&out)?;
        Ok(unpack_samples(&host[..2 * b.rows]))
    }
}
