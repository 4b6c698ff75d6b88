//! `simulate --sweep`: the sensitivity sweeps beside the main table (the baseline's
//! over-sampling chunk and the engines' concurrency, the frontier width, the trainer pool
//! size), each written as CSV (and text or a plot) under `--out`.
use std::path::Path;

use anyhow::Context;

use super::{jobs_of, run_all};
use crate::plot::{self, Series};
use crate::sim::RunResult;
use crate::sim::config::{Mode, QueueOrder, Schedule, SimConfig};

/// Mean of the r2t cut of `mode` against sync over the runs of one sweep point.
fn mean_cut(results: &[RunResult], sync: &[RunResult], mode: Mode) -> f64 {
    let cuts: Vec<f64> = results
        .iter()
        .filter(|r| r.mode == mode)
        .filter_map(|r| {
            let s = sync
                .iter()
                .find(|s| s.profile == r.profile && s.setting == r.setting)?;
            Some((s.mean_r2t() - r.mean_r2t()) / s.mean_r2t())
        })
        .collect();
    cuts.iter().sum::<f64>() / cuts.len().max(1) as f64
}

/// A point of the swept axes: (over-sampling draw factor, concurrency).
type SweepPoint = (u32, u32);
/// One mode's r2t cuts over the settings.
type ModeCuts = (Schedule, Vec<f64>);

/// The swept axes: the baseline's over-sampling chunk (`draw_batch` B or 2B) and the per-engine
/// concurrency (`sglang_server_concurrency`), for every setting and the on-policy modes. Writes
/// `sweep_axes.csv` (one line per run) and `sweep_axes.txt` (per mode: the range of the r2t cut
/// over all settings at each axis point, and over everything).
fn sweep_axes(cfg: &SimConfig, out: &Path, threads: usize) -> anyhow::Result<()> {
    // The on-policy overlapping modes: CGP and RolloutPipe, and CGP with its tail policies.
    let modes: Vec<Schedule> = (Schedule::NAMED.into_iter())
        .filter(|m| m.mode.pipelined() && cfg.run.modes.contains(m))
        .collect();
    let mut csv = String::from(
        "draw_factor,concurrency,profile,setting,mode,r2t_s,r2t_cut,bound_cut,wait_ratio,slime_wait\n",
    );
    let mut summary: Vec<(SweepPoint, Vec<ModeCuts>)> = Vec::new();
    for draw in [1u32, 2] {
        for conc in [32u32, 128, 512] {
            let mut c = cfg.clone();
            c.rollout.max_running = conc;
            for s in c.setting.values_mut() {
                s.max_running = None;
                s.draw_batch = s.batch * draw;
            }
            c.run.modes = std::iter::once(Mode::Sync.into())
                .chain(modes.iter().copied())
                .collect();
            let results: Vec<RunResult> = run_all(&c, &jobs_of(&c, None), threads)?
                .into_iter()
                .map(|s| s.result)
                .collect();
            let mut per_mode: Vec<ModeCuts> = modes.iter().map(|&m| (m, vec![])).collect();
            for r in results.iter().filter(|r| r.mode != Mode::Sync) {
                let Some(s) = results.iter().find(|s| {
                    s.mode == Mode::Sync && s.profile == r.profile && s.setting == r.setting
                }) else {
                    continue;
                };
                let cut = (s.mean_r2t() - r.mean_r2t()) / s.mean_r2t();
                let bound = (s.mean_r2t() - s.mean_ideal()) / s.mean_r2t();
                csv.push_str(&format!(
                    "{draw},{conc},{},{},{},{:.6},{:.6},{:.6},{:.6},{:.6}\n",
                    r.profile,
                    r.setting,
                    r.mode,
                    r.mean_r2t(),
                    cut,
                    bound,
                    r.mean_wait_ratio(),
                    r.mean_slime_wait_ratio()
                ));
                if let Some((_, v)) = per_mode.iter_mut().find(|(m, _)| *m == r.mode) {
                    v.push(cut);
                }
            }
            summary.push(((draw, conc), per_mode));
        }
    }
    std::fs::write(out.join("sweep_axes.csv"), csv).context("writing sweep_axes.csv")?;
    let txt = axes_summary(cfg, &modes, &summary);
    std::fs::write(out.join("sweep_axes.txt"), &txt).context("writing sweep_axes.txt")?;
    print!("{txt}");
    Ok(())
}

/// `sweep_axes.txt`: per mode, the range of the r2t cut over the settings at each axis point
/// and over all of them, after which axis point the main table ran at.
fn axes_summary(
    cfg: &SimConfig,
    modes: &[Schedule],
    summary: &[(SweepPoint, Vec<ModeCuts>)],
) -> String {
    let range = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        format!("{:.1}% .. {:.1}%", 100.0 * lo, 100.0 * hi)
    };
    let mut txt = String::from(
        "r2t cut vs sync (same draw_batch and concurrency), range over the selected settings\n",
    );
    // Which axis point the main table ran at, if any.
    let draw_default = cfg
        .setting
        .values()
        .all(|s| s.draw_batch == s.batch)
        .then_some(1)
        .or_else(|| {
            cfg.setting
                .values()
                .all(|s| s.draw_batch == 2 * s.batch)
                .then_some(2)
        });
    let conc = cfg.rollout.max_running;
    let conc_default = cfg
        .setting
        .values()
        .all(|s| s.max_running(&cfg.rollout) == conc);
    match draw_default {
        Some(d) if conc_default && [32, 128, 512].contains(&conc) => txt.push_str(&format!(
            "default (table.txt): draw_batch {d}B, {conc} per engine\n"
        )),
        _ => txt.push_str("default (table.txt): not an axis point of this sweep\n"),
    }
    for &m in modes {
        txt.push_str(&format!("\n{m}\n"));
        let mut all = Vec::new();
        for ((draw, conc), per_mode) in summary {
            if let Some((_, v)) = per_mode.iter().find(|(x, _)| *x == m) {
                txt.push_str(&format!(
                    "  draw_batch {draw}B, {conc:>3} per engine: {}\n",
                    range(v)
                ));
                all.extend_from_slice(v);
            }
        }
        txt.push_str(&format!("  over all axis points: {}\n", range(&all)));
    }
    txt
}

pub(super) fn sweeps(
    cfg: &SimConfig,
    out: &Path,
    threads: usize,
    base: &[RunResult],
) -> anyhow::Result<()> {
    sweep_axes(cfg, out, threads)?;
    let sync: Vec<RunResult> = base
        .iter()
        .filter(|r| r.mode == Mode::Sync)
        .cloned()
        .collect();
    sweep_frontier(cfg, out, threads, &sync)?;
    sweep_trainer(cfg, out, threads)
}

/// The frontier widths swept.
const WIDTHS: [u32; 7] = [0, 1, 2, 4, 8, 16, 64];

/// Frontier width: RolloutPipe only (the other modes do not use it), per setting. Under a
/// group-major baseline order FIFO already admits the frontier first, so the sweep also runs
/// with the interleaved order, where admission order matters.
fn sweep_frontier(
    cfg: &SimConfig,
    out: &Path,
    threads: usize,
    sync: &[RunResult],
) -> anyhow::Result<()> {
    let mut csv =
        String::from("submit_order,width,profile,setting,mode,r2t_s,r2t_cut,wait_ratio\n");
    let mut lines_fw: Vec<Series<(f64, f64)>> = Vec::new();
    let mut orders = vec![cfg.scheduler.submit_order];
    if cfg.scheduler.submit_order != QueueOrder::Interleaved {
        orders.push(QueueOrder::Interleaved);
    }
    for order in orders {
        let (rp_lines, cgp_lines) = frontier_order(cfg, threads, sync, order, &mut csv)?;
        lines_fw.extend(rp_lines);
        if order == QueueOrder::Interleaved {
            lines_fw.extend(cgp_lines);
        }
    }
    std::fs::write(out.join("sweep_frontier.csv"), csv).context("writing sweep_frontier.csv")?;
    plot::lines(
        &out.join("sweep_frontier.svg"),
        "Frontier width: r2t cut vs sync (mean over profiles)",
        "frontier width (extra groups)",
        "cut, percent",
        &lines_fw,
    )
}

/// Per-setting lines of the cut against sync over the frontier widths.
type CutLines = Vec<Series<(f64, f64)>>;

/// The frontier sweep under one baseline order: its CSV lines, and per setting the
/// RolloutPipe and CGP lines of the cut against sync.
fn frontier_order(
    cfg: &SimConfig,
    threads: usize,
    sync: &[RunResult],
    order: QueueOrder,
    csv: &mut String,
) -> anyhow::Result<(CutLines, CutLines)> {
    let oname = format!("{order:?}").to_lowercase();
    let mut c = cfg.clone();
    c.scheduler.submit_order = order;
    let cgp = run_mode(&mut c, Mode::Cgp, threads)?;
    let lines = |m: Mode| -> CutLines {
        (cfg.run.settings.iter())
            .map(|s| Series::new(format!("{m} {s} {oname}"), Vec::new()))
            .collect()
    };
    let (mut rp_lines, mut cgp_lines) = (lines(Mode::Rolloutpipe), lines(Mode::Cgp));
    for w in WIDTHS {
        c.scheduler.frontier_width = w;
        let res = run_mode(&mut c, Mode::Rolloutpipe, threads)?;
        for r in res
            .iter()
            .chain(if w == 0 { cgp.iter() } else { [].iter() })
        {
            let s = sync
                .iter()
                .find(|s| s.profile == r.profile && s.setting == r.setting);
            let cut = s.map_or(f64::NAN, |s| (s.mean_r2t() - r.mean_r2t()) / s.mean_r2t());
            csv.push_str(&format!(
                "{oname},{w},{},{},{},{:.4},{:.5},{:.5}\n",
                r.profile,
                r.setting,
                r.mode,
                r.mean_r2t(),
                cut,
                r.mean_wait_ratio()
            ));
        }
        for (i, s) in cfg.run.settings.iter().enumerate() {
            let sel: Vec<RunResult> = res.iter().filter(|r| &r.setting == s).cloned().collect();
            rp_lines[i].values.push((
                f64::from(w),
                100.0 * mean_cut(&sel, sync, Mode::Rolloutpipe),
            ));
            let sel: Vec<RunResult> = cgp.iter().filter(|r| &r.setting == s).cloned().collect();
            cgp_lines[i]
                .values
                .push((f64::from(w), 100.0 * mean_cut(&sel, sync, Mode::Cgp)));
        }
    }
    Ok((rp_lines, cgp_lines))
}

/// `c`'s table in `mode` only.
fn run_mode(c: &mut SimConfig, mode: Mode, threads: usize) -> anyhow::Result<Vec<RunResult>> {
    c.run.modes = vec![mode.into()];
    let mut work = jobs_of(c, None);
    work.retain(|j| j.mode == mode);
    Ok(run_all(c, &work, threads)?
        .into_iter()
        .map(|s| s.result)
        .collect())
}

/// Trainer pool: the training share of a sync step bounds any overlap.
fn sweep_trainer(cfg: &SimConfig, out: &Path, threads: usize) -> anyhow::Result<()> {
    let gpus = [1u32, 2, 3, 4, 6, 8];
    let mut csv = String::from(
        "trainer_gpus,profile,setting,mode,r2t_s,r2t_cut,wait_ratio,rollout_s,train_s\n",
    );
    let modes = [Mode::Cgp, Mode::Rolloutpipe];
    let mut lines: Vec<Series<(f64, f64)>> = modes
        .iter()
        .map(|m| Series::new(m.name(), Vec::new()))
        .collect();
    let mut bound = Series::new("ideal bound", Vec::new());
    let mut share = Series::new("training share of sync step", Vec::new());
    for &g in &gpus {
        let mut c = cfg.clone();
        c.trainer.gpus = g;
        c.run.modes = [Mode::Sync, Mode::Cgp, Mode::Rolloutpipe]
            .map(Schedule::of)
            .to_vec();
        let res: Vec<RunResult> = run_all(&c, &jobs_of(&c, None), threads)?
            .into_iter()
            .map(|s| s.result)
            .collect();
        let sync_g: Vec<RunResult> = res
            .iter()
            .filter(|r| r.mode == Mode::Sync)
            .cloned()
            .collect();
        for r in &res {
            let s = sync_g
                .iter()
                .find(|s| s.profile == r.profile && s.setting == r.setting);
            let cut = s.map_or(f64::NAN, |s| (s.mean_r2t() - r.mean_r2t()) / s.mean_r2t());
            csv.push_str(&format!(
                "{g},{},{},{},{:.4},{:.5},{:.5},{:.4},{:.4}\n",
                r.profile,
                r.setting,
                r.mode,
                r.mean_r2t(),
                cut,
                r.mean_wait_ratio(),
                r.mean_rollout(),
                r.mean_trainer_busy()
            ));
        }
        for (i, m) in modes.iter().enumerate() {
            lines[i]
                .values
                .push((f64::from(g), 100.0 * mean_cut(&res, &sync_g, *m)));
        }
        let n = sync_g.len().max(1) as f64;
        let ideal = sync_g
            .iter()
            .map(|s| (s.mean_r2t() - s.mean_ideal()) / s.mean_r2t())
            .sum::<f64>()
            / n;
        let tshare = sync_g
            .iter()
            .map(|s| s.mean_trainer_busy() / s.mean_r2t())
            .sum::<f64>()
            / n;
        bound.values.push((f64::from(g), 100.0 * ideal));
        share.values.push((f64::from(g), 100.0 * tshare));
    }
    std::fs::write(out.join("sweep_trainer.csv"), csv).context("writing sweep_trainer.csv")?;
    lines.push(bound);
    lines.push(share);
    plot::lines(
        &out.join("sweep_trainer.svg"),
        "Trainer pool size: r2t cut vs sync (mean over 12 settings)",
        "trainer GPUs",
        "percent",
        &lines,
    )
}
