//! What a plot shows: reports grouped into one panel per op and one line per tool, backend,
//! world size and type. Repeated runs of a line (scripts/cpu_compare.sh repeats every tool)
//! merge, each size keeping its fastest run, as scripts/compare_report.py's tables do.

use crate::report::Report;
use clap::CommandFactory;
use std::collections::BTreeMap;

/// One size of a line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Point {
    /// Message size (the x axis).
    pub bytes: f64,
    /// Microseconds per call.
    pub time_us: f64,
    /// Bus bandwidth, GB/s.
    pub busbw: f64,
}

/// One line: a tool's runs of one op at one world size.
#[derive(Clone, Debug)]
pub struct Series {
    /// The legend's text: `ferrocomm n=2`, with the backend and type where the panel needs them
    /// to tell lines apart.
    pub label: String,
    /// Which tool measured it (lines of one tool share a marker).
    pub tool: String,
    /// By size, ascending.
    pub points: Vec<Point>,
}

/// The lines of one op.
#[derive(Clone, Debug)]
pub struct Panel {
    /// The op, in the captions.
    pub op: String,
    /// Its lines, in the legend's order.
    pub series: Vec<Series>,
}

/// A panel's lines while they are gathered: each line's points by size.
type Lines = Vec<(Key, BTreeMap<usize, Point>)>;

/// What identifies a line; runs with equal keys merge.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    tool: String,
    backend: String,
    world: usize,
    dtype: String,
}

/// Groups `reports` into panels of lines, in an order that does not depend on the files'
/// order: panels as the bench lists its ops (others after them, by name), lines by tool,
/// backend, world size and type.
/// Rows that cannot be drawn on logarithmic axes (a size or time of zero, or not finite) are
/// left out; a report left with no rows is refused, naming its op and tool.
pub fn panels(reports: &[Report]) -> Result<Vec<Panel>, String> {
    let mut ops: Vec<(String, Lines)> = Vec::new();
    for r in reports {
        let drawable: Vec<Point> = r
            .rows
            .iter()
            .filter(|row| row.bytes > 0 && row.time_us > 0.0 && row.time_us.is_finite() && row.busbw.is_finite())
            .map(|row| Point {
                bytes: row.bytes as f64,
                time_us: row.time_us,
                busbw: row.busbw.max(0.0),
            })
            .collect();
        if drawable.is_empty() {
            return Err(format!("{} {} (world {}): no rows to plot", r.tool, r.op, r.world));
        }
        // rmsnorm's rows also time the unfused steps: a line of their own beside the fused
        // call's, same bytes and bus factor.
        let unfused: Vec<Point> = r
            .rows
            .iter()
            .filter_map(|row| {
                let t = row.unfused_us?;
                (row.bytes > 0 && t > 0.0 && t.is_finite() && row.time_us > 0.0).then(|| Point {
                    bytes: row.bytes as f64,
                    time_us: t,
                    busbw: (row.busbw * row.time_us / t).max(0.0),
                })
            })
            .collect();
        let mut tools = vec![(r.tool.clone(), drawable)];
        if !unfused.is_empty() {
            tools.push((format!("{} unfused", r.tool), unfused));
        }
        let i = index_of(&mut ops, &r.op, |op| (op.clone(), Vec::new()));
        for (tool, points) in tools {
            let key = Key {
                tool,
                backend: r.backend.clone(),
                world: r.world,
                dtype: r.dtype.clone(),
            };
            let lines = &mut ops[i].1;
            let j = index_of(lines, &key, |k| (k.clone(), BTreeMap::new()));
            let line = &mut lines[j].1;
            for p in points {
                let faster = line.get(&(p.bytes as usize)).is_none_or(|q| p.time_us < q.time_us);
                if faster {
                    line.insert(p.bytes as usize, p);
                }
            }
        }
    }
    // Panels in the order of `ferrocomm-bench --help`: its subcommands are the ops' names.
    let order: Vec<String> = crate::cli::Cli::command()
        .get_subcommands()
        .map(|c| c.get_name().to_owned())
        .collect();
    let rank = |op: &str| order.iter().position(|o| o == op).unwrap_or(order.len());
    ops.sort_by(|(a, _), (b, _)| (rank(a), a).cmp(&(rank(b), b)));
    Ok(ops
        .into_iter()
        .map(|(op, mut lines)| {
            lines.sort_by(|(a, _), (b, _)| a.cmp(b));
            let labels = labels(&lines.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>());
            Panel {
                op,
                series: lines
                    .into_iter()
                    .zip(labels)
                    .map(|((key, points), label)| Series {
                        label,
                        tool: key.tool,
                        points: points.into_values().collect(),
                    })
                    .collect(),
            }
        })
        .collect())
}

/// The index of the entry of `v` keyed `key`, appending `new(key)` if there is none.
fn index_of<K: PartialEq, V>(v: &mut Vec<(K, V)>, key: &K, new: impl FnOnce(&K) -> (K, V)) -> usize {
    match v.iter().position(|(k, _)| k == key) {
        Some(i) => i,
        None => {
            v.push(new(key));
            v.len() - 1
        }
    }
}

/// The shortest labels that tell the panel's lines apart: the tool and world size, then the
/// backend, then the type.
fn labels(keys: &[Key]) -> Vec<String> {
    let forms: [fn(&Key) -> String; 3] = [
        |k| format!("{} n={}", k.tool, k.world),
        |k| format!("{} {} n={}", k.tool, k.backend, k.world),
        |k| format!("{} {} {} n={}", k.tool, k.backend, k.dtype, k.world),
    ];
    for form in &forms[..2] {
        let v: Vec<String> = keys.iter().map(form).collect();
        let mut unique = v.clone();
        unique.sort();
        unique.dedup();
        if unique.len() == v.len() {
            return v;
        }
    }
    keys.iter().map(forms[2]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Row;

    fn report(tool: &str, backend: &str, op: &str, world: usize, rows: &[(usize, f64)]) -> Report {
        Report {
            tool: tool.into(),
            backend: backend.into(),
            op: op.into(),
            world,
            dtype: "f32".into(),
            redop: "sum".into(),
            rows: rows
                .iter()
                .map(|&(bytes, time_us)| Row {
                    bytes,
                    count: bytes / 4,
                    time_us,
                    algbw: 0.0,
                    busbw: bytes as f64 / time_us / 1e3,
                    wrong: 0,
                    ..Row::default()
                })
                .collect(),
            params: None,
        }
    }

    #[test]
    fn repeated_runs_merge_keeping_each_sizes_fastest_time() {
        let p = panels(&[
            report("ferrocomm", "cpu", "all_reduce", 2, &[(8, 2.0), (16, 1.0)]),
            report("ferrocomm", "cpu", "all_reduce", 2, &[(8, 1.5), (16, 3.0), (32, 4.0)]),
        ])
        .unwrap();
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].series.len(), 1);
        let times: Vec<f64> = p[0].series[0].points.iter().map(|q| q.time_us).collect();
        assert_eq!(times, [1.5, 1.0, 4.0]);
    }

    #[test]
    fn each_op_gets_a_panel_in_the_benchs_order_and_labels_grow_only_as_needed() {
        let p = panels(&[
            report("ferrocomm", "device", "all_gather", 2, &[(8, 1.0)]),
            report("mpich", "mpi", "all_reduce", 2, &[(8, 1.0)]),
            report("ferrocomm", "cpu", "all_gather", 2, &[(8, 1.0)]),
            report("ferrocomm", "cpu", "all_reduce", 2, &[(8, 1.0)]),
        ])
        .unwrap();
        let ops: Vec<&str> = p.iter().map(|x| x.op.as_str()).collect();
        assert_eq!(ops, ["all_reduce", "all_gather"]);
        let labels = |i: usize| p[i].series.iter().map(|s| s.label.clone()).collect::<Vec<_>>();
        assert_eq!(labels(0), ["ferrocomm n=2", "mpich n=2"]);
        assert_eq!(labels(1), ["ferrocomm cpu n=2", "ferrocomm device n=2"]);
    }

    #[test]
    fn rmsnorm_rows_draw_the_unfused_steps_as_a_second_line() {
        let mut r = report("ferrocomm", "cpu", "rmsnorm", 2, &[(1024, 2.0), (2048, 3.0)]);
        r.rows[1].unfused_us = Some(6.0);
        let p = panels(&[r]).unwrap();
        let labels: Vec<&str> = p[0].series.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(labels, ["ferrocomm n=2", "ferrocomm unfused n=2"]);
        let u = &p[0].series[1].points;
        assert_eq!(u.len(), 1);
        assert_eq!((u[0].bytes, u[0].time_us), (2048.0, 6.0));
        assert!((u[0].busbw - p[0].series[0].points[1].busbw / 2.0).abs() < 1e-12);
    }

    #[test]
    fn undrawable_rows_are_left_out_and_an_empty_report_is_refused() {
        let p = panels(&[report(
            "gloo",
            "gloo",
            "all_to_all",
            4,
            &[(0, 1.0), (8, 0.0), (16, 2.0)],
        )])
        .unwrap();
        assert_eq!(p[0].series[0].points.len(), 1);
        let e = panels(&[report("gloo", "gloo", "all_to_all", 4, &[])]).unwrap_err();
        assert!(e.contains("gloo all_to_all"), "{e}");
    }
}
