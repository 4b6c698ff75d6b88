//! One rollout engine with continuous batching (SGLang-like), advanced in closed form.
//!
//! Every running request decodes one token per iteration; an iteration with `B` running requests
//! and `K` resident KV tokens takes `base + per_seq*B + per_kv*K`. Between two events (a request
//! finishing, the KV cache filling up, an admission) `B` is fixed and `K` grows by `B` per
//! iteration, so the time of `n` iterations is a quadratic in `n`: the simulator jumps from event
//! to event instead of stepping token by token. Newly admitted requests are prefilled before the
//! next iteration (prefill stalls decode, as SGLang does without mixed chunking). When the cache
//! would overflow, the request with the fewest generated tokens is retracted (SGLang's
//! `retract_decode`): it frees its KV and resumes later with its prompt and output re-prefilled.
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::config::RolloutConfig;

/// Simulated time in nanoseconds.
pub type Ns = u64;

/// Converts seconds to nanoseconds, rounding up so that a positive duration never becomes 0.
pub fn secs_to_ns(s: f64) -> Ns {
    if s <= 0.0 { 0 } else { (s * 1e9).ceil() as Ns }
}

/// Iterations kept free after a retraction, so that the engine does not retract again on the
/// next iteration (SGLang retracts until its decode-memory check passes with a buffer; est.).
const RETRACT_HEADROOM_ITERS: u64 = 32;

/// Decode iteration cost: `base + per_seq*B + per_kv_token*K` seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeModel {
    /// Constant term, s.
    pub base_s: f64,
    /// Per running sequence, s.
    pub per_seq_s: f64,
    /// Per resident KV token, s.
    pub per_kv_token_s: f64,
}

impl DecodeModel {
    /// From the rollout config (ms and per-thousand-token units).
    pub fn from_config(c: &RolloutConfig) -> Self {
        Self {
            base_s: c.decode_base_ms * 1e-3,
            per_seq_s: c.decode_per_seq_ms * 1e-3,
            per_kv_token_s: c.decode_per_kilo_kv_ms * 1e-6,
        }
    }

    /// One iteration with `b` running and `k` resident tokens, s.
    pub fn iteration_s(&self, b: u64, k: u64) -> f64 {
        self.base_s + self.per_seq_s * b as f64 + self.per_kv_token_s * k as f64
    }

    /// `n` iterations from `b` running and `k` resident tokens (K grows by `b` each), s.
    pub fn run_s(&self, b: u64, k: u64, n: u64) -> f64 {
        let n_f = n as f64;
        n_f * self.iteration_s(b, k) + self.per_kv_token_s * b as f64 * n_f * (n_f - 1.0) / 2.0
    }

    /// The fewest iterations whose total time (rounded to ns) reaches `dt`.
    pub fn iterations_reaching(&self, b: u64, k: u64, dt: Ns) -> u64 {
        if dt == 0 {
            return 0;
        }
        let a = self.iteration_s(b, k);
        let half_c = self.per_kv_token_s * b as f64 / 2.0;
        let secs = dt as f64 * 1e-9;
        // Solve half_c n^2 + (a - half_c) n = secs, then fix up rounding on the integer grid.
        let q = a - half_c;
        let guess = if half_c > 0.0 {
            (-q + (q * q + 4.0 * half_c * secs).sqrt()) / (2.0 * half_c)
        } else {
            secs / a
        };
        let mut n = guess.max(0.0).floor() as u64;
        while secs_to_ns(self.run_s(b, k, n)) < dt {
            n += 1;
        }
        while n > 0 && secs_to_ns(self.run_s(b, k, n - 1)) >= dt {
            n -= 1;
        }
        n
    }
}

/// A request as the engine sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Running {
    prompt: u32,
    target: u32,
    gen_at_join: u32,
    join_iter: u64,
}

impl Running {
    fn finish_iter(&self) -> u64 {
        self.join_iter + u64::from(self.target - self.gen_at_join)
    }
    fn generated(&self, iter: u64) -> u32 {
        self.gen_at_join + (iter - self.join_iter) as u32
    }
    /// Larger = fewer tokens generated so far (retracted first).
    fn retract_rank(&self) -> i64 {
        self.join_iter as i64 - i64::from(self.gen_at_join)
    }
    /// The iteration from which its remaining budget `cap - generated` drops below the clip,
    /// so that its admission estimate stops being the clip and starts shrinking.
    fn unclip_iter(&self, unclip_at: u32) -> u64 {
        self.join_iter + u64::from(unclip_at.saturating_sub(self.gen_at_join))
    }
}

/// A request waiting in the engine's own queue: new (bound at submission) or retracted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiting {
    /// The caller's handle.
    pub key: u64,
    /// Prompt tokens.
    pub prompt: u32,
    /// Response length it will reach.
    pub target: u32,
    /// Tokens generated before it waited (0 unless retracted or migrated).
    pub generated: u32,
    /// Its KV is already on this engine (migrated by KV transfer): no prefill on admission.
    pub resident: bool,
}

/// What happened at an engine's boundary event.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BoundaryOutcome {
    /// Requests that generated their last token (caller's keys).
    pub finished: Vec<u64>,
    /// Requests retracted to free KV.
    pub retracted: u32,
}

/// One engine's state. Time only moves forward through `advance_to`, `occupy` and `on_event`.
#[derive(Debug, Clone)]
pub struct Engine {
    model: DecodeModel,
    max_running: u32,
    capacity: u64,
    ratio: f64,
    cap: u32,
    /// SGLang's CLIP_MAX_NEW_TOKENS_ESTIMATION: the admission estimate of a request's remaining
    /// tokens is `min(cap - generated, clip)`.
    clip: u32,
    prefill_tok_per_s: f64,
    /// Time of the current iteration boundary.
    t: Ns,
    iter: u64,
    running: BTreeMap<(u64, u64), Running>,
    by_rank: BTreeSet<(i64, u64)>,
    finish_of: BTreeMap<u64, u64>,
    /// Running requests whose estimate is still the clip, by the iteration they leave it.
    clipped: BTreeSet<(u64, u64)>,
    /// Running requests past the clip: how many, and the sum of `gen_at_join - join_iter`
    /// (their generated total is `count * iter + offset`).
    unclipped_count: u64,
    unclipped_offset: i64,
    /// Tokens charged this round for requests admitted at this boundary beyond their
    /// ratio-scaled estimate (SGLang charges a new request its whole clipped estimate).
    round_extra: f64,
    kv: u64,
    waiting: VecDeque<Waiting>,
    pending_prefill: u64,
    /// Bumped whenever the scheduled event is superseded.
    epoch: u64,
    /// Iterations the scheduled event covers.
    planned: u64,
    busy_ns: Ns,
    retractions: u64,
}

impl Engine {
    /// An idle engine at time 0; `cap` is the response cap (SGLang's max_new_tokens).
    pub fn new(c: &RolloutConfig, max_running: u32, cap: u32) -> Self {
        Self {
            model: DecodeModel::from_config(c),
            max_running,
            capacity: c.kv_capacity_tokens,
            ratio: c.kv_new_token_ratio,
            cap,
            clip: c.clip_max_new_tokens,
            prefill_tok_per_s: c.prefill_tok_per_s,
            t: 0,
            iter: 0,
            running: BTreeMap::new(),
            by_rank: BTreeSet::new(),
            finish_of: BTreeMap::new(),
            clipped: BTreeSet::new(),
            unclipped_count: 0,
            unclipped_offset: 0,
            round_extra: 0.0,
            kv: 0,
            waiting: VecDeque::new(),
            pending_prefill: 0,
            epoch: 0,
            planned: 0,
            busy_ns: 0,
            retractions: 0,
        }
    }

    /// Requests running in the batch.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting in this engine's queue (bound to it, or retracted).
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests held (running or waiting).
    pub fn held(&self) -> usize {
        self.running.len() + self.waiting.len()
    }

    /// Whether the engine has no request at all.
    pub fn is_idle(&self) -> bool {
        self.held() == 0
    }

    /// Resident KV tokens.
    pub fn kv_tokens(&self) -> u64 {
        self.kv
    }

    /// The current boundary time.
    pub fn time(&self) -> Ns {
        self.t
    }

    /// The epoch a scheduled event must carry to be current.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Time spent decoding, prefilling or on other work (`occupy`).
    pub fn busy_ns(&self) -> Ns {
        self.busy_ns
    }

    /// Retractions so far.
    pub fn retractions(&self) -> u64 {
        self.retractions
    }

    fn b(&self) -> u64 {
        self.running.len() as u64
    }

    fn unclip_at(&self) -> u32 {
        self.cap.saturating_sub(self.clip)
    }

    /// KV the admission check keeps for running requests to grow: SGLang's PrefillAdder charges
    /// each running request `min(max_new_tokens - generated, CLIP) * new_token_ratio`
    /// (`_get_running_request_total_token_offset`), plus the full clipped estimate of the
    /// requests it admitted in this round.
    fn reserve(&self) -> f64 {
        let clipped = self.clipped.len() as f64 * f64::from(self.clip.min(self.cap));
        let generated = self.unclipped_count as i64 * self.iter as i64 + self.unclipped_offset;
        let unclipped = (self.unclipped_count * u64::from(self.cap)) as i64 - generated;
        self.ratio * (clipped + unclipped.max(0) as f64) + self.round_extra
    }

    /// Whether a new request with `prompt` tokens would be admitted now (slot, nobody waiting
    /// ahead of it, KV): the late-binding router's question.
    pub fn can_admit(&self, prompt: u32) -> bool {
        self.held() < self.max_running as usize
            && self.waiting.is_empty()
            && self.fits(u64::from(prompt), u64::from(self.cap))
    }

    fn estimate(&self, remaining: u64) -> f64 {
        remaining.min(u64::from(self.clip)) as f64
    }

    fn fits(&self, tokens: u64, remaining: u64) -> bool {
        // `kv` already counts requests admitted at this boundary (their prompts are resident).
        (self.kv + tokens) as f64 + self.reserve() + self.estimate(remaining)
            <= self.capacity as f64
    }

    /// Moves to the first iteration boundary at or after `now` (never past the scheduled event)
    /// and cancels the scheduled event: the caller changes the batch, then reschedules.
    pub fn advance_to(&mut self, now: Ns) {
        self.epoch += 1;
        if self.running.is_empty() {
            self.t = self.t.max(now);
            return;
        }
        if now <= self.t {
            return;
        }
        let n = self
            .model
            .iterations_reaching(self.b(), self.kv, now - self.t)
            .min(self.planned);
        self.run(n);
    }

    /// Keeps the engine busy with other work (a multiplexed log-prob pass, a KV copy-in) for
    /// `dt` from `now` or its current boundary, whichever is later: decode stalls and requests
    /// routed to it wait. Call `advance_to` first when requests are running. Returns when it
    /// is free again.
    pub fn occupy(&mut self, now: Ns, dt: Ns) -> Ns {
        self.epoch += 1;
        self.t = self.t.max(now) + dt;
        self.busy_ns += dt;
        self.t
    }

    fn run(&mut self, n: u64) {
        if n == 0 {
            return;
        }
        let dt = secs_to_ns(self.model.run_s(self.b(), self.kv, n));
        self.t += dt;
        self.busy_ns += dt;
        self.kv += self.b() * n;
        self.iter += n;
        self.planned = self.planned.saturating_sub(n);
        self.round_extra = 0.0;
        // Requests whose remaining budget fell below the clip now count it exactly.
        while let Some(&(at, key)) = self.clipped.first() {
            if at > self.iter {
                break;
            }
            self.clipped.pop_first();
            let finish = self.finish_of[&key];
            let r = self.running[&(finish, key)];
            self.unclipped_count += 1;
            self.unclipped_offset += i64::from(r.gen_at_join) - r.join_iter as i64;
        }
    }

    /// Puts a request at the back of this engine's waiting queue (bound at submission);
    /// `admit_waiting` admits it when it reaches the front and fits.
    pub fn enqueue(&mut self, w: Waiting) {
        self.waiting.push_back(w);
    }

    /// Adds a new request to the batch at the current boundary (the late-binding router, after
    /// `can_admit`); `key` is the caller's handle.
    pub fn admit(&mut self, key: u64, prompt: u32, response_tokens: u32) {
        let target = response_tokens.max(1);
        self.insert(key, prompt, target, 0);
        self.round_extra += (1.0 - self.ratio) * self.estimate(u64::from(self.cap));
        self.pending_prefill += u64::from(prompt);
    }

    fn insert(&mut self, key: u64, prompt: u32, target: u32, generated: u32) {
        let r = Running {
            prompt,
            target,
            gen_at_join: generated,
            join_iter: self.iter,
        };
        self.running.insert((r.finish_iter(), key), r);
        self.by_rank.insert((r.retract_rank(), key));
        self.finish_of.insert(key, r.finish_iter());
        let at = r.unclip_iter(self.unclip_at());
        if at > self.iter {
            self.clipped.insert((at, key));
        } else {
            self.unclipped_count += 1;
            self.unclipped_offset += i64::from(r.gen_at_join) - r.join_iter as i64;
        }
        self.kv += u64::from(prompt) + u64::from(generated);
    }

    fn remove(&mut self, key: u64) -> Option<Running> {
        let finish = self.finish_of.remove(&key)?;
        let r = self.running.remove(&(finish, key))?;
        self.by_rank.remove(&(r.retract_rank(), key));
        if !self.clipped.remove(&(r.unclip_iter(self.unclip_at()), key)) {
            self.unclipped_count -= 1;
            self.unclipped_offset -= i64::from(r.gen_at_join) - r.join_iter as i64;
        }
        self.kv -= u64::from(r.prompt) + u64::from(r.generated(self.iter));
        Some(r)
    }

    /// Admits waiting requests first come, first served (SGLang's FCFS `get_new_batch_prefill`),
    /// stopping at the first that does not fit (`AddReqResult.NO_TOKEN`). Prompt and any
    /// earlier output are prefilled. Returns how many joined.
    pub fn admit_waiting(&mut self) -> u32 {
        let mut joined = 0;
        while let Some(w) = self.waiting.front().copied() {
            if self.running.len() >= self.max_running as usize {
                break;
            }
            let tokens = u64::from(w.prompt) + u64::from(w.generated);
            let remaining = u64::from(self.cap - w.generated.min(self.cap));
            if !self.fits(tokens, remaining) && !self.running.is_empty() {
                break;
            }
            self.waiting.pop_front();
            let target = w.target.max(w.generated + 1).max(1);
            self.insert(w.key, w.prompt, target, w.generated);
            self.round_extra += (1.0 - self.ratio) * self.estimate(remaining);
            if !w.resident {
                self.pending_prefill += tokens;
            }
            joined += 1;
        }
        joined
    }

    /// Runs the prefill of everything admitted at this boundary.
    pub fn prefill(&mut self) {
        if self.pending_prefill > 0 {
            let dt = secs_to_ns(self.pending_prefill as f64 / self.prefill_tok_per_s);
            self.t += dt;
            self.busy_ns += dt;
            self.pending_prefill = 0;
        }
    }

    /// Schedules the next boundary: the earliest finish, or the iteration that would overflow
    /// the KV cache. Returns its time and epoch, or `None` when idle.
    pub fn schedule(&mut self) -> Option<(Ns, u64)> {
        self.epoch += 1;
        let (&(finish, _), _) = self.running.first_key_value()?;
        let b = self.b();
        let to_finish = finish - self.iter;
        let room = self.capacity.saturating_sub(self.kv) / b;
        self.planned = to_finish.min(room);
        let at = self.t + secs_to_ns(self.model.run_s(b, self.kv, self.planned));
        Some((at, self.epoch))
    }

    /// Handles the scheduled boundary: runs the planned iterations, collects finished requests
    /// and retracts if the cache is full.
    pub fn on_event(&mut self) -> BoundaryOutcome {
        let mut out = BoundaryOutcome::default();
        self.run(self.planned);
        self.epoch += 1;
        while let Some((&(finish, key), _)) = self.running.first_key_value() {
            if finish > self.iter {
                break;
            }
            self.remove(key);
            out.finished.push(key);
        }
        let b = self.b();
        if b > 0 && self.kv + b > self.capacity {
            // SGLang's `retract_decode` retracts the request with the fewest output tokens
            // first, and the scheduler puts retracted requests at the back of its waiting queue
            // (`_extend_requests_to_queue`), behind everything already waiting.
            while self.b() > 1 && self.kv + self.b() * RETRACT_HEADROOM_ITERS > self.capacity {
                let Some(&(_, key)) = self.by_rank.last() else {
                    break;
                };
                let Some(r) = self.remove(key) else { break };
                self.waiting.push_back(Waiting {
                    key,
                    prompt: r.prompt,
                    target: r.target,
                    generated: r.generated(self.iter),
                    resident: false,
                });
                self.retractions += 1;
                out.retracted += 1;
            }
        }
        out
    }

    /// Drops a request (abort); returns the tokens it had generated, or `None` if the engine
    /// did not hold it.
    pub fn abort(&mut self, key: u64) -> Option<u32> {
        self.take(key).map(|w| w.generated)
    }

    /// Takes a request out of the engine (running or waiting) with what it has generated, to
    /// abort it or move it to another engine.
    pub fn take(&mut self, key: u64) -> Option<Waiting> {
        let iter = self.iter;
        if let Some(r) = self.remove(key) {
            return Some(Waiting {
                key,
                prompt: r.prompt,
                target: r.target,
                generated: r.generated(iter),
                resident: false,
            });
        }
        let pos = self.waiting.iter().position(|w| w.key == key)?;
        self.waiting.remove(pos)
    }

    /// The running request that has generated the most tokens: (key, generated).
    pub fn most_generated(&self) -> Option<(u64, u32)> {
        // generated = iter - retract_rank, so the smallest rank has generated the most.
        let &(rank, key) = self.by_rank.first()?;
        Some((key, (self.iter as i64 - rank) as u32))
    }

    /// Running requests as (key, generated so far, tokens left), longest remaining first.
    pub fn running_requests(&self) -> Vec<(u64, u32, u32)> {
        let mut v: Vec<(u64, u32, u32)> = self
            .running
            .iter()
            .map(|(&(finish, key), r)| (key, r.generated(self.iter), (finish - self.iter) as u32))
            .collect();
        v.sort_by_key(|&(key, _, left)| (std::cmp::Reverse(left), key));
        v
    }

    /// Whether a slot is free (the KV check is separate, see `can_admit`).
    pub fn has_free_slot(&self) -> bool {
        self.held() < self.max_running as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::config::SimConfig;

    fn config() -> RolloutConfig {
        SimConfig::defaults().unwrap().rollout
    }

    #[test]
    fn closed_form_matches_iteration_by_iteration() {
        let m = DecodeModel::from_config(&config());
        let (b, k) = (37, 12_345);
        let stepped: f64 = (0..500).map(|i| m.iteration_s(b, k + i * b)).sum();
        assert!((m.run_s(b, k, 500) - stepped).abs() < 1e-9);
        let dt = secs_to_ns(m.run_s(b, k, 321));
        assert_eq!(m.iterations_reaching(b, k, dt), 321);
        assert_eq!(m.iterations_reaching(b, k, dt + 1), 322);
    }

    #[test]
    fn single_request_takes_prefill_plus_its_decode() {
        let c = config();
        let mut e = Engine::new(&c, 8, 4096);
        e.admit(1, 100, 50);
        e.prefill();
        let (at, _) = e.schedule().unwrap();
        let m = DecodeModel::from_config(&c);
        let expected = secs_to_ns(100.0 / c.prefill_tok_per_s) + secs_to_ns(m.run_s(1, 100, 50));
        assert_eq!(at, expected);
        let out = e.on_event();
        assert_eq!(out.finished, vec![1]);
        assert_eq!(e.time(), expected);
        assert_eq!(e.kv_tokens(), 0);
    }

    #[test]
    fn shorter_request_finishes_first_and_batch_shrinks() {
        let c = config();
        let mut e = Engine::new(&c, 8, 4096);
        e.admit(1, 10, 5);
        e.admit(2, 10, 8);
        e.prefill();
        e.schedule();
        assert_eq!(e.on_event().finished, vec![1]);
        // Request 2 has 3 tokens left; its KV is prompt + 5 generated.
        assert_eq!(e.kv_tokens(), 15);
        e.schedule();
        assert_eq!(e.on_event().finished, vec![2]);
    }

    #[test]
    fn admission_mid_run_joins_at_the_next_boundary() {
        let c = config();
        let m = DecodeModel::from_config(&c);
        let mut e = Engine::new(&c, 8, 4096);
        e.admit(1, 0, 100);
        e.schedule();
        let now = secs_to_ns(m.run_s(1, 0, 10)) + 1;
        e.advance_to(now);
        // Ten whole iterations were done before `now`; the eleventh ends after it.
        assert_eq!(e.time(), secs_to_ns(m.run_s(1, 0, 11)));
        assert_eq!(e.kv_tokens(), 11);
        e.admit(2, 0, 5);
        e.schedule();
        assert_eq!(e.on_event().finished, vec![2]);
    }

    #[test]
    fn kv_overflow_retracts_the_youngest_and_resumes_it() {
        let mut c = config();
        c.kv_capacity_tokens = 1_000;
        c.kv_new_token_ratio = 0.0;
        let mut e = Engine::new(&c, 8, 900);
        e.admit(1, 100, 600);
        e.admit(2, 100, 600);
        e.prefill();
        e.schedule();
        // 200 prompt tokens + 2 per iteration overflow 1000 after 400 iterations.
        let out = e.on_event();
        assert!(out.finished.is_empty());
        assert_eq!(out.retracted, 1);
        assert_eq!(e.running(), 1);
        assert_eq!(e.held(), 2);
        assert!(!e.can_admit(1));
        // Request 1 finishes; request 2 resumes with its 400 generated tokens.
        e.schedule();
        let out = e.on_event();
        assert_eq!(out.finished.len(), 1);
        e.admit_waiting();
        assert_eq!(e.running(), 1);
        assert_eq!(e.kv_tokens(), 500);
        e.prefill();
        e.schedule();
        assert_eq!(e.on_event().finished.len(), 1);
        assert_eq!(e.retractions(), 1);
    }

    #[test]
    fn abort_frees_slot_and_kv() {
        let c = config();
        let mut e = Engine::new(&c, 1, 4096);
        e.admit(7, 100, 1000);
        assert!(!e.can_admit(10));
        assert_eq!(e.abort(7), Some(0));
        assert_eq!(e.abort(7), None);
        assert_eq!(e.kv_tokens(), 0);
        assert!(e.can_admit(10));
    }

    fn brute_reserve(e: &Engine) -> f64 {
        e.running
            .values()
            .map(|r| {
                let left = e.cap - r.generated(e.iter);
                f64::from(left.min(e.clip)) * e.ratio
            })
            .sum::<f64>()
            + e.round_extra
    }

    #[test]
    fn admission_estimate_is_clipped_like_sglang() {
        // SGLang charges a running request min(max_new - generated, CLIP) * ratio and a new one
        // its whole clipped estimate; with a 16k cap the clip is what lets a second request in.
        let mut c = config();
        c.kv_capacity_tokens = 20_000;
        c.kv_new_token_ratio = 1.0;
        c.clip_max_new_tokens = 4096;
        let mut e = Engine::new(&c, 8, 16_384);
        e.admit(1, 100, 10_000);
        assert!(
            e.can_admit(100),
            "clipped: 100 + 100 + 4096 + 4096 fits 20k"
        );
        c.clip_max_new_tokens = 16_384;
        let mut e = Engine::new(&c, 8, 16_384);
        e.admit(1, 100, 10_000);
        assert!(!e.can_admit(100), "unclipped: 2 x 16384 does not fit 20k");
    }

    #[test]
    fn clipped_reserve_matches_a_per_request_sum() {
        let mut c = config();
        c.kv_new_token_ratio = 0.3;
        c.clip_max_new_tokens = 1000;
        let m = DecodeModel::from_config(&c);
        let mut e = Engine::new(&c, 64, 1500);
        // Requests joining with different progress: some start past the clip.
        for (k, g) in [(1u64, 0u32), (2, 400), (3, 600), (4, 1200)] {
            e.enqueue(Waiting {
                key: k,
                prompt: 50,
                target: 1490,
                generated: g,
                resident: false,
            });
        }
        e.admit_waiting();
        assert_eq!(e.running(), 4);
        e.prefill();
        e.schedule();
        let mut now = e.time();
        for step in [1u64, 99, 250, 400, 700] {
            now += secs_to_ns(m.run_s(4, e.kv_tokens(), step));
            e.advance_to(now);
            assert!(
                (e.reserve() - brute_reserve(&e)).abs() < 1e-6,
                "iter {}: {} vs {}",
                e.iter,
                e.reserve(),
                brute_reserve(&e)
            );
            e.schedule();
        }
        // Removal keeps the aggregates right whichever side of the clip a request is on.
        e.take(2);
        e.take(4);
        assert!((e.reserve() - brute_reserve(&e)).abs() < 1e-6);
    }

    #[test]
    fn retracted_requests_go_to_the_back_of_the_waiting_queue() {
        let mut c = config();
        c.kv_capacity_tokens = 1_000;
        c.kv_new_token_ratio = 0.0;
        c.clip_max_new_tokens = 1;
        let mut e = Engine::new(&c, 8, 900);
        e.admit(1, 100, 600);
        e.admit(2, 100, 600);
        // A request bound to this engine waits behind the running ones.
        e.enqueue(Waiting {
            key: 3,
            prompt: 100,
            target: 10,
            generated: 0,
            resident: false,
        });
        e.prefill();
        e.schedule();
        let out = e.on_event();
        assert_eq!(out.retracted, 1);
        assert_eq!(e.waiting(), 2);
        // Request 1 finishes; the new request 3 is admitted before the retracted request 2.
        e.schedule();
        assert_eq!(e.on_event().finished, vec![1]);
        e.admit_waiting();
        let keys: Vec<u64> = e.running_requests().iter().map(|r| r.0).collect();
        assert!(keys.contains(&3), "new request admitted first: {keys:?}");
        // Request 2 generated the most of those held; it is the migration candidate.
        assert_eq!(e.most_generated(), Some((2, 400)));
    }

    #[test]
    fn occupied_engine_delays_its_waiting_requests() {
        let c = config();
        let mut e = Engine::new(&c, 8, 4096);
        let free = e.occupy(1_000, 5_000);
        assert_eq!(free, 6_000);
        e.advance_to(2_000);
        e.enqueue(Waiting {
            key: 1,
            prompt: 100,
            target: 5,
            generated: 0,
            resident: false,
        });
        e.admit_waiting();
        e.prefill();
        let (at, _) = e.schedule().unwrap();
        assert!(at > 6_000 + secs_to_ns(100.0 / c.prefill_tok_per_s));
        // A migrated request whose KV was copied in needs no prefill.
        let mut e = Engine::new(&c, 8, 4096);
        e.enqueue(Waiting {
            key: 9,
            prompt: 100,
            target: 50,
            generated: 40,
            resident: true,
        });
        e.admit_waiting();
        e.prefill();
        assert_eq!(e.time(), 0);
        assert_eq!(e.kv_tokens(), 140);
    }
}
