//! Grammar masks off the engine loop: each constrained sequence hands its matcher to a small pool of
//! worker threads after every accepted token, and takes it back, with the next position's allowed-token
//! bitset, when it samples. The workers run while the model runs the step, so a mask usually costs the
//! loop nothing; one that is late makes its sequence wait a step (see `process`), never the batch.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use sanmai_structured::{mask_words, GrammarMatcher};

use crate::api::OutputConstraint;

/// A matcher and its mask buffer, travelling between the loop and the workers.
pub(crate) struct MaskJob {
    pub matcher: GrammarMatcher,
    /// The allowed tokens of the next position (valid when `result` is `Ok`).
    pub mask: Vec<u32>,
    pub result: Result<(), String>,
    /// Time the worker spent computing it.
    pub took: Duration,
}

/// Where a worker leaves a finished job.
#[derive(Default)]
pub(crate) struct MaskSlot {
    done: Mutex<Option<Box<MaskJob>>>,
    ready: Condvar,
}

impl MaskSlot {
    fn put(&self, job: Box<MaskJob>) {
        *self.done.lock().unwrap_or_else(|e| e.into_inner()) = Some(job);
        self.ready.notify_all();
    }

    /// The finished job, if it is back.
    pub fn try_take(&self) -> Option<Box<MaskJob>> {
        self.done.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Waits up to `timeout` for the job to come back; true if it is there.
    pub fn wait(&self, timeout: Duration) -> bool {
        let guard = self.done.lock().unwrap_or_else(|e| e.into_inner());
        let (guard, _) = self
            .ready
            .wait_timeout_while(guard, timeout, |d| d.is_none())
            .unwrap_or_else(|e| e.into_inner());
        guard.is_some()
    }
}

type Work = (Box<MaskJob>, Arc<MaskSlot>);

/// The worker threads (started with the first constrained request).
pub(crate) struct MaskWorkers {
    tx: Option<Sender<Work>>,
    threads: usize,
}

impl MaskWorkers {
    pub fn new(threads: usize) -> Self {
        MaskWorkers {
            tx: None,
            threads: threads.max(1),
        }
    }

    fn sender(&mut self) -> &Sender<Work> {
        self.tx.get_or_insert_with(|| {
            let (tx, rx) = channel::<Work>();
            let rx = Arc::new(Mutex::new(rx));
            for i in 0..self.threads {
                let rx = rx.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("sanmai-mask-{i}"))
                    .spawn(move || worker(rx));
                if let Err(e) = spawned {
                    tracing::error!(error = %e, "cannot start a grammar mask worker");
                }
            }
            tx
        })
    }

    /// Computes `job`'s next mask on a worker; the result comes back in `slot`.
    pub fn dispatch(&mut self, job: Box<MaskJob>, slot: &Arc<MaskSlot>) {
        if let Err(e) = self.sender().send((job, slot.clone())) {
            // No worker is alive: compute it here.
            let (mut job, slot) = e.0;
            compute(&mut job);
            slot.put(job);
        }
    }
}

fn worker(rx: Arc<Mutex<Receiver<Work>>>) {
    loop {
        let next = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
        let Ok((mut job, slot)) = next else { return };
        compute(&mut job);
        slot.put(job);
    }
}

fn compute(job: &mut MaskJob) {
    let started = Instant::now();
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        job.matcher.fill_mask(&mut job.mask)
    }));
    job.result = match out {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("the grammar matcher panicked".into()),
    };
    job.took = started.elapsed();
}

/// A sequence's grammar state.
pub(crate) struct Constrained {
    /// The job while the loop holds it (`None` while a worker has it).
    job: Option<Box<MaskJob>>,
    slot: Arc<MaskSlot>,
    trigger: Vec<u32>,
    active: bool,
    /// The held job's mask is the next position's.
    fresh: bool,
}

/// What accepting a token did to the grammar.
/// Drafts picked under a grammar and the mask of each verify row ([`Constrained::pick_drafts`]).
pub(crate) type Picked = (Vec<u32>, Vec<Vec<u32>>);

pub(crate) enum Accepted {
    Continue,
    /// The grammar is complete: the sequence ends.
    Done,
    Failed(String),
}

impl Constrained {
    pub fn new(c: OutputConstraint) -> Self {
        let words = mask_words(c.matcher.vocab_size());
        Constrained {
            job: Some(Box::new(MaskJob {
                matcher: c.matcher,
                mask: vec![0; words],
                result: Ok(()),
                took: Duration::ZERO,
            })),
            slot: Arc::new(MaskSlot::default()),
            active: c.activate_after.is_empty(),
            trigger: c.activate_after,
            fresh: false,
        }
    }

    /// Whether sampling needs a mask now.
    pub fn active(&self) -> bool {
        self.active
    }

    /// Starts computing the mask of the next position if it is needed and not under way.
    pub fn request_mask(&mut self, workers: &mut MaskWorkers) {
        if !self.active || self.fresh {
            return;
        }
        if let Some(job) = self.job.take() {
            workers.dispatch(job, &self.slot);
        }
    }

    /// Collects a finished mask job without waiting; true when the next mask is in hand.
    pub fn poll(&mut self) -> bool {
        if !self.active {
            return false;
        }
        if self.job.is_none() {
            if let Some(job) = self.slot.try_take() {
                self.job = Some(job);
                self.fresh = true;
            }
        }
        self.fresh && self.job.is_some()
    }

    /// Waits up to `timeout` for the mask under way.
    pub fn wait(&self, timeout: Duration) {
        if self.job.is_none() {
            self.slot.wait(timeout);
        }
    }

    /// The mask of the next position (after a successful [`Constrained::poll`]); the error when the
    /// matcher failed.
    pub fn mask(&self) -> Option<Result<&[u32], String>> {
        let job = self.job.as_ref().filter(|_| self.fresh)?;
        Some(match &job.result {
            Ok(()) => Ok(&job.mask),
            Err(e) => Err(e.clone()),
        })
    }

    /// Drafts under the grammar, at most `max`, with the mask of every verify row. Where the MTP
    /// head's logits row behind draft `j` is given (`rows[j]`), draft `j` is its greedy pick among
    /// the tokens the grammar allows after the drafts before it; the head chained its later rows
    /// from its own unmasked pick, so the drafts end after the first pick that differs from it.
    /// Without rows, `drafts` are taken as far as the grammar allows them. Returns the drafts and
    /// `drafts + 1` masks (of [`mask_words`] words); `None` unless the next position's mask is in
    /// hand. Computed here, on the caller's thread; the matcher is left where it was.
    pub fn pick_drafts(
        &mut self,
        drafts: &[u32],
        rows: &[Vec<f32>],
        max: usize,
    ) -> Option<Result<Picked, String>> {
        if !self.poll() {
            return None;
        }
        let job = self.job.as_mut()?;
        let words = job.mask.len();
        let m = &mut job.matcher;
        let (mut picked, mut masks) = (Vec::new(), Vec::new());
        let out = (|| {
            loop {
                let mut mask = vec![0u32; words];
                m.fill_mask(&mut mask)?;
                let j = picked.len();
                masks.push(mask);
                if j >= max || m.is_stopped() {
                    break;
                }
                let mask = &masks[j];
                let allowed = |t: usize| mask.get(t / 32).is_some_and(|w| w & (1 << (t % 32)) != 0);
                let greedy = |row: &[f32], only: bool| {
                    (0..row.len())
                        .filter(|&t| !only || allowed(t))
                        .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
                };
                let (t, chained) = match (rows.get(j), drafts.get(j)) {
                    (Some(row), _) => match greedy(row, true) {
                        Some(t) => (t, greedy(row, false) == Some(t)),
                        None => break,
                    },
                    (None, Some(&d)) if allowed(d as usize) => (d as usize, true),
                    _ => break,
                };
                picked.push(t as u32);
                m.advance(&[t as u32])?;
                if !chained {
                    let mut mask = vec![0u32; words];
                    m.fill_mask(&mut mask)?;
                    masks.push(mask);
                    break;
                }
            }
            Ok::<(), sanmai_structured::StructuredError>(())
        })();
        let rollback = m.rollback(picked.len());
        Some(
            out.and(rollback)
                .map(|()| (picked, masks))
                .map_err(|e| e.to_string()),
        )
    }

    /// Accepts a sampled token; `output` is the output so far, the token included.
    pub fn accept(&mut self, token: u32, output: &[u32]) -> Accepted {
        if !self.active {
            if !self.trigger.is_empty() && output.ends_with(&self.trigger) {
                self.active = true;
            }
            return Accepted::Continue;
        }
        let Some(job) = self.job.as_mut() else {
            return Accepted::Failed("a token was sampled without its grammar mask".into());
        };
        self.fresh = false;
        if let Err(e) = job.matcher.advance(&[token]) {
            return Accepted::Failed(e.to_string());
        }
        if job.matcher.is_stopped() {
            return match job.matcher.error() {
                Some(e) => Accepted::Failed(e),
                None => Accepted::Done,
            };
        }
        Accepted::Continue
    }
}
