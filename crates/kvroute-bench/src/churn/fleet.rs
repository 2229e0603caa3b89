//! The engines a churn run moves in and out of the fleet, each on an address of its own in
//! 127.0.0.0/8 (so that a DNS name can list them), and the source that tells kvroute.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use crate::fixtures::dns_server::DnsServer;
use crate::fixtures::nats_server::NatsServer;
use anyhow::Context;
use kvroute_core::WorkerId;
use kvroute_http::HttpClient;
use kvroute_mocker::{EngineConfig, Timing};
use kvroute_router::WorkerSpec;
use kvroute_router::members::{BucketConfig, DnsConfig, Template, register};
use kvroute_stack::Discovery;
use kvroute_stack::addressed::{Ports, engine_at};
use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::plan::ChurnSource;
use crate::run::FleetConfig;

/// The DNS name the engines are published under.
const NAME: &str = "engines.kvroute.test";

/// The engines of a run.
pub(super) struct Engines {
    pub(super) specs: Vec<WorkerSpec>,
    pub(super) ports: Ports,
    _engines: Vec<kvroute_mocker::Spawned>,
}

fn ip(k: usize) -> IpAddr {
    IpAddr::from([127, 0, 10, (k + 1) as u8])
}

impl Engines {
    /// Starts `n` simulated engines of `fleet`'s kind, engine `k` at 127.0.10.(k+1), all on the
    /// first one's (free) ports.
    pub(super) async fn start(n: usize, fleet: &FleetConfig) -> anyhow::Result<Self> {
        let mut ports: Option<Ports> = None;
        let (mut specs, mut engines) = (Vec::new(), Vec::new());
        for k in 0..n {
            let engine = EngineConfig {
                num_blocks: fleet.num_blocks,
                max_num_seqs: fleet.max_num_seqs,
                max_batched_tokens: fleet.max_batched_tokens,
                timing: Timing { speedup: fleet.speedup },
                ..EngineConfig::default()
            };
            let (spawned, spec, these) = engine_at(ip(k), ports, engine)
                .await
                .with_context(|| format!("an engine at {}", ip(k)))?;
            ports.get_or_insert(these);
            specs.push(spec);
            engines.push(spawned);
        }
        let ports = ports.context("no engine")?;
        Ok(Self { specs, ports, _engines: engines })
    }

    pub(super) fn id(&self, k: usize) -> WorkerId {
        self.specs[k].id
    }

    /// Engine `k` as `POST /workers` and a registration take it (no id: made from its URL).
    fn json(&self, k: usize) -> Value {
        let s = &self.specs[k];
        json!({"url": s.url, "events": s.events, "replay": s.replay, "metrics": s.metrics})
    }

    fn template(&self) -> anyhow::Result<Template> {
        Ok(self.ports.template()?)
    }
}

/// A secret of the run's own: 32 random bytes in hex (the API's admin token, the bucket's
/// registration key).
pub(super) fn admin_token() -> anyhow::Result<String> {
    let mut secret = [0u8; 32];
    getrandom::fill(&mut secret).map_err(|e| anyhow::anyhow!("no randomness: {e}"))?;
    Ok(secret.iter().map(|b| format!("{b:02x}")).collect())
}

/// How the run tells kvroute its members (one per run: its size does not matter).
#[allow(clippy::large_enum_variant)]
pub(super) enum Membership {
    Api {
        admin: String,
        token: String,
    },
    Dns {
        server: DnsServer,
    },
    Nats {
        bucket: BucketConfig,
        sidecars: BTreeMap<usize, oneshot::Sender<()>>,
        _server: NatsServer,
    },
    Kube {
        api: super::fake_api::FakeApi,
        url: String,
    },
}

impl Membership {
    /// The source's servers, and what the stack must follow (the API needs nothing).
    pub(super) async fn start(
        source: ChurnSource,
        engines: &Engines,
        store: &std::path::Path,
    ) -> anyhow::Result<(Self, Discovery)> {
        let mut discovery =
            Discovery { drain_timeout: Duration::from_secs(60), ..Discovery::default() };
        let membership = match source {
            ChurnSource::Api => Self::Api { admin: String::new(), token: String::new() },
            ChurnSource::Dns => {
                let server = DnsServer::start("kvroute.test", &[])?;
                discovery.dns = Some(DnsConfig {
                    name: NAME.into(),
                    server: Some(server.at),
                    every: Duration::from_millis(500),
                    template: engines.template()?,
                });
                Self::Dns { server }
            }
            ChurnSource::Nats => {
                let server = NatsServer::start(store, 0).await?;
                let nats = kvroute_router::nats::NatsConfig::new(server.url());
                // The run's own registration key, drawn at random.
                let bucket = BucketConfig {
                    nats,
                    bucket: "churn_members".into(),
                    ttl: Duration::from_secs(6),
                    key: kvroute_router::members::MembersKey::from_secret(
                        admin_token()?.as_bytes(),
                    )?,
                    allow: Vec::new(),
                };
                discovery.bucket = Some(bucket.clone());
                Self::Nats { bucket, sidecars: BTreeMap::new(), _server: server }
            }
            ChurnSource::Kube => {
                let (api, url) = super::fake_api::FakeApi::start(engines.ports.http).await?;
                Self::Kube { api, url }
            }
        };
        Ok((membership, discovery))
    }

    /// The Kubernetes source over the run's own API server (`None` for the other sources).
    pub(super) fn kube_source(
        &self,
        engines: &Engines,
    ) -> anyhow::Result<Option<kvroute_kube::KubeSource>> {
        let Self::Kube { url, .. } = self else { return Ok(None) };
        let config = kvroute_kube::KubeConfig {
            pool: super::fake_api::POOL.into(),
            namespace: super::fake_api::NAMESPACE.into(),
            template: engines.template()?,
            own_pod: None,
        };
        Ok(Some(kvroute_kube::KubeSource::at(url, config)?))
    }

    /// The front door whose admin API takes the API's changes.
    pub(super) fn set_admin(&mut self, base: &str, with: &str) {
        if let Self::Api { admin, token } = self {
            base.clone_into(admin);
            with.clone_into(token);
        }
    }

    /// `members` are the fleet from now on: `join` are new in it, `leave` gone from it.
    pub(super) async fn apply(
        &mut self,
        engines: &Engines,
        members: &[usize],
        join: &[usize],
        leave: &[usize],
    ) -> anyhow::Result<()> {
        match self {
            Self::Api { admin, token } => {
                let client = HttpClient::new().with_bearer_for(admin, token);
                for &k in join {
                    let url = format!("{admin}/workers");
                    let response =
                        client.call(hyper::Method::POST, &url, Some(&engines.json(k))).await?;
                    anyhow::ensure!(
                        response.status() == 201,
                        "POST /workers: {}",
                        response.status()
                    );
                }
                for &k in leave {
                    let url = format!("{admin}/workers/{}/drain", engines.id(k));
                    let response = client.call(hyper::Method::POST, &url, None::<&Value>).await?;
                    anyhow::ensure!(response.status() == 202, "drain: {}", response.status());
                }
            }
            Self::Dns { server } => {
                let entries: Vec<(IpAddr, &str)> = members.iter().map(|&k| (ip(k), NAME)).collect();
                server.publish(&entries)?;
            }
            Self::Kube { api, .. } => {
                let pods: Vec<(String, IpAddr)> =
                    members.iter().map(|&k| (format!("vllm-{k}"), ip(k))).collect();
                api.set(&pods);
            }
            Self::Nats { bucket, sidecars, .. } => {
                for &k in join {
                    let (stop, stopped) = oneshot::channel::<()>();
                    let (bucket, spec) = (bucket.clone(), engines.json(k));
                    tokio::spawn(async move {
                        let stop = async {
                            let _ = stopped.await;
                        };
                        if let Err(err) = register(&bucket, &spec, stop).await {
                            tracing::error!(%err, "a sidecar failed");
                        }
                    });
                    sidecars.insert(k, stop);
                }
                for k in leave {
                    if let Some(stop) = sidecars.remove(k) {
                        let _ = stop.send(());
                    }
                }
            }
        }
        Ok(())
    }
}
