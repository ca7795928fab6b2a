//! A MoE model's routing decisions, token by token: per routed layer, the experts its router chose
//! for each token and, from a white-box teacher, the weights their outputs were mixed with and
//! those outputs' norms. What the llama.cpp engine reads from the graph
//! ([`crate::engine::llama_cpp`]), what served engines return ([`wire`], ids only), what routing
//! shards store (`k3mini_data::routing`, where the types live) and routing statistics are built
//! from.

pub mod wire;

pub use k3mini_data::routing::{LayerRouting, Routing, RoutingShape};
use k3mini_gguf::{GgufError, GgufFile, Value};

/// The routing of a GGUF's model as its metadata and tensors say: `{arch}.block_count` layers,
/// `{arch}.expert_count` experts, `{arch}.expert_used_count` per token, MoE layers those with a
/// router (`blk.N.ffn_gate_inp.weight`). `None` for a dense model (or one without those keys).
pub fn gguf_routing(file: &GgufFile) -> Result<Option<RoutingShape>, GgufError> {
    let arch = file.require("general.architecture", Value::as_str)?;
    let count = |key: &str| {
        file.get(&format!("{arch}.{key}"))
            .and_then(Value::as_u64)
            .unwrap_or(0) as usize
    };
    // A file without a layer count is the engine's to refuse (with its own reason).
    let layers = count("block_count");
    let moe_layers: Vec<usize> = (0..layers)
        .filter(|l| {
            file.tensor(&format!("blk.{l}.ffn_gate_inp.weight"))
                .is_some()
        })
        .collect();
    let (experts, k) = (count("expert_count"), count("expert_used_count"));
    if moe_layers.is_empty() || experts == 0 {
        return Ok(None);
    }
    if k == 0 || k > experts {
        return Err(GgufError::File {
            path: file.path.clone(),
            message: format!("{arch}.expert_used_count {k} of {experts} experts"),
        });
    }
    Ok(Some(RoutingShape {
        layers,
        k,
        experts,
        moe_layers,
    }))
}
