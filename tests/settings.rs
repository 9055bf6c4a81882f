//! One place for settings (issue 24): the library reads the process environment only in
//! `host/contracts/config.rs`, which parses every variable into its typed `Config`; everything
//! else takes its settings from a communicator's options or from that module's accessor.
//! `host/bin/` holds programs, not the library, and is left out.

use std::path::{Path, PathBuf};

const READS: [&str; 3] = ["env::var", "var_os(", "env::vars"];
const THE_PLACE: &str = "host/contracts/config.rs";

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn only_config_rs_reads_the_environment() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("host"), &mut files);
    assert!(files.len() > 50, "host/ looks empty: {files:?}");
    let mut offenders = Vec::new();
    for file in files {
        let name = file.strip_prefix(root).unwrap().to_string_lossy().replace('\\', "/");
        if name == THE_PLACE || name.starts_with("host/bin/") {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        for (n, line) in text.lines().enumerate() {
            if READS.iter().any(|r| line.contains(r)) {
                offenders.push(format!("{name}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "the environment is read outside {THE_PLACE} (take the setting from Config):\n{}",
        offenders.join("\n")
    );
}
