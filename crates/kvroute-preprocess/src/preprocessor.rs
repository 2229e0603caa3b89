//! [`Preprocessor`]: a model's tokenizer, chat template and image geometry, and a chat or
//! completion request made into tokens and multimodal info ([`Prepared`]).

use kvroute_core::{RequestExtraInfo, RequestMmObjectInfo};
use kvroute_http::ApiError;
use kvroute_http::openai::{
    ChatMessage, CompletionPrompt, CompletionRequest, ContentPart, ImageUrl, MessageContent,
    check_lengths, image_urls,
};
use std::path::{Path, PathBuf};

use crate::error::{PreprocessError, TooLong};
use crate::images::{self, Image, ImageConfig};
use crate::words::Words;
use crate::{fast_bpe, prefix_cache};
use minijinja::Environment;
use serde::Deserialize;
use tokenizers::Tokenizer;

/// Text of at least this many bytes (about a thousand tokens, a millisecond or more of
/// tokenizing) is tokenized off the async runtime's worker thread.
pub const OFF_RUNTIME_BYTES: usize = 4096;

/// Runs `f`, a CPU-bound step over `bytes` of input: a large one, on a multi-threaded tokio
/// runtime, in `block_in_place`, so the runtime hands this thread's other tasks (streams,
/// engine clocks, `/health`) to another worker meanwhile instead of stalling them for
/// milliseconds. Anywhere else it just runs.
fn off_runtime<T>(bytes: usize, f: impl FnOnce() -> T) -> T {
    #[cfg(feature = "fetch")]
    if bytes >= OFF_RUNTIME_BYTES
        && tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
    {
        return tokio::task::block_in_place(f);
    }
    #[cfg(not(feature = "fetch"))]
    let _ = bytes;
    f()
}

/// The name of the built-in model ([`Preprocessor::builtin`]).
pub const BUILTIN_MODEL: &str = "kvroute-tiny";
const BUILTIN_TOKENIZER: &[u8] = include_bytes!("../../../models/kvroute-tiny/tokenizer.json");
const BUILTIN_CONFIG: &str = include_str!("../../../models/kvroute-tiny/tokenizer_config.json");

/// The chat template of a model directory that has none: each message as its role and a colon
/// on one line and its text on the next (text parts joined; images not supported by such a
/// model), then `assistant:` on a line of its own when a generation prompt is asked for, so an
/// answer sent back renders as the generation prompt followed by the answer.
pub const DEFAULT_CHAT_TEMPLATE: &str = r#"{%- for message in messages -%}
{{ message['role'] }}:
{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}
{% endfor -%}
{%- if add_generation_prompt %}assistant:
{% endif -%}"#;

/// A request ready for hashing and for an engine.
#[derive(Clone, Debug, PartialEq)]
pub struct Prepared {
    pub tokens: Vec<u32>,
    /// Where each image's placeholder tokens are, request-level (docs/architecture.md, "Invariants").
    pub mm: RequestExtraInfo,
    pub images: Vec<Image>,
}

/// `tokenizer_config.json`, the keys kvroute reads.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ModelConfig {
    model_name: Option<String>,
    chat_template: Option<ChatTemplate>,
    eos_token: Option<TokenName>,
    model_max_length: Option<f64>,
    image_token: Option<String>,
    image_patch_size: Option<u32>,
    image_min_pixels: Option<u64>,
    image_max_pixels: Option<u64>,
}

/// Hugging Face writes a template as a string, or as a list of named ones.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ChatTemplate {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Debug, Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

/// A special token as a string, or as an added-token object with `content`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TokenName {
    Plain(String),
    Added { content: String },
}

impl TokenName {
    fn as_str(&self) -> &str {
        match self {
            Self::Plain(s) | Self::Added { content: s } => s,
        }
    }
}

/// The image token of models that do not name one.
const DEFAULT_IMAGE_TOKEN: &str = "<|image_pad|>";

/// A loaded model: tokenizer, chat template, image handling.
#[derive(Debug)]
pub struct Preprocessor {
    pub(crate) tokenizer: Tokenizer,
    pub(crate) templates: Environment<'static>,
    pub(crate) model_name: String,
    pub(crate) image_token_id: Option<u32>,
    pub(crate) eos_token_id: Option<u32>,
    pub(crate) max_model_len: Option<u64>,
    pub(crate) image_config: ImageConfig,
    pub(crate) words: std::sync::OnceLock<std::sync::Arc<Words>>,
    /// The longest vocabulary entry, in bytes (found on first use).
    pub(crate) max_token_bytes: std::sync::OnceLock<usize>,
    /// The vocabulary's size with the added tokens (found on first use: the tokenizer counts
    /// it by building the whole vocabulary as a map).
    pub(crate) vocab_size: std::sync::OnceLock<usize>,
    /// Why a model whose vocabulary has an image token is text-only all the same.
    pub(crate) text_only: Option<String>,
    /// Ids of prompt beginnings seen before, for a tokenizer whose output composes
    /// ([`prefix_cache`]).
    pub(crate) prefix_cache: Option<prefix_cache::PrefixCache>,
    /// The tokenizer's ids without its bookkeeping, for the family [`fast_bpe`] covers.
    pub(crate) fast: Option<fast_bpe::FastBpe>,
}

impl Preprocessor {
    /// Loads the model at `dir`, or the built-in one when `None`.
    pub fn load_or_builtin(dir: Option<&Path>) -> Result<Self, PreprocessError> {
        match dir {
            Some(dir) => Self::load(dir),
            None => Ok(Self::builtin()),
        }
    }

    /// kvroute's small model, compiled in (`models/kvroute-tiny`).
    pub fn builtin() -> Self {
        let built = Tokenizer::from_bytes(BUILTIN_TOKENIZER).ok().and_then(|tokenizer| {
            let config = serde_json::from_str(BUILTIN_CONFIG).ok()?;
            Self::new(tokenizer, config, BUILTIN_MODEL, None).ok()
        });
        built.unwrap_or_else(|| unreachable!("the built-in model loads (tested)"))
    }

    /// Loads `tokenizer.json` and, when present, `tokenizer_config.json` and
    /// `chat_template.jinja` from `dir`.
    pub fn load(dir: &Path) -> Result<Self, PreprocessError> {
        let model_err =
            |message: String| PreprocessError::Model { path: dir.display().to_string(), message };
        let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| model_err(format!("tokenizer.json: {e}")))?;
        let config: ModelConfig = match std::fs::read_to_string(dir.join("tokenizer_config.json")) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| model_err(format!("tokenizer_config.json: {e}")))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => ModelConfig::default(),
            Err(e) => return Err(model_err(format!("tokenizer_config.json: {e}"))),
        };
        let template_file = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(model_err(format!("chat_template.jinja: {e}"))),
        };
        let name = dir
            .file_name()
            .map_or_else(|| "model".to_owned(), |n| n.to_string_lossy().into_owned());
        Self::new(tokenizer, config, &name, template_file).map_err(|e| match e {
            PreprocessError::Model { message, .. } => model_err(message),
            other => other,
        })
    }

    fn new(
        tokenizer: Tokenizer,
        config: ModelConfig,
        default_name: &str,
        template_file: Option<String>,
    ) -> Result<Self, PreprocessError> {
        let model_err =
            |message: String| PreprocessError::Model { path: default_name.to_owned(), message };
        let image_token_id = match &config.image_token {
            // Named explicitly: it must exist.
            Some(token) => Some(tokenizer.token_to_id(token).ok_or_else(|| {
                model_err(format!("the vocabulary has no image token {token:?}"))
            })?),
            None => tokenizer.token_to_id(DEFAULT_IMAGE_TOKEN),
        };
        let eos_token_id =
            config.eos_token.as_ref().and_then(|t| tokenizer.token_to_id(t.as_str()));
        let template = match (template_file, config.chat_template) {
            (Some(file), _) => file,
            (None, Some(ChatTemplate::One(t))) => t,
            (None, Some(ChatTemplate::Named(list))) => {
                let mut list = list;
                let at = list.iter().position(|t| t.name == "default").unwrap_or(0);
                if list.is_empty() {
                    DEFAULT_CHAT_TEMPLATE.to_owned()
                } else {
                    list.swap_remove(at).template
                }
            }
            (None, None) => DEFAULT_CHAT_TEMPLATE.to_owned(),
        };
        let mut templates = Environment::new();
        templates.add_template_owned("chat", template).map_err(PreprocessError::Template)?;
        let defaults = ImageConfig::default();
        let image_config = ImageConfig {
            patch: config.image_patch_size.unwrap_or(defaults.patch),
            min_pixels: config.image_min_pixels.unwrap_or(defaults.min_pixels),
            max_pixels: config.image_max_pixels.unwrap_or(defaults.max_pixels),
            ..defaults
        };
        // Hugging Face writes 1e30 for "no limit".
        let max_model_len = config
            .model_max_length
            .filter(|&n| n >= 1.0 && n < (1u64 << 40) as f64)
            .map(|n| n as u64);
        // The tokenizer's serialized form, which both faster paths judge it by (serialized once:
        // a large vocabulary takes a while).
        let json = serde_json::to_value(&tokenizer).ok();
        Ok(Self {
            templates,
            model_name: config.model_name.unwrap_or_else(|| default_name.to_owned()),
            image_token_id,
            eos_token_id,
            max_model_len,
            image_config,
            words: std::sync::OnceLock::new(),
            max_token_bytes: std::sync::OnceLock::new(),
            vocab_size: std::sync::OnceLock::new(),
            text_only: None,
            prefix_cache: json.as_ref().and_then(prefix_cache::PrefixCache::for_tokenizer),
            fast: json.as_ref().and_then(fast_bpe::FastBpe::for_tokenizer),
            tokenizer,
        }
        .with_images_checked())
    }

    /// The same model tokenizing every prompt in full, as an engine's own server does: the
    /// simulated engine keeps a real engine's tokenizing cost (the prefix cache is the front
    /// door's).
    pub fn without_prefix_cache(mut self) -> Self {
        self.prefix_cache = None;
        self
    }

    /// The same model always tokenizing through the tokenizer library (for comparisons).
    pub fn without_fast_path(mut self) -> Self {
        self.fast = None;
        self
    }

    /// The same model rendering chats with `template` (Jinja) instead of its own, as vLLM's
    /// `--chat-template` does; whether it takes images is judged again.
    pub fn with_chat_template(mut self, template: String) -> Result<Self, PreprocessError> {
        let mut templates = Environment::new();
        templates.add_template_owned("chat", template).map_err(PreprocessError::Template)?;
        self.templates = templates;
        self.text_only = None;
        Ok(self.with_images_checked())
    }

    /// A vocabulary with an image token makes a vision model only if its chat template puts
    /// a placeholder where a message has an image: one chat with a small picture is rendered
    /// to see. A template that prints content parts as text (or drops them) cannot take
    /// images: the model is text-only, and [`Preprocessor::text_only_reason`] says why.
    fn with_images_checked(mut self) -> Self {
        let Some(pad) = self.image_token_id else { return self };
        let picture = images::seeded_png(0, 56);
        let Ok(image) = images::decode(&picture, &self.image_config) else { return self };
        let part = ContentPart::ImageUrl {
            image_url: ImageUrl { url: images::png_data_url(&picture), detail: None, uuid: None },
        };
        let messages = [ChatMessage {
            role: "user".to_owned(),
            content: Some(MessageContent::Parts(vec![part])),
        }];
        if let Err(e) = self.prepare_chat(&messages, true, vec![image]) {
            let token = self.tokenizer.id_to_token(pad).unwrap_or_default();
            self.text_only = Some(format!(
                "its vocabulary has the image token {token:?} (id {pad}), but its chat template puts no image placeholder where a message has an image ({e}); it takes no images"
            ));
            self.image_token_id = None;
        }
        self
    }

    pub(crate) fn text_only_error(&self) -> PreprocessError {
        PreprocessError::TextOnly {
            model: self.model_name.clone(),
            why: self.text_only.as_ref().map_or_else(String::new, |w| format!(": {w}")),
        }
    }

    /// Why this model takes no images though its vocabulary has an image token (`None`: it
    /// takes images, or its vocabulary has none).
    pub fn text_only_reason(&self) -> Option<&str> {
        self.text_only.as_deref()
    }

    /// Where the repository keeps the built-in model's files (for tools that rebuild it).
    pub fn repository_model_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models").join(BUILTIN_MODEL)
    }

    pub fn model_name(&self) -> &str {
        &self.model_name
    }

    /// The token every image position carries (what engines' events are normalised to);
    /// `None` for a text-only model.
    pub fn image_token_id(&self) -> Option<u32> {
        self.image_token_id
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    /// The model's context length (`model_max_length`), when its directory says.
    pub fn max_model_len(&self) -> Option<u64> {
        self.max_model_len
    }

    /// The vocabulary's words (tokens whose text tokenizes back to them), found on first use.
    pub fn words(&self) -> &std::sync::Arc<Words> {
        self.words.get_or_init(|| std::sync::Arc::new(Words::scan(&self.tokenizer)))
    }

    pub fn vocab_size(&self) -> usize {
        *self.vocab_size.get_or_init(|| self.tokenizer.get_vocab_size(true))
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
        let template = self.templates.get_template("chat").map_err(PreprocessError::Template)?;
        template
            .render(minijinja::context! {
                messages => minijinja::Value::from_serialize(messages),
                add_generation_prompt => add_generation_prompt,
            })
            .map_err(PreprocessError::Template)
    }

    /// Tokens of `text`, special tokens recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, PreprocessError> {
        let plain = |text: &str| match self.fast.as_ref().and_then(|fast| fast.encode(text)) {
            Some(ids) => Ok(ids),
            None => self.tokenizer.encode(text, false).map(|e| e.get_ids().to_vec()),
        };
        off_runtime(text.len(), || match &self.prefix_cache {
            Some(cache) if text.len() > 2 * prefix_cache::CHECKPOINT_BYTES => {
                cache.encode_with(text, &plain)
            }
            _ => plain(text),
        })
        .map_err(PreprocessError::Tokenizer)
    }

    /// Text of `tokens` (special tokens skipped).
    pub fn decode(&self, tokens: &[u32]) -> Result<String, PreprocessError> {
        self.tokenizer.decode(tokens, true).map_err(PreprocessError::Tokenizer)
    }

    /// Each token's vocabulary entry (vLLM's `token_strs`).
    pub fn token_strings(&self, tokens: &[u32]) -> Vec<String> {
        tokens.iter().map(|&t| self.tokenizer.id_to_token(t).unwrap_or_default()).collect()
    }

    /// Most bytes of text one token stands for: its vocabulary entry's UTF-8 length (byte-level
    /// BPE writes each byte as one character of one or two bytes; SentencePiece writes a space
    /// as three), so no text of more than `n x` this bytes is `n` tokens or fewer.
    pub fn max_token_bytes(&self) -> usize {
        *self.max_token_bytes.get_or_init(|| {
            self.tokenizer.get_vocab(true).keys().map(String::len).max().unwrap_or(1).max(1)
        })
    }

    /// Refuses, before rendering and tokenizing, what cannot fit in `max_model_len` tokens:
    /// more messages than tokens, or more text than that many of the longest tokens could
    /// hold. Rendering and tokenizing cost time in proportion to the text (about a second per
    /// megabyte here), so a body of tens of megabytes is turned away in microseconds.
    pub fn check_size<'a>(
        &self,
        messages: usize,
        texts: impl IntoIterator<Item = &'a str>,
        max_model_len: u64,
    ) -> Result<(), PreprocessError> {
        if messages as u64 > max_model_len {
            return Err(TooLong::Messages { messages, max_model_len }.into());
        }
        let bytes: usize = texts.into_iter().map(str::len).sum();
        let limit = (max_model_len as usize).saturating_mul(self.max_token_bytes());
        if bytes > limit {
            return Err(TooLong::Text { bytes, max_model_len }.into());
        }
        Ok(())
    }

    /// Refuses images for a text-only model.
    pub fn check_images(&self, messages: &[ChatMessage]) -> Result<(), PreprocessError> {
        if self.image_token_id.is_none() && !image_urls(messages).is_empty() {
            return Err(self.text_only_error());
        }
        Ok(())
    }

    /// A chat request's tokens, with each image's placeholder expanded; `images` are the
    /// request's images in order (see [`image_urls`]), already decoded.
    pub fn prepare_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        images: Vec<Image>,
    ) -> Result<Prepared, PreprocessError> {
        self.check_images(messages)?;
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

    /// A `/v1/completions` request as a server takes it (its `model` resolved by the caller,
    /// `kvroute_http::models`): the prompt within `max_model_len` by size, then tokenized, and its length and `max_tokens` checked as
    /// vLLM checks them.
    pub fn prepare_completion_request(
        &self,
        req: &CompletionRequest,
        max_model_len: u64,
    ) -> Result<Prepared, ApiError> {
        if let CompletionPrompt::Text(text) = &req.prompt {
            self.check_size(0, [text.as_str()], max_model_len)
                .map_err(|e| ApiError::from(e).param("prompt"))?;
        }
        let prepared = self
            .prepare_completion(req.prompt.clone())
            .map_err(|e| ApiError::from(e).param("prompt"))?;
        if prepared.tokens.is_empty() {
            return Err(ApiError::bad_request("the prompt is empty").param("prompt"));
        }
        check_lengths(prepared.tokens.len(), req.max_tokens, max_model_len).map_err(|e| match e
            .body()
            .error
            .param
            .as_deref()
        {
            Some("messages") => e.param("prompt"),
            _ => e,
        })?;
        Ok(prepared)
    }

    /// Token ids with one image token per image, as an API that takes images beside its
    /// ids (SGLang's `input_ids` with `image_data`) has them: each expanded to its image's
    /// placeholder tokens, as a chat's are, and recorded where.
    pub fn expand_images(
        &self,
        tokens: Vec<u32>,
        images: Vec<Image>,
    ) -> Result<Prepared, PreprocessError> {
        self.expand(tokens, images)
    }

    /// Replaces the i-th image token with `images[i].tokens` copies and records where.
    fn expand(&self, tokens: Vec<u32>, images: Vec<Image>) -> Result<Prepared, PreprocessError> {
        let Some(pad) = self.image_token_id else {
            if images.is_empty() {
                return Ok(Prepared { tokens, mm: RequestExtraInfo::default(), images });
            }
            return Err(self.text_only_error());
        };
        let pads = tokens.iter().filter(|&&t| t == pad).count();
        if pads != images.len() {
            return Err(PreprocessError::ImageCount { parts: pads, given: images.len() });
        }
        let extra: usize = images.iter().map(|i| i.tokens.saturating_sub(1)).sum();
        let mut out = Vec::with_capacity(tokens.len() + extra);
        let mut objects = Vec::with_capacity(images.len());
        let mut next = images.iter();
        for t in tokens {
            if t != pad {
                out.push(t);
                continue;
            }
            let image = next.next().unwrap_or_else(|| unreachable!("counted above"));
            let start = out.len();
            out.extend(std::iter::repeat_n(pad, image.tokens));
            objects.push(RequestMmObjectInfo {
                mm_hash: image.mm_hash,
                offsets: vec![(start, out.len())],
            });
        }
        Ok(Prepared { tokens: out, mm: RequestExtraInfo { mm_objects: objects }, images })
    }
}
