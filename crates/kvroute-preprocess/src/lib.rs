//! What turns an OpenAI chat request into tokens and multimodal info: the model's tokenizer
//! (HF `tokenizers`), its chat template (`minijinja`) and its images. Shared by the front door
//! and the simulated engine, so both see identical tokens and identical block hashes.
//!
//! ```text
//!  messages ──chat template──▶ text with one <|image_pad|> per image ──tokenizer──▶ tokens
//!  image parts ──decode──▶ identifier, mm_hash, N placeholder tokens
//!  tokens: each lone <|image_pad|> expanded to N pads ──▶ Prepared { tokens, mm offsets }
//! ```
//!
//! The model directory holds `tokenizer.json` and `tokenizer_config.json` (with
//! `chat_template` and the image tokens); `models/kvroute-tiny` in the repository is the
//! default, built by `scripts/build-model`. Images arrive as bytes, `data:` URLs, or `http://`
//! URLs fetched by [`fetch`] (feature `fetch`: async, with size, time and address limits).

#[cfg(feature = "fetch")]
pub mod fetch;
pub mod images;

use std::path::Path;

use kvroute_core::{RequestExtraInfo, RequestMmObjectInfo};
use minijinja::Environment;
use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;

pub use images::{Image, ImageConfig};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PreprocessError {
    #[error("model directory {path}: {message}")]
    Model { path: String, message: String },
    #[error("chat template: {0}")]
    Template(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("image: {0}")]
    Image(String),
    #[error("image larger than {limit} bytes")]
    ImageTooLarge { limit: usize },
    #[error("the request names {parts} images but {given} were given")]
    ImageCount { parts: usize, given: usize },
}

/// An OpenAI chat message (text, or parts of text and images).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<MessageContent>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    Text { text: String },
    ImageUrl { image_url: ImageUrl },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ImageUrl {
    pub url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// A caller-chosen id of the image (vLLM's multimodal UUID); the front door sets it to the
    /// image's identifier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
}

/// A `/v1/completions` prompt: text, or token ids given directly.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum CompletionPrompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// The image URLs of `messages`, in the order their placeholders appear.
pub fn image_urls(messages: &[ChatMessage]) -> Vec<&str> {
    messages
        .iter()
        .filter_map(|m| match &m.content {
            Some(MessageContent::Parts(parts)) => Some(parts),
            _ => None,
        })
        .flatten()
        .filter_map(|p| match p {
            ContentPart::ImageUrl { image_url } => Some(image_url.url.as_str()),
            ContentPart::Text { .. } => None,
        })
        .collect()
}

/// A request ready for hashing and for an engine.
#[derive(Clone, Debug, PartialEq)]
pub struct Prepared {
    pub tokens: Vec<u32>,
    /// Where each image's placeholder tokens are, request-level (SPEC section 4).
    pub mm: RequestExtraInfo,
    pub images: Vec<Image>,
}

#[derive(Debug, Deserialize)]
struct ModelConfig {
    #[serde(default)]
    model_name: Option<String>,
    chat_template: String,
    #[serde(default)]
    eos_token: Option<String>,
    #[serde(default = "default_image_token")]
    image_token: String,
    #[serde(default)]
    image_patch_size: Option<u32>,
    #[serde(default)]
    image_min_pixels: Option<u64>,
    #[serde(default)]
    image_max_pixels: Option<u64>,
}

fn default_image_token() -> String {
    "<|image_pad|>".to_owned()
}

/// A loaded model directory.
#[derive(Debug)]
pub struct Preprocessor {
    tokenizer: Tokenizer,
    templates: Environment<'static>,
    model_name: String,
    image_token_id: u32,
    eos_token_id: Option<u32>,
    image_config: ImageConfig,
}

impl Preprocessor {
    /// Loads `tokenizer.json` and `tokenizer_config.json` from `dir`.
    pub fn load(dir: &Path) -> Result<Self, PreprocessError> {
        let model_err =
            |message: String| PreprocessError::Model { path: dir.display().to_string(), message };
        let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| model_err(format!("tokenizer.json: {e}")))?;
        let config_text = std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .map_err(|e| model_err(format!("tokenizer_config.json: {e}")))?;
        let config: ModelConfig = serde_json::from_str(&config_text)
            .map_err(|e| model_err(format!("tokenizer_config.json: {e}")))?;
        let image_token_id = tokenizer.token_to_id(&config.image_token).ok_or_else(|| {
            model_err(format!("the vocabulary has no image token {:?}", config.image_token))
        })?;
        let eos_token_id = config.eos_token.as_deref().and_then(|t| tokenizer.token_to_id(t));
        let mut templates = Environment::new();
        templates
            .add_template_owned("chat", config.chat_template)
            .map_err(|e| PreprocessError::Template(e.to_string()))?;
        let defaults = ImageConfig::default();
        let image_config = ImageConfig {
            patch: config.image_patch_size.unwrap_or(defaults.patch),
            min_pixels: config.image_min_pixels.unwrap_or(defaults.min_pixels),
            max_pixels: config.image_max_pixels.unwrap_or(defaults.max_pixels),
            ..defaults
        };
        let model_name = config.model_name.unwrap_or_else(|| {
            dir.file_name().map_or_else(|| "model".to_owned(), |n| n.to_string_lossy().into_owned())
        });
        Ok(Self { tokenizer, templates, model_name, image_token_id, eos_token_id, image_config })
    }

    /// The model directory shipped in the repository (`models/kvroute-tiny`).
    pub fn default_model_dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/kvroute-tiny")
    }

    pub fn model_name(&self) -> &str {
        &self.model_name
    }

    /// The token every image position carries (what engines' events are normalised to).
    pub fn image_token_id(&self) -> u32 {
        self.image_token_id
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    pub fn image_config(&self) -> &ImageConfig {
        &self.image_config
    }

    /// The chat template applied to `messages`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, PreprocessError> {
        let template = self
            .templates
            .get_template("chat")
            .map_err(|e| PreprocessError::Template(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => minijinja::Value::from_serialize(messages),
                add_generation_prompt => add_generation_prompt,
            })
            .map_err(|e| PreprocessError::Template(e.to_string()))
    }

    /// Tokens of `text`, special tokens recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, PreprocessError> {
        let encoding = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| PreprocessError::Tokenizer(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `tokens` (special tokens skipped).
    pub fn decode(&self, tokens: &[u32]) -> Result<String, PreprocessError> {
        self.tokenizer.decode(tokens, true).map_err(|e| PreprocessError::Tokenizer(e.to_string()))
    }

    /// A chat request's tokens, with each image's placeholder expanded; `images` are the
    /// request's images in order (see [`image_urls`]), already decoded.
    pub fn prepare_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        images: Vec<Image>,
    ) -> Result<Prepared, PreprocessError> {
        let text = self.render(messages, add_generation_prompt)?;
        self.expand(self.encode(&text)?, images)
    }

    /// A plain prompt (`/v1/completions`): tokens only.
    pub fn prepare_prompt(&self, prompt: &str) -> Result<Prepared, PreprocessError> {
        self.expand(self.encode(prompt)?, Vec::new())
    }

    /// A `/v1/completions` prompt: text is tokenized, token ids are taken as they are.
    pub fn prepare_completion(
        &self,
        prompt: CompletionPrompt,
    ) -> Result<Prepared, PreprocessError> {
        match prompt {
            CompletionPrompt::Text(text) => self.prepare_prompt(&text),
            CompletionPrompt::Tokens(tokens) => {
                Ok(Prepared { tokens, mm: RequestExtraInfo::default(), images: Vec::new() })
            }
        }
    }

    /// Replaces the i-th image token with `images[i].tokens` copies and records where.
    fn expand(&self, tokens: Vec<u32>, images: Vec<Image>) -> Result<Prepared, PreprocessError> {
        let pads = tokens.iter().filter(|&&t| t == self.image_token_id).count();
        if pads != images.len() {
            return Err(PreprocessError::ImageCount { parts: pads, given: images.len() });
        }
        let extra: usize = images.iter().map(|i| i.tokens.saturating_sub(1)).sum();
        let mut out = Vec::with_capacity(tokens.len() + extra);
        let mut objects = Vec::with_capacity(images.len());
        let mut next = images.iter();
        for t in tokens {
            if t != self.image_token_id {
                out.push(t);
                continue;
            }
            let image = next.next().unwrap_or_else(|| unreachable!("counted above"));
            let start = out.len();
            out.extend(std::iter::repeat_n(self.image_token_id, image.tokens));
            objects.push(RequestMmObjectInfo {
                mm_hash: image.mm_hash,
                offsets: vec![(start, out.len())],
            });
        }
        Ok(Prepared { tokens: out, mm: RequestExtraInfo { mm_objects: objects }, images })
    }
}

#[cfg(test)]
mod tests;
