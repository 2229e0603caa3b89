//! kvroute's own event form, already core events.

use kvroute_core::RouterEvent;

use crate::WireError;

/// kvroute's native form: Dynamo's `RouterEvent` JSON, one object or a list.
pub fn decode_router_events(bytes: &[u8]) -> Result<Vec<RouterEvent>, WireError> {
    let value: serde_json::Value = serde_json::from_slice(bytes)?;
    Ok(match value {
        serde_json::Value::Array(_) => serde_json::from_value(value)?,
        other => vec![serde_json::from_value(other)?],
    })
}
