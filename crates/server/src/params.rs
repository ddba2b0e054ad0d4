//! Request fields → engine parameters: [`SamplingParams`] (validated once, here, by their own rules,
//! into the [`ValidatedParams`] a request carries), the [`StopParams`] and `n`. Lengths (the prompt and
//! `max_tokens` against the context) are the engine's admission to check (see
//! [`crate::error::SubmitFields`]).

use sanmai_engine::api::StopParams;
use sanmai_engine::sampler::{ParamError, SamplingParams, ValidatedParams};

use crate::error::ApiError;
use crate::request::CommonFields;

/// The most choices one request may ask for.
pub const MAX_N: usize = 128;

/// The sampling parameters of a request, validated; `logprobs` is the number of alternatives per token,
/// if asked, from the request field `logprobs_field` (which a count out of range names).
pub fn sampling(
    f: &CommonFields,
    logprobs: Option<usize>,
    logprobs_field: &str,
    vocab_size: usize,
) -> Result<ValidatedParams, ApiError> {
    let d = SamplingParams::default();
    let mut bias = Vec::new();
    if let Some(map) = &f.logit_bias {
        for (key, value) in map {
            let id: u32 = key.trim().parse().map_err(|_| {
                ApiError::invalid(
                    "logit_bias",
                    format!("logit_bias keys must be token ids, got {key:?}"),
                )
            })?;
            let v = value.as_f64().ok_or_else(|| {
                ApiError::invalid(
                    "logit_bias",
                    format!("the logit_bias of token {id} must be a number, got {value}"),
                )
            })?;
            // OpenAI documents the range -100..=100; vLLM clamps to it as well.
            bias.push((id, v.clamp(-100.0, 100.0) as f32));
        }
    }
    let params = SamplingParams {
        temperature: f.temperature.unwrap_or(d.temperature),
        top_p: f.top_p.unwrap_or(d.top_p),
        top_k: f.top_k.unwrap_or(d.top_k),
        min_p: f.min_p.unwrap_or(d.min_p),
        seed: f.seed.map(|s| s as u64),
        presence_penalty: f.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: f.frequency_penalty.unwrap_or(d.frequency_penalty),
        repetition_penalty: f.repetition_penalty.unwrap_or(d.repetition_penalty),
        logit_bias: bias,
        logprobs,
    };
    params.validated(vocab_size).map_err(|e| match e {
        ParamError::Logprobs(_) => ApiError::invalid(logprobs_field, e.to_string()),
        e => e.into(),
    })
}

/// `n`: how many choices (1 when absent).
pub fn choices(f: &CommonFields) -> Result<usize, ApiError> {
    match f.n {
        None => Ok(1),
        Some(n) if n >= 1 && n as usize <= MAX_N => Ok(n as usize),
        Some(n) => Err(ApiError::invalid(
            "n",
            format!("n must be between 1 and {MAX_N}, got {n}"),
        )),
    }
}

/// The sampling parameters of choice `i` of `n`: a given seed is offset so the choices differ.
pub fn for_choice(params: &ValidatedParams, i: usize) -> ValidatedParams {
    params.with_seed(params.seed.map(|s| s.wrapping_add(i as u64)))
}

/// A positive token count from an optional request field.
pub fn positive(field: &str, v: Option<i64>) -> Result<Option<usize>, ApiError> {
    match v {
        None => Ok(None),
        Some(n) if n >= 1 => Ok(Some(n as usize)),
        Some(n) => Err(ApiError::invalid(
            field,
            format!("{field} must be at least 1, got {n}"),
        )),
    }
}

/// The stop conditions of a request, without `max_tokens` (the caller sets the one requested, which the
/// engine checks against the context when it admits the request).
pub fn stop(f: &CommonFields, vocab_size: usize) -> Result<StopParams, ApiError> {
    let stop = f.stop.clone().map(|s| s.into_vec()).unwrap_or_default();
    if stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::invalid("stop", "stop strings must not be empty"));
    }
    let stop_token_ids = f.stop_token_ids.clone().unwrap_or_default();
    if let Some(bad) = stop_token_ids.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(ApiError::invalid(
            "stop_token_ids",
            format!("stop token id {bad} is outside the vocabulary of {vocab_size} tokens"),
        ));
    }
    let min_tokens = match f.min_tokens {
        None => 0,
        Some(n) if n >= 0 => n as usize,
        Some(n) => {
            return Err(ApiError::invalid(
                "min_tokens",
                format!("min_tokens must be >= 0, got {n}"),
            ))
        }
    };
    Ok(StopParams {
        max_tokens: None,
        min_tokens,
        stop,
        stop_token_ids,
        ignore_eos: f.ignore_eos.unwrap_or(false),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::fields;
    use serde_json::json;

    #[test]
    fn sampling_fields_map_and_validate() {
        let f: CommonFields = fields(&json!({
            "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7,
            "presence_penalty": 0.1, "frequency_penalty": 0.2, "repetition_penalty": 1.1,
            "logit_bias": {"12": 5, "13": -500}
        }))
        .unwrap();
        let p = sampling(&f, Some(3), "top_logprobs", 1000).unwrap();
        assert_eq!(p.temperature, 0.5);
        assert_eq!(p.top_k, 40);
        assert_eq!(p.seed, Some(7));
        assert_eq!(p.logit_bias, vec![(12, 5.0), (13, -100.0)]);
        assert_eq!(p.logprobs, Some(3));
        assert_eq!(for_choice(&p, 2).seed, Some(9));

        for (body, field) in [
            (json!({"temperature": -1}), "temperature"),
            (json!({"top_p": 0}), "top_p"),
            (json!({"min_p": 2}), "min_p"),
            (json!({"logit_bias": {"x": 1}}), "logit_bias"),
            (json!({"logit_bias": {"5000": 1}}), "logit_bias"),
            (json!({"presence_penalty": 3}), "presence_penalty"),
        ] {
            let f: CommonFields = fields(&body).unwrap();
            let e = sampling(&f, None, "top_logprobs", 1000).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{body}");
        }
        let e = sampling(&CommonFields::default(), Some(21), "top_logprobs", 1000).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
        assert!(e.message.contains("20"), "{}", e.message);
        let e = sampling(&CommonFields::default(), Some(21), "logprobs", 1000).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logprobs"));
    }

    #[test]
    fn n_and_stops() {
        let f: CommonFields = fields(&json!({"n": 0})).unwrap();
        assert_eq!(choices(&f).unwrap_err().param.as_deref(), Some("n"));
        let f: CommonFields = fields(&json!({"n": 3, "stop": ["a", "b"], "stop_token_ids": [5], "min_tokens": 2, "ignore_eos": true})).unwrap();
        assert_eq!(choices(&f).unwrap(), 3);
        let s = stop(&f, 1000).unwrap();
        assert_eq!(s.stop, vec!["a", "b"]);
        assert_eq!(s.stop_token_ids, vec![5]);
        assert_eq!(s.min_tokens, 2);
        assert!(s.ignore_eos);
        let f: CommonFields = fields(&json!({"stop": [""]})).unwrap();
        assert_eq!(stop(&f, 1000).unwrap_err().param.as_deref(), Some("stop"));
        let f: CommonFields = fields(&json!({"stop_token_ids": [1000]})).unwrap();
        assert!(stop(&f, 1000).is_err());
    }

    #[test]
    fn token_counts_are_positive() {
        assert_eq!(positive("max_tokens", None).unwrap(), None);
        assert_eq!(positive("max_tokens", Some(3)).unwrap(), Some(3));
        assert!(positive("max_tokens", Some(0)).is_err());
    }
}
