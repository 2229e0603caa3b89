//! The binary as users run it: settings merged from flags, environment and file; refusals of
//! what would otherwise be dropped silently; logs without colour codes off a terminal (and as
//! JSON); and `kvroute serve` from another directory and with a text-only model.

#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use serde_json::{Value, json};

mod common;
use common::kvroute;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn output(cmd: &mut Command) -> (Output, String, String) {
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr)
}

#[test]
fn a_flag_wins_over_its_env_which_wins_over_the_file() {
    let dir = temp_dir("merge");
    let file = dir.join("kvroute.toml");
    std::fs::write(
        &file,
        "block_size = 32\npolicy = \"dynamo\"\nshards = 2\nport = 1234\n\n[[workers]]\nid = 1\nevents = \"tcp://127.0.0.1:5557\"\nformat = \"sglang\"\n",
    )
    .unwrap();
    let (out, stdout, stderr) = output(
        kvroute()
            .args(["router", "--config"])
            .arg(&file)
            .args([
                "--policy",
                "round-robin",
                "--worker",
                "id=2,url=http://127.0.0.1:9002",
                "--print-config",
            ])
            .env("KVROUTE_BLOCK_SIZE", "64")
            .env("KVROUTE_POLICY", "random"),
    );
    assert!(out.status.success(), "{stderr}");
    let merged: toml::Table = toml::from_str(&stdout).unwrap();
    assert_eq!(merged["policy"].as_str(), Some("round-robin"), "flag over env and file");
    assert_eq!(merged["block_size"].as_integer(), Some(64), "env over file");
    assert_eq!(merged["shards"].as_integer(), Some(2), "file over default");
    assert_eq!(merged["port"].as_integer(), Some(1234));
    let workers = merged["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 2, "the file's worker and the flag's");
    assert_eq!(workers[0]["format"].as_str(), Some("sglang"), "a format prints back as written");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The `kv` cost's weights are settings by name: the file's `[kv_cost]` table, each one
/// overridden by `--kv-cost NAME=VALUE`.
#[test]
fn kv_cost_weights_are_settings() {
    let dir = temp_dir("kv-cost");
    let file = dir.join("kvroute.toml");
    std::fs::write(&file, "[kv_cost]\nqueue_weight = 0.25\neviction_weight = 2.0\n").unwrap();
    let (out, stdout, stderr) = output(
        kvroute()
            .args(["router", "--kv-cost", "eviction_weight=0.5", "--print-config", "--config"])
            .arg(&file),
    );
    assert!(out.status.success(), "{stderr}");
    let merged: toml::Table = toml::from_str(&stdout).unwrap();
    assert_eq!(merged["kv_cost"]["queue_weight"].as_float(), Some(0.25), "from the file");
    assert_eq!(merged["kv_cost"]["eviction_weight"].as_float(), Some(0.5), "the flag over it");
    let (out, _, stderr) = output(kvroute().args(["router", "--kv-cost", "queue_weight"]));
    assert!(!out.status.success());
    assert!(stderr.contains("expected NAME=VALUE"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `serve --help` groups its flags, the common ones first: the fleet and routing before the
/// listener and security, the replicas' NATS flags last; the simulated engine's say so.
#[test]
fn serve_help_is_grouped_common_flags_first() {
    let (out, stdout, stderr) = output(kvroute().args(["serve", "--help"]));
    assert!(out.status.success(), "{stderr}");
    let at = |heading: &str| {
        stdout.find(&format!("\n{heading}:\n")).unwrap_or_else(|| panic!("no {heading}:\n{stdout}"))
    };
    let order = [
        at("Fleet"),
        at("Routing"),
        at("Model"),
        at("Simulated engine (on serve: its simulated workers only)"),
        at("Listener"),
        at("Front door"),
        at("Security"),
        at("Replicas (NATS)"),
    ];
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{stdout}");
    let flag = |name: &str| stdout.find(name).unwrap();
    assert!(flag("--simulated-workers") < flag("--policy"), "{stdout}");
    assert!(flag("--policy") < flag("--nats-url"), "{stdout}");
}

#[test]
fn what_would_be_dropped_is_an_error() {
    let dir = temp_dir("refuse");
    let file = dir.join("kvroute.toml");
    std::fs::write(&file, "num_blocks = 5\n").unwrap();
    let (out, _, stderr) =
        output(kvroute().args(["router", "--print-config", "--config"]).arg(&file));
    assert!(!out.status.success());
    assert!(stderr.contains("`num_blocks` does not apply to `kvroute router`"), "{stderr}");
    std::fs::write(&file, "[[workers]]\nid = 1\nurl = \"http://127.0.0.1:9001\"\n").unwrap();
    let (out, _, stderr) = output(
        kvroute()
            .args([
                "frontend",
                "--print-config",
                "--worker",
                "id=1,url=http://127.0.0.1:9999",
                "--config",
            ])
            .arg(&file),
    );
    assert!(!out.status.success());
    assert!(stderr.contains("worker 1 is given twice with different keys"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A running `kvroute` whose first stdout line has been read (the rest of stdout stays open).
struct Running {
    child: Child,
    line: String,
    stdout: Option<BufReader<std::process::ChildStdout>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(cmd: &mut Command, cwd: &Path) -> Running {
    let mut child =
        cmd.current_dir(cwd).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert!(!line.is_empty(), "no ready line");
    Running { child, line, stdout: Some(stdout) }
}

impl Running {
    /// Closes our end of its stdout, as `kvroute serve | head -1` would.
    fn close_stdout(&mut self) {
        self.stdout = None;
    }

    fn base(&self) -> String {
        let at = self.line.find("http://").unwrap();
        self.line[at..].split_whitespace().next().unwrap().to_owned()
    }

    /// Stops it and returns what it logged.
    fn stop(mut self) -> String {
        let _ = self.child.kill();
        let mut stderr = String::new();
        self.child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
        stderr
    }
}

fn post_chat(base: &str, body: &Value) -> (u16, Value) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let client = kvroute_http::HttpClient::new();
        let url = format!("{base}/v1/chat/completions");
        let response = client.call(hyper::Method::POST, &url, Some(body)).await.unwrap();
        let status = response.status().as_u16();
        let bytes = kvroute_http::client::read_body(response.into_body(), 1 << 20).await.unwrap();
        (status, serde_json::from_slice(&bytes).unwrap())
    })
}

#[test]
fn logs_carry_no_colour_codes_off_a_terminal_and_can_be_json() {
    let cwd = std::env::temp_dir();
    // A worker whose events never come: a warning names it after the ready timeout.
    let args = [
        "router",
        "--port",
        "0",
        "--worker",
        "id=9,events=tcp://127.0.0.1:9",
        "--ready-timeout",
        "0.2",
    ];
    let text = start(kvroute().args(args), &cwd).stop();
    assert!(text.contains("workers not ready") && text.contains("9/0"), "{text}");
    assert!(!text.contains('\u{1b}'), "no ANSI escapes in a pipe: {text:?}");
    let json_logs = start(kvroute().args(["--log-format", "json"]).args(args), &cwd).stop();
    let lines: Vec<Value> = json_logs
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    assert!(lines.iter().any(|l| l["level"] == "WARN"), "{json_logs}");
}

#[test]
fn serve_runs_from_any_directory_with_the_built_in_model() {
    let elsewhere = temp_dir("elsewhere");
    let serve = start(
        kvroute().args(["serve", "--port", "0", "--simulated-workers", "1", "--speedup", "100"]),
        &elsewhere,
    );
    assert!(serve.line.contains("ready on"), "{}", serve.line);
    let body = json!({"model": "kvroute-tiny", "messages": [{"role": "user", "content": "Hello! What is a KV cache?"}], "max_tokens": 4});
    let (status, v) = post_chat(&serve.base(), &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    drop(serve);
    std::fs::remove_dir_all(&elsewhere).unwrap();
}

#[test]
fn serve_takes_a_text_only_model_directory() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/tiny-text");
    let mut serve = start(
        kvroute()
            .args([
                "serve",
                "--port",
                "0",
                "--simulated-workers",
                "1",
                "--speedup",
                "100",
                "--model-path",
            ])
            .arg(&model),
        &std::env::temp_dir(),
    );
    // Whoever read the ready line may go away: the server stays up.
    serve.close_stdout();
    let text = json!({"messages": [{"role": "user", "content": "Hello there, how are you?"}], "max_tokens": 2});
    let (status, v) = post_chat(&serve.base(), &text);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["model"], "tiny-text");
    let image = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]});
    let (status, v) = post_chat(&serve.base(), &image);
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("takes text only"), "{v}");
}

/// `--print-config` with nothing set prints every setting at its default, and that output is
/// a config file the command reads back unchanged.
#[test]
fn print_config_shows_the_defaults_and_reads_back() {
    for (command, port) in [("serve", 8000), ("frontend", 8000), ("router", 8001)] {
        let (out, printed, stderr) = output(kvroute().args([command, "--print-config"]));
        assert!(out.status.success(), "{command}: {stderr}");
        let table: toml::Table = toml::from_str(&printed).unwrap();
        assert_eq!(table["port"].as_integer(), Some(port), "{command}");
        assert_eq!(table["block_size"].as_integer(), Some(16), "{command}");
        assert_eq!(table["kv_cost"]["queue_weight"].as_float(), Some(0.5), "{command}");
        let dir = temp_dir(&format!("print-{command}"));
        let file = dir.join("printed.toml");
        std::fs::write(&file, &printed).unwrap();
        let (out, again, stderr) =
            output(kvroute().args([command, "--print-config", "--config"]).arg(&file));
        assert!(out.status.success(), "{command} reads its printed config back: {stderr}");
        assert_eq!(again, printed, "{command}");
    }
}

/// Every `[default: V]` in `serve --help` is what `--print-config` says the default is: the
/// help's figures cannot drift from the libraries' defaults, where they come from.
#[test]
fn help_defaults_are_the_printed_defaults() {
    let (_, help, _) = output(kvroute().args(["serve", "--help"]));
    let (_, printed, _) = output(kvroute().args(["serve", "--print-config"]));
    let defaults: toml::Table = toml::from_str(&printed).unwrap();
    // Each flag's help, its lines joined.
    let mut flags: Vec<(String, String)> = Vec::new();
    for line in help.lines() {
        let trimmed = line.trim_start();
        // A flag starts its line at column 6; its help (and the help's wrapped lines) further in.
        let indent = line.len() - trimmed.len();
        if let Some(rest) = trimmed.strip_prefix("--").filter(|_| indent <= 6) {
            let name = rest.split([' ', '\t']).next().unwrap_or_default().replace('-', "_");
            flags.push((name, String::new()));
        } else if let Some((_, text)) = flags.last_mut() {
            text.push(' ');
            text.push_str(trimmed);
        }
    }
    let mut checked = 0;
    for (name, text) in &flags {
        let Some(start) = text.find("[default: ") else { continue };
        let said = &text[start + 10..];
        let said = &said[..said.find(']').unwrap()];
        let Some(value) = defaults.get(name) else { continue };
        let value = match value {
            toml::Value::String(s) => s.clone(),
            toml::Value::Float(f) => format!("{f}"),
            other => other.to_string(),
        };
        // Descriptive defaults ("the model's context length", "a quarter of ...") are words.
        if said.parse::<f64>().is_err() && said.contains(' ') {
            continue;
        }
        let same = match (said.parse::<f64>(), value.parse::<f64>()) {
            (Ok(a), Ok(b)) => a == b,
            _ => said == value,
        };
        assert!(same, "--{name}: the help says {said}, the default is {value}");
        checked += 1;
    }
    assert!(checked >= 15, "only {checked} defaults checked: is the help's format still read?");
}
