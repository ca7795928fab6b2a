//! The llama.cpp architectures k3mini writes (its two Kimi ones, and deepseek2 for a Transformer
//! twin): which one a student maps to, each one's tensor names in one table (as llama.cpp's
//! `llama-arch.cpp` lists them), and its hyperparameter keys.

use k3mini_gguf::Value;
use k3mini_student::config::{Activation, KdaConfig};
use k3mini_student::hf::kimi_linear_gap;
use k3mini_student::mlp::{SITU_BETA, SITU_LINEAR_BETA};
use k3mini_student::{LayerKind, ModelConfig};

/// The llama.cpp architecture a student maps to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufArch {
    /// `kimi-linear`: Kimi Linear's own graph, for students without K3 features.
    KimiLinear,
    /// `kimi-k3`: adds AttnRes, SiTU, the MLA output gate and q-LoRA, the full-rank and safe KDA
    /// gates, and LatentMoE.
    KimiK3,
    /// `deepseek2`, for a student without KDA layers (a Transformer twin): both Kimi graphs abort
    /// on a model with no recurrent layer (`GGML_ASSERT` on its empty recurrent-state buffer),
    /// and deepseek2 computes the same absorbed MLA (q-LoRA included), SwiGLU FFN and
    /// sigmoid-routed MoE with shared experts, its RoPE turned into the identity
    /// ([`nope_as_rope`]).
    Deepseek2,
}

impl GgufArch {
    /// `kimi-linear` where it expresses the student (the graph more llama.cpp builds have),
    /// `kimi-k3` otherwise; `deepseek2` for a student without KDA layers that it expresses
    /// ([`twin_gap`]; one it does not maps to `kimi-k3`, which the export refuses).
    pub fn for_config(cfg: &ModelConfig) -> Self {
        let has_kda = cfg
            .layer_kinds()
            .map_or(true, |k| k.contains(&LayerKind::Kda));
        if !has_kda && twin_gap(cfg).is_none() {
            Self::Deepseek2
        } else if kimi_linear_gap(cfg).is_none() && cfg.mla.q_lora_rank.is_none() {
            Self::KimiLinear
        } else {
            Self::KimiK3
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::KimiLinear => "kimi-linear",
            Self::KimiK3 => "kimi-k3",
            Self::Deepseek2 => "deepseek2",
        }
    }

    /// The architecture's tensor names.
    pub fn tensors(self) -> &'static TensorNames {
        match self {
            Self::KimiLinear => &KIMI_LINEAR,
            Self::KimiK3 => &KIMI_K3,
            Self::Deepseek2 => &DEEPSEEK2,
        }
    }
}

/// What llama.cpp's deepseek2 cannot express of a student without KDA layers, named as
/// [`kimi_linear_gap`] names it; None when it runs as deepseek2. The student's KDA settings are
/// moot without a KDA layer, so only its other features count, and three of deepseek2's own:
/// it rotates the rope slice in pairs, requires a shared expert, and reads 26 or 27 layers (or
/// 48 at Llama 3's 128,256 ids) as DeepSeek-V2-Lite's shape, without q-LoRA.
pub fn twin_gap(cfg: &ModelConfig) -> Option<(&'static str, &'static str)> {
    let moot_kda = ModelConfig {
        kda: KdaConfig {
            gate_lower_bound: None,
            gate_rank: Some(cfg.kda.head_dim),
            ..cfg.kda.clone()
        },
        ..cfg.clone()
    };
    let lite = matches!(cfg.n_layers, 26 | 27) || (cfg.n_layers == 48 && cfg.vocab_size == 128_256);
    if let Some(gap) = kimi_linear_gap(&moot_kda) {
        Some(gap)
    } else if cfg.mla.qk_rope_head_dim % 2 == 1 || cfg.mla.qk_rope_head_dim == 0 {
        Some(("mla.qk_rope_head_dim", "an odd or empty rope slice"))
    } else if cfg.moe.as_ref().is_some_and(|m| m.num_shared_experts == 0) {
        Some(("moe.num_shared_experts", "MoE without a shared expert"))
    } else if cfg.mla.q_lora_rank.is_some() && lite {
        Some((
            "mla.q_lora_rank",
            "q-LoRA at 26 or 27 layers (or 48 at 128,256 ids: DeepSeek-V2-Lite's shapes)",
        ))
    } else {
        None
    }
}

/// Kimi's MLA never rotates its "rope" slice (NoPE); deepseek2 rotates it by `pos·θ_i/F` under
/// linear RoPE scaling by `F`. With `F = 2^56` every angle is below 2^-25 rad at any position
/// llama.cpp takes (`pos < 2^31`, `θ_i ≤ 1`), so `cos` rounds to 1 and the `sin` term moves the
/// slice by less than f32 rounding of its norm: the rotation is the identity. deepseek2 then
/// pre-scales `q·k` by `mscale²`, `mscale = (1 + 0.1·ln F)·(1 + m·ln F)` (its YaRN correction,
/// applied under any scaling type; `m` the stored `yarn_log_multiplier`), so
/// `m = −0.1/(1 + 0.1·ln F)` makes `mscale = 1` (to one f32 ulp in llama.cpp's own arithmetic at
/// this `F`; the cancellation in `1 + m·ln F` grows with `ln F`) and leaves Kimi's `q·k/√d_k`.
/// Returns the three keys, without the architecture's prefix.
pub fn nope_as_rope() -> [(&'static str, Value); 3] {
    let factor = 2f64.powi(56);
    let ln_f = factor.ln();
    [
        ("rope.scaling.type", Value::String("linear".into())),
        ("rope.scaling.factor", Value::F32(factor as f32)),
        (
            "rope.scaling.yarn_log_multiplier",
            Value::F32((-0.1 / (1.0 + 0.1 * ln_f)) as f32),
        ),
    ]
}

/// kimi-k3 applies SiTU in every FFN. SwiGLU is its limit as the caps go to infinity: with
/// β = 1e6, `β·tanh(g/β) = g·(1 − (g/β)²/3 + …)` equals `g` to f32 rounding for |g| < 100, and a
/// linear β of 0 turns the up-branch cap off (llama.cpp's convention).
const SWIGLU_AS_SITU: (f32, f32) = (1e6, 0.0);

/// A tensor that keeps its values: `(transformers name, GGUF name)`, ggml's `ne` the shape
/// reversed. In per-layer lists both are relative to the layer (`model.layers.{i}.`, `blk.{i}.`).
pub type Rename = (&'static str, &'static str);

/// One architecture's tensors, in the order the GGUF lists them. Plain renames are [`Rename`]s;
/// a tensor the mapping transforms (`tensors.rs`: a split, a product, `−exp`) is named by its
/// GGUF name beside the student tensors it comes from.
pub struct TensorNames {
    pub embedding: Rename,
    /// After the layers: the final norm and the (untied) head.
    pub output: [Rename; 2],
    /// Every layer, in order: the mixer's input norm; its output projection and the FFN's
    /// input norm after the mixer.
    pub mixer_norm: Rename,
    pub mixer_out: [Rename; 2],
    /// KDA: the q/k/v projections; the fused short conv split into q, k and v; the forget gate
    /// and β projections; `−exp(A_log)` (`[1, H]` in kimi-linear, as its checkpoints, `[H]` in
    /// kimi-k3); dt_bias; the output gate; the per-head output norm.
    pub kda_proj: [Rename; 3],
    pub kda_conv: (&'static str, [&'static str; 3]),
    pub kda_gates: [Rename; 3],
    pub kda_decay: (&'static str, &'static str, bool),
    pub kda_dt_bias: Rename,
    pub kda_out_gate: KdaGate,
    pub kda_norm: Rename,
    /// MLA: the query (or K3's q-LoRA), the compressed KV and its norm; `kv_b` split per head
    /// into keys (transposed) and values; K3's output gate.
    pub mla_q: Rename,
    pub mla_q_lora: Option<[Rename; 3]>,
    pub mla_kv_a: [Rename; 2],
    pub mla_kv_b: (&'static str, [&'static str; 2]),
    pub mla_gate: Option<Rename>,
    pub dense_ffn: [Rename; 3],
    /// MoE: the router and its score-correction bias; the routed experts' fused `gate_up`
    /// split into gate and up, then down; LatentMoE's projections and norm; the shared expert.
    pub moe_router: [Rename; 2],
    pub moe_gate_up: (&'static str, [&'static str; 2]),
    pub moe_down: Rename,
    pub moe_latent: Option<[Rename; 3]>,
    pub moe_shared: [Rename; 3],
    /// AttnRes score vectors (kimi-k3): before each mixer, before each FFN, and the final one;
    /// each from a pseudo-query and its key norm.
    pub attn_res: Option<AttnResNames>,
}

/// KDA's output gate.
pub enum KdaGate {
    /// kimi-linear keeps the low-rank pair `g_b · g_a`.
    LowRank([Rename; 2]),
    /// kimi-k3 has one full-rank matrix: the student's full gate (`g_b_proj` alone), or the
    /// product of its low-rank pair `(g_a, g_b)`.
    Full {
        low_rank: [&'static str; 2],
        gguf: &'static str,
    },
}

pub struct AttnResNames {
    /// The student's depth attentions (`{p}.query`, `{p}.key_norm.weight`) → the GGUF score.
    pub mixer: Rename,
    pub ffn: Rename,
    pub output: Rename,
}

const KIMI_LINEAR: TensorNames = TensorNames {
    embedding: ("model.embed_tokens.weight", "token_embd.weight"),
    output: [
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ],
    mixer_norm: ("input_layernorm.weight", "attn_norm.weight"),
    mixer_out: [
        ("self_attn.o_proj.weight", "attn_output.weight"),
        ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ],
    kda_proj: [
        ("self_attn.q_proj.weight", "attn_q.weight"),
        ("self_attn.k_proj.weight", "attn_k.weight"),
        ("self_attn.v_proj.weight", "attn_v.weight"),
    ],
    kda_conv: (
        "self_attn.conv1d.weight",
        [
            "ssm_conv1d_q.weight",
            "ssm_conv1d_k.weight",
            "ssm_conv1d_v.weight",
        ],
    ),
    kda_gates: [
        ("self_attn.forget_gate.f_a_proj.weight", "ssm_f_a.weight"),
        ("self_attn.forget_gate.f_b_proj.weight", "ssm_f_b.weight"),
        ("self_attn.b_proj.weight", "ssm_beta.weight"),
    ],
    kda_decay: ("self_attn.forget_gate.A_log", "ssm_a", true),
    kda_dt_bias: ("self_attn.forget_gate.dt_bias", "ssm_dt.bias"),
    kda_out_gate: KdaGate::LowRank([
        ("self_attn.g_a_proj.weight", "ssm_g_a.weight"),
        ("self_attn.g_b_proj.weight", "ssm_g_b.weight"),
    ]),
    kda_norm: ("self_attn.o_norm.weight", "ssm_norm.weight"),
    mla_q: ("self_attn.q_proj.weight", "attn_q.weight"),
    mla_q_lora: None,
    mla_kv_a: [
        (
            "self_attn.kv_a_proj_with_mqa.weight",
            "attn_kv_a_mqa.weight",
        ),
        ("self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"),
    ],
    mla_kv_b: (
        "self_attn.kv_b_proj.weight",
        ["attn_k_b.weight", "attn_v_b.weight"],
    ),
    mla_gate: None,
    dense_ffn: [
        ("mlp.gate_proj.weight", "ffn_gate.weight"),
        ("mlp.up_proj.weight", "ffn_up.weight"),
        ("mlp.down_proj.weight", "ffn_down.weight"),
    ],
    moe_router: [
        ("mlp.gate.weight", "ffn_gate_inp.weight"),
        ("mlp.gate.e_score_correction_bias", "exp_probs_b.bias"),
    ],
    moe_gate_up: (
        "mlp.experts.gate_up_proj",
        ["ffn_gate_exps.weight", "ffn_up_exps.weight"],
    ),
    moe_down: ("mlp.experts.down_proj", "ffn_down_exps.weight"),
    moe_latent: None,
    moe_shared: [
        (
            "mlp.shared_experts.gate_proj.weight",
            "ffn_gate_shexp.weight",
        ),
        ("mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight"),
        (
            "mlp.shared_experts.down_proj.weight",
            "ffn_down_shexp.weight",
        ),
    ],
    attn_res: None,
};

/// deepseek2 names the MLA, FFN and MoE tensors as kimi-linear does; its q-LoRA as kimi-k3.
const DEEPSEEK2: TensorNames = TensorNames {
    mla_q_lora: KIMI_K3.mla_q_lora,
    ..KIMI_LINEAR
};

/// kimi-k3: kimi-linear's tensors with K3's features (llama.cpp's conversion/kimi_k3.py).
const KIMI_K3: TensorNames = TensorNames {
    kda_decay: ("self_attn.forget_gate.A_log", "ssm_a", false),
    kda_out_gate: KdaGate::Full {
        low_rank: ["self_attn.g_a_proj.weight", "self_attn.g_b_proj.weight"],
        gguf: "ssm_g.weight",
    },
    mla_q_lora: Some([
        ("self_attn.q_a_proj.weight", "attn_q_a.weight"),
        ("self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"),
        ("self_attn.q_b_proj.weight", "attn_q_b.weight"),
    ]),
    mla_gate: Some(("self_attn.g_proj.weight", "attn_gate.weight")),
    moe_latent: Some([
        ("mlp.latent_down_proj.weight", "ffn_routed_down.weight"),
        ("mlp.latent_norm.weight", "ffn_routed_norm.weight"),
        ("mlp.latent_up_proj.weight", "ffn_routed_up.weight"),
    ]),
    attn_res: Some(AttnResNames {
        mixer: ("attn_res", "attn_res_score.weight"),
        ffn: ("mlp_res", "ffn_res_score.weight"),
        output: ("model.final_res", "output_res_score.weight"),
    }),
    ..KIMI_LINEAR
};

/// The architecture's hyperparameter keys.
pub fn gguf_metadata(
    cfg: &ModelConfig,
    arch: GgufArch,
    kinds: &[LayerKind],
) -> Vec<(String, Value)> {
    let name = arch.name();
    let u = |x: usize| Value::U32(x as u32);
    let k = |key: &str| format!("{name}.{key}");
    let (mla, kda) = (&cfg.mla, &cfg.kda);
    // Dense students still give the MoE keys llama.cpp requires, with every block dense.
    let moe = cfg.moe.as_ref();
    let head_count_kv = kinds.iter().map(|k| u((*k == LayerKind::Mla) as usize));
    let mut metadata = vec![
        ("general.architecture".into(), Value::String(name.into())),
        ("general.name".into(), Value::String("K3 Mini".into())),
        (k("context_length"), u(cfg.max_seq_len)),
        (k("embedding_length"), u(cfg.d_model)),
        (k("block_count"), u(cfg.n_layers)),
        (k("feed_forward_length"), u(cfg.ffn_hidden)),
        (k("attention.head_count"), u(cfg.n_heads)),
        (
            k("attention.head_count_kv"),
            Value::Array(head_count_kv.collect()),
        ),
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(cfg.rms_eps as f32),
        ),
        (k("vocab_size"), u(cfg.vocab_size)),
        (k("rope.dimension_count"), u(mla.qk_rope_head_dim)),
        (k("attention.kv_lora_rank"), u(mla.kv_lora_rank)),
        (
            k("attention.key_length"),
            u(mla.kv_lora_rank + mla.qk_rope_head_dim),
        ),
        (k("attention.value_length"), u(mla.kv_lora_rank)),
        (
            k("attention.key_length_mla"),
            u(mla.qk_nope_head_dim + mla.qk_rope_head_dim),
        ),
        (k("attention.value_length_mla"), u(mla.v_head_dim)),
        (
            k("expert_feed_forward_length"),
            u(moe.map_or(cfg.ffn_hidden, |m| m.expert_hidden)),
        ),
        (
            k("expert_shared_count"),
            u(moe.map_or(0, |m| m.num_shared_experts)),
        ),
        (
            k("leading_dense_block_count"),
            u(moe.map_or(cfg.n_layers, |m| m.first_dense_layers)),
        ),
        (
            k("expert_weights_scale"),
            Value::F32(moe.map_or(1.0, |m| m.routed_scaling_factor) as f32),
        ),
        (k("expert_gating_func"), u(2)), // sigmoid, as Kimi's router
    ];
    if let Some(m) = moe {
        metadata.extend([
            (k("expert_count"), u(m.num_experts)),
            (k("expert_used_count"), u(m.top_k)),
        ]);
    }
    if arch == GgufArch::Deepseek2 {
        metadata.extend(nope_as_rope().map(|(key, v)| (k(key), v)));
        metadata.extend([
            // Required (0: no q-LoRA); Kimi's router renormalises its top-k weights, which
            // kimi-linear's graph does unasked.
            (k("attention.q_lora_rank"), u(mla.q_lora_rank.unwrap_or(0))),
            (k("expert_weights_norm"), Value::Bool(true)),
        ]);
    } else {
        metadata.extend([
            (k("ssm.conv_kernel"), u(kda.conv_kernel)),
            (k("kda.head_dim"), u(kda.head_dim)),
        ]);
    }
    if arch == GgufArch::KimiK3 {
        let (beta, linear_beta) = match cfg.activation {
            Activation::Situ => (SITU_BETA as f32, SITU_LINEAR_BETA as f32),
            Activation::Swiglu => SWIGLU_AS_SITU,
        };
        metadata.extend([
            // llama.cpp counts AttnRes blocks in layers, k3mini in sub-layers; 0 = off.
            (
                k("attn_res.block_size"),
                u(cfg.attn_res.as_ref().map_or(0, |a| a.block_size / 2)),
            ),
            (k("activation.situ_beta"), Value::F32(beta)),
            (k("activation.situ_linear_beta"), Value::F32(linear_beta)),
            (k("expert_weights_norm"), Value::Bool(true)),
        ]);
        if let Some(r) = mla.q_lora_rank {
            metadata.push((k("attention.q_lora_rank"), u(r)));
        }
        if let Some(lb) = kda.gate_lower_bound {
            metadata.push((k("kda.gate_lower_bound"), Value::F32(lb as f32)));
        }
        if let Some(l) = moe.and_then(|m| m.latent_dim) {
            metadata.push((k("expert_latent_length"), u(l)));
        }
    }
    metadata
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3mini_student::presets::{tiny, transformer_twin};

    /// deepseek2's attention scale under [`nope_as_rope`], in llama.cpp's own f32 arithmetic
    /// (llama-model.cpp's `1/factor`, llama-context.cpp's linear scaling with `ext_factor = 0`,
    /// deepseek2.cpp's `attn_factor_org`, `mscale` and the loader's `/ 0.1`).
    #[test]
    fn nope_as_rope_leaves_q_k_unscaled_and_every_angle_below_f32_rounding() {
        let keys = nope_as_rope();
        let f32_of = |key: &str| match keys.iter().find(|(k, _)| *k == key).map(|(_, v)| v) {
            Some(Value::F32(x)) => *x,
            other => panic!("{key}: {other:?}"),
        };
        let freq_scale = 1.0f32 / f32_of("rope.scaling.factor");
        let log_mul = f32_of("rope.scaling.yarn_log_multiplier") / 0.1f32;
        let attn_factor = 1.0f32; // yarn_attn_factor · rope_attn_factor, both unset
        let ln = (1.0f32 / freq_scale).ln();
        let attn_factor_org = attn_factor * (1.0 + 0.1 * ln);
        let mscale = attn_factor_org * (1.0 + 0.1 * log_mul * ln);
        assert!(
            (mscale * mscale - 1.0).abs() <= 2.0 * f32::EPSILON,
            "mscale {mscale}"
        );
        // θ_i ≤ 1 (i = 0), positions below 2^31: every angle under 2^-25 rad.
        assert!(2f32.powi(31) * freq_scale <= 2f32.powi(-25));
        assert!(matches!(&keys[0].1, Value::String(s) if s == "linear"));
    }

    #[test]
    fn a_twin_maps_to_deepseek2_whatever_its_kda_settings_and_the_hybrid_does_not() {
        assert_eq!(GgufArch::for_config(&tiny()), GgufArch::KimiLinear);
        let mut twin = transformer_twin(&tiny());
        assert_eq!(GgufArch::for_config(&twin), GgufArch::Deepseek2);
        twin.kda.gate_lower_bound = Some(-5.0);
        twin.kda.gate_rank = None;
        assert_eq!(GgufArch::for_config(&twin), GgufArch::Deepseek2);
        twin.mla.qk_rope_head_dim = 15;
        assert_eq!(twin_gap(&twin).map(|g| g.0), Some("mla.qk_rope_head_dim"));
        twin.mla.qk_rope_head_dim = 16;
        twin.mla.q_lora_rank = Some(32);
        twin.n_layers = 27;
        assert_eq!(twin_gap(&twin).map(|g| g.0), Some("mla.q_lora_rank"));
        twin.n_layers = 28;
        assert_eq!(GgufArch::for_config(&twin), GgufArch::Deepseek2);
        twin.mla.output_gate = true;
        assert_eq!(GgufArch::for_config(&twin), GgufArch::KimiK3);
    }
}
