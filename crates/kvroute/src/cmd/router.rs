//! `kvroute router`: the standalone router service (docs/router-api.md).

use std::process::ExitCode;

use clap::Args;
use kvroute_stack::Stack;
use kvroute_stack::settings::{
    Blocks, DEFAULT_ROUTER_PORT, Listen, Membership, Nats, Routing, Security, Settings, Tracing,
    keys_of,
};

use super::args::ConfigArgs;

#[derive(Debug, Args)]
pub(crate) struct RouterArgs {
    #[command(flatten)]
    listen: Listen,
    #[command(flatten)]
    security: Security,
    #[command(flatten)]
    blocks: Blocks,
    #[command(flatten)]
    routing: Routing,
    #[command(flatten)]
    nats: Nats,
    #[command(flatten)]
    membership: Membership,
    #[command(flatten)]
    tracing: Tracing,
    #[command(flatten)]
    config: ConfigArgs,
}

pub(crate) fn run(args: &RouterArgs) -> anyhow::Result<ExitCode> {
    let flags = Settings {
        listen: args.listen.clone(),
        security: args.security.clone(),
        blocks: args.blocks.clone(),
        routing: args.routing.clone(),
        nats: args.nats.clone(),
        membership: args.membership.clone(),
        tracing: args.tracing.clone(),
        ..Settings::default()
    };
    let keys = keys_of::<RouterArgs>();
    let reload = args.config.reload(&flags, &keys, "router");
    let mut settings = args.config.merge(flags, &keys, "router")?;
    if args.config.printed(&settings, DEFAULT_ROUTER_PORT, &keys, |s: &Settings| {
        s.router_config()?;
        s.discovery().map(drop)
    })? {
        return Ok(ExitCode::SUCCESS);
    }
    let (runtime, telemetry) = super::started(&settings.tracing, "router")?;
    settings.take_engines_block_size()?;
    let mut config = settings.stack_config(0, false)?;
    config.discovery.reload = reload;
    settings.check_exposure(&config.access, false)?;
    let options = settings.serve_options()?;
    let scheme = super::scheme(&options);
    let policy = config.router.scheduler.policy;
    let timeout = settings.ready_timeout()?;
    runtime.block_on(async move {
        let listener = super::bind(&settings.address(DEFAULT_ROUTER_PORT)).await?;
        let stack = Stack::start(config).await?;
        stack.ready(timeout).await;
        let local = listener.local_addr()?;
        let workers = stack.workers.len();
        tracing::info!(%local, workers, %policy, "kvroute router ready");
        super::announce(&[
            format!("kvroute router listening on {scheme}://{local} ({workers} configured workers, policy {policy})"),
            format!(
                "try: curl -s {scheme}://{local}/find_best_worker -H 'content-type: application/json' -d '{{\"local_hashes\":[1,2,3],\"num_tokens\":48}}'"
            ),
        ]);
        let app = stack.router_app().ok_or_else(|| anyhow::anyhow!("no router"))?;
        super::serve_until_signal(listener, app, options).await?;
        telemetry.flush().await;
        Ok(ExitCode::SUCCESS)
    })
}
