//! The multimodal wrapper's image fields: the vision tower's `vision_config` (kept as JSON: the
//! vision crate parses it) and the ids of the tokens that stand for images in a prompt.

use serde_json::Value;

use crate::fields::Fields;
use crate::Result;

/// A checkpoint's vision tower and image tokens (`vision_config`, `image_token_id`,
/// `video_token_id`, `vision_start_token_id`, `vision_end_token_id` at the top level of the
/// wrapper's `config.json`). A missing token id takes transformers' `Qwen3_5MoeConfig` default
/// (Qwen3.5's ids).
#[derive(Debug, Clone, PartialEq)]
pub struct VisionSpec {
    /// The `vision_config` object as the checkpoint writes it.
    pub config: Value,
    /// The placeholder token whose rows take the tower's merged outputs (`<|image_pad|>`).
    pub image_token_id: u32,
    /// The placeholder of video frames (`<|video_pad|>`).
    pub video_token_id: u32,
    /// `<|vision_start|>`, before an image's placeholders.
    pub vision_start_token_id: u32,
    /// `<|vision_end|>`, after them.
    pub vision_end_token_id: u32,
}

/// transformers' defaults: Qwen3.5's `<|image_pad|>`, `<|video_pad|>`, `<|vision_start|>`,
/// `<|vision_end|>`.
const IMAGE: u32 = 248_056;
const VIDEO: u32 = 248_057;
const START: u32 = 248_053;
const END: u32 = 248_054;

/// The vision spec of the top-level object `top`, when it carries a `vision_config` object.
pub(crate) fn parse(top: &Fields) -> Result<Option<VisionSpec>> {
    let config = match top.get("vision_config") {
        None | Some(Value::Null) => return Ok(None),
        Some(v @ Value::Object(_)) => v.clone(),
        Some(v) => {
            return Err(top.invalid(
                "vision_config",
                format!("expected a JSON object, found {v}"),
            ))
        }
    };
    let id = |name: &str, default: u32| -> Result<u32> {
        match top.opt_usize(name)? {
            None => Ok(default),
            Some(x) => {
                u32::try_from(x).map_err(|_| top.invalid(name, format!("{x} is not a token id")))
            }
        }
    };
    Ok(Some(VisionSpec {
        config,
        image_token_id: id("image_token_id", IMAGE)?,
        video_token_id: id("video_token_id", VIDEO)?,
        vision_start_token_id: id("vision_start_token_id", START)?,
        vision_end_token_id: id("vision_end_token_id", END)?,
    }))
}
