//! `queue_pickup`: how long a descriptor waits in a proxy queue before the proxy's polling
//! loop picks it up, with the consumer hot (descriptors back to back) and after it has been
//! idle for a while (it polls for FERROCOMM_PROXY_POLL_US, then sleeps in 20 us steps). No communicator: one process,
//! a producer thread and the consumer thread.

use crate::cli::Args;
use crate::progress::Progress;
use ferrocomm::Result;
use std::time::Duration;

/// The idle gaps before a descriptor, a row each.
const GAPS_US: [u64; 5] = [0, 10, 100, 1000, 10_000];

/// Runs `queue_pickup` in this process, prints its table and writes `--json`.
pub fn run(a: &Args) -> Result<()> {
    println!(
        "# ferrocomm-bench queue_pickup: up to {} descriptors per row (fewer after long gaps), one in flight",
        a.iters
    );
    println!("#  idle gap     p50 (us)   p90 (us)   p99 (us)   max (us)  mean (us)");
    let mut json = Vec::new();
    let progress = Progress::new(&a.op, GAPS_US.len(), true);
    for gap_us in GAPS_US {
        progress.start_row(format!("gaps of {gap_us} us"));
        let gap = Duration::from_micros(gap_us);
        // Five seconds of gaps at most per row.
        let samples = a.iters.min((5_000_000 / gap_us.max(1)) as usize).max(1);
        ferrocomm::net::measure_pickup(a.warmup.clamp(1, samples), gap)?;
        let mut t: Vec<f64> = ferrocomm::net::measure_pickup(samples, gap)?
            .iter()
            .map(|d| d.as_secs_f64() * 1e6)
            .collect();
        t.sort_by(f64::total_cmp);
        let at = |q: f64| t[((t.len() - 1) as f64 * q).round() as usize];
        let mean = t.iter().sum::<f64>() / t.len() as f64;
        progress.print_row(&format!(
            "{:>8} us {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>10.3}",
            gap_us,
            at(0.5),
            at(0.9),
            at(0.99),
            at(1.0),
            mean
        ));
        json.push(format!(
            "{{\"gap_us\":{gap_us},\"p50_us\":{:.3},\"p90_us\":{:.3},\"p99_us\":{:.3},\"max_us\":{:.3},\"mean_us\":{mean:.3}}}",
            at(0.5),
            at(0.9),
            at(0.99),
            at(1.0)
        ));
    }
    if let Some(p) = &a.json {
        let doc = format!(
            "{{\"tool\":\"ferrocomm\",\"op\":\"queue_pickup\",\"rows\":[{}]}}\n",
            json.join(",")
        );
        std::fs::write(p, doc).map_err(|e| ferrocomm::Error::Io {
            context: "write benchmark output".into(),
            source: e,
        })?;
    }
    Ok(())
}
