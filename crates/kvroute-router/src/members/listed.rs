//! Members a list of addresses brings: the addresses a gateway's pool names (the picker's
//! endpoints file, docs/gateway.md). The list is written by whoever reads it ([`Listing`]);
//! each address becomes a worker described by a template, source `file`, and one gone from
//! the list drains: the same [`Sink`] path as every other source.
//!
//! Which listed addresses are already workers of another source (a `--worker` named by its
//! host name that the gateway names by address) only the list's reader can tell, from the
//! names it resolved; it writes here only the addresses no other worker answers to.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;

use tokio::sync::watch;

use super::source::{Sink, Source};
use super::template::Template;

/// The writing end: the addresses that should be workers now.
#[derive(Debug)]
pub struct Listing(watch::Sender<Vec<SocketAddr>>);

impl Listing {
    /// The whole list now (the source offers it at once).
    pub fn set(&self, mut addresses: Vec<SocketAddr>) {
        addresses.sort_unstable();
        addresses.dedup();
        self.0.send_if_modified(|now| {
            let changed = *now != addresses;
            *now = std::mem::take(&mut addresses);
            changed
        });
    }
}

/// The source: follows its [`Listing`] until that is dropped.
#[derive(Debug)]
pub struct ListedSource {
    template: Template,
    listed: watch::Receiver<Vec<SocketAddr>>,
}

/// A source of members made by `template` from the addresses written to the [`Listing`].
pub fn listed(template: Template) -> (ListedSource, Listing) {
    let (tx, listed) = watch::channel(Vec::new());
    (ListedSource { template, listed }, Listing(tx))
}

impl ListedSource {
    fn specs(&self, addresses: &[SocketAddr]) -> Vec<crate::config::WorkerSpec> {
        let fill = |a: &SocketAddr| match self.template.fill(a.ip(), Some(a.port())) {
            Ok(spec) => Some(spec),
            Err(err) => {
                tracing::warn!(address = %a, %err, "a listed address cannot be a worker");
                None
            }
        };
        addresses.iter().filter_map(fill).collect()
    }
}

impl Source for ListedSource {
    fn name(&self) -> String {
        "file".to_owned()
    }

    fn run(mut self: Box<Self>, sink: Sink) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            loop {
                let addresses = self.listed.borrow_and_update().clone();
                sink.offer(self.specs(&addresses));
                if self.listed.changed().await.is_err() {
                    return; // the list's reader is gone: its members stay as they are
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::RouterState;
    use crate::config::RouterConfig;

    #[tokio::test]
    async fn listed_addresses_join_and_leave_through_the_sink() {
        let state = Arc::new(RouterState::new(RouterConfig::default()));
        let template: Template = "url=http://{host}:{port}".parse().unwrap();
        let (source, listing) = listed(template);
        let task = super::super::spawn_source(&state, Box::new(source), Duration::ZERO);
        let a: SocketAddr = "127.0.0.1:9001".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:9002".parse().unwrap();
        let members = || {
            let mut urls: Vec<String> = state
                .roster
                .of_source("file")
                .into_iter()
                .filter(|m| !m.draining)
                .filter_map(|m| m.spec.url)
                .collect();
            urls.sort();
            urls
        };
        let until = async |want: Vec<&str>| {
            for _ in 0..500 {
                if members() == want {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("members {:?}, not {want:?}", members());
        };
        listing.set(vec![b, a, a]);
        until(vec!["http://127.0.0.1:9001", "http://127.0.0.1:9002"]).await;
        listing.set(vec![b]);
        until(vec!["http://127.0.0.1:9002"]).await;
        drop(listing);
        task.await.unwrap();
        assert_eq!(members(), vec!["http://127.0.0.1:9002"], "a dropped list keeps its members");
    }
}
