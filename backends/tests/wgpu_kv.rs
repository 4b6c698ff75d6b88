//! The wgpu engine's paged KV pool and non-blocking steps: a group's samples reference the
//! shared prompt pages and still generate what they would alone, bit for bit; the pool's
//! free pages are the engine's capacity (a request that does not fit comes back); and
//! `submit_step` returns with the step queued, so the host adds and cancels requests before
//! `poll_step` collects it, with the same outcome as blocking steps.
#![cfg(feature = "wgpu")]

#[path = "support/check.rs"]
#[allow(dead_code)]
mod check;
#[path = "support/device.rs"]
mod device;
#[path = "support/engine.rs"]
mod engine;
#[path = "support/wgpu_small.rs"]
mod small;

use std::sync::Arc;

use check::{assert_close, rand_vec, tol};
use engine::{assert_same_outputs as assert_same, drain, overlap_reference, params};
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::SeedableRng;
use rolloutpipe_backends::engine::{KvStore, Paged};
use rolloutpipe_backends::wgpu::Exec;
use rolloutpipe_backends::wgpu::kv::{self, KvPool, PAGE, StepRows};
use rolloutpipe_backends::*;
use small::{engine, overlap_matches, prompt, setup};

#[test]
fn group_references_the_shared_prefix_and_matches_independent_requests_bit_for_bit() {
    let Some((cfg, w, g)) = setup(1) else { return };
    let prompt = prompt();
    // Different lengths and a one-token sample (it finishes in the prefill step).
    let samples: Vec<(RequestKey, SamplingParams)> = [(0, 7), (1, 1), (2, 12), (3, 5)]
        .iter()
        .map(|&(i, n)| (RequestKey(i), params(100 + i, n)))
        .collect();
    let group = GroupRequest {
        prompt: prompt.clone(),
        samples: samples.clone(),
    };
    let mut alone = engine(&cfg, &w, &g);
    for r in group.clone().into_requests() {
        alone.add_request(r).expect("add");
    }
    let independent_kv = alone.load().kv_tokens;
    let want = drain(&mut alone);
    // The CPU reference generates the same tokens.
    let mut cpu = CpuBackend::new(&cfg, &w, 1).expect("cpu");
    for r in group.clone().into_requests() {
        cpu.add_request(r).expect("cpu add");
    }
    let cpu_out = drain(&mut cpu);
    for (id, o) in &want {
        assert_eq!(cpu_out[id].tokens, o.tokens, "sample {id} against the CPU");
    }

    let mut grouped = engine(&cfg, &w, &g);
    grouped.add_group(group.clone()).expect("add_group");
    assert_eq!(grouped.active_requests(), 4);
    // The 32 shared positions are reserved once, not four times.
    assert_eq!(grouped.load().kv_tokens, independent_kv - 3 * 2 * PAGE);
    let got = drain(&mut grouped);
    assert_same(&got, &want);
    assert_eq!(grouped.load(), EngineLoad::default());

    // The sample that would prefill the prompt is cancelled before any step: another one
    // writes the shared pages, and the rest still match.
    let mut be = engine(&cfg, &w, &g);
    be.add_group(group).expect("add_group");
    be.cancel_request(RequestKey(0)).expect("cancel");
    let got = drain(&mut be);
    let mut rest = want.clone();
    rest.remove(&0);
    assert_same(&got, &rest);
}

#[test]
fn the_pool_is_the_capacity_and_a_full_engine_hands_the_request_back() {
    let Some((cfg, w, g)) = setup(2) else { return };
    let mut be = engine(&cfg, &w, &g);
    assert!(be.kv_pages().expect("pages") > 1000, "default: one binding");
    assert!(be.set_kv_pages(0).is_err());
    // Six pages: a group of four samples of 37 + 8 positions needs 2 shared pages and one
    // page each (6); as independent requests it would need 3 pages each (12).
    be.set_kv_pages(6).expect("pages");
    let prompt = prompt();
    let group = GroupRequest {
        prompt: prompt.clone(),
        samples: (0..4).map(|i| (RequestKey(i), params(i, 8))).collect(),
    };
    let req = |id: u64, n: usize| GenRequest {
        id: RequestKey(id),
        prompt: prompt.clone(),
        params: params(id, n),
    };
    be.add_request(req(10, 8)).expect("3 pages fit");
    // The group needs 6 pages, 3 are free: handed back whole, nothing admitted.
    let e = be.add_group(group.clone()).unwrap_err();
    assert!(e.to_string().starts_with("engine full:"), "{e}");
    match e.into_rejected() {
        Ok(Rejected::Group(back)) => assert_eq!(back, group),
        other => panic!("expected the group back, got {other:?}"),
    }
    assert_eq!(be.active_requests(), 1);
    be.add_request(req(11, 8)).expect("3 more pages fit");
    match be
        .add_request(req(12, 1))
        .map_err(BackendError::into_rejected)
    {
        Err(Ok(Rejected::Request(r))) => assert_eq!(r, req(12, 1)),
        other => panic!("expected the request handed back, got {other:?}"),
    }
    // The cap cannot drop below the pages in use.
    assert!(be.set_kv_pages(2).is_err());
    let two = drain(&mut be);
    assert_eq!(two.len(), 2);
    // Freed pages are reused: the whole group now fits.
    be.add_group(group).expect("group fits in the freed pages");
    assert_eq!(drain(&mut be).len(), 4);
}

#[test]
fn submit_returns_with_the_step_queued_and_poll_collects_it() {
    let Some((cfg, w, g)) = setup(4) else { return };
    // Reference with blocking steps.
    let want = overlap_reference(&mut engine(&cfg, &w, &g));
    // While the step runs: add and cancel for the next one; what needs the engine idle is
    // refused.
    overlap_matches(&mut engine(&cfg, &w, &g), &want, |_| {});
}

/// The kernel itself against the CPU's `attention_fwd` on contiguous keys: a 150-position
/// prefill (three 64-key chunks) scattered over pages out of order, and in the same step a
/// second sequence of 20 rows at positions 64..84 whose table starts with the first one's
/// four pages (a shared prefix, written by the same step's KV-append). GQA 4:1, head_dim 64.
#[test]
fn attention_decode_over_pages_matches_cpu_attention() {
    let Some(g) = device::gpu() else { return };
    let cfg = ModelConfig {
        num_attention_heads: 8,
        num_key_value_heads: 2,
        head_dim: 64,
        max_position_embeddings: 256,
        ..ModelConfig::tiny()
    };
    let (h, kvh, hd) = (8, 2, 64);
    let (qd, kd) = (h * hd, kvh * hd);
    let (na, nb, b0) = (150usize, 20usize, 64usize);
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let q = rand_vec(&mut rng, (na + nb) * qd, 1.0);
    let k = rand_vec(&mut rng, (na + nb) * kd, 1.0);
    let v = rand_vec(&mut rng, (na + nb) * kd, 1.0);
    let mut ex = Exec::new(Arc::clone(&g));
    let mut store = Paged::new(kv::device_pages(&g, &cfg));
    let all = store.alloc(16).expect("pages");
    let mut pool = KvPool::default();
    pool.ensure_built(&g, &mut ex, &cfg, store.pages_used(), store.max_pages());
    // A: pages 15, 13, .., 1 then 14, 12: positions land out of order. B: A's first four
    // pages, then two of its own.
    let table_a: Vec<u32> = [15, 13, 11, 9, 7, 5, 3, 1, 14, 12].map(|i| all[i]).to_vec();
    let table_b: Vec<u32> = table_a[..4]
        .iter()
        .copied()
        .chain([all[0], all[2]])
        .collect();
    let pages: Vec<u32> = table_a.iter().chain(&table_b).copied().collect();
    let mut meta = Vec::new();
    for t in 0..na {
        meta.extend([0u32, t as u32]);
    }
    for t in b0..b0 + nb {
        meta.extend([table_a.len() as u32, t as u32]);
    }
    let n = na + nb;
    let (qb, kb, vb) = (g.upload("q", &q), g.upload("k", &k), g.upload("v", &v));
    let (mb, pb) = (g.upload("meta", &meta), g.upload("pages", &pages));
    let (out, state) = (g.buffer("out", n * qd), g.buffer("state", 2 * n * h));
    let rows = StepRows {
        q: &qb,
        out: &out,
        state: &state,
        k: &kb,
        v: &vb,
        meta: &mb,
        pages: &pb,
        n,
        pages_len: pages.len(),
        max_pos: (na - 1).max(b0 + nb - 1),
    };
    rows.kv_append(&mut ex, &pool, 0, &cfg).expect("append");
    rows.attention_decode(&mut ex, &pool, 0, &cfg)
        .expect("attention");
    ex.submit().expect("submit");
    let got = g.read::<f32>(&out, n * qd).expect("read");

    let mut want_a = vec![0.0; na * qd];
    let mut att = vec![0.0; h * na * na];
    rolloutpipe_backends::cpu::ops::attention_fwd(
        &mut want_a,
        &mut att,
        &q[..na * qd],
        &k[..na * kd],
        &v[..na * kd],
        na,
        na,
        h,
        kvh,
        hd,
    );
    assert_close("sequence A", &got[..na * qd], &want_a, tol::ATTENTION);
    // B's keys: A's first 64 positions, then its own rows.
    let kb_cat: Vec<f32> = k[..b0 * kd].iter().chain(&k[na * kd..]).copied().collect();
    let vb_cat: Vec<f32> = v[..b0 * kd].iter().chain(&v[na * kd..]).copied().collect();
    let mut want_b = vec![0.0; nb * qd];
    let mut att = vec![0.0; h * nb * (b0 + nb)];
    rolloutpipe_backends::cpu::ops::attention_fwd(
        &mut want_b,
        &mut att,
        &q[na * qd..],
        &kb_cat,
        &vb_cat,
        nb,
        b0 + nb,
        h,
        kvh,
        hd,
    );
    assert_close(
        "sequence B on the shared pages",
        &got[na * qd..],
        &want_b,
        tol::ATTENTION,
    );
}

/// One decode row at position `len - 1` of a single request whose every position was
/// appended to the pool, run with `window` keys per launch (`None`: the adapter's choice):
/// the row's attention output, with the inputs the CPU reference needs to check it.
fn long_decode(
    g: &Arc<rolloutpipe_backends::wgpu::Gpu>,
    h: usize,
    kvh: usize,
    hd: usize,
    len: usize,
    window: Option<usize>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let cfg = ModelConfig {
        num_attention_heads: h,
        num_key_value_heads: kvh,
        head_dim: hd,
        max_position_embeddings: len,
        ..ModelConfig::tiny()
    };
    let (qd, kd) = (h * hd, kvh * hd);
    let mut rng = ChaCha8Rng::seed_from_u64(len as u64);
    let q = rand_vec(&mut rng, qd, 1.0);
    let k = rand_vec(&mut rng, len * kd, 1.0);
    let v = rand_vec(&mut rng, len * kd, 1.0);
    let mut ex = Exec::new(Arc::clone(g));
    ex.force_decode_window(window);
    let mut store = Paged::new(kv::device_pages(g, &cfg));
    let table = store.alloc(len.div_ceil(PAGE)).expect("pages");
    let mut pool = KvPool::default();
    pool.ensure_built(g, &mut ex, &cfg, store.pages_used(), store.max_pages());
    // Every position appended as its own row (as a prefill's rows reach the pool), then one
    // decode row at the last position.
    let meta: Vec<u32> = (0..len as u32).flat_map(|t| [0, t]).collect();
    let (kb, vb) = (g.upload("k", &k), g.upload("v", &v));
    let (mb, pb) = (g.upload("meta", &meta), g.upload("pages", &table));
    let (qall, outall) = (g.buffer("q", len * qd), g.buffer("out", len * qd));
    let state = g.buffer("state", 2 * len * h);
    let append = StepRows {
        q: &qall,
        out: &outall,
        state: &state,
        k: &kb,
        v: &vb,
        meta: &mb,
        pages: &pb,
        n: len,
        pages_len: table.len(),
        max_pos: len - 1,
    };
    append.kv_append(&mut ex, &pool, 0, &cfg).expect("append");
    let (qb, out) = (g.upload("q1", &q), g.buffer("out1", qd));
    let m1 = g.upload("meta1", &[0u32, (len - 1) as u32]);
    let row = StepRows {
        q: &qb,
        out: &out,
        meta: &m1,
        n: 1,
        ..append
    };
    row.attention_decode(&mut ex, &pool, 0, &cfg)
        .expect("attention");
    ex.submit().expect("submit");
    (g.read::<f32>(&out, qd).expect("read"), q, k, v)
}

/// Decode rows at long contexts against the CPU reference. One launch over all keys runs
/// past llvmpipe's 65,535 loop iterations per invocation (after which it silently stops
/// loops) at about 1,250 keys with GQA 8:1 and head_dim 128, and 5,500 with 2:1 (measured:
/// those launches gave wrong outputs), so on llvmpipe the kernel is launched in windows of
/// keys that carry each row's softmax state; elsewhere in one launch.
#[test]
fn attention_decode_matches_cpu_at_long_context() {
    let Some(g) = device::gpu() else { return };
    for (h, kvh, len) in [(8usize, 1usize, 1500usize), (2, 1, 6000)] {
        let hd = 128;
        let (got, q, k, v) = long_decode(&g, h, kvh, hd, len, None);
        let mut want = vec![0.0; h * hd];
        let mut att = vec![0.0; h * len];
        rolloutpipe_backends::cpu::ops::attention_fwd(
            &mut want, &mut att, &q, &k, &v, 1, len, h, kvh, hd,
        );
        let what = format!(
            "decode at position {} (G {}, head_dim {hd})",
            len - 1,
            h / kvh
        );
        assert_close(&what, &got, &want, tol::ATTENTION);
    }
}

/// Splitting a row's keys over launches changes no bit: windows of one chunk, of three, and
/// one launch for all 700 keys (below llvmpipe's limit) give the same output.
#[test]
fn attention_decode_windows_give_the_same_bits() {
    let Some(g) = device::gpu() else { return };
    let whole = long_decode(&g, 8, 2, 64, 700, Some(1 << 20)).0;
    for w in [64, 192] {
        let split = long_decode(&g, 8, 2, 64, 700, Some(w)).0;
        let same = split
            .iter()
            .zip(&whole)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "window {w}: decode output differs from one launch");
    }
}
