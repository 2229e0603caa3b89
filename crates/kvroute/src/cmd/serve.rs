//! `kvroute serve`: front door + router + simulated workers in one process.

use std::process::ExitCode;

use clap::Args;
use kvroute_stack::Stack;
use kvroute_stack::settings::{
    Blocks, DEFAULT_FRONT_DOOR_PORT, Engine, FrontDoor, Gateway, Listen, Membership, Model, Nats,
    Routing, Security, Settings, SimulatedFleet, Tracing, keys_of,
};

use super::args::ConfigArgs;

#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    simulated: SimulatedFleet,
    #[command(flatten)]
    blocks: Blocks,
    #[command(flatten)]
    routing: Routing,
    #[command(flatten)]
    model: Model,
    #[command(flatten)]
    engine: Engine,
    #[command(flatten)]
    listen: Listen,
    #[command(flatten)]
    front_door: FrontDoor,
    #[command(flatten)]
    security: Security,
    #[command(flatten)]
    nats: Nats,
    #[command(flatten)]
    gateway: Gateway,
    #[command(flatten)]
    membership: Membership,
    #[command(flatten)]
    tracing: Tracing,
    #[command(flatten)]
    config: ConfigArgs,
}

/// What `serve` converts its settings into, checked (for `--print-config`).
fn check(settings: &Settings) -> Result<(), kvroute_stack::StackError> {
    settings.router_config()?;
    settings.front_door()?;
    settings.engine_config()?;
    settings.discovery()?;
    Ok(())
}

pub(crate) fn run(args: &ServeArgs) -> anyhow::Result<ExitCode> {
    let flags = Settings {
        simulated: args.simulated.clone(),
        blocks: args.blocks.clone(),
        routing: args.routing.clone(),
        model: args.model.clone(),
        engine: args.engine.clone(),
        listen: args.listen.clone(),
        front_door: args.front_door.clone(),
        security: args.security.clone(),
        nats: args.nats.clone(),
        gateway: args.gateway.clone(),
        membership: args.membership.clone(),
        tracing: args.tracing.clone(),
        ..Settings::default()
    };
    let keys = keys_of::<ServeArgs>();
    let reload = args.config.reload(&flags, &keys, "serve");
    let mut settings = args.config.merge(flags, &keys, "serve")?;
    if args.config.printed(&settings, DEFAULT_FRONT_DOOR_PORT, &keys, check)? {
        return Ok(ExitCode::SUCCESS);
    }
    let (runtime, telemetry) = super::started(&settings.tracing, "serve")?;
    let simulated = settings.simulated_workers();
    let pd = settings.simulated.prefill_workers.unwrap_or(0)
        + settings.simulated.decode_workers.unwrap_or(0);
    anyhow::ensure!(
        simulated + pd > 0
            || !settings.routing.workers.is_empty()
            || settings.membership.has_source(),
        "no workers: use --simulated-workers N, --prefill-workers P --decode-workers D, --worker ..., or a source of members (--discover-dns, --members-bucket, --kube-pool)"
    );
    settings.take_engines_block_size()?;
    let mut config = settings.stack_config(simulated, true)?;
    config.discovery.reload = reload;
    settings.check_exposure(&config.access, true)?;
    let options = settings.serve_options()?;
    let scheme = super::scheme(&options);
    let policy = config.router.scheduler.policy;
    let timeout = settings.ready_timeout()?;
    runtime.block_on(async move {
        let listener = super::bind(&settings.address(DEFAULT_FRONT_DOOR_PORT)).await?;
        let stack = Stack::start(config).await?;
        let picker_ready = super::start_picker(&stack, &settings).await?;
        let waiting = stack.ready(timeout).await;
        if let Some(ready) = picker_ready {
            let _ = ready.send(());
        }
        let local = listener.local_addr()?;
        let n = stack.workers.len();
        let still = match waiting.is_empty() {
            true => String::new(),
            false => format!("; still waiting for {}", stack.waiting_for(&waiting)),
        };
        super::announce(&[
            format!("kvroute serve ready on {scheme}://{local} ({n} workers, policy {policy}{still})"),
            format!(
                "try: curl -s {scheme}://{local}/v1/chat/completions -H 'content-type: application/json' -d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"Hello\"}}],\"max_tokens\":16}}'"
            ),
        ]);
        let app = stack.frontend_app().ok_or_else(|| anyhow::anyhow!("no front door"))?;
        super::serve_until_signal(listener, app, options).await?;
        telemetry.flush().await;
        Ok(ExitCode::SUCCESS)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--print-config` refuses what `serve` refuses (#52: `--kv-cost nope=1` was printed).
    #[test]
    fn print_config_checks_as_serve_does() {
        let mut settings = Settings::default();
        assert!(check(&settings).is_ok());
        settings.routing.kv_cost = vec![("nope".to_owned(), 1.0)];
        assert!(check(&settings).is_err());
    }
}
