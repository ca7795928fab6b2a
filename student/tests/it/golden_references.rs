//! The student against the public references: transformers' `KimiLinearForCausalLM` (whole-model
//! logits from the same weights) and fla's `naive_attnres`. Files from scripts/golden/generate.py.

use crate::common::{Golden, device, golden_path, max_abs_diff};
use burn::module::Param;
use k3mini_student::K3Mini;
use k3mini_student::attnres::attn_res;
use k3mini_student::hf::{config_from_kimi_linear, load_hf_safetensors};
use k3mini_student::norm::RmsNorm;

#[test]
fn tiny_kimi_linear_logits_match_transformers() {
    let weights = Golden::open("kimi_linear_tiny.safetensors");
    let config_json: serde_json::Value = serde_json::from_str(&weights.metadata("config")).unwrap();
    let config = config_from_kimi_linear(&config_json).expect("config maps");
    assert_eq!(config.layer_kinds().unwrap().len(), 4);
    let mut model = K3Mini::new(&config, &device()).unwrap();
    load_hf_safetensors(&mut model, &golden_path("kimi_linear_tiny.safetensors"))
        .expect("weights load by name");

    let io = Golden::open("kimi_linear_tiny_logits.safetensors");
    let logits = model.forward(io.int::<2>("input_ids"));
    let d = max_abs_diff(logits, io.float::<3>("logits"));
    assert!(d < 1e-4, "max |Δlogit| = {d:e}");
}

#[test]
fn loading_rejects_a_missing_file_by_name() {
    let config_json: serde_json::Value =
        serde_json::from_str(&Golden::open("kimi_linear_tiny.safetensors").metadata("config"))
            .unwrap();
    let mut model =
        K3Mini::new(&config_from_kimi_linear(&config_json).unwrap(), &device()).unwrap();
    let err = load_hf_safetensors(&mut model, &golden_path("nope.safetensors")).unwrap_err();
    assert!(err.to_string().contains("nope.safetensors"), "{err}");
}

#[test]
fn attn_res_matches_fla() {
    let g = Golden::open("attnres.safetensors");
    let sources: Vec<_> = (0..5)
        .map(|i| g.float::<3>(&format!("residual_{i}")))
        .collect();
    let mut norm = RmsNorm::new(32, 1e-5, &device());
    norm.weight = Param::from_tensor(g.float::<1>("rms_weight"));
    let out = attn_res(g.float::<1>("query"), &sources, &norm);
    let d = max_abs_diff(out, g.float::<3>("output"));
    assert!(d < 1e-5, "|Δ| = {d:e}");
}
