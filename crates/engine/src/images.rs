//! Images in a prompt, for the engine: [`ImageEncoder`] turns image files into the vision tower's
//! merged tokens and places a prompt's tokens ([`PromptImages`]); the engine then gives each chunk
//! of such a prompt its explicit MRoPE positions and the embeddings of its image rows
//! ([`ChunkImages`]), and keys the prefix cache of image rows by the image's pixels
//! (`cache_tokens`).
//!
//! A prompt shows an image as one placeholder token (`image_token_id`) where the chat template
//! put it; [`ImageEncoder::encode`] expands it to the image's `t·h·w / merge²` placeholders, as
//! transformers' processor does, so usage counts them as prompt tokens.

use std::borrow::Cow;
use std::hash::{Hash, Hasher};

use sanmai_model::vision::{
    Grid, ImageError, Patches, PreprocessorConfig, PromptPositions, Tower, Vision,
};

/// A multimodal model's vision tower with how its images are prepared.
pub struct ImageEncoder {
    vision: Vision,
    /// Runs the tower in place of `vision`'s CPU forward (a device's copy of its weights).
    tower: Option<Box<dyn Tower>>,
    preprocessor: PreprocessorConfig,
    /// Images one prompt may hold (`--limit-mm-per-prompt`).
    pub max_images: usize,
}

/// One prepared image and a hash of its pixels (what the prefix cache keys its rows by).
#[derive(Debug, Clone)]
pub struct PreparedImage {
    pub patches: Patches,
    pub hash: u64,
}

impl ImageEncoder {
    pub fn new(vision: Vision, preprocessor: PreprocessorConfig, max_images: usize) -> Self {
        ImageEncoder {
            vision,
            tower: None,
            preprocessor,
            max_images,
        }
    }

    /// Runs the tower with `tower` (the same weights on a device) instead of on the CPU.
    pub fn with_tower(mut self, tower: Box<dyn Tower>) -> Self {
        self.tower = Some(tower);
        self
    }

    /// Whether the tower runs on a device with its blocks in pinned host memory.
    pub fn blocks_on_host(&self) -> bool {
        self.tower.as_ref().is_some_and(|t| t.blocks_on_host())
    }

    /// The tower's CPU reference (its config and weights).
    pub fn vision(&self) -> &Vision {
        &self.vision
    }

    pub fn preprocessor(&self) -> &PreprocessorConfig {
        &self.preprocessor
    }

    /// The token the chat template writes for an image (`<|image_pad|>`).
    pub fn image_token(&self) -> u32 {
        self.vision.image_token_id
    }

    /// An image file's bytes decoded, resized and cut into patches; its hash covers the patches
    /// (the pixels the model sees) and the grid.
    pub fn prepare(&self, bytes: &[u8]) -> Result<PreparedImage, ImageError> {
        let patches = sanmai_model::vision::preprocess(bytes, &self.preprocessor)?;
        let mut h = std::collections::hash_map::DefaultHasher::new();
        patches.grid_thw.hash(&mut h);
        for x in &patches.pixel_values {
            x.to_bits().hash(&mut h);
        }
        let hash = h.finish();
        Ok(PreparedImage { patches, hash })
    }

    /// The placeholder tokens an image of `grid` takes in the prompt.
    pub fn tokens(&self, grid: Grid) -> usize {
        self.vision.tokens(grid)
    }

    /// Expands each image placeholder of `ids` (one per image, in order) to the image's tokens and
    /// runs the tower: the prompt's ids and its [`PromptImages`]. Also returns, for each original
    /// position, where it moved (`moved[i]`: the new index of `ids[i]`), so that positions in the
    /// unexpanded prompt can follow.
    pub fn encode(
        &self,
        ids: &[u32],
        images: &[PreparedImage],
    ) -> Result<(Vec<u32>, PromptImages, Vec<usize>), ImageError> {
        let image_token = self.image_token();
        let found = ids.iter().filter(|&&t| t == image_token).count();
        if found != images.len() {
            return Err(ImageError::Input(format!(
                "the rendered prompt holds {found} image placeholder tokens for {} images",
                images.len()
            )));
        }
        let grids: Vec<Grid> = images.iter().map(|i| i.patches.grid_thw).collect();
        let mut out = Vec::with_capacity(ids.len() + images.len());
        let mut moved = Vec::with_capacity(ids.len());
        let mut next = images.iter();
        for &t in ids {
            moved.push(out.len());
            if t == image_token {
                let img = next.next().expect("counted above");
                out.extend(std::iter::repeat_n(
                    image_token,
                    self.tokens(img.patches.grid_thw),
                ));
            } else {
                out.push(t);
            }
        }
        let positions = self.vision.positions(&out, &grids)?;
        let pixels: Vec<f32> = images
            .iter()
            .flat_map(|i| i.patches.pixel_values.iter().copied())
            .collect();
        let embeds = match &self.tower {
            Some(t) => t.forward(&pixels, &grids)?,
            None => self.vision.forward(&pixels, &grids)?,
        };
        let hidden = self.vision.config.out_hidden_size;
        let keys = positions
            .image_rows
            .iter()
            .zip(images.iter().flat_map(|i| {
                (0..self.tokens(i.patches.grid_thw)).map(move |j| row_key(i.hash, j))
            }))
            .map(|(&r, k)| (r, k))
            .collect();
        Ok((
            out,
            PromptImages {
                embeds,
                hidden,
                positions,
                keys,
            },
            moved,
        ))
    }
}

/// The prefix-cache key of an image's `j`-th token: its hash mixed with the index, so that another
/// image with as many tokens keys differently.
fn row_key(hash: u64, j: usize) -> u32 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (hash, j).hash(&mut h);
    h.finish() as u32
}

/// A prompt's images, ready for its steps.
#[derive(Clone)]
pub struct PromptImages {
    /// The merged tokens of every image, in prompt order: `[Σ tokens, hidden]`, row-major; row `i`
    /// is the input embedding of `positions.image_rows[i]`.
    pub embeds: Vec<f32>,
    pub hidden: usize,
    /// Every prompt token's `(t, h, w)`, the image rows and the offset of the positions after the
    /// prompt (`get_rope_index`).
    pub positions: PromptPositions,
    /// `(row, key)` of each image row: what the prefix cache hashes in place of the placeholder.
    keys: Vec<(usize, u32)>,
}

impl std::fmt::Debug for PromptImages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptImages")
            .field("image_tokens", &self.positions.image_rows.len())
            .field("delta", &self.positions.delta)
            .finish()
    }
}

/// What a chunk of a sequence with images adds to its tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkImages {
    /// `(t, h, w)` of each of the chunk's tokens.
    pub positions: Vec<[u32; 3]>,
    /// The chunk's rows (from 0) that are image tokens, and their embeddings `[rows, hidden]`.
    pub rows: Vec<usize>,
    pub embeds: Vec<f32>,
}

impl PromptImages {
    /// The chunk of `len` tokens at sequence positions `pos0 ..`: `None` when its positions are the
    /// sequence positions and it holds no image row (a plain step).
    pub fn chunk(&self, pos0: usize, len: usize) -> Option<ChunkImages> {
        let positions = self.positions.at(pos0, len);
        let (rows, first) = self.positions.image_rows_in(pos0, len, 0);
        let plain = positions
            .iter()
            .enumerate()
            .all(|(i, p)| p.iter().all(|&x| x as usize == pos0 + i));
        if plain && rows.is_empty() {
            return None;
        }
        let h = self.hidden;
        let embeds = self.embeds[first * h..(first + rows.len()) * h].to_vec();
        Some(ChunkImages {
            positions,
            rows,
            embeds,
        })
    }
}

/// What the prefix cache hashes of a sequence's `tokens`: the tokens, with each image row replaced
/// by its key (the image's hash and the row's index in it), so that the same image hits the cache
/// and another image behind the same placeholders does not. The caller reads positions from
/// `reads_from` on only: when every image row lies before it (a decode step past the prompt), the
/// tokens come back as they are, not copied.
pub(crate) fn cache_tokens<'a>(
    images: Option<&PromptImages>,
    tokens: &'a [u32],
    reads_from: usize,
) -> Cow<'a, [u32]> {
    let Some(images) = images.filter(|i| i.keys.last().is_some_and(|&(r, _)| r >= reads_from))
    else {
        return Cow::Borrowed(tokens);
    };
    let mut out = tokens.to_vec();
    for &(r, k) in &images.keys {
        if let Some(t) = out.get_mut(r) {
            *t = k;
        }
    }
    Cow::Owned(out)
}
