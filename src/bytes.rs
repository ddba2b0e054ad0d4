//! Byte sizes on the command line and in presets: plain bytes or a number with a unit (`23.5GiB`,
//! `24124MiB`, `2G`; K/M/G/T are binary like their KiB/MiB/GiB/TiB spellings), and their display.

use std::fmt;
use std::str::FromStr;

/// A size in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub usize);

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let t = text.trim();
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let shift = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 0,
            "k" | "kb" | "kib" => 10,
            "m" | "mb" | "mib" => 20,
            "g" | "gb" | "gib" => 30,
            "t" | "tb" | "tib" => 40,
            _ => {
                return Err(format!(
                    "{text:?}: expected bytes, e.g. 23.5GiB, 24124MiB or 2G"
                ))
            }
        };
        let value: f64 = num
            .parse()
            .map_err(|_| format!("{text:?}: expected bytes, e.g. 23.5GiB, 24124MiB or 2G"))?;
        let bytes = value * (1u64 << shift) as f64;
        if !bytes.is_finite() || bytes < 1.0 || bytes > usize::MAX as f64 {
            return Err(format!("{text:?}: expected a positive size"));
        }
        Ok(ByteSize(bytes as usize))
    }
}

/// `bytes` in GiB with two decimals (`23.50 GiB`).
pub fn gib(bytes: usize) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&gib(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        let b = |s: &str| s.parse::<ByteSize>().map(|b| b.0);
        assert_eq!(b("23.5GiB"), Ok(23 * (1 << 30) + (1 << 29)));
        assert_eq!(b("24124MiB"), Ok(24124 << 20));
        assert_eq!(b("2G"), Ok(2 << 30));
        assert_eq!(b("4096"), Ok(4096));
        assert_eq!(b(" 1 kib "), Ok(1024));
        for bad in ["", "GiB", "1.2.3G", "12 parsecs", "0", "-1G"] {
            let e = b(bad).unwrap_err();
            assert!(!e.contains('\n'), "{e}");
        }
        assert_eq!(ByteSize(3 << 29).to_string(), "1.50 GiB");
    }
}
