//! Our side of `scripts/bench/vs_torch.sh`: one workload on a model directory, timed from model
//! loaded to result, printed as one JSON line (the script adds whole-process time and peak RSS
//! from `/usr/bin/time -v`, and runs `scripts/bench/vs_torch.py` for PyTorch's side).
//!
//! Run: `cargo bench -p rolloutpipe-backends --no-default-features --bench vs_torch --
//! (grpo|logits|generate) MODEL_DIR`. The workloads (token ids, rewards, settings) are the same
//! seeded ones `vs_torch.py` builds, so both sides do the same work:
//! - `grpo`: one GRPO step on 2 groups × 4 responses × 48 tokens after 16-token prompts (β = 0.04,
//!   ε = 0.2, token-mean; old and reference log-probs are the current weights', detached, as for
//!   the first step of a rollout), then one AdamW step;
//! - `logits`: the full logits of 64 tokens;
//! - `generate`: 16 requests of 16-token prompts × 64 new tokens, greedy, no stop token.
//!
//! The model directory is memory-mapped (`CpuBackend::from_model_dir`); `grpo` trains f32
//! master weights, `logits` and `generate` run a bf16-storage engine (`--f32-engine`: f32).

use std::path::PathBuf;
use std::time::Instant;

use rolloutpipe_backends::cpu::ops::SamplingParams;
use rolloutpipe_backends::optim::AdamW;
use rolloutpipe_backends::*;

/// The token ids both sides use: a 64-bit LCG (Knuth's MMIX constants), top bits mod vocab.
fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// This process's resident set now and at its peak (`VmRSS`, `VmHWM` of /proc/self/status), GiB;
/// zeros where /proc is unavailable.
fn rss() -> (f64, f64) {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = |key: &str| {
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
            / (1024.0 * 1024.0)
    };
    (kb("VmRSS:"), kb("VmHWM:"))
}

/// `"name":[rss, peak]` for the JSON line.
fn phase(name: &str) -> String {
    let (now, peak) = rss();
    format!("\"{name}\":[{now:.3},{peak:.3}]")
}

fn main() {
    if let Err(e) = run() {
        eprintln!("vs_torch: {e}");
        std::process::exit(1);
    }
}

fn run() -> std::result::Result<(), String> {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    if std::env::args().any(|a| a == "--list") {
        return Ok(()); // `cargo bench -- --list` probes every bench binary
    }
    let [task, dir] = &args[..] else {
        return Err("usage: vs_torch (grpo|logits|generate) MODEL_DIR".into());
    };
    // The trainer keeps f32 master weights; the inference workloads run an engine, which
    // stores the checkpoint's bf16 weights as they are (`--f32-engine`: widened to f32). Both
    // compute in f32 on the same values, so the results are identical.
    let dtype = if task == "grpo" || std::env::args().any(|a| a == "--f32-engine") {
        DType::F32
    } else {
        DType::Bf16
    };
    let t0 = Instant::now();
    let mut be = CpuBackend::from_model_dir(&PathBuf::from(dir), 0, dtype)
        .map_err(|e| format!("{dir}: {e}"))?;
    let cfg = be.config().clone();
    let load_s = t0.elapsed().as_secs_f64();
    // Resident GiB [now, peak so far] after each phase: where the memory goes.
    let mut phases = vec![phase("loaded")];
    let v = cfg.vocab_size;
    let t1 = Instant::now();
    let detail = match task.as_str() {
        "grpo" => {
            let rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0];
            let mut seqs = Vec::new();
            for g in 0..2 {
                let adv = advantages(&rewards[g * 4..g * 4 + 4], StdMode::Sample)
                    .map_err(|e| e.to_string())?;
                let prompt = tokens(100 + g as u64, 16, v);
                for (i, a) in adv.iter().enumerate() {
                    let resp = tokens(200 + (g * 4 + i) as u64, 48, v);
                    seqs.push(TrainSequence::new(
                        prompt.clone(),
                        resp,
                        *a,
                        Aggregation::TokenMean,
                    ));
                }
            }
            let batch = TrainBatch { sequences: seqs };
            let obj = Objective::Grpo {
                eps_low: 0.2,
                eps_high: 0.2,
                beta: 0.04,
                temperature: 1.0,
            };
            let norm = normalizer(Aggregation::TokenMean, std::slice::from_ref(&batch));
            // VS_TORCH_STEPS=N repeats the step on the same batch (as vs_torch.py does): step 1
            // touches the gradient sums and moments for the first time, later steps show the
            // steady state.
            let steps: usize = std::env::var("VS_TORCH_STEPS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(1);
            let mut step_s = Vec::new();
            let mut last = None;
            for s in 0..steps.max(1) {
                let ts = Instant::now();
                be.zero_grad().map_err(|e| e.to_string())?;
                let st = be.accumulate(&batch, &obj).map_err(|e| e.to_string())?;
                if s == 0 {
                    phases.push(phase("accumulated"));
                }
                let os = be
                    .optimizer_step(norm, &AdamW::default())
                    .map_err(|e| e.to_string())?;
                step_s.push(ts.elapsed().as_secs_f64());
                if s == 0 {
                    phases.push(phase("stepped"));
                }
                last = Some((st, os));
            }
            let (st, os) = last.expect("at least one step");
            format!(
                "\"loss\":{},\"entropy\":{},\"grad_norm\":{},\"step_s\":{:?}",
                st.loss_sum / norm,
                st.entropy_sum / st.tokens as f64,
                os.grad_norm,
                step_s
            )
        }
        "logits" => {
            let z = be.logits(&tokens(7, 64, v)).map_err(|e| e.to_string())?;
            let s: f64 = z.iter().map(|x| *x as f64).sum();
            format!("\"logits_sum\":{s}")
        }
        "generate" => {
            for r in 0..16u64 {
                be.add_request(GenRequest {
                    id: RequestKey(r),
                    prompt: tokens(300 + r, 16, v),
                    params: SamplingParams {
                        temperature: 0.0,
                        max_new_tokens: 64,
                        ..Default::default()
                    },
                })
                .map_err(|e| e.to_string())?;
            }
            let mut out = Vec::new();
            while be.active_requests() > 0 {
                out.extend(be.decode_step().map_err(|e| e.to_string())?);
            }
            out.sort_by_key(|o| o.id.0);
            let n: usize = out.iter().map(|o| o.tokens.len()).sum();
            let secs = t1.elapsed().as_secs_f64();
            format!(
                "\"new_tokens\":{n},\"tok_per_s\":{},\"first\":{:?}",
                n as f64 / secs,
                &out[0].tokens[..8]
            )
        }
        other => return Err(format!("unknown task {other:?} (grpo, logits, generate)")),
    };
    let run_s = t1.elapsed().as_secs_f64();
    phases.push(phase("done"));
    println!(
        "{{\"side\":\"ours\",\"task\":\"{task}\",\"weights\":\"{dtype}\",\"load_s\":{load_s},\"run_s\":{run_s},{detail},\"rss_gib\":{{{}}}}}",
        phases.join(",")
    );
    Ok(())
}
