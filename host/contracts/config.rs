//! The one table of ferrocomm's environment variables, and the warning for a `FERROCOMM_*`
//! variable that is none of them (most often a typo, which would otherwise be ignored in
//! silence). The README's table lists the same names; a unit test holds the two together.

/// Every `FERROCOMM_*` variable the library, its binaries and its build read.
pub(crate) const VARIABLES: [&str; 28] = [
    "FERROCOMM_TIMEOUT",
    "FERROCOMM_ABORT_ON_ERROR",
    "FERROCOMM_CHECK_CALLS",
    "FERROCOMM_TOKEN",
    "FERROCOMM_STORE",
    "FERROCOMM_STORE_EXTERNAL",
    "FERROCOMM_RUN_GRACE",
    "FERROCOMM_TRANSPORT",
    "FERROCOMM_SHM_RING_BYTES",
    "FERROCOMM_SOCKET_ADDR",
    "FERROCOMM_NET",
    "FERROCOMM_MULTICAST",
    "FERROCOMM_PYTHON",
    "FERROCOMM_PROXY_AFFINITY",
    "FERROCOMM_PROXY_POLL_US",
    "FERROCOMM_CPU_DIRECT_MAX",
    "FERROCOMM_CPU_CHUNK",
    "FERROCOMM_LOG",
    "FERROCOMM_NVRTC_PATH",
    "FERROCOMM_NCCL_PATH",
    "FERROCOMM_NCCL",
    "FERROCOMM_NCCL_THRESHOLD",
    "FERROCOMM_DEVICE_ONESHOT_MAX",
    "FERROCOMM_DEVICE_TWOSHOT_MIN",
    "FERROCOMM_REQUIRE_NVCC",
    "FERROCOMM_REQUIRE_NVRTC",
    "FERROCOMM_REQUIRE_NCCL",
    "FERROCOMM_REQUIRE_GPU",
];

/// Variables the project's own tests set for their child processes (README, "Tests").
const TEST_PREFIXES: [&str; 5] = [
    "FERROCOMM_TEST_",
    "FERROCOMM_FAULT_",
    "FERROCOMM_INTEGRITY_",
    "FERROCOMM_RELIABILITY_",
    "FERROCOMM_EXAMPLE_",
];

/// The `FERROCOMM_*` names among `names` that nothing reads, each with the known name it most
/// resembles (when one is close).
pub(crate) fn unknown(names: impl Iterator<Item = String>) -> Vec<(String, Option<&'static str>)> {
    names
        .filter(|n| n.starts_with("FERROCOMM_") && !VARIABLES.contains(&n.as_str()))
        .filter(|n| !TEST_PREFIXES.iter().any(|p| n.starts_with(p)))
        .map(|n| {
            let near = VARIABLES
                .iter()
                .map(|k| (edit_distance(&n, k), *k))
                .min()
                .filter(|(d, _)| *d <= 3)
                .map(|(_, k)| k);
            (n, near)
        })
        .collect()
}

/// Warns once per process about unknown `FERROCOMM_*` variables.
pub(crate) fn warn_unknown_once() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let names = std::env::vars_os().filter_map(|(k, _)| k.into_string().ok());
        for (name, near) in unknown(names) {
            match near {
                Some(k) => tracing::warn!(variable = %name, "unknown ferrocomm variable, ignored: did you mean {k}?"),
                None => tracing::warn!(variable = %name, "unknown ferrocomm variable, ignored (README lists them all)"),
            }
        }
    });
}

/// Levenshtein distance, for the "did you mean" of a misspelt name.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let up = row[j + 1];
            row[j + 1] = (up + 1).min(row[j] + 1).min(diag + usize::from(ca != *cb));
            diag = up;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_misspelt_variable_is_named_with_the_one_it_resembles() {
        let names = [
            "FERROCOMM_TIMOUT",
            "FERROCOMM_TIMEOUT",
            "FERROCOMM_WHATEVER_ELSE",
            "PATH",
            "FERROCOMM_TEST_SEED",
        ];
        let got = unknown(names.iter().map(|s| s.to_string()));
        assert_eq!(
            got,
            vec![
                ("FERROCOMM_TIMOUT".to_string(), Some("FERROCOMM_TIMEOUT")),
                ("FERROCOMM_WHATEVER_ELSE".to_string(), None)
            ]
        );
    }

    #[test]
    fn the_readme_lists_exactly_these_variables() {
        let readme = include_str!("../../README.md");
        let table = readme
            .split("## Environment variables")
            .nth(1)
            .and_then(|t| t.split("\n## ").next())
            .expect("README has an environment table");
        let mut listed: Vec<&str> = table
            .split('`')
            .filter(|w| w.starts_with("FERROCOMM_") && w.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
            .collect();
        listed.sort_unstable();
        listed.dedup();
        let mut known = VARIABLES.to_vec();
        known.sort_unstable();
        assert_eq!(listed, known, "README's environment table and config::VARIABLES differ");
    }
}
