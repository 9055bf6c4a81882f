//! The progress bar of a sweep: on stderr, only when stderr is a terminal, and only once the
//! sweep has run for a couple of seconds (a quick sweep prints its table and nothing else).
//! Rows still go to stdout, so a redirected table or `--json` never holds a bar.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// How long a sweep runs before its bar appears.
const SHOW_AFTER: Duration = Duration::from_secs(2);

/// The bar of one sweep; hidden until `SHOW_AFTER` has passed at a row's start.
pub struct Progress {
    bar: ProgressBar,
    started: Instant,
    /// Whether this process may draw at all: it leads the sweep and stderr is a terminal.
    drawable: bool,
}

impl Progress {
    /// A bar over the `rows` rows (sizes, mostly) of `op`; `lead` says whether this process reports the sweep
    /// (rank 0 of several).
    pub fn new(op: &str, rows: usize, lead: bool) -> Progress {
        let bar = ProgressBar::with_draw_target(Some(rows as u64), ProgressDrawTarget::hidden());
        // The template is a constant; should indicatif ever refuse it, the bar keeps its default.
        if let Ok(style) = ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} rows, now {msg} ({elapsed})") {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(op.to_owned());
        Progress {
            bar,
            started: Instant::now(),
            drawable: lead && std::io::stderr().is_terminal(),
        }
    }

    /// Says that the row of `bytes` starts; shows the bar if the sweep has run long enough.
    pub fn start_size(&self, bytes: usize) {
        self.start_row(format!("{} bytes", crate::size::human(bytes as f64)));
    }

    /// Says that the row `now` starts; shows the bar if the sweep has run long enough.
    pub fn start_row(&self, now: String) {
        self.bar.set_message(now);
        if self.drawable && self.bar.is_hidden() && self.started.elapsed() >= SHOW_AFTER {
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
            // Keeps the elapsed time moving through a long row.
            self.bar.enable_steady_tick(Duration::from_millis(250));
        }
    }

    /// Prints a finished row to stdout, clearing the bar around it where both share a terminal.
    pub fn print_row(&self, line: &str) {
        self.bar.suspend(|| {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{line}");
            let _ = out.flush();
        });
        self.bar.inc(1);
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}
