//! A chat request as a server takes it ([`Preprocessor::prepare_chat_request`]): its size
//! checked, its images loaded (`data:` URLs decoded, others fetched by [`crate::fetch`]) and
//! decoded off the async runtime, its prompt prepared and its lengths checked.

use kvroute_http::ApiError;
use kvroute_http::openai::{ChatCompletionRequest, check_lengths};

use crate::fetch::Fetcher;
use crate::{
    ChatMessage, ContentPart, Image, MessageContent, Prepared, PreprocessError, Preprocessor,
    image_urls, images,
};

/// One image part's picture, decoded, with the bytes fetched for it when it came by
/// `http(s)://` URL (a `data:` URL is inline already).
#[derive(Clone, Debug)]
pub struct LoadedImage {
    pub image: Image,
    pub fetched: Option<Vec<u8>>,
}

impl Preprocessor {
    /// The request's images in order (see [`image_urls`]): `data:` URLs decoded, others fetched
    /// by `fetcher` within its limits, then decoded within the model's image limits. A
    /// text-only model refuses them before anything is fetched.
    pub async fn load_images(
        &self,
        messages: &[ChatMessage],
        fetcher: &Fetcher,
    ) -> Result<Vec<LoadedImage>, PreprocessError> {
        self.check_images(messages)?;
        self.load_image_urls(&image_urls(messages), fetcher).await
    }

    /// Images by their URLs, in order, as [`Preprocessor::load_images`] loads a request's:
    /// for an API that takes them beside the prompt (SGLang's `image_data`).
    pub async fn load_image_urls(
        &self,
        urls: &[&str],
        fetcher: &Fetcher,
    ) -> Result<Vec<LoadedImage>, PreprocessError> {
        if self.image_token_id().is_none() && !urls.is_empty() {
            return Err(self.text_only_error());
        }
        let config = *self.image_config();
        if urls.len() > config.max_images {
            let (count, limit) = (urls.len(), config.max_images);
            return Err(PreprocessError::TooManyImages { count, limit });
        }
        let mut out = Vec::new();
        let mut pixels_left = config.max_request_pixels;
        let mut flow = crate::decoding::DecodeTurn::default();
        for &url in urls {
            let (bytes, fetched) = match url.strip_prefix("data:") {
                Some(_) => (images::data_url_bytes(url, &config)?, false),
                None => (fetcher.fetch(url).await?, true),
            };
            let (image, bytes) = decode_off_runtime(bytes, config, pixels_left, &mut flow).await?;
            pixels_left -= u64::from(image.width) * u64::from(image.height);
            out.push(LoadedImage { image, fetched: fetched.then_some(bytes) });
        }
        Ok(out)
    }

    /// A chat request as a server takes it (its `model` resolved by the caller,
    /// `kvroute_http::models`): the messages present and within
    /// `max_model_len` by size ([`Preprocessor::check_size`]), the images loaded
    /// ([`Preprocessor::load_images`]), the prompt prepared, and its length and `max_tokens`
    /// checked as vLLM checks them. Refusals are the client's errors, naming the field at fault.
    pub async fn prepare_chat_request(
        &self,
        req: &ChatCompletionRequest,
        fetcher: &Fetcher,
        max_model_len: u64,
    ) -> Result<(Prepared, Vec<LoadedImage>), ApiError> {
        if req.messages.is_empty() {
            return Err(ApiError::bad_request("messages must not be empty").param("messages"));
        }
        let texts = req.messages.iter().flat_map(|m| {
            let parts: Vec<&str> = match &m.content {
                None => Vec::new(),
                Some(MessageContent::Text(t)) => vec![t.as_str()],
                Some(MessageContent::Parts(parts)) => parts
                    .iter()
                    .filter_map(|p| match p {
                        ContentPart::Text { text } => Some(text.as_str()),
                        ContentPart::ImageUrl { .. } => None,
                    })
                    .collect(),
            };
            std::iter::once(m.role.as_str()).chain(parts)
        });
        self.check_size(req.messages.len(), texts, max_model_len)
            .map_err(|e| ApiError::from(e).param("messages"))?;
        let loaded = self
            .load_images(&req.messages, fetcher)
            .await
            .map_err(|e| ApiError::from(e).param("messages"))?;
        let images = loaded.iter().map(|l| l.image.clone()).collect();
        let prepared = self
            .prepare_chat(&req.messages, true, images)
            .map_err(|e| ApiError::from(e).param("messages"))?;
        check_lengths(prepared.tokens.len(), req.max_output_tokens(), max_model_len)?;
        Ok((prepared, loaded))
    }
}

/// Decodes an image off the async runtime's threads (so `/health` and streams keep
/// answering), as many at once as there are cores (so concurrent requests full of images
/// queue instead of multiplying peak memory), in the fair order of [`crate::decoding`]: a
/// request's small image does not wait behind other requests' heavy ones.
async fn decode_off_runtime(
    bytes: Vec<u8>,
    config: images::ImageConfig,
    max_pixels: u64,
    flow: &mut crate::decoding::DecodeTurn,
) -> Result<(images::Image, Vec<u8>), PreprocessError> {
    // Its cost, from its header (what cannot be read costs its size; decoding will refuse it).
    let cost = images::header_pixels(&bytes).unwrap_or(bytes.len() as u64);
    let _slot = crate::decoding::queue().acquire(flow, cost).await;
    tokio::task::spawn_blocking(move || {
        images::decode_within(&bytes, &config, max_pixels).map(|image| (image, bytes))
    })
    .await
    .map_err(|e| PreprocessError::Image(crate::ImageError::DecodeStopped(e.to_string())))?
}
