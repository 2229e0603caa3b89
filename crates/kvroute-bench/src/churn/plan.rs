//! What changes when: the plans of `--churn`.

use serde::Serialize;

/// How the fleet changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ChurnPlan {
    /// 2 workers, 4 at 40 s, 3 at 90 s (the first drained).
    Scale,
    /// 4 workers, each replaced by one at a new address, one every 20 s from 40 s.
    Rolling,
}

/// Where the members come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ChurnSource {
    /// The admin API: `POST /workers`, `POST /workers/{id}/drain`.
    Api,
    /// A name on a real DNS server (dnsmasq) on loopback, resolved every 500 ms.
    Dns,
    /// A NATS key-value bucket on a real nats-server, each worker's registration its sidecar's.
    Nats,
    /// An InferencePool's pods, watched with kube's client on an API server of the bench's own
    /// (a pod ADDED as an engine joins, DELETED as it leaves).
    Kube,
}

/// Where the requests go in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ChurnVia {
    /// kvroute's front door.
    Front,
    /// A gateway whose Endpoint Picker is kvroute.
    Picker,
}

/// One change: engines (by index) that join and leave at `at` seconds.
#[derive(Clone, Debug, Serialize)]
pub struct Change {
    pub at: f64,
    pub join: Vec<usize>,
    pub leave: Vec<usize>,
}

/// A whole plan.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    /// Engines started (each on an address of its own).
    pub engines: usize,
    pub initial: Vec<usize>,
    pub changes: Vec<Change>,
    pub seconds: f64,
}

impl ChurnPlan {
    pub fn plan(self) -> Plan {
        match self {
            Self::Scale => Plan {
                engines: 4,
                initial: vec![0, 1],
                changes: vec![
                    Change { at: 40.0, join: vec![2, 3], leave: vec![] },
                    Change { at: 90.0, join: vec![], leave: vec![0] },
                ],
                seconds: 140.0,
            },
            Self::Rolling => Plan {
                engines: 8,
                initial: vec![0, 1, 2, 3],
                changes: (0..4)
                    .map(|k| Change {
                        at: 40.0 + 20.0 * k as f64,
                        join: vec![4 + k],
                        leave: vec![k],
                    })
                    .collect(),
                seconds: 140.0,
            },
        }
    }
}
