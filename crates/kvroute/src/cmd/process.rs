//! What the serving subcommands share: the decorated command line, the runtime, listening,
//! serving until Ctrl-C or SIGTERM, the picker's start.

use std::time::Duration;

use anyhow::Context;

/// How long open responses get to finish after Ctrl-C or SIGTERM.
const GRACE: Duration = Duration::from_secs(5);

/// The command line with the settings' flags decorated: each one's environment variable and,
/// in its help, its default for that command ([`kvroute_stack::settings::decorate`]).
pub(crate) fn decorated(command: clap::Command) -> clap::Command {
    use kvroute_stack::settings::{
        DEFAULT_FRONT_DOOR_PORT, DEFAULT_MOCKER_PORT, DEFAULT_ROUTER_PORT, Settings, decorate,
    };
    let ports = [
        ("serve", DEFAULT_FRONT_DOOR_PORT),
        ("frontend", DEFAULT_FRONT_DOOR_PORT),
        ("router", DEFAULT_ROUTER_PORT),
        ("mocker", DEFAULT_MOCKER_PORT),
    ];
    ports.into_iter().fold(command, |command, (name, port)| {
        command.mut_subcommand(name, |sub| short_help(decorate(sub, &Settings::defaults(port))))
    })
}

/// The flags `-h` shows: the ones a newcomer needs first (where to listen, which workers, a
/// config file); `--help` shows every flag, by group.
const FIRST_FLAGS: &[&str] = &[
    "host",
    "port",
    "simulated_workers",
    "speedup",
    "workers",
    "router_url",
    "model_path",
    "policy",
    "admin_token_file",
    "api_keys_file",
    "config",
    "print_config",
    "help",
    "version",
];

/// `-h` lists [`FIRST_FLAGS`] only, and says where the rest are.
fn short_help(mut command: clap::Command) -> clap::Command {
    let ids: Vec<String> = command.get_arguments().map(|a| a.get_id().to_string()).collect();
    let all = ids.len();
    // Every argument in turn (clap moves an argument it changes to the end).
    for id in ids {
        let first = FIRST_FLAGS.contains(&id.as_str());
        command = command.mut_arg(&id, |arg| arg.hide_short_help(!first));
    }
    command
        .after_help(format!(
            "-h shows the flags to start with; --help shows all {all}, each also an environment variable (KVROUTE_<FLAG>) and a key of --config's file."
        ))
        .after_long_help("Each setting is also an environment variable (KVROUTE_<FLAG>) and a key of --config's file (snake_case).")
}

/// Writes the ready line (and a hint) to stdout. A closed stdout (`kvroute serve | head -1`)
/// must not take the server down, so write errors are ignored.
pub(crate) fn announce(lines: &[String]) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    for line in lines {
        let _ = writeln!(out, "{line}");
    }
    let _ = out.flush();
}

pub(crate) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting a runtime")
}

/// The runtime, with the process's log and its spans' exporter (`role` names the process in
/// its spans) started in it.
pub(crate) fn started(
    tracing: &kvroute_stack::settings::Tracing,
    role: &'static str,
) -> anyhow::Result<(tokio::runtime::Runtime, kvroute_stack::telemetry::Telemetry)> {
    let runtime = runtime()?;
    let telemetry = {
        let _inside = runtime.enter();
        kvroute_stack::telemetry::init(Some(tracing), role)?
    };
    Ok((runtime, telemetry))
}

pub(crate) async fn bind(address: &str) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(address).await.with_context(|| format!("binding {address}"))
}

/// `http` or `https`, as the listener serves.
pub(crate) fn scheme(options: &kvroute_http::ServeOptions) -> &'static str {
    if options.tls.is_some() { "https" } else { "http" }
}

/// Serves `app` until Ctrl-C or SIGTERM, then stops accepting and gives open responses
/// [`GRACE`] to finish.
pub(crate) async fn serve_until_signal(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    options: kvroute_http::ServeOptions,
) -> anyhow::Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        shutdown_signal().await;
        let _ = stop_tx.send(());
    };
    let server = kvroute_http::serve_with(listener, app, shutdown, options);
    let grace = async move {
        let _ = stop_rx.await;
        tokio::time::sleep(GRACE).await;
    };
    tokio::select! {
        result = server => result?,
        () = grace => tracing::warn!("open responses cancelled after {} s", GRACE.as_secs()),
    }
    Ok(())
}

/// Starts the Endpoint Picker when the settings ask for one (`--ext-proc-port`), on `--host`,
/// serving until the process ends. It answers gRPC health at once, `liveness` serving and
/// `readiness` not until the returned sender is fired (the workers ready).
pub(crate) async fn start_picker(
    stack: &kvroute_stack::Stack,
    settings: &kvroute_stack::settings::Settings,
) -> anyhow::Result<Option<tokio::sync::oneshot::Sender<()>>> {
    let (Some(options), Some(port)) = (settings.epp_options(), settings.gateway.ext_proc_port)
    else {
        return Ok(None);
    };
    let tls = settings.epp_tls()?;
    let token = settings.epp_token()?;
    let picker = stack.picker(options, token).context("the picker needs the front door")?;
    if let Some(path) = &settings.gateway.endpoints_file {
        // With a worker template, what the file lists that is no worker joins.
        if let Some(template) = &settings.membership.worker_template {
            let discovery = settings.discovery()?;
            picker.add_listed(template.parse()?, discovery.drain_timeout);
        }
        picker.watch(path.clone(), Duration::from_secs(2));
    }
    let listener = bind(&settings.address_on(port)).await?;
    let local = listener.local_addr()?;
    let health = match settings.gateway.ext_proc_health_port {
        Some(port) => Some(bind(&settings.address_on(port)).await?),
        None => None,
    };
    let mut lines =
        vec![format!("kvroute endpoint picker (Envoy ext_proc, gRPC health) on {local}")];
    if tls.is_some() {
        lines.push("  the picker's port serves TLS".to_owned());
    }
    if let Some(h) = &health {
        lines.push(format!("  the picker's gRPC health in plain text on {}", h.local_addr()?));
    }
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<()>();
    let ready = async move {
        let _ = ready_rx.await;
    };
    tokio::spawn(async move {
        let never = std::future::pending::<()>();
        if let Err(e) = kvroute_epp::serve_tls(listener, picker, tls, health, ready, never).await {
            tracing::error!(error = %e, "the endpoint picker stopped");
        }
    });
    announce(&lines);
    Ok(Some(ready_tx))
}

/// Resolves on Ctrl-C or SIGTERM.
pub(crate) async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!("shutting down");
}
