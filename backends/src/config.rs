//! The model configuration: the fields of Hugging Face's `Qwen3Config` that the architecture needs.
//!
//! `config.json` is parsed field by field (not with a derive) so that every error names the field,
//! so that both places `rope_theta` lives in (top level, Hub style, or under `rope_parameters`,
//! newer transformers) are read, and so that unsupported variants (attention bias, another
//! activation, sliding windows) are refused instead of silently computing something else.

use serde_json::{Map, Value, json};

use crate::error::{BackendError, Result};

/// Shape and numerics of a Qwen3 model (Hugging Face `config.json` field names).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Vocabulary size (rows of the embedding and of `lm_head`).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (grouped-query attention); divides `num_attention_heads`.
    pub num_key_value_heads: usize,
    /// Width of one head; its own value in Qwen3, not `hidden_size / heads`.
    pub head_dim: usize,
    /// Epsilon inside every RMSNorm.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Whether `lm_head` shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Longest sequence (prompt + response) the model accepts.
    pub max_position_embeddings: usize,
    /// Beginning-of-sequence token, if the tokenizer has one.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token, if any (the first one where config.json lists several).
    pub eos_token_id: Option<u32>,
}

impl ModelConfig {
    /// The default small model of RolloutPipe's CPU runs and benchmarks.
    ///
    /// Vocabulary 64 (room for the built-in character tokenizer), hidden 128, 4 layers, 4 query
    /// heads and 2 key/value heads (so grouped-query attention is exercised) of width 32, MLP 384,
    /// tied embeddings, 512 positions: about 0.8 M parameters, small enough to train with GRPO on
    /// two CPU cores in minutes, large enough to learn multi-digit arithmetic.
    pub fn small() -> Self {
        Self {
            vocab_size: 64,
            hidden_size: 128,
            intermediate_size: 384,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 32,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            tie_word_embeddings: true,
            max_position_embeddings: 512,
            bos_token_id: None,
            eos_token_id: None,
        }
    }

    /// Qwen3-0.6B's shape (its Hub `config.json`): vocabulary 151,936, hidden 1,024, MLP
    /// 3,072, 28 layers, 16 query and 8 key/value heads of 128, tied embeddings, RoPE θ 10⁶,
    /// 40,960 positions. The shape only: no special tokens, for random-weight tests and
    /// benchmarks at real size.
    pub fn qwen3_0_6b() -> Self {
        Self::qwen3_shape(1024, 3072)
    }

    /// Qwen3-1.7B's shape: as [`ModelConfig::qwen3_0_6b`] with hidden 2,048 and MLP 6,144.
    pub fn qwen3_1_7b() -> Self {
        Self::qwen3_shape(2048, 6144)
    }

    fn qwen3_shape(hidden: usize, mlp: usize) -> Self {
        Self {
            vocab_size: 151_936,
            hidden_size: hidden,
            intermediate_size: mlp,
            num_hidden_layers: 28,
            num_attention_heads: 16,
            num_key_value_heads: 8,
            head_dim: 128,
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            tie_word_embeddings: true,
            max_position_embeddings: 40_960,
            bos_token_id: None,
            eos_token_id: None,
        }
    }

    /// A very small model for tests: every feature (GQA, two layers) at a size where f64
    /// finite-difference checks over all parameters take milliseconds.
    pub fn tiny() -> Self {
        Self {
            vocab_size: 11,
            hidden_size: 8,
            intermediate_size: 12,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 4,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            tie_word_embeddings: false,
            max_position_embeddings: 64,
            bos_token_id: None,
            eos_token_id: None,
        }
    }

    /// Width of the query projection output (`heads × head_dim`).
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Width of the key/value projection outputs (`kv_heads × head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Checks every invariant the model code relies on.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(BackendError::config(field, "must be positive"));
            }
        }
        if self.vocab_size > u32::MAX as usize {
            return Err(BackendError::config(
                "vocab_size",
                "must fit in u32 token ids",
            ));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(BackendError::config(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(BackendError::config(
                "head_dim",
                format!("{} is odd; rotate-half RoPE needs pairs", self.head_dim),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(BackendError::config(
                "rms_norm_eps",
                format!("{} is not a positive finite number", self.rms_norm_eps),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(BackendError::config(
                "rope_theta",
                format!("{} is not a positive finite number", self.rope_theta),
            ));
        }
        for (field, id) in [
            ("bos_token_id", self.bos_token_id),
            ("eos_token_id", self.eos_token_id),
        ] {
            if let Some(id) = id
                && id as usize >= self.vocab_size
            {
                return Err(BackendError::config(
                    field,
                    format!("{id} is not below vocab_size {}", self.vocab_size),
                ));
            }
        }
        Ok(())
    }

    /// Parses and validates the text of a Hugging Face `config.json`.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| BackendError::config("config.json", format!("not valid JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| BackendError::config("config.json", "top level is not an object"))?;
        Self::from_json_map(obj)
    }

    fn from_json_map(obj: &Map<String, Value>) -> Result<Self> {
        if let Some(mt) = obj.get("model_type").and_then(Value::as_str)
            && mt != "qwen3"
        {
            return Err(BackendError::config(
                "model_type",
                format!("`{mt}` is not supported (only qwen3)"),
            ));
        }
        if let Some(act) = obj.get("hidden_act").and_then(Value::as_str)
            && act != "silu"
        {
            return Err(BackendError::config(
                "hidden_act",
                format!("`{act}` is not supported (only silu)"),
            ));
        }
        if obj.get("attention_bias").and_then(Value::as_bool) == Some(true) {
            return Err(BackendError::config(
                "attention_bias",
                "true is not supported (Qwen3 projections have no bias)",
            ));
        }
        if obj.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
            return Err(BackendError::config(
                "use_sliding_window",
                "sliding-window attention is not supported",
            ));
        }
        let num_attention_heads = req_usize(obj, "num_attention_heads")?;
        let hidden_size = req_usize(obj, "hidden_size")?;
        let cfg = Self {
            vocab_size: req_usize(obj, "vocab_size")?,
            hidden_size,
            intermediate_size: req_usize(obj, "intermediate_size")?,
            num_hidden_layers: req_usize(obj, "num_hidden_layers")?,
            num_attention_heads,
            // transformers' Qwen3Config falls back to multi-head attention when absent.
            num_key_value_heads: opt_usize(obj, "num_key_value_heads")?
                .unwrap_or(num_attention_heads),
            // Qwen3Config's own default is 128; configs written by transformers always carry it.
            head_dim: opt_usize(obj, "head_dim")?.unwrap_or(128),
            rms_norm_eps: opt_f64(obj, "rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta: rope_theta(obj)?,
            tie_word_embeddings: match obj.get("tie_word_embeddings") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(other) => {
                    return Err(BackendError::config(
                        "tie_word_embeddings",
                        format!("expected a boolean, got {other}"),
                    ));
                }
            },
            max_position_embeddings: opt_usize(obj, "max_position_embeddings")?.unwrap_or(32_768),
            bos_token_id: token_id(obj, "bos_token_id")?,
            eos_token_id: token_id(obj, "eos_token_id")?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The configuration as a Hugging Face `config.json` document (loadable by transformers'
    /// `Qwen3ForCausalLM.from_pretrained`).
    pub fn to_json(&self) -> Value {
        json!({
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "torch_dtype": "float32",
            "hidden_act": "silu",
            "attention_bias": false,
            "attention_dropout": 0.0,
            "use_sliding_window": false,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        })
    }

    /// Number of parameters (the embedding counted once when tied).
    pub fn num_parameters(&self) -> usize {
        crate::weights::param_specs(self)
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }
}

fn req_usize(obj: &Map<String, Value>, field: &str) -> Result<usize> {
    opt_usize(obj, field)?.ok_or_else(|| BackendError::config(field, "missing"))
}

fn opt_usize(obj: &Map<String, Value>, field: &str) -> Result<Option<usize>> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|x| usize::try_from(x).ok())
            .map(Some)
            .ok_or_else(|| {
                BackendError::config(field, format!("expected a non-negative integer, got {v}"))
            }),
    }
}

fn opt_f64(obj: &Map<String, Value>, field: &str) -> Result<Option<f64>> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| BackendError::config(field, format!("expected a number, got {v}"))),
    }
}

fn rope_theta(obj: &Map<String, Value>) -> Result<f64> {
    if let Some(t) = opt_f64(obj, "rope_theta")? {
        return Ok(t);
    }
    if let Some(rp) = obj.get("rope_parameters").filter(|v| !v.is_null()) {
        let rp = rp.as_object().ok_or_else(|| {
            BackendError::config("rope_parameters", format!("expected an object, got {rp}"))
        })?;
        if let Some(kind) = rp.get("rope_type").and_then(Value::as_str)
            && kind != "default"
        {
            return Err(BackendError::config(
                "rope_parameters.rope_type",
                format!("`{kind}` scaling is not supported (only default)"),
            ));
        }
        if let Some(t) = opt_f64(rp, "rope_theta")? {
            return Ok(t);
        }
    }
    // Qwen3Config's default.
    Ok(10_000.0)
}

fn token_id(obj: &Map<String, Value>, field: &str) -> Result<Option<u32>> {
    let as_id = |v: &Value| {
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| BackendError::config(field, format!("expected a token id, got {v}")))
    };
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(ids)) => ids.first().map(as_id).transpose(),
        Some(v) => as_id(v).map(Some),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trip_keeps_every_field() {
        let mut cfg = ModelConfig::small();
        cfg.eos_token_id = Some(3);
        let back = ModelConfig::from_json_str(&cfg.to_json().to_string()).unwrap();
        assert_eq!(back, cfg);
    }

    #[test]
    fn rope_theta_under_rope_parameters_and_eos_list() {
        let text = r#"{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "eos_token_id": [7, 8]}"#;
        let cfg = ModelConfig::from_json_str(text).unwrap();
        assert_eq!(cfg.rope_theta, 1e6);
        assert_eq!(cfg.eos_token_id, Some(7));
        assert!(!cfg.tie_word_embeddings);
        assert_eq!(cfg.max_position_embeddings, 32_768);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (r#"{"hidden_size": 8}"#, "num_attention_heads"),
            (
                r#"{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                "num_hidden_layers": 1, "num_attention_heads": 3, "num_key_value_heads": 2,
                "head_dim": 4}"#,
                "num_key_value_heads",
            ),
            (
                r#"{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 3}"#,
                "head_dim",
            ),
            (
                r#"{"vocab_size": -1, "hidden_size": 8, "intermediate_size": 16,
                "num_hidden_layers": 1, "num_attention_heads": 2}"#,
                "vocab_size",
            ),
            (
                r#"{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                "num_hidden_layers": 1, "num_attention_heads": 2, "attention_bias": true}"#,
                "attention_bias",
            ),
            (
                r#"{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 4,
                "eos_token_id": 10}"#,
                "eos_token_id",
            ),
        ];
        for (text, field) in cases {
            match ModelConfig::from_json_str(text) {
                Err(BackendError::Config { field: f, .. }) => assert_eq!(f, field, "{text}"),
                other => panic!("{text}: expected a Config error on {field}, got {other:?}"),
            }
        }
    }

    #[test]
    fn small_model_size_is_as_documented() {
        let n = ModelConfig::small().num_parameters();
        // embed 64·128 + 4 layers × (q 128·128 + k,v 2·64·128 + o 128·128 + mlp 3·384·128
        // + norms 2·128 + 2·32) + final norm 128
        assert_eq!(
            n,
            8192 + 4 * (16384 + 16384 + 16384 + 147456 + 256 + 64) + 128
        );
    }
}
