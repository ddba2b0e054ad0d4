//! Step metadata on the device: token ids, output rows, per-row positions and K/V destinations, and
//! per-sequence state slots, context lengths, chunk rows (first row, row count) and block tables,
//! uploaded once per step into one persistent device buffer through a ring of pinned host staging
//! buffers (one async copy each).
//!
//! Device buffer layout (u32 words): `[0, cap_tok)` ids uploaded by `embed` alone, `[cap_tok,
//! 2·cap_tok)` row indices uploaded by `rows` alone, then the packed step region written by
//! [`Meta::stage`]: `[ids][out_rows]` (when staged through `begin_step`) `[positions: rows][kv_dst:
//! rows][slots: seqs][lens: seqs][starts: seqs][chunk_lens: seqs][tables: seqs·stride]`. Every op
//! reads its metadata from views of this buffer; the host keeps a copy of what each region holds, so
//! an op whose metadata is already there uploads nothing. A staging buffer is rewritten only after its
//! previous copy has completed (its event), which, with a ring of [`RING`] buffers, never waits in a
//! normal step.
//!
//! A step with explicit interleaved-MRoPE positions (images in a prompt) also uploads its rows'
//! `(t, h, w)` through the same ring into a small buffer of their own ([`Meta::stage_mrope`]),
//! allocated with the first such step and reused (grown when a step has more rows); every attention
//! layer of the step reads the same copy.

use cudarc::driver::{
    result, CudaContext, CudaEvent, CudaSlice, CudaView, DevicePtr, PinnedHostSlice,
};
use sanmai_model::SeqChunk;
use std::sync::Arc;

use crate::error::{CudaError, Result};
use crate::gpu::Gpu;

/// Staging buffers in the ring.
const RING: usize = 4;
/// Marks a row without a K/V destination (not part of any chunk).
pub(crate) const NO_ROW: u32 = u32::MAX;

/// The step's sequences as the host last uploaded them.
#[derive(Clone, PartialEq, Eq)]
struct SeqKey {
    rows: usize,
    block_size: usize,
    chunks: Vec<(usize, usize, usize, usize, Vec<u32>)>,
}

impl SeqKey {
    fn of(seqs: &[SeqChunk<'_>], rows: usize, block_size: usize) -> Self {
        SeqKey {
            rows,
            block_size,
            chunks: seqs
                .iter()
                .map(|s| (s.start, s.len, s.pos0, s.state, s.blocks.to_vec()))
                .collect(),
        }
    }
}

/// Where the sequence metadata of the current step lies in the device buffer (word offsets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SeqMeta {
    pub rows: usize,
    pub n_seq: usize,
    pub positions: usize,
    pub kv_dst: usize,
    pub slots: usize,
    pub lens: usize,
    /// First row of each sequence's chunk in the step.
    pub starts: usize,
    /// Rows of each sequence's chunk.
    pub chunk_lens: usize,
    pub tables: usize,
    /// Block ids per table row (the step's longest block list).
    pub stride: usize,
}

struct Staging {
    host: PinnedHostSlice<u32>,
    event: CudaEvent,
}

pub(crate) struct Meta {
    pub dev: CudaSlice<u32>,
    cap_tok: usize,
    ring: Vec<Staging>,
    next: usize,
    ids: Option<(Vec<u32>, usize)>,
    out_rows: Option<(Vec<u32>, usize)>,
    seqs: Option<(SeqKey, SeqMeta)>,
    /// Explicit MRoPE positions, `[rows, 3]` words, and what the host last copied there.
    mrope_dev: Option<CudaSlice<u32>>,
    mrope: Option<Vec<u32>>,
    /// Counts reallocations of `dev` (a recorded graph holds its address).
    pub generation: u64,
}

fn pinned(ctx: &Arc<CudaContext>, words: usize) -> Result<Staging> {
    // SAFETY: the buffer is written before any copy reads it.
    let host = unsafe { ctx.alloc_pinned::<u32>(words.max(1)) }?;
    Ok(Staging {
        host,
        event: ctx.new_event(None)?,
    })
}

/// Copies `words` to word offset `at` of `dst` through the next staging buffer of `ring` (`next`
/// names it, and moves on).
fn copy_staged(
    ring: &mut [Staging],
    next: &mut usize,
    gpu: &Gpu,
    dst: &CudaSlice<u32>,
    words: &[u32],
    at: usize,
) -> Result<()> {
    if words.is_empty() {
        return Ok(());
    }
    if at + words.len() > dst.len() {
        return Err(CudaError::Shape {
            op: "step metadata",
            msg: format!("{} words at {at} of a buffer of {}", words.len(), dst.len()),
        });
    }
    let i = *next;
    *next = (i + 1) % ring.len();
    let st = &mut ring[i];
    // Waits for this buffer's previous copy (long done in a normal step).
    st.event.synchronize()?;
    if st.host.len() < words.len() {
        *st = pinned(gpu.context(), words.len().next_power_of_two())?;
    }
    let host = st.host.as_mut_slice()?;
    host[..words.len()].copy_from_slice(words);
    let s = gpu.stream();
    let (dp, _g) = dst.device_ptr(s);
    // SAFETY: the destination range lies inside `dst` (checked above); the pinned source is not
    // rewritten before the event recorded below completes.
    unsafe { result::memcpy_htod_async(dp + 4 * at as u64, &host[..words.len()], s.cu_stream()) }?;
    st.event.record(s)?;
    Ok(())
}

/// Words the packed step region needs, and its table stride (at least `min_stride`).
fn packed_words(
    ids: usize,
    rows_out: usize,
    rows: usize,
    seqs: &[SeqChunk<'_>],
    min_stride: usize,
) -> (usize, usize) {
    let stride = seqs
        .iter()
        .map(|s| s.blocks.len())
        .max()
        .unwrap_or(0)
        .max(min_stride)
        .max(1);
    (
        ids + rows_out + 2 * rows + 4 * seqs.len() + seqs.len() * stride,
        stride,
    )
}

impl Meta {
    /// A buffer for steps of up to `max_tokens` rows and `max_seqs` sequences with tables of up to
    /// `max_blocks` ids (larger steps grow it).
    pub fn new(gpu: &Gpu, max_tokens: usize, max_seqs: usize, max_blocks: usize) -> Result<Self> {
        let cap_tok = max_tokens.max(1);
        let words = 2 * cap_tok + 4 * cap_tok + max_seqs * (4 + max_blocks.max(1));
        let ring = (0..RING)
            .map(|_| pinned(gpu.context(), words))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            dev: gpu.zeros::<u32>(words)?,
            cap_tok,
            ring,
            next: 0,
            ids: None,
            out_rows: None,
            seqs: None,
            mrope_dev: None,
            mrope: None,
            generation: 0,
        })
    }

    /// Device bytes of the metadata buffers.
    pub fn bytes(&self) -> usize {
        4 * (self.dev.len() + self.mrope_dev.as_ref().map_or(0, |d| d.len()))
    }

    fn packed_base(&self) -> usize {
        2 * self.cap_tok
    }

    /// Makes the device buffer hold `cap_tok` lazy rows and a packed region of `packed` words.
    fn reserve(&mut self, gpu: &Gpu, cap_tok: usize, packed: usize) -> Result<()> {
        let cap_tok = cap_tok.max(self.cap_tok);
        let need = 2 * cap_tok + packed;
        if cap_tok != self.cap_tok || need > self.dev.len() {
            // Kernels already queued keep reading the old buffer: it is freed in stream order.
            self.dev = gpu.zeros::<u32>(need.max(self.dev.len()).next_power_of_two())?;
            self.cap_tok = cap_tok;
            self.generation += 1;
            self.ids = None;
            self.out_rows = None;
            self.seqs = None;
        }
        Ok(())
    }

    /// Copies `words` to word offset `at` of the device buffer through the next staging buffer.
    fn upload(&mut self, gpu: &Gpu, words: &[u32], at: usize) -> Result<()> {
        copy_staged(&mut self.ring, &mut self.next, gpu, &self.dev, words, at)
    }

    /// Makes the MRoPE buffer hold `positions` (`(t, h, w)` of each of the step's rows), uploading
    /// them when it holds other values; [`Meta::mrope_view`] then reads them.
    pub fn stage_mrope(&mut self, gpu: &Gpu, positions: &[[u32; 3]]) -> Result<()> {
        let words: Vec<u32> = positions.iter().flatten().copied().collect();
        if self.mrope_dev.is_some() && self.mrope.as_ref() == Some(&words) {
            return Ok(());
        }
        self.mrope = None;
        let dev = match self.mrope_dev.take() {
            Some(d) if d.len() >= words.len() => d,
            // Kernels already queued keep reading the old buffer: it is freed in stream order.
            _ => gpu.zeros::<u32>(words.len().max(1).next_power_of_two())?,
        };
        let copied = copy_staged(&mut self.ring, &mut self.next, gpu, &dev, &words, 0);
        self.mrope_dev = Some(dev);
        copied?;
        self.mrope = Some(words);
        Ok(())
    }

    /// The MRoPE positions last staged ([`Meta::stage_mrope`]), `3·rows` words; `None` before any.
    pub fn mrope_view(&self, rows: usize) -> Option<CudaView<'_, u32>> {
        let d = self.mrope_dev.as_ref()?;
        Some(d.slice(..(3 * rows).clamp(1, d.len())))
    }

    /// Appends the sequence words of a step to `w`, returning their offsets relative to `base`.
    fn seq_words(
        w: &mut Vec<u32>,
        base: usize,
        seqs: &[SeqChunk<'_>],
        rows: usize,
        block_size: usize,
        stride: usize,
    ) -> Result<SeqMeta> {
        let bs = block_size.max(1);
        let positions = base + w.len();
        let mut pos = vec![0u32; rows];
        let mut dst = vec![NO_ROW; rows];
        for s in seqs {
            if s.start + s.len > rows || (s.pos0 + s.len).div_ceil(bs) > s.blocks.len() {
                return Err(CudaError::Shape {
                    op: "step metadata",
                    msg: format!(
                        "chunk start {} len {} pos0 {} with {} blocks does not fit {rows} rows of blocks of {bs}",
                        s.start,
                        s.len,
                        s.pos0,
                        s.blocks.len()
                    ),
                });
            }
            for i in 0..s.len {
                let p = s.pos0 + i;
                pos[s.start + i] = p as u32;
                let row = s.blocks[p / bs] as u64 * bs as u64 + (p % bs) as u64;
                dst[s.start + i] = u32::try_from(row).unwrap_or(NO_ROW);
            }
        }
        w.extend_from_slice(&pos);
        let kv_dst = base + w.len();
        w.extend_from_slice(&dst);
        let slots = base + w.len();
        w.extend(
            seqs.iter()
                .map(|s| u32::try_from(s.state).unwrap_or(NO_ROW)),
        );
        let lens = base + w.len();
        w.extend(seqs.iter().map(|s| (s.pos0 + s.len) as u32));
        let starts = base + w.len();
        w.extend(seqs.iter().map(|s| s.start as u32));
        let chunk_lens = base + w.len();
        w.extend(seqs.iter().map(|s| s.len as u32));
        let tables = base + w.len();
        for s in seqs {
            w.extend_from_slice(s.blocks);
            w.extend(std::iter::repeat_n(0u32, stride - s.blocks.len()));
        }
        Ok(SeqMeta {
            rows,
            n_seq: seqs.len(),
            positions,
            kv_dst,
            slots,
            lens,
            starts,
            chunk_lens,
            tables,
            stride,
        })
    }

    /// Uploads a whole step (ids, output rows, sequences) in one copy, block tables padded to at
    /// least `min_stride` ids a row (a recorded decode step keeps its layout across context lengths).
    pub fn stage(
        &mut self,
        gpu: &Gpu,
        ids: &[u32],
        seqs: &[SeqChunk<'_>],
        out_rows: &[usize],
        block_size: usize,
        min_stride: usize,
    ) -> Result<()> {
        let rows = ids.len();
        let (words, stride) = packed_words(ids.len(), out_rows.len(), rows, seqs, min_stride);
        self.reserve(gpu, 0, words)?;
        let base = self.packed_base();
        let mut w = Vec::with_capacity(words);
        w.extend_from_slice(ids);
        let out: Vec<u32> = out_rows.iter().map(|&r| r as u32).collect();
        w.extend_from_slice(&out);
        let sm = Self::seq_words(&mut w, base, seqs, rows, block_size, stride)?;
        self.upload(gpu, &w, base)?;
        self.ids = Some((ids.to_vec(), base));
        self.out_rows = Some((out, base + ids.len()));
        self.seqs = Some((SeqKey::of(seqs, rows, block_size), sm));
        Ok(())
    }

    /// The word offset of `ids` on the device, uploading them when they are not there.
    pub fn ids(&mut self, gpu: &Gpu, ids: &[u32]) -> Result<usize> {
        if let Some((h, at)) = &self.ids {
            if h == ids {
                return Ok(*at);
            }
        }
        self.reserve(gpu, ids.len(), 0)?;
        self.upload(gpu, ids, 0)?;
        self.ids = Some((ids.to_vec(), 0));
        Ok(0)
    }

    /// The word offset of the row indices `rows` on the device, uploading them when needed.
    pub fn out_rows(&mut self, gpu: &Gpu, rows: &[usize]) -> Result<usize> {
        let r: Vec<u32> = rows.iter().map(|&x| x as u32).collect();
        if let Some((h, at)) = &self.out_rows {
            if *h == r {
                return Ok(*at);
            }
        }
        self.reserve(gpu, r.len(), 0)?;
        let at = self.cap_tok;
        self.upload(gpu, &r, at)?;
        self.out_rows = Some((r, at));
        Ok(at)
    }

    /// The sequence metadata of a step of `rows` rows, uploaded when it differs from the last.
    pub fn seqs(
        &mut self,
        gpu: &Gpu,
        seqs: &[SeqChunk<'_>],
        rows: usize,
        block_size: usize,
    ) -> Result<SeqMeta> {
        let key = SeqKey::of(seqs, rows, block_size);
        if let Some((k, m)) = &self.seqs {
            if *k == key {
                return Ok(*m);
            }
        }
        let (words, stride) = packed_words(0, 0, rows, seqs, 0);
        // Keep ids / rows staged with the step: place sequence words after them.
        let keep = [&self.ids, &self.out_rows]
            .iter()
            .filter_map(|x| x.as_ref())
            .filter(|(_, at)| *at >= self.packed_base())
            .map(|(h, at)| at + h.len())
            .max()
            .unwrap_or(0);
        let base = keep.max(self.packed_base());
        self.reserve(gpu, 0, base - self.packed_base() + words)?;
        let base = if self.ids.is_none() && self.out_rows.is_none() {
            self.packed_base()
        } else {
            base
        };
        let mut w = Vec::with_capacity(words);
        let sm = Self::seq_words(&mut w, base, seqs, rows, block_size, stride)?;
        self.upload(gpu, &w, base)?;
        self.seqs = Some((key, sm));
        Ok(sm)
    }

    /// A view of `len` words at offset `at`.
    pub fn view(&self, at: usize, len: usize) -> CudaView<'_, u32> {
        self.dev.slice(at..at + len.max(1).min(self.dev.len() - at))
    }
}
