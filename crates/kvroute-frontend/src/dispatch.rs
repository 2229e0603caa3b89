//! Dispatch: places a request and sends it over one hop ([`crate::hop`]), trying another
//! worker while none has answered ([`crate::attempts`]); a pair's two legs are sent by
//! [`crate::pair`].

use std::sync::Arc;

use axum::response::Response;
use kvroute_http::ApiError;

use crate::attempts::{Attempt, Attempts};
use crate::hop::{Outbound, send};
use crate::pair::split;
use crate::{FrontendState, RESPONSE_TIMEOUT};

pub(crate) use crate::dialect::Keys;

/// Places the request and sends it, trying another worker while none has answered: until an
/// answer's head arrives nothing has reached the client, so a worker that refuses the
/// connection, breaks it or stays silent past the timeout is ejected and the request placed
/// again without it (the first one drops the request when we hang up).
pub(crate) async fn dispatch(
    state: &Arc<FrontendState>,
    out: &Outbound,
) -> Result<Response, ApiError> {
    let mut attempts = Attempts::new(state, out, None);
    loop {
        let attempt = attempts.next().await?;
        let answer = match attempt.legs.prefill {
            Some(prefill) => split(state, out, prefill, attempt, &mut attempts).await?,
            None => one(state, out, attempt, &mut attempts).await?,
        };
        if let Some(answer) = answer {
            return Ok(answer);
        }
    }
}

/// One attempt on one worker (prefilled where it decodes): its answer, or `None` when the
/// worker could not take it or failed it (left out of the next attempts).
async fn one(
    state: &Arc<FrontendState>,
    out: &Outbound,
    attempt: Attempt,
    attempts: &mut Attempts<'_>,
) -> Result<Option<Response>, ApiError> {
    let Attempt { legs, guard } = attempt;
    let timeout = if out.streamed { state.options.first_byte_timeout } else { RESPONSE_TIMEOUT };
    if attempts.paired() {
        state.metrics.pd_in_place.inc();
    }
    let placement = legs.decode;
    let worker = placement.worker.worker_id;
    let Some(base) = state.workers().url(worker).map(str::to_owned) else {
        attempts.skip(worker);
        return Ok(None);
    };
    if let Some(adapter) = out.place.adapter.as_deref()
        && !state.ensure_adapter(worker, &base, adapter).await
    {
        attempts.skip(worker);
        return Ok(None);
    }
    // A tenant over its share gets a lower engine priority than its class's, once placed: its
    // work fills the engines without standing ahead of the others' (#78).
    let lowered = attempts.lowered();
    let dialect = Some(state.workers().dialect(worker))
        .filter(|d| out.tokens.iter().any(|(sent, _)| sent == d));
    let lower = move |v: &mut serde_json::Value| crate::dialect::lower_priority(v, dialect);
    let edit: Option<crate::hop::Edit<'_>> = lowered.then_some(&lower);
    if lowered {
        state.metrics.lowered_priority.inc();
    }
    match send(state, out, placement, guard, edit, timeout).await? {
        Ok(answer) => Ok(Some(answer)),
        Err(failure) => {
            attempts.failed(worker, failure);
            Ok(None)
        }
    }
}
