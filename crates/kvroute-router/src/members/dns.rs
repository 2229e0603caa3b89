//! DNS as a source of members ([`DnsSource`]): a name resolved every few seconds, each
//! address it answers one worker, described by a [`Template`] with the address filled in.
//!
//! A Kubernetes headless Service publishes the addresses of its ready pods only, so readiness
//! comes free. A name that starts with `_` (`_http._tcp.engines.ns.svc.cluster.local`) is
//! looked up as SRV records: each target's addresses, with the record's port as `{port}`.
//! A name without records is an empty fleet (its members drain); a lookup that fails
//! (timeout, refused) keeps the members as they are, logged once per run of failures.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::time::Duration;

use hickory_resolver::TokioResolver;
use hickory_resolver::config::{NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::{RData, RecordType};

use super::source::{MAX_MEMBERS_PER_SOURCE, Sink, Source};
use super::template::Template;
use crate::config::WorkerSpec;

/// How often the name is resolved, unless configured.
pub const DNS_EVERY: Duration = Duration::from_secs(5);

/// What the DNS source follows.
#[derive(Clone, Debug)]
pub struct DnsConfig {
    /// The name: a headless Service's (A/AAAA), or an SRV name (starting with `_`).
    pub name: String,
    /// The server asked (`None`: the system's, from `/etc/resolv.conf`).
    pub server: Option<SocketAddr>,
    pub every: Duration,
    pub template: Template,
}

/// A source of members from DNS (see the module docs).
pub struct DnsSource {
    config: DnsConfig,
    resolver: TokioResolver,
}

impl std::fmt::Debug for DnsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DnsSource").field("config", &self.config).finish_non_exhaustive()
    }
}

/// Why DNS cannot be followed.
#[derive(Debug, thiserror::Error)]
#[error("DNS: {0}")]
pub struct DnsError(String);

impl DnsSource {
    pub fn new(config: DnsConfig) -> Result<Self, DnsError> {
        let provider = TokioRuntimeProvider::default();
        let mut builder = match config.server {
            Some(at) => {
                let mut server = NameServerConfig::udp_and_tcp(at.ip());
                for c in &mut server.connections {
                    c.port = at.port();
                }
                let servers = ResolverConfig::from_name_servers(vec![server]);
                TokioResolver::builder_with_config(servers, provider)
            }
            None => TokioResolver::builder(provider).map_err(|e| DnsError(e.to_string()))?,
        };
        // Every round asks the server: a pod that left must not linger in a cache.
        builder.options_mut().cache_size = 0;
        builder.options_mut().timeout = Duration::from_secs(2);
        let resolver = builder.build().map_err(|e| DnsError(e.to_string()))?;
        Ok(Self { config, resolver })
    }

    /// The workers the name answers now (none when it has no records); `Err` when the lookup
    /// failed.
    pub async fn lookup(&self) -> Result<Vec<WorkerSpec>, DnsError> {
        let found = match self.config.name.starts_with('_') {
            true => self.srv().await,
            false => {
                let ips = self.addresses(&self.config.name).await;
                ips.map(|a| a.into_iter().map(|ip| (ip, None)).collect())
            }
        };
        let found = match found {
            Ok(found) => found,
            Err(err) if err.is_no_records_found() => Vec::new(),
            Err(err) => return Err(DnsError(err.to_string())),
        };
        let mut specs = Vec::new();
        for (ip, port) in found.into_iter().take(MAX_MEMBERS_PER_SOURCE * 4) {
            match self.config.template.fill(ip, port) {
                Ok(spec) => specs.push(spec),
                Err(err) => return Err(DnsError(err.to_string())),
            }
        }
        Ok(specs)
    }

    async fn addresses(&self, name: &str) -> Result<Vec<IpAddr>, hickory_resolver::net::NetError> {
        let found = self.resolver.lookup_ip(name).await?;
        Ok(found.iter().collect())
    }

    async fn srv(&self) -> Result<Vec<(IpAddr, Option<u16>)>, hickory_resolver::net::NetError> {
        let lookup = self.resolver.lookup(self.config.name.as_str(), RecordType::SRV).await?;
        let mut out = Vec::new();
        let targets = lookup.answers().iter().filter_map(|r| match &r.data {
            RData::SRV(srv) => Some((srv.target.clone(), srv.port)),
            _ => None,
        });
        for (target, port) in targets.take(MAX_MEMBERS_PER_SOURCE * 4) {
            match self.addresses(&target.to_utf8()).await {
                Ok(ips) => out.extend(ips.into_iter().map(|ip| (ip, Some(port)))),
                Err(err) if err.is_no_records_found() => {}
                Err(err) => return Err(err),
            }
        }
        Ok(out)
    }
}

impl Source for DnsSource {
    fn name(&self) -> String {
        "dns".to_owned()
    }

    fn run(self: Box<Self>, sink: Sink) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let mut failing = false;
            loop {
                match self.lookup().await {
                    Ok(specs) => {
                        if std::mem::take(&mut failing) {
                            tracing::info!(name = %self.config.name, "DNS answers again");
                        }
                        sink.offer(specs);
                    }
                    Err(err) if !failing => {
                        failing = true;
                        tracing::warn!(name = %self.config.name, %err, "DNS lookup failed: the members stay as they are");
                    }
                    Err(_) => {}
                }
                tokio::time::sleep(self.config.every).await;
            }
        })
    }
}
