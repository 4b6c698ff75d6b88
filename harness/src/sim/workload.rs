//! Synthetic prompts: per-prompt pass rates and long-tailed response lengths.
//!
//! A group's responses are a pure function of (seed, setting, step, draw index), so every mode
//! of a setting sees exactly the same samples and differs only in how it schedules them.
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Beta, Distribution, LogNormal};

use super::config::{Profile, Setting};

/// One response as the engines will produce it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleDraw {
    /// Generated tokens (1..=cap).
    pub response_tokens: u32,
    /// Verifier reward: 1 for a correct answer, 0 otherwise.
    pub reward: f32,
}

/// One prompt and its G responses.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupDraw {
    /// The prompt's pass rate p.
    pub pass_rate: f64,
    /// Prompt length, tokens.
    pub prompt_tokens: u32,
    /// The responses, by sample index.
    pub samples: Vec<SampleDraw>,
}

impl GroupDraw {
    /// Whether the group is filtered for zero reward variance (all right or all wrong).
    pub fn zero_variance(&self) -> bool {
        self.samples.windows(2).all(|w| w[0].reward == w[1].reward)
    }

    /// Prompt plus response tokens over all samples (what the trainer processes).
    pub fn train_tokens(&self) -> u64 {
        self.samples
            .iter()
            .map(|s| u64::from(self.prompt_tokens) + u64::from(s.response_tokens))
            .sum()
    }
}

/// The distributions of one (profile, setting) at one training progress.
#[derive(Debug, Clone)]
pub struct Workload {
    seed: u64,
    prompt_tokens: u32,
    cap: u32,
    group: u32,
    runaway: f64,
    alternate: bool,
    beta: Beta<f64>,
    right: LogNormal<f64>,
    wrong: LogNormal<f64>,
}

/// SplitMix64 finalizer: decorrelates the seeds of neighbouring (step, group) pairs.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A stable 64-bit hash of a name (FNV-1a), for seeding per setting.
pub fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

impl Workload {
    /// The workload of `profile` x `setting` at `progress` in [0, 1] (0 = start, 1 = late).
    pub fn new(
        seed: u64,
        profile: &Profile,
        setting: &Setting,
        progress: f64,
    ) -> anyhow::Result<Self> {
        let progress = progress.clamp(0.0, 1.0);
        let lerp = |a: f64, b: f64| a + (b - a) * progress;
        let mean = lerp(profile.mean_tokens_start, profile.mean_tokens_late);
        let acc = lerp(profile.acc_start, profile.acc_late);
        // Keep the overall mean: mean = m_right * (acc + (1 - acc) * f).
        let f = profile.wrong_length_factor;
        let m_right = mean / (acc + (1.0 - acc) * f);
        let sigma = profile.sigma;
        // A lognormal with mean m has mu = ln m - sigma^2 / 2.
        let lognormal = |m: f64| {
            LogNormal::new(m.ln() - sigma * sigma / 2.0, sigma)
                .map_err(|e| anyhow::anyhow!("lognormal(mean {m}, sigma {sigma}): {e}"))
        };
        let beta = Beta::new(acc * profile.beta_k, (1.0 - acc) * profile.beta_k)
            .map_err(|e| anyhow::anyhow!("Beta(acc {acc}, k {}): {e}", profile.beta_k))?;
        Ok(Self {
            seed,
            prompt_tokens: profile.prompt_tokens,
            cap: setting.cap,
            group: setting.group,
            runaway: profile.runaway,
            alternate: profile.alternate_rewards,
            beta,
            right: lognormal(m_right)?,
            wrong: lognormal(m_right * f)?,
        })
    }

    /// Draws `n` responses per prompt instead of the setting's G: room for the extra samples of
    /// an allocation policy. Responses are drawn in sample order from one stream, so the first G
    /// are the same whatever `n`.
    pub fn with_samples(mut self, n: u32) -> Self {
        self.group = n;
        self
    }

    /// The `index`-th prompt drawn in `step` (deterministic).
    pub fn group(&self, step: u64, index: u64) -> GroupDraw {
        let mut rng = ChaCha8Rng::seed_from_u64(mix(self.seed ^ mix(step ^ mix(index))));
        let p: f64 = self.beta.sample(&mut rng);
        let samples = (0..self.group)
            .map(|i| {
                let drawn = rng.random_bool(p.clamp(0.0, 1.0));
                let correct = if self.alternate { i % 2 == 0 } else { drawn };
                let runaway = rng.random_bool(self.runaway);
                let len = if runaway {
                    f64::from(self.cap)
                } else if correct {
                    self.right.sample(&mut rng)
                } else {
                    self.wrong.sample(&mut rng)
                };
                // Truncation at the cap is the engine's max_new_tokens; a cap-hit is unfinished, so
                // its answer cannot be verified correct.
                let tokens = len.round().clamp(1.0, f64::from(self.cap)) as u32;
                let reward = if correct && !runaway && tokens < self.cap {
                    1.0
                } else {
                    0.0
                };
                SampleDraw {
                    response_tokens: tokens,
                    reward,
                }
            })
            .collect();
        GroupDraw {
            pass_rate: p,
            prompt_tokens: self.prompt_tokens,
            samples,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::config::SimConfig;

    fn workload(profile: &str, setting: &str, progress: f64) -> Workload {
        let c = SimConfig::defaults().unwrap();
        Workload::new(7, &c.profile[profile], &c.setting[setting], progress).unwrap()
    }

    #[test]
    fn draws_are_deterministic_and_distinct() {
        let w = workload("math", "R2", 0.0);
        assert_eq!(w.group(3, 5), w.group(3, 5));
        assert_ne!(w.group(3, 5), w.group(3, 6));
        assert_ne!(w.group(3, 5), w.group(4, 5));
    }

    #[test]
    fn lengths_and_pass_rates_match_the_profile() {
        // Competition math late: mean 2500 tokens, acc 0.45, cap 8192 truncates the tail.
        let w = workload("math", "R2", 1.0);
        let groups: Vec<_> = (0..2000).map(|i| w.group(0, i)).collect();
        let n = groups.len() as f64 * 8.0;
        let mean_len = groups
            .iter()
            .flat_map(|g| &g.samples)
            .map(|s| f64::from(s.response_tokens))
            .sum::<f64>()
            / n;
        let acc = groups
            .iter()
            .flat_map(|g| &g.samples)
            .map(|s| f64::from(s.reward))
            .sum::<f64>()
            / n;
        let capped = groups
            .iter()
            .flat_map(|g| &g.samples)
            .filter(|s| s.response_tokens == 8192)
            .count() as f64
            / n;
        // Truncation at the cap lowers the mean below 2500; runaways add 1% at the cap.
        assert!((2000.0..2600.0).contains(&mean_len), "mean {mean_len}");
        // Runaways and cap-hits are wrong, so accuracy sits a little under 0.45.
        assert!((0.38..0.46).contains(&acc), "acc {acc}");
        assert!((0.02..0.09).contains(&capped), "cap share {capped}");
        // Filtered share (all right or all wrong) near CALIBRATION's 11% + 18% for n = 8.
        let filtered =
            groups.iter().filter(|g| g.zero_variance()).count() as f64 / groups.len() as f64;
        assert!((0.2..0.4).contains(&filtered), "filtered {filtered}");
    }
}
