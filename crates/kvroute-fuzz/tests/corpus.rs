//! Replays every fuzz target's corpus (`fuzz/corpus/<target>`, seeded from the engines' wire
//! fixtures) and the inputs that once crashed one (`fuzz/regressions/<target>`) as ordinary
//! tests: each must go through without a panic.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

fn inputs(kind: &str, target: &str) -> Vec<PathBuf> {
    let dir = root().join(kind).join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
    let mut files: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    files.sort();
    files
}

#[test]
fn every_target_has_a_seed_corpus_and_replays_it() {
    for (target, run) in kvroute_fuzz::TARGETS {
        let corpus = inputs("corpus", target);
        assert!(!corpus.is_empty(), "fuzz/corpus/{target} has no seeds");
        for path in corpus.iter().chain(&inputs("regressions", target)) {
            let Ok(bytes) = std::fs::read(path) else { panic!("reading {}", path.display()) };
            run(&bytes);
        }
    }
}

#[test]
fn every_cargo_fuzz_target_is_listed() {
    let Ok(entries) = std::fs::read_dir(root().join("fuzz_targets")) else {
        panic!("fuzz/fuzz_targets")
    };
    let mut on_disk: Vec<String> = entries
        .filter_map(|e| e.ok()?.path().file_stem().map(|s| s.to_string_lossy().into_owned()))
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> =
        kvroute_fuzz::TARGETS.iter().map(|(t, _)| (*t).to_owned()).collect();
    listed.sort();
    assert_eq!(on_disk, listed);
}

#[test]
fn the_zmtp_seeds_decode_as_a_socket_would_and_the_attacks_are_refused() {
    let seed = |name: &str| std::fs::read(root().join("corpus/zmtp").join(name)).unwrap();
    for split in [0, 7, 255] {
        assert_eq!(kvroute_fuzz::zmtp_messages(&seed(&format!("pub-batches-{split}"))), (3, false));
        assert_eq!(
            kvroute_fuzz::zmtp_messages(&seed(&format!("router-replay-{split}"))),
            (2, false)
        );
    }
    for attack in ["packet-73", "message-400mib", "empty-parts", "bad-greeting"] {
        assert_eq!(kvroute_fuzz::zmtp_messages(&seed(attack)), (0, true), "{attack}");
    }
}

/// The ext_proc seeds are the messages `ext_proc_seeds` builds (rewrite them with
/// `KVROUTE_WRITE_SEEDS=1`), and each goes the whole way: picked and freed.
#[test]
fn the_ext_proc_seeds_are_built_from_the_protobuf_types() {
    let dir = root().join("corpus/ext_proc");
    for (name, bytes) in kvroute_fuzz::ext_proc_seeds() {
        let path = dir.join(name);
        if std::env::var_os("KVROUTE_WRITE_SEEDS").is_some() {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &bytes).unwrap();
        }
        assert_eq!(std::fs::read(&path).ok().as_ref(), Some(&bytes), "{name}");
    }
    let answers =
        |name: &str| kvroute_fuzz::ext_proc_answers(&std::fs::read(dir.join(name)).unwrap());
    // Headers and body unanswered until the body ends, then the headers and the body back,
    // then each response message answered.
    assert_eq!(answers("chat-full-duplex"), (5, false));
    assert_eq!(answers("completion-buffered"), (5, false));
    assert_eq!(answers("get-with-subset"), (1, false));
    assert_eq!(answers("body-first"), (0, true));
    // #64: a transfer field off the placed paths is refused; a native body is placed by its ids;
    // a deadline mid-body is a 408, after the pick the stream ends (its placement freed).
    assert_eq!(answers("generate-with-transfer"), (1, true));
    assert_eq!(answers("generate-placed"), (4, false));
    assert_eq!(answers("deadline-mid-body"), (1, true));
    assert_eq!(answers("deadline-after-pick"), (2, true));
}

/// The seeds with bytes flipped, cut and repeated (a fixed pseudo-random walk, bounded):
/// every mutant is answered or refused, never a panic, and leaves nothing in flight.
#[test]
fn mutated_ext_proc_streams_never_panic() {
    let seeds = kvroute_fuzz::ext_proc_seeds();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for round in 0..3_000 {
        let mut bytes = seeds[round % seeds.len()].1.clone();
        for _ in 0..1 + next() % 4 {
            let at = (next() as usize) % bytes.len().max(1);
            match next() % 4 {
                0 if !bytes.is_empty() => bytes[at] ^= 1 << (next() % 8),
                1 => bytes.truncate(at),
                2 => bytes.insert(at.min(bytes.len()), next() as u8),
                _ => {
                    let tail = bytes[at.min(bytes.len())..].to_vec();
                    bytes.extend_from_slice(&tail);
                }
            }
        }
        kvroute_fuzz::ext_proc(&bytes);
    }
}

/// The members target's signed seed verifies under the fuzz fleet's key, so the fuzzer starts
/// past the signature into the worker's own checks (#77).
#[test]
fn the_members_seed_holds_a_registration_signed_with_the_fuzz_key() {
    use kvroute_router::members::{MembersKey, Verifier};
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/members/signed");
    let text = std::fs::read(&path).unwrap();
    let verifier = Verifier {
        key: MembersKey::from_secret(kvroute_fuzz::MEMBERS_FUZZ_KEY).unwrap(),
        bucket: "fuzz".into(),
        ttl: std::time::Duration::from_secs(u64::MAX / 4_000),
        allow: vec!["127.0.0.0/8".parse().unwrap()],
    };
    let line = text.split(|&b| b == b'\n').next().unwrap();
    let tab = line.iter().position(|&b| b == b'\t').unwrap();
    let key = std::str::from_utf8(&line[..tab]).unwrap();
    let spec = verifier.verify(key, &line[tab + 1..]).unwrap();
    assert_eq!(spec.url.as_deref(), Some("http://127.0.0.1:8000"));
}
