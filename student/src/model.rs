//! The K3 Mini hybrid: a stack of pre-norm decoder layers whose token mixer is KDA or Gated MLA,
//! driven by the layer pattern (default 3 KDA : 1 MLA, last layer MLA), with optional AttnRes and MoE.
//!
//! ```text
//! h_0 = E[tokens]
//! per layer (plain residuals):   h += Mixer(RMSNorm(h));   h += FFN(RMSNorm(h))
//! per layer (AttnRes):           x = AttnRes(sources);  out = Mixer(RMSNorm(x));  sources.push(out)   (same for the FFN)
//! logits = W_lm RMSNorm(h)       untied embeddings
//! ```
//!
//! Module paths mirror transformers' `KimiLinearForCausalLM` (`model.layers.3.self_attn.kv_b_proj`, …).

use crate::attnres::{DepthAttention, DepthSources};
use crate::config::{ConfigError, LayerKind, ModelConfig};
use crate::kda::{KdaState, KimiDeltaAttention};
use crate::linear;
use crate::mla::{GatedMla, MlaCache};
use crate::mlp::Mlp;
use crate::moe::{ExpertLoad, Moe, Route};
use crate::norm::RmsNorm;
use crate::precision::Precision;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::{Embedding, EmbeddingConfig, Initializer, Linear};
use burn::tensor::{Device, Int, Tensor};
use k3mini_kernels::recompute::recompute;

/// The token mixer of a layer.
#[derive(Module, Debug)]
pub enum Mixer {
    Kda(KimiDeltaAttention),
    Mla(GatedMla),
}

/// The FFN of a layer.
#[derive(Module, Debug)]
pub enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

#[derive(Module, Debug)]
pub struct DecoderLayer {
    pub self_attn: Mixer,
    pub mlp: Ffn,
    pub input_layernorm: RmsNorm,
    pub post_attention_layernorm: RmsNorm,
    /// AttnRes before the mixer (absent on the very first sub-layer, whose only source is the embedding).
    pub attn_res: Option<DepthAttention>,
    /// AttnRes before the FFN.
    pub mlp_res: Option<DepthAttention>,
}

/// `Mixer(RMSNorm(x))` over a whole sequence.
fn mix(parts: &(RmsNorm, Mixer), x: Tensor<3>, starts: Option<&Tensor<2>>) -> Tensor<3> {
    let x = parts.0.forward(x);
    match &parts.1 {
        Mixer::Kda(k) => k.forward(x, None, starts),
        Mixer::Mla(m) => m.forward(x, None, starts),
    }
}

/// `FFN(RMSNorm(x))` of a dense FFN.
fn feed_forward(parts: &(RmsNorm, Mlp), x: Tensor<3>, _: Option<&Tensor<2>>) -> Tensor<3> {
    parts.1.forward(parts.0.forward(x))
}

/// `f(module, x, starts)`, with `checkpointing` as one recompute region: the backward keeps
/// `x [B, T, d]`, the starts and the module's weights, and runs `f` again.
fn sublayer<M: Module + Sync + 'static>(
    module: M,
    x: Tensor<3>,
    starts: Option<&Tensor<2>>,
    checkpointing: bool,
    f: fn(&M, Tensor<3>, Option<&Tensor<2>>) -> Tensor<3>,
) -> Tensor<3> {
    if !checkpointing {
        return f(&module, x, starts);
    }
    let mut inputs = vec![x.unsqueeze_dim::<4>(0)];
    inputs.extend(starts.map(|s| s.clone().unsqueeze::<4>()));
    let skip = inputs.len();
    let mut weights = Weights(Vec::new());
    module.visit(&mut weights);
    inputs.extend(weights.0);
    recompute(inputs, move |x| {
        let starts = (skip == 2).then(|| x[1].clone().squeeze_dim::<3>(0).squeeze_dim::<2>(0));
        let module = module.clone().map(&mut Replace(x[skip..].iter()));
        f(&module, x[0].clone().squeeze_dim::<3>(0), starts.as_ref()).unsqueeze_dim::<4>(0)
    })
    .squeeze_dim::<3>(0)
}

/// A module's float weights, each viewed as rank 4, in visiting order.
struct Weights(Vec<Tensor<4>>);

impl ModuleVisitor for Weights {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let w = param.val();
        let n = w.dims().iter().product::<usize>();
        self.0.push(w.reshape([1, 1, 1, n]));
    }
}

/// Replaces a module's float weights, in visiting order, with the given tensors.
struct Replace<'a, I: Iterator<Item = &'a Tensor<4>>>(I);

impl<'a, I: Iterator<Item = &'a Tensor<4>>> ModuleMapper for Replace<'a, I> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let w = self.0.next().expect("one tensor per weight").clone();
        param.map(|old| w.reshape(old.dims()))
    }
}

#[derive(Module, Debug)]
pub struct Backbone {
    pub embed_tokens: Embedding,
    pub layers: Vec<DecoderLayer>,
    pub norm: RmsNorm,
    /// Final AttnRes aggregation before `norm`.
    pub final_res: Option<DepthAttention>,
}

#[derive(Module, Debug)]
pub struct K3Mini {
    pub model: Backbone,
    pub lm_head: Linear,
    #[module(skip)]
    pub config: ModelConfig,
    /// Activation checkpointing (`train.activation_checkpointing`): each sub-layer of a training
    /// forward is one recompute region (see [`K3Mini::with_checkpointing`]).
    #[module(skip)]
    pub checkpointing: bool,
}

/// Per-layer inference state: KDA recurrent state + conv tail, or the MLA compressed cache.
#[derive(Clone, Debug)]
pub enum LayerState {
    Kda(KdaState),
    Mla(MlaCache),
}

/// Everything incremental decoding carries between calls.
#[derive(Clone, Debug)]
pub struct InferenceState {
    pub layers: Vec<LayerState>,
    /// Tokens consumed so far.
    pub position: usize,
}

impl InferenceState {
    /// Bytes held by the state now (f32 everywhere).
    pub fn bytes(&self) -> usize {
        let n = |t: &Tensor<4>| t.shape().num_elements();
        let n3 = |t: &Tensor<3>| t.shape().num_elements();
        4 * self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Kda(s) => n(&s.recurrent) + n3(&s.conv),
                LayerState::Mla(c) => n3(&c.latent) + n3(&c.k_rope),
            })
            .sum::<usize>()
    }
}

/// A forward's results.
#[derive(Clone, Debug)]
pub struct ModelOutput {
    /// `[B, T, vocab]`.
    pub logits: Tensor<3>,
    /// Tokens per expert, for each MoE layer in order (for the aux-loss-free bias update).
    pub expert_load: Vec<ExpertLoad>,
    /// Each MoE layer's routing, in order.
    pub routing: Vec<Route>,
    /// `Σ_layers α · L_bal`, for a training loss to add, when the MoE config sets α.
    pub balance_loss: Option<Tensor<1>>,
}

/// A forward without the LM head: what [`crate::head`] turns into a loss chunk by chunk.
#[derive(Clone, Debug)]
pub struct Trunk {
    /// The final norm's output `[B, T, d_model]`, the LM head's input.
    pub hidden: Tensor<3>,
    pub expert_load: Vec<ExpertLoad>,
    pub routing: Vec<Route>,
    pub balance_loss: Option<Tensor<1>>,
}

impl Trunk {
    /// The head's input at the positions that predict a next token (all but each row's last):
    /// `[B, T, d] → [B·(T−1), d]`.
    pub fn predicting(&self) -> Tensor<2> {
        let [b, t, d] = self.hidden.dims();
        assert!(t >= 2, "next-token losses need at least two tokens per row");
        self.hidden
            .clone()
            .narrow(1, 0, t - 1)
            .reshape([b * (t - 1), d])
    }
}

impl K3Mini {
    /// Builds a randomly initialised model; the config is validated first.
    pub fn new(config: &ModelConfig, device: &Device) -> Result<Self, ConfigError> {
        config.validate()?;
        let kinds = config.layer_kinds()?;
        let d = config.d_model;
        let eps = config.rms_eps;
        let block = config.attn_res.as_ref().map(|a| a.block_size);
        let layers = kinds
            .iter()
            .enumerate()
            .map(|(i, kind)| DecoderLayer {
                self_attn: match kind {
                    LayerKind::Kda => Mixer::Kda(KimiDeltaAttention::new(
                        d,
                        config.n_heads,
                        &config.kda,
                        eps,
                        device,
                    )),
                    LayerKind::Mla => {
                        Mixer::Mla(GatedMla::new(d, config.n_heads, &config.mla, device))
                    }
                },
                mlp: match (&config.moe, config.is_moe_layer(i)) {
                    (Some(moe), true) => Ffn::Moe(Moe::new(d, moe, config.activation, eps, device)),
                    _ => Ffn::Dense(Mlp::new(d, config.ffn_hidden, config.activation, device)),
                },
                input_layernorm: RmsNorm::new(d, eps, device),
                post_attention_layernorm: RmsNorm::new(d, eps, device),
                attn_res: block
                    .filter(|_| i > 0)
                    .map(|_| DepthAttention::new(d, eps, device)),
                mlp_res: block.map(|_| DepthAttention::new(d, eps, device)),
            })
            .collect();
        let embed_tokens = EmbeddingConfig::new(config.vocab_size, d)
            .with_initializer(Initializer::Normal {
                mean: 0.0,
                std: crate::INIT_STD,
            })
            .init(device);
        Ok(Self {
            model: Backbone {
                embed_tokens,
                layers,
                norm: RmsNorm::new(d, eps, device),
                final_res: block.map(|_| DepthAttention::new(d, eps, device)),
            },
            lm_head: linear(d, config.vocab_size, device),
            config: config.clone(),
            checkpointing: false,
        }
        .with_precision(config.precision))
    }

    /// With `on`, each sub-layer of a training forward (a mixer, a dense FFN) is one recompute
    /// region: the graph keeps its input, and the backward runs the sub-layer again (one more
    /// forward of the trunk's sub-layers for a fraction of the activations).
    pub fn with_checkpointing(mut self, on: bool) -> Self {
        self.checkpointing = on;
        self
    }

    /// Every layer's matrix products at `p` (see [`crate::precision`]).
    pub fn with_precision(mut self, p: Precision) -> Self {
        self.config.precision = p;
        for layer in &mut self.model.layers {
            match &mut layer.self_attn {
                Mixer::Kda(k) => k.precision = p,
                Mixer::Mla(m) => m.precision = p,
            }
            match &mut layer.mlp {
                Ffn::Dense(mlp) => mlp.precision = p,
                Ffn::Moe(moe) => {
                    moe.precision = p;
                    if let Some(shared) = &mut moe.shared_experts {
                        shared.precision = p;
                    }
                }
            }
        }
        self
    }

    /// Full-sequence forward `tokens [B, T]` → logits `[B, T, vocab]`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.run(tokens, None, None).logits
    }

    /// Forward over packed documents: `starts [B, T]` is 1.0 where a token begins a new document.
    /// Each document is computed exactly as if it were alone: KDA states and convs reset at its
    /// start, MLA attention is block-diagonal (per-token layers need nothing).
    pub fn forward_packed(&self, tokens: Tensor<2, Int>, starts: Tensor<2>) -> ModelOutput {
        self.run(tokens, Some(&starts), None)
    }

    /// A fresh inference state for `batch` sequences.
    pub fn empty_state(&self, batch: usize, device: &Device) -> InferenceState {
        let layers = self
            .model
            .layers
            .iter()
            .map(|l| match &l.self_attn {
                Mixer::Kda(k) => LayerState::Kda(k.empty_state(batch, device)),
                Mixer::Mla(m) => LayerState::Mla(m.empty_cache(batch, device)),
            })
            .collect();
        InferenceState {
            layers,
            position: 0,
        }
    }

    /// Forward that continues from `state` when given (prefill with T > 1, decode with T = 1) and
    /// updates it. Without a state it is the plain training forward.
    pub fn forward_with(
        &self,
        tokens: Tensor<2, Int>,
        state: Option<&mut InferenceState>,
    ) -> ModelOutput {
        self.run(tokens, None, state)
    }

    /// The training forward without the LM head: `tokens [B, T]` (packed documents with
    /// `starts`) → the head's input `[B, T, d]`, for [`crate::head::head_loss`].
    pub fn trunk(&self, tokens: Tensor<2, Int>, starts: Option<&Tensor<2>>) -> Trunk {
        self.run_trunk(tokens, starts, None)
    }

    /// The LM head: `hidden [.., d]` → logits `[.., vocab]`.
    pub fn head<const D: usize>(&self, hidden: Tensor<D>) -> Tensor<D> {
        self.config.precision.linear(&self.lm_head, hidden)
    }

    fn run(
        &self,
        tokens: Tensor<2, Int>,
        starts: Option<&Tensor<2>>,
        state: Option<&mut InferenceState>,
    ) -> ModelOutput {
        let trunk = self.run_trunk(tokens, starts, state);
        ModelOutput {
            logits: self.head(trunk.hidden),
            expert_load: trunk.expert_load,
            routing: trunk.routing,
            balance_loss: trunk.balance_loss,
        }
    }

    fn run_trunk(
        &self,
        tokens: Tensor<2, Int>,
        starts: Option<&Tensor<2>>,
        mut state: Option<&mut InferenceState>,
    ) -> Trunk {
        let t = tokens.dims()[1];
        let embedded = self.model.embed_tokens.forward(tokens);
        let block = self.config.attn_res.as_ref().map(|a| a.block_size);
        let (mut expert_load, mut routing) = (Vec::new(), Vec::new());
        let mut balance_loss: Option<Tensor<1>> = None;
        let mut h = embedded.clone();
        let mut depth = DepthSources {
            done: vec![embedded],
            partial: None,
        };
        let checkpointing = state.is_none() && self.checkpointing;
        for (i, layer) in self.model.layers.iter().enumerate() {
            let layer_state = state.as_deref_mut().map(|s| &mut s.layers[i]);
            // Mixer sub-layer (global index 2i).
            let x = match (block, &layer.attn_res) {
                (Some(bs), Some(res)) => res.forward(&depth.sources_for(2 * i, bs)),
                _ => h.clone(),
            };
            let mixed = match (&layer.self_attn, layer_state) {
                (Mixer::Kda(k), Some(LayerState::Kda(s))) => {
                    k.forward(layer.input_layernorm.forward(x), Some(s), starts)
                }
                (Mixer::Mla(m), Some(LayerState::Mla(c))) => {
                    m.forward(layer.input_layernorm.forward(x), Some(c), starts)
                }
                (mixer, None) => sublayer(
                    (layer.input_layernorm.clone(), mixer.clone()),
                    x,
                    starts,
                    checkpointing,
                    mix,
                ),
                _ => panic!("inference state does not match layer {i}'s mixer"),
            };
            // FFN sub-layer (global index 2i + 1).
            let x = match (block, &layer.mlp_res) {
                (Some(bs), Some(res)) => {
                    depth.push_output(mixed);
                    res.forward(&depth.sources_for(2 * i + 1, bs))
                }
                _ => {
                    h = h + mixed;
                    h.clone()
                }
            };
            let out = match &layer.mlp {
                Ffn::Dense(mlp) => sublayer(
                    (layer.post_attention_layernorm.clone(), mlp.clone()),
                    x,
                    None,
                    checkpointing,
                    feed_forward,
                ),
                Ffn::Moe(moe) => {
                    let out = moe.forward(layer.post_attention_layernorm.forward(x));
                    expert_load.push(out.load);
                    routing.push(Route {
                        layer: i,
                        ..out.route
                    });
                    if let Some(l) = out.balance_loss {
                        balance_loss = Some(match balance_loss {
                            Some(sum) => sum + l,
                            None => l,
                        });
                    }
                    out.y
                }
            };
            if block.is_some() {
                depth.push_output(out);
            } else {
                h = h + out;
            }
        }
        let h = match &self.model.final_res {
            Some(res) => res.forward(&depth.all()),
            None => h,
        };
        if let Some(s) = state {
            s.position += t;
        }
        Trunk {
            hidden: self.model.norm.forward(h),
            expert_load,
            routing,
            balance_loss,
        }
    }

    /// The model with, at MoE layer `i` (in order), only the routed experts `keep[i]` (ascending
    /// ids, the same number at every layer): see [`Moe::retain_experts`].
    pub fn retain_experts(&self, keep: &[Vec<usize>]) -> Result<Self, ConfigError> {
        let bad = |message: String| ConfigError {
            field: "moe.num_experts".into(),
            message,
        };
        let moe = self
            .config
            .moe
            .as_ref()
            .ok_or_else(|| bad("a dense model has no experts to prune".into()))?;
        let n = keep.first().map_or(0, Vec::len);
        let moe_layers = self
            .model
            .layers
            .iter()
            .filter(|l| matches!(l.mlp, Ffn::Moe(_)))
            .count();
        if keep.len() != moe_layers {
            return Err(bad(format!(
                "experts to keep for {} MoE layers of {moe_layers}",
                keep.len()
            )));
        }
        for (i, k) in keep.iter().enumerate() {
            if k.len() != n || !k.windows(2).all(|w| w[0] < w[1]) {
                return Err(bad(format!(
                    "MoE layer {i}: keep {n} distinct ascending experts at every layer, not {k:?}"
                )));
            }
            if let Some(&e) = k.last().filter(|&&e| e >= moe.num_experts) {
                return Err(bad(format!(
                    "MoE layer {i}: expert {e} of {} experts",
                    moe.num_experts
                )));
            }
        }
        if n < moe.top_k {
            return Err(bad(format!(
                "{n} experts cannot serve top_k = {}: keep at least {}",
                moe.top_k, moe.top_k
            )));
        }
        let mut out = self.clone();
        if let Some(m) = out.config.moe.as_mut() {
            m.num_experts = n;
        }
        for (m, k) in out.moe_layers_mut().zip(keep) {
            *m = m.retain_experts(k);
        }
        Ok(out)
    }

    /// Applies the aux-loss-free bias update to every MoE layer.
    pub fn update_router_biases(&mut self, loads: &[ExpertLoad]) {
        let rate = self.config.moe.as_ref().map_or(0.0, |m| m.bias_update_rate);
        for (moe, load) in self.moe_layers_mut().zip(loads) {
            moe.update_bias(load, rate);
        }
    }

    /// The MoE layers' FFNs, in order.
    fn moe_layers_mut(&mut self) -> impl Iterator<Item = &mut Moe> {
        self.model
            .layers
            .iter_mut()
            .filter_map(|l| match &mut l.mlp {
                Ffn::Moe(m) => Some(m),
                Ffn::Dense(_) => None,
            })
    }
}
