//! What turns an OpenAI chat request into tokens and multimodal info: the model's tokenizer
//! (HF `tokenizers`), its chat template (`minijinja`) and its images. Shared by the front door
//! and the simulated engine, so both see identical tokens and identical block hashes.
//!
//! ```text
//!  messages ──chat template──▶ text with one <|image_pad|> per image ──tokenizer──▶ tokens
//!  image parts ──load (data: or fetched), decode──▶ identifier, mm_hash, N placeholder tokens
//!  tokens: each lone <|image_pad|> expanded to N pads ──▶ Prepared { tokens, mm offsets }
//! ```
//!
//! A model directory holds `tokenizer.json` and usually `tokenizer_config.json`, whose keys are
//! read as Hugging Face writes them: `chat_template` (or a `chat_template.jinja` file beside
//! it), `eos_token`, `model_max_length`, and kvroute's own `model_name`, `image_token` and
//! image geometry. A model whose vocabulary has no image token (`<|image_pad|>` unless
//! `image_token` names another) is text-only: requests with images are refused. Without a chat
//! template, [`DEFAULT_CHAT_TEMPLATE`] applies.
//!
//! kvroute's own small model, `models/kvroute-tiny` (built by `scripts/build-model`), is
//! compiled into the binary: [`Preprocessor::builtin`], the default wherever no directory is
//! given, so an installed binary needs no files.

#[cfg(feature = "fetch")]
pub mod chat_request;
#[cfg(feature = "fetch")]
mod decoding;
mod detokenize;
mod error;
mod fast_bpe;
#[cfg(feature = "fetch")]
pub mod fetch;
pub mod images;
pub mod prefix_cache;
mod preprocessor;
mod words;

pub use kvroute_http::openai::{
    ChatMessage, CompletionPrompt, CompletionRequest, ContentPart, ImageUrl, MessageContent,
    image_urls,
};

pub use detokenize::DecodeWindow;
pub use error::{ImageError, PreprocessError, TooLong};
pub use images::{Image, ImageConfig};
pub use preprocessor::{
    BUILTIN_MODEL, DEFAULT_CHAT_TEMPLATE, OFF_RUNTIME_BYTES, Prepared, Preprocessor,
};
pub use words::Words;

#[cfg(test)]
mod tests;
