//! kvroute's Kubernetes source of members: the `InferencePool` named in the configuration
//! (GIE's `inference.networking.k8s.io/v1`), its selector and target port, and the ready pods
//! it selects, watched with kube-rs (docs/membership.md). Its own crate: kube and the API's
//! types are large to build, and nothing else of kvroute needs them.

mod pool;
mod source;

pub use pool::{PoolError, PoolSpec, ROLE_LABEL, Skipped, pool_spec, workers};
pub use source::{KubeConfig, KubeSource, KubeSourceError, pool_resource};
