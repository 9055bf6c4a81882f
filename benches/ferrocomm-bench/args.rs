//! Command line of ferrocomm-bench (nccl-tests style).

use std::path::PathBuf;

pub const USAGE: &str = "usage: ferrocomm-bench <op> [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP]
       [--backend cpu] [--world N] [--threads] [--dtype f32] [--redop sum] [--root 0]
       [--algo NAME] [--device cuda|host]
       [--check] [--json FILE] [--csv FILE] [--plot FILE.png] [--graph]
ops: all_reduce reduce broadcast all_gather reduce_scatter all_to_all send_recv put get signal
     queue_put (put + signal through the window's proxy queue; needs ranks on other hosts,
       or FERROCOMM_TRANSPORT=tcp)
     queue_pickup (proxy queue enqueue to pickup latency, one process)
     device_put device_pingpong (2 ranks on GPU 0, device backend; --device host: on the host
       device, --check verifies the put)
     device_all_reduce (--world ranks on GPU 0, bf16, graph replay, one- and two-shot or --algo;
       against NCCL at world 1 and the copy roofline; --device host: on the host device, CPU
       threads, no GPU figures, --check compares every result bit for bit)
     nccl_all_reduce (ferrocomm's nccl backend against direct NCCL calls, world 1, GPU 0)
sizes take K, M, G suffixes (powers of 1024)";

#[derive(Clone, Debug)]
pub struct Args {
    pub op: String,
    pub min_bytes: usize,
    pub max_bytes: usize,
    pub factor: usize,
    pub iters: usize,
    pub warmup: usize,
    pub backend: String,
    pub world: usize,
    pub threads: bool,
    pub dtype: String,
    pub redop: String,
    pub root: usize,
    /// The backend's `algorithm` hint for collectives (cpu: oneshot, direct, ring; device:
    /// oneshot, twoshot, multimem).
    pub algo: Option<String>,
    /// Where the device rows run: `cuda` (GPU 0) or `host` (the host device).
    pub device: String,
    pub check: bool,
    pub json: Option<PathBuf>,
    pub csv: Option<PathBuf>,
    pub plot: Option<PathBuf>,
    pub graph: bool,
}

pub fn parse_size(s: &str) -> Result<usize, String> {
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .map(|n| n * mult)
        .map_err(|_| format!("bad size {s:?}"))
}

pub fn parse(argv: &[String]) -> Result<Args, String> {
    let mut a = Args {
        op: String::new(),
        min_bytes: 8,
        max_bytes: 64 << 20,
        factor: 2,
        iters: 20,
        warmup: 5,
        backend: "cpu".into(),
        world: 2,
        threads: false,
        dtype: "f32".into(),
        redop: "sum".into(),
        root: 0,
        algo: None,
        device: "cuda".into(),
        check: false,
        json: None,
        csv: None,
        plot: None,
        graph: false,
    };
    let mut it = argv.iter();
    while let Some(x) = it.next() {
        let mut val = || it.next().cloned().ok_or_else(|| format!("{x} needs a value"));
        let num = |v: String| v.parse::<usize>().map_err(|_| format!("{x}: {v:?} is not a number"));
        match x.as_str() {
            "-b" | "--minbytes" => a.min_bytes = parse_size(&val()?)?,
            "-e" | "--maxbytes" => a.max_bytes = parse_size(&val()?)?,
            "-f" | "--stepfactor" => a.factor = num(val()?)?,
            "-n" | "--iters" => a.iters = num(val()?)?,
            "-w" | "--warmup_iters" | "--warmup" => a.warmup = num(val()?)?,
            "--backend" => a.backend = val()?,
            "--world" | "-g" => a.world = num(val()?)?,
            "--threads" => a.threads = true,
            "--dtype" | "-d" => a.dtype = val()?,
            "--redop" | "-o" => a.redop = val()?,
            "--root" | "-r" => a.root = num(val()?)?,
            "--algo" => a.algo = Some(val()?),
            "--device" => a.device = val()?,
            "--check" | "-c" => a.check = true,
            "--json" => a.json = Some(val()?.into()),
            "--csv" => a.csv = Some(val()?.into()),
            "--plot" => a.plot = Some(val()?.into()),
            "--graph" | "-G" => a.graph = true,
            "-h" | "--help" => return Err(String::new()),
            s if s.starts_with('-') => return Err(format!("unknown option {s}")),
            s if a.op.is_empty() => a.op = s.to_owned(),
            s => return Err(format!("unexpected argument {s}")),
        }
    }
    if a.op.is_empty() {
        return Err("missing <op>".into());
    }
    if a.factor < 2 || a.min_bytes == 0 || a.min_bytes > a.max_bytes || a.iters == 0 || a.world == 0 {
        return Err("need -f >= 2, 0 < -b <= -e, -n >= 1, --world >= 1".into());
    }
    Ok(a)
}

/// Options as a flat argument list again, to hand to the rank processes.
pub fn to_argv(a: &Args) -> Vec<String> {
    let mut v = vec![
        a.op.clone(),
        "-b".into(),
        a.min_bytes.to_string(),
        "-e".into(),
        a.max_bytes.to_string(),
        "-f".into(),
        a.factor.to_string(),
        "-n".into(),
        a.iters.to_string(),
        "-w".into(),
        a.warmup.to_string(),
        "--backend".into(),
        a.backend.clone(),
        "--world".into(),
        a.world.to_string(),
        "--dtype".into(),
        a.dtype.clone(),
        "--redop".into(),
        a.redop.clone(),
        "--root".into(),
        a.root.to_string(),
    ];
    if let Some(algo) = &a.algo {
        v.extend(["--algo".into(), algo.clone()]);
    }
    if a.check {
        v.push("--check".into());
    }
    if a.graph {
        v.push("--graph".into());
    }
    v
}
