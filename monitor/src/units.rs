//! Human-readable byte counts in binary units, at most 8 characters wide.

/// `bytes` as `"512 B"`, `"1.25 GiB"`, `"48.0 MiB"`, `"1023 KiB"`: three significant digits (four
/// just below the next unit), binary units up to EiB.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    // Rounding may carry into the next unit ("1024 KiB"): show it there.
    let shown = if value < 9.995 {
        format!("{value:.2}")
    } else if value < 99.95 {
        format!("{value:.1}")
    } else {
        format!("{value:.0}")
    };
    if shown == "1024" && unit + 1 < UNITS.len() {
        return format!("1.00 {}", UNITS[unit + 1]);
    }
    format!("{shown} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::human_bytes;

    #[test]
    fn units_are_binary_and_short() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1024), "1.00 KiB");
        assert_eq!(human_bytes(48 << 20), "48.0 MiB");
        assert_eq!(human_bytes(512 << 20), "512 MiB");
        assert_eq!(human_bytes(5 << 30), "5.00 GiB");
        assert_eq!(human_bytes((1 << 30) + (1 << 28)), "1.25 GiB");
        assert_eq!(human_bytes((1 << 20) - 1), "1.00 MiB");
        assert_eq!(human_bytes(1023 << 10), "1023 KiB");
        assert_eq!(human_bytes(u64::MAX), "16.0 EiB");
        for shift in 0..64 {
            for bytes in [(1u64 << shift) - 1, 1u64 << shift, (1u64 << shift) + (1 << shift) / 3] {
                assert!(human_bytes(bytes).len() <= 8, "{bytes}: {}", human_bytes(bytes));
            }
        }
    }
}
