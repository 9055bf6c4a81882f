//! The layering of host/ (docs/architecture.md), checked on the source: every file belongs to
//! a layer, imports nothing from a layer above its own, the public face reaches the backends
//! only through the registry, and no files import each other in a loop. And one place for
//! settings: only `contracts/config.rs` reads the process environment.
//!
//! An import is any path into this crate that a file names: `use` trees, `crate::`, `super::`
//! and `self::` paths, and paths through a child module it declares. A path resolves to the
//! file that defines the name, following `pub use` re-exports, so a folder's `mod.rs` that only
//! hands names on is not counted as their home. Test modules (`#[cfg(test)] mod ...` at the
//! end of a file) are left out: they may reach anywhere.
//!
//! `FERROCOMM_LAYERING_REPORT=1 cargo test --test layering -- --nocapture` prints every
//! file's layer and imports.

use regex::Regex;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, bottom up, by module path prefix (the longest prefix wins).
const LAYERS: &[(&str, usize, &str)] = &[
    ("contracts", 1, "contracts"),
    ("compute", 1, "contracts"),
    ("bootstrap", 2, "bootstrap and links"),
    ("net::links", 2, "bootstrap and links"),
    ("gpu", 3, "GPU wing"),
    ("net", 4, "window network"),
    ("net::windows", 4, "window network"),
    ("backend", 5, "backends"),
    ("", 6, "public face"),
];

/// The one module of layer 5 that the public face may import.
const REGISTRY: &str = "backend::registry";

type ModPath = Vec<String>;

struct SourceFile {
    module: ModPath,
    /// The path below host/, for messages.
    path: PathBuf,
    /// Whether the file is its module's folder file (`mod.rs`, `lib.rs`).
    is_folder: bool,
    code: String,
}

fn module_name(m: &[String]) -> String {
    if m.is_empty() {
        "lib".into()
    } else {
        m.join("::")
    }
}

fn layer_of(m: &[String]) -> (usize, &'static str) {
    let name = m.join("::");
    LAYERS
        .iter()
        .filter(|(prefix, ..)| prefix.is_empty() || name == *prefix || name.starts_with(&format!("{prefix}::")))
        .max_by_key(|(prefix, ..)| prefix.len())
        .map(|&(_, layer, what)| (layer, what))
        .expect("the empty prefix matches every module")
}

/// The code of a file that counts for imports: comments and the trailing test module removed.
fn code_of(text: &str) -> String {
    let line_comment = Regex::new(r"//[^\n]*").unwrap();
    let text = line_comment.replace_all(text, "");
    let tests = Regex::new(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{").unwrap();
    match tests.find(&text) {
        Some(m) => text[..m.start()].to_string(),
        None => text.to_string(),
    }
}

fn read_tree(root: &Path) -> Vec<SourceFile> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|e| e == "rs") {
                out.push(p);
            }
        }
    }
    let mut paths = Vec::new();
    walk(root, &mut paths);
    let mut files = Vec::new();
    for p in paths {
        let rel = p.strip_prefix(root).unwrap();
        // host/bin holds programs that use the library from outside.
        if rel.starts_with("bin") {
            continue;
        }
        let mut module: ModPath = rel
            .with_extension("")
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        let last = module.last().cloned().unwrap_or_default();
        let is_folder = last == "mod" || last == "lib";
        if is_folder {
            module.pop();
        }
        let code = code_of(&std::fs::read_to_string(&p).unwrap());
        files.push(SourceFile {
            module,
            path: rel.to_path_buf(),
            is_folder,
            code,
        });
    }
    files.sort_by(|a, b| a.module.cmp(&b.module));
    files
}

/// Expands a `use` tree (`a::{b, c::{d, e as f}}`) into its paths.
fn expand_use(tree: &str) -> Vec<Vec<String>> {
    fn split_top(s: &str) -> Vec<&str> {
        let (mut depth, mut start, mut out) = (0, 0, Vec::new());
        for (i, ch) in s.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    out.push(&s[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        out.push(&s[start..]);
        out
    }
    fn rec(prefix: &[String], tree: &str, out: &mut Vec<Vec<String>>) {
        for item in split_top(tree) {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            if let Some(open) = item.find('{') {
                let close = item.rfind('}').unwrap_or(item.len());
                let mut p = prefix.to_vec();
                p.extend(item[..open].split("::").filter(|s| !s.is_empty()).map(String::from));
                rec(&p, &item[open + 1..close], out);
            } else {
                let item = item.split(" as ").next().unwrap().trim();
                let mut p = prefix.to_vec();
                p.extend(
                    item.split("::")
                        .filter(|s| !s.is_empty() && *s != "self")
                        .map(String::from),
                );
                out.push(p);
            }
        }
    }
    let compact: String = tree.split_whitespace().collect::<Vec<_>>().join(" ");
    let compact = compact.replace(" :: ", "::").replace(":: ", "::").replace(" ::", "::");
    let mut out = Vec::new();
    rec(&[], &compact, &mut out);
    out
}

/// A path as written in `file`, made absolute (a crate module path plus names), or `None` for
/// a path outside this crate.
fn absolute(file: &SourceFile, path: &[String], children: &BTreeSet<String>) -> Option<Vec<String>> {
    let first = path.first()?;
    let parent: Vec<String> = if file.is_folder {
        file.module.clone()
    } else {
        file.module[..file.module.len().saturating_sub(1)].to_vec()
    };
    match first.as_str() {
        "crate" => Some(path[1..].to_vec()),
        "self" => {
            let mut m = file.module.clone();
            m.extend(path[1..].iter().cloned());
            Some(m)
        }
        "super" => {
            // `super` of a folder file is the folder's parent; of a plain file, its folder.
            let mut base = if file.is_folder {
                file.module[..file.module.len().saturating_sub(1)].to_vec()
            } else {
                parent
            };
            let mut i = 1;
            while path.get(i).is_some_and(|s| s == "super") {
                base.pop();
                i += 1;
            }
            base.extend(path[i..].iter().cloned());
            Some(base)
        }
        name if children.contains(name) => {
            let mut m = file.module.clone();
            m.extend(path.iter().cloned());
            Some(m)
        }
        _ => None,
    }
}

struct Graph {
    modules: BTreeSet<ModPath>,
    defs: BTreeMap<ModPath, BTreeSet<String>>,
    reexports: BTreeMap<ModPath, BTreeMap<String, Vec<String>>>,
    edges: BTreeMap<ModPath, BTreeSet<ModPath>>,
}

impl Graph {
    /// The file that defines what `path` names: the longest module prefix, then through that
    /// module's re-exports while the name is not its own.
    fn resolve(&self, path: &[String], depth: usize) -> Option<ModPath> {
        let i = (0..=path.len()).rev().find(|&i| self.modules.contains(&path[..i]))?;
        let (module, rest) = (path[..i].to_vec(), &path[i..]);
        if let Some(name) = rest.first() {
            let own = self.defs.get(&module).is_some_and(|d| d.contains(name));
            if !own && depth < 8 {
                if let Some(target) = self.reexports.get(&module).and_then(|r| r.get(name)) {
                    let mut next = target.clone();
                    next.extend(rest[1..].iter().cloned());
                    return self.resolve(&next, depth + 1);
                }
            }
        }
        Some(module)
    }
}

fn build_graph(files: &[SourceFile]) -> Graph {
    let use_re = Regex::new(r"(?m)^\s*(?:pub(?:\([^)]*\))?\s+)?use\s+([\w:{},\s*]+);").unwrap();
    let pub_use_re = Regex::new(r"(?m)^\s*pub(\([^)]*\))?\s+use\s+([\w:{},\s*]+);").unwrap();
    let path_re = Regex::new(r"\b(?:crate|super|self)(?:::\w+)+").unwrap();
    let def_re =
        Regex::new(r"\b(?:struct|enum|trait|fn|type|const|static|union)\s+(\w+)|macro_rules!\s*(\w+)").unwrap();
    let child_re = Regex::new(r"(?m)^\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;").unwrap();

    let mut g = Graph {
        modules: files.iter().map(|f| f.module.clone()).collect(),
        defs: BTreeMap::new(),
        reexports: BTreeMap::new(),
        edges: BTreeMap::new(),
    };
    let children_of =
        |f: &SourceFile| -> BTreeSet<String> { child_re.captures_iter(&f.code).map(|c| c[1].to_string()).collect() };
    for f in files {
        let defs = def_re
            .captures_iter(&f.code)
            .filter_map(|c| c.get(1).or(c.get(2)).map(|m| m.as_str().to_string()))
            .collect();
        g.defs.insert(f.module.clone(), defs);
        let children = children_of(f);
        let mut re = BTreeMap::new();
        for c in pub_use_re.captures_iter(&f.code) {
            for p in expand_use(&c[2]) {
                if let (Some(name), Some(abs)) = (p.last(), absolute(f, &p, &children)) {
                    re.insert(name.clone(), abs);
                }
            }
        }
        g.reexports.insert(f.module.clone(), re);
    }
    for f in files {
        let children = children_of(f);
        let mut refs: Vec<Vec<String>> = Vec::new();
        for c in use_re.captures_iter(&f.code) {
            refs.extend(expand_use(&c[1]));
        }
        refs.extend(
            path_re
                .find_iter(&f.code)
                .map(|m| m.as_str().split("::").map(String::from).collect()),
        );
        // A `mod child;` line declares, it does not import.
        let body = child_re.replace_all(&f.code, "");
        for child in &children {
            let re = Regex::new(&format!(r"(?:^|[^:\w]){child}\b((?:::\w+)*)")).unwrap();
            for c in re.captures_iter(&body) {
                let mut p = vec![child.clone()];
                p.extend(c[1].split("::").filter(|s| !s.is_empty()).map(String::from));
                refs.push(p);
            }
        }
        let mut targets = BTreeSet::new();
        for r in refs {
            if let Some(t) = absolute(f, &r, &children).and_then(|abs| g.resolve(&abs, 0)) {
                if t != f.module && !t.is_empty() {
                    targets.insert(t);
                }
            }
        }
        g.edges.insert(f.module.clone(), targets);
    }
    g
}

/// Every rule broken, one line each.
fn violations(g: &Graph) -> Vec<String> {
    let mut out = Vec::new();
    for (from, tos) in &g.edges {
        let (lf, wf) = layer_of(from);
        for to in tos {
            let (lt, wt) = layer_of(to);
            if lt > lf {
                out.push(format!(
                    "upward import: {} (layer {lf}, {wf}) imports {} (layer {lt}, {wt})",
                    module_name(from),
                    module_name(to)
                ));
            }
            if lf == 6 && lt == 5 && to.join("::") != REGISTRY {
                out.push(format!(
                    "the public face reaches a backend past the registry: {} imports {}",
                    module_name(from),
                    module_name(to)
                ));
            }
        }
    }
    for cycle in cycles(g) {
        out.push(format!(
            "import cycle: {}",
            cycle.iter().map(|m| module_name(m)).collect::<Vec<_>>().join(" -> ")
        ));
    }
    out
}

/// The import cycles: Tarjan's strongly connected components of more than one file.
fn cycles(g: &Graph) -> Vec<Vec<ModPath>> {
    struct State<'a> {
        g: &'a Graph,
        index: BTreeMap<&'a ModPath, usize>,
        low: BTreeMap<&'a ModPath, usize>,
        stack: Vec<&'a ModPath>,
        on_stack: BTreeSet<&'a ModPath>,
        next: usize,
        found: Vec<Vec<ModPath>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a ModPath) {
        s.index.insert(v, s.next);
        s.low.insert(v, s.next);
        s.next += 1;
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.g.edges.get(v).into_iter().flatten() {
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on_stack.remove(w);
                comp.push(w.clone());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.found.push(comp);
            }
        }
    }
    let mut s = State {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        found: Vec::new(),
    };
    for v in &g.modules {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.found
}

#[test]
fn host_has_no_upward_imports_and_no_cycles() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("host");
    let files = read_tree(&root);
    let g = build_graph(&files);
    if std::env::var_os("FERROCOMM_LAYERING_REPORT").is_some() {
        for (from, tos) in &g.edges {
            let (layer, what) = layer_of(from);
            let names: Vec<String> = tos.iter().map(|t| module_name(t)).collect();
            println!("{layer} {what:<20} {} -> {}", module_name(from), names.join(", "));
        }
    }
    let edges: usize = g.edges.values().map(BTreeSet::len).sum();
    assert!(
        files.len() > 50 && edges > 150,
        "the checker read too little: {} files, {edges} imports",
        files.len()
    );
    let bad = violations(&g);
    assert!(bad.is_empty(), "{} layering faults:\n{}", bad.len(), bad.join("\n"));
}

/// The checker finds what it exists to find, in a small tree made for it.
#[test]
fn the_checker_finds_upward_imports_cycles_and_backdoors() {
    let dir = std::env::temp_dir().join(format!("ferrocomm-layering-{}", std::process::id()));
    let write = |rel: &str, text: &str| {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    write("lib.rs", "mod contracts;\nmod backend;\nmod comm;\nmod gpu;\n");
    write("contracts/mod.rs", "pub(crate) mod error;\npub(crate) mod ops;\n");
    // Upward: the contracts reach the public face.
    write("contracts/error.rs", "use crate::comm::Comm;\npub struct Error;\n");
    write("contracts/ops.rs", "pub struct Op;\n");
    write("backend/mod.rs", "pub(crate) mod registry;\npub(crate) mod cpu;\n");
    write("backend/registry.rs", "use super::cpu::Cpu;\npub fn make() {}\n");
    write("backend/cpu.rs", "pub struct Cpu;\n");
    // Past the registry: the face names a backend directly.
    write(
        "comm.rs",
        "use crate::backend::cpu::Cpu;\nuse crate::backend::registry;\npub struct Comm;\n",
    );
    // A cycle through a re-export: gpu/mod.rs only hands `Stream` on; a.rs and b.rs loop.
    write("gpu/mod.rs", "mod a;\nmod b;\npub(crate) use b::Stream;\n");
    write("gpu/a.rs", "use crate::gpu::Stream;\npub fn f() {}\n");
    write(
        "gpu/b.rs",
        "pub struct Stream;\nfn g() { super::a::f() }\n#[cfg(test)]\nmod tests {\n use crate::comm::Comm;\n}\n",
    );
    let g = build_graph(&read_tree(&dir));
    let bad = violations(&g);
    let _ = std::fs::remove_dir_all(&dir);
    let has = |needle: &str| bad.iter().any(|l| l.contains(needle));
    assert!(
        has("upward import: contracts::error (layer 1, contracts) imports comm"),
        "{bad:#?}"
    );
    assert!(has("past the registry: comm imports backend::cpu"), "{bad:#?}");
    assert!(has("import cycle: gpu::a -> gpu::b"), "{bad:#?}");
    // The test module's import does not count, and the registry is the allowed door.
    assert!(!has("gpu::b (layer 3, GPU wing) imports comm"), "{bad:#?}");
    assert!(!has("imports backend::registry"), "{bad:#?}");
    assert_eq!(bad.len(), 3, "{bad:#?}");
}

/// The one module that reads the process environment; everything else takes its settings
/// from a communicator's options or from `config::current()`.
const SETTINGS: &str = "contracts::config";

#[test]
fn only_the_config_module_reads_the_environment() {
    let files = read_tree(&Path::new(env!("CARGO_MANIFEST_DIR")).join("host"));
    assert!(files.len() > 50, "the checker read too little: {} files", files.len());
    let mut offenders = Vec::new();
    for f in files.iter().filter(|f| f.module.join("::") != SETTINGS) {
        for (n, line) in f.code.lines().enumerate() {
            if ["env::var", "var_os(", "env::vars"].iter().any(|r| line.contains(r)) {
                offenders.push(format!("host/{}:{}: {}", f.path.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "the environment is read outside host/contracts/config.rs (take the setting from Config):\n{}",
        offenders.join("\n")
    );
}
