//! `sanmai bench --kernel-times`: one decode step's time by kernel, measured inside a CUDA graph replay
//! (timed events between the kernels; see `sanmai_cuda::timer` for what an interval holds), and the
//! phases of its persistent layer launches (their trace marks in the same replay).

use std::collections::HashMap;

use anyhow::Result;
use sanmai_model::{Model, PhaseTable, Probe};

/// Decode steps run with timing on: the warm-up of the timed recording, its capture (and first
/// replay), and the replay that is read.
pub const STEPS: usize = 3;

/// Runs [`STEPS`] decode steps (`step`, one each call) with kernel timing on and prints the last one
/// by kernel, beside the untimed median step `itl` (seconds).
pub fn run<B: Probe>(m: &Model<B>, mut step: impl FnMut() -> Result<()>, itl: f64) -> Result<()> {
    m.backend.time_kernels(true)?;
    let steps = (0..STEPS).try_for_each(|_| step());
    let times = m.backend.kernel_times();
    let phases = m.backend.layer_phases();
    m.backend.time_kernels(false)?;
    steps?;
    let times = times?;
    let phases = phases?;
    if times.is_empty() {
        println!(
            "  kernel times: none, no decode step of this batch size was replayed from a CUDA graph \
             (graphs off, a batch size not recorded, or a failed capture: see the log)"
        );
    } else {
        print!("{}", table(&times, itl));
        print!("{}", phase_lines(&phases));
    }
    Ok(())
}

/// One line per persistent layer kernel: its launches and each phase's median µs.
fn phase_lines(phases: &[PhaseTable]) -> String {
    if phases.is_empty() {
        return String::new();
    }
    let mut out = "  layer phases (block 0's trace marks in the same replay; medians over the launches, us; \
                   from_last_exit: from the layer launch before ending to this one's first phase):\n"
        .to_string();
    for t in phases {
        let spans: Vec<String> = t
            .spans
            .iter()
            .map(|(n, us)| format!("{n}={us:.2}"))
            .collect();
        out += &format!("    {} x{}: {}\n", t.kernel, t.launches, spans.join(" "));
    }
    out
}

/// The step's kernels grouped by name, largest total first: launches, µs per step, µs a launch, the
/// step's first launch of the kernel and the others' mean (a kernel's first launch in a step may find
/// its code out of the caches), share of the sum.
fn table(times: &[(String, f64)], itl: f64) -> String {
    let mut order: Vec<&str> = Vec::new();
    // Launches, µs in all, µs of the first launch.
    let mut by: HashMap<&str, (usize, f64, f64)> = HashMap::new();
    for (name, us) in times {
        let e = by.entry(name).or_insert_with(|| {
            order.push(name);
            (0, 0.0, *us)
        });
        e.0 += 1;
        e.1 += us;
    }
    order.sort_by(|a, b| by[b].1.total_cmp(&by[a].1));
    let sum: f64 = times.iter().map(|t| t.1).sum();
    let mut out = format!(
        "  kernel times (one decode step replayed from a CUDA graph with timed events between its \
         kernels): {} launches, {:.1} us in all against the untimed median step of {:.1} us\n",
        times.len(),
        sum,
        itl * 1e6
    );
    out += &format!(
        "    {:<40} {:>8} {:>10} {:>9} {:>9} {:>9} {:>7}\n",
        "kernel", "launches", "us/step", "us each", "first", "others", "share"
    );
    for name in order {
        let (n, us, first) = by[name];
        let others = if n > 1 {
            format!("{:.2}", (us - first) / (n - 1) as f64)
        } else {
            "-".to_string()
        };
        out += &format!(
            "    {:<40} {:>8} {:>10.1} {:>9.2} {:>9.2} {:>9} {:>6.1}%\n",
            name,
            n,
            us,
            us / n as f64,
            first,
            others,
            100.0 * us / sum.max(1e-9)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_groups_kernels_by_name_largest_first() {
        let times = vec![
            ("gemv".to_string(), 10.0),
            ("norm".to_string(), 3.0),
            ("gemv".to_string(), 12.0),
            ("attn".to_string(), 15.0),
        ];
        let t = table(&times, 50e-6);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].contains("4 launches, 40.0 us in all"), "{t}");
        assert!(lines[0].contains("median step of 50.0 us"), "{t}");
        let rows: Vec<Vec<&str>> = lines[2..]
            .iter()
            .map(|l| l.split_whitespace().collect())
            .collect();
        // gemv: first launch 10 µs, the other 12 µs.
        assert_eq!(
            rows[0],
            ["gemv", "2", "22.0", "11.00", "10.00", "12.00", "55.0%"]
        );
        assert_eq!(
            rows[1],
            ["attn", "1", "15.0", "15.00", "15.00", "-", "37.5%"]
        );
        assert_eq!(rows[2], ["norm", "1", "3.0", "3.00", "3.00", "-", "7.5%"]);
    }

    #[test]
    fn phase_lines_print_each_layer_kernel_once() {
        assert_eq!(phase_lines(&[]), "");
        let t = PhaseTable {
            kernel: "moe_layer_m1_q4_s6_u2".into(),
            launches: 48,
            spans: vec![
                ("from_last_exit".into(), 4.5),
                ("router_shared_gu".into(), 2.304),
            ],
        };
        let out = phase_lines(&[t]);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2, "{out}");
        assert_eq!(
            lines[1].trim(),
            "moe_layer_m1_q4_s6_u2 x48: from_last_exit=4.50 router_shared_gu=2.30"
        );
    }
}
