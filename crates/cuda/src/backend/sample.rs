//! Sampling where the logits are: [`Backend::sample`](sanmai_model::Backend::sample) on the device.
//! Only the packed parameters go up and each row's id and log-probability come back; a vocabulary
//! wider than the kernel takes falls back to the host implementation.

use sanmai_model::sample::{sample_rows, RowError, RowSampling, Sampled};

use super::tensor::CudaTensor;
use super::CudaBackend;
use crate::error::Result;
use crate::ops::SAMPLE_MAX_VOCAB;

impl CudaBackend {
    pub(crate) fn sample_impl(
        &self,
        logits: &CudaTensor,
        valid_vocab: usize,
        rows: &[RowSampling<'_>],
    ) -> Result<Vec<std::result::Result<Sampled, RowError>>> {
        let fits = rows.len() <= logits.rows
            && (1..=logits.cols.min(SAMPLE_MAX_VOCAB)).contains(&valid_vocab);
        if !fits {
            let mut values = self.to_host_impl(logits)?;
            return Ok(sample_rows(&mut values, logits.cols, valid_vocab, rows));
        }
        self.gpu
            .sample_rows(&logits.buf, logits.cols, valid_vocab, rows)
    }
}
