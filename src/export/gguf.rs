//! Writing the student as a GGUF: tensors mapped (`tensors.rs`), typed by llama.cpp's mix,
//! quantised in parallel with ggml's quantisers, the tokenizer added; and its benchmark.

use super::arch::GgufArch;
use super::tensors::{GgufTensor, Metadata, student_gguf, student_gguf_of};
use super::tokenizer::gguf_tokenizer_metadata;
use crate::error::Result;
use crate::run_dir::Checkpoint;
use crate::train::qat::{FakeQuantizer, QatFormat};
use burn::tensor::Device;
use k3mini_data::pool::run_many;
use k3mini_data::{ChatFormat, Tokenizer};
use k3mini_gguf::mix::{FileType, tensor_types};
use k3mini_gguf::quantize::{fake_quantize, quantize};
use k3mini_gguf::writer::GgufWriter;
use k3mini_gguf::{GgmlType, Value};
use k3mini_student::K3Mini;
use k3mini_student::hf::{hf_weight_files, save_hf_files};
use std::path::{Path, PathBuf};

/// An MXFP4 file holds the model `[train.qat] format = "mxfp4"` computes with: the checkpoint's
/// weights through QAT's own fake quantiser (`train::qat`, on the CPU whatever the run trained
/// on), written out and mapped as usual. Tensors the mapping renames stay on the MXFP4 grid, so
/// quantising them again is exact; those it computes from trained weights are not (see
/// [`off_the_grid`]). Holds about three copies of the f32 weights at its peak (the model, its
/// fake-quantised twin and their values), and one on disk in the temporary directory.
fn fake_quantised_gguf(ck: &Checkpoint) -> Result<(Metadata, Vec<GgufTensor>)> {
    let scratch = crate::scratch::Scratch::new("mxfp4-export")?;
    {
        let trained = FakeQuantizer::new(QatFormat::Mxfp4).apply(&ck.model(&Device::default())?);
        save_hf_files(&trained, scratch.path(), ck.plan.train.weights_shard_bytes)?;
    }
    student_gguf_of(ck, &hf_weight_files(scratch.path())?)
}

/// A tensor the mix gives MXFP4 whose values are not on MXFP4's grid: one the mapping computed
/// from two trained weights (kimi-k3's low-rank KDA output gate multiplied out, `g_b·g_a`). An
/// MXFP4 file never re-quantises, so it is written F16 instead.
fn off_the_grid(values: &[f32]) -> bool {
    fake_quantize(GgmlType::MXFP4, values).map_or(true, |q| q != values)
}

/// Writes the student as a llama.cpp GGUF of file type `ftype` with its tokenizer (see
/// [`gguf_tokenizer_metadata`]); returns the bytes written.
pub fn export_gguf(
    ck: &Checkpoint,
    ftype: FileType,
    tokenizer: Option<&Tokenizer>,
    out: &Path,
) -> Result<u64> {
    let (metadata, tensors) = match ftype {
        FileType::Mxfp4 => fake_quantised_gguf(ck)?,
        _ => student_gguf(ck)?,
    };
    let student = match tokenizer {
        Some(t) => t.clone(),
        None => crate::teachers::student_tokenizer(&ck.plan.data.tokenizer)?,
    };
    let tokenizer =
        gguf_tokenizer_metadata(&ck.plan.data.tokenizer, tokenizer, ck.plan.model.vocab_size)?;
    // The student's chat format (the plan's, else the one its vocabulary's markers name)
    // replaces every copied template (a teacher's named variants too: llama.cpp takes
    // `.tool_use` for requests with tools), so a client of llama.cpp renders chats, tools and
    // calls as the student was trained on them; the agent reads the format back from it.
    let template = ChatFormat::spoken(ck.plan.chat_format(), &student).map(ChatFormat::jinja);
    let copied = |k: &str| template.is_some() && k.starts_with("tokenizer.chat_template");
    let mut w = GgufWriter::new();
    for (k, v) in metadata.into_iter().chain(tokenizer) {
        if !copied(&k) {
            w.set(&k, v);
        }
    }
    if let Some(template) = template {
        w.set("tokenizer.chat_template", Value::String(template.into()));
    }
    w.set("general.file_type", Value::U32(ftype.id()));
    if ftype != FileType::F32 && ftype != FileType::F16 {
        w.set("general.quantization_version", Value::U32(2));
    }
    let shapes: Vec<(&str, &[u64])> = tensors
        .iter()
        .map(|(n, ne, _)| (n.as_str(), &ne[..]))
        .collect();
    let mut types = tensor_types(&shapes, ck.plan.model.n_layers, ftype);
    for ((_, _, values), ty) in tensors.iter().zip(&mut types) {
        if *ty == GgmlType::MXFP4 && off_the_grid(values) {
            *ty = GgmlType::F16;
        }
    }
    let jobs: Vec<_> = tensors.iter().zip(types).collect();
    let bar = crate::progress::observer().bar("tensors quantised", jobs.len() as u64, 0);
    // Tensors quantise independently (K-quants are slow): one worker per core.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let quantised = run_many(
        jobs.len(),
        cores,
        &|i| {
            let ((name, _, values), ty) = &jobs[i];
            quantize(*ty, values).map_err(|e| crate::refused!("{name}: {e}"))
        },
        &mut |_| bar.inc(1),
    )?;
    bar.finish(true);
    for (((name, ne, _), ty), bytes) in jobs.iter().zip(quantised) {
        w.add_tensor(name, ne, *ty, bytes)?;
    }
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    Ok(w.write(out)?)
}

/// One export of [`bench_export`].
#[derive(Debug, serde::Serialize)]
pub struct ExportTiming {
    pub quant: String,
    pub arch: &'static str,
    pub params: usize,
    pub seconds: f64,
    pub bytes: u64,
    pub path: PathBuf,
}

/// Times `k3mini export --format gguf` of a freshly initialised `preset` student (the export's
/// cost does not depend on the weights' values) for each file type, writing the files into `dir`.
/// The checkpoint's plan names the SmolLM2 teacher's tokenizer, so the preset's vocabulary must
/// be SmolLM2's (`smoke-300m`, `tiny` with `vocab_size = 49152`).
pub fn bench_export(preset: &str, quants: &[FileType], dir: &Path) -> Result<Vec<ExportTiming>> {
    // A real plan for the checkpoint: the preset student on the SmolLM2 teacher's tokenizer.
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("corpus.txt"), "Export benchmark.\n")?;
    let recipe = dir.join("bench-export.toml");
    std::fs::write(
        &recipe,
        format!(
            "[run]\nname = \"bench-export\"\nout_dir = {:?}\n[model]\npreset = \"{preset}\"\n\
             [data]\ntokenizer = \"teacher\"\nseq_len = 64\n[[data.sources]]\npath = \"corpus.txt\"\n\
             [teacher]\nmodel = \"smollm2\"\n[distill]\nobjectives = [{{ kind = \"ce\" }}]\n\
             [optim]\nlr = 1e-3\n[schedule]\nkind = \"constant\"\nwarmup_steps = 0\n\
             [train]\nsteps = 1\nbatch_tokens = 64\nmicro_batch = 1\n",
            dir.join("checkpoint").display().to_string()
        ),
    )?;
    let plan = crate::recipe::load(&recipe)?;
    let model = K3Mini::new(&plan.model, &Device::default())?;
    let params = k3mini_student::info::param_breakdown(&plan.model).total();
    let ck_dir = crate::run_dir::write_weights(&plan, &model, 0)?;
    drop(model);
    let ck = crate::run_dir::open_checkpoint(&ck_dir)?;
    quants
        .iter()
        .map(|&q| {
            let path = dir.join(format!("{preset}.{}.gguf", q.name()));
            let t0 = std::time::Instant::now();
            let bytes = export_gguf(&ck, q, None, &path)?;
            Ok(ExportTiming {
                quant: q.name().into(),
                arch: GgufArch::for_config(&ck.plan.model).name(),
                params,
                seconds: t0.elapsed().as_secs_f64(),
                bytes,
                path,
            })
        })
        .collect()
}
