//! Packed training sequences: every document's logits equal those of the document run alone, so
//! neither KDA state, short conv nor MLA attention leaks across a boundary.

use crate::common::{device, max_abs_diff, random_tokens};
use burn::tensor::{Int, Tensor, TensorData};
use k3mini_student::config::{AttnResConfig, KdaConfig, ModelConfig, MoeConfig};
use k3mini_student::{K3Mini, presets};

fn check(config: &ModelConfig) {
    let device = device();
    device.seed(8);
    let model = K3Mini::new(config, &device).unwrap();
    // Three documents packed in each of two rows, boundaries at different places per row.
    let bounds = [[0usize, 9, 30, 41], [0, 17, 21, 41]];
    let tokens = random_tokens(2, 41, config.vocab_size, 12);
    let mut starts = vec![0.0f32; 2 * 41];
    for (row, b) in bounds.iter().enumerate() {
        for &p in &b[1..3] {
            starts[row * 41 + p] = 1.0;
        }
    }
    let packed = model
        .forward_packed(
            tokens.clone(),
            Tensor::from_data(TensorData::new(starts, [2, 41]), &device),
        )
        .logits;
    for (row, b) in bounds.iter().enumerate() {
        for w in b.windows(2) {
            let doc: Tensor<2, Int> = tokens
                .clone()
                .narrow(0, row, 1)
                .narrow(1, w[0], w[1] - w[0]);
            let alone = model.forward(doc);
            let got = packed
                .clone()
                .narrow(0, row, 1)
                .narrow(1, w[0], w[1] - w[0]);
            let d = max_abs_diff(got, alone);
            assert!(d < 1e-5, "row {row} document {w:?}: |Δlogit| = {d:e}");
        }
    }
}

fn tiny() -> ModelConfig {
    // Chunk 16 so documents straddle chunk edges.
    ModelConfig {
        vocab_size: 256,
        kda: KdaConfig {
            chunk_size: 16,
            ..presets::tiny().kda
        },
        ..presets::tiny()
    }
}

#[test]
fn hybrid_documents_do_not_see_each_other() {
    check(&tiny());
}

#[test]
fn with_attn_res_and_moe() {
    let moe = MoeConfig {
        num_experts: 4,
        top_k: 2,
        num_shared_experts: 1,
        expert_hidden: 16,
        routed_scaling_factor: 2.446,
        latent_dim: None,
        first_dense_layers: 1,
        bias_update_rate: 1e-3,
        balance_loss_weight: 0.0,
    };
    check(&ModelConfig {
        attn_res: Some(AttnResConfig { block_size: 2 }),
        moe: Some(moe),
        ..tiny()
    });
}

/// MLA's attention in chunks of queries (3 rows a chunk, the offsets of later chunks and of a
/// cache exercised) equals it in one chunk: outputs and the input's gradient, packed documents
/// in the part that reads the cache.
#[test]
fn mla_attention_in_chunks_of_queries_equals_one_chunk() {
    use burn::tensor::Distribution;
    use k3mini_student::mla::GatedMla;
    let device = device().autodiff();
    device.seed(4);
    let mut cfg = presets::tiny().mla;
    cfg.q_lora_rank = Some(24);
    cfg.output_gate = true;
    let whole = GatedMla::new(32, 2, &cfg, &device);
    let mut chunked = whole.clone();
    chunked.scores_at_once = 3 * 2 * 19; // 3 query rows of [B=1 x H=2 x S=19] scores
    let x = Tensor::<3>::random([1, 19, 32], Distribution::Normal(0.0, 1.0), &device);
    let mut starts = vec![0.0f32; 12];
    starts[5] = 1.0;
    let starts = Tensor::<2>::from_data(TensorData::new(starts, [1, 12]), &device);
    let run = |layer: &GatedMla| {
        let x = x.clone().require_grad();
        let mut cache = layer.empty_cache(1, &device);
        let first = layer.forward(x.clone().narrow(1, 0, 7), Some(&mut cache), None);
        let rest = layer.forward(x.clone().narrow(1, 7, 12), Some(&mut cache), Some(&starts));
        let y = Tensor::cat(vec![first, rest], 1);
        // Seeded after the forward, which initialises the lazy weights on the first run.
        device.seed(9);
        let w = Tensor::<3>::random(y.dims(), Distribution::Normal(0.0, 1.0), &device);
        let grads = (y.clone() * w).sum().backward();
        (y.inner(), x.grad(&grads).unwrap())
    };
    let (y_whole, g_whole) = run(&whole);
    let (y_chunked, g_chunked) = run(&chunked);
    assert!(max_abs_diff(y_chunked, y_whole) < 1e-5);
    let d = max_abs_diff(g_chunked.clone(), g_whole.clone());
    assert!(
        d < 1e-5,
        "{d} of {}",
        g_whole.abs().max().into_scalar::<f32>()
    );
}
