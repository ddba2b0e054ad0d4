//! `sanmai ple`: the PLE n-gram table's tools — print the row indices of a token sequence, create a
//! table file with its sidecar, and check a table against a model config.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use sanmai_config::PleConfig;
use sanmai_ple::{check_table, create_table, run_bench, CreateOptions, Fill, PleHasher};
use serde_json::json;

#[derive(Args, Debug)]
pub struct PleArgs {
    #[command(subcommand)]
    pub command: PleCommand,
}

#[derive(Subcommand, Debug)]
pub enum PleCommand {
    /// Print, per position, the row index inside each sub-table in (order, head) order.
    Hash(HashArgs),
    /// Write a table file and its JSON sidecar for a model config.
    Create(CreateArgs),
    /// Validate a table directory against a model config.
    Check(CheckArgs),
    /// Cold-prompt gather time without and with prefetch, warm, and the disk's random-read rate.
    Bench(BenchArgs),
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// The table directory (made with `sanmai ple create`).
    #[arg(long)]
    pub dir: PathBuf,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 8192)]
    pub tokens: usize,
    /// Model config: when given, the table is validated against it and its EOS id is used.
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[arg(long, default_value_t = 248046)]
    pub eos_token_id: i64,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct HashArgs {
    /// Model config (config.json) holding the `ple` block.
    #[arg(long)]
    pub config: PathBuf,
    /// Token ids, comma-separated, from the start of the sequence.
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true)]
    pub ids: Vec<i64>,
    /// Print `{"indices": [[...], ...]}` (the default output is one line of indices per position).
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    #[arg(long)]
    pub config: PathBuf,
    /// Directory to write `ple.bin` and `ple.json` into.
    #[arg(long)]
    pub out: PathBuf,
    /// Scale every sub-table size (largest prime ≤ P·F), for benchmarks on small disks.
    #[arg(long, default_value_t = 1.0)]
    pub rows_scale: f64,
    /// random | zeros
    #[arg(long, default_value = "random")]
    pub fill: Fill,
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    /// The table directory.
    pub dir: PathBuf,
    #[arg(long)]
    pub config: PathBuf,
}

fn load_config(path: &std::path::Path) -> Result<PleConfig> {
    PleConfig::from_model_config_file(path).with_context(|| format!("reading {}", path.display()))
}

pub fn run(args: PleArgs) -> Result<()> {
    match args.command {
        PleCommand::Hash(a) => {
            let cfg = load_config(&a.config)?;
            let hasher = PleHasher::new(&cfg);
            let idx = hasher.indices(&a.ids);
            let rows: Vec<&[u64]> = idx.chunks(hasher.num_tables().max(1)).collect();
            if a.json {
                println!("{}", json!({ "indices": rows }));
            } else {
                for r in rows {
                    let line: Vec<String> = r.iter().map(u64::to_string).collect();
                    println!("{}", line.join(" "));
                }
            }
        }
        PleCommand::Create(a) => {
            let cfg = load_config(&a.config)?;
            let opts = CreateOptions {
                rows_scale: a.rows_scale,
                fill: a.fill,
                progress: true,
            };
            let s = create_table(&cfg, &a.out, opts)?;
            println!(
                "{}",
                json!({
                    "dir": a.out.display().to_string(),
                    "bytes": s.file_len(),
                    "rows": s.total_rows(),
                    "sizes": s.sizes,
                    "checksum": s.checksum,
                })
            );
        }
        PleCommand::Check(a) => {
            let cfg = load_config(&a.config)?;
            let s = check_table(&a.dir, &cfg)?;
            println!(
                "ok: {} bytes, {} rows, rows_scale {}, {}",
                s.file_len(),
                s.total_rows(),
                s.rows_scale,
                s.checksum
            );
        }
        PleCommand::Bench(a) => {
            let mut eos = a.eos_token_id;
            if let Some(c) = &a.config {
                let cfg = load_config(c)?;
                check_table(&a.dir, &cfg)?;
                eos = cfg.eos_token_id;
            }
            let r = run_bench(&a.dir, a.tokens, eos)?;
            if a.json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                let rate = |r: Option<f64>| {
                    r.map_or("n/a (O_DIRECT refused)".to_string(), |x| {
                        format!("{x:.0}/s")
                    })
                };
                println!(
                    "{} tokens, {} pages; cold without prefetch {:.3} s ({:.0} pages/s), \
                     cold with prefetch {:.3} s ({:.0} pages/s), warm {:.3} s; \
                     4 KiB random reads at depth 1: {}, at depth 32: {}; resident after eviction {:.1}%",
                    r.tokens,
                    r.pages,
                    r.cold_no_prefetch_s,
                    r.cold_no_prefetch_pages_per_s,
                    r.cold_prefetch_s,
                    r.cold_prefetch_pages_per_s,
                    r.warm_s,
                    rate(r.random_read_4k_per_s),
                    rate(r.random_read_4k_qd32_per_s),
                    100.0 * r.resident_after_evict
                );
            }
        }
    }
    Ok(())
}
