//! Running one API request as engine requests: submitting all choices at once, merging their event
//! streams, and the server-sent-events body a producer task writes into (the task stops, and the engine
//! requests are aborted, as soon as the client goes away; a panic in it ends the stream with an error).

use std::convert::Infallible;
use std::future::Future;
use std::panic::AssertUnwindSafe;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, select_all, BoxStream, StreamExt};
use futures_util::FutureExt;
use sanmai_engine::api::{EngineEvent, EngineRequest};
use sanmai_engine::{EngineHandle, RequestStream};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::error::{ApiError, SubmitFields};
use crate::structured::Prepared;

/// Submits every request, each with its own matcher of `grammar` if one is given; if one is refused
/// (the engine's admission: a refusal names the request field of `fields` at fault), the ones already
/// queued are aborted.
pub fn submit_all(
    engine: &EngineHandle,
    requests: Vec<EngineRequest>,
    grammar: Option<&Prepared>,
    fields: SubmitFields,
) -> Result<Vec<RequestStream>, ApiError> {
    let mut streams = Vec::with_capacity(requests.len());
    for req in requests {
        // On error `streams` is dropped here, which aborts what was queued.
        let stream = engine
            .submit_constrained(req, grammar.map(Prepared::for_choice))
            .map_err(|e| ApiError::submit(e, fields))?;
        streams.push(stream);
    }
    Ok(streams)
}

/// The events of several requests as one stream of `(choice index, event)`. Each request's events keep
/// their order; a request whose engine went away without `Finished` just ends. Dropping the merged
/// stream aborts every request that has not finished.
pub fn merge(streams: Vec<RequestStream>) -> BoxStream<'static, (usize, EngineEvent)> {
    let per_choice = streams.into_iter().enumerate().map(|(i, s)| {
        stream::unfold(s, move |mut s| async move {
            s.recv().await.map(|ev| ((i, ev), s))
        })
        .boxed()
    });
    select_all(per_choice).boxed()
}

/// The sending side of a server-sent-events response.
#[derive(Clone)]
pub struct SseSender {
    tx: mpsc::Sender<Event>,
}

impl SseSender {
    /// Sends one `data:` event holding `value`; false once the client is gone.
    pub async fn json(&self, value: &Value) -> bool {
        self.tx
            .send(Event::default().data(value.to_string()))
            .await
            .is_ok()
    }

    /// Sends the closing `data: [DONE]`.
    pub async fn done(&self) -> bool {
        self.tx.send(Event::default().data("[DONE]")).await.is_ok()
    }

    /// Resolves when the client has gone away (the response body was dropped).
    pub async fn closed(&self) {
        self.tx.closed().await
    }
}

/// Events buffered between the producer task and the connection.
const SSE_BUFFER: usize = 64;

/// A `text/event-stream` response written by `producer`, which runs as its own task. If the producer
/// panics, the client gets an error event and `[DONE]`; the other requests are unaffected.
pub fn sse_response<F, Fut>(producer: F) -> Response
where
    F: FnOnce(SseSender) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (tx, mut rx) = mpsc::channel::<Event>(SSE_BUFFER);
    let sender = SseSender { tx };
    let fut = producer(sender.clone());
    tokio::spawn(async move {
        if AssertUnwindSafe(fut).catch_unwind().await.is_err() {
            tracing::error!("a streaming response panicked");
            let err = ApiError::internal("internal error while streaming the response");
            if sender.json(&err.body()).await {
                sender.done().await;
            }
        }
    });
    let body = stream::poll_fn(move |cx| rx.poll_recv(cx)).map(Ok::<_, Infallible>);
    Sse::new(body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use serde_json::json;

    async fn body_of(resp: Response) -> String {
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn events_arrive_in_order_then_done() {
        let resp = sse_response(|sse| async move {
            assert!(sse.json(&json!({"n": 1})).await);
            assert!(sse.json(&json!({"n": 2})).await);
            sse.done().await;
        });
        let ct = resp.headers()["content-type"].to_str().unwrap().to_string();
        assert!(ct.starts_with("text/event-stream"));
        assert_eq!(
            body_of(resp).await,
            "data: {\"n\":1}\n\ndata: {\"n\":2}\n\ndata: [DONE]\n\n"
        );
    }

    #[tokio::test]
    async fn a_panicking_producer_ends_the_stream_with_an_error() {
        let resp = sse_response(|sse| async move {
            sse.json(&json!({"n": 1})).await;
            panic!("producer bug");
        });
        let text = body_of(resp).await;
        assert!(text.starts_with("data: {\"n\":1}\n\n"), "{text}");
        assert!(text.contains("\"type\":\"internal_error\""), "{text}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    }

    #[tokio::test]
    async fn the_producer_learns_when_the_client_leaves() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let resp = sse_response(|sse| async move {
            sse.closed().await;
            let _ = tx.send(sse.json(&json!({"late": true})).await);
        });
        drop(resp);
        assert!(
            !rx.await.unwrap(),
            "sending after the client left must fail"
        );
    }
}
