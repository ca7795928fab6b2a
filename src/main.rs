//! `k3mini`: the command line. Thin by design: it parses arguments and calls library functions.

mod cli;

use std::process::ExitCode;

/// Training allocates and frees large activation buffers every step; glibc's malloc hands them back to
/// the OS and page-faults them in again (a quarter of a tiny step's time under perf). mimalloc reuses them.
/// Counted, so `bench` reports the heap's live peak beside resident memory.
#[global_allocator]
static ALLOC: k3mini_student::bench::CountingAlloc<mimalloc::MiMalloc> =
    k3mini_student::bench::CountingAlloc(mimalloc::MiMalloc);

fn main() -> ExitCode {
    cli::main()
}
