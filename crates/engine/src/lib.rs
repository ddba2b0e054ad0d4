//! The engine crate owns scheduling, sequences and sampling: the loop that turns model logits into tokens
//! for many concurrent requests.
//!
//! Only sampling exists so far: [`sampler`] turns one row of logits per sequence into a token id plus the
//! log-probabilities an OpenAI response reports.

pub mod sampler;
