//! The fused all_reduce + residual add + RMSNorm (`Op::AllReduceRmsNorm`) on the collective
//! window: kernels/fused_norm.cu's one-shot (every rank computes every row; few rows) and
//! two-shot (each rank computes its run of rows, then every rank copies the others' results;
//! many rows), picked by size or by the hint `algorithm` = `oneshot` / `twoshot`.
//!
//! A launch keeps every rank's rows of `x`, the two-shot results and a scratch row per block in
//! the window's first region; a call with more rows than fit runs as consecutive launches of
//! whole rows, the same cut on every rank (it depends only on the shape, the dtypes, the world
//! size and the region). A row that does not fit even alone has no kernel here: the backend
//! then runs the operation on its other paths (the CPU engine, or the staged host copy).
//!
//! Ranks whose calls differ must all find out in the same launch (kernels/fused_norm.cu): every
//! launch has the same grid, MAX_BLOCKS, whatever its rows, and carries the call's rows and its
//! own index, so the first launch of calls cut differently already differs and the later
//! launches of a mismatched call end at once on every rank.

use crate::contracts::error::Result;
use crate::contracts::window_handle::WindowHandle;
use crate::gpu::kernels::MAX_BLOCKS;
use crate::gpu::kernels::{self, Function, NormArgs, Queue};
use std::collections::HashMap;

pub(super) const OP: &str = "all_reduce_residual_rmsnorm";

/// kernels/fused_norm.cu's per-block header bytes.
const HEADER_BYTES: usize = 32;

/// The fused norm's kernels per name suffix (`f32`, `f16`, `bf16`, each also with `_fp8`).
pub(super) struct NormKernels {
    pub(super) one_shot: HashMap<&'static str, Function>,
    pub(super) two_shot: HashMap<&'static str, Function>,
}

pub(super) use crate::gpu::kernels::norm_suffix as suffix;

impl NormKernels {
    pub(super) fn load(load: impl Fn(String) -> Result<Function>) -> Result<NormKernels> {
        let (mut one_shot, mut two_shot) = (HashMap::new(), HashMap::new());
        for (_, _, s) in kernels::NORM_SUFFIXES {
            one_shot.insert(s, load(format!("{}{s}", kernels::RMSNORM_ONESHOT.name))?);
            two_shot.insert(s, load(format!("{}{s}", kernels::RMSNORM_TWOSHOT.name))?);
        }
        Ok(NormKernels { one_shot, two_shot })
    }
}

/// One call: its arguments over all rows, and how many rows each launch takes.
pub(super) struct NormCall {
    pub(super) args: NormArgs,
    pub(super) two_shot: bool,
    pub(super) row_in: u64,
    pub(super) row_out: u64,
    pub(super) per_launch: u64,
}

impl NormCall {
    /// The arguments of each launch: consecutive runs of at most `per_launch` rows, each with
    /// the call's rows and its index.
    fn launches(&self) -> impl Iterator<Item = NormArgs> + '_ {
        let a = self.args;
        (0..a.rows.div_ceil(self.per_launch)).map(move |k| {
            let first = k * self.per_launch;
            NormArgs {
                x: a.x + first * self.row_in,
                residual: a.residual + first * self.row_in,
                out: a.out + first * self.row_out,
                scales: if a.scales == 0 { 0 } else { a.scales + 4 * first },
                rows: self.per_launch.min(a.rows - first),
                call_rows: a.rows,
                launch: k,
                ..a
            }
        })
    }

    /// How many kernel launches the call makes.
    pub(super) fn count(&self) -> u32 {
        self.args.rows.div_ceil(self.per_launch).max(1) as u32
    }

    /// Puts the call's launches on `queue`, each of MAX_BLOCKS blocks: a grid that followed the
    /// rows would differ between mismatched calls, and a block of the larger one would wait
    /// for a peer's block that never runs (see the module doc).
    /// `mismatches`: the device address of the kernels' two u64 for mismatched calls.
    pub(super) fn enqueue(
        &self,
        f: &Function,
        queue: Queue<'_>,
        handle: WindowHandle,
        counters: u64,
        mismatches: u64,
    ) -> Result<()> {
        let kernel = if self.two_shot {
            &kernels::RMSNORM_TWOSHOT
        } else {
            &kernels::RMSNORM_ONESHOT
        };
        for a in self.launches() {
            let a = NormArgs { mismatches, ..a };
            kernel.launch(f, queue, MAX_BLOCKS as u32, (handle, a, counters))?;
        }
        Ok(())
    }
}

/// kernels/fused_norm.cu's `Layout`: the segment bytes a launch of `rows` rows uses.
pub(super) fn segment_bytes(
    rows: usize,
    hidden: usize,
    in_size: usize,
    out_size: usize,
    size: usize,
    two_shot: bool,
) -> usize {
    let pad16 = |b: usize| b.next_multiple_of(16);
    let own = if two_shot { rows.div_ceil(size.max(1)) } else { 0 };
    let result_row = pad16(hidden * in_size) + pad16(hidden * out_size) + 16;
    HEADER_BYTES * MAX_BLOCKS + pad16(rows * hidden * in_size) + own * result_row + MAX_BLOCKS * pad16(hidden * 4)
}

/// The most rows (at most `tokens`) that one launch fits into `region` bytes; 0 when not even
/// one row fits.
pub(super) fn rows_per_launch(tokens: usize, region: usize, bytes: impl Fn(usize) -> usize) -> usize {
    if bytes(1) > region {
        return 0;
    }
    // The bytes grow with the rows: bisect for the last count that fits.
    let (mut lo, mut hi) = (1, tokens.max(1));
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if bytes(mid) <= region {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// Two-shot or not: the hint's where it names one of the two, else two-shot from
/// `two_shot_min` bytes of `x` when every rank gets a row; with why a hint was not honoured.
pub(super) fn pick(
    hint: Option<&str>,
    x_bytes: usize,
    tokens: usize,
    size: usize,
    two_shot_min: usize,
) -> (bool, Option<&str>) {
    let by_size = x_bytes >= two_shot_min && tokens >= size;
    match hint {
        None => (by_size, None),
        Some("oneshot") => (false, None),
        Some("twoshot") => (true, None),
        Some(_) => (by_size, Some("the fused norm's kernels run oneshot or twoshot")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_pick_the_algorithm_and_the_size_rule_needs_a_row_per_rank() {
        assert_eq!(pick(None, 100, 64, 4, 1000), (false, None));
        assert_eq!(pick(None, 1000, 64, 4, 1000), (true, None));
        // Fewer rows than ranks: one-shot whatever the size.
        assert_eq!(pick(None, 1 << 20, 3, 4, 1000), (false, None));
        assert_eq!(pick(Some("twoshot"), 8, 1, 4, 1000), (true, None));
        assert_eq!(pick(Some("oneshot"), 1 << 20, 64, 4, 1000), (false, None));
        let (two, why) = pick(Some("multimem"), 1 << 20, 64, 4, 1000);
        assert!(two && why.is_some());
    }

    #[test]
    fn launches_take_whole_rows_that_fit_the_region() {
        let bytes = |rows| segment_bytes(rows, 1000, 2, 1, 4, true);
        let region = 1 << 20;
        let per = rows_per_launch(4096, region, bytes);
        assert!(per > 1 && bytes(per) <= region && bytes(per + 1) > region, "{per}");
        assert_eq!(
            rows_per_launch(3, region, bytes),
            3,
            "never more rows than the call has"
        );
        // A row larger than the region: no launch can take it.
        assert_eq!(
            rows_per_launch(8, region, |r| segment_bytes(r, 1 << 20, 4, 4, 2, false)),
            0
        );
        let call = NormCall {
            args: NormArgs {
                x: 1 << 20,
                residual: 2 << 20,
                out: 3 << 20,
                scales: 4 << 20,
                rows: 10,
                hidden: 8,
                ..Default::default()
            },
            two_shot: false,
            row_in: 16,
            row_out: 8,
            per_launch: 4,
        };
        let l: Vec<NormArgs> = call.launches().collect();
        assert_eq!(l.iter().map(|a| a.rows).collect::<Vec<_>>(), vec![4, 4, 2]);
        assert!(
            l.iter().all(|a| a.call_rows == 10),
            "every launch carries the call's rows"
        );
        assert_eq!(l.iter().map(|a| a.launch).collect::<Vec<_>>(), vec![0, 1, 2]);
        assert_eq!(call.count(), 3);
        assert_eq!((l[2].x, l[2].residual), ((1 << 20) + 128, (2 << 20) + 128));
        assert_eq!((l[2].out, l[2].scales), ((3 << 20) + 64, (4 << 20) + 32));
    }
}
