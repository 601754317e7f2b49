//! `kvferry`: demo, prefill, decode, proxy and bench: argument parsing and printing over the
//! reference embedder in `kvferry-testkit`.

mod args;
mod bench;
mod demo;
mod nodes;
mod proxy;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kvferry",
    version,
    about = "Move LLM KV caches from prefill to decode, correctly."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a prefill and a decode node on loopback and move real bytes end to end.
    Demo(demo::DemoArgs),
    /// Serve synthetic KV as a prefill node.
    Prefill(nodes::PrefillArgs),
    /// Act as a decode node: request rooms from a prefill node and verify every byte.
    Decode(nodes::DecodeArgs),
    /// A fault-injecting TCP proxy between two nodes (loopback only), for trying failures.
    Proxy(proxy::ProxyArgs),
    /// Measure the TCP data plane against a plain socket pair.
    Bench(bench::BenchArgs),
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVFERRY_LOG")
                .unwrap_or_else(|_| "warn,kvferry::start=info".into()),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Err(e) = run(cli).await {
        eprintln!("kvferry: {e}");
        std::process::exit(1);
    }
}

async fn run(cli: Cli) -> Result<(), String> {
    match cli.command {
        Command::Demo(args) => demo::run(args).await,
        Command::Prefill(args) => nodes::prefill(args).await,
        Command::Decode(args) => nodes::decode(args).await,
        Command::Proxy(args) => proxy::run(args).await,
        Command::Bench(args) => bench::run(args).await,
    }
}
