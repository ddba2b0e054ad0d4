//! Python-compatible formatting of template values, as Jinja2 under transformers produces it:
//! `str()`/`repr()` of values, `json.dumps(..., ensure_ascii=False)`, and `strftime`.

use std::fmt::Write as _;

use minijinja::value::{Value, ValueKind};

/// Python's `str(value)`: strings as they are, `True`/`False`/`None`, containers as `repr`.
pub fn py_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::String => value.as_str().unwrap_or_default().to_string(),
        ValueKind::Undefined => String::new(),
        _ => py_repr(value),
    }
}

/// Python's `repr(value)`.
pub fn py_repr(value: &Value) -> String {
    let mut out = String::new();
    write_repr(&mut out, value);
    out
}

fn write_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&number_repr(value)),
        ValueKind::String => write_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            let tuple = value.is_tuple();
            out.push(if tuple { '(' } else { '[' });
            let mut n = 0;
            for (i, item) in value.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &item);
                n += 1;
            }
            if tuple && n == 1 {
                out.push(',');
            }
            out.push(if tuple { ')' } else { ']' });
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &key);
                out.push_str(": ");
                write_repr(out, &value.get_item(&key).unwrap_or_default());
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr(str)`: single quotes unless the text has `'` and no `"`.
fn write_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..=0xa0).contains(&(c as u32)) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if !is_printable(c) => {
                let n = c as u32;
                if n > 0xffff {
                    let _ = write!(out, "\\U{n:08x}");
                } else {
                    let _ = write!(out, "\\u{n:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// An approximation of `str.isprintable` for characters past U+00A0: separators other than
/// the space, and format characters, are not printable.
fn is_printable(c: char) -> bool {
    !matches!(c as u32,
        0xad | 0x600..=0x605 | 0x61c | 0x6dd | 0x70f | 0x1680 | 0x180e | 0x2000..=0x200f
        | 0x2028..=0x202f | 0x205f..=0x206f | 0x3000 | 0xd800..=0xf8ff | 0xfeff
        | 0xfff9..=0xfffb | 0xe0000..=0xe007f | 0xf0000..=0x10ffff)
}

fn number_repr(value: &Value) -> String {
    if value.is_integer() {
        if let Ok(n) = i128::try_from(value.clone()) {
            return n.to_string();
        }
    }
    match f64::try_from(value.clone()) {
        Ok(f) => float_repr(f),
        Err(_) => value.to_string(),
    }
}

/// Python's `repr(float)`: shortest round-trip digits, fixed notation for exponents in
/// `-4..16`, otherwise `1e+16` style; `inf`, `-inf`, `nan`.
pub fn float_repr(f: f64) -> String {
    float_format(f, "inf", "nan")
}

fn float_format(f: f64, inf: &str, nan: &str) -> String {
    if f.is_nan() {
        return nan.to_string();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            inf.to_string()
        } else {
            format!("-{inf}")
        };
    }
    // `{:e}` yields the shortest round-trip digits: "-1.2345e-7", "1e16", "0e0".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if (point as usize) >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            let (a, b) = digits.split_at(point as usize);
            format!("{a}.{b}")
        };
        format!("{sign}{body}")
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{esign}{:02}", exp.abs())
    }
}

/// Options of Python's `json.dumps`.
#[derive(Debug, Clone)]
pub struct JsonOptions {
    pub ensure_ascii: bool,
    /// `None`: single line; `Some(s)`: newline and `s` per level.
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
}

impl Default for JsonOptions {
    fn default() -> Self {
        JsonOptions {
            ensure_ascii: false,
            indent: None,
            item_separator: ", ".to_string(),
            key_separator: ": ".to_string(),
            sort_keys: false,
        }
    }
}

/// Python's `json.dumps(value, ...)`. Fails on values JSON cannot hold (undefined, objects).
pub fn json_dumps(value: &Value, opts: &JsonOptions) -> Result<String, String> {
    let mut out = String::new();
    write_json(&mut out, value, opts, 0)?;
    Ok(out)
}

fn newline(out: &mut String, opts: &JsonOptions, level: usize) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

fn write_json(
    out: &mut String,
    value: &Value,
    opts: &JsonOptions,
    level: usize,
) -> Result<(), String> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                out.push_str(&number_repr(value));
            } else {
                let f = f64::try_from(value.clone()).map_err(|e| e.to_string())?;
                out.push_str(&float_format(f, "Infinity", "NaN"));
            }
        }
        ValueKind::String => write_json_str(out, value.as_str().unwrap_or_default(), opts),
        ValueKind::Seq => {
            let items: Vec<Value> = value.try_iter().map_err(|e| e.to_string())?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_separator);
                }
                newline(out, opts, level + 1);
                write_json(out, item, opts, level + 1)?;
            }
            newline(out, opts, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter().map_err(|e| e.to_string())?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_separator);
                }
                newline(out, opts, level + 1);
                let key_text = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or_default().to_string(),
                    ValueKind::None => "null".to_string(),
                    ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_string(),
                    ValueKind::Number => number_repr(key),
                    kind => {
                        return Err(format!(
                            "keys must be str, int, float, bool or None, not {kind}"
                        ))
                    }
                };
                write_json_str(out, &key_text, opts);
                out.push_str(&opts.key_separator);
                let item = value.get_item(key).map_err(|e| e.to_string())?;
                write_json(out, &item, opts, level + 1)?;
            }
            newline(out, opts, level);
            out.push('}');
        }
        kind => return Err(format!("Object of type {kind} is not JSON serializable")),
    }
    Ok(())
}

fn write_json_str(out: &mut String, s: &str, opts: &JsonOptions) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if opts.ensure_ascii && (c as u32) > 0x7e => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A broken-down UTC time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CivilTime {
    pub year: i64,
    pub month: u32,
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
    /// 0 = Monday.
    pub weekday: u32,
    /// 1-based day of the year.
    pub yday: u32,
}

impl CivilTime {
    /// The UTC time `secs` seconds after the Unix epoch.
    pub fn from_unix(secs: i64) -> CivilTime {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400) as u32;
        // Howard Hinnant's civil_from_days.
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = yoe + era * 400 + i64::from(month <= 2);
        let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
        const CUM: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
        let yday = CUM[month as usize - 1] + day + u32::from(leap && month > 2);
        CivilTime {
            year,
            month,
            day,
            hour: rem / 3600,
            minute: rem / 60 % 60,
            second: rem % 60,
            weekday: (days + 3).rem_euclid(7) as u32,
            yday,
        }
    }
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// C `strftime` for the common directives (`%Y %y %m %d %e %H %I %M %S %p %B %b %h %A %a %j
/// %w %u %F %T %D %R %c %x %X %%`); `%-d` style drops zero padding. Unknown directives are
/// copied through.
pub fn strftime(t: &CivilTime, format: &str) -> String {
    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let num = |n: u32, width: usize| {
            if no_pad {
                n.to_string()
            } else {
                format!("{n:0width$}")
            }
        };
        let hour12 = match t.hour % 12 {
            0 => 12,
            h => h,
        };
        match chars.next() {
            Some('Y') => out.push_str(&t.year.to_string()),
            Some('y') => out.push_str(&num(t.year.rem_euclid(100) as u32, 2)),
            Some('m') => out.push_str(&num(t.month, 2)),
            Some('d') => out.push_str(&num(t.day, 2)),
            Some('e') => out.push_str(&format!("{:>2}", t.day)),
            Some('H') => out.push_str(&num(t.hour, 2)),
            Some('I') => out.push_str(&num(hour12, 2)),
            Some('M') => out.push_str(&num(t.minute, 2)),
            Some('S') => out.push_str(&num(t.second, 2)),
            Some('j') => out.push_str(&num(t.yday, 3)),
            Some('p') => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[t.month as usize - 1]),
            Some('b') | Some('h') => out.push_str(&MONTHS[t.month as usize - 1][..3]),
            Some('A') => out.push_str(WEEKDAYS[t.weekday as usize]),
            Some('a') => out.push_str(&WEEKDAYS[t.weekday as usize][..3]),
            Some('w') => out.push_str(&((t.weekday + 1) % 7).to_string()),
            Some('u') => out.push_str(&(t.weekday + 1).to_string()),
            Some('F') => out.push_str(&strftime(t, "%Y-%m-%d")),
            Some('T') => out.push_str(&strftime(t, "%H:%M:%S")),
            Some('D') => out.push_str(&strftime(t, "%m/%d/%y")),
            Some('R') => out.push_str(&strftime(t, "%H:%M")),
            Some('c') => out.push_str(&strftime(t, "%a %b %e %H:%M:%S %Y")),
            Some('x') => out.push_str(&strftime(t, "%m/%d/%y")),
            Some('X') => out.push_str(&strftime(t, "%H:%M:%S")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1.5e-7, "1.5e-07"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (12345678901234567.0, "1.2345678901234568e+16"),
            (0.1 + 0.2, "0.30000000000000004"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (100.0, "100.0"),
            (f64::INFINITY, "inf"),
        ];
        for (f, want) in cases {
            assert_eq!(float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn json_matches_python_dumps() {
        let v = Value::from_serialize_json(r#"{"b": [1, 2.5, true, null], "a": "x<\"é\n"}"#);
        assert_eq!(
            json_dumps(&v, &JsonOptions::default()).unwrap(),
            r#"{"b": [1, 2.5, true, null], "a": "x<\"é\n"}"#
        );
        let opts = JsonOptions {
            indent: Some("  ".into()),
            item_separator: ",".into(),
            sort_keys: true,
            ensure_ascii: true,
            ..JsonOptions::default()
        };
        assert_eq!(
            json_dumps(&v, &opts).unwrap(),
            "{\n  \"a\": \"x<\\\"\\u00e9\\n\",\n  \"b\": [\n    1,\n    2.5,\n    true,\n    null\n  ]\n}"
        );
        assert!(json_dumps(&Value::UNDEFINED, &JsonOptions::default()).is_err());
    }

    #[test]
    fn repr_matches_python() {
        let v = Value::from_serialize_json(r#"["it's", "a\"b", {"k": null, "t": false}, 3]"#);
        assert_eq!(
            py_repr(&v),
            r#"["it's", 'a"b', {'k': None, 't': False}, 3]"#
        );
        assert_eq!(py_str(&Value::from("plain")), "plain");
        assert_eq!(py_str(&Value::from(true)), "True");
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = CivilTime::from_unix(1_709_211_909);
        assert_eq!(
            t,
            CivilTime {
                year: 2024,
                month: 2,
                day: 29,
                hour: 13,
                minute: 5,
                second: 9,
                weekday: 3,
                yday: 60
            }
        );
        assert_eq!(strftime(&t, "%d %b %Y"), "29 Feb 2024");
        assert_eq!(
            strftime(&t, "%A, %B %-d, %Y %I:%M %p"),
            "Thursday, February 29, 2024 01:05 PM"
        );
        assert_eq!(strftime(&t, "%F %T %j %%"), "2024-02-29 13:05:09 060 %");
        assert_eq!(CivilTime::from_unix(0).weekday, 3);
    }

    trait FromJson {
        fn from_serialize_json(text: &str) -> Value;
    }
    impl FromJson for Value {
        fn from_serialize_json(text: &str) -> Value {
            crate::template::messages::json_to_value(&serde_json::from_str(text).unwrap())
        }
    }
}
