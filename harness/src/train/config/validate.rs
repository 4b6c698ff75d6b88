//! [`TrainConfig::validate`]: values and combinations that cannot work are refused before
//! anything runs, in one line that names the key and says why. The checks run in a fixed
//! order, so that a config with several faults is refused for the same one every time.
use anyhow::ensure;

use super::{Mode, OldLogprobs, TrainConfig, WeightDType};
use crate::limits::{check_fits, check_model_fits, finite_nonneg, finite_positive};

impl TrainConfig {
    /// Refuses values and combinations that cannot work, saying why.
    pub fn validate(&self) -> anyhow::Result<()> {
        ensure!(self.run.steps > 0, "run.steps must be at least 1");
        self.check_numbers()?;
        self.check_sizes()?;
        self.check_workers()?;
        self.check_rl()?;
        self.check_draws_and_data()?;
        self.check_tail_policies()?;
        self.check_faults()?;
        let rl = &self.rl;
        self.alloc.allocator(rl.batch_groups, rl.group_size)?;
        self.plan()
            .validate()
            .map_err(|e| anyhow::anyhow!("rl/rollout settings: {e}"))?;
        Ok(())
    }

    /// The backend, the engines and the verifiers.
    fn check_workers(&self) -> anyhow::Result<()> {
        let (r, ro) = (&self.run, &self.rollout);
        ensure!(
            matches!(r.backend.as_str(), "cpu" | "wgpu" | "cuda"),
            "run.backend {:?} is not one of cpu, wgpu, cuda",
            r.backend
        );
        ensure!(
            ro.engines >= 1,
            "rollout.engines must be at least 1 (nothing would generate)"
        );
        ensure!(ro.slots >= 1, "rollout.slots must be at least 1");
        ensure!(ro.verifiers >= 1, "rollout.verifiers must be at least 1");
        Ok(())
    }

    /// The GRPO objective and sampling, and where `logπ_old` comes from.
    fn check_rl(&self) -> anyhow::Result<()> {
        let rl = &self.rl;
        ensure!(
            rl.group_size >= 2,
            "rl.group_size must be at least 2: GRPO advantages compare responses of one prompt"
        );
        ensure!(
            rl.temperature.is_finite() && rl.temperature > 0.0,
            "rl.temperature must be > 0: greedy rollouts make every group identical, so all would be filtered"
        );
        ensure!(
            (0.0..=1.0).contains(&rl.top_p) && rl.top_p > 0.0,
            "rl.top_p must be in (0, 1]"
        );
        ensure!(
            rl.max_new_tokens >= 1,
            "rl.max_new_tokens must be at least 1"
        );
        ensure!(
            rl.eps_low >= 0.0 && rl.eps_high >= 0.0,
            "rl.eps_low and rl.eps_high must be >= 0"
        );
        ensure!(rl.beta >= 0.0, "rl.beta must be >= 0");
        ensure!(
            !(rl.opt_steps > 1 && rl.old_logprobs == OldLogprobs::Recompute),
            "rl.opt_steps = {} with rl.old_logprobs = \"recompute\": after the first optimizer step \
             the trainer's weights are no longer v_k, so recomputed log-probs would not be the \
             rollout policy's; set rl.old_logprobs = \"rollout\"",
            rl.opt_steps
        );
        ensure!(
            !(self.run.mode == Mode::OneStepOff && rl.old_logprobs == OldLogprobs::Recompute),
            "run.mode = \"one-step-off\" with rl.old_logprobs = \"recompute\": the trainer holds \
             v_(k+1) while it trains samples from v_k, so logπ_old must come from the rollout; \
             set rl.old_logprobs = \"rollout\""
        );
        Ok(())
    }

    /// Over-sampling, the engines' weight storage, the warm start, the data and the threads.
    fn check_draws_and_data(&self) -> anyhow::Result<()> {
        let (r, ro) = (&self.run, &self.rollout);
        ensure!(
            ro.max_groups_factor.is_finite() && ro.max_groups_factor >= 1.0,
            "rollout.max_groups_factor must be >= 1 (a step must be able to draw B prompts)"
        );
        ensure!(
            (0.0..1.0).contains(&ro.expected_filter),
            "rollout.expected_filter must be in [0, 1)"
        );
        ensure!(
            ro.dtype == WeightDType::F32 || matches!(r.backend.as_str(), "cpu" | "wgpu"),
            "rollout.dtype {:?} needs run.backend = \"cpu\" or \"wgpu\": the {} backend stores f32 weights",
            ro.dtype.name(),
            r.backend
        );
        ensure!(
            self.sft.steps == 0 || (self.sft.batch > 0 && self.sft.lr > 0.0),
            "sft.batch and sft.lr must be positive when sft.steps > 0"
        );
        ensure!(
            self.task.heldout_per_mille > 0 && self.task.heldout_per_mille < 1000,
            "task.heldout_per_mille must be in 1..=999 (a held-out set and a training set are both needed)"
        );
        ensure!(r.eval_problems >= 1, "run.eval_problems must be at least 1");
        ensure!(
            (1..=1 << 20).contains(&self.task.train_pool),
            "task.train_pool is {}, must be within 1..=1048576",
            self.task.train_pool
        );
        ensure!(
            self.trainer.threads >= 1 && ro.threads_per_engine >= 1,
            "trainer.threads and rollout.threads_per_engine must be at least 1"
        );
        Ok(())
    }

    /// Tail multiplexing, the switches only the wgpu backend has, and long-tail migration.
    fn check_tail_policies(&self) -> anyhow::Result<()> {
        let (r, ro) = (&self.run, &self.rollout);
        if ro.multiplex {
            ensure!(
                self.rl.beta > 0.0,
                "rollout.multiplex needs rl.beta > 0: the KL reference pass is the only \
                 forward-only work the trainer has (old log-probs come from its training forward \
                 or from the rollout)"
            );
            ensure!(
                r.mode != Mode::OneStepOff,
                "rollout.multiplex needs an on-policy mode (sync, cgp or rolloutpipe): one-step-off \
                 buffers each micro-batch at dispatch, so no dispatched group waits for the trainer"
            );
        }
        for (on, key, why) in [
            (
                self.trainer.tensor_cores,
                "trainer.tensor_cores",
                "only the wgpu trainer has the cooperative-matrix path",
            ),
            (
                ro.lookahead,
                "rollout.lookahead",
                "only wgpu engines queue a step on the device behind the running one",
            ),
            (
                ro.tensor_cores,
                "rollout.tensor_cores",
                "only wgpu engines have the cooperative-matrix path",
            ),
        ] {
            ensure!(
                !on || r.backend == "wgpu",
                "{key} = true needs run.backend = \"wgpu\" (got {:?}): {why}",
                r.backend
            );
        }
        if ro.migrate {
            ensure!(
                matches!(r.backend.as_str(), "cpu" | "wgpu"),
                "rollout.migrate needs run.backend = \"cpu\" or \"wgpu\": the {} engine cannot export a running request's state",
                r.backend
            );
            ensure!(
                ro.engines >= 2,
                "rollout.migrate needs rollout.engines >= 2: requests move between engines"
            );
        }
        ensure!(
            ro.migrate_min_generated >= 1,
            "rollout.migrate_min_generated must be at least 1 (a request moves once it has generated a token)"
        );
        ensure!(
            (1..=ro.slots).contains(&ro.migrate_receiver_max),
            "rollout.migrate_receiver_max is {}, must be within 1..=rollout.slots ({})",
            ro.migrate_receiver_max,
            ro.slots
        );
        Ok(())
    }

    /// The test-only fault switches.
    fn check_faults(&self) -> anyhow::Result<()> {
        ensure!(
            !self.fault.perturb_mux || self.rollout.multiplex,
            "fault.perturb_mux needs rollout.multiplex = true"
        );
        if self.fault.fail_engine_at_request > 0 {
            ensure!(
                self.rollout.engines >= 2,
                "fault.fail_engine_at_request needs rollout.engines >= 2: with one engine nothing is left to re-admit the failed requests"
            );
        }
        Ok(())
    }

    /// Every float finite and in range, so a typo fails here and not after the warm start.
    fn check_numbers(&self) -> anyhow::Result<()> {
        let rl = &self.rl;
        finite_nonneg("rl.lr", rl.lr)?;
        finite_nonneg("rl.weight_decay", rl.weight_decay)?;
        finite_nonneg("rl.max_grad_norm", rl.max_grad_norm)?;
        finite_nonneg("rl.eps_low", rl.eps_low)?;
        finite_nonneg("rl.eps_high", rl.eps_high)?;
        finite_nonneg("rl.beta", rl.beta)?;
        finite_nonneg("task.format_penalty", f64::from(self.task.format_penalty))?;
        finite_nonneg("rollout.expected_filter", self.rollout.expected_filter)?;
        if self.sft.steps > 0 {
            finite_positive("sft.lr", self.sft.lr)?;
        }
        let drop = self.sft.carry_drop;
        ensure!(
            drop.is_finite() && (0.0..=1.0).contains(&drop),
            "sft.carry_drop = {drop} must be a probability in 0..=1"
        );
        ensure!(
            drop == 0.0 || (self.task.name == "add" && self.task.jsonl.as_os_str().is_empty()),
            "sft.carry_drop applies to the generated add task only (task.name = {:?}{})",
            self.task.name,
            if self.task.jsonl.as_os_str().is_empty() {
                ""
            } else {
                " with task.jsonl"
            }
        );
        Ok(())
    }

    /// Every size small enough for this machine, so a typo fails here and not as an allocation
    /// failure. Per-item costs are generous upper bounds of what the run keeps per item.
    fn check_sizes(&self) -> anyhow::Result<()> {
        let (rl, m) = (&self.rl, &self.model);
        if m.dir.as_os_str().is_empty() {
            for (name, v) in [
                ("model.hidden_size", m.hidden_size),
                ("model.intermediate_size", m.intermediate_size),
                ("model.layers", m.layers),
                ("model.heads", m.heads),
                ("model.kv_heads", m.kv_heads),
                ("model.head_dim", m.head_dim),
            ] {
                ensure!(v >= 1, "{name} must be at least 1");
            }
            // Weights, gradients and two AdamW moments in the trainer, a copy per engine, the
            // evaluator, a reference and the checkpoint being written; with multiplexing, a
            // reference per engine as well.
            let engine_copies = if self.rollout.multiplex { 2 } else { 1 };
            let copies = 4 + engine_copies * u128::from(self.rollout.engines) + 3;
            let mc = self.model_config(256);
            check_model_fits(
                &mc,
                copies,
                "model.hidden_size/intermediate_size/layers/heads",
            )?;
        }
        let tokens = rl.max_new_tokens as u128 + 64;
        let responses = u128::from(rl.batch_groups) * u128::from(rl.group_size);
        // Each response keeps tokens, log-probs and activations for the backward pass.
        check_fits("rl.batch_groups x rl.group_size", responses, tokens * 64)?;
        // The plan's own rule, so that what is checked is what runs.
        let max_groups = u128::from(crate::driver::plan::max_groups(
            rl.batch_groups,
            self.rollout.max_groups_factor,
        ));
        check_fits(
            "rollout.max_groups_factor x rl.batch_groups",
            max_groups.saturating_mul(u128::from(rl.group_size)),
            tokens * 16,
        )?;
        let sft_problems = u128::from(self.sft.steps) * u128::from(self.sft.batch);
        check_fits("sft.steps x sft.batch", sft_problems, 512)?;
        check_fits(
            "run.eval_problems",
            u128::from(self.run.eval_problems),
            1024,
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::DEFAULT_TOML;
    use super::super::load::tests::toml_without;
    use super::*;
    use crate::alloc::AllocPolicy;

    #[test]
    fn tensor_cores_default_off_and_need_wgpu() {
        // The embedded default has both keys, off; a config without them (an older run
        // directory's) reads as off.
        let table: toml::Table = toml::from_str(DEFAULT_TOML).unwrap();
        let c = TrainConfig::default_config().unwrap();
        let old = toml_without(&c, "tensor_cores");
        assert!(!old.contains("tensor_cores"), "{old}");
        let old = TrainConfig::from_toml_str(&old).unwrap();
        let get = |c: &TrainConfig, section: &str| match section {
            "rollout" => c.rollout.tensor_cores,
            _ => c.trainer.tensor_cores,
        };
        for section in ["rollout", "trainer"] {
            let key = format!("{section}.tensor_cores");
            assert_eq!(
                table[section].get("tensor_cores"),
                Some(&toml::Value::Boolean(false)),
                "default.toml's [{section}] must set tensor_cores = false"
            );
            assert!(!get(&c, section) && !get(&old, section), "{key}");
            // It parses from a file and from --set, and validates on wgpu.
            let file = TrainConfig::from_partial_toml(&format!(
                "[run]\nbackend = \"wgpu\"\n[{section}]\ntensor_cores = true\n"
            ))
            .unwrap();
            assert!(get(&file, section), "{key}");
            file.validate().unwrap();
            let on = c.with_overrides(&[format!("{key}=true")]).unwrap();
            assert!(get(&on, section), "{key}");
            let err = c.with_overrides(&[format!("{key}=\"yes\"")]).unwrap_err();
            assert!(format!("{err:#}").contains("tensor_cores"), "{err:#}");
            assert_needs_wgpu(&on, &key);
        }
        // Off, every backend validates.
        for backend in ["cpu", "wgpu", "cuda"] {
            c.with_overrides(&[format!("run.backend=\"{backend}\"")])
                .unwrap()
                .validate()
                .unwrap();
        }
    }

    #[test]
    fn lookahead_defaults_off_and_needs_wgpu() {
        // The embedded default sets it off; a config without it (an older run directory's)
        // reads as off.
        let table: toml::Table = toml::from_str(DEFAULT_TOML).unwrap();
        assert_eq!(
            table["rollout"].get("lookahead"),
            Some(&toml::Value::Boolean(false))
        );
        let c = TrainConfig::default_config().unwrap();
        let old = toml_without(&c, "lookahead");
        assert!(!old.contains("lookahead"), "{old}");
        assert!(
            !c.rollout.lookahead && !TrainConfig::from_toml_str(&old).unwrap().rollout.lookahead
        );
        let file = TrainConfig::from_partial_toml(
            "[run]\nbackend = \"wgpu\"\n[rollout]\nlookahead = true\n",
        )
        .unwrap();
        assert!(file.rollout.lookahead);
        file.validate().unwrap();
        let on = c
            .with_overrides(&["rollout.lookahead=true".into()])
            .unwrap();
        assert!(on.rollout.lookahead);
        let err = c
            .with_overrides(&["rollout.lookahead=1".into()])
            .unwrap_err();
        assert!(format!("{err:#}").contains("lookahead"), "{err:#}");
        assert_needs_wgpu(&on, "rollout.lookahead");
    }

    /// `on` (with `key` set) on any other backend is refused in one line naming the key and
    /// the backend.
    fn assert_needs_wgpu(on: &TrainConfig, key: &str) {
        for backend in ["cpu", "cuda"] {
            let bad = on
                .with_overrides(&[format!("run.backend=\"{backend}\"")])
                .unwrap();
            let e = format!("{:#}", bad.validate().unwrap_err());
            assert_eq!(e.lines().count(), 1, "{e}");
            assert!(
                e.starts_with(&format!(
                    "{key} = true needs run.backend = \"wgpu\" (got \"{backend}\")"
                )),
                "{e}"
            );
        }
    }

    #[test]
    fn invalid_combinations_say_why() {
        let c = TrainConfig::default_config().unwrap();
        let bad = c.with_overrides(&["rl.opt_steps=2".into()]).unwrap();
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("old_logprobs"), "{e}");
        let bad = c.with_overrides(&["rl.micro_batch=3".into()]).unwrap();
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("not divisible"), "{e}");
        let bad = c.with_overrides(&["rl.temperature=0".into()]).unwrap();
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("temperature")
        );
        let bad = c
            .with_overrides(&[
                "rollout.engines=1".into(),
                "fault.fail_engine_at_request=3".into(),
            ])
            .unwrap();
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("engines >= 2")
        );
        let bad = c.with_overrides(&["run.backend=tpu".into()]).unwrap();
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("\"tpu\" is not one of cpu, wgpu, cuda")
        );
        // Refused when the config is read (a named value) or when it is validated.
        let refused = |set: &[String]| {
            let e = c
                .with_overrides(set)
                .and_then(|c| c.validate())
                .unwrap_err();
            format!("{e:#}")
        };
        for (set, says) in [
            (
                vec!["rollout.dtype=\"fp8\""],
                "\"fp8\" is not one of f32, bf16, f16",
            ),
            (
                vec!["rollout.dtype=\"bf16\"", "run.backend=\"cuda\""],
                "needs run.backend = \"cpu\" or \"wgpu\": the cuda backend stores f32 weights",
            ),
            (vec!["sft.carry_drop=1.5"], "probability"),
            (vec!["sft.carry_drop=-0.1"], "probability"),
            (vec!["sft.carry_drop=0.5", "task.name=mul"], "add task only"),
            (
                vec!["task.train_pool=0"],
                "task.train_pool is 0, must be within 1..=1048576",
            ),
        ] {
            let set: Vec<String> = set.into_iter().map(Into::into).collect();
            let e = refused(&set);
            assert!(e.contains(says), "{set:?}: {e}");
        }
        let ok = c.with_overrides(&["sft.carry_drop=1".into()]).unwrap();
        ok.validate().unwrap();
        // Half engine storage is accepted on the two backends that have it.
        for (backend, dtype) in [("cpu", "bf16"), ("wgpu", "bf16"), ("wgpu", "f16")] {
            let set = [
                format!("run.backend=\"{backend}\""),
                format!("rollout.dtype=\"{dtype}\""),
            ];
            let half = c.with_overrides(&set).unwrap();
            half.validate().unwrap();
            assert_eq!(half.rollout.dtype.dtype().name().to_lowercase(), dtype);
        }
    }

    #[test]
    fn alloc_section_is_validated_and_configures_the_plan() {
        let c = TrainConfig::default_config().unwrap();
        assert_eq!(c.alloc.policy, AllocPolicy::Fixed);
        assert_eq!(c.plan(), {
            let mut p = c.clone();
            p.alloc.policy = AllocPolicy::Fixed;
            p.plan()
        });
        let v = c.with_overrides(&["alloc.policy=vigor".into()]).unwrap();
        v.validate().unwrap();
        let plan = v.plan();
        assert_eq!(
            (plan.group_size, plan.sample_budget, plan.hold_scored),
            (4, 16 * 8, true)
        );
        for (set, want) in [
            ("alloc.n0=1", "alloc.n0 is 1, must be at least 2"),
            (
                "alloc.budget=10",
                "alloc.budget 10 is below n0 × batch_groups = 64 samples",
            ),
            ("alloc.policy=dapo", "alloc.policy \"dapo\" is not one of"),
        ] {
            // A named value is refused as it is read, the rest when validated.
            let e = match v.with_overrides(&[set.into()]) {
                Ok(bad) => bad.validate().unwrap_err(),
                Err(e) => e,
            };
            let e = e.root_cause().to_string();
            assert!(e.starts_with(want), "{set}: {e}");
        }
        let p = c
            .with_overrides(&["alloc.policy=pilot_commit".into(), "alloc.upper=1.5".into()])
            .unwrap();
        let e = p.validate().unwrap_err().to_string();
        assert_eq!(e, "alloc.upper is 1.5, must be within [0, 1]");
        // A config without [alloc] loads, as fixed G.
        let old = c.to_toml().unwrap().replace("[alloc]", "[ignored]");
        let old = old.split("[ignored]").next().unwrap();
        assert_eq!(
            TrainConfig::from_toml_str(old).unwrap().alloc.policy,
            AllocPolicy::Fixed
        );
    }
}
