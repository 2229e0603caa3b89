//! The models a server answers to: one base model and the LoRA adapters over it, as vLLM
//! serves them (`--lora-modules`, `/v1/load_lora_adapter`) and lists them in `GET /v1/models`
//! (an adapter's card names its base model as `parent`).
//!
//! The simulated engine holds one [`Catalog`] (its adapters come and go through vLLM's
//! dynamic API); the front door holds one for the fleet (adapters from its settings and from
//! what the workers list). A request's `model` resolves to the base model or one adapter
//! ([`Catalog::resolve`]); any other name is OpenAI's 404 `model_not_found`.

use std::collections::BTreeMap;
use std::sync::RwLock;

use serde::{Deserialize, Serialize};

use crate::ApiError;

/// Adapters one catalog holds at most: names come from outside (a load request, a worker's
/// model list), so the set is bounded.
pub const MAX_ADAPTERS: usize = 4_096;
/// The longest adapter name accepted (vLLM takes any; a name is hashed into every block).
pub const MAX_ADAPTER_NAME: usize = 256;
/// The longest path an adapter's weights may be named by (Linux's `PATH_MAX`).
pub const MAX_ADAPTER_PATH: usize = 4_096;

/// The most characters of a client's string an error message repeats.
pub const MAX_ECHOED_CHARS: usize = 64;

/// One served model in `GET /v1/models`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    /// Where the model's weights come from (vLLM's field: the base model's path, an adapter's
    /// path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<String>,
    /// The base model an adapter runs over; `null` for a base model (vLLM's field).
    #[serde(default)]
    pub parent: Option<String>,
    /// The longest prompt plus output the model takes (vLLM's field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u64>,
}

impl ModelCard {
    fn new(id: &str, parent: Option<&str>, root: Option<&str>, max_model_len: Option<u64>) -> Self {
        Self {
            id: id.to_owned(),
            object: "model".into(),
            created: 0,
            owned_by: "kvroute".into(),
            root: root.map(str::to_owned),
            parent: parent.map(str::to_owned),
            max_model_len,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}

impl ModelList {
    /// The list of one model.
    pub fn one(id: &str, max_model_len: Option<u64>) -> Self {
        Self { object: "list".into(), data: vec![ModelCard::new(id, None, None, max_model_len)] }
    }

    /// The adapters a list names over `base` (cards whose `parent` is `base`), in order.
    pub fn adapters_of(&self, base: &str) -> Vec<String> {
        self.data
            .iter()
            .filter(|c| c.parent.as_deref() == Some(base) && c.id != base)
            .map(|c| c.id.clone())
            .collect()
    }
}

/// OpenAI's answer to a model nobody serves: 404, `code` `model_not_found`, `param` `model`
/// (a long name is cut before it is sent back).
pub fn model_not_found(requested: &str) -> ApiError {
    let shown: String = requested.chars().take(MAX_ECHOED_CHARS).collect();
    let cut = if requested.chars().nth(MAX_ECHOED_CHARS).is_some() { "..." } else { "" };
    ApiError::not_found(format!(
        "The model `{shown}{cut}` does not exist or you do not have access to it."
    ))
    .param("model")
    .code("model_not_found")
}

/// A request naming another model than the one served is a 404 (an empty or absent name is
/// taken as the served one).
pub fn check_model(served: &str, requested: Option<&str>) -> Result<(), ApiError> {
    match requested {
        Some(m) if !m.is_empty() && m != served => Err(model_not_found(m)),
        _ => Ok(()),
    }
}

/// Why an adapter was not added.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AdapterError {
    #[error(
        "an adapter name must be 1 to {MAX_ADAPTER_NAME} bytes, without commas or control \
         characters (load reports list names joined by commas)"
    )]
    BadName,
    #[error(
        "an adapter's path must be at most {MAX_ADAPTER_PATH} bytes, without control characters"
    )]
    BadPath,
    #[error("the name is the base model's")]
    BaseName,
    #[error("{MAX_ADAPTERS} adapters are served already")]
    Full,
}

/// A base model and its adapters (each with where it came from).
#[derive(Debug)]
pub struct Catalog {
    base: String,
    max_model_len: Option<u64>,
    adapters: RwLock<BTreeMap<String, Option<String>>>,
}

impl Catalog {
    pub fn new(base: impl Into<String>, max_model_len: Option<u64>) -> Self {
        Self { base: base.into(), max_model_len, adapters: RwLock::default() }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// The model a request names: `None` for the base model (also when it names none), an
    /// adapter's name, or a 404 `model_not_found`.
    pub fn resolve(&self, requested: Option<&str>) -> Result<Option<String>, ApiError> {
        match requested {
            None | Some("") => Ok(None),
            Some(m) if m == self.base => Ok(None),
            Some(m) if self.contains(m) => Ok(Some(m.to_owned())),
            Some(m) => Err(model_not_found(m)),
        }
    }

    /// Adds an adapter (`root`: where its weights are); `Ok(false)` when it was served already
    /// (its root is updated).
    pub fn insert(&self, name: &str, root: Option<&str>) -> Result<bool, AdapterError> {
        let bad = |c: char| c == ',' || c.is_control();
        if name.is_empty() || name.len() > MAX_ADAPTER_NAME || name.contains(bad) {
            return Err(AdapterError::BadName);
        }
        if root.is_some_and(|r| r.len() > MAX_ADAPTER_PATH || r.contains(char::is_control)) {
            return Err(AdapterError::BadPath);
        }
        if name == self.base {
            return Err(AdapterError::BaseName);
        }
        let mut adapters = self.adapters.write().unwrap_or_else(|e| e.into_inner());
        if !adapters.contains_key(name) && adapters.len() >= MAX_ADAPTERS {
            return Err(AdapterError::Full);
        }
        Ok(adapters.insert(name.to_owned(), root.map(str::to_owned)).is_none())
    }

    /// Removes an adapter; whether it was served.
    pub fn remove(&self, name: &str) -> bool {
        self.adapters.write().unwrap_or_else(|e| e.into_inner()).remove(name).is_some()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.adapters.read().unwrap_or_else(|e| e.into_inner()).contains_key(name)
    }

    /// The adapters' names, sorted.
    pub fn adapters(&self) -> Vec<String> {
        self.adapters.read().unwrap_or_else(|e| e.into_inner()).keys().cloned().collect()
    }

    /// `GET /v1/models`: the base model, then each adapter with the base as its parent.
    pub fn list(&self) -> ModelList {
        let adapters = self.adapters.read().unwrap_or_else(|e| e.into_inner());
        let base = ModelCard::new(&self.base, None, None, self.max_model_len);
        let cards = adapters.iter().map(|(name, root)| {
            ModelCard::new(name, Some(&self.base), root.as_deref(), self.max_model_len)
        });
        ModelList { object: "list".into(), data: std::iter::once(base).chain(cards).collect() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_base_adapters_and_refuses_the_rest() {
        let c = Catalog::new("tiny", Some(4096));
        assert_eq!(c.insert("sql", Some("/loras/sql")), Ok(true));
        assert_eq!(c.insert("sql", None), Ok(false));
        assert_eq!(c.resolve(None).unwrap(), None);
        assert_eq!(c.resolve(Some("")).unwrap(), None);
        assert_eq!(c.resolve(Some("tiny")).unwrap(), None);
        assert_eq!(c.resolve(Some("sql")).unwrap().as_deref(), Some("sql"));
        let e = c.resolve(Some("gpt-9")).unwrap_err();
        assert_eq!(e.status().as_u16(), 404);
        let body = serde_json::to_value(e.body()).unwrap();
        assert_eq!(body["error"]["code"], "model_not_found");
        assert_eq!(body["error"]["param"], "model");
        assert!(c.remove("sql"));
        assert!(c.resolve(Some("sql")).is_err());
    }

    #[test]
    fn lists_adapters_under_their_parent() {
        let c = Catalog::new("tiny", None);
        c.insert("b", None).unwrap();
        c.insert("a", Some("/a")).unwrap();
        let list = c.list();
        let ids: Vec<&str> = list.data.iter().map(|m| m.id.as_str()).collect();
        assert_eq!(ids, ["tiny", "a", "b"]);
        assert_eq!(list.data[0].parent, None);
        assert_eq!(list.data[1].parent.as_deref(), Some("tiny"));
        assert_eq!(list.adapters_of("tiny"), ["a", "b"]);
        let json = serde_json::to_value(&list).unwrap();
        assert_eq!(json["data"][1]["root"], "/a");
        assert!(json["data"][0]["parent"].is_null());
    }

    #[test]
    fn names_are_bounded() {
        let c = Catalog::new("tiny", None);
        assert_eq!(c.insert("", None), Err(AdapterError::BadName));
        assert_eq!(c.insert(&"x".repeat(MAX_ADAPTER_NAME + 1), None), Err(AdapterError::BadName));
        // #51 finding 10: names that would split a load report's list, paths of any length.
        assert_eq!(c.insert("a,b", None), Err(AdapterError::BadName));
        assert_eq!(c.insert("a\nb", None), Err(AdapterError::BadName));
        let long = "/".repeat(MAX_ADAPTER_PATH + 1);
        assert_eq!(c.insert("a", Some(&long)), Err(AdapterError::BadPath));
        assert!(!c.contains("a"));
        assert_eq!(c.insert("a", Some(&"/".repeat(MAX_ADAPTER_PATH))), Ok(true));
        assert!(c.remove("a"));
        assert_eq!(c.insert("tiny", None), Err(AdapterError::BaseName));
        for i in 0..MAX_ADAPTERS {
            c.insert(&format!("a{i}"), None).unwrap();
        }
        assert_eq!(c.insert("one-more", None), Err(AdapterError::Full));
        assert_eq!(c.insert("a0", None), Ok(false));
    }

    #[test]
    fn a_long_name_is_cut_in_the_error() {
        let e = model_not_found(&"m".repeat(10_000));
        assert!(e.message().len() < 200, "{}", e.message());
    }
}
