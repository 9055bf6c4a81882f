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
    /// The inference ops' shape (`rmsnorm`, `moe`); absent for the other ops.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<Params>,
}

/// The shape an inference op ran with (fields that do not apply are absent).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Params {
    /// Elements per token row.
    pub hidden: usize,
    /// `rmsnorm`: the output is fp8 e4m3 with per-token scales; `moe`: the dispatched tokens
    /// are fp8 e4m3 with per-128-element scales.
    pub fp8: bool,
    /// `rmsnorm`: the norm's epsilon.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eps: Option<f32>,
    /// `moe`: experts per token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topk: Option<usize>,
    /// `moe`: experts over all ranks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<usize>,
    /// `moe`: rows per local expert in the receive buffers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<usize>,
}

/// One size: nccl-tests' columns, and the inference ops' own after them (absent elsewhere).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
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
    /// `rmsnorm`, `moe`: token rows per rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<usize>,
    /// `rmsnorm`: the same steps unfused (`time_us` is the fused call), slowest rank's mean.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unfused_us: Option<f64>,
    /// `rmsnorm`: `unfused_us / time_us` (above 1: the fused call is faster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratio: Option<f64>,
    /// `moe`: the dispatch's slowest rank's mean (`time_us`: dispatch + combine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch_us: Option<f64>,
    /// `moe`: the combine's slowest rank's mean.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub combine_us: Option<f64>,
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
            unfused_us: self.unfused_us.map(|v| round(v, 3)),
            ratio: self.ratio.map(|v| round(v, 4)),
            dispatch_us: self.dispatch_us.map(|v| round(v, 3)),
            combine_us: self.combine_us.map(|v| round(v, 3)),
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

    /// Writes the report as CSV: a header, then a row per size with the report's fields. The
    /// inference ops add their columns after `wrong` (`rmsnorm`: tokens, hidden, fp8,
    /// unfused_us, ratio; `moe`: tokens, hidden, topk, experts, capacity, fp8, dispatch_us,
    /// combine_us); the other ops' columns are as they always were.
    pub fn write_csv(&self, path: &Path) -> ferrocomm::Result<()> {
        let extra = self.params.as_ref().map(|p| (p, p.topk.is_some()));
        let mut s = String::from("tool,backend,op,world,dtype,redop,bytes,count,time_us,algbw,busbw,wrong");
        match extra {
            Some((_, false)) => s += ",tokens,hidden,fp8,unfused_us,ratio",
            Some((_, true)) => s += ",tokens,hidden,topk,experts,capacity,fp8,dispatch_us,combine_us",
            None => {}
        }
        s += "\n";
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
            let opt = |v: Option<f64>, places: usize| v.map(|v| format!("{v:.places$}")).unwrap_or_default();
            let tokens = r.tokens.unwrap_or_default();
            match extra {
                Some((p, false)) => {
                    s.pop();
                    s += &format!(
                        ",{tokens},{},{},{},{}\n",
                        p.hidden,
                        p.fp8,
                        opt(r.unfused_us, 3),
                        opt(r.ratio, 4)
                    );
                }
                Some((p, true)) => {
                    s.pop();
                    s += &format!(
                        ",{tokens},{},{},{},{},{},{},{}\n",
                        p.hidden,
                        p.topk.unwrap_or_default(),
                        p.experts.unwrap_or_default(),
                        p.capacity.unwrap_or_default(),
                        p.fp8,
                        opt(r.dispatch_us, 3),
                        opt(r.combine_us, 3)
                    );
                }
                None => {}
            }
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
                ..Row::default()
            }],
            params: None,
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
