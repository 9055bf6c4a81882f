//! Message sizes: the command line's byte counts (`64K`, `4M`, `1G`), the sizes one sweep
//! visits, and sizes written for people (axis labels).

/// Parses `1024`, `64K`, `4M`, `1G` with the library's own parser (`ferrocomm::parse_bytes`,
/// the one `FERROCOMM_*` byte settings go through), so both read sizes alike.
pub fn parse(s: &str) -> Result<usize, String> {
    ferrocomm::parse_bytes(s)
        .ok_or_else(|| format!("{s:?} is not a size (bytes, or with a K, M or G suffix) or is too large"))
}

/// `min`, `min * factor`, ... up to `max`, as nccl-tests visits them.
pub fn sweep(min: usize, max: usize, factor: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min;
    while s <= max && s > 0 {
        v.push(s);
        // Past usize::MAX there is no next size: checked_mul ends the sweep rather than wrap.
        match s.checked_mul(factor) {
            Some(next) if next > s => s = next,
            _ => break,
        }
    }
    v
}

/// `512`, `64K`, `1M`, `1.5M`: a size in the largest unit that keeps it at least 1.
pub fn human(bytes: f64) -> String {
    const UNITS: [(&str, f64); 3] = [("G", (1u64 << 30) as f64), ("M", (1u64 << 20) as f64), ("K", 1024.0)];
    for (unit, scale) in UNITS {
        if bytes >= scale {
            let v = bytes / scale;
            return if v.fract().abs() < 1e-9 {
                format!("{v:.0}{unit}")
            } else {
                format!("{v:.1}{unit}")
            };
        }
    }
    format!("{bytes:.0}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_binary_suffixes_and_refuse_the_rest() {
        assert_eq!(parse("8"), Ok(8));
        assert_eq!(parse("64K"), Ok(64 << 10));
        assert_eq!(parse("4m"), Ok(4 << 20));
        assert_eq!(parse("1GiB"), Ok(1 << 30));
        assert!(parse("1x").is_err());
        assert!(parse("").is_err());
        assert!(parse("-1").is_err());
        assert!(parse("99999999999999999999G").is_err());
        assert!(parse(&format!("{}G", usize::MAX)).is_err());
    }

    #[test]
    fn a_sweep_multiplies_up_to_the_maximum_and_never_wraps() {
        assert_eq!(sweep(8, 64, 2), [8, 16, 32, 64]);
        assert_eq!(sweep(8, 100, 4), [8, 32]);
        assert_eq!(sweep(64, 8, 2), Vec::<usize>::new());
        assert_eq!(sweep(usize::MAX / 2 + 1, usize::MAX, 2).len(), 1);
    }

    #[test]
    fn human_sizes_use_the_largest_unit() {
        assert_eq!(human(512.0), "512");
        assert_eq!(human(65536.0), "64K");
        assert_eq!(human(1.5 * 1048576.0), "1.5M");
        assert_eq!(human((1u64 << 30) as f64), "1G");
    }
}
