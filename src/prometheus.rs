//! Reading the Prometheus text exposition format, what a server's `GET /metrics` answers: each sample's
//! name, labels (with `\\`, `\"` and `\n` unescaped) and value. Blank lines and `#` lines (`# HELP`,
//! `# TYPE`, comments) are skipped; a sample's timestamp is read and dropped.

use anyhow::{anyhow, bail, Context, Result};

/// One sample line: `name{label="value",...} value [timestamp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    /// The value of the label `key`, if the sample has it.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// Every sample of `text`; an unreadable line is an error naming its number.
pub fn parse(text: &str) -> Result<Vec<Sample>> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'))
        .map(|(i, l)| parse_line(l).with_context(|| format!("metrics line {}: {l:?}", i + 1)))
        .collect()
}

fn is_name(s: &str, colon: bool) -> bool {
    let mut chars = s.chars();
    let ok_first = |c: char| c.is_ascii_alphabetic() || c == '_' || (colon && c == ':');
    chars.next().is_some_and(ok_first) && chars.all(|c| ok_first(c) || c.is_ascii_digit())
}

fn parse_line(line: &str) -> Result<Sample> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .ok_or_else(|| anyhow!("no value"))?;
    let name = &line[..name_end];
    if !is_name(name, true) {
        bail!("{name:?} is not a metric name");
    }
    // Blanks may stand between the name and its labels.
    let mut rest = line[name_end..].trim_start();
    let mut labels = Vec::new();
    if let Some(r) = rest.strip_prefix('{') {
        rest = parse_labels(r, &mut labels)?;
    }
    let mut fields = rest.split_whitespace();
    let value = fields.next().ok_or_else(|| anyhow!("no value"))?;
    // Rust reads `NaN`, `+Inf` and `-Inf` as Prometheus writes them.
    let value: f64 = value
        .parse()
        .map_err(|_| anyhow!("{value:?} is not a number"))?;
    if let Some(ts) = fields.next() {
        ts.parse::<i64>()
            .map_err(|_| anyhow!("{ts:?} is not a timestamp"))?;
    }
    if fields.next().is_some() {
        bail!("text after the timestamp");
    }
    Ok(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// Reads `key="value",...}` (the text after `{`) into `out`; returns the text after `}`.
fn parse_labels<'a>(mut s: &'a str, out: &mut Vec<(String, String)>) -> Result<&'a str> {
    loop {
        s = s.trim_start();
        if let Some(r) = s.strip_prefix('}') {
            return Ok(r);
        }
        let (key, r) = s
            .split_once('=')
            .ok_or_else(|| anyhow!("a label without `=`"))?;
        let key = key.trim();
        if !is_name(key, false) {
            bail!("{key:?} is not a label name");
        }
        let r = r
            .trim_start()
            .strip_prefix('"')
            .ok_or_else(|| anyhow!("the label {key} has no quoted value"))?;
        let mut value = String::new();
        let mut chars = r.char_indices();
        let end = loop {
            match chars.next() {
                None => bail!("the label {key} has no closing quote"),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    // Other escapes are not defined: kept as written.
                    Some((_, c)) => {
                        value.push('\\');
                        value.push(c);
                    }
                    None => bail!("the label {key} has no closing quote"),
                },
                Some((_, c)) => value.push(c),
            }
        };
        out.push((key.to_string(), value));
        s = r[end + 1..].trim_start();
        if let Some(r) = s.strip_prefix(',') {
            s = r;
        } else if !s.starts_with('}') {
            bail!("expected `,` or `}}` after the label {key}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn samples_with_and_without_labels() {
        let text = "# HELP sanmai:x A counter.\n# TYPE sanmai:x counter\n\
                    sanmai:x{model_name=\"m\",stage=\"1\"} 2.5\n\
                    \n\
                    up 1 1700000000000\n\
                    h_bucket{le=\"+Inf\",} 7\n\
                    g { a = \"b\" } -Inf\n\
                    n NaN\n";
        let s = parse(text).unwrap();
        assert_eq!(s.len(), 5);
        assert_eq!(s[0].name, "sanmai:x");
        assert_eq!(s[0].labels, labels(&[("model_name", "m"), ("stage", "1")]));
        assert_eq!(s[0].value, 2.5);
        assert_eq!(s[0].label("stage"), Some("1"));
        assert_eq!(s[0].label("le"), None);
        assert_eq!((s[1].name.as_str(), s[1].value), ("up", 1.0));
        assert!(s[1].labels.is_empty());
        assert_eq!(s[2].labels, labels(&[("le", "+Inf")]));
        assert_eq!(s[3].labels, labels(&[("a", "b")]));
        assert_eq!(s[3].value, f64::NEG_INFINITY);
        assert!(s[4].value.is_nan());
    }

    #[test]
    fn escaped_label_values() {
        let s = parse(r#"m{a="say \"hi\"",b="x\\y}z",c="l1\nl2",d="\q"} 3"#).unwrap();
        assert_eq!(
            s[0].labels,
            labels(&[
                ("a", "say \"hi\""),
                ("b", "x\\y}z"),
                ("c", "l1\nl2"),
                ("d", "\\q"),
            ])
        );
        assert_eq!(s[0].value, 3.0);
    }

    #[test]
    fn unreadable_lines_name_their_number() {
        for (text, needle) in [
            ("ok 1\nm{a=\"b\" 1", "line 2"),
            ("m{a=\"b} 1", "closing quote"),
            ("m{a=b} 1", "quoted value"),
            ("m{a=\"b\" c=\"d\"} 1", "expected `,`"),
            ("m{1a=\"b\"} 1", "label name"),
            ("m", "no value"),
            ("m{}", "no value"),
            ("m one", "not a number"),
            ("m 1 later", "timestamp"),
            ("m 1 2 3", "after the timestamp"),
            ("9m 1", "metric name"),
        ] {
            let err = format!("{:#}", parse(text).unwrap_err());
            assert!(err.contains(needle), "{text:?}: {err}");
        }
    }
}
