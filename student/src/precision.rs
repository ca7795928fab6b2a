//! The precision of the student's matrix products (`[model] precision`).
//!
//! `bf16` rounds both operands of the projections, the experts and MLA's attention products to
//! bfloat16, and the backends (flex, libtorch) return the product in bfloat16 too, which is then
//! cast to f32: every product's output is a bf16 value — the LM head's logits and MLA's scores and
//! context included, so the loss sees logits rounded to bf16 (`student/tests/it/precision.rs`
//! checks this and measures the KL to the f32 model; the README quotes it). The matmuls run on
//! bf16 units (tensor cores, AMX) while the master weights, their gradients and AdamW moments,
//! norms, softmax, KDA's forget gate and recurrent state, the MoE router and every loss compute in
//! f32. The gradient flows through the casts to the f32 weights (a cast's backward casts back).

use burn::nn::Linear;
use burn::tensor::{DType, Tensor};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    F32,
    Bf16,
}

impl std::str::FromStr for Precision {
    type Err = String;

    /// As a recipe writes it.
    fn from_str(s: &str) -> Result<Self, String> {
        Self::deserialize(serde::de::value::StrDeserializer::<serde::de::value::Error>::new(s))
            .map_err(|_| format!("{s:?} is not a precision: f32 or bf16"))
    }
}

impl Precision {
    pub fn is_f32(&self) -> bool {
        *self == Precision::F32
    }

    /// `a · b` (batched over leading dimensions) as f32; under bf16 a bf16-rounded product.
    pub fn matmul<const D: usize>(self, a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
        match self {
            Precision::F32 => a.matmul(b),
            Precision::Bf16 => a
                .cast(DType::BF16)
                .matmul(b.cast(DType::BF16))
                .cast(DType::F32),
        }
    }

    /// A bias-free projection `x · W` (`W: [d_in, d_out]`) as f32 (under bf16, a bf16-rounded
    /// product); f32 is exactly `Linear::forward`.
    pub fn linear<const D: usize>(self, l: &Linear, x: Tensor<D>) -> Tensor<D> {
        match self {
            Precision::F32 => l.forward(x),
            Precision::Bf16 => self.project(x, l.weight.val()),
        }
    }

    /// `x · w` for a weight given as a tensor (`w: [d_in, d_out]`): what [`Self::linear`] computes
    /// for a bias-free `Linear` whose weight is `w`.
    pub fn project<const D: usize>(self, x: Tensor<D>, w: Tensor<2>) -> Tensor<D> {
        match self {
            Precision::F32 => burn::tensor::module::linear(x, w, None),
            Precision::Bf16 => {
                burn::tensor::module::linear(x.cast(DType::BF16), w.cast(DType::BF16), None)
                    .cast(DType::F32)
            }
        }
    }
}
