//! [`EngineHandle`]: the thread-safe front door of the engine loop, where requests are admitted (their
//! lengths checked against the context, once: [`EngineInfo::token_budget`]), and [`RequestStream`], one
//! request's event channel (dropping it aborts the request).

use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc::UnboundedReceiver;

use crate::api::{
    EngineEvent, EngineRequest, MetricsSnapshot, OutputConstraint, StopParams, SubmitError,
};
use crate::images::ImageEncoder;

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

impl EngineInfo {
    /// The tokens a request with a prompt of `prompt` tokens and stop conditions `stop` may generate:
    /// its `max_tokens`, else the default capped by the room the prompt leaves, else that room. The
    /// prompt must leave room for one token, a requested `max_tokens` must fit in the room, and
    /// `min_tokens` must not exceed the `max_tokens` in force.
    pub fn token_budget(&self, prompt: usize, stop: &StopParams) -> Result<usize, SubmitError> {
        let max_model_len = self.max_model_len;
        if prompt >= max_model_len {
            return Err(SubmitError::PromptTooLong {
                prompt,
                max_model_len,
            });
        }
        let room = max_model_len - prompt;
        let max = match stop.max_tokens {
            Some(m) if m > room => {
                return Err(SubmitError::TooManyTokens {
                    prompt,
                    max_tokens: m,
                    max_model_len,
                })
            }
            Some(m) => Some(m),
            None => self.default_max_tokens.map(|d| d.min(room)),
        };
        if let Some(m) = max.filter(|&m| stop.min_tokens > m) {
            return Err(SubmitError::MinTokens {
                min_tokens: stop.min_tokens,
                max_tokens: m,
            });
        }
        Ok(max.unwrap_or(room))
    }
}

pub(crate) enum Command {
    /// An admitted request with the tokens it may generate.
    Submit(
        Box<EngineRequest>,
        usize,
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
    pub(crate) images: Option<Arc<ImageEncoder>>,
    /// The engine's thread, joined by the first [`EngineHandle::shutdown`].
    pub(crate) thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
}

pub(crate) struct Limits {
    pub max_waiting: usize,
    pub waiting: std::sync::atomic::AtomicUsize,
}

impl EngineHandle {
    /// Admits and queues a request (see [`EngineInfo::token_budget`] for its lengths). Its events arrive
    /// on the returned stream.
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
        let max_tokens = self.info.token_budget(req.prompt.len(), &req.stop)?;
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
                max_tokens,
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

    /// The engine takes prompts with images, prepared by `encoder` (a model with a vision tower).
    pub fn with_images(mut self, encoder: ImageEncoder) -> Self {
        self.images = Some(Arc::new(encoder));
        self
    }

    /// What prepares a prompt's images, when the model takes images.
    pub fn images(&self) -> Option<&Arc<ImageEncoder>> {
        self.images.as_ref()
    }

    pub fn metrics(&self) -> MetricsSnapshot {
        self.metrics.lock().unwrap().clone()
    }

    /// Stops the engine: queued and running requests finish with `Abort`; returns once its thread has
    /// ended and released the model (its device memory and contexts), so that a process may exit
    /// right after without tearing the device down under it.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread {
            if t.join().is_err() {
                tracing::error!("the engine thread panicked");
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn info(default_max_tokens: Option<usize>) -> EngineInfo {
        EngineInfo {
            model_name: "m".into(),
            max_model_len: 100,
            valid_vocab: 1000,
            default_max_tokens,
        }
    }

    fn stop(max_tokens: Option<usize>, min_tokens: usize) -> StopParams {
        StopParams {
            max_tokens,
            min_tokens,
            ..StopParams::default()
        }
    }

    #[test]
    fn the_token_budget_fits_the_context() {
        let i = info(Some(16));
        assert_eq!(i.token_budget(10, &stop(None, 0)), Ok(16));
        assert_eq!(i.token_budget(90, &stop(None, 0)), Ok(10));
        assert_eq!(i.token_budget(10, &stop(Some(90), 0)), Ok(90));
        assert_eq!(info(None).token_budget(10, &stop(None, 0)), Ok(90));
        let e = i.token_budget(10, &stop(Some(91), 0)).unwrap_err();
        assert_eq!(
            e,
            SubmitError::TooManyTokens {
                prompt: 10,
                max_tokens: 91,
                max_model_len: 100
            }
        );
        let msg = e.to_string();
        assert!(
            msg.contains("context length") && msg.contains("100") && msg.contains("101"),
            "{msg}"
        );
        for prompt in [100, 150] {
            let e = i.token_budget(prompt, &stop(None, 0)).unwrap_err();
            assert_eq!(
                e,
                SubmitError::PromptTooLong {
                    prompt,
                    max_model_len: 100
                }
            );
            assert!(
                e.to_string().contains("context length is 100 tokens"),
                "{e}"
            );
        }
        assert_eq!(
            i.token_budget(10, &stop(Some(4), 5)),
            Err(SubmitError::MinTokens {
                min_tokens: 5,
                max_tokens: 4
            })
        );
        // The default in force bounds min_tokens too; without one nothing does but the context.
        assert!(i.token_budget(10, &stop(None, 17)).is_err());
        assert_eq!(info(None).token_budget(10, &stop(None, 95)), Ok(90));
    }
}
