//! Images that come beside token ids, for both engines' APIs: vLLM's `content_parts` (each
//! keyed by its `uuid`) and SGLang's `image_data` (keyed by `mm_hashes`). Both engines keep a
//! cache of processed media by the caller's key, so a repeated image is not processed again
//! (vLLM's multimodal processor cache, SGLang's trusted content hashes): so does the simulated
//! engine, holding each image's size and placeholder count by its key. An image without a
//! key, or not seen before, is loaded within the model's image limits and keyed by its key,
//! or by its pixels when it has none.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use kvroute_preprocess::Image;

/// Keys the cache holds before it drops its oldest.
const CAPACITY: usize = 4096;

/// Processed images by their caller's key, oldest first out.
#[derive(Debug, Default)]
pub(crate) struct Processed {
    inner: Mutex<(HashMap<String, Image>, VecDeque<String>)>,
}

impl Processed {
    pub(crate) fn get(&self, key: &str) -> Option<Image> {
        let inner = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        inner.0.get(key).cloned()
    }

    pub(crate) fn put(&self, key: &str, image: &Image) {
        let mut inner = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (map, order) = &mut *inner;
        if map.insert(key.to_owned(), image.clone()).is_none() {
            order.push_back(key.to_owned());
        }
        while order.len() > CAPACITY {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
    }
}

/// The cache's key of a caller's key under a request's `cache_salt`: tenants with different
/// salts never share a processed image, whatever keys they choose (vLLM keys its processor
/// cache by the salted hash too).
pub(crate) fn salted(salt: Option<&str>, key: &str) -> String {
    match salt {
        Some(salt) => format!("{}:{salt}|{key}", salt.len()),
        None => format!("-|{key}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// #51 finding 9: one tenant's key never names another tenant's image.
    #[test]
    fn keys_are_salted_apart() {
        assert_ne!(salted(Some("a"), "shared"), salted(Some("b"), "shared"));
        assert_ne!(salted(Some("a"), "shared"), salted(None, "shared"));
        assert_ne!(salted(Some("a|b"), "c"), salted(Some("a"), "b|c"));
        assert_eq!(salted(Some("a"), "k"), salted(Some("a"), "k"));
    }
}
