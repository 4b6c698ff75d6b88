//! One end-to-end pass of the wgpu backend at a model shape, timed phase by phase, for
//! before/after comparisons across commits (`scripts/bench/wgpu_ab.sh` copies this file into
//! a worktree of the older commit, so it uses only the API both sides share: `Gpu::new`,
//! `WgpuBackend::with_gpu`, the `Policy` calls).
//!
//! ```text
//! cargo run --profile dev -p rolloutpipe-backends --features wgpu --example wgpu_e2e_ab -- 0.6b
//! ```
//!
//! Prints one `phase <name> <seconds> <tokens>` line per phase (or `phase <name> failed
//! <reason>`): `build` (weights to the device), `warmup` (untimed in the comparison's sense:
//! one request of 1 + 1 tokens and a 1 + 1-token forward and backward, so that every kernel
//! is compiled before the timed phases), `generate` (4 requests of 16-token prompts,
//! 8 new tokens each, prefill included; tokens = generated tokens), `accumulate` (forward and
//! backward of 2 sequences of 16 + 16 tokens) and `optimizer_step` (the AdamW step over every
//! parameter, its kernels' first call included). Each phase runs once: at a 0.6B shape on a
//! CPU adapter one iteration takes minutes.
//! Random weights (seed 0); the shape is `small` (the default model) or `0.6b`.

#[cfg(feature = "wgpu")]
fn main() {
    use std::sync::Arc;
    use std::time::Instant;

    use rolloutpipe_backends::wgpu::{Gpu, WgpuBackend};
    use rolloutpipe_backends::*;

    let shape = std::env::args().nth(1).unwrap_or_else(|| "0.6b".into());
    let cfg = match shape.as_str() {
        "small" => ModelConfig::small(),
        // Qwen3-0.6B's shape, written out: the older side has no named constructor.
        "0.6b" => ModelConfig {
            vocab_size: 151_936,
            hidden_size: 1024,
            intermediate_size: 3072,
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
        },
        other => {
            eprintln!("error: shape {other:?} is not `small` or `0.6b`");
            std::process::exit(2);
        }
    };
    let gpu: Arc<Gpu> = match Gpu::new() {
        Ok(Some(g)) => g,
        Ok(None) => {
            eprintln!("error: no wgpu adapter found");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("error: opening the wgpu adapter: {e}");
            std::process::exit(1);
        }
    };
    let vocab = cfg.vocab_size;
    // A failure's reason on the phase's one line, whatever whitespace the driver's had.
    let line = |e: &dyn std::fmt::Display| {
        e.to_string()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    let w = Weights::random(&cfg, 0).expect("random weights");
    let t = Instant::now();
    let mut be = match WgpuBackend::with_gpu(gpu, &cfg, &w) {
        Ok(b) => b,
        Err(e) => {
            println!("phase build failed {}", line(&e));
            return;
        }
    };
    drop(w);
    println!("phase build {:.3} 0", t.elapsed().as_secs_f64());

    // Generate `requests` × (`prompt_len` + `new`); the generated token count.
    let generate =
        |be: &mut WgpuBackend, requests: usize, prompt_len: usize, new: usize, first: u64| {
            for i in 0..requests {
                let prompt = (0..prompt_len)
                    .map(|t| ((t * 7 + i) % vocab) as u32)
                    .collect();
                let params = SamplingParams {
                    max_new_tokens: new,
                    seed: first + i as u64,
                    ..Default::default()
                };
                be.add_request(GenRequest {
                    id: RequestKey(first + i as u64),
                    prompt,
                    params,
                })?;
            }
            let mut tokens = 0;
            while be.active_requests() > 0 {
                for o in be.decode_step()? {
                    tokens += o.tokens.len();
                }
            }
            Ok::<usize, BackendError>(tokens)
        };
    // Forward and backward of `seqs` × (`p_len` + `r_len`).
    let batch = |seqs: usize, p_len: usize, r_len: usize| TrainBatch {
        sequences: (0..seqs)
            .map(|s| {
                let p = (0..p_len).map(|t| ((t * 5 + s) % vocab) as u32).collect();
                let r = (0..r_len)
                    .map(|t| ((t * 3 + 2 * s) % vocab) as u32)
                    .collect();
                let adv = if s % 2 == 0 { 1.0 } else { -1.0 };
                TrainSequence::new(p, r, adv, Aggregation::TokenMean)
            })
            .collect(),
    };
    let accumulate = |be: &mut WgpuBackend, b: &TrainBatch| {
        be.zero_grad()?;
        be.accumulate(b, &Objective::default())
    };

    // Warm-up, untimed: every generate and train kernel compiled once, at 1 token each.
    let t = Instant::now();
    let warm = generate(&mut be, 1, 1, 1, 1_000)
        .and_then(|_| accumulate(&mut be, &batch(1, 1, 1)).map(|_| ()));
    match warm {
        Ok(()) => println!("phase warmup {:.3} 0", t.elapsed().as_secs_f64()),
        Err(e) => println!("phase warmup failed {}", line(&e)),
    }

    // Generate: 4 requests × (16 + 8).
    let t = Instant::now();
    match generate(&mut be, 4, 16, 8, 1) {
        Ok(n) => println!("phase generate {:.3} {n}", t.elapsed().as_secs_f64()),
        Err(e) => println!("phase generate failed {}", line(&e)),
    }

    // Train: 2 sequences × (16 + 16), one GRPO step.
    let b = batch(2, 16, 16);
    let norm = normalizer(Aggregation::TokenMean, std::slice::from_ref(&b));
    let opt = AdamW {
        lr: 1e-4,
        ..Default::default()
    };
    let t = Instant::now();
    match accumulate(&mut be, &b) {
        Ok(_) => println!(
            "phase accumulate {:.3} {}",
            t.elapsed().as_secs_f64(),
            2 * 32
        ),
        Err(e) => {
            println!("phase accumulate failed {}", line(&e));
            return;
        }
    }
    let t = Instant::now();
    match be.optimizer_step(norm, &opt) {
        Ok(_) => println!("phase optimizer_step {:.3} 0", t.elapsed().as_secs_f64()),
        Err(e) => println!("phase optimizer_step failed {}", line(&e)),
    }
}

#[cfg(not(feature = "wgpu"))]
fn main() {
    eprintln!("error: built without the wgpu feature (add --features wgpu)");
    std::process::exit(2);
}
