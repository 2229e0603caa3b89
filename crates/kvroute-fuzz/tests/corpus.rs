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
