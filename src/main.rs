//! `sanmai`: the command line. Subcommands load a model (a Hugging Face checkpoint directory, random
//! weights for a config, or the built-in default model) and run it.

mod bench;
mod bench_kernels;
mod bench_mtp;
mod bench_prompts;
mod bench_serve;
mod bytes;
mod engine_args;
mod generate;
mod images;
mod load;
mod memory_plan;
mod plan;
mod ple;
mod prometheus;
mod quantize;
mod serve;
mod server_metrics;
mod speculative;
mod stages;
mod switches;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "sanmai",
    version,
    about = "An LLM inference server for hybrid GDN/attention MoE models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a completion for one prompt and print it (or a JSON record with --json).
    Generate(generate::GenerateArgs),
    /// Measure prefill and decode speed (`bench serve`: load a running server).
    Bench(bench_serve::BenchCommand),
    /// Serve the OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
    /// The PLE n-gram table: hash, create, check.
    Ple(ple::PleArgs),
    /// Print the GPU memory plan of a deployment (per pipeline stage) without loading anything.
    Plan(plan::PlanArgs),
    /// Write a checkpoint's MTP head with its routed experts in INT4 (`--mtp-int4 DIR OUT`), for
    /// --speculative-config's `model`.
    Quantize(quantize::QuantizeArgs),
}

/// Runs the command; an error prints as one line, its causes joined (`Error: while: because`).
fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse().command) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {}", one_line(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// An error and its causes on one line, a cause left out where the message before it already says it.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !line.contains(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
    }
    line
}

fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Generate(args) => generate::run(args),
        Command::Bench(b) => match b.command {
            Some(bench_serve::BenchSub::Serve(args)) => bench_serve::run(args),
            None => bench::run(b.local),
        },
        Command::Serve(args) => serve::run(args),
        Command::Ple(args) => ple::run(args),
        Command::Plan(args) => plan::run(args),
        Command::Quantize(args) => quantize::run(args),
    }
}
