//! `kvroute serve`: front door + router + simulated workers in one process.

use std::process::ExitCode;

use clap::Args;
use kvroute_stack::Stack;
use kvroute_stack::settings::{DEFAULT_FRONT_DOOR_PORT, DEFAULT_SIMULATED_WORKERS, Settings, keys};

use super::args::{
    BlockSizeArg, ConfigArgs, EngineArgs, FrontDoorArgs, ListenArgs, ModelArgs, NatsArgs,
    RoutingArgs, SecurityArgs,
};

#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// Simulated workers to start in-process, on free loopback ports; 0 with --worker for
    /// external workers only [default: 4].
    #[arg(
        long,
        visible_alias = "workers",
        env = "KVROUTE_SIMULATED_WORKERS",
        help_heading = "Fleet"
    )]
    simulated_workers: Option<usize>,
    #[command(flatten)]
    block_size: BlockSizeArg,
    #[command(flatten)]
    routing: RoutingArgs,
    #[command(flatten)]
    model: ModelArgs,
    /// Each simulated worker's knobs.
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    listen: ListenArgs,
    #[command(flatten)]
    front_door: FrontDoorArgs,
    #[command(flatten)]
    security: SecurityArgs,
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    config: ConfigArgs,
}

pub(crate) fn run(args: &ServeArgs) -> anyhow::Result<ExitCode> {
    let mut flags = Settings { simulated_workers: args.simulated_workers, ..Settings::default() };
    args.listen.apply(&mut flags);
    args.security.apply(&mut flags);
    args.front_door.apply(&mut flags);
    args.block_size.apply(&mut flags);
    args.routing.apply(&mut flags);
    args.nats.apply(&mut flags);
    args.model.apply(&mut flags);
    args.engine.apply(&mut flags);
    let settings = args.config.merge(flags, &keys::serve(), "serve")?;
    if args.config.printed(&settings, DEFAULT_FRONT_DOOR_PORT, &keys::serve()) {
        return Ok(ExitCode::SUCCESS);
    }
    let simulated = settings.simulated_workers.unwrap_or(DEFAULT_SIMULATED_WORKERS);
    anyhow::ensure!(
        simulated > 0 || !settings.workers.is_empty(),
        "no workers: use --simulated-workers N or --worker ..."
    );
    let config = settings.stack_config(simulated, true)?;
    settings.check_exposure(&config.access, true)?;
    let options = settings.serve_options()?;
    let scheme = super::scheme(&options);
    let policy = config.router.scheduler.policy;
    let timeout = settings.ready_timeout()?;
    super::runtime()?.block_on(async move {
        let listener = super::bind(&settings.address(DEFAULT_FRONT_DOOR_PORT)).await?;
        let stack = Stack::start(config).await?;
        let waiting = stack.ready(timeout).await;
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
        Ok(ExitCode::SUCCESS)
    })
}
