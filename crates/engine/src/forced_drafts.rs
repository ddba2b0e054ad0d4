//! [`ForcedDrafts`]: an executor that replaces the MTP head's drafts with tokens given in advance,
//! for measuring and testing verification where the head's own drafts are not worth much (random
//! weights accept almost nothing). Given each request's greedy output without drafts, it drafts
//! exactly those tokens (every draft accepted: the all-accepted case end to end), or spoils the
//! drafts a rule picks (rejections at chosen positions). The head still runs and proposes as it
//! would; only its tokens are swapped, so the step and draft times are the real ones.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::api::StageTimes;
use crate::executor::{CacheGeometry, Executor};
use crate::step::{StepLogits, StepPlan};

/// Which drafts to spoil: called with the request's key, the step's count and the draft's position
/// in its proposal (0: the first); a spoiled draft is the right token plus one.
pub type Spoil = Box<dyn FnMut(u64, u64, usize) -> bool + Send>;

/// Each request's known tokens (prompt and output), by request key.
pub type Known = Arc<Mutex<HashMap<u64, Vec<u32>>>>;

/// An executor whose MTP drafts are the tokens each request is known to produce.
pub struct ForcedDrafts<E> {
    inner: E,
    known: Known,
    spoil: Option<Spoil>,
    steps: u64,
}

impl<E: Executor> ForcedDrafts<E> {
    /// Drafts from `known` (request key → the request's prompt and greedy output); `spoil` picks
    /// drafts to make wrong.
    pub fn new(inner: E, known: HashMap<u64, Vec<u32>>, spoil: Option<Spoil>) -> Self {
        ForcedDrafts {
            inner,
            known: Arc::new(Mutex::new(known)),
            spoil,
            steps: 0,
        }
    }

    /// The known tokens, shared: what is put there after the engine started drafts the requests
    /// submitted after it.
    pub fn known(&self) -> Known {
        self.known.clone()
    }

    /// The drafts for the chunks of a step that returned `out`, where the head proposed some.
    fn force(&mut self, plan: &StepPlan, out: &mut StepLogits) {
        self.steps += 1;
        let known_all = self.known.clone();
        let known_all = known_all.lock().unwrap_or_else(|e| e.into_inner());
        let mut first_row = 0;
        for (ci, c) in plan.chunks.iter().enumerate() {
            let rows = c.logits.count(c.tokens.len());
            let start = first_row;
            first_row += rows;
            let (Some(spec), Some(known)) = (c.spec, known_all.get(&c.request)) else {
                continue;
            };
            let Some(proposed) = out.drafts.get_mut(ci).filter(|d| !d.is_empty()) else {
                continue;
            };
            // The engine takes these drafts as they are, not picks from the head's logits.
            if let Some(rows) = out.draft_logits.get_mut(ci) {
                rows.clear();
            }
            // The sequence's length after this step: its certain tokens, the accepted drafts and
            // the token drawn after them.
            let drawn: Vec<u32> = (start..start + rows)
                .filter_map(|r| match out.sampled.get(r) {
                    Some(Some(Ok(s))) => Some(s.id),
                    _ => None,
                })
                .collect();
            let certain = c.tokens.len() - spec.drafts;
            let accepted = drawn
                .iter()
                .zip(&c.tokens[certain..])
                .take_while(|(x, y)| x == y)
                .count();
            let len = c.pos0 + certain + accepted + 1;
            for (j, d) in proposed.iter_mut().enumerate() {
                if let Some(&t) = known.get(len + j) {
                    let spoiled = self
                        .spoil
                        .as_mut()
                        .is_some_and(|f| f(c.request, self.steps, j));
                    *d = if spoiled { t + 1 } else { t };
                }
            }
        }
    }
}

impl<E: Executor> Executor for ForcedDrafts<E> {
    fn geometry(&self) -> CacheGeometry {
        self.inner.geometry()
    }
    fn init_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<(), String> {
        self.inner.init_cache(num_blocks, block_size)
    }
    fn alloc_state(&mut self) -> Result<usize, String> {
        self.inner.alloc_state()
    }
    fn reserve_states(&mut self, slots: usize) -> Result<(), String> {
        self.inner.reserve_states(slots)
    }
    fn free_state(&mut self, slot: usize) {
        self.inner.free_state(slot)
    }
    fn copy_state(&mut self, src: usize, dst: usize) -> Result<(), String> {
        self.inner.copy_state(src, dst)
    }
    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), String> {
        self.inner.copy_block(src, dst)
    }
    fn prefetch(&mut self, request: u64, prompt: &[u32], from: usize) {
        self.inner.prefetch(request, prompt, from)
    }
    fn cancel_prefetch(&mut self, request: u64) {
        self.inner.cancel_prefetch(request)
    }
    fn samples_on_device(&self) -> bool {
        self.inner.samples_on_device()
    }
    fn max_in_flight(&self) -> usize {
        self.inner.max_in_flight()
    }
    fn stage_times(&self) -> Vec<StageTimes> {
        self.inner.stage_times()
    }
    fn fault(&self) -> Option<String> {
        self.inner.fault()
    }
    fn submit(&mut self, plan: StepPlan) {
        self.inner.submit(plan)
    }
    fn wait(&mut self) -> (StepPlan, Result<StepLogits, String>) {
        let (plan, mut out) = self.inner.wait();
        if let Ok(out) = out.as_mut() {
            self.force(&plan, out);
        }
        (plan, out)
    }
}
