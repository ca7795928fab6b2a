// Shared helpers for the student tests.
#![allow(dead_code)]

use burn::tensor::{Device, Int, Tensor, TensorData};
use std::path::PathBuf;

/// A recipe's `[model]` table (`preset = "NAME"` plus overrides, as TOML) resolved as the recipe's
/// plan resolves it.
pub fn model_config(model_table: &str) -> k3mini_student::ModelConfig {
    let mut table: toml::Table = model_table.parse().unwrap();
    let Some(toml::Value::String(name)) = table.remove("preset") else {
        panic!("no preset in {model_table}")
    };
    k3mini_student::presets::resolve(&name, &table).unwrap()
}

pub fn device() -> Device {
    Device::flex()
}

pub fn golden_path(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/golden")
        .join(file)
}

/// Reads every tensor (f32 or i64) and the metadata of a golden safetensors file.
pub struct Golden {
    bytes: Vec<u8>,
}

impl Golden {
    pub fn open(file: &str) -> Self {
        let path = golden_path(file);
        Self {
            bytes: std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        }
    }

    fn view(&self) -> safetensors::SafeTensors<'_> {
        safetensors::SafeTensors::deserialize(&self.bytes).expect("golden file parses")
    }

    pub fn float<const D: usize>(&self, name: &str) -> Tensor<D> {
        let st = self.view();
        let v = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(v.dtype(), safetensors::Dtype::F32, "{name}");
        let values: Vec<f32> = v
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        Tensor::from_data(TensorData::new(values, v.shape().to_vec()), &device())
    }

    pub fn int<const D: usize>(&self, name: &str) -> Tensor<D, Int> {
        let st = self.view();
        let v = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(v.dtype(), safetensors::Dtype::I64, "{name}");
        let values: Vec<i64> = v
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        Tensor::from_data(TensorData::new(values, v.shape().to_vec()), &device())
    }

    pub fn metadata(&self, key: &str) -> String {
        let (_, meta) = safetensors::SafeTensors::read_metadata(&self.bytes).expect("header");
        meta.metadata()
            .as_ref()
            .and_then(|m| m.get(key).cloned())
            .unwrap_or_else(|| panic!("no metadata {key}"))
    }
}

pub fn max_abs_diff<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shape mismatch");
    (a - b).abs().max().into_scalar::<f32>()
}

/// Random token ids `[b, t]` below `vocab`.
pub fn random_tokens(b: usize, t: usize, vocab: usize, seed: u64) -> Tensor<2, Int> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let ids: Vec<i64> = (0..b * t)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as i64
        })
        .collect();
    Tensor::from_data(TensorData::new(ids, [b, t]), &device())
}
