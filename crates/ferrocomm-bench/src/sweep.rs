//! The host sweep of one op: a row per size on every rank, rank 0 printing nccl-tests' table
//! and writing the outputs.

use crate::cli::{Args, DType};
use crate::ops::{Bench, BenchElem};
use crate::progress::Progress;
use crate::report::{Report, Row};
use ferrocomm::prelude::*;
use ferrocomm::Result;

const HEADER: &str = "#       size         count      type   redop    root     time   algbw   busbw  #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)";

fn format_row(a: &Args, r: &Row) -> String {
    let root = if matches!(a.op.as_str(), "reduce" | "broadcast") {
        a.root as i64
    } else {
        -1
    };
    let redop = if matches!(a.op.as_str(), "all_reduce" | "reduce" | "reduce_scatter") {
        a.redop.name()
    } else {
        "none"
    };
    format!(
        "{:>12} {:>13} {:>9} {:>7} {:>7} {:>8.2} {:>7.2} {:>7.2} {:>7}",
        r.bytes,
        r.count,
        a.dtype.name(),
        redop,
        root,
        r.time_us,
        r.algbw,
        r.busbw,
        r.wrong
    )
}

/// Runs the sweep on this rank; rank 0 prints the table. Every rank returns the rows.
fn sweep<T: BenchElem>(comm: &Comm, a: &Args) -> Result<Vec<Row>> {
    let mut bench = Bench::new(comm, a)?;
    let sizes = crate::size::sweep(a.min_bytes, a.max_bytes, a.factor);
    let lead = comm.rank() == 0;
    if lead {
        println!(
            "# ferrocomm-bench {} on backend {}, {} ranks, {}",
            a.op,
            comm.backend_name(),
            comm.size(),
            a.dtype.name()
        );
        println!("{HEADER}");
    }
    crate::settle::settle(comm, a.settle_ms)?;
    let progress = Progress::new(&a.op, sizes.len(), lead);
    let mut rows = Vec::new();
    for bytes in sizes {
        progress.start_size(bytes);
        let Some(row) = bench.row::<T>(bytes)? else { continue };
        if lead {
            progress.print_row(&format_row(a, &row));
        }
        rows.push(row);
        if a.op == "signal" {
            break; // one latency figure, independent of size
        }
    }
    Ok(rows)
}

/// Runs the sweep with the element type `--datatype` names.
pub fn run(comm: &Comm, a: &Args) -> Result<Vec<Row>> {
    if a.inference.is_some() {
        return crate::inference::run(comm, a);
    }
    match a.dtype {
        DType::F32 => sweep::<f32>(comm, a),
        DType::F64 => sweep::<f64>(comm, a),
        DType::F16 => sweep::<ferrocomm::f16>(comm, a),
        DType::Bf16 => sweep::<ferrocomm::bf16>(comm, a),
        DType::I8 => sweep::<i8>(comm, a),
        DType::U8 => sweep::<u8>(comm, a),
        DType::I32 => sweep::<i32>(comm, a),
        DType::U32 => sweep::<u32>(comm, a),
        DType::I64 => sweep::<i64>(comm, a),
        DType::U64 => sweep::<u64>(comm, a),
        DType::Bool => sweep::<bool>(comm, a),
        DType::I16 => sweep::<i16>(comm, a),
        DType::U16 => sweep::<u16>(comm, a),
        DType::F8E4M3 => sweep::<ferrocomm::F8E4M3>(comm, a),
        DType::F8E5M2 => sweep::<ferrocomm::F8E5M2>(comm, a),
    }
}

/// Writes `--json`, `--csv` and `--plot` from rank 0's rows.
pub fn write_outputs(a: &Args, world: usize, rows: Vec<Row>) -> std::result::Result<(), crate::Failure> {
    let report = Report {
        tool: "ferrocomm".into(),
        backend: a.backend.clone(),
        op: a.op.clone(),
        world,
        dtype: a.dtype.name().into(),
        redop: a.redop.name().into(),
        rows,
        params: crate::inference::params(a, world),
    };
    if let Some(p) = &a.json {
        report.write_json(p)?;
    }
    if let Some(p) = &a.csv {
        report.write_csv(p)?;
    }
    if let Some(p) = &a.plot {
        crate::plot::draw(&[report], p)?;
    }
    Ok(())
}
