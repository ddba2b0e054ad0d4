//! `GET /metrics`: the engine's [`MetricsSnapshot`] in the Prometheus text format, under vLLM's metric
//! names with a `sanmai:` prefix and a `model_name` label.

use std::fmt::Write;

use sanmai_engine::api::{Histogram, KvHostStats, MetricsSnapshot, RowCacheCounts, StageTimes};

/// The Prometheus text exposition of `m`.
pub fn render(m: &MetricsSnapshot, model_name: &str) -> String {
    let label = format!("model_name=\"{}\"", escape(model_name));
    let mut out = String::with_capacity(4096);
    let gauges: [(&str, &str, f64); 3] = [
        (
            "num_requests_running",
            "Number of requests in model execution batches.",
            m.requests_running as f64,
        ),
        (
            "num_requests_waiting",
            "Number of requests waiting to be processed.",
            m.requests_waiting as f64,
        ),
        (
            "kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            m.kv_cache_usage,
        ),
    ];
    for (name, help, v) in gauges {
        metric(&mut out, name, "gauge", help);
        let _ = writeln!(out, "sanmai:{name}{{{label}}} {}", num(v));
    }
    let counters: [(&str, &str, u64); 6] = [
        (
            "prompt_tokens_total",
            "Number of prefill tokens processed.",
            m.prompt_tokens_total,
        ),
        (
            "generation_tokens_total",
            "Number of generation tokens processed.",
            m.generation_tokens_total,
        ),
        (
            "prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            m.prefix_cache_queries_total,
        ),
        (
            "prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            m.prefix_cache_hits_total,
        ),
        (
            "num_preemptions_total",
            "Cumulative number of preemptions from the engine.",
            m.preemptions_total,
        ),
        (
            "request_success_total",
            "Count of finished requests.",
            m.requests_finished_total,
        ),
    ];
    for (name, help, v) in counters {
        metric(&mut out, name, "counter", help);
        let _ = writeln!(out, "sanmai:{name}{{{label}}} {v}");
    }
    if let Some(p) = &m.ple {
        let ple: [(&str, &str, f64); 5] = [
            (
                "ple_pages_requested_total",
                "PLE table pages requested ahead of their reads (prompt windows and decode rows).",
                p.pages_requested as f64,
            ),
            (
                "ple_prefetch_windows_total",
                "PLE prompt prefetch windows of 1024 tokens requested.",
                p.windows_done as f64,
            ),
            (
                "ple_prefetch_windows_dropped_total",
                "PLE prompt prefetch windows dropped because their request ended or was preempted.",
                p.windows_dropped as f64,
            ),
            (
                "ple_gathered_tokens_total",
                "Tokens whose PLE rows were gathered from the table.",
                p.gathered_tokens as f64,
            ),
            (
                "ple_gather_seconds_total",
                "Time spent gathering PLE rows from the table.",
                p.gather_ns as f64 * 1e-9,
            ),
        ];
        for (name, help, v) in ple {
            metric(&mut out, name, "counter", help);
            let _ = writeln!(out, "sanmai:{name}{{{label}}} {}", num(v));
        }
    }
    if let Some(h) = &m.kv_host {
        kv_host(&mut out, &label, h);
    }
    if !m.spec_decode_num_accepted_tokens_per_pos_total.is_empty() {
        spec_decode(&mut out, &label, m);
    }
    if !m.stages.is_empty() {
        type Counter = (&'static str, &'static str, fn(&StageTimes) -> f64);
        let stage: [Counter; 2] = [
            (
                "pp_stage_busy_seconds_total",
                "Time each pipeline stage spent computing its share of steps.",
                |t| t.busy_seconds,
            ),
            (
                "pp_stage_idle_seconds_total",
                "Time each pipeline stage spent waiting for a step or for the previous stage.",
                |t| t.idle_seconds,
            ),
        ];
        for (name, help, get) in stage {
            metric(&mut out, name, "counter", help);
            for (k, t) in m.stages.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "sanmai:{name}{{{label},stage=\"{k}\"}} {}",
                    num(get(t))
                );
            }
        }
    }
    let histograms: [(&str, &str, &Histogram); 3] = [
        (
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &m.time_to_first_token,
        ),
        (
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &m.inter_token_latency,
        ),
        (
            "e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            &m.e2e_request_latency,
        ),
    ];
    for (name, help, h) in histograms {
        metric(&mut out, name, "histogram", help);
        for (i, bound) in h.bounds.iter().enumerate() {
            let c = h.counts.get(i).copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "sanmai:{name}_bucket{{{label},le=\"{}\"}} {c}",
                num(*bound)
            );
        }
        let _ = writeln!(
            out,
            "sanmai:{name}_bucket{{{label},le=\"+Inf\"}} {}",
            h.count
        );
        let _ = writeln!(out, "sanmai:{name}_sum{{{label}}} {}", num(h.sum));
        let _ = writeln!(out, "sanmai:{name}_count{{{label}}} {}", h.count);
    }
    out
}

/// The QSA K/V host pool's counters: row-cache hits and misses per QSA layer, bytes read from host
/// memory.
fn kv_host(out: &mut String, label: &str, h: &KvHostStats) {
    type Count = (&'static str, &'static str, fn(&RowCacheCounts) -> u64);
    let per_layer: [Count; 2] = [
        (
            "qsa_row_cache_hits_total",
            "QSA K/V row reads of decode steps served by the row cache, per QSA layer.",
            |c| c.hits,
        ),
        (
            "qsa_row_cache_misses_total",
            "QSA K/V row reads of decode steps that went to host memory, per QSA layer.",
            |c| c.misses,
        ),
    ];
    for (name, help, get) in per_layer {
        metric(out, name, "counter", help);
        for c in &h.layers {
            let _ = writeln!(
                out,
                "sanmai:{name}{{{label},layer=\"{}\"}} {}",
                c.layer,
                get(c)
            );
        }
    }
    let name = "qsa_host_bytes_read_total";
    metric(
        out,
        name,
        "counter",
        "Bytes of QSA K/V rows read from pinned host memory (row-cache misses and every row of \
         larger steps).",
    );
    let _ = writeln!(out, "sanmai:{name}{{{label}}} {}", h.host_bytes_read);
}

fn metric(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP sanmai:{name} {help}");
    let _ = writeln!(out, "# TYPE sanmai:{name} {kind}");
}

/// A sample value as Prometheus writes it (`1`, `0.25`, `NaN`, `+Inf`).
fn num(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        format!("{v}")
    }
}

/// A label value with `\`, `"` and newlines escaped.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The speculative-decoding counters (a server with `--speculative-config`), under vLLM's names.
fn spec_decode(out: &mut String, label: &str, m: &MetricsSnapshot) {
    let counters: [(&str, &str, u64); 3] = [
        (
            "spec_decode_num_drafts_total",
            "Number of spec decoding drafts.",
            m.spec_decode_num_drafts_total,
        ),
        (
            "spec_decode_num_draft_tokens_total",
            "Number of draft tokens.",
            m.spec_decode_num_draft_tokens_total,
        ),
        (
            "spec_decode_num_accepted_tokens_total",
            "Number of accepted tokens.",
            m.spec_decode_num_accepted_tokens_total,
        ),
    ];
    for (name, help, v) in counters {
        metric(out, name, "counter", help);
        let _ = writeln!(out, "sanmai:{name}{{{label}}} {v}");
    }
    let name = "spec_decode_num_accepted_tokens_per_pos_total";
    metric(out, name, "counter", "Accepted tokens per draft position.");
    for (k, v) in m
        .spec_decode_num_accepted_tokens_per_pos_total
        .iter()
        .enumerate()
    {
        let _ = writeln!(out, "sanmai:{name}{{{label},position=\"{k}\"}} {v}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of the sample line starting with `key` (name plus labels).
    fn sample(text: &str, key: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(key).map(|r| r.trim().parse().unwrap()))
            .unwrap_or_else(|| panic!("no sample {key} in\n{text}"))
    }

    #[test]
    fn stage_times_appear_per_stage() {
        let mut m = MetricsSnapshot::default();
        assert!(!render(&m, "demo").contains("pp_stage"));
        m.stages = vec![
            StageTimes {
                busy_seconds: 1.5,
                idle_seconds: 0.25,
            },
            StageTimes {
                busy_seconds: 2.0,
                idle_seconds: 0.0,
            },
        ];
        let text = render(&m, "demo");
        for line in [
            "sanmai:pp_stage_busy_seconds_total{model_name=\"demo\",stage=\"0\"} 1.5",
            "sanmai:pp_stage_busy_seconds_total{model_name=\"demo\",stage=\"1\"} 2",
            "sanmai:pp_stage_idle_seconds_total{model_name=\"demo\",stage=\"0\"} 0.25",
            "# TYPE sanmai:pp_stage_idle_seconds_total counter",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
    }

    #[test]
    fn ple_counters_appear_only_with_a_ple_table() {
        let m = MetricsSnapshot::default();
        assert!(!render(&m, "demo").contains("ple_"));
        let m = MetricsSnapshot {
            ple: Some(sanmai_ple::PleMetricsSnapshot {
                pages_requested: 120,
                windows_done: 3,
                windows_dropped: 1,
                gather_ns: 2_500_000_000,
                gathered_tokens: 4096,
            }),
            ..MetricsSnapshot::default()
        };
        let text = render(&m, "demo");
        let l = "{model_name=\"demo\"}";
        for (name, v) in [
            ("ple_pages_requested_total", 120.0),
            ("ple_prefetch_windows_total", 3.0),
            ("ple_prefetch_windows_dropped_total", 1.0),
            ("ple_gathered_tokens_total", 4096.0),
            ("ple_gather_seconds_total", 2.5),
        ] {
            assert_eq!(sample(&text, &format!("sanmai:{name}{l}")), v, "{name}");
            assert!(text.contains(&format!("# TYPE sanmai:{name} counter")));
        }
    }

    #[test]
    fn qsa_host_counters_appear_per_layer_only_with_offload() {
        let m = MetricsSnapshot::default();
        assert!(!render(&m, "demo").contains("qsa_"));
        let m = MetricsSnapshot {
            kv_host: Some(KvHostStats {
                layers: vec![
                    RowCacheCounts {
                        layer: 3,
                        hits: 40,
                        misses: 7,
                    },
                    RowCacheCounts {
                        layer: 7,
                        hits: 0,
                        misses: 2,
                    },
                ],
                host_bytes_read: 1 << 40,
            }),
            ..MetricsSnapshot::default()
        };
        let text = render(&m, "demo");
        let l = "model_name=\"demo\"";
        for (key, v) in [
            (format!("qsa_row_cache_hits_total{{{l},layer=\"3\"}}"), 40.0),
            (format!("qsa_row_cache_hits_total{{{l},layer=\"7\"}}"), 0.0),
            (
                format!("qsa_row_cache_misses_total{{{l},layer=\"3\"}}"),
                7.0,
            ),
            (
                format!("qsa_row_cache_misses_total{{{l},layer=\"7\"}}"),
                2.0,
            ),
            (
                format!("qsa_host_bytes_read_total{{{l}}}"),
                (1u64 << 40) as f64,
            ),
        ] {
            assert_eq!(sample(&text, &format!("sanmai:{key}")), v, "{key}");
        }
        for name in [
            "qsa_row_cache_hits_total",
            "qsa_row_cache_misses_total",
            "qsa_host_bytes_read_total",
        ] {
            assert!(text.contains(&format!("# TYPE sanmai:{name} counter")));
            assert_eq!(text.matches(&format!("# HELP sanmai:{name} ")).count(), 1);
        }
        // Offloaded stages without QSA layers: the bytes, no per-layer series.
        let m = MetricsSnapshot {
            kv_host: Some(KvHostStats::default()),
            ..MetricsSnapshot::default()
        };
        let text = render(&m, "demo");
        assert_eq!(
            sample(&text, &format!("sanmai:qsa_host_bytes_read_total{{{l}}}")),
            0.0
        );
        assert!(!text.contains("sanmai:qsa_row_cache_hits_total{"));
    }

    #[test]
    fn speculative_decoding_counters_appear_with_drafting() {
        let text = render(&MetricsSnapshot::default(), "m");
        assert!(!text.contains("spec_decode"), "no drafting, no series");
        let m = MetricsSnapshot {
            spec_decode_num_drafts_total: 10,
            spec_decode_num_draft_tokens_total: 20,
            spec_decode_num_accepted_tokens_total: 13,
            spec_decode_num_accepted_tokens_per_pos_total: vec![8, 5],
            ..MetricsSnapshot::default()
        };
        let text = render(&m, "m");
        let l = "model_name=\"m\"";
        for (name, v) in [
            ("spec_decode_num_drafts_total", 10.0),
            ("spec_decode_num_draft_tokens_total", 20.0),
            ("spec_decode_num_accepted_tokens_total", 13.0),
        ] {
            assert_eq!(sample(&text, &format!("sanmai:{name}{{{l}}}")), v, "{name}");
            assert!(text.contains(&format!("# TYPE sanmai:{name} counter")));
        }
        let p = "sanmai:spec_decode_num_accepted_tokens_per_pos_total";
        assert_eq!(sample(&text, &format!("{p}{{{l},position=\"0\"}}")), 8.0);
        assert_eq!(sample(&text, &format!("{p}{{{l},position=\"1\"}}")), 5.0);
    }

    #[test]
    fn renders_every_family_with_values() {
        let mut m = MetricsSnapshot {
            requests_running: 2,
            requests_waiting: 1,
            kv_cache_usage: 0.25,
            prompt_tokens_total: 100,
            generation_tokens_total: 40,
            prefix_cache_queries_total: 64,
            prefix_cache_hits_total: 32,
            preemptions_total: 3,
            requests_finished_total: 5,
            ..MetricsSnapshot::default()
        };
        m.time_to_first_token.observe(0.003);
        m.time_to_first_token.observe(0.3);
        let text = render(&m, "demo\"x");
        let l = "{model_name=\"demo\\\"x\"}";
        for (name, v) in [
            ("num_requests_running", 2.0),
            ("num_requests_waiting", 1.0),
            ("kv_cache_usage_perc", 0.25),
            ("prompt_tokens_total", 100.0),
            ("generation_tokens_total", 40.0),
            ("prefix_cache_queries_total", 64.0),
            ("prefix_cache_hits_total", 32.0),
            ("num_preemptions_total", 3.0),
        ] {
            assert_eq!(sample(&text, &format!("sanmai:{name}{l}")), v, "{name}");
        }
        let b = "sanmai:time_to_first_token_seconds_bucket{model_name=\"demo\\\"x\"";
        assert_eq!(sample(&text, &format!("{b},le=\"0.001\"}}")), 0.0);
        assert_eq!(sample(&text, &format!("{b},le=\"0.005\"}}")), 1.0);
        assert_eq!(sample(&text, &format!("{b},le=\"0.5\"}}")), 2.0);
        assert_eq!(sample(&text, &format!("{b},le=\"+Inf\"}}")), 2.0);
        assert_eq!(
            sample(
                &text,
                &format!("sanmai:time_to_first_token_seconds_count{l}")
            ),
            2.0
        );
        assert!(
            (sample(&text, &format!("sanmai:time_to_first_token_seconds_sum{l}")) - 0.303).abs()
                < 1e-9
        );
        for family in ["inter_token_latency_seconds", "e2e_request_latency_seconds"] {
            assert!(text.contains(&format!("# TYPE sanmai:{family} histogram")));
        }
        assert!(text.contains("# TYPE sanmai:prompt_tokens_total counter"));
        assert!(text.contains("# TYPE sanmai:num_requests_running gauge"));
    }
}
