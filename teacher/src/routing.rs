//! A MoE model's routing decisions, token by token: per routed layer, the experts its router chose
//! for each token and the weights their outputs were mixed with. What the llama.cpp engine reads
//! from the graph ([`crate::engine::llama_cpp`]) and what routing statistics are built from.

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
}
