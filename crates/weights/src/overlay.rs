//! Two sources as one: the tensors whose names start with a prefix come from the overlay source, every
//! other tensor from the base. `sanmai`'s `--speculative-config` `model` key reads the MTP head
//! (`mtp.*`) this way, from a directory written by `sanmai quantize --mtp-int4`, over the main
//! checkpoint.
//!
//! Routing is by name only: a prefixed tensor the overlay lacks is missing (never read from the base),
//! so a head is never put together from both sources. Every error names the source it came from
//! (`the MTP checkpoint DIR: tensor `mtp.fc.weight` is missing from the checkpoint`).

use crate::quant::PackedTensor;
use crate::{HostTensor, Init, Result, TensorSource, WeightError};

/// A named source: the name prefixes its errors.
struct Named {
    name: String,
    src: Box<dyn TensorSource>,
}

/// Reads the tensors under `prefix` from one source and the rest from another.
pub struct Overlay {
    prefix: String,
    base: Named,
    over: Named,
}

impl Overlay {
    /// Tensors named `prefix…` come from `over`, all others from `base`. `base_name` and `over_name`
    /// describe the sources in errors (e.g. `the main checkpoint DIR`, `the MTP checkpoint DIR`).
    pub fn new(
        prefix: impl Into<String>,
        base: Box<dyn TensorSource>,
        base_name: impl Into<String>,
        over: Box<dyn TensorSource>,
        over_name: impl Into<String>,
    ) -> Self {
        Overlay {
            prefix: prefix.into(),
            base: Named {
                name: base_name.into(),
                src: base,
            },
            over: Named {
                name: over_name.into(),
                src: over,
            },
        }
    }

    /// The prefix of the tensors read from the overlay source.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Whether `name` is read from the overlay source (else from the base).
    pub fn routes_to_overlay(&self, name: &str) -> bool {
        name.starts_with(&self.prefix)
    }

    /// The description of the source `name` is read from.
    pub fn source_name(&self, name: &str) -> &str {
        &self.route(name).name
    }

    fn route(&self, name: &str) -> &Named {
        if self.routes_to_overlay(name) {
            &self.over
        } else {
            &self.base
        }
    }
}

impl Named {
    /// `e` with the source's name in front.
    fn err(&self, e: WeightError) -> WeightError {
        WeightError::File {
            path: self.name.clone(),
            message: e.to_string(),
        }
    }
}

impl TensorSource for Overlay {
    fn tensor(&self, name: &str, shape: &[usize], init: Init) -> Result<HostTensor<'_>> {
        let s = self.route(name);
        s.src.tensor(name, shape, init).map_err(|e| s.err(e))
    }

    fn contains(&self, name: &str) -> bool {
        self.route(name).src.contains(name)
    }

    fn packed(&self, name: &str, shape: &[usize], init: Init) -> Result<Option<PackedTensor<'_>>> {
        let s = self.route(name);
        s.src.packed(name, shape, init).map_err(|e| s.err(e))
    }
}
