//! `kvroute frontend`: the front door alone, with a remote or an embedded router.

use std::process::ExitCode;

use clap::Args;
use kvroute_stack::Stack;
use kvroute_stack::settings::{DEFAULT_FRONT_DOOR_PORT, Settings, keys};

use std::path::PathBuf;

use super::args::{
    BlockSizeArg, ConfigArgs, FrontDoorArgs, ListenArgs, ModelArgs, NatsArgs, RoutingArgs,
    SecurityArgs,
};

#[derive(Debug, Args)]
pub(crate) struct FrontendArgs {
    #[command(flatten)]
    listen: ListenArgs,
    /// A `kvroute router` to ask (its /find_best_worker and request lifecycle). Without it, a
    /// router runs embedded, subscribed to the workers' events.
    #[arg(long, env = "KVROUTE_ROUTER_URL")]
    router_url: Option<String>,
    /// File holding the remote router's admin token (first line), sent with every call to it;
    /// or the token itself in KVROUTE_ROUTER_TOKEN.
    #[arg(long, env = "KVROUTE_ROUTER_TOKEN_FILE")]
    router_token_file: Option<PathBuf>,
    #[command(flatten)]
    security: SecurityArgs,
    #[command(flatten)]
    front_door: FrontDoorArgs,
    #[command(flatten)]
    block_size: BlockSizeArg,
    #[command(flatten)]
    routing: RoutingArgs,
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    config: ConfigArgs,
}

pub(crate) fn run(args: &FrontendArgs) -> anyhow::Result<ExitCode> {
    let mut flags = Settings {
        router_url: args.router_url.clone(),
        router_token_file: args.router_token_file.clone(),
        ..Settings::default()
    };
    args.listen.apply(&mut flags);
    args.security.apply(&mut flags);
    args.front_door.apply(&mut flags);
    args.block_size.apply(&mut flags);
    args.routing.apply(&mut flags);
    args.nats.apply(&mut flags);
    args.model.apply(&mut flags);
    let settings = args.config.merge(flags, &keys::frontend(), "frontend")?;
    if args.config.printed(&settings, DEFAULT_FRONT_DOOR_PORT, &keys::frontend()) {
        return Ok(ExitCode::SUCCESS);
    }
    anyhow::ensure!(!settings.workers.is_empty(), "no workers: give --worker id=..,url=..");
    let config = settings.stack_config(0, true)?;
    settings.check_exposure(&config.access, true)?;
    let options = settings.serve_options()?;
    let scheme = super::scheme(&options);
    let timeout = settings.ready_timeout()?;
    super::runtime()?.block_on(async move {
        let listener = super::bind(&settings.address(DEFAULT_FRONT_DOOR_PORT)).await?;
        let stack = Stack::start(config).await?;
        stack.ready(timeout).await;
        let local = listener.local_addr()?;
        let via = settings.router_url.as_deref().unwrap_or("an embedded router");
        let n = stack.workers.len();
        super::announce(&[format!(
            "kvroute frontend ready on {scheme}://{local} ({n} workers, via {via})"
        )]);
        let app = stack.frontend_app().ok_or_else(|| anyhow::anyhow!("no front door"))?;
        super::serve_until_signal(listener, app, options).await?;
        Ok(ExitCode::SUCCESS)
    })
}
