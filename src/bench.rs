//! `k3mini bench`: placeholder wired below.
use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand)]
pub enum BenchCommand {}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {}
}
