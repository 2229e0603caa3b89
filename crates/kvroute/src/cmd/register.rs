//! `kvroute register`: keeps one worker registered in the fleet's NATS key-value bucket
//! (`--members-bucket`) while it runs, a sidecar beside an engine; on Ctrl-C or SIGTERM the
//! registration is deleted and the routers drain the worker at once (docs/membership.md).

use std::process::ExitCode;

use clap::Args;
use kvroute_stack::settings::{Membership, Nats, Settings};

/// The worker a sidecar registers.
#[derive(Debug, Args)]
pub(crate) struct RegisterArgs {
    /// The worker, as --worker takes it (comma-separated key=value pairs: url, events, replay,
    /// metrics, dialect, ...); without id, the routers make one from its url.
    #[arg(long)]
    worker: String,
    #[command(flatten)]
    nats: Nats,
    #[command(flatten)]
    membership: Membership,
}

pub(crate) fn run(args: &RegisterArgs) -> anyhow::Result<ExitCode> {
    let settings = Settings {
        nats: args.nats.clone(),
        membership: args.membership.clone(),
        ..Settings::default()
    };
    let discovery = settings.discovery()?;
    let Some(bucket) = discovery.bucket else {
        anyhow::bail!("kvroute register needs --members-bucket and --nats-url");
    };
    let spec = registration(&args.worker)?;
    let key = kvroute_router::members::signed::sign(&bucket.key, &bucket.bucket, &spec)?.0;
    super::runtime()?.block_on(async move {
        tracing::info!(bucket = %bucket.bucket, %key, ttl_secs = bucket.ttl.as_secs(), "registering the worker");
        kvroute_router::members::register(&bucket, &spec, super::shutdown_signal()).await
    })?;
    Ok(ExitCode::SUCCESS)
}

/// A `--worker` description as the bucket holds it: JSON, without an id (the routers make it
/// from the URL) and never with a token (the bucket is shared; a worker that needs one gets
/// it from the routers' own configuration).
fn registration(text: &str) -> anyhow::Result<serde_json::Value> {
    let has_id = text.split(',').filter_map(|p| p.split_once('=')).any(|(k, _)| k.trim() == "id");
    if has_id {
        anyhow::bail!("a registered worker's id is made from its url: leave id out of --worker");
    }
    let spec: kvroute_router::WorkerSpec = format!("id=0,{text}").parse()?;
    if spec.api_key.is_some() {
        anyhow::bail!("a worker's token does not belong in the shared bucket");
    }
    if spec.url.is_none() && spec.events.is_none() {
        anyhow::bail!("--worker needs a url (or events)");
    }
    let mut json = serde_json::to_value(&spec)?;
    if let Some(object) = json.as_object_mut() {
        object.remove("id");
    }
    Ok(json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registration_is_the_worker_without_its_id_or_token() {
        let r = registration("url=http://10.0.0.1:8000,events=tcp://10.0.0.1:5557").unwrap();
        assert!(r.get("id").is_none());
        let spec = kvroute_router::members::parse_entry(&serde_json::to_vec(&r).unwrap()).unwrap();
        assert_eq!(spec.id, kvroute_router::members::id_for("http://10.0.0.1:8000"));
        assert!(registration("id=4,url=http://a:1").is_err());
        assert!(registration("url=http://a:1,api_key=x").is_err());
        assert!(registration("dialect=openai-chat").is_err());
    }
}
