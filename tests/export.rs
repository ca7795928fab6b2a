//! `k3mini export --format hf`: a checkpoint becomes safetensors + a Kimi Linear config.json that
//! load back into the same model (transformers' own check is scripts/interop/check_hf.py), and
//! what Kimi Linear cannot express is refused.
use burn::tensor::{Device, Int, Tensor, TensorData};
use k3mini::export::{export_hf, load_model, open_checkpoint};
use k3mini_student::K3Mini;
use k3mini_student::hf::{config_from_kimi_linear, load_hf_safetensors, to_hf_bytes};

fn checkpoint(dir: &std::path::Path, model_table: &str) -> K3Mini {
    let recipe =
        format!("[run]\nname = \"e\"\n[model]\n{model_table}\n[data]\ntokenizer = \"none.json\"\n");
    let cfg = k3mini_student::presets::from_recipe_toml(&recipe).unwrap();
    let device = Device::default();
    device.seed(3);
    let model = K3Mini::new(&cfg, &device).unwrap();
    k3mini_checkpoints::write(
        dir,
        5,
        &[
            ("model.safetensors", to_hf_bytes(&model).unwrap()),
            ("recipe.toml", recipe.into_bytes()),
        ],
        1,
    )
    .unwrap();
    model
}

fn logits(model: &K3Mini) -> Vec<f32> {
    let ids: Vec<i64> = (0..24).map(|i| (i * 37 % 512) as i64).collect();
    let device = Device::default();
    let t = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, 12]), &device);
    model.forward(t).into_data().try_into_vec().unwrap()
}

#[test]
fn hf_export_loads_back_into_the_same_model_and_refuses_kimi_k3_features() {
    let dir = std::env::temp_dir().join(format!("k3mini-export-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let run = dir.join("run");
    let model = checkpoint(&run, "preset = \"tiny\"\nvocab_size = 512\nd_model = 64");
    let ck = open_checkpoint(&run).unwrap();
    assert_eq!(
        logits(&load_model(&ck, &Device::default()).unwrap()),
        logits(&model)
    );
    let out = dir.join("hf");
    let files = export_hf(&ck, None, &out, false).unwrap();
    assert_eq!(files.len(), 2);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    let cfg = config_from_kimi_linear(&config).unwrap();
    let mut back = K3Mini::new(&cfg, &Device::default()).unwrap();
    load_hf_safetensors(&mut back, &out.join("model.safetensors")).unwrap();
    assert_eq!(
        logits(&back),
        logits(&model),
        "the export is the same model"
    );
    // AttnRes and the MLA gate are kimi-k3 features: refused with their names.
    let k3 = dir.join("k3");
    checkpoint(
        &k3,
        "preset = \"tiny\"\nvocab_size = 512\nd_model = 64\nattn_res = { block_size = 2 }",
    );
    let e = export_hf(
        &open_checkpoint(&k3).unwrap(),
        None,
        &dir.join("k3-hf"),
        false,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("Attention Residuals") && e.contains("no Kimi Linear equivalent"),
        "{e}"
    );
    assert!(
        !dir.join("k3-hf/model.safetensors").exists(),
        "nothing written on refusal"
    );
    let e = open_checkpoint(&dir.join("nothing"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("neither a checkpoint nor a run directory"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
