//! The llama.cpp engine (feature `llama-cpp`): any GGUF llama.cpp runs (SmolLM2, k3mini's own
//! `kimi-linear` / `kimi-k3` exports, dense or MoE), quantised as stored, on CPU threads or one
//! CUDA device (feature `llama-cpp-cuda`). It is written on the C API (`llama-cpp-sys-2`, which
//! builds its vendored llama.cpp with CMake, a C++ compiler and libclang) because what k3mini
//! needs from it is below any safe wrapper: llama.cpp's log (its reason a file did not load) and
//! the graph's evaluation callback (the MoE router's choices, [`Routing`]).

use crate::TeacherError;
use crate::engine::{Limits, Model, Session};
use crate::routing::{LayerRouting, Routing};
use llama_cpp_sys_2 as sys;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{CStr, CString, c_char, c_void};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, Once, PoisonError};

/// Ids per `llama_decode` (its batch and micro-batch): scoring throughput levels off here.
pub const CHUNK: usize = 512;

/// Where llama.cpp computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// This many CPU threads.
    Cpu { threads: usize },
    /// Every layer on CUDA device N (a `llama-cpp-cuda` build).
    Cuda(usize),
}

thread_local! {
    /// What llama.cpp logged on this thread at warning level or above since the last
    /// [`take_log`]: its own account of a failure, which its API reports only as a null pointer.
    static LOG: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

unsafe extern "C" fn log_line(level: sys::ggml_log_level, text: *const c_char, _: *mut c_void) {
    if text.is_null() {
        return;
    }
    // SAFETY: llama.cpp passes a NUL-terminated string that lives for the call.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    LOG.with_borrow_mut(|log| match level {
        sys::GGML_LOG_LEVEL_CONT => {
            if let Some(last) = log.last_mut() {
                last.push_str(&text);
            }
        }
        sys::GGML_LOG_LEVEL_WARN | sys::GGML_LOG_LEVEL_ERROR => {
            if log.len() < 64 {
                log.push(text.into_owned());
            }
        }
        _ => {}
    });
}

/// This thread's llama.cpp warnings and errors since the last call, one line each.
fn take_log() -> String {
    let lines = LOG.with_borrow_mut(std::mem::take);
    let lines: Vec<&str> = lines
        .iter()
        .map(|l| l.trim())
        .filter(|l| !l.is_empty())
        .collect();
    if lines.is_empty() {
        "no reason logged".into()
    } else {
        lines.join("; ")
    }
}

/// Starts llama.cpp's backends once per process, its log captured by [`log_line`].
fn init() {
    static INIT: Once = Once::new();
    INIT.call_once(|| unsafe {
        sys::llama_log_set(Some(log_line), std::ptr::null_mut());
        sys::llama_backend_init();
    });
}

/// A GGUF loaded into llama.cpp.
pub struct LlamaCppModel {
    path: PathBuf,
    model: *mut sys::llama_model,
    vocab: *const sys::llama_vocab,
    n_vocab: usize,
    context: usize,
    threads: i32,
    /// One context computes at a time (each already uses every thread it is given); between
    /// sequences the last one waits here for the next of its length, since making a context (its
    /// KV cache, its scheduler's buffers) costs as much as scoring a dozen tokens.
    compute: Mutex<Option<Idle>>,
}

/// A context no sequence holds, its memory cleared before it is lent again.
struct Idle {
    ctx: *mut sys::llama_context,
    n_ctx: u32,
}

impl Drop for Idle {
    fn drop(&mut self) {
        // SAFETY: an idle context is owned here alone (taken out of `compute` or never lent).
        unsafe { sys::llama_free(self.ctx) }
    }
}

// SAFETY: a llama_model is read-only once loaded and llama.cpp allows contexts on several
// threads over one model; contexts are created and used under `compute`, one at a time.
unsafe impl Send for LlamaCppModel {}
unsafe impl Sync for LlamaCppModel {}

impl Drop for LlamaCppModel {
    fn drop(&mut self) {
        // Contexts before their model.
        let idle = self
            .compute
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        drop(idle.take());
        // SAFETY: `&mut self`: no context or tokenization uses the model any more.
        unsafe { sys::llama_model_free(self.model) }
    }
}

impl LlamaCppModel {
    /// Loads `path` into llama.cpp. A file it cannot load is a [`TeacherError::Load`] with
    /// llama.cpp's own reason.
    pub fn load(path: &Path, placement: Placement) -> Result<Self, TeacherError> {
        let err = |message: String| TeacherError::Load {
            path: path.to_path_buf(),
            message,
        };
        init();
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| err("the path holds a NUL byte".into()))?;
        let mut params = unsafe { sys::llama_model_default_params() };
        let threads = match placement {
            Placement::Cpu { threads } => {
                params.n_gpu_layers = 0;
                threads.max(1) as i32
            }
            Placement::Cuda(gpu) => {
                if !unsafe { sys::llama_supports_gpu_offload() } {
                    return Err(err(
                        "this k3mini's llama.cpp has no CUDA backend: build with --features \
                         llama-cpp-cuda"
                            .into(),
                    ));
                }
                params.n_gpu_layers = i32::MAX;
                params.split_mode = sys::LLAMA_SPLIT_MODE_NONE;
                params.main_gpu = gpu as i32;
                1
            }
        };
        take_log();
        let model = unsafe { sys::llama_model_load_from_file(c_path.as_ptr(), params) };
        if model.is_null() {
            return Err(err(format!("llama.cpp could not load it: {}", take_log())));
        }
        let vocab = unsafe { sys::llama_model_get_vocab(model) };
        let n_vocab = unsafe { sys::llama_vocab_n_tokens(vocab) };
        let context = unsafe { sys::llama_model_n_ctx_train(model) };
        let loaded = Self {
            path: path.to_path_buf(),
            model,
            vocab,
            n_vocab: n_vocab.max(0) as usize,
            context: context.max(0) as usize,
            threads,
            compute: Mutex::new(None),
        };
        if n_vocab <= 0 || context <= 1 {
            return Err(err(format!(
                "llama.cpp reads {n_vocab} tokens and a context of {context}"
            )));
        }
        Ok(loaded)
    }

    pub fn vocab_size(&self) -> usize {
        self.n_vocab
    }

    /// `text` as llama.cpp's tokenizer splits it (special tokens parsed, none added).
    ///
    /// Not under the compute lock: tokenizing reads the vocabulary, which is immutable once the
    /// model is loaded, and keeps its state per call; llama.cpp's own server tokenizes on its
    /// HTTP threads while its main loop decodes. Holding the lock would queue every tokenization
    /// behind a whole sequence's scoring.
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, TeacherError> {
        let len = i32::try_from(text.len())
            .map_err(|_| TeacherError::Request("text too long to tokenize".into()))?;
        // Returns the count, or minus the room it needs.
        // SAFETY: `vocab` lives as long as the model (freed in `Drop`); the text pointer and length
        // describe `text`, and `out` has `out.len()` writable slots.
        let run = |out: &mut Vec<i32>| unsafe {
            sys::llama_tokenize(
                self.vocab,
                text.as_ptr().cast(),
                len,
                out.as_mut_ptr(),
                out.len() as i32,
                false,
                true,
            )
        };
        let mut out = vec![0i32; text.len() + 8];
        let mut n = run(&mut out);
        if n < 0 {
            out.resize(n.unsigned_abs() as usize, 0);
            n = run(&mut out);
        }
        if n < 0 {
            return Err(TeacherError::Request("llama.cpp could not tokenize".into()));
        }
        Ok(out[..n as usize].iter().map(|&t| t as u32).collect())
    }

    /// A context for one sequence of up to `len` ids, recording the MoE routing when `routing`
    /// (a fresh one: llama.cpp holds the address of what it records into).
    fn context(&self, len: usize, routing: bool) -> Result<Context<'_>, TeacherError> {
        self.context_with(len.clamp(1, self.context) as u32, routing, None)
    }

    /// A context of `n_ctx` positions, with `flash` set or llama.cpp's default. Only a context
    /// for scoring (no routing, the default) is lent again afterwards; an idle one that does not
    /// fit is freed before a new one is made.
    fn context_with(
        &self,
        n_ctx: u32,
        routing: bool,
        flash: Option<FlashAttn>,
    ) -> Result<Context<'_>, TeacherError> {
        let mut guard = self.compute.lock().unwrap_or_else(|p| p.into_inner());
        let pooled = !routing && flash.is_none();
        let capture = routing.then(|| Box::into_raw(Box::<Capture>::default()));
        let idle = guard.take();
        let ctx = match idle {
            Some(idle) if idle.n_ctx == n_ctx && pooled => {
                let ctx = std::mem::ManuallyDrop::new(idle).ctx;
                // SAFETY: the idle context is ours under the compute lock held here.
                unsafe { sys::llama_memory_clear(sys::llama_get_memory(ctx), true) };
                ctx
            }
            other => {
                drop(other);
                match self.new_context(n_ctx, capture, flash.unwrap_or_default()) {
                    Ok(ctx) => ctx,
                    Err(e) => {
                        // SAFETY: from `Box::into_raw` above; no context was made to hold it.
                        if let Some(c) = capture {
                            drop(unsafe { Box::from_raw(c) });
                        }
                        return Err(e);
                    }
                }
            }
        };
        Ok(Context {
            model: self,
            ctx,
            n_ctx,
            batch: unsafe { sys::llama_batch_init(CHUNK as i32, 0, 1) },
            pos: 0,
            capture,
            pooled,
            failed: false,
            compute: guard,
        })
    }

    fn new_context(
        &self,
        n_ctx: u32,
        capture: Option<*mut Capture>,
        flash: FlashAttn,
    ) -> Result<*mut sys::llama_context, TeacherError> {
        let mut params = unsafe { sys::llama_context_default_params() };
        params.n_ctx = n_ctx;
        params.n_batch = CHUNK as u32;
        params.n_ubatch = CHUNK as u32;
        params.n_seq_max = 1;
        params.n_threads = self.threads;
        params.n_threads_batch = self.threads;
        params.no_perf = true;
        params.flash_attn_type = match flash {
            FlashAttn::Auto => sys::LLAMA_FLASH_ATTN_TYPE_AUTO,
            FlashAttn::On => sys::LLAMA_FLASH_ATTN_TYPE_ENABLED,
            FlashAttn::Off => sys::LLAMA_FLASH_ATTN_TYPE_DISABLED,
        };
        if let Some(capture) = capture {
            params.cb_eval = Some(observe);
            params.cb_eval_user_data = capture.cast();
        }
        take_log();
        let ctx = unsafe { sys::llama_init_from_model(self.model, params) };
        if ctx.is_null() {
            return Err(TeacherError::Load {
                path: self.path.clone(),
                message: format!("llama.cpp could not make a context: {}", take_log()),
            });
        }
        Ok(ctx)
    }

    /// Logits `[ids.len(), vocab]` of every position of `ids`, and the MoE router's choices for
    /// every token when `routing` (None for a model without routed experts).
    pub fn forward(
        &self,
        ids: &[u32],
        routing: bool,
    ) -> Result<(Vec<f32>, Option<Routing>), TeacherError> {
        let mut ctx = self.context(ids.len(), routing)?;
        let mut logits = Vec::with_capacity(ids.len() * self.n_vocab);
        for piece in ids.chunks(CHUNK) {
            logits.extend(ctx.feed(piece)?);
        }
        Ok((logits, ctx.routing()?))
    }

    /// Prefills `prompt` (logits of its last id alone), then decodes `tokens` more one at a time,
    /// each the argmax of the last logits, in a context of exactly that length (beyond the
    /// model's training context if asked). Returns both speeds and the bytes of the sequence's
    /// state at the end.
    pub fn decode_speed(
        &self,
        prompt: &[u32],
        tokens: usize,
        flash: FlashAttn,
    ) -> Result<DecodeSpeed, TeacherError> {
        let n_ctx = decode_context(prompt.len(), tokens)?;
        let mut ctx = self.context_with(n_ctx, false, Some(flash))?;
        let start = std::time::Instant::now();
        let chunks = prompt.len().div_ceil(CHUNK);
        for (i, piece) in prompt.chunks(CHUNK).enumerate() {
            let outputs = if i + 1 == chunks {
                Outputs::Last
            } else {
                Outputs::None
            };
            ctx.decode(piece, outputs)?;
        }
        let prefill = start.elapsed().as_secs_f64();
        // Only llama.cpp's steps are timed, not the host's argmax over the vocabulary.
        let mut decode = 0.0;
        for _ in 0..tokens {
            let last = ctx.row(-1)?;
            let next =
                (0..last.len()).fold(0, |best, i| if last[i] > last[best] { i } else { best });
            let start = std::time::Instant::now();
            ctx.decode(&[next as u32], Outputs::Last)?;
            decode += start.elapsed().as_secs_f64();
        }
        Ok(DecodeSpeed {
            context: prompt.len(),
            tokens,
            prefill_tokens_per_s: prompt.len() as f64 / prefill,
            decode_tokens_per_s: tokens as f64 / decode,
            // SAFETY: this context is this call's, under the compute lock its `Context` holds.
            state_bytes: unsafe { sys::llama_state_seq_get_size(ctx.ctx, 0) },
        })
    }
}

/// The context [`LlamaCppModel::decode_speed`] needs for `prompt` ids and `tokens` more: at
/// least one of each, positions within llama.cpp's `i32` with room for its padding of the
/// context to 256.
pub fn decode_context(prompt: usize, tokens: usize) -> Result<u32, TeacherError> {
    let bad = |why: &str| {
        Err(TeacherError::Request(format!(
            "decode {tokens} ids after {prompt}: {why}"
        )))
    };
    if prompt == 0 || tokens == 0 {
        return bad("needs at least one of each");
    }
    match prompt.checked_add(tokens) {
        Some(n) if n <= i32::MAX as usize - 256 => Ok(n as u32),
        _ => bad("beyond llama.cpp's 2^31 positions"),
    }
}

/// llama.cpp's flash-attention setting for a context.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FlashAttn {
    /// llama.cpp's choice (on where the backend supports the graph's attention).
    #[default]
    Auto,
    On,
    Off,
}

/// What [`LlamaCppModel::decode_speed`] measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DecodeSpeed {
    /// Prompt ids prefilled.
    pub context: usize,
    /// Ids decoded after them.
    pub tokens: usize,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
    /// The sequence's state after decoding (`context + tokens` positions), as llama.cpp saves it
    /// (`llama_state_seq_get_size`): the attention layers' KV cache and, per position, its
    /// bookkeeping (position and sequence id, 12 bytes), which grow with context, and the
    /// recurrent layers' fixed state.
    pub state_bytes: usize,
}

/// Which positions of a batch llama.cpp computes logits for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Outputs {
    All,
    Last,
    None,
}

impl Model for LlamaCppModel {
    fn limits(&self) -> Limits {
        Limits {
            vocab: self.n_vocab,
            context: self.context,
            chunk: CHUNK,
        }
    }

    fn session(&self, len: usize, routing: bool) -> Result<Box<dyn Session + '_>, TeacherError> {
        Ok(Box::new(self.context(len, routing)?))
    }
}

/// One sequence in a llama.cpp context, holding the model's compute lock.
struct Context<'a> {
    model: &'a LlamaCppModel,
    ctx: *mut sys::llama_context,
    n_ctx: u32,
    batch: sys::llama_batch,
    pos: i32,
    /// The routing being recorded. llama.cpp holds its address (the eval callback's user data)
    /// and writes through it while the context lives, so it is owned as the raw pointer
    /// `Box::into_raw` gave — never a `Box` or a `&mut` that could claim it while llama.cpp
    /// writes — and freed in `Drop` after the context.
    capture: Option<*mut Capture>,
    /// Lent again after use (see `context_with`).
    pooled: bool,
    /// A decode failed: the context is freed, not lent again.
    failed: bool,
    compute: MutexGuard<'a, Option<Idle>>,
}

impl Drop for Context<'_> {
    fn drop(&mut self) {
        // SAFETY: the batch was made by `llama_batch_init` for this context and is freed once.
        unsafe { sys::llama_batch_free(self.batch) };
        let idle = Idle {
            ctx: self.ctx,
            n_ctx: self.n_ctx,
        };
        // A recording context keeps the callback's pointer to its capture: never lent again.
        match self.capture {
            None if self.pooled && !self.failed => *self.compute = Some(idle),
            _ => drop(idle), // frees the context
        }
        if let Some(capture) = self.capture.take() {
            // SAFETY: from `Box::into_raw` in `context`; the context that held its address is
            // freed above, so nothing writes through it any more.
            drop(unsafe { Box::from_raw(capture) });
        }
    }
}

impl Context<'_> {
    /// Decodes `ids` (at most [`CHUNK`]) at the next positions, computing logits for `outputs`.
    fn decode(&mut self, ids: &[u32], outputs: Outputs) -> Result<(), TeacherError> {
        assert!(ids.len() <= CHUNK, "fed in chunks of at most {CHUNK}");
        let n = ids.len();
        // SAFETY: the batch was made for CHUNK tokens of one sequence each.
        unsafe {
            let b = &mut self.batch;
            for (i, &id) in ids.iter().enumerate() {
                *b.token.add(i) = id as i32;
                *b.pos.add(i) = self.pos + i as i32;
                *b.n_seq_id.add(i) = 1;
                **b.seq_id.add(i) = 0;
                *b.logits.add(i) = match outputs {
                    Outputs::All => 1,
                    Outputs::Last => (i + 1 == n) as i8,
                    Outputs::None => 0,
                };
            }
            b.n_tokens = n as i32;
        }
        take_log();
        // SAFETY: this context and batch are this session's, under the compute lock it holds.
        let status = unsafe { sys::llama_decode(self.ctx, self.batch) };
        if status != 0 {
            self.failed = true;
            return Err(TeacherError::Request(format!(
                "llama.cpp could not decode {n} tokens at position {} (status {status}): {}",
                self.pos,
                take_log()
            )));
        }
        self.pos += n as i32;
        Ok(())
    }

    /// The logits of the last decode's batch position `i` (negative: from its last output).
    fn row(&mut self, i: i32) -> Result<&[f32], TeacherError> {
        // SAFETY: a row holds `vocab` floats and stays valid until the next decode, which the
        // borrow of `self` rules out; null when `i` had no logits computed.
        let row = unsafe { sys::llama_get_logits_ith(self.ctx, i) };
        if row.is_null() {
            self.failed = true;
            return Err(TeacherError::Request(format!(
                "llama.cpp returned no logits for batch position {i} before position {}",
                self.pos
            )));
        }
        Ok(unsafe { std::slice::from_raw_parts(row, self.model.n_vocab) })
    }
}

impl Session for Context<'_> {
    fn feed(&mut self, ids: &[u32]) -> Result<Vec<f32>, TeacherError> {
        self.decode(ids, Outputs::All)?;
        let mut logits = Vec::with_capacity(ids.len() * self.model.n_vocab);
        for i in 0..ids.len() {
            logits.extend_from_slice(self.row(i as i32)?);
        }
        Ok(logits)
    }

    fn routing(&mut self) -> Result<Option<Routing>, TeacherError> {
        let tokens = self.pos as usize;
        match self.capture {
            None => Ok(None),
            // SAFETY: llama.cpp writes through the pointer only from its eval callback, which
            // runs inside `llama_decode` on this thread; no decode runs while this borrow lives.
            Some(capture) => unsafe { &mut *capture }.finish(tokens).map_err(|e| {
                TeacherError::Request(format!(
                    "{}: llama.cpp's routing: {e}",
                    self.model.path.display()
                ))
            }),
        }
    }
}

/// The routing tensors of the graph llama.cpp evaluates, per layer, in evaluation order.
#[derive(Default)]
struct Capture {
    /// Per layer: the record so far, micro-batch after micro-batch.
    layers: BTreeMap<usize, LayerRouting>,
    /// Within one micro-batch: each layer's latest weights and output norms (llama.cpp
    /// renormalises and scales the weights, and scales and biases the outputs, in steps, each its
    /// own tensor; the last of each is what the layer goes on with).
    pending: BTreeMap<usize, (Option<Vec<f32>>, Option<Vec<f32>>)>,
    /// A tensor of an unexpected type or shape: reported instead of guessed at.
    error: Option<String>,
}

/// llama.cpp's names for the router's outputs (src/llama-graph.cpp, `build_moe_ffn`): the
/// experts chosen, the weights as each step leaves them, and the experts' outputs likewise.
const TOPK: &str = "ffn_moe_topk";
const WEIGHTS: [&str; 4] = [
    "ffn_moe_weights",
    "ffn_moe_weights_softmax",
    "ffn_moe_weights_norm",
    "ffn_moe_weights_scaled",
];
const OUTPUTS: [&str; 3] = ["ffn_moe_down", "ffn_moe_down_scaled", "ffn_moe_down_biased"];

/// `name-N` → (name, N).
fn layer_tensor(name: &str) -> Option<(&str, usize)> {
    let (base, layer) = name.rsplit_once('-')?;
    Some((base, layer.parse().ok()?))
}

impl Capture {
    fn wants(name: &str) -> bool {
        layer_tensor(name).is_some_and(|(base, _)| {
            base == TOPK || WEIGHTS.contains(&base) || OUTPUTS.contains(&base)
        })
    }

    fn record(&mut self, name: &str, t: &sys::ggml_tensor) {
        let Some((base, layer)) = layer_tensor(name) else {
            return;
        };
        // Rows of `width` values, `[tokens, k]` of them: the experts `[k, tokens]`, the weights
        // `[1, k, tokens]` or `[k, tokens]`, the outputs `[d, k, tokens]`.
        let ne = t.ne;
        let (width, k, tokens, rest) = match base {
            TOPK => (1, ne[0], ne[1], ne[2] * ne[3]),
            _ if OUTPUTS.contains(&base) || ne[0] == 1 => (ne[0], ne[1], ne[2], ne[3]),
            _ => (1, ne[0], ne[1], ne[2] * ne[3]),
        };
        let expected = match base {
            TOPK => sys::GGML_TYPE_I32,
            _ => sys::GGML_TYPE_F32,
        };
        if t.type_ != expected || rest != 1 || width < 1 || k < 1 || tokens < 1 {
            self.error
                .get_or_insert_with(|| format!("{name}: type {} shape {ne:?}", t.type_));
            return;
        }
        let n = (k * tokens) as usize;
        if base == TOPK {
            // The micro-batch's last weights and norms for this layer belong to its previous
            // experts.
            self.flush(layer);
            let mut values = Vec::with_capacity(n);
            read_rows(t, |row| {
                values.extend(row.iter().map(|v| i32::from_ne_bytes(*v) as u32))
            });
            let entry = self.layers.entry(layer).or_insert(LayerRouting {
                layer,
                k: k as usize,
                experts: vec![],
                weights: Some(vec![]),
                norms: Some(vec![]),
            });
            entry.experts.extend(values);
        } else if OUTPUTS.contains(&base) {
            let mut values = Vec::with_capacity(n);
            read_rows(t, |row| {
                let sq: f64 = row
                    .iter()
                    .map(|v| f32::from_ne_bytes(*v) as f64)
                    .map(|x| x * x)
                    .sum();
                values.push(sq.sqrt() as f32)
            });
            self.pending.entry(layer).or_default().1 = Some(values);
        } else {
            let mut values = Vec::with_capacity(n);
            read_rows(t, |row| {
                values.extend(row.iter().map(|v| f32::from_ne_bytes(*v)))
            });
            self.pending.entry(layer).or_default().0 = Some(values);
        }
    }

    /// Moves `layer`'s pending weights and norms into its record.
    fn flush(&mut self, layer: usize) {
        if let Some((weights, norms)) = self.pending.remove(&layer)
            && let Some(entry) = self.layers.get_mut(&layer)
        {
            let extend = |v: &mut Option<Vec<f32>>, new: Option<Vec<f32>>| {
                v.get_or_insert_default().extend(new.unwrap_or_default())
            };
            extend(&mut entry.weights, weights);
            extend(&mut entry.norms, norms);
        }
    }

    /// The record of `tokens` tokens (None when the model routes nothing), or what was wrong.
    fn finish(&mut self, tokens: usize) -> Result<Option<Routing>, String> {
        let layers: Vec<usize> = self.pending.keys().copied().collect();
        for layer in layers {
            self.flush(layer);
        }
        if let Some(e) = self.error.take() {
            return Err(format!("an unexpected routing tensor: {e}"));
        }
        if self.layers.is_empty() {
            return Ok(None);
        }
        let layers: Vec<LayerRouting> = std::mem::take(&mut self.layers).into_values().collect();
        let len = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, Vec::len);
        for l in &layers {
            let n = tokens * l.k;
            if l.experts.len() != n || len(&l.weights) != n || len(&l.norms) != n {
                return Err(format!(
                    "layer {}: {} experts, {} weights and {} output norms for {tokens} tokens at \
                     k = {}",
                    l.layer,
                    l.experts.len(),
                    len(&l.weights),
                    len(&l.norms),
                    l.k
                ));
            }
        }
        Ok(Some(Routing { layers }))
    }
}

/// A 4-byte-element tensor's rows (`ne[0]` values each) in row-major order, read through its
/// strides (llama.cpp's top-k is a view into the full argsort) from whichever backend holds it.
fn read_rows(t: &sys::ggml_tensor, mut each: impl FnMut(&[[u8; 4]])) {
    let [n0, n1, n2, n3] = t.ne.map(|n| n.max(0) as usize);
    let mut row = vec![[0u8; 4]; n0];
    for i3 in 0..n3 {
        for i2 in 0..n2 {
            for i1 in 0..n1 {
                let base = i1 * t.nb[1] + i2 * t.nb[2] + i3 * t.nb[3];
                if t.nb[0] == 4 {
                    // SAFETY: the row lies inside the tensor (ggml_nbytes spans its strides).
                    unsafe {
                        sys::ggml_backend_tensor_get(
                            std::ptr::from_ref(t).cast_mut(),
                            row.as_mut_ptr().cast(),
                            base,
                            4 * n0,
                        )
                    };
                } else {
                    for (i0, v) in row.iter_mut().enumerate() {
                        unsafe {
                            sys::ggml_backend_tensor_get(
                                std::ptr::from_ref(t).cast_mut(),
                                v.as_mut_ptr().cast(),
                                base + i0 * t.nb[0],
                                4,
                            )
                        };
                    }
                }
                each(&row);
            }
        }
    }
}

/// llama.cpp's evaluation callback: asked first whether a node is wanted, then called with it
/// computed.
unsafe extern "C" fn observe(t: *mut sys::ggml_tensor, ask: bool, user: *mut c_void) -> bool {
    // SAFETY: `user` is the context's boxed Capture, alive while the context is; `t` is a
    // graph node llama.cpp passes for the call.
    let (t, capture) = unsafe { (&*t, &mut *user.cast::<Capture>()) };
    let name = unsafe { CStr::from_ptr(t.name.as_ptr()) }.to_string_lossy();
    if ask {
        return Capture::wants(&name);
    }
    if Capture::wants(&name) {
        capture.record(&name, t);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::decode_context;

    #[test]
    fn a_decode_context_needs_ids_and_fits_llama_cpp_s_positions() {
        assert_eq!(decode_context(2048, 32).unwrap(), 2080);
        for (prompt, tokens) in [(0, 1), (1, 0), (usize::MAX, 1), (i32::MAX as usize, 1)] {
            let e = decode_context(prompt, tokens).unwrap_err().to_string();
            assert!(e.contains(&format!("after {prompt}")), "{e}");
        }
    }
}
