//! [`EngineHandle`]: the thread-safe front door of the engine loop, and [`RequestStream`], one request's
//! event channel (dropping it aborts the request).

use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc::UnboundedReceiver;

use crate::api::{EngineEvent, EngineRequest, MetricsSnapshot, OutputConstraint, SubmitError};

/// Static facts about the served model.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    pub model_name: String,
    /// Context length in tokens (prompt + generated).
    pub max_model_len: usize,
    /// Ids below this are real tokens.
    pub valid_vocab: usize,
    /// Default `max_tokens` when a request gives none (`generation_config`), capped by the context.
    pub default_max_tokens: Option<usize>,
}

pub(crate) enum Command {
    Submit(
        Box<EngineRequest>,
        tokio::sync::mpsc::UnboundedSender<EngineEvent>,
        Option<Box<OutputConstraint>>,
    ),
    Abort(String),
    Shutdown,
}

/// Cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    pub(crate) tx: Sender<Command>,
    pub(crate) info: Arc<EngineInfo>,
    pub(crate) metrics: Arc<Mutex<MetricsSnapshot>>,
    pub(crate) limits: Arc<Limits>,
}

pub(crate) struct Limits {
    pub max_waiting: usize,
    pub waiting: std::sync::atomic::AtomicUsize,
}

impl EngineHandle {
    /// Queues a request. Its events arrive on the returned stream.
    pub fn submit(&self, req: EngineRequest) -> Result<RequestStream, SubmitError> {
        self.submit_constrained(req, None)
    }

    /// Queues a request whose output follows `constraint` (structured output).
    pub fn submit_constrained(
        &self,
        req: EngineRequest,
        constraint: Option<OutputConstraint>,
    ) -> Result<RequestStream, SubmitError> {
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if req.prompt.len() >= self.info.max_model_len {
            return Err(SubmitError::PromptTooLong {
                prompt: req.prompt.len(),
                max_model_len: self.info.max_model_len,
            });
        }
        if let Some(&bad) = req
            .prompt
            .iter()
            .find(|&&t| t as usize >= self.info.valid_vocab)
        {
            return Err(SubmitError::Invalid(format!(
                "token id {bad} is outside the vocabulary of {} tokens",
                self.info.valid_vocab
            )));
        }
        let waiting = self
            .limits
            .waiting
            .load(std::sync::atomic::Ordering::Relaxed);
        if waiting >= self.limits.max_waiting {
            return Err(SubmitError::Overloaded(waiting));
        }
        let (etx, erx) = tokio::sync::mpsc::unbounded_channel();
        let id = req.id.clone();
        self.limits
            .waiting
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.tx
            .send(Command::Submit(
                Box::new(req),
                etx,
                constraint.map(Box::new),
            ))
            .map_err(|_| SubmitError::ShuttingDown)?;
        Ok(RequestStream {
            id,
            rx: erx,
            tx: self.tx.clone(),
            finished: false,
        })
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    pub fn metrics(&self) -> MetricsSnapshot {
        self.metrics.lock().unwrap().clone()
    }

    /// Stops the engine: queued and running requests finish with `Abort`.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }
}

/// One request's events. Dropping it before `Finished` aborts the request.
pub struct RequestStream {
    id: String,
    rx: UnboundedReceiver<EngineEvent>,
    tx: Sender<Command>,
    finished: bool,
}

impl RequestStream {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The next event; `None` after `Finished` (or if the engine is gone).
    pub async fn recv(&mut self) -> Option<EngineEvent> {
        if self.finished {
            return None;
        }
        let ev = self.rx.recv().await;
        if matches!(ev, Some(EngineEvent::Finished { .. }) | None) {
            self.finished = true;
        }
        ev
    }

    /// Blocking variant for non-async callers.
    pub fn blocking_recv(&mut self) -> Option<EngineEvent> {
        if self.finished {
            return None;
        }
        let ev = self.rx.blocking_recv();
        if matches!(ev, Some(EngineEvent::Finished { .. }) | None) {
            self.finished = true;
        }
        ev
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.tx.send(Command::Abort(self.id.clone()));
        }
    }
}
