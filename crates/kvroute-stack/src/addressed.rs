//! Simulated engines each on an address of its own in 127.0.0.0/8, all on the same ports, as
//! the pods behind a headless Service are: one DNS name can list them, and one worker
//! template (`{host}` for the address) describes each. For the membership tests and
//! `kvroute bench --churn`.

use std::net::IpAddr;

use kvroute_mocker::{EngineConfig, MockerConfig, Spawned};
use kvroute_router::WorkerSpec;
use kvroute_router::members::{Template, TemplateError, id_for};

use crate::StackError;

/// The ports every engine listens on, each on its own address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ports {
    pub http: u16,
    pub events: u16,
    pub replay: u16,
    pub metrics: u16,
}

impl Ports {
    /// The worker template of engines on these ports.
    pub fn template(self) -> Result<Template, TemplateError> {
        let Self { http, events, replay, metrics } = self;
        format!(
            "url=http://{{host}}:{http},events=tcp://{{host}}:{events},replay=tcp://{{host}}:{replay},metrics=tcp://{{host}}:{metrics}"
        )
        .parse()
    }
}

fn port_of(endpoint: Option<&str>) -> Result<u16, StackError> {
    let port = endpoint.and_then(|e| e.rsplit(':').next()?.parse().ok());
    port.ok_or_else(|| StackError::Io(std::io::Error::other("an engine without its endpoint")))
}

/// Starts a simulated engine with `engine`'s settings on `ip`, on `ports` (`None`: free ones,
/// which the next engines then share); its worker (id made from its URL) and its ports.
pub async fn engine_at(
    ip: IpAddr,
    ports: Option<Ports>,
    engine: EngineConfig,
) -> Result<(Spawned, WorkerSpec, Ports), StackError> {
    let at = |p: Option<u16>| Some(format!("tcp://{ip}:{}", p.unwrap_or(0)));
    let endpoints = kvroute_mocker::Endpoints {
        events: at(ports.map(|p| p.events)),
        replay: at(ports.map(|p| p.replay)),
        metrics: at(ports.map(|p| p.metrics)),
    };
    let config = MockerConfig { engine, endpoints, ..MockerConfig::default() };
    let listener = tokio::net::TcpListener::bind((ip, ports.map_or(0, |p| p.http))).await?;
    let http = listener.local_addr()?.port();
    let spawned = kvroute_mocker::spawn(config, listener).await?;
    let ports = Ports {
        http,
        events: port_of(spawned.events.as_deref())?,
        replay: port_of(spawned.replay.as_deref())?,
        metrics: port_of(spawned.metrics.as_deref())?,
    };
    let mut spec = WorkerSpec::new(0);
    spec.url = Some(spawned.url.clone());
    spec.events.clone_from(&spawned.events);
    spec.replay.clone_from(&spawned.replay);
    spec.metrics.clone_from(&spawned.metrics);
    spec.id = id_for(&spawned.url);
    Ok((spawned, spec, ports))
}
