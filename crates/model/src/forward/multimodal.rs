//! [`Model::step`] for prompts with images: explicit interleaved-MRoPE positions and input
//! embeddings in place of token embeddings ([`StepMultimodal`]), in one call or prepared ahead as a
//! pipeline stage does.

use super::{
    Layout, Prepared, StepChunk, StepEmbeds, StepError, StepInput, StepMultimodal, StepOutput,
    StepStart,
};
use crate::backend::Backend;
use crate::load::Model;

impl<B: Backend> Model<B> {
    /// [`Model::step`] for a prompt with images: the chunks' tokens turned at explicit MRoPE
    /// positions, and some rows' input embeddings given (see [`StepMultimodal`]). A step with
    /// either runs op by op (not as a [`Backend::decode_step`], which a backend may replay from a
    /// recording of the plain step); without either it is exactly [`Model::step`].
    pub fn step_multimodal(
        &self,
        input: StepInput<'_, B::Tensor>,
        mm: StepMultimodal<'_, B::Tensor>,
    ) -> Result<StepOutput<B::Tensor>, StepError> {
        let mut layout = Layout::of(input.chunks);
        layout.mrope = self.mrope_rows(input.chunks, mm.positions)?;
        let ple = match input.start {
            StepStart::Draft(_) => None,
            _ => self.ple_rows(input.chunks, &layout)?,
        };
        self.run_prepared_multimodal(
            Prepared { layout, ple },
            input.start,
            input.hidden,
            mm.embeds.as_ref(),
        )
    }

    /// [`Model::prepare`] for a step whose chunks turn at explicit MRoPE positions (see
    /// [`StepMultimodal::positions`]); run it with [`Model::run_prepared_multimodal`].
    pub fn prepare_multimodal<'a>(
        &self,
        chunks: &'a [StepChunk<'a>],
        positions: &[Option<&[[u32; 3]]>],
    ) -> Result<Prepared<'a, B::Tensor>, StepError> {
        let mut prepared = self.prepare(chunks)?;
        prepared.layout.mrope = self.mrope_rows(chunks, positions)?;
        Ok(prepared)
    }

    /// [`Model::run_prepared`] with some rows' input embeddings given (on the first stage, from
    /// tokens: see [`StepMultimodal::embeds`]).
    pub fn run_prepared_multimodal(
        &self,
        prepared: Prepared<'_, B::Tensor>,
        start: StepStart<B::Tensor>,
        hidden: bool,
        embeds: Option<&StepEmbeds<'_, B::Tensor>>,
    ) -> Result<StepOutput<B::Tensor>, StepError> {
        if let Some(e) = embeds {
            if !matches!(start, StepStart::Tokens) {
                return Err(StepError::Input(
                    "input embeddings replace token embeddings: only a step from tokens takes them"
                        .into(),
                ));
            }
            let n = prepared.layout.ids.len();
            let mut rows = e.rows.to_vec();
            rows.sort_unstable();
            if let Some(&bad) = rows.last().filter(|&&r| r >= n) {
                return Err(StepError::Input(format!(
                    "input embedding for row {bad} of a step of {n} rows"
                )));
            }
            if let Some(w) = rows.windows(2).find(|w| w[0] == w[1]) {
                return Err(StepError::Input(format!(
                    "two input embeddings for row {}",
                    w[0]
                )));
            }
        }
        self.run(prepared, start, hidden, embeds)
    }

    /// Every row's MRoPE positions when a chunk has explicit ones (`None` when none has).
    fn mrope_rows(
        &self,
        chunks: &[StepChunk<'_>],
        positions: &[Option<&[[u32; 3]]>],
    ) -> Result<Option<Vec<[u32; 3]>>, StepError> {
        if positions.iter().all(Option::is_none) {
            return Ok(None);
        }
        if positions.len() > chunks.len() {
            return Err(StepError::Input(format!(
                "MRoPE positions for {} chunks of a step of {}",
                positions.len(),
                chunks.len()
            )));
        }
        if self.cfg.rope.mrope_section.is_none() {
            return Err(StepError::Input(
                "explicit MRoPE positions for a model whose RoPE has no mrope_section".into(),
            ));
        }
        let mut rows = Vec::with_capacity(chunks.iter().map(|c| c.tokens.len()).sum());
        for (i, c) in chunks.iter().enumerate() {
            match positions.get(i).copied().flatten() {
                Some(p) if p.len() != c.tokens.len() => {
                    return Err(StepError::Input(format!(
                        "chunk {i}: {} MRoPE positions for {} tokens",
                        p.len(),
                        c.tokens.len()
                    )))
                }
                Some(p) => rows.extend_from_slice(p),
                None => rows.extend((c.pos0..c.pos0 + c.tokens.len()).map(|p| [p as u32; 3])),
            }
        }
        Ok(Some(rows))
    }
}
