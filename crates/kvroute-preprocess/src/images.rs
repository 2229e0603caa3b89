//! Images: data-URL decoding, pixel decoding with limits, the identifier, and how many
//! placeholder tokens an image becomes (docs/architecture.md, "Invariants").
//!
//! The identifier is the lowercase hex BLAKE3 of `width ‖ height` (u32 LE) and the RGBA8
//! pixels, so the same picture gets the same identifier however it was sent; its `mm_hash`
//! follows [`kvroute_core::hash::mm_hash_from_identifier`]. Placeholder count follows
//! Qwen2-VL: each side resized to a multiple of the patch size (28) within the pixel bounds,
//! then one token per 28 x 28 patch.

use base64::Engine as _;
use image::{ImageDecoder as _, ImageReader, Limits};
use kvroute_core::hash::mm_hash_from_identifier;

use crate::{ImageError, PreprocessError};

/// Limits and geometry of image handling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageConfig {
    /// Side of one placeholder token's patch, in pixels.
    pub patch: u32,
    pub min_pixels: u64,
    pub max_pixels: u64,
    /// Largest encoded image accepted (bytes).
    pub max_bytes: usize,
    /// Largest decoded side accepted (pixels).
    pub max_side: u32,
    /// Most pixels of one image, read from its header before anything is decoded: a few
    /// hundred compressed bytes can claim 8192 x 8192 (256 MiB of RGBA).
    pub max_image_pixels: u64,
    /// Most pixels of all of a request's images together (bounds its decoding time).
    pub max_request_pixels: u64,
    /// Most images in one request.
    pub max_images: usize,
}

impl Default for ImageConfig {
    fn default() -> Self {
        Self {
            patch: 28,
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            max_bytes: 20 << 20,
            max_side: 8192,
            // 12 Mpx: a 4000 x 3000 photo; 48 MiB as RGBA.
            max_image_pixels: 12 << 20,
            max_request_pixels: 24 << 20,
            max_images: 16,
        }
    }
}

/// A decoded image and what routing needs of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Image {
    pub width: u32,
    pub height: u32,
    /// Lowercase hex BLAKE3 of the size and RGBA8 pixels.
    pub identifier: String,
    pub mm_hash: u64,
    /// Placeholder tokens the image expands into.
    pub tokens: usize,
}

/// The bytes of a `data:` URL (`data:image/png;base64,...`).
pub fn data_url_bytes(url: &str, config: &ImageConfig) -> Result<Vec<u8>, PreprocessError> {
    let rest =
        url.strip_prefix("data:").ok_or_else(|| PreprocessError::Image(ImageError::NotDataUrl))?;
    let (meta, payload) =
        rest.split_once(',').ok_or_else(|| PreprocessError::Image(ImageError::NoComma))?;
    if !meta.ends_with(";base64") {
        return Err(PreprocessError::Image(ImageError::NotBase64));
    }
    if payload.len() / 4 * 3 > config.max_bytes {
        return Err(PreprocessError::ImageTooLarge { limit: config.max_bytes });
    }
    base64::engine::general_purpose::STANDARD
        .decode(payload.trim())
        .map_err(|e| PreprocessError::Image(ImageError::BadBase64(e)))
}

/// Decodes an encoded image (PNG, JPEG or WebP) and describes it.
pub fn decode(bytes: &[u8], config: &ImageConfig) -> Result<Image, PreprocessError> {
    decode_within(bytes, config, config.max_image_pixels)
}

/// The pixels an image's header claims, read without decoding it (`None`: no header this
/// crate reads).
pub fn header_pixels(bytes: &[u8]) -> Option<u64> {
    let (w, h) = ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .ok()?
        .into_dimensions()
        .ok()?;
    Some(u64::from(w) * u64::from(h))
}

/// [`decode`], refusing more than `max_pixels` (what is left of the request's budget) by the
/// image's header, before decoding. Memory stays within one decoded copy of the image: RGBA8
/// images are hashed in place, others converted a row at a time.
pub fn decode_within(
    bytes: &[u8],
    config: &ImageConfig,
    max_pixels: u64,
) -> Result<Image, PreprocessError> {
    if bytes.len() > config.max_bytes {
        return Err(PreprocessError::ImageTooLarge { limit: config.max_bytes });
    }
    let reader = ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| PreprocessError::ImageDecode { what: "unreadable", source: e.into() })?;
    let mut decoder = reader
        .into_decoder()
        .map_err(|source| PreprocessError::ImageDecode { what: "unreadable", source })?;
    let (width, height) = decoder.dimensions();
    let pixels = u64::from(width) * u64::from(height);
    let limit = max_pixels.min(config.max_image_pixels);
    if pixels > limit || width > config.max_side || height > config.max_side {
        return Err(PreprocessError::ImagePixels { width, height, limit });
    }
    let mut limits = Limits::default();
    limits.max_image_width = Some(config.max_side);
    limits.max_image_height = Some(config.max_side);
    // One decoded copy at up to 8 bytes a pixel (16-bit RGBA), and the decoder's buffers.
    limits.max_alloc = Some(pixels * 8 + (8 << 20));
    decoder
        .set_limits(limits)
        .map_err(|source| PreprocessError::ImageDecode { what: "too large", source })?;
    let decoded = image::DynamicImage::from_decoder(decoder)
        .map_err(|source| PreprocessError::ImageDecode { what: "undecodable", source })?;
    let mut hasher = blake3::Hasher::new();
    hasher.update(&width.to_le_bytes());
    hasher.update(&height.to_le_bytes());
    match &decoded {
        image::DynamicImage::ImageRgba8(rgba) => {
            hasher.update(rgba.as_raw());
        }
        other => {
            // The same bytes as the RGBA8 conversion, a row at a time.
            let mut row = Vec::with_capacity(width as usize * 4);
            for y in 0..height {
                row.clear();
                for x in 0..width {
                    row.extend_from_slice(&image::GenericImageView::get_pixel(other, x, y).0);
                }
                hasher.update(&row);
            }
        }
    }
    let identifier = hasher.finalize().to_hex().to_string();
    Ok(Image {
        width,
        height,
        mm_hash: mm_hash_from_identifier(&identifier),
        tokens: placeholder_tokens(width, height, config),
        identifier,
    })
}

/// A `side` x `side` PNG whose pixels follow from `seed` (the parity probe's picture: a new
/// seed, a picture no engine has cached).
pub fn seeded_png(seed: u64, side: u32) -> Vec<u8> {
    let mut state = seed | 1;
    let picture = image::RgbaImage::from_fn(side, side, |_, _| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let [r, g, b, ..] = state.to_le_bytes();
        image::Rgba([r, g, b, 255])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    // Encoding an in-memory RGBA8 picture into memory cannot fail.
    let _ = picture.write_to(&mut out, image::ImageFormat::Png);
    out.into_inner()
}

/// A PNG as a `data:` URL.
pub fn png_data_url(png: &[u8]) -> String {
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(png))
}

/// Qwen2-VL's `smart_resize`, then one token per patch.
pub fn placeholder_tokens(width: u32, height: u32, config: &ImageConfig) -> usize {
    let f = f64::from(config.patch);
    let (w, h) = (f64::from(width.max(1)), f64::from(height.max(1)));
    let mut hb = f.max((h / f).round() * f);
    let mut wb = f.max((w / f).round() * f);
    if hb * wb > config.max_pixels as f64 {
        let beta = (h * w / config.max_pixels as f64).sqrt();
        hb = f.max((h / beta / f).floor() * f);
        wb = f.max((w / beta / f).floor() * f);
    } else if hb * wb < config.min_pixels as f64 {
        let beta = (config.min_pixels as f64 / (h * w)).sqrt();
        hb = (h * beta / f).ceil() * f;
        wb = (w * beta / f).ceil() * f;
    }
    ((hb / f) as usize) * ((wb / f) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen2_vl_geometry() {
        let c = ImageConfig::default();
        assert_eq!(placeholder_tokens(84, 56, &c), 3 * 2);
        assert_eq!(placeholder_tokens(448, 448, &c), 256, "the common 448 x 448 -> 256 tokens");
        assert_eq!(placeholder_tokens(10, 10, &c), 4, "small images grow to min_pixels");
        assert!(placeholder_tokens(8000, 8000, &c) <= 1280, "large ones shrink to max_pixels");
    }

    #[test]
    fn seeded_pictures_differ_by_seed_and_round_trip() {
        let c = ImageConfig::default();
        let a = seeded_png(1, 112);
        let url = png_data_url(&a);
        let image = decode(&data_url_bytes(&url, &c).unwrap(), &c).unwrap();
        assert_eq!((image.width, image.height, image.tokens), (112, 112, 16));
        assert_eq!(
            image,
            decode(&seeded_png(1, 112), &c).unwrap(),
            "the same seed, the same picture"
        );
        assert_ne!(image.mm_hash, decode(&seeded_png(2, 112), &c).unwrap().mm_hash);
    }

    #[test]
    fn data_urls() {
        let c = ImageConfig::default();
        assert_eq!(data_url_bytes("data:image/png;base64,AAEC", &c).unwrap(), vec![0, 1, 2]);
        assert!(data_url_bytes("http://x", &c).is_err());
        assert!(data_url_bytes("data:image/png,raw", &c).is_err());
        assert!(data_url_bytes("data:image/png;base64,!!!", &c).is_err());
        let small = ImageConfig { max_bytes: 2, ..c };
        assert!(matches!(
            data_url_bytes("data:image/png;base64,AAECAwQF", &small),
            Err(PreprocessError::ImageTooLarge { .. })
        ));
        assert!(decode(b"not an image", &c).is_err());
    }

    fn png(width: u32, height: u32, color: image::ColorType) -> Vec<u8> {
        let mut out = Vec::new();
        let raw = vec![7u8; width as usize * height as usize * color.bytes_per_pixel() as usize];
        image::ImageEncoder::write_image(
            image::codecs::png::PngEncoder::new(&mut out),
            &raw,
            width,
            height,
            color.into(),
        )
        .unwrap();
        out
    }

    /// The identifier hashes RGBA8 pixels whatever the stored format: an RGB image and the
    /// same pixels stored as RGBA get the same one (the row-wise conversion is the image
    /// crate's own).
    #[test]
    fn rgb_and_rgba_of_the_same_pixels_share_an_identifier() {
        let c = ImageConfig::default();
        let rgb = decode(&png(30, 20, image::ColorType::Rgb8), &c).unwrap();
        let rgba_pixels: Vec<u8> = [7u8, 7, 7, 255].repeat(30 * 20);
        let mut rgba_png = Vec::new();
        image::ImageEncoder::write_image(
            image::codecs::png::PngEncoder::new(&mut rgba_png),
            &rgba_pixels,
            30,
            20,
            image::ExtendedColorType::Rgba8,
        )
        .unwrap();
        let rgba = decode(&rgba_png, &c).unwrap();
        assert_eq!(rgb.identifier, rgba.identifier);
        assert_eq!((rgb.width, rgb.height), (30, 20));
    }

    /// A small file that claims many pixels is refused by its header, before decoding.
    #[test]
    fn pixel_bombs_are_refused_before_decoding() {
        let c = ImageConfig { max_image_pixels: 1000, ..ImageConfig::default() };
        let bomb = png(100, 100, image::ColorType::L8);
        assert!(bomb.len() < 1000, "{} bytes", bomb.len());
        let err = decode(&bomb, &c).unwrap_err();
        assert!(
            matches!(err, PreprocessError::ImagePixels { width: 100, height: 100, limit: 1000 }),
            "{err}"
        );
        assert!(
            decode_within(&png(20, 20, image::ColorType::L8), &c, 399).is_err(),
            "the request's budget"
        );
        assert!(decode_within(&png(20, 20, image::ColorType::L8), &c, 400).is_ok());
    }
}
