//! `k3mini export`: a trained student in the formats other runtimes load.
//!
//! `--format hf` writes `model.safetensors` (the checkpoint's weights, already under transformers'
//! `KimiLinearForCausalLM` names), `config.json` (`k3mini_student::hf::config_to_kimi_linear`,
//! which refuses what Kimi Linear cannot express) and, where the run's tokenizer has one,
//! `tokenizer.json`. Every file is written atomically. `--with-reference` adds
//! `k3mini_reference.safetensors`: fixed input ids and k3mini's logits for them, which
//! `scripts/interop/check_hf.py` compares with transformers' forward of the export.
//!
//! `--format gguf` maps the student to llama.cpp's `kimi-linear` or, for students with K3
//! features, `kimi-k3` ([`GgufArch`]), quantised with ggml's own quantisers in llama.cpp's
//! tensor-type mix; its `--with-reference` writes `FILE.reference.safetensors` for
//! `scripts/interop/check_gguf.py`.
//!
//! | file | holds |
//! |---|---|
//! | `hf.rs` | the Hugging Face export and the reference logits both checks compare |
//! | `arch.rs` | the two llama.cpp architectures: each one's tensor-name table and metadata keys |
//! | `tensors.rs` | the student's tensors mapped through a table (splits, products, `−exp`) |
//! | `tokenizer.rs` | the tokenizer a GGUF carries: a teacher's copied, or a tokenizer.json converted |
//! | `gguf.rs` | writing the GGUF: quantising in parallel, the export benchmark |

mod arch;
mod gguf;
mod hf;
mod tensors;
mod tokenizer;

pub use arch::{GgufArch, TensorNames};
pub use gguf::{ExportTiming, bench_export, export_gguf};
pub use hf::{REFERENCE_TEXT, export_hf, write_reference};
pub use tensors::{GgufTensor, student_gguf, student_gguf_of};
pub use tokenizer::{bpe_tokenizer_metadata, gguf_tokenizer_metadata, plan_tokenizer};

use crate::bail;
use crate::error::Result;
use crate::run_dir::Checkpoint;
use std::path::Path;

/// Refuses an output path that would overwrite the checkpoint itself.
pub fn check_out(ck: &Checkpoint, out: &Path) -> Result<()> {
    if out.canonicalize().ok() == Some(ck.dir.canonicalize()?) {
        bail!("--out {} is the checkpoint itself", out.display());
    }
    Ok(())
}
