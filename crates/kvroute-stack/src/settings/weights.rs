//! The cost's weights: `NAME=VALUE` on the command line, a `[kv_cost]` table in a file.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::invalid::Invalid;

/// `NAME=VALUE` of `--kv-cost` and `--pd-cost` (the name is checked against the cost's settings
/// later).
pub fn kv_weight(arg: &str) -> Result<(String, f64), Invalid> {
    let bad = || Invalid::Weight(arg.to_owned());
    let (name, value) = arg.split_once('=').ok_or_else(bad)?;
    let value = value.trim().parse().map_err(|_| bad())?;
    Ok((name.trim().to_owned(), value))
}

// The `kv` cost's weights in a file: a `[kv_cost]` table of `name = value` (the last of a
// name given twice wins), through `#[serde(with = "super::weights")]`.

pub(super) fn serialize<S: Serializer>(weights: &[(String, f64)], s: S) -> Result<S::Ok, S::Error> {
    let table: BTreeMap<&str, f64> = weights.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    table.serialize(s)
}

pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(String, f64)>, D::Error> {
    Ok(BTreeMap::<String, f64>::deserialize(d)?.into_iter().collect())
}
