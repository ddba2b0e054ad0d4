//! Token sampling next to the logits (`kernels/sample.cu`, `sample_draw.cu`): a fixed sequence of
//! kernels, all but the last one block per chunk of a row, picks each row's token as
//! `sanmai_model::sample::sample_row` does and writes only its id and log-probability. Top-k, top-p and
//! top-p within top-k all cut by chunk-parallel radix passes over the ranking key (counts for top-k,
//! masses for top-p), so every row costs a few passes over its logits whatever its filters.

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;
use sanmai_model::sample::{collect_edits, RowError, RowSampling, Sampled};

use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// The widest vocabulary the kernels sample (a row's chunk statistics fit one warp, two per lane).
pub const SAMPLE_MAX_VOCAB: usize = 262_144;
/// Ids per chunk and threads of a chunk's block (and of the per-row finishing kernel).
const CHUNK: usize = 4096;
const CHUNK_THREADS: u32 = 256;
/// Words of the `work` buffer per row (`SAMPLE_ROW_WORDS` in the kernel source).
const ROW_WORDS: usize = 25_180;
/// Radix passes: the first cut (top-k, else top-p), then top-p within top-k; three digits each.
const RADIX_PASSES: i32 = 6;
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
    /// Packs `rows` for a vocabulary of `vocab` tokens: the one place the kernels' layout is built from
    /// the request's [`SamplingParams`](sanmai_model::sample::SamplingParams) each row borrows.
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
            let params = p.params;
            let greedy = params.is_greedy();
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
                if greedy {
                    1.0f32
                } else {
                    1.0 / params.temperature
                }
                .to_bits(),
                params.top_k_within(vocab).unwrap_or(0) as u32,
                params.top_p.to_bits(),
                params.min_p.to_bits(),
                params.repetition_penalty.to_bits(),
                params.frequency_penalty.to_bits(),
                params.presence_penalty.to_bits(),
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

    /// Words of the kernels' `work` buffer: per-row partial results, then one value per edit.
    pub fn work_words(&self) -> usize {
        self.rows * ROW_WORDS + self.num_edits()
    }
}

/// The device buffers of one [`Gpu::sample_bf16`] call: a [`SampleBatch`]'s `params`, `masks` and
/// `edits` uploaded, the kernels' scratch `work` ([`SampleBatch::work_words`] words) and `out`
/// (`[rows, 2]`: each row's id and log-probability bits, see [`unpack_samples`]).
pub struct SampleBuffers<'a, P, W, O> {
    pub params: &'a P,
    pub masks: &'a P,
    pub edits: &'a P,
    pub work: &'a mut W,
    pub out: &'a mut O,
}

/// Device pointers and sizes every sampling kernel takes, in their order.
struct SampleArgs {
    logits: u64,
    cols: i32,
    vocab: i32,
    rows: i32,
    params: u64,
    masks: u64,
    edits: u64,
    work: u64,
    out: u64,
}

/// The kernels' `[rows, 2]` output as results.
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
    /// tokens) with the packed batch `b` uploaded into `bufs` (see [`SampleBuffers`]); `bufs.out`
    /// receives each row's id and log-probability bits. Launches the same kernels whatever the
    /// parameters (rows a stage does not concern return at once), with shapes that depend only on
    /// the rows and the vocabulary.
    pub fn sample_bf16(
        &self,
        logits: &impl DevicePtr<bf16>,
        cols: usize,
        b: &SampleBatch,
        bufs: SampleBuffers<
            '_,
            impl DevicePtr<u32>,
            impl DevicePtrMut<u32>,
            impl DevicePtrMut<u32>,
        >,
    ) -> Result<()> {
        const OP: &str = "sample";
        let SampleBuffers {
            params,
            masks,
            edits,
            work,
            out,
        } = bufs;
        let rows = b.rows;
        ensure(b.vocab >= 1 && b.vocab <= cols, OP, || {
            format!("vocabulary {} does not fit rows of {cols}", b.vocab)
        })?;
        ensure(b.vocab <= SAMPLE_MAX_VOCAB, OP, || {
            format!("vocabulary {} exceeds {SAMPLE_MAX_VOCAB}", b.vocab)
        })?;
        // Rows are the second grid dimension of the chunk kernels.
        ensure(rows <= 65_535, OP, || {
            format!("{rows} rows exceed a grid's y limit")
        })?;
        check_len(OP, "logits", logits, rows * cols)?;
        check_len(OP, "params", params, rows * SAMPLE_PARAM_WORDS)?;
        check_len(OP, "masks", masks, b.masks.len())?;
        check_len(OP, "edits", edits, b.edits.len())?;
        check_len(OP, "work", work, b.work_words())?;
        check_len(OP, "out", out, rows * 2)?;
        if rows == 0 {
            return Ok(());
        }
        let (ci, vi, ri) = (
            int(OP, "cols", cols)?,
            int(OP, "vocab", b.vocab)?,
            int(OP, "rows", rows)?,
        );
        let s = self.stream();
        let (lp, _gl) = logits.device_ptr(s);
        let (pp, _gp) = params.device_ptr(s);
        let (mp, _gm) = masks.device_ptr(s);
        let (ep, _ge) = edits.device_ptr(s);
        let (wp, _gw) = work.device_ptr_mut(s);
        let (op, _go) = out.device_ptr_mut(s);
        let args = SampleArgs {
            logits: lp,
            cols: ci,
            vocab: vi,
            rows: ri,
            params: pp,
            masks: mp,
            edits: ep,
            work: wp,
            out: op,
        };
        let grid_rows = grid_u32(OP, rows)?;
        let chunks = (grid_u32(OP, b.vocab.div_ceil(CHUNK))?, grid_rows, 1);
        let per_row = (grid_rows, 1, 1);
        // SAFETY (every launch): argument types match the kernels (`SAMPLE_ARGS`, plus the pass of
        // `sample_radix`); buffer lengths, the work size and the vocabulary limit are checked above.
        unsafe {
            self.sample_launch("sample_stats", &args, None, cfg(chunks, CHUNK_THREADS, 0))?;
            for pass in 0..RADIX_PASSES {
                self.sample_launch(
                    "sample_radix",
                    &args,
                    Some(&pass),
                    cfg(chunks, CHUNK_THREADS, 0),
                )?;
            }
            self.sample_launch(
                "sample_draw_mass",
                &args,
                None,
                cfg(chunks, CHUNK_THREADS, 0),
            )?;
            self.sample_launch("sample_finish", &args, None, cfg(per_row, CHUNK_THREADS, 0))?;
        }
        Ok(())
    }

    /// Launches one sampling stage with the common arguments (and the radix pass, for `sample_radix`).
    ///
    /// # Safety
    /// `name` must take `SAMPLE_ARGS` (then the pass when one is given), and the buffers behind `a` must
    /// be valid for the batch the grid covers.
    unsafe fn sample_launch(
        &self,
        name: &str,
        a: &SampleArgs,
        pass: Option<&i32>,
        c: cudarc::driver::LaunchConfig,
    ) -> Result<()> {
        let mut lb = self.launch(self.kernel(name)?);
        lb.arg(&a.logits)
            .arg(&a.cols)
            .arg(&a.vocab)
            .arg(&a.rows)
            .arg(&a.params)
            .arg(&a.masks)
            .arg(&a.edits)
            .arg(&a.work)
            .arg(&a.out);
        if let Some(p) = pass {
            lb.arg(p);
        }
        // SAFETY: the caller vouches for the arguments (see above).
        unsafe { lb.launch(c) }
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
        // SAFETY: the kernels write every word of `work` they read before reading it.
        let mut work = unsafe { self.stream().alloc::<u32>(b.work_words().max(1)) }?;
        // SAFETY: the kernel writes both words of every row.
        let mut out = unsafe { self.stream().alloc::<u32>((2 * b.rows).max(1)) }?;
        let bufs = SampleBuffers {
            params: &params,
            masks: &masks,
            edits: &edits,
            work: &mut work,
            out: &mut out,
        };
        self.sample_bf16(logits, cols, &b, bufs)?;
        let host = self.download(&out)?;
        Ok(unpack_samples(&host[..2 * b.rows]))
    }
}
