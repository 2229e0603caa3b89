//! `kvroute frontend`: the front door alone, with a remote or an embedded router.

use std::process::ExitCode;

use clap::Args;
use kvroute_stack::Stack;
use kvroute_stack::settings::{
    Blocks, DEFAULT_FRONT_DOOR_PORT, FrontDoor, Gateway, Listen, Membership, Model, Nats,
    RemoteRouter, Routing, Security, Settings, Tracing, keys_of,
};

use super::args::ConfigArgs;

#[derive(Debug, Args)]
pub(crate) struct FrontendArgs {
    #[command(flatten)]
    remote: RemoteRouter,
    #[command(flatten)]
    listen: Listen,
    #[command(flatten)]
    security: Security,
    #[command(flatten)]
    front_door: FrontDoor,
    #[command(flatten)]
    blocks: Blocks,
    #[command(flatten)]
    routing: Routing,
    #[command(flatten)]
    nats: Nats,
    #[command(flatten)]
    model: Model,
    #[command(flatten)]
    gateway: Gateway,
    #[command(flatten)]
    membership: Membership,
    #[command(flatten)]
    tracing: Tracing,
    #[command(flatten)]
    config: ConfigArgs,
}

pub(crate) fn run(args: &FrontendArgs) -> anyhow::Result<ExitCode> {
    let flags = Settings {
        remote: args.remote.clone(),
        listen: args.listen.clone(),
        security: args.security.clone(),
        front_door: args.front_door.clone(),
        blocks: args.blocks.clone(),
        routing: args.routing.clone(),
        nats: args.nats.clone(),
        model: args.model.clone(),
        gateway: args.gateway.clone(),
        membership: args.membership.clone(),
        tracing: args.tracing.clone(),
        ..Settings::default()
    };
    let keys = keys_of::<FrontendArgs>();
    let reload = args.config.reload(&flags, &keys, "frontend");
    let mut settings = args.config.merge(flags, &keys, "frontend")?;
    if args.config.printed(&settings, DEFAULT_FRONT_DOOR_PORT, &keys, |s: &Settings| {
        s.router_config().and(s.front_door()).and(s.discovery()).map(drop)
    })? {
        return Ok(ExitCode::SUCCESS);
    }
    let (runtime, telemetry) = super::started(&settings.tracing, "frontend")?;
    anyhow::ensure!(
        !settings.routing.workers.is_empty() || settings.membership.has_source(),
        "no workers: give --worker id=..,url=.., --discover-dns, --members-bucket or --kube-pool"
    );
    settings.take_engines_block_size()?;
    let mut config = settings.stack_config(0, true)?;
    config.discovery.reload = reload;
    settings.check_exposure(&config.access, true)?;
    let options = settings.serve_options()?;
    let scheme = super::scheme(&options);
    let timeout = settings.ready_timeout()?;
    runtime.block_on(async move {
        let listener = super::bind(&settings.address(DEFAULT_FRONT_DOOR_PORT)).await?;
        let stack = Stack::start(config).await?;
        let picker_ready = super::start_picker(&stack, &settings).await?;
        stack.ready(timeout).await;
        if let Some(ready) = picker_ready {
            let _ = ready.send(());
        }
        let local = listener.local_addr()?;
        let via = settings.remote.router_url.as_deref().unwrap_or("an embedded router");
        let n = stack.workers.len();
        super::announce(&[format!(
            "kvroute frontend ready on {scheme}://{local} ({n} workers, via {via})"
        )]);
        let app = stack.frontend_app().ok_or_else(|| anyhow::anyhow!("no front door"))?;
        super::serve_until_signal(listener, app, options).await?;
        telemetry.flush().await;
        Ok(ExitCode::SUCCESS)
    })
}
