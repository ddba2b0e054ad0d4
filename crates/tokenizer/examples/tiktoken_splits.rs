//! Writes the split table (one byte per rank: where the rank's merge splits its bytes, 0 for
//! none) of a tiktoken rank file, the precomputed form that `TiktokenSpec::splits` takes.
//!
//! `cargo run --release -p sanmai-tokenizer --example tiktoken_splits -- RANKS.tiktoken OUT.splits`

use sanmai_tokenizer::tiktoken::Ranks;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [ranks_path, out_path] = args.as_slice() else {
        return Err("usage: tiktoken_splits RANKS.tiktoken OUT.splits".into());
    };
    let ranks = Ranks::parse(&std::fs::read_to_string(ranks_path)?)?;
    let splits = ranks.splits()?;
    std::fs::write(out_path, &splits)?;
    let merges = splits.iter().filter(|&&k| k != 0).count();
    println!("{} ranks, {merges} merges → {out_path}", splits.len());
    Ok(())
}
