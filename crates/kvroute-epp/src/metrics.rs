//! The picker's metrics, named as the Gateway API Inference Extension's Endpoint Picker names
//! its own where one exists (`inference_objective_*`, `inference_extension_*`), kvroute's
//! (`kvroute_epp_*`) where none does. The router's and front door's metrics are served beside
//! them.

use std::time::Duration;

use kvroute_http::metrics::{Counter, EncodeLabelSet, Family, Gauge, Histogram, Registry};

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ModelLabels {
    model_name: String,
    target_model_name: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ErrorLabels {
    model_name: String,
    target_model_name: String,
    error_code: String,
}

const DURATION_BUCKETS: [f64; 16] =
    [0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0];

const PICK_BUCKETS: [f64; 12] =
    [0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5];

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct StageLabels {
    stage: String,
}

/// Where a stream's deadline passed: its request's headers and body (`request`), or the
/// response's beginning (`response`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Request,
    Response,
}

#[derive(Debug)]
pub struct EppMetrics {
    /// Streams whose deadline passed, by stage (their placement freed).
    deadlines: Family<StageLabels, Counter>,
    /// Requests on routes the picker does not place, sent in turn.
    pub unplaced: Counter,
    /// Streams refused for a missing or wrong ext_proc token.
    pub unauthenticated: Counter,
    pub registry: std::sync::Arc<Registry>,
    pub streams: Counter,
    pub requests: Counter,
    pub broken: Counter,
    pub fallbacks_served: Counter,
    pub pick_seconds: Histogram,
    picked: Family<ModelLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    running: Family<ModelLabels, Gauge>,
    duration: Family<ModelLabels, Histogram>,
}

impl Default for EppMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl EppMetrics {
    pub fn new() -> Self {
        let mut r = Registry::default();
        let streams = Counter::default();
        let requests = Counter::default();
        let broken = Counter::default();
        let fallbacks_served = Counter::default();
        let pick_seconds = Histogram::new(PICK_BUCKETS);
        let deadlines = Family::<StageLabels, Counter>::default();
        let unplaced = Counter::default();
        let unauthenticated = Counter::default();
        r.register(
            "kvroute_epp_deadlines",
            "Streams whose request did not arrive, or whose response did not begin, in time (its \
             placement freed), by stage",
            deadlines.clone(),
        );
        r.register(
            "kvroute_epp_unplaced_requests",
            "Requests on routes the picker does not place (sent in turn, after the transfer-field \
             check)",
            unplaced.clone(),
        );
        r.register(
            "kvroute_epp_unauthenticated_streams",
            "ext_proc streams refused for a missing or wrong token",
            unauthenticated.clone(),
        );
        let picked = Family::<ModelLabels, Counter>::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        let running = Family::<ModelLabels, Gauge>::default();
        let duration = Family::<ModelLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(DURATION_BUCKETS)
        });
        r.register(
            "kvroute_epp_streams",
            "ext_proc streams opened by the gateway",
            streams.clone(),
        );
        r.register(
            "kvroute_epp_requests",
            "Requests whose headers came over ext_proc",
            requests.clone(),
        );
        r.register(
            "kvroute_epp_broken_streams",
            "ext_proc streams the gateway broke before the response ended (their requests freed)",
            broken.clone(),
        );
        r.register(
            "kvroute_epp_fallbacks_served",
            "Responses served by a fallback endpoint (the one picked could not be reached)",
            fallbacks_served.clone(),
        );
        r.register(
            "inference_extension_scheduler_e2e_duration_seconds",
            "Time to pick an endpoint: parse, tokenize, hash, admit and place",
            pick_seconds.clone(),
        );
        r.register(
            "inference_objective_request",
            "Requests picked an endpoint, by model",
            picked.clone(),
        );
        r.register(
            "inference_objective_request_error",
            "Requests refused by the picker or answered with an error status, by model and code",
            errors.clone(),
        );
        r.register(
            "inference_objective_running_requests",
            "Requests picked whose response has not ended, by model",
            running.clone(),
        );
        r.register(
            "inference_objective_request_duration_seconds",
            "Time from a request's headers to its response's end, by model",
            duration.clone(),
        );
        Self {
            deadlines,
            unplaced,
            unauthenticated,
            registry: std::sync::Arc::new(r),
            streams,
            requests,
            broken,
            fallbacks_served,
            pick_seconds,
            picked,
            errors,
            running,
            duration,
        }
    }

    fn labels(model: &str) -> ModelLabels {
        ModelLabels { model_name: model.to_owned(), target_model_name: model.to_owned() }
    }

    pub(crate) fn picked(&self, model: &str) {
        self.picked.get_or_create(&Self::labels(model)).inc();
        self.running.get_or_create(&Self::labels(model)).inc();
    }

    pub(crate) fn finished(&self, model: &str, took: Duration) {
        if model.is_empty() {
            return;
        }
        self.running.get_or_create(&Self::labels(model)).dec();
        self.duration.get_or_create(&Self::labels(model)).observe(took.as_secs_f64());
    }

    pub(crate) fn deadline(&self, stage: Stage) {
        let stage = match stage {
            Stage::Request => "request",
            Stage::Response => "response",
        };
        self.deadlines.get_or_create(&StageLabels { stage: stage.to_owned() }).inc();
    }

    /// Deadlines passed at `stage` so far.
    pub fn deadlines(&self, stage: Stage) -> u64 {
        let stage = match stage {
            Stage::Request => "request",
            Stage::Response => "response",
        };
        self.deadlines.get_or_create(&StageLabels { stage: stage.to_owned() }).get()
    }

    pub(crate) fn refused(&self, model: &str, status: u16) {
        self.error(model, status);
    }

    pub(crate) fn error(&self, model: &str, status: u16) {
        let labels = ErrorLabels {
            model_name: model.to_owned(),
            target_model_name: model.to_owned(),
            error_code: status.to_string(),
        };
        self.errors.get_or_create(&labels).inc();
    }
}
