//! The router before a model is installed and around the handlers: 503 while loading, 404 for unknown
//! routes, 405, the API key, the body-size limit and the error shape, all without an engine.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use sanmai_server::{Server, ServerConfig};
use serde_json::Value;
use tower::ServiceExt;

async fn call(server: &Server, req: Request<Body>) -> (StatusCode, Value) {
    let resp = server.router().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{e}: {bytes:?}"))
    };
    (status, v)
}

fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

fn post(path: &str, body: &str, key: Option<&str>) -> Request<Body> {
    let mut r = Request::post(path).header("content-type", "application/json");
    if let Some(k) = key {
        r = r.header("authorization", format!("Bearer {k}"));
    }
    r.body(Body::from(body.to_string())).unwrap()
}

fn assert_error(v: &Value, kind: &str) {
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert_eq!(e["type"], kind, "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
}

#[tokio::test]
async fn loading_server_answers_503() {
    let server = Server::new(ServerConfig::new("m"));
    assert!(!server.is_ready());
    let (status, v) = call(&server, get("/health")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_error(&v, "service_unavailable_error");
    assert!(v["error"]["message"].as_str().unwrap().contains("loading"));
    for path in ["/v1/models", "/metrics"] {
        let (status, _) = call(&server, get(path)).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{path}");
    }
    let body = r#"{"messages": [{"role": "user", "content": "hi"}]}"#;
    for path in ["/v1/chat/completions", "/v1/completions", "/tokenize"] {
        let (status, v) = call(&server, post(path, body, None)).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{path}");
        assert_error(&v, "service_unavailable_error");
    }
    let (status, v) = call(&server, get("/version")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(v["version"].is_string());
}

#[tokio::test]
async fn unknown_routes_methods_keys_and_sizes() {
    let mut cfg = ServerConfig::new("m");
    cfg.api_key = Some("k".into());
    cfg.max_request_bytes = 100;
    let server = Server::new(cfg);
    let (status, v) = call(&server, get("/nope")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_error(&v, "not_found_error");
    let (status, v) = call(&server, get("/v1/chat/completions")).await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "the key is checked first: {v}"
    );
    let (status, v) = call(&server, post("/v1/completions", "{}", None)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_error(&v, "authentication_error");
    assert_eq!(v["error"]["code"], "invalid_api_key");
    let (status, _) = call(&server, post("/v1/completions", "{}", Some("wrong"))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let big = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(200));
    let (status, v) = call(&server, post("/v1/completions", &big, Some("k"))).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_error(&v, "invalid_request_error");
    let (status, v) = call(&server, post("/v1/completions", "{not json", Some("k"))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(v["error"]["message"].as_str().unwrap().contains("JSON"));
    let req = Request::get("/v1/chat/completions")
        .header("authorization", "Bearer k")
        .body(Body::empty())
        .unwrap();
    let (status, v) = call(&server, req).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_error(&v, "invalid_request_error");
    // Probes need no key.
    let (status, _) = call(&server, get("/health")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
}
