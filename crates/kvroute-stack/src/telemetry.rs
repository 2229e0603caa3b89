//! What the process reports of itself: its log (stderr, text or JSON, filtered by
//! `KVROUTE_LOG`) and, when `--otlp-endpoint` is set, kvroute's spans exported over OTLP/gRPC
//! with parent-based ratio sampling (docs/tracing.md). The spans' target
//! ([`kvroute_http::otel::TARGET`]) goes to the exporter only, never to the log; without an
//! endpoint no layer takes it, so its spans are never made.

use std::io::IsTerminal as _;
use std::sync::OnceLock;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// How the log is written, as the command line said (set once, by the binary's `main`).
#[derive(Clone, Copy, Debug)]
pub struct Logging {
    /// JSON objects, else text (coloured on a terminal only).
    pub json: bool,
    /// The filter when neither `KVROUTE_LOG` nor `RUST_LOG` is set.
    pub default: &'static str,
}

static LOGGING: OnceLock<Logging> = OnceLock::new();

pub fn set_logging(logging: Logging) {
    let _ = LOGGING.set(logging);
}

/// Why spans cannot be exported as asked.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("--trace-ratio must be within 0 and 1, not {0}")]
    Ratio(f64),
    #[error("the OTLP exporter to {endpoint}")]
    Exporter {
        endpoint: String,
        #[source]
        source: opentelemetry_otlp::ExporterBuildError,
    },
}

/// The exporter of a process that exports spans: flushed at the end.
#[derive(Debug, Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Sends the spans still batched (within the exporter's timeout), off the runtime's
    /// threads (the batch task runs on them).
    pub async fn flush(self) {
        if let Some(provider) = self.provider {
            let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        }
    }
}

/// The process's log, and its spans' exporter when `tracing` names an endpoint. Called once,
/// inside the runtime the exporter's batch task runs on (`role` names the process in its
/// spans' resource: serve, frontend, router).
pub fn init(
    tracing: Option<&crate::settings::Tracing>,
    role: &'static str,
) -> Result<Telemetry, TelemetryError> {
    let logging = LOGGING.get().copied().unwrap_or(Logging { json: false, default: "info" });
    let filter = std::env::var("KVROUTE_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        .unwrap_or_else(|_| logging.default.to_owned());
    // kvroute's spans are the exporter's, not the log's (unless the filter names them).
    let filter =
        tracing_subscriber::EnvFilter::new(format!("{}=off,{filter}", kvroute_http::otel::TARGET));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = match logging.json {
        false => fmt.with_ansi(std::io::stderr().is_terminal()).boxed(),
        true => fmt.json().with_ansi(false).boxed(),
    };
    let endpoint = tracing.and_then(|t| t.otlp_endpoint.as_deref());
    let ratio = tracing.and_then(|t| t.trace_ratio).unwrap_or(crate::settings::DEFAULT_TRACE_RATIO);
    let (provider, otel) = match endpoint {
        Some(endpoint) => {
            let provider = provider(endpoint, ratio, role)?;
            let layer = tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("kvroute"))
                .with_location(false)
                .with_target(false)
                .with_threads(false)
                .with_tracked_inactivity(false)
                .with_filter(
                    tracing_subscriber::filter::Targets::new()
                        .with_target(kvroute_http::otel::TARGET, tracing::Level::TRACE),
                );
            (Some(provider), Some(layer))
        }
        None => (None, None),
    };
    let _ = tracing_subscriber::registry().with(fmt.with_filter(filter)).with(otel).try_init();
    if provider.is_some() {
        kvroute_http::otel::turn_on(ratio);
    }
    Ok(Telemetry { provider })
}

/// Spans batched to `endpoint` over OTLP/gRPC. Whether a request is traced is decided at
/// its start, once (`kvroute_http::otel::sample`: the caller's flag, else `ratio`); the spans
/// made are the sampled requests' and are all kept (parent-based over always-on).
fn provider(
    endpoint: &str,
    ratio: f64,
    role: &'static str,
) -> Result<SdkTracerProvider, TelemetryError> {
    if !(0.0..=1.0).contains(&ratio) {
        return Err(TelemetryError::Ratio(ratio));
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(Duration::from_secs(5))
        .build()
        .map_err(|source| TelemetryError::Exporter { endpoint: endpoint.to_owned(), source })?;
    let batch =
        opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
            exporter,
            opentelemetry_sdk::runtime::Tokio,
        )
        .build();
    let mut resource = opentelemetry_sdk::Resource::builder()
        .with_attribute(opentelemetry::KeyValue::new("kvroute.role", role));
    // OTEL_SERVICE_NAME names the service when set; else it is kvroute.
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("kvroute");
    }
    let sampler = Sampler::ParentBased(Box::new(Sampler::AlwaysOn));
    Ok(SdkTracerProvider::builder()
        .with_span_processor(batch)
        .with_sampler(sampler)
        .with_resource(resource.build())
        .build())
}
