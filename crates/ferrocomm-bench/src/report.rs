//! The results of one sweep as files: the JSON that scripts/compare_report.py and `plot` read
//! (benches/peers/ write the same schema), and CSV with the same columns.

use serde::{Deserialize, Serialize};
use std::path::Path;

/// One sweep: who measured what, and a row per size. Fields are in the order the JSON has
/// always had.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    /// `ferrocomm`, or the peer: `mpich`, `gloo`.
    pub tool: String,
    /// The communicator's backend (`cpu`, `device`, ...), or the peer's (`mpi`, `gloo`).
    #[serde(default)]
    pub backend: String,
    /// The op's name, as the bench's subcommands spell it.
    pub op: String,
    /// Ranks in the job.
    pub world: usize,
    /// Element type: `f32`, `bf16`, ...
    #[serde(default)]
    pub dtype: String,
    /// The reduction (`sum`, ...), also for ops that do not reduce.
    #[serde(default)]
    pub redop: String,
    /// One row per size, ascending.
    pub rows: Vec<Row>,
}

/// One size: nccl-tests' columns.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Row {
    /// nccl-tests' size: per rank for all_reduce, broadcast, reduce and send_recv, all ranks'
    /// blocks together for all_gather, reduce_scatter and all_to_all.
    pub bytes: usize,
    /// Elements per rank-block.
    #[serde(default)]
    pub count: usize,
    /// The slowest rank's mean time per call, microseconds.
    pub time_us: f64,
    /// GB/s: bytes over time.
    #[serde(default)]
    pub algbw: f64,
    /// GB/s with nccl-tests' bus factors.
    pub busbw: f64,
    /// Wrong elements over all ranks (`--check`; 0 without it).
    #[serde(default)]
    pub wrong: u64,
}

impl Row {
    /// The row as written: microseconds to 3 decimals, GB/s to 4, as the JSON always had.
    fn rounded(&self) -> Row {
        let round = |v: f64, places: i32| {
            let s = 10f64.powi(places);
            (v * s).round() / s
        };
        Row {
            time_us: round(self.time_us, 3),
            algbw: round(self.algbw, 4),
            busbw: round(self.busbw, 4),
            ..self.clone()
        }
    }
}

fn write(path: &Path, text: String) -> ferrocomm::Result<()> {
    std::fs::write(path, text).map_err(|e| ferrocomm::Error::Io {
        context: format!("write {}", path.display()),
        source: e,
    })
}

impl Report {
    /// Writes the report as one line of JSON.
    pub fn write_json(&self, path: &Path) -> ferrocomm::Result<()> {
        let rounded = Report {
            rows: self.rows.iter().map(Row::rounded).collect(),
            ..self.clone()
        };
        let text = serde_json::to_string(&rounded).map_err(|e| ferrocomm::Error::Config(format!("JSON: {e}")))?;
        write(path, text + "\n")
    }

    /// Writes the report as CSV: a header, then a row per size with the report's fields.
    pub fn write_csv(&self, path: &Path) -> ferrocomm::Result<()> {
        let mut s = String::from("tool,backend,op,world,dtype,redop,bytes,count,time_us,algbw,busbw,wrong\n");
        for r in &self.rows {
            s += &format!(
                "{},{},{},{},{},{},{},{},{:.3},{:.4},{:.4},{}\n",
                self.tool,
                self.backend,
                self.op,
                self.world,
                self.dtype,
                self.redop,
                r.bytes,
                r.count,
                r.time_us,
                r.algbw,
                r.busbw,
                r.wrong
            );
        }
        write(path, s)
    }

    /// Reads a report written by `write_json` or by a peer.
    pub fn read_json(path: &Path) -> Result<Report, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: not a ferrocomm-bench report: {e}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_json_keeps_its_schema_and_reads_back() {
        let r = Report {
            tool: "ferrocomm".into(),
            backend: "cpu".into(),
            op: "all_reduce".into(),
            world: 2,
            dtype: "f32".into(),
            redop: "sum".into(),
            rows: vec![Row {
                bytes: 8,
                count: 2,
                time_us: 1.234_567,
                algbw: 0.006_480_1,
                busbw: 0.006_480_1,
                wrong: 0,
            }],
        };
        let path = std::env::temp_dir().join(format!("fc-report-{}.json", std::process::id()));
        r.write_json(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text,
            "{\"tool\":\"ferrocomm\",\"backend\":\"cpu\",\"op\":\"all_reduce\",\"world\":2,\"dtype\":\"f32\",\
             \"redop\":\"sum\",\"rows\":[{\"bytes\":8,\"count\":2,\"time_us\":1.235,\"algbw\":0.0065,\
             \"busbw\":0.0065,\"wrong\":0}]}\n"
        );
        let back = Report::read_json(&path).unwrap();
        assert_eq!((back.rows[0].bytes, back.rows[0].time_us), (8, 1.235));
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_file_of_another_shape_is_an_error_naming_it() {
        let path = std::env::temp_dir().join(format!("fc-report-bad-{}.json", std::process::id()));
        std::fs::write(
            &path,
            "{\"tool\":\"ferrocomm\",\"op\":\"queue_pickup\",\"rows\":[{\"gap_us\":0}]}",
        )
        .unwrap();
        let e = Report::read_json(&path).unwrap_err();
        assert!(e.contains("fc-report-bad") && e.contains("missing field"), "{e}");
        std::fs::remove_file(path).unwrap();
    }
}
