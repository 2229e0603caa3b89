//! A worker's description with its address left out ([`Template`]), filled in for each
//! address a source finds; and the id a discovered worker gets from its address.

use std::net::IpAddr;

use kvroute_core::WorkerId;

use crate::config::{ConfigError, WorkerSpec};

/// A `--worker` description whose values may hold `{host}` (the address found, an IPv6 one in
/// brackets) and `{port}` (an SRV record's port), and no `id` (a worker's id is made from its
/// address, the same on every replica): e.g.
/// `url=http://{host}:8000,events=tcp://{host}:5557,metrics=http://{host}:8000/metrics`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Template(String);

/// Why a template, or a worker made from one, is refused.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("a worker template has no id (the id is made from the address): {0}")]
    HasId(String),
    #[error("a worker template must name {{host}} in its url or events: {0}")]
    NoHost(String),
    #[error("the template needs {{port}} and the source found none (an A record without SRV)")]
    NoPort,
    #[error(transparent)]
    Worker(#[from] ConfigError),
}

impl std::str::FromStr for Template {
    type Err = TemplateError;

    fn from_str(s: &str) -> Result<Self, TemplateError> {
        let keys = s.split(',').filter_map(|p| p.split_once('=')).map(|(k, _)| k.trim());
        if keys.clone().any(|k| k == "id") {
            return Err(TemplateError::HasId(s.to_owned()));
        }
        if !s.contains("{host}") {
            return Err(TemplateError::NoHost(s.to_owned()));
        }
        let template = Self(s.to_owned());
        template.fill(IpAddr::from([127, 0, 0, 1]), Some(1))?;
        Ok(template)
    }
}

impl Template {
    /// The worker at `host` (and `port`, from SRV).
    pub fn fill(&self, host: IpAddr, port: Option<u16>) -> Result<WorkerSpec, TemplateError> {
        let host = match host {
            IpAddr::V4(v4) => v4.to_string(),
            IpAddr::V6(v6) => format!("[{v6}]"),
        };
        let mut text = self.0.replace("{host}", &host);
        if text.contains("{port}") {
            text = text.replace("{port}", &port.ok_or(TemplateError::NoPort)?.to_string());
        }
        let mut spec: WorkerSpec = format!("id=0,{text}").parse()?;
        let address = spec.url.as_deref().or(spec.events.as_deref()).unwrap_or(&host);
        spec.id = id_for(address);
        Ok(spec)
    }
}

/// The id of a worker found at `address` (its URL, or its events endpoint): 48 bits of its
/// xxh3 hash, the same on every replica and exact in a JSON number.
pub fn id_for(address: &str) -> WorkerId {
    WorkerId(xxhash_rust::xxh3::xxh3_64(address.trim_end_matches('/').as_bytes()) & ((1 << 48) - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_template_fills_in_the_address_and_names_the_worker_by_it() {
        let t: Template = "url=http://{host}:8000,events=tcp://{host}:{port},dialect=vllm-generate"
            .parse()
            .unwrap();
        let a = t.fill("10.0.0.7".parse().unwrap(), Some(5557)).unwrap();
        assert_eq!(a.url.as_deref(), Some("http://10.0.0.7:8000"));
        assert_eq!(a.events.as_deref(), Some("tcp://10.0.0.7:5557"));
        assert_eq!(a.id, id_for("http://10.0.0.7:8000"));
        let v6 = t.fill("fd00::7".parse().unwrap(), Some(5557)).unwrap();
        assert_eq!(v6.url.as_deref(), Some("http://[fd00::7]:8000"));
        assert_ne!(a.id, v6.id);
        assert!(matches!(t.fill("10.0.0.7".parse().unwrap(), None), Err(TemplateError::NoPort)));
        assert!(a.id.0 < 1 << 48);
    }

    #[test]
    fn a_template_with_an_id_or_no_host_or_a_bad_key_is_refused() {
        assert!(matches!(
            "id=3,url=http://{host}:1".parse::<Template>(),
            Err(TemplateError::HasId(_))
        ));
        assert!(matches!("url=http://x:1".parse::<Template>(), Err(TemplateError::NoHost(_))));
        assert!(matches!(
            "url=http://{host}:1,color=red".parse::<Template>(),
            Err(TemplateError::Worker(_))
        ));
    }
}
