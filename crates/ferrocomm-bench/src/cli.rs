//! The command line: one subcommand per op, each taking nccl-tests' flags (`-b -e -f -n -w -c
//! -d -o`) and ferrocomm's own, and `plot`.

use crate::size;
use clap::builder::PossibleValue;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

/// nccl-tests-style sweeps of ferrocomm's collectives, one-sided window operations and device
/// rows, and plots of their JSON.
///
/// Without launcher variables (RANK, WORLD_SIZE, ...) a sweep starts `--world` ranks itself, as
/// processes or, with `--threads`, as threads; under a launcher each process is one rank. Rank 0
/// prints the table and writes `--json`, `--csv` and `--plot`.
#[derive(Parser, Debug)]
#[command(name = "ferrocomm-bench", version, arg_required_else_help = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// What to run. Subcommand names are the ops' names in the JSON (`all_reduce`, ...).
#[derive(Subcommand, Debug)]
#[command(rename_all = "snake_case")]
pub enum Command {
    /// Every rank ends with the reduction of all ranks' buffers.
    AllReduce(Args),
    /// The root ends with the reduction of all ranks' buffers.
    Reduce(Args),
    /// Every rank ends with the root's buffer.
    Broadcast(Args),
    /// Every rank ends with every rank's block (size: all blocks together).
    AllGather(Args),
    /// Each rank ends with its block of the reduction (size: all blocks together).
    ReduceScatter(Args),
    /// Each rank sends a block to every rank (size: all blocks together).
    AllToAll(Args),
    /// A ring: each rank sends to the right and receives from the left.
    SendRecv(Args),
    /// all_reduce + residual add + RMSNorm fused in one call, against the same steps unfused
    /// (all_reduce into a copy of x, then the bench's own residual + norm pass), side by side
    /// (size: bytes of x per rank, whole token rows of `--hidden`; or `--tokens`).
    Rmsnorm(RmsNormArgs),
    /// MoE dispatch + combine (DeepEP's shape by default: 128 tokens per rank, hidden 7168,
    /// top-8 of 256 experts), random routing, identity experts; times of each half.
    Moe(MoeArgs),
    /// Window put + signal to the right neighbour, then wait for the left one's.
    Put(Args),
    /// Window get from the right neighbour.
    Get(Args),
    /// Signal ping-pong between ranks 0 and 1: half a round trip (one row).
    Signal(Args),
    /// Put + signal through the window's proxy queue (needs ranks on other hosts, or
    /// FERROCOMM_TRANSPORT=tcp).
    QueuePut(Args),
    /// How long a descriptor waits in a proxy queue before the proxy picks it up (one
    /// process).
    QueuePickup(Args),
    /// A put by SMs into the peer's window against cuMemcpyDtoDAsync (2 ranks on GPU 0;
    /// `--device host`: on the host device, `--check` verifies it).
    DevicePut(Args),
    /// put(8 B) + signal ping-pong between two ranks' kernels (GPU 0, or `--device host`).
    DevicePingpong(Args),
    /// The device backend's one- and two-shot all_reduce kernels, bf16, `--world` ranks on
    /// GPU 0 (graph replay), against NCCL at world 1 and the copy roofline; `--device host`:
    /// on the host device, `--check` compares every result bit for bit.
    DeviceAllReduce(Args),
    /// The fused all_reduce + residual + RMSNorm on device buffers, `--world` ranks on GPU 0
    /// (graph replay): the fused kernels against the steps apart with the own kernels, and NCCL
    /// at world 1 with the norm kernel (size: bytes of x per rank, or `--tokens`).
    DeviceRmsnorm(RmsNormArgs),
    /// ferrocomm's nccl backend against direct NCCL calls (world 1, GPU 0).
    NcclAllReduce(Args),
    /// Communicator creation: `-n` communicators of `--world` ranks (processes, or `--threads`),
    /// each timed until every rank holds it and until a first 8-byte all_reduce has completed
    /// (-b/-e/-f do not apply).
    Init(InitArgs),
    /// Draws latency and bus bandwidth against message size from JSON files of
    /// ferrocomm-bench and its MPI and Gloo peers.
    Plot(PlotArgs),
    /// Prints a shell completion script.
    #[command(hide = true)]
    Completions {
        /// The shell to complete for.
        shell: clap_complete::Shell,
    },
}

/// The flags of every op (nccl-tests' short forms where it has them).
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// The op's name, from the subcommand.
    #[arg(skip)]
    pub op: String,
    /// Smallest message size in bytes (K, M, G suffixes: powers of 1024).
    #[arg(short = 'b', long = "minbytes", value_name = "SIZE", default_value = "8", value_parser = size::parse)]
    pub min_bytes: usize,
    /// Largest message size in bytes (K, M, G suffixes).
    #[arg(short = 'e', long = "maxbytes", value_name = "SIZE", default_value = "64M", value_parser = size::parse)]
    pub max_bytes: usize,
    /// Each size is the previous one times this.
    #[arg(short = 'f', long = "stepfactor", value_name = "N", default_value = "2", value_parser = at_least::<2>)]
    pub factor: usize,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", value_name = "N", default_value = "20", value_parser = at_least::<1>)]
    pub iters: usize,
    /// Untimed iterations before them.
    #[arg(
        short = 'w',
        long = "warmup_iters",
        visible_alias = "warmup",
        value_name = "N",
        default_value_t = 5
    )]
    pub warmup: usize,
    /// Before the first size, run 4-byte all_reduces for at least this many milliseconds (0:
    /// none), so that every rank starts timing once the scheduler has placed the ranks: where
    /// they outnumber the cores, the first 100-200 ms can run three ranks on one core and one
    /// on the other (docs/results/cpu.md, "Ranks placed three to one").
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub settle_ms: u64,
    /// Verify every size and count wrong elements: `-c 1` (nccl-tests) or a bare `--check`.
    #[arg(short = 'c', long = "check", value_name = "0|1", num_args = 0..=1, default_value = "0",
          default_missing_value = "1", value_parser = zero_or_one)]
    pub check: bool,
    /// Element type.
    #[arg(
        short = 'd',
        long = "datatype",
        visible_alias = "dtype",
        value_name = "TYPE",
        default_value = "f32"
    )]
    pub dtype: DType,
    /// Reduction of all_reduce, reduce and reduce_scatter.
    #[arg(
        short = 'o',
        long = "redop",
        visible_alias = "op",
        value_name = "OP",
        default_value = "sum"
    )]
    pub redop: Redop,
    /// Root of reduce and broadcast.
    #[arg(short = 'r', long, value_name = "RANK", default_value_t = 0)]
    pub root: usize,
    /// Backend of the communicator (cpu, nccl, device, auto, or a registered one).
    #[arg(long, value_name = "NAME", default_value = "cpu")]
    pub backend: String,
    /// Ranks to start (without a launcher); device_all_reduce: ranks on the device.
    #[arg(short = 'g', long, value_name = "N", default_value = "2", value_parser = at_least::<1>)]
    pub world: usize,
    /// Start the ranks as threads of this process rather than as processes.
    #[arg(long)]
    pub threads: bool,
    /// `core`: each rank process this bench starts runs on a core of its own (as
    /// `ferrocomm-run --bind-to core`), where they fit; `none` leaves them to the scheduler.
    #[arg(long, value_name = "WHAT", default_value = "none", value_parser = ["none", "core"])]
    pub bind_to: String,
    /// The backend's `algorithm` hint for collectives (cpu: oneshot, direct, ring, two_level;
    /// device: oneshot, twoshot, multimem).
    #[arg(long, value_name = "NAME")]
    pub algo: Option<String>,
    /// Where the device rows run: GPU 0, or the host device (kernels on CPU threads).
    #[arg(long, value_name = "WHERE", default_value = "cuda")]
    pub device: DeviceKind,
    /// Capture the timed calls in CUDA graphs (needs a GPU backend).
    #[arg(short = 'G', long)]
    pub graph: bool,
    /// Write the rows as JSON (the schema scripts/compare_report.py and `plot` read).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write the rows as CSV.
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,
    /// Draw the rows as `plot` does (PNG or SVG, by the file's extension).
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// The flags of `rmsnorm` and `moe`, from their subcommands.
    #[arg(skip)]
    pub inference: Option<Box<Inference>>,
    /// `init --transport tcp`: every link over TCP, also between ranks of this host.
    #[arg(skip)]
    pub transport_tcp: bool,
}

/// `init`'s flags: the common ones and its own.
#[derive(clap::Args, Clone, Debug)]
pub struct InitArgs {
    #[command(flatten)]
    pub common: Args,
    /// How ranks of this host connect: `auto` (shared memory) or `tcp` (as
    /// FERROCOMM_TRANSPORT=tcp does).
    #[arg(long, value_name = "KIND", default_value = "auto", value_parser = ["auto", "shm", "tcp"])]
    pub transport: String,
}

/// `rmsnorm`'s flags: the common ones and its own.
#[derive(clap::Args, Clone, Debug)]
pub struct RmsNormArgs {
    #[command(flatten)]
    pub common: Args,
    #[command(flatten)]
    pub opts: RmsNormOpts,
}

/// What `rmsnorm` adds to the common flags.
#[derive(clap::Args, Clone, Debug, PartialEq)]
pub struct RmsNormOpts {
    /// Elements per token row (gamma's length).
    #[arg(long, value_name = "N", default_value_t = 4096, value_parser = at_least::<1>)]
    pub hidden: usize,
    /// Token counts to run (comma-separated) instead of the -b/-e/-f byte sweep.
    #[arg(long, value_name = "N,...", value_delimiter = ',', value_parser = at_least::<1>)]
    pub tokens: Vec<usize>,
    /// Quantise the output to fp8 e4m3 with a scale per token (RESIDUAL_RMS_NORM_QUANT_FP8).
    #[arg(long)]
    pub fp8: bool,
    /// The norm's epsilon.
    #[arg(long, value_name = "EPS", default_value_t = 1e-6)]
    pub eps: f32,
}

/// `moe`'s flags: the common ones and its own.
#[derive(clap::Args, Clone, Debug)]
pub struct MoeArgs {
    #[command(flatten)]
    pub common: Args,
    #[command(flatten)]
    pub opts: MoeOpts,
}

/// What `moe` adds to the common flags (-b/-e/-f do not apply: a row per `--tokens` value).
#[derive(clap::Args, Clone, Debug, PartialEq)]
pub struct MoeOpts {
    /// Tokens per rank (comma-separated: a row each).
    #[arg(long, value_name = "N,...", value_delimiter = ',', default_value = "128", value_parser = at_least::<1>)]
    pub tokens: Vec<usize>,
    /// Elements per token row.
    #[arg(long, value_name = "N", default_value_t = 7168, value_parser = at_least::<1>)]
    pub hidden: usize,
    /// Experts per token (K).
    #[arg(long, value_name = "K", default_value_t = 8, value_parser = at_least::<1>)]
    pub topk: usize,
    /// Experts over all ranks (a multiple of the world size).
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = at_least::<1>)]
    pub experts: usize,
    /// Rows per local expert in the receive buffers; default tokens x ranks (DeepEP's
    /// low-latency layout: never exceeded).
    #[arg(long, value_name = "ROWS", value_parser = at_least::<1>)]
    pub capacity: Option<usize>,
    /// Dispatch fp8 e4m3 tokens with a scale per 128 elements (DeepEP's fp8 dispatch); the
    /// experts' outputs and the combine stay in `--datatype`.
    #[arg(long)]
    pub fp8: bool,
    /// Seed of the random routing and weights.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
}

/// The flags of the inference ops, carried in `Args`.
#[derive(Clone, Debug, PartialEq)]
pub enum Inference {
    RmsNorm(RmsNormOpts),
    Moe(MoeOpts),
}

/// `ferrocomm-bench plot`'s arguments.
#[derive(clap::Args, Clone, Debug)]
pub struct PlotArgs {
    /// The image to write: .png or .svg.
    #[arg(short = 'o', long, value_name = "FILE")]
    pub output: PathBuf,
    /// JSON files written by `--json` (or by benches/peers/); runs of one tool, backend, op,
    /// world size and type are merged, each size keeping its fastest time.
    #[arg(required = true, value_name = "JSON")]
    pub inputs: Vec<PathBuf>,
}

/// The element types a sweep can drive (nccl-tests' names are aliases).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F64,
    F16,
    Bf16,
    I8,
    U8,
    I32,
    U32,
    I64,
    U64,
    Bool,
    I16,
    U16,
    F8E4M3,
    F8E5M2,
}

impl DType {
    const ALL: [DType; 15] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::Bf16,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
        DType::Bool,
        DType::I16,
        DType::U16,
        DType::F8E4M3,
        DType::F8E5M2,
    ];

    /// The name in tables and JSON, and nccl-tests' name for the type.
    fn names(self) -> (&'static str, &'static str) {
        match self {
            DType::F32 => ("f32", "float"),
            DType::F64 => ("f64", "double"),
            DType::F16 => ("f16", "half"),
            DType::Bf16 => ("bf16", "bfloat16"),
            DType::I8 => ("i8", "int8"),
            DType::U8 => ("u8", "uint8"),
            DType::I32 => ("i32", "int32"),
            DType::U32 => ("u32", "uint32"),
            DType::I64 => ("i64", "int64"),
            DType::U64 => ("u64", "uint64"),
            // nccl-tests has no bool or 16-bit integers; its fp8 names are ours.
            DType::Bool => ("bool", "bool"),
            DType::I16 => ("i16", "int16"),
            DType::U16 => ("u16", "uint16"),
            DType::F8E4M3 => ("f8e4m3", "f8e4m3"),
            DType::F8E5M2 => ("f8e5m2", "f8e5m2"),
        }
    }

    /// The name in tables and JSON.
    pub fn name(self) -> &'static str {
        self.names().0
    }
}

impl ValueEnum for DType {
    fn value_variants<'a>() -> &'a [Self] {
        &Self::ALL
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        let (ours, nccl) = self.names();
        let v = PossibleValue::new(ours);
        Some(if nccl == ours { v } else { v.alias(nccl) })
    }
}

/// The reductions (`-o`), as nccl-tests names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Redop {
    Sum,
    Prod,
    Min,
    Max,
    Avg,
}

impl Redop {
    /// The name in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Redop::Sum => "sum",
            Redop::Prod => "prod",
            Redop::Min => "min",
            Redop::Max => "max",
            Redop::Avg => "avg",
        }
    }

    /// The library's reduction.
    pub fn reduce_op(self) -> ferrocomm::ReduceOp {
        use ferrocomm::ReduceOp;
        match self {
            Redop::Sum => ReduceOp::Sum,
            Redop::Prod => ReduceOp::Prod,
            Redop::Min => ReduceOp::Min,
            Redop::Max => ReduceOp::Max,
            Redop::Avg => ReduceOp::Avg,
        }
    }
}

/// Where the device rows run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceKind {
    /// GPU 0.
    Cuda,
    /// The host device: the library's kernels on CPU threads (feature host-kernels).
    Host,
}

/// What the command line asks for, checked.
pub enum Invocation {
    /// An op's sweep.
    Sweep(Args),
    /// `plot`.
    Plot(PlotArgs),
    /// The completion script for a shell.
    Completions(clap_complete::Shell),
}

/// Parses the command line; a malformed one ends the process with clap's usage error (status
/// 2), `--help` and `--version` with status 0.
pub fn parse() -> Invocation {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let op = matches.subcommand_name().unwrap_or_default().to_owned();
    let mut args = match cli.command {
        Command::Plot(p) => return Invocation::Plot(p),
        Command::Completions { shell } => return Invocation::Completions(shell),
        Command::AllReduce(a)
        | Command::Reduce(a)
        | Command::Broadcast(a)
        | Command::AllGather(a)
        | Command::ReduceScatter(a)
        | Command::AllToAll(a)
        | Command::SendRecv(a)
        | Command::Put(a)
        | Command::Get(a)
        | Command::Signal(a)
        | Command::QueuePut(a)
        | Command::QueuePickup(a)
        | Command::DevicePut(a)
        | Command::DevicePingpong(a)
        | Command::DeviceAllReduce(a)
        | Command::NcclAllReduce(a) => a,
        Command::Rmsnorm(r) | Command::DeviceRmsnorm(r) => Args {
            inference: Some(Box::new(Inference::RmsNorm(r.opts))),
            ..r.common
        },
        Command::Moe(m) => Args {
            inference: Some(Box::new(Inference::Moe(m.opts))),
            ..m.common
        },
        Command::Init(i) => Args {
            transport_tcp: i.transport == "tcp",
            ..i.common
        },
    };
    if args.min_bytes == 0 || args.min_bytes > args.max_bytes {
        let msg = format!(
            "-b {} -e {}: need 0 < minbytes <= maxbytes",
            args.min_bytes, args.max_bytes
        );
        let mut cmd = Cli::command();
        // Built, the op's subcommand knows its full name for the usage line, as in clap's own
        // errors.
        cmd.build();
        let sub = cmd.find_subcommand(&op).cloned();
        sub.unwrap_or(cmd)
            .error(clap::error::ErrorKind::ValueValidation, msg)
            .exit();
    }
    args.op = op;
    Invocation::Sweep(args)
}

/// A whole number no smaller than `MIN`.
fn at_least<const MIN: usize>(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= MIN => Ok(n),
        _ => Err(format!("{s:?}: expected a whole number of at least {MIN}")),
    }
}

/// nccl-tests' `-c 0|1`; `--check` alone means 1.
fn zero_or_one(s: &str) -> Result<bool, String> {
    match s {
        "1" | "true" => Ok(true),
        "0" | "false" => Ok(false),
        _ => Err(format!("{s:?}: expected 0 or 1")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sweep(argv: &[&str]) -> Result<Args, clap::Error> {
        let cli = Cli::try_parse_from(std::iter::once("ferrocomm-bench").chain(argv.iter().copied()))?;
        match cli.command {
            Command::AllReduce(a) => Ok(a),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn the_cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn nccl_tests_flags_are_accepted() {
        let a = sweep(&[
            "all_reduce",
            "-b",
            "8",
            "-e",
            "128M",
            "-f",
            "2",
            "-n",
            "50",
            "-w",
            "5",
            "-c",
            "1",
            "-d",
            "float",
            "-o",
            "max",
        ])
        .unwrap();
        assert_eq!(
            (a.min_bytes, a.max_bytes, a.factor, a.iters, a.warmup),
            (8, 128 << 20, 2, 50, 5)
        );
        assert!(a.check);
        assert_eq!((a.dtype, a.redop), (DType::F32, Redop::Max));
        assert!(!sweep(&["all_reduce", "-c", "0"]).unwrap().check);
    }

    #[test]
    fn a_bare_check_and_the_long_names_work() {
        let a = sweep(&["all_reduce", "--check", "--dtype", "bf16", "--world", "3", "--threads"]).unwrap();
        assert!(a.check && a.threads);
        assert_eq!((a.dtype, a.world), (DType::Bf16, 3));
        let a = sweep(&["all_reduce", "-b", "8", "--check"]).unwrap();
        assert!(a.check);
    }

    #[test]
    fn the_inference_ops_have_their_defaults() {
        let parse = |argv: &[&str]| Cli::try_parse_from(std::iter::once("ferrocomm-bench").chain(argv.iter().copied()));
        match parse(&["moe"]).unwrap().command {
            Command::Moe(m) => {
                let o = m.opts;
                assert_eq!(
                    (o.tokens, o.hidden, o.topk, o.experts, o.capacity, o.fp8),
                    (vec![128], 7168, 8, 256, None, false)
                );
            }
            other => panic!("parsed as {other:?}"),
        }
        match parse(&["rmsnorm", "--tokens", "1,8", "--fp8", "-d", "bf16"])
            .unwrap()
            .command
        {
            Command::Rmsnorm(r) => {
                assert_eq!((r.opts.hidden, r.opts.tokens, r.opts.fp8), (4096, vec![1, 8], true));
                assert_eq!(r.common.dtype, DType::Bf16);
            }
            other => panic!("parsed as {other:?}"),
        }
        assert!(parse(&["moe", "--tokens", "0"]).is_err());
        assert!(parse(&["rmsnorm", "--hidden", "0"]).is_err());
        assert!(
            parse(&["all_reduce", "--hidden", "8"]).is_err(),
            "only the inference ops take --hidden"
        );
    }

    #[test]
    fn malformed_values_are_refused() {
        for bad in [
            &["all_reduce", "-b", "1x"][..],
            &["all_reduce", "-f", "1"],
            &["all_reduce", "-n", "0"],
            &["all_reduce", "-c", "2"],
            &["all_reduce", "-d", "f8"],
            &["all_reduce", "--world", "0"],
            &["no_such_op"],
        ] {
            assert!(sweep(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
