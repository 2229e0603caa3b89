//! What the Endpoint Picker protocol carries in Envoy's metadata and headers
//! (`docs/proposals/004-endpoint-picker-protocol` of the Gateway API Inference Extension):
//! the subset hint the gateway sends, the destination the picker answers, the endpoint that
//! served, each read or built from the protobuf types Envoy uses.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::HeaderMutation;
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};

/// The metadata namespace of the destination and of the endpoint that served.
pub const DESTINATION_NAMESPACE: &str = "envoy.lb";
/// The header, and the key in [`DESTINATION_NAMESPACE`], naming the endpoints picked
/// (`ip:port`, or a comma-separated list, the first the one to use, the others fallbacks).
pub const DESTINATION_KEY: &str = "x-gateway-destination-endpoint";
/// The key in [`DESTINATION_NAMESPACE`] of the endpoint that served a response.
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// The metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key in [`SUBSET_NAMESPACE`] listing the endpoints the picker may choose from.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// llm-d's header naming the prefill endpoint of a split request (read by the decode pod's
/// routing sidecar, which runs the prefill there first).
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";

/// The most endpoints a subset hint may list (a pool of this many pods is far past any
/// fleet's size; a longer list is refused rather than held).
pub const MAX_SUBSET: usize = 4096;

/// The subset hint: `None` when the gateway sent none (any endpoint of the pool), else the
/// endpoints listed, as strings or one comma-separated string (gateways write both). An
/// entry with no port allows every port of that address. `Err` when it lists more than
/// [`MAX_SUBSET`].
pub fn subset(metadata: Option<&Metadata>) -> Result<Option<Vec<String>>, usize> {
    let Some(hint) = metadata.and_then(|m| m.filter_metadata.get(SUBSET_NAMESPACE)) else {
        return Ok(None);
    };
    let Some(value) = hint.fields.get(SUBSET_KEY) else { return Ok(None) };
    let mut out = Vec::new();
    let mut push = |s: &str| {
        out.extend(s.split(',').map(str::trim).filter(|e| !e.is_empty()).map(str::to_owned));
    };
    match &value.kind {
        Some(Kind::StringValue(s)) => push(s),
        Some(Kind::ListValue(list)) => {
            for v in &list.values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    push(s);
                }
            }
        }
        _ => {}
    }
    match out.len() > MAX_SUBSET {
        true => Err(out.len()),
        false => Ok(Some(out)),
    }
}

/// The endpoint the gateway says served the response, if it said.
pub fn served(metadata: Option<&Metadata>) -> Option<&str> {
    let lb = metadata?.filter_metadata.get(DESTINATION_NAMESPACE)?;
    match &lb.fields.get(SERVED_KEY)?.kind {
        Some(Kind::StringValue(s)) => Some(s.split(',').next().unwrap_or(s).trim()),
        _ => None,
    }
}

/// A string as a protobuf value.
pub fn string(s: &str) -> Value {
    Value { kind: Some(Kind::StringValue(s.to_owned())) }
}

/// Strings as a protobuf list value.
pub fn list<'a>(items: impl IntoIterator<Item = &'a str>) -> Value {
    Value {
        kind: Some(Kind::ListValue(ListValue { values: items.into_iter().map(string).collect() })),
    }
}

/// `{namespace: {key: value}}`, as Envoy's dynamic and filter metadata nest them.
pub fn nested(namespace: &str, key: &str, value: Value) -> Struct {
    let inner = Struct { fields: HashMap::from([(key.to_owned(), value)]) };
    let inner = Value { kind: Some(Kind::StructValue(inner)) };
    Struct { fields: HashMap::from([(namespace.to_owned(), inner)]) }
}

/// The dynamic metadata naming the destination (the same value as its header).
pub fn destination(value: &str) -> Struct {
    nested(DESTINATION_NAMESPACE, DESTINATION_KEY, string(value))
}

/// The key in [`DESTINATION_NAMESPACE`] of the candidates' scores (llm-d's picker's).
pub const SCORES_KEY: &str = "x-gateway-destination-endpoint-scores";

/// The dynamic metadata naming the destination and, beside it, each scored endpoint's score.
pub fn destination_scored(value: &str, scores: &[(&str, f64)]) -> Struct {
    let mut out = destination(value);
    let scored = Struct {
        fields: scores
            .iter()
            .map(|(endpoint, score)| {
                ((*endpoint).to_owned(), Value { kind: Some(Kind::NumberValue(*score)) })
            })
            .collect(),
    };
    if let Some(Value { kind: Some(Kind::StructValue(lb)) }) =
        out.fields.get_mut(DESTINATION_NAMESPACE)
    {
        lb.fields.insert(SCORES_KEY.to_owned(), Value { kind: Some(Kind::StructValue(scored)) });
    }
    out
}

/// Reads `namespace.key` out of dynamic metadata as the gateway does.
pub fn dynamic_string<'a>(metadata: &'a Struct, namespace: &str, key: &str) -> Option<&'a str> {
    match &metadata.fields.get(namespace)?.kind {
        Some(Kind::StructValue(inner)) => match &inner.fields.get(key)?.kind {
            Some(Kind::StringValue(s)) => Some(s),
            _ => None,
        },
        _ => None,
    }
}

/// A header set as Envoy takes it (the value as raw bytes, replacing any before it).
pub fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        // OVERWRITE_IF_EXISTS_OR_ADD
        append_action: 2,
        ..HeaderValueOption::default()
    }
}

/// Headers to set.
pub fn set_headers<'a>(headers: impl IntoIterator<Item = (&'a str, String)>) -> HeaderMutation {
    HeaderMutation {
        set_headers: headers.into_iter().map(|(k, v)| set_header(k, &v)).collect(),
        remove_headers: Vec::new(),
    }
}

/// A header's value as Envoy sends it: `raw_value` when set, else `value`.
pub fn header_value(h: &HeaderValue) -> &[u8] {
    match h.raw_value.is_empty() {
        true => h.value.as_bytes(),
        false => &h.raw_value,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn hint(value: Value) -> Metadata {
        Metadata {
            filter_metadata: nested(SUBSET_NAMESPACE, SUBSET_KEY, value)
                .fields
                .into_iter()
                .map(|(k, v)| match v.kind {
                    Some(Kind::StructValue(s)) => (k, s),
                    _ => unreachable!(),
                })
                .collect(),
            ..Metadata::default()
        }
    }

    #[test]
    fn a_subset_is_read_as_a_list_or_a_comma_separated_string() {
        assert_eq!(subset(None), Ok(None));
        let listed = hint(list(["10.0.0.1:8000", "10.0.0.2:8000, 10.0.0.3:8000"]));
        assert_eq!(
            subset(Some(&listed)).unwrap().unwrap(),
            ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
        );
        let flat = hint(string(" 10.0.0.1:8000 ,10.0.0.2"));
        assert_eq!(subset(Some(&flat)).unwrap().unwrap(), ["10.0.0.1:8000", "10.0.0.2"]);
        let empty = hint(list([]));
        assert_eq!(subset(Some(&empty)), Ok(Some(vec![])), "set but empty: nothing is eligible");
        let long: Vec<String> =
            (0..=MAX_SUBSET).map(|i| format!("10.0.{}.{}:80", i / 256, i % 256)).collect();
        let long = hint(list(long.iter().map(String::as_str)));
        assert_eq!(subset(Some(&long)), Err(MAX_SUBSET + 1));
    }

    #[test]
    fn the_destination_reads_back_from_its_metadata() {
        let d = destination("10.0.0.1:8000,10.0.0.2:8000");
        let value = dynamic_string(&d, DESTINATION_NAMESPACE, DESTINATION_KEY);
        assert_eq!(value, Some("10.0.0.1:8000,10.0.0.2:8000"));
    }
}
