//! `k3mini export RUN_OR_CHECKPOINT --format hf --out DIR`.

use anyhow::Result;
use clap::{Args, ValueEnum};
use k3mini::device::DeviceList;
use k3mini::export::{
    GgufArch, check_out, export_gguf, export_hf, plan_tokenizer, write_reference,
};
use k3mini::run_dir::open_checkpoint;
use k3mini_data::Tokenizer;
use k3mini_gguf::mix::FileType;
use std::path::PathBuf;

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    /// safetensors + config.json (+ tokenizer.json) for transformers' KimiLinearForCausalLM.
    Hf,
    /// A llama.cpp GGUF (kimi-linear; kimi-k3 for K3 features; deepseek2 without KDA layers), quantised per --quant.
    Gguf,
}

#[derive(Args)]
pub struct ExportArgs {
    /// A run directory (its newest checkpoint) or a checkpoint directory.
    checkpoint: PathBuf,
    #[arg(long, value_enum)]
    format: Format,
    /// Output directory (hf) or file (gguf).
    #[arg(long)]
    out: PathBuf,
    /// GGUF file type: q4_k_m, q4_0, q8_0, f16, f32, or mxfp4 (what `[train.qat] format =
    /// "mxfp4"` trained quantised, in MXFP4; see docs/export.md).
    #[arg(long, default_value = "q4_k_m")]
    quant: String,
    /// The student's tokenizer.json, to ship (default: the one the run trained with; a GGUF
    /// teacher's for `data.tokenizer = "teacher"`).
    #[arg(long)]
    tokenizer: Option<String>,
    /// Also write k3mini's logits for fixed inputs: into the hf directory, or next to the GGUF as
    /// FILE.reference.safetensors (scripts/interop/check_hf.py and check_gguf.py compare them).
    #[arg(long)]
    with_reference: bool,
    /// Where the reference logits are computed (default: the run's run.device).
    #[arg(long)]
    device: Option<DeviceList>,
}

pub fn run(args: ExportArgs) -> Result<()> {
    let mut ck = open_checkpoint(&args.checkpoint)?;
    if let Some(d) = args.device {
        ck.plan.devices = d;
    }
    check_out(&ck, &args.out)?;
    let given = args.tokenizer.as_deref().map(Tokenizer::load).transpose()?;
    let tokenizer = match &given {
        Some(t) => Some(t.clone()),
        None => plan_tokenizer(&ck.plan.data.tokenizer)?,
    };
    match args.format {
        Format::Gguf => {
            let ftype = FileType::parse(&args.quant)?;
            let bytes = export_gguf(&ck, ftype, given.as_ref(), &args.out)?;
            let arch = GgufArch::for_config(&ck.plan.model);
            println!(
                "{} ({:.1} MB, {}, {})",
                args.out.display(),
                bytes as f64 / 1e6,
                arch.name(),
                args.quant
            );
            if arch == GgufArch::Deepseek2 {
                eprintln!(
                    "note: deepseek2 with its RoPE scaled away (docs/export.md) computes this \
                     student only in llama.cpp from December 2025 on (PR 17945's attention scale; \
                     any build that runs kimi-linear); older builds and forks load it and compute \
                     something else"
                );
            }
            if args.with_reference {
                let reference = args.out.with_extension("reference.safetensors");
                write_reference(&ck, tokenizer.as_ref(), &reference)?;
                println!("{}", reference.display());
            }
        }
        Format::Hf => {
            if tokenizer.is_none() {
                eprintln!(
                    "note: no tokenizer.json to ship (the run's tokenizer is a built-in vocabulary); \
                     pass --tokenizer FILE to ship one"
                );
            }
            for f in export_hf(&ck, tokenizer.as_ref(), &args.out, args.with_reference)? {
                println!("{}", f.display());
            }
        }
    }
    Ok(())
}
