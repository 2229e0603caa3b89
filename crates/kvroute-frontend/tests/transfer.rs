//! kvroute's list of KV-transfer fields against the engines' own request models, read from
//! their wheels (`scripts/engine-request-fields` wrote the fixtures): every field an engine
//! documents as steering a transfer is on the list, and every entry of the list is a field
//! of some engine's.

use std::collections::BTreeSet;

use kvroute_frontend::transfer::{NESTED_IN, TRANSFER_FIELDS};

/// (engine file, class, field, what the source says of it) of every fixture.
fn fields() -> Vec<(String, String, String, String)> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/engine-request-fields");
    let mut out = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("the fixtures")
        .map(|e| e.expect("an entry").path())
        .collect();
    files.sort();
    assert_eq!(files.len(), 2, "vLLM's and SGLang's: {files:?}");
    for path in files {
        let text = std::fs::read_to_string(&path).expect("a fixture");
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let cols: Vec<&str> = line.split('\t').collect();
            assert_eq!(cols.len(), 4, "{}: {line}", path.display());
            out.push((cols[0].into(), cols[1].into(), cols[2].into(), cols[3].to_lowercase()));
        }
    }
    out
}

/// What an engine says of a field that steers a transfer: KV or encoder-cache transfer
/// parameters, disaggregated (prefill/decode, encoder) serving, bootstrap, KV hints for a
/// trusted orchestrator, encoder URLs.
fn steers_a_transfer(field: &str, said: &str) -> bool {
    let text = format!("{field} {said}").to_lowercase();
    ["transfer", "disagg", "bootstrap", "kv_hint", "kv-hint", "encoder url", "encoder_url"]
        .iter()
        .any(|k| text.contains(k))
}

#[test]
fn every_field_an_engine_documents_as_a_transfer_is_refused() {
    let fields = fields();
    assert!(fields.len() > 900, "the request models of both engines: {}", fields.len());
    let listed: BTreeSet<&str> = TRANSFER_FIELDS.iter().copied().collect();
    let missing: BTreeSet<String> = fields
        .iter()
        .filter(|(_, _, f, said)| steers_a_transfer(f, said))
        .filter(|(_, _, f, _)| !listed.contains(f.as_str()))
        .map(|(file, class, f, _)| format!("{file} {class}.{f}"))
        .collect();
    assert!(missing.is_empty(), "transfer fields not on the list: {missing:?}");
}

#[test]
fn every_listed_field_is_an_engines_field() {
    let names: BTreeSet<String> = fields().into_iter().map(|(_, _, f, _)| f).collect();
    // TensorRT-LLM's field: its wheel is not read here (its server takes it on
    // `/v1/completions` and `/v1/chat/completions`, `tensorrt_llm/serve/openai_protocol.py`).
    let elsewhere = ["disaggregated_params"];
    for field in TRANSFER_FIELDS.iter().chain(NESTED_IN) {
        assert!(
            names.contains(*field) || elsewhere.contains(field),
            "{field} is no field of the engines' request models"
        );
    }
}
