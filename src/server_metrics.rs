//! What a server's `/metrics` counted during a `sanmai bench serve` run, from a scrape before and one
//! after it: the deltas of a few engine counters and, where the server runs pipeline stages
//! (`sanmai:pp_stage_busy_seconds_total` and `sanmai:pp_stage_idle_seconds_total`, one sample per
//! `stage` label), each stage's busy and idle seconds, its busy fraction of the time between the
//! scrapes, and the pipeline overlap: the stages' busy seconds summed over that time (1 when the stages
//! compute in turn, N when N stages are all busy at once). Counters are found by their name after the
//! namespace (`sanmai:`, `vllm:`) and summed over their other labels.

use std::time::Instant;

use serde_json::{json, Value};

use crate::prometheus::Sample;

/// One scrape: its samples and when the server answered (the middle of the round trip).
pub struct Scrape {
    pub at: Instant,
    pub samples: Vec<Sample>,
}

const BUSY: &str = "pp_stage_busy_seconds_total";
const IDLE: &str = "pp_stage_idle_seconds_total";

/// The counters whose deltas are reported: name after the namespace, and the JSON key.
const COUNTERS: [(&str, &str); 5] = [
    ("prompt_tokens_total", "prompt_tokens"),
    ("generation_tokens_total", "generation_tokens"),
    ("prefix_cache_queries_total", "prefix_cache_queries"),
    ("prefix_cache_hits_total", "prefix_cache_hits"),
    ("num_preemptions_total", "preemptions"),
];

/// One pipeline stage during the run.
#[derive(Debug, Clone, PartialEq)]
pub struct StageFigures {
    /// The `stage` label.
    pub stage: String,
    pub busy_s: f64,
    pub idle_s: f64,
    /// `busy_s` over the time between the scrapes.
    pub busy_fraction: f64,
}

/// What the server counted between two scrapes.
#[derive(Debug, Clone)]
pub struct RunCounters {
    /// Seconds between the scrapes.
    pub window_s: f64,
    /// JSON key and delta of each counter the server has.
    pub counters: Vec<(&'static str, f64)>,
    /// Every stage, in stage order; empty without pipeline stages.
    pub stages: Vec<StageFigures>,
}

/// A metric's name without its namespace: `prompt_tokens_total` of `vllm:prompt_tokens_total`.
fn unqualified(name: &str) -> &str {
    name.rsplit_once(':').map_or(name, |(_, n)| n)
}

/// The sum of the samples named `name` (after the namespace), if there are any.
fn total(samples: &[Sample], name: &str) -> Option<f64> {
    let mut found = samples
        .iter()
        .filter(|s| unqualified(&s.name) == name)
        .peekable();
    found.peek()?;
    Some(found.map(|s| s.value).sum())
}

/// The samples named `name`, summed per `stage` label.
fn per_stage(samples: &[Sample], name: &str) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = Vec::new();
    for s in samples.iter().filter(|s| unqualified(&s.name) == name) {
        let Some(stage) = s.label("stage") else {
            continue;
        };
        match out.iter_mut().find(|(k, _)| k == stage) {
            Some((_, v)) => *v += s.value,
            None => out.push((stage.to_string(), s.value)),
        }
    }
    out
}

/// `after - before` of a counter, missing before counting as 0; `None` when it went back (a restart).
fn delta(before: Option<f64>, after: f64) -> Option<f64> {
    let d = after - before.unwrap_or(0.0);
    (d >= 0.0).then_some(d)
}

impl RunCounters {
    /// The deltas between `before` and `after`, taken `window_s` seconds apart.
    pub fn between(before: &[Sample], after: &[Sample], window_s: f64) -> RunCounters {
        let counters = COUNTERS
            .iter()
            .filter_map(|&(name, key)| {
                let d = delta(total(before, name), total(after, name)?)?;
                Some((key, d))
            })
            .collect();
        let (busy0, idle0) = (per_stage(before, BUSY), per_stage(before, IDLE));
        let idle1 = per_stage(after, IDLE);
        let at = |v: &[(String, f64)], k: &str| v.iter().find(|(s, _)| s == k).map(|(_, x)| *x);
        let mut stages: Vec<StageFigures> = per_stage(after, BUSY)
            .into_iter()
            .filter_map(|(stage, busy1)| {
                let busy_s = delta(at(&busy0, &stage), busy1)?;
                let idle_s = delta(at(&idle0, &stage), at(&idle1, &stage).unwrap_or(0.0))?;
                Some(StageFigures {
                    busy_fraction: busy_s / window_s,
                    stage,
                    busy_s,
                    idle_s,
                })
            })
            .collect();
        stages.sort_by_key(|s| (s.stage.parse::<u64>().unwrap_or(u64::MAX), s.stage.clone()));
        RunCounters {
            window_s,
            counters,
            stages,
        }
    }

    /// The delta of the counter with JSON key `key`, if the server has it.
    pub fn counter(&self, key: &str) -> Option<f64> {
        self.counters
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| *v)
    }

    /// The stages' busy seconds summed over the window; `None` without pipeline stages.
    pub fn overlap(&self) -> Option<f64> {
        (!self.stages.is_empty())
            .then(|| self.stages.iter().map(|s| s.busy_s).sum::<f64>() / self.window_s)
    }

    /// Prints the counters as `line(label, value)` rows and the stage table.
    pub fn print(&self, line: &dyn Fn(&str, String)) {
        if !self.counters.is_empty() {
            println!("{:-^52}", "Server Counters");
            for (key, label) in [
                ("prompt_tokens", "Prompt tokens processed:"),
                ("generation_tokens", "Generation tokens:"),
            ] {
                if let Some(v) = self.counter(key) {
                    line(label, format!("{v}"));
                }
            }
            if let (Some(hits), Some(q)) = (
                self.counter("prefix_cache_hits"),
                self.counter("prefix_cache_queries"),
            ) {
                if q > 0.0 {
                    line(
                        "Prefix cache hit rate (%):",
                        format!("{:.2}", hits / q * 1e2),
                    );
                }
            }
            if let Some(v) = self.counter("preemptions") {
                line("Preemptions:", format!("{v}"));
            }
        }
        if let Some(overlap) = self.overlap() {
            println!("{:-^52}", "Pipeline Stages");
            println!(
                "{:<10}{:>14}{:>14}{:>14}",
                "Stage", "Busy (s)", "Idle (s)", "Busy/wall"
            );
            for s in &self.stages {
                println!(
                    "{:<10}{:>14.3}{:>14.3}{:>14.3}",
                    s.stage, s.busy_s, s.idle_s, s.busy_fraction
                );
            }
            line(
                "Pipeline overlap (busy sum / wall):",
                format!("{overlap:.2}"),
            );
        }
    }

    /// The figures as JSON fields: `server_counters`, `pp_stages` and `pp_overlap`.
    pub fn json(&self) -> Value {
        let counters: serde_json::Map<String, Value> = self
            .counters
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        let stages: Vec<Value> = self
            .stages
            .iter()
            .map(|s| {
                json!({"stage": s.stage, "busy_s": s.busy_s, "idle_s": s.idle_s,
                       "busy_fraction": s.busy_fraction})
            })
            .collect();
        json!({
            "metrics_window_s": self.window_s,
            "server_counters": counters,
            "pp_stages": stages,
            "pp_overlap": self.overlap(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prometheus::parse;

    fn stage_text(busy: [f64; 2], idle: [f64; 2], generated: u64) -> String {
        let mut t = String::from("# TYPE sanmai:pp_stage_busy_seconds_total counter\n");
        for (k, b) in busy.iter().enumerate() {
            t += &format!(
                "sanmai:pp_stage_busy_seconds_total{{model_name=\"m\",stage=\"{k}\"}} {b}\n"
            );
        }
        for (k, i) in idle.iter().enumerate() {
            t += &format!(
                "sanmai:pp_stage_idle_seconds_total{{model_name=\"m\",stage=\"{k}\"}} {i}\n"
            );
        }
        t + &format!(
            "sanmai:generation_tokens_total{{model_name=\"m\"}} {generated}\n\
             sanmai:prefix_cache_queries_total{{model_name=\"m\"}} 400\n\
             sanmai:prefix_cache_hits_total{{model_name=\"m\"}} 100\n"
        )
    }

    #[test]
    fn stage_deltas_fractions_and_overlap() {
        let before = parse(&stage_text([1.0, 2.0], [5.0, 5.0], 10)).unwrap();
        let after = parse(&stage_text([4.0, 5.5], [6.0, 5.5], 74)).unwrap();
        let r = RunCounters::between(&before, &after, 4.0);
        let got: Vec<(&str, f64, f64, f64)> = r
            .stages
            .iter()
            .map(|s| (s.stage.as_str(), s.busy_s, s.idle_s, s.busy_fraction))
            .collect();
        assert_eq!(got, vec![("0", 3.0, 1.0, 0.75), ("1", 3.5, 0.5, 0.875)]);
        // (3 + 3.5) / 4: the stages were busy at once for part of the run.
        assert_eq!(r.overlap(), Some(1.625));
        assert_eq!(r.counter("generation_tokens"), Some(64.0));
        assert_eq!(r.counter("prefix_cache_hits"), Some(0.0));
        assert_eq!(r.counter("prompt_tokens"), None);
        let j = r.json();
        assert_eq!(j["pp_overlap"], json!(1.625));
        assert_eq!(j["pp_stages"][1]["stage"], json!("1"));
        assert_eq!(j["pp_stages"][1]["busy_s"], json!(3.5));
        assert_eq!(j["server_counters"]["generation_tokens"], json!(64.0));
        assert_eq!(j["metrics_window_s"], json!(4.0));
    }

    #[test]
    fn stages_sort_by_number_and_sum_other_labels() {
        let text = |b: f64| {
            (0..12)
                .rev()
                .map(|k| {
                    format!(
                        "vllm:pp_stage_busy_seconds_total{{engine=\"0\",stage=\"{k}\"}} {b}\n\
                         vllm:pp_stage_busy_seconds_total{{engine=\"1\",stage=\"{k}\"}} {b}\n"
                    )
                })
                .collect::<String>()
        };
        let r = RunCounters::between(
            &parse(&text(1.0)).unwrap(),
            &parse(&text(2.0)).unwrap(),
            8.0,
        );
        let order: Vec<&str> = r.stages.iter().map(|s| s.stage.as_str()).collect();
        assert_eq!(
            order,
            ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11"]
        );
        assert!(r.stages.iter().all(|s| s.busy_s == 2.0 && s.idle_s == 0.0));
        assert_eq!(r.overlap(), Some(3.0));
    }

    #[test]
    fn servers_without_stages_or_counters() {
        // A single-stage server: counters, no stage table.
        let before = parse("sanmai:num_preemptions_total{model_name=\"m\"} 2\n").unwrap();
        let after = parse("sanmai:num_preemptions_total{model_name=\"m\"} 5\nother 1\n").unwrap();
        let r = RunCounters::between(&before, &after, 1.0);
        assert!(r.stages.is_empty());
        assert_eq!(r.overlap(), None);
        assert_eq!(r.counters, vec![("preemptions", 3.0)]);
        assert_eq!(r.json()["pp_overlap"], Value::Null);
        // A counter that went back (the server restarted) is left out, and one new since counts from 0.
        let before = parse("vllm:num_preemptions_total 9\n").unwrap();
        let after = parse("vllm:num_preemptions_total 1\nvllm:prompt_tokens_total 30\n").unwrap();
        let r = RunCounters::between(&before, &after, 1.0);
        assert_eq!(r.counters, vec![("prompt_tokens", 30.0)]);
        assert!(RunCounters::between(&[], &[], 1.0).counters.is_empty());
    }
}
