//! The PLE rows of a step (spec §3): their gathering from the step's token ids (on the host, uploaded
//! as one `[rows, E]` tensor) and the mix that reads them; where the rows come from is `source.rs`.

pub(crate) mod source;

pub use source::PleSource;

use crate::backend::{Backend, BackendError, OpResult, PleCall, PleWeights, SeqChunk};
use crate::forward::{Layout, StepChunk, StepError};
use crate::load::Model;

impl<B: Backend> Model<B> {
    /// The step's PLE rows `[rows, E]`: chunk `i`'s rows hash its tokens with the history before
    /// them (the gather sees the history followed by the chunk), placed at the chunk's rows. `None`
    /// when the model has no PLE.
    pub(crate) fn ple_rows(
        &self,
        chunks: &[StepChunk<'_>],
        layout: &Layout<'_>,
    ) -> Result<Option<B::Tensor>, StepError> {
        let Some((shape, source)) = &self.ple else {
            return Ok(None);
        };
        let e = shape.row_width;
        let rows = layout.ids.len();
        let mut data = vec![0f32; rows * e];
        let mut seq = Vec::new();
        for (c, s) in chunks.iter().zip(&layout.seqs) {
            seq.clear();
            seq.extend_from_slice(c.history);
            seq.extend_from_slice(c.tokens);
            let from = c.history.len();
            source.gather(
                &seq,
                from..from + s.len,
                e,
                &mut data[s.start * e..(s.start + s.len) * e],
            )?;
        }
        Ok(Some(self.backend.upload(rows, e, data)?))
    }

    /// Layer `layer`'s PLE mix on the residual streams, with the step's rows from
    /// [`Model::ple_rows`].
    pub(crate) fn ple_mix(
        &self,
        layer: usize,
        w: &PleWeights<B::Weight>,
        streams: &mut B::Tensor,
        rows: Option<&B::Tensor>,
        seqs: &[SeqChunk<'_>],
    ) -> OpResult<()> {
        let missing = |what| BackendError::invalid("ple_mix", what);
        let (shape, _) = self
            .ple
            .as_ref()
            .ok_or_else(|| missing("PLE weights without a PLE shape"))?;
        let rows = rows.ok_or_else(|| missing("a PLE layer without the step's PLE rows"))?;
        self.backend.ple_mix(
            streams,
            &PleCall {
                layer,
                shape,
                rows,
                w,
                seqs,
            },
        )
    }
}
