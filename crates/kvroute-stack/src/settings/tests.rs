#![allow(clippy::unwrap_used)]

use super::*;
use crate::Access;
use clap::Args;
use kvroute_core::schedule::PolicyKind;
use kvroute_core::schedule::cost::KvConfig;
use kvroute_router::RouterConfig;
use kvroute_router::WorkerSpec;
use std::path::Path;

/// Every key (`serve` and `frontend` together).
fn all() -> Vec<String> {
    keys_of::<Settings>()
}

/// What `kvroute router` takes: the groups its command flattens.
fn router_keys() -> Vec<String> {
    #[derive(clap::Args)]
    struct Router {
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
    }
    keys_of::<Router>()
}

fn workers(workers: Vec<WorkerSpec>) -> Settings {
    let routing = Routing { workers, ..Routing::default() };
    Settings { routing, ..Settings::default() }
}

fn weight(name: &str, value: f64) -> Settings {
    let routing = Routing { kv_cost: vec![(name.to_owned(), value)], ..Routing::default() };
    Settings { routing, ..Settings::default() }
}

fn file(text: &str) -> Settings {
    Settings::from_toml(text, Path::new("f.toml"), &all(), "serve").unwrap()
}

fn router_file(text: &str) -> String {
    let err = Settings::from_toml(text, Path::new("f.toml"), &router_keys(), "router");
    kvroute_http::error::chain(&err.unwrap_err())
}

#[test]
fn a_flag_wins_over_the_file_and_the_file_over_the_default() {
    let from_file = file("block_size = 32\npolicy = \"dynamo\"\nshards = 2\n");
    let routing = Routing { policy: Some(PolicyKind::RoundRobin), ..Routing::default() };
    let flags = Settings { routing, ..Settings::default() };
    let merged = from_file.overlaid_by(flags).unwrap();
    let router = merged.router_config().unwrap();
    assert_eq!(router.scheduler.policy, PolicyKind::RoundRobin, "flag over file");
    assert_eq!((router.block_size.get(), router.shards), (32, 2), "file over default");
    assert_eq!(
        router.index.max_held_blocks,
        RouterConfig::default().index.max_held_blocks,
        "default"
    );
    assert_eq!(merged.engine_config().unwrap().block_size.get(), 32, "one block size for all");
}

#[test]
fn keys_a_command_does_not_use_are_errors() {
    let err = router_file("num_blocks = 10\n");
    assert!(err.contains("`num_blocks` does not apply to `kvroute router`"), "{err}");
    let err = router_file("blocksize = 10\n");
    assert!(err.contains("unknown key `blocksize`"), "{err}");
    let err = router_file("block_size = \"x\"\n");
    assert!(err.starts_with("f.toml: ") && err.contains("block_size"), "{err}");
}

#[test]
fn workers_add_up_and_the_same_id_must_agree() {
    let from_file = file(
        "[[workers]]\nid = 1\nurl = \"http://127.0.0.1:9001\"\nformat = \"sglang\"\n[[workers]]\nid = 2\n",
    );
    let same: WorkerSpec = "id=1,url=http://127.0.0.1:9001,format=sglang".parse().unwrap();
    let new: WorkerSpec = "id=3".parse().unwrap();
    let flags = workers(vec![same, new]);
    let merged = from_file.clone().overlaid_by(flags).unwrap();
    let ids: Vec<u64> = merged.routing.workers.iter().map(|w| w.id.0).collect();
    assert_eq!(ids, [1, 2, 3]);
    let other: WorkerSpec = "id=2,url=http://127.0.0.1:9002".parse().unwrap();
    let err = from_file.overlaid_by(workers(vec![other])).unwrap_err().to_string();
    assert!(err.contains("worker 2 is given twice"), "{err}");
}

#[test]
fn kv_cost_weights_come_by_name_from_the_file_and_the_flags() {
    let from_file = file("[kv_cost]\nqueue_weight = 0.25\neviction_weight = 2.0\n");
    let flags = weight("eviction_weight", 0.5);
    let merged = from_file.overlaid_by(flags).unwrap();
    let kv = merged.router_config().unwrap().scheduler.kv;
    let default = KvConfig::default();
    assert_eq!((kv.queue_weight, kv.eviction_weight), (0.25, 0.5), "file, then the flag over it");
    assert_eq!(kv.decode_full_cache_tokens, default.decode_full_cache_tokens, "the rest default");
    assert_eq!(file(&merged.to_toml()), merged, "printed back as a [kv_cost] table");
    let named = weight;
    let err = named("queue_wieght", 1.0).router_config().unwrap_err().to_string();
    assert!(err.contains("unknown kv_cost weight `queue_wieght`"), "{err}");
    assert!(err.contains("queue_weight"), "the known names are listed: {err}");
    let err = named("queue_weight", -1.0).router_config().unwrap_err().to_string();
    assert!(err.contains("must be >= 0"), "{err}");
    assert!(named("queue_weight", f64::NAN).router_config().is_err());
}

#[test]
fn settings_print_as_a_file_that_reads_back() {
    let mut s = workers(vec!["id=4,events=tcp://127.0.0.1:5557".parse().unwrap()]);
    s.listen.port = Some(9000);
    s.engine.speedup = Some(2.5);
    s.front_door.parity_probe = Some(false);
    assert_eq!(file(&s.to_toml()), s);
    assert!(s.to_toml().contains("parity_probe = false"), "{}", s.to_toml());
    assert_eq!(s.address(8000), "127.0.0.1:9000");
    let v6 = file("host = \"::1\"");
    assert_eq!(v6.address(8000), "[::1]:8000");
    let bad = file("speedup = 0.0");
    assert!(bad.engine_config().is_err());
}

#[test]
fn keys_come_from_files_and_the_environment_and_exposure_needs_them() {
    let dir = std::env::temp_dir().join(format!("kvroute-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let keys_file = dir.join("keys");
    std::fs::write(&keys_file, "# clients\nsk-from-file-1\n\nsk-from-file-2\n").unwrap();
    let token_file = dir.join("token");
    std::fs::write(&token_file, "router-token-1\n").unwrap();
    let mut s = file("host = \"0.0.0.0\"");
    s.front_door.api_keys_file = Some(keys_file);
    s.remote.router_token_file = Some(token_file);
    let env = |name: &str| match name {
        ENV_API_KEYS => Some("sk-from-env-1, sk-from-env-2".to_owned()),
        _ => None,
    };
    let access = s.access_with_env(env).unwrap();
    assert_eq!(access.api_keys.len(), 4);
    assert!(access.api_keys.accepts("sk-from-env-2") && access.api_keys.accepts("sk-from-file-1"));
    assert_eq!(access.router_token.as_deref(), Some("router-token-1"));
    let err = s.check_exposure(&access, true).unwrap_err().to_string();
    assert!(err.contains("without an admin token") && !err.contains("API keys"), "{err}");
    let admin = |_: &str| Some("admin-token-1".to_owned());
    let full = s.access_with_env(admin).unwrap();
    assert!(s.check_exposure(&full, true).is_ok());
    let open = file("host = \"0.0.0.0\"");
    let err = open.check_exposure(&Access::default(), true).unwrap_err().to_string();
    assert!(err.contains("API keys") && err.contains("admin token"), "{err}");
    assert!(open.check_exposure(&Access::default(), true).is_err());
    let mut insecure = open.clone();
    insecure.security.insecure = Some(true);
    assert!(insecure.check_exposure(&Access::default(), true).is_ok());
    for host in ["127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"] {
        assert!(is_loopback(host), "{host}");
    }
    for host in ["0.0.0.0", "::", "10.0.0.1", "example.invalid"] {
        assert!(!is_loopback(host), "{host}");
    }
    let bad = |_: &str| Some("short".to_owned());
    assert!(open.access_with_env(bad).is_err(), "a short key is refused");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every setting's one declaration gives a flag and a file key that mean the same: set by its
/// flag alone, it equals the file holding that key alone (a value per setting: its default,
/// else a sample of its type).
#[test]
fn every_setting_reads_the_same_from_its_flag_and_from_the_file() {
    use clap::FromArgMatches as _;
    let command =
        decorate(Settings::augment_args(clap::Command::new("all")), &Settings::defaults(8000));
    let defaults = toml::Table::try_from(Settings::defaults(8000)).unwrap();
    let sample = |key: &str| -> toml::Value {
        match key {
            "nats_snapshot_every" | "max_model_len" => 7.into(),
            "ext_proc_port" => 9002.into(),
            "ext_proc_health_port" => 9003.into(),
            "kv_transfer_bandwidth_across_nodes" => 7.5.into(),
            _ => "/x".into(),
        }
    };
    // Settings that only go together.
    let companion = |key: &str| match key {
        "tls_cert" => Some("tls_key"),
        "tls_key" => Some("tls_cert"),
        "nats_tls_cert" => Some("nats_tls_key"),
        "nats_tls_key" => Some("nats_tls_cert"),
        "ext_proc_tls_cert" => Some("ext_proc_tls_key"),
        "ext_proc_tls_key" => Some("ext_proc_tls_cert"),
        // The picker's settings need its port.
        "epp_fallbacks"
        | "epp_endpoint_scores"
        | "endpoints_file"
        | "ext_proc_self_signed"
        | "ext_proc_token_file"
        | "ext_proc_health_port" => Some("ext_proc_port"),
        _ => None,
    };
    let long = |key: &str| {
        let arg = command.get_arguments().find(|a| a.get_id() == key).unwrap();
        arg.get_long().unwrap().to_owned()
    };
    let mut checked = 0;
    for key in keys_of::<Settings>() {
        let (flags, text) = match key.as_str() {
            "workers" => {
                (vec!["--worker".to_owned(), "id=3".to_owned()], "[[workers]]\nid = 3\n".to_owned())
            }
            "kv_cost" => (
                vec!["--kv-cost".to_owned(), "queue_weight=0.5".to_owned()],
                "[kv_cost]\nqueue_weight = 0.5\n".to_owned(),
            ),
            "pd_cost" => (
                vec!["--pd-cost".to_owned(), "in_place=0".to_owned()],
                "[pd_cost]\nin_place = 0.0\n".to_owned(),
            ),
            "model_priorities" => (
                vec!["--model-priority".to_owned(), "chat=5,base=-1".to_owned()],
                "model_priorities = [\"chat=5\", \"base=-1\"]\n".to_owned(),
            ),
            "lora_modules" | "adapters" => (
                vec![format!("--{}", long(&key)), "sql=/x,chat".to_owned()],
                format!("{key} = [\"sql=/x\", \"chat\"]\n"),
            ),
            "members_allow" => (
                vec!["--members-allow".to_owned(), "10.0.0.0/8,fd00::/8".to_owned()],
                "members_allow = [\"10.0.0.0/8\", \"fd00::/8\"]\n".to_owned(),
            ),
            _ => {
                let mut flags = Vec::new();
                let mut text = String::new();
                for key in [Some(key.as_str()), companion(&key)].into_iter().flatten() {
                    let long = long(key);
                    let value = defaults.get(key).cloned().unwrap_or_else(|| sample(key));
                    flags.push(format!("--{long}"));
                    let value = match value {
                        toml::Value::Boolean(_) => {
                            let negated = long.starts_with("no-") || long.contains("-no-");
                            toml::Value::Boolean(!negated)
                        }
                        toml::Value::String(s) => {
                            flags.push(s.clone());
                            toml::Value::String(s)
                        }
                        other => {
                            flags.push(other.to_string());
                            other
                        }
                    };
                    text.push_str(&format!("{key} = {value}\n"));
                }
                (flags, text)
            }
        };
        let matches = command
            .clone()
            .try_get_matches_from(std::iter::once("all".to_owned()).chain(flags.clone()))
            .unwrap_or_else(|e| panic!("{flags:?}: {e}"));
        let from_flags = Settings::from_arg_matches(&matches).unwrap();
        assert_ne!(from_flags, Settings::default(), "{flags:?} set nothing");
        assert_eq!(from_flags, file(&text), "{flags:?} against the file's\n{text}");
        checked += 1;
    }
    assert!(checked >= 50, "only {checked} settings");
}

#[test]
fn each_variable_is_named_after_its_flag_and_each_help_shows_its_default() {
    let command =
        decorate(Settings::augment_args(clap::Command::new("all")), &Settings::defaults(8001));
    let arg = |key: &str| command.get_arguments().find(|a| a.get_id() == key).unwrap().clone();
    let env = |key: &str| arg(key).get_env().unwrap().to_string_lossy().into_owned();
    assert_eq!(env("block_size"), "KVROUTE_BLOCK_SIZE");
    assert_eq!(env("parity_probe"), "KVROUTE_NO_PARITY_PROBE", "a negated switch's is its flag's");
    assert_eq!(env("nats_sync"), "KVROUTE_NATS_NO_SYNC");
    assert_eq!(env("workers"), "KVROUTE_WORKERS", "a declared one is kept");
    assert!(command.get_arguments().all(|a| a.get_env().is_some()), "every setting has one");
    let help = |key: &str| arg(key).get_help().unwrap().to_string();
    let block = kvroute_core::BlockSize::default().get();
    assert!(help("block_size").ends_with(&format!("[default: {block}]")), "{}", help("block_size"));
    assert!(help("port").ends_with("[default: 8001]"), "the command's port");
    assert!(!help("insecure").contains("[default"), "switches say nothing");
    assert!(help("max_model_len").contains("the model's context length"), "or words");
    // The order of declaration survives the decoration.
    let ids: Vec<String> = command.get_arguments().map(|a| a.get_id().to_string()).collect();
    assert_eq!(ids, keys_of::<Settings>());
}

#[test]
fn a_switch_is_named_or_left_out_and_a_bad_value_names_its_key() {
    use clap::FromArgMatches as _;
    let command = Settings::augment_args(clap::Command::new("all"));
    let parse = |args: &[&str]| {
        let matches = command.clone().try_get_matches_from(args).unwrap();
        Settings::from_arg_matches(&matches).unwrap()
    };
    let named = parse(&["all", "--no-parity-probe", "--insecure"]);
    assert_eq!(named.front_door.parity_probe, Some(false));
    assert_eq!(named.security.insecure, Some(true));
    let absent = parse(&["all"]);
    assert_eq!((absent.front_door.parity_probe, absent.security.insecure), (None, None));
    assert!(command.clone().try_get_matches_from(["all", "--insecure=yes"]).is_err());
    let err = Settings::from_toml(
        "shards = 2\nblock_size = \"x\"\n",
        Path::new("f.toml"),
        &all(),
        "serve",
    )
    .unwrap_err();
    assert!(err.to_string().contains("`block_size`"), "{}", kvroute_http::error::chain(&err));
}

/// The simulated engines' links price the pair cost's transfers, unless it names its own;
/// `--node` labels an engine as the router labels a worker.
#[test]
fn the_engines_links_price_the_pairs() {
    let mut s = Settings::default();
    let pairs = s.router_config().unwrap().scheduler.pairs;
    assert_eq!(pairs, kvroute_core::schedule::PairConfig::default(), "nothing given");
    s.engine.kv_transfer_bandwidth = Some(40.0);
    let pairs = s.router_config().unwrap().scheduler.pairs;
    assert_eq!((pairs.link_within_node_gbps, pairs.link_across_nodes_gbps), (40.0, 40.0));
    s.engine.kv_transfer_bandwidth_across_nodes = Some(4.0);
    s.routing.pd_cost = vec![("link_within_node_gbps".into(), 400.0)];
    let pairs = s.router_config().unwrap().scheduler.pairs;
    assert_eq!((pairs.link_within_node_gbps, pairs.link_across_nodes_gbps), (400.0, 4.0));
    let disagg = s.engine_config().unwrap().disagg;
    assert_eq!((disagg.kv_transfer_bandwidth_gbps, disagg.node), (40.0, 0));
    assert_eq!(disagg.link_gbps(9), 4.0);
    s.engine.node = Some("rack-1".into());
    let node = s.engine_config().unwrap().disagg.node;
    assert_eq!(node, kvroute_core::schedule::pairs::node_id(Some("rack-1")));
    assert_ne!(node, 0);
    s.engine.kv_transfer_bandwidth_across_nodes = Some(-1.0);
    assert!(s.engine_config().is_err());
}

/// `--model-priority NAME=N`: each model's priority; a malformed or out-of-range entry is
/// refused at start, naming it.
#[test]
fn model_priorities_are_read_and_bad_ones_refused() {
    let mut s = Settings::default();
    s.front_door.model_priorities = vec!["chat=5".into(), " base = -1".into()];
    let read = s.model_priorities().unwrap();
    assert_eq!(read.get("chat"), Some(&5));
    assert_eq!(read.get("base"), Some(&-1));
    for bad in ["chat", "chat=x", "=3", "chat=1000"] {
        s.front_door.model_priorities = vec![bad.into()];
        let e = s.model_priorities().unwrap_err().to_string();
        assert!(e.contains(bad.trim()), "{e}");
    }
}
