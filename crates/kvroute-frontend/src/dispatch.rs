//! Dispatch: places a request and sends it over one hop ([`crate::hop`]), trying another
//! worker while none has answered; in a fleet with prefill workers it takes two legs instead
//! ([`crate::pair`]).

use std::sync::Arc;
use std::time::Instant;

use axum::response::Response;
use kvroute_core::WorkerWithDpRank;
use kvroute_http::ApiError;

use crate::hop::{Outbound, send};
use crate::observer::InFlight;
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
    let timeout = if out.streamed { state.options.first_byte_timeout } else { RESPONSE_TIMEOUT };
    let mut excluded: Vec<WorkerWithDpRank> = state
        .health
        .excluded(Instant::now())
        .into_iter()
        .flat_map(|w| state.all_ranks(w))
        .collect();
    if state.placer.disaggregated(state.workers().prefill_workers) {
        return crate::pair::dispatch_pair(state, out, excluded).await;
    }
    // Flow control admits a request once; placed again after a worker failed it, it is not
    // held again.
    let mut request = out.place.clone();
    // A tenant over its share gets a lower engine priority than its class's, once placed: its
    // work fills the engines without standing ahead of the others' (#78).
    let mut lowered = false;
    loop {
        let id = state.request_id();
        let placed = state
            .placer
            .place(&request, state.block_size, (&id, out.trace.as_ref()), &excluded)
            .await?;
        if let Some(class) = request.class.take() {
            lowered = state.options.engine_priority && state.placer.over_share(&class);
        }
        let Some(placement) = placed.filter(|p| !excluded.contains(&p.worker)) else {
            return Err(ApiError::unavailable("no worker is available"));
        };
        let mut guard = InFlight::new(state, id);
        let worker = placement.worker;
        guard.span = crate::hop::engine_span(worker, "aggregated", &guard.id);
        let Some(base) = state.workers().url(worker.worker_id).map(str::to_owned) else {
            excluded.push(worker);
            continue;
        };
        if let Some(adapter) = out.place.adapter.as_deref()
            && !state.ensure_adapter(worker.worker_id, &base, adapter).await
        {
            excluded.extend(state.all_ranks(worker.worker_id));
            continue;
        }
        let dialect = Some(state.dialect(worker.worker_id))
            .filter(|d| out.tokens.iter().any(|(sent, _)| sent == d));
        let lower = move |v: &mut serde_json::Value| crate::dialect::lower_priority(v, dialect);
        let edit: Option<crate::hop::Edit<'_>> = lowered.then_some(&lower);
        if lowered {
            state.metrics.lowered_priority.inc();
        }
        match send(state, out, placement, guard, edit, timeout).await? {
            Ok(answer) => return Ok(answer),
            Err(failure) => state.retry_without(worker.worker_id, failure, &mut excluded),
        }
    }
}
