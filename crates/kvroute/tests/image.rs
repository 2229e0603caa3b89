//! The container image's `Dockerfile`, checked statically: this machine has a Docker client but
//! no engine, and no registry to pull base images from, so the image is not built here. What
//! can break without a build is checked: a builder stage that builds this workspace's binary
//! with a toolchain at least the workspace's `rust-version`; a runtime stage that copies that
//! binary from it and runs as a non-root user; a default command the binary accepts; and a
//! `.dockerignore` that keeps build output and local environments out of the context.

#![allow(clippy::unwrap_used)]

mod common;
use common::kvroute;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

/// The Dockerfile's instructions: (keyword, arguments), continuation lines joined.
fn instructions(text: &str) -> Vec<(String, String)> {
    let (mut out, mut current) = (Vec::new(), String::new());
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        match line.strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(line);
                let (key, rest) = current.split_once(' ').unwrap_or((&current, ""));
                out.push((key.to_ascii_uppercase(), rest.trim().to_owned()));
                current.clear();
            }
        }
    }
    out
}

/// A JSON-form argument list (`["a", "b"]`).
fn exec_form(args: &str) -> Vec<String> {
    serde_json::from_str(args).unwrap_or_else(|e| panic!("not the exec form ({e}): {args}"))
}

fn version(v: &str) -> (u32, u32) {
    let mut parts = v.split('.').map(|p| p.parse::<u32>().unwrap());
    (parts.next().unwrap(), parts.next().unwrap_or(0))
}

#[test]
fn the_dockerfile_builds_the_binary_and_runs_it_unprivileged() {
    let text = std::fs::read_to_string(format!("{ROOT}/Dockerfile")).unwrap();
    let steps = instructions(&text);
    // Stages: FROM image AS name.
    let stages: Vec<(usize, String, String)> = steps
        .iter()
        .enumerate()
        .filter(|(_, (k, _))| k == "FROM")
        .map(|(i, (_, a))| {
            let words: Vec<&str> = a.split_whitespace().collect();
            assert_eq!(words.len(), 3, "FROM image AS name: {a}");
            assert!(words[1].eq_ignore_ascii_case("as"), "{a}");
            (i, words[0].to_owned(), words[2].to_owned())
        })
        .collect();
    assert_eq!(stages.len(), 2, "a builder and a runtime stage");
    let (builder, runtime) = (&stages[0], &stages[1]);
    let stage_steps = |from: usize, to: usize| &steps[from + 1..to];
    let build = stage_steps(builder.0, runtime.0);
    let run = stage_steps(runtime.0, steps.len());

    // The builder's toolchain is at least the workspace's floor.
    let manifest = std::fs::read_to_string(format!("{ROOT}/Cargo.toml")).unwrap();
    let floor =
        manifest.lines().find_map(|l| l.strip_prefix("rust-version = ")).unwrap().trim_matches('"');
    let tag = builder.1.strip_prefix("rust:").expect("the builder is the official rust image");
    let toolchain = tag.split('-').next().unwrap();
    assert!(
        version(toolchain) >= version(floor),
        "rust:{toolchain} is older than rust-version {floor}"
    );
    // It builds the release binary from the locked dependencies, and puts it where the
    // runtime copies it from.
    let runs: Vec<&str> =
        build.iter().filter(|(k, _)| k == "RUN").map(|(_, a)| a.as_str()).collect();
    let cargo = runs.iter().find(|r| r.contains("cargo build")).expect("a cargo build");
    for flag in ["--release", "--locked", "-p kvroute"] {
        assert!(cargo.contains(flag), "cargo build without {flag}: {cargo}");
    }
    let (_, copy) =
        run.iter().find(|(k, a)| k == "COPY" && a.starts_with("--from=")).expect("COPY --from");
    let words: Vec<&str> = copy.split_whitespace().collect();
    assert_eq!(words[0], format!("--from={}", builder.2), "copied from the builder: {copy}");
    assert!(cargo.contains(&format!("cp target/release/kvroute {}", words[1])), "{cargo} / {copy}");

    // Unprivileged: a numeric non-root user (Kubernetes' runAsNonRoot checks the number).
    let (_, user) = run.iter().rev().find(|(k, _)| k == "USER").expect("a USER");
    let uid: u32 = user.split(':').next().unwrap().parse().expect("a numeric USER");
    assert_ne!(uid, 0, "the runtime runs as root");
    assert!(
        run.iter().any(|(k, a)| k == "RUN" && a.contains(&format!("--uid {uid}"))),
        "user {uid} is created"
    );

    // The entry point is the copied binary, and the default command is one it accepts.
    let (_, entry) = run.iter().find(|(k, _)| k == "ENTRYPOINT").unwrap();
    assert_eq!(exec_form(entry), [words[2]]);
    let (_, cmd) = run.iter().find(|(k, _)| k == "CMD").unwrap();
    let cmd = exec_form(cmd);
    let out = kvroute().args(&cmd).arg("--print-config").output().unwrap();
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        printed.contains("host = \"0.0.0.0\""),
        "it listens beyond the container's loopback: {printed}"
    );
    // The front door's port, and the picker's (deploy/ runs it with ext_proc_port = 9002).
    let (_, expose) = run.iter().find(|(k, _)| k == "EXPOSE").unwrap();
    let ports: Vec<&str> = expose.split_whitespace().collect();
    assert_eq!(ports.len(), 2, "EXPOSE {expose}");
    assert!(printed.contains(&format!("port = {}", ports[0])), "EXPOSE {expose}: {printed}");
    let picker =
        std::fs::read_to_string(format!("{ROOT}/deploy/overlays/aggregated/kvroute.toml")).unwrap();
    assert!(picker.contains(&format!("ext_proc_port = {}", ports[1])), "EXPOSE {expose}");

    // The build context leaves out what would make it gigabytes.
    let ignore = std::fs::read_to_string(format!("{ROOT}/.dockerignore")).unwrap();
    for path in ["target/", ".venv/", ".git/"] {
        assert!(ignore.lines().any(|l| l.trim() == path), ".dockerignore lacks {path}");
    }
}

#[test]
fn the_dockerfile_reader_joins_and_splits_as_docker_does() {
    let steps = instructions("# c\nFROM a AS b\nRUN x \\\n && y\n\nuser 5\n");
    assert_eq!(steps.len(), 3);
    assert_eq!(steps[1], ("RUN".to_owned(), "x && y".to_owned()));
    assert_eq!(steps[2].0, "USER");
    assert_eq!(exec_form("[\"a\", \"b\"]"), ["a", "b"]);
    assert!(version("1.88") >= version("1.88") && version("1.9") < version("1.88"));
}
