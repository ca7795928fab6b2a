//! A MoE model's routing decisions, token by token: per routed layer, the experts its router chose
//! for each token, the weights their outputs were mixed with, and those outputs' norms. What the
//! llama.cpp engine reads from the graph ([`crate::engine::llama_cpp`]) and what routing
//! statistics are built from. [`wire`]: the expert ids served engines return.

pub mod wire;

/// One sequence's routing.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// The routed layers, by layer index.
    pub layers: Vec<LayerRouting>,
}

/// One layer's routing of one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerRouting {
    /// The block's index in the model.
    pub layer: usize,
    /// Experts per token.
    pub k: usize,
    /// `[tokens, k]` row-major: the chosen experts, in the router's order (best first).
    pub experts: Vec<u32>,
    /// `[tokens, k]`: the weight each chosen expert's output is multiplied by.
    pub weights: Vec<f32>,
    /// `[tokens, k]`: the L2 norm of each chosen expert's output before its weight (REAP's
    /// ‖f_j(x)‖₂; where a graph weights the experts' inputs instead, as Llama 4's does, the
    /// output of the weighted input).
    pub norms: Vec<f32>,
}
