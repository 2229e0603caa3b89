//! The engine command lines of `docs/engines.md` and the README, checked so they cannot drift:
//! every flag of a `vllm serve` or `python -m sglang.launch_server` line must be one that
//! engine's parser defines, and its `--kv-events-config` JSON may hold only that engine's
//! `KVEventsConfig` keys (both read from the engines' wheels by `scripts/engine-flags` into
//! `fixtures/engine-flags.json`); every `kvroute` line must be accepted by the binary itself
//! (`--print-config` runs serve's own checks and exits).

#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;

use serde_json::Value;

mod common;
use common::kvroute;

/// A document's shell commands: the lines of its ```sh blocks, continuations joined.
fn commands(doc: &str) -> Vec<String> {
    let (mut out, mut inside, mut current) = (Vec::new(), false, String::new());
    for line in doc.lines() {
        if line.starts_with("```") {
            inside = line == "```sh";
            continue;
        }
        if !inside {
            continue;
        }
        match line.trim_end().strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(line);
                out.push(std::mem::take(&mut current).trim().to_owned());
            }
        }
    }
    out
}

/// A command line's words, with '...' quoting as the shell reads it (no escapes inside).
fn words(line: &str) -> Vec<String> {
    let (mut out, mut word, mut quoted, mut any) = (Vec::new(), String::new(), false, false);
    for c in line.chars() {
        match c {
            '\'' => (quoted, any) = (!quoted, true),
            c if c.is_whitespace() && !quoted => {
                if any {
                    out.push(std::mem::take(&mut word));
                }
                any = false;
            }
            c => (word, any) = (word + &c.to_string(), true),
        }
    }
    assert!(!quoted, "unclosed quote: {line}");
    if any {
        out.push(word);
    }
    out
}

struct Engine {
    flags: BTreeSet<String>,
    events: BTreeSet<String>,
}

fn engine(fixture: &Value, name: &str) -> Engine {
    let set = |key: &str| -> BTreeSet<String> {
        fixture[name][key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_owned())
            .collect()
    };
    Engine { flags: set("flags"), events: set("kv_events_config") }
}

/// Every flag of an engine's command line is its parser's, and its events config is JSON of
/// its keys that turns publishing on. Returns what was checked, for the caller's count.
fn check_engine(line: &str, args: &[String], engine: &Engine, name: &str) -> usize {
    let mut checked = 0;
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        if let Some(flag) =
            arg.strip_prefix("--").map(|f| format!("--{}", f.split('=').next().unwrap()))
        {
            assert!(engine.flags.contains(&flag), "{name} has no flag {flag}: {line}");
            checked += 1;
            if flag == "--kv-events-config" {
                let json: Value = serde_json::from_str(&args[i + 1]).unwrap_or_else(|e| {
                    panic!("{name}'s --kv-events-config is not JSON ({e}): {line}")
                });
                let keys: BTreeSet<String> = json.as_object().unwrap().keys().cloned().collect();
                let unknown: Vec<_> = keys.difference(&engine.events).collect();
                assert!(unknown.is_empty(), "{name}'s KVEventsConfig has no {unknown:?}: {line}");
                assert_eq!(json["publisher"], "zmq", "{line}");
                assert!(
                    json["endpoint"].as_str().is_some_and(|e| e.starts_with("tcp://")),
                    "{line}"
                );
                if engine.events.contains("enable_kv_cache_events") {
                    assert_eq!(json["enable_kv_cache_events"], true, "{line}");
                }
            }
        }
        i += 1;
    }
    checked
}

#[test]
fn documented_engine_lines_use_the_engines_own_flags() {
    let fixture: Value = serde_json::from_str(include_str!("fixtures/engine-flags.json")).unwrap();
    let (vllm, sglang) = (engine(&fixture, "vllm"), engine(&fixture, "sglang"));
    assert_eq!(
        (fixture["vllm"]["version"].as_str(), fixture["sglang"]["version"].as_str()),
        (Some("0.33.0"), Some("0.5.23"))
    );
    // The fixture is not a list that accepts anything: a flag the engines dropped is absent.
    assert!(
        !vllm.flags.contains("--enable-kv-cache-events") && !sglang.flags.contains("--block-size")
    );
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let (mut engines, mut kvroutes) = (Vec::new(), 0);
    for doc in ["docs/engines.md", "README.md"] {
        let text = std::fs::read_to_string(format!("{root}/{doc}")).unwrap();
        for line in commands(&text) {
            let args = words(&line);
            match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
                ["vllm", "serve", ..] => {
                    engines.push(("vllm", check_engine(&line, &args, &vllm, "vllm")));
                }
                ["python", "-m", "sglang.launch_server", ..] => {
                    engines.push(("sglang", check_engine(&line, &args, &sglang, "sglang")));
                }
                ["kvroute", sub @ ("serve" | "frontend" | "router" | "mocker"), ..]
                    if line.contains("--worker") =>
                {
                    let out = kvroute().args(&args[1..]).arg("--print-config").output().unwrap();
                    let err = String::from_utf8_lossy(&out.stderr);
                    assert!(
                        out.status.success(),
                        "kvroute {sub} refuses {doc}'s line ({err}): {line}"
                    );
                    kvroutes += 1;
                }
                _ => {}
            }
        }
    }
    let count = |name| engines.iter().filter(|(n, _)| *n == name).count();
    assert!(
        count("vllm") >= 2 && count("sglang") >= 2,
        "a line per engine in the README and docs: {engines:?}"
    );
    assert!(engines.iter().all(|&(_, flags)| flags >= 3), "{engines:?}");
    assert!(kvroutes >= 4, "the matching kvroute lines: {kvroutes}");
}

#[test]
fn the_doc_parser_reads_what_a_shell_reads() {
    let doc =
        "text\n```sh\nvllm serve m \\\n  --kv-events-config '{\"a\": 1}'\n```\n```json\n{}\n```\n";
    let lines = commands(doc);
    assert_eq!(lines, ["vllm serve m   --kv-events-config '{\"a\": 1}'"]);
    assert_eq!(words(&lines[0]), ["vllm", "serve", "m", "--kv-events-config", "{\"a\": 1}"]);
    let fixture: Value = serde_json::from_str(include_str!("fixtures/engine-flags.json")).unwrap();
    let vllm = engine(&fixture, "vllm");
    let bad = words("vllm serve m --enable-prefix-cache");
    assert!(
        std::panic::catch_unwind(|| check_engine("", &bad, &vllm, "vllm")).is_err(),
        "a misspelt flag fails"
    );
}
