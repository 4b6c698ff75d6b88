//! The simulator's own placement policies: sgl-router's binding of requests to engines, and
//! the two bound-moving policies (tail multiplexing, long-tail migration), which live in the
//! engine layer until the core has a migration event.
use super::{Engine, Ev, MigrateVia, Routing, Sim, secs_to_ns};

impl Sim<'_> {
    /// The engine a newly submitted request of `group` is bound to. sgl-router's cache_aware
    /// policy (`CacheAwarePolicy::select_worker`): when the loads are unbalanced (max - min >
    /// balance_abs and max > min * balance_rel) the least-loaded engine; otherwise the engine
    /// whose radix tree holds the prompt, which is where the group's earlier samples went; a
    /// prompt seen nowhere goes to the least-loaded engine.
    pub(super) fn route(&mut self, step: u64, group: u32) -> usize {
        let loads: Vec<usize> = self.engines.iter().map(Engine::held).collect();
        let least = (0..loads.len()).min_by_key(|&e| (loads[e], e)).unwrap_or(0);
        if self.cfg.rollout.routing == Routing::LeastLoaded {
            return least;
        }
        let (min, max) = (loads[least], loads.iter().copied().max().unwrap_or(0));
        let r = &self.cfg.rollout;
        let unbalanced = max - min > r.router_balance_abs as usize
            && max as f64 > min as f64 * r.router_balance_rel;
        let e = match self.prefix_home.get(&(step, group)) {
            Some(&home) if !unbalanced => usize::from(home),
            _ => least,
        };
        self.prefix_home.insert((step, group), e as u16);
        e
    }

    /// Tail multiplexing: each idle engine (nothing running or waiting, no admissible request
    /// anywhere) takes the old/ref log-prob pass of one complete group the trainer has not
    /// started. The engines hold the weights v_k the rollout used, which are the weights the
    /// trainer would compute the pass with, so step k stays on-policy. It takes the most
    /// recently dispatched group: the trainer consumes groups in dispatch order, so work from
    /// the back is the least likely to be overtaken.
    pub(super) fn multiplex(&mut self) {
        let Some(step) = self.training else { return };
        let po = &self.cfg.policy;
        let passes = f64::from(self.cfg.trainer.logprob_passes);
        if passes == 0.0 {
            return;
        }
        for e in 0..self.engines.len() {
            if !self.engines[e].is_idle() || self.engines[e].time() > self.now {
                continue;
            }
            let c = &mut self.ctxs[step as usize];
            let Some(&g) = c.dispatched.iter().rev().find(|g| {
                let gi = g.0 as usize;
                !c.mb_started[gi] && c.logprob_ready[gi].is_none()
            }) else {
                return;
            };
            let gi = g.0 as usize;
            let tokens = c.groups[gi].train_tokens();
            let dt =
                secs_to_ns(po.mux_overhead_s + passes * tokens as f64 / po.mux_logprob_tok_per_s);
            let start = self.now.max(c.data_ready[gi].min(self.now));
            let end = self.engines[e].occupy(start, dt);
            c.logprob_ready[gi] = Some(end);
            c.mux_ns += dt;
            c.mux_groups += 1;
            self.dirty[e] = true;
            self.queue.push(end, Ev::MuxDone);
            if self.record {
                self.rec.mux.push((step, e as u16, g.0, end - dt, end));
            }
        }
    }

    /// Long-tail migration: when no request waits to be admitted, the rollout's tail is what is
    /// left on the engines. A lightly loaded engine (fewer than `migrate_receiver_max` running)
    /// receives, one at a time, the request that has generated the most tokens (at least
    /// `migrate_min_generated`) on the engine with the largest batch, when that batch is more
    /// than twice its own. A long-running request is the likeliest long tail (lengths are
    /// heavy-tailed), and in a small batch it decodes near the base iteration time instead of
    /// the crowded batch's, so the tail is consolidated on few engines and runs faster. The
    /// policy knows only what a live system knows (tokens generated so far), never the
    /// remaining length. The core keeps the request in flight: a move is not a failure. State
    /// moves by KV transfer (the receiver's decode stalls for the copy) or by re-prefill.
    pub(super) fn migrate(&mut self, step: u64) {
        let po = &self.cfg.policy;
        let max_moves = self.engines.len() * po.migrate_receiver_max as usize;
        for _ in 0..max_moves {
            // The receiver: the least-loaded engine that is not busy with other work.
            let Some(dst) = (0..self.engines.len())
                .filter(|&e| {
                    let en = &self.engines[e];
                    en.running() < po.migrate_receiver_max as usize
                        && en.waiting() == 0
                        && !(en.is_idle() && en.time() > self.now)
                })
                .min_by_key(|&e| (self.engines[e].running(), e))
            else {
                return;
            };
            let floor = 2 * (self.engines[dst].running() + 1);
            let mut best: Option<(usize, usize, u32, u64)> = None;
            for src in 0..self.engines.len() {
                let n = self.engines[src].running();
                if src == dst || n <= floor || self.engines[src].waiting() > 0 {
                    continue;
                }
                let Some((key, generated)) = self.engines[src].most_generated() else {
                    continue;
                };
                if generated < po.migrate_min_generated {
                    continue;
                }
                if best.is_none_or(|(_, bn, bg, _)| (n, generated) > (bn, bg)) {
                    best = Some((src, n, generated, key));
                }
            }
            let Some((src, _, _, key)) = best else { return };
            self.engines[src].advance_to(self.now);
            self.dirty[src] = true;
            {
                let Some(mut w) = self.engines[src].take(key) else {
                    continue;
                };
                let tokens = w.prompt + w.generated;
                self.engines[dst].advance_to(self.now);
                if po.migrate_via == MigrateVia::KvTransfer {
                    let bytes = f64::from(tokens) * f64::from(po.kv_bytes_per_token);
                    let dt = secs_to_ns(bytes / (po.migrate_kv_gb_per_s * 1e9));
                    self.engines[dst].occupy(self.now, dt);
                    w.resident = true;
                }
                self.engines[dst].enqueue(w);
                self.dirty[dst] = true;
                let r = &mut self.reqs[key as usize];
                r.engine = dst as u16;
                let id = r.id;
                self.held_changed(src as u16, -1);
                self.held_changed(dst as u16, 1);
                self.ctxs[step as usize].migrations += 1;
                if self.record {
                    self.rec.migrations.push((
                        step, id.group.0, id.sample, src as u16, dst as u16, self.now, tokens,
                    ));
                }
            }
        }
    }
}
