//! Host weight snapshots loaded straight into a CPU model's storage.
//!
//! A rollout engine receives a host snapshot at every weight sync, already in its own dtype.
//! Going through named f32 [`Weights`](crate::weights::Weights) and a flattened f32 copy (as
//! this did before) held two f32 copies of the whole model per engine while it loaded, and the
//! engines load at once: a bf16 engine's sync peaked at about 4× its own weights, so four bf16
//! engines peaked higher than four f32 ones. Here the snapshot is checked in full first
//! (the same checks as `Weights::validate`: every parameter, its shape, finite values, nothing
//! extra), so a bad snapshot leaves the engine's weights untouched, then written tensor by
//! tensor into the storage, converting only a tensor whose dtype differs from the storage's.
use std::collections::HashMap;

use super::model::Model;
use super::store::{HalfData, HalfStore};
use crate::error::{BackendError, Result};
use crate::seam::{DType, TensorData, TypedTensor};

/// Loads `ts` (a host snapshot's tensors) into `m`'s storage: its f32 parameters in place, or
/// a new 16-bit store. Values end bit-identical to loading the same snapshot through f32.
pub(super) fn load_host(m: &mut Model<f32>, ts: &[(String, TypedTensor)]) -> Result<()> {
    let by_name = check(m, ts)?;
    let layout = &m.layout;
    match &m.half {
        Some(h) => {
            let dtype = h.data.dtype();
            let mut out = match dtype {
                DType::Bf16 => HalfData::Bf16(vec![half::bf16::ZERO; layout.total]),
                _ => HalfData::F16(vec![half::f16::ZERO; layout.total]),
            };
            for e in &layout.entries {
                let src = &by_name[e.name.as_str()].data;
                // Only a tensor in another dtype is converted (nearest-even, as a sync through
                // f32 rounds); past f16's range that is an error naming the tensor.
                let converted;
                let src = if src.dtype() == dtype {
                    src
                } else {
                    converted = src.to_dtype(dtype);
                    if let TensorData::F16(v) = &converted
                        && v.iter().any(|x| !x.is_finite())
                    {
                        return Err(BackendError::invalid(
                            "weight dtype",
                            format!(
                                "{}: a value does not fit in f16 (|x| <= 65504); use BF16",
                                e.name
                            ),
                        ));
                    }
                    &converted
                };
                let range = e.offset..e.offset + e.len;
                match (src, &mut out) {
                    (TensorData::Bf16(v), HalfData::Bf16(o)) => o[range].copy_from_slice(v),
                    (TensorData::F16(v), HalfData::F16(o)) => o[range].copy_from_slice(v),
                    (t, o) => {
                        return Err(BackendError::invalid(
                            "weight snapshot",
                            format!("{}: {} data for a {} store", e.name, t.dtype(), o.dtype()),
                        ));
                    }
                }
            }
            m.half = Some(HalfStore::new(layout, out)?);
        }
        None => {
            for e in &layout.entries {
                by_name[e.name.as_str()]
                    .data
                    .write_f32(&mut m.params[e.offset..e.offset + e.len])?;
            }
        }
    }
    Ok(())
}

/// Every parameter of `m`'s layout present once with its shape and finite values, and no other
/// tensor; the tensors by name.
fn check<'t>(
    m: &Model<f32>,
    ts: &'t [(String, TypedTensor)],
) -> Result<HashMap<&'t str, &'t TypedTensor>> {
    let by_name: HashMap<&str, &TypedTensor> = ts.iter().map(|(n, t)| (n.as_str(), t)).collect();
    for e in &m.layout.entries {
        let t = by_name
            .get(e.name.as_str())
            .ok_or_else(|| BackendError::MissingTensor(e.name.clone()))?;
        if t.shape != e.shape {
            return Err(BackendError::shape(
                e.name.clone(),
                format!("{:?}", e.shape),
                format!("{:?}", t.shape),
            ));
        }
        if t.data.len() != e.len {
            return Err(BackendError::shape(e.name.clone(), e.len, t.data.len()));
        }
        let finite = match &t.data {
            TensorData::F32(v) => v.iter().all(|x| x.is_finite()),
            TensorData::Bf16(v) => v.iter().all(|x| x.is_finite()),
            TensorData::F16(v) => v.iter().all(|x| x.is_finite()),
        };
        if !finite {
            return Err(BackendError::non_finite(e.name.clone()));
        }
    }
    if by_name.len() != ts.len() || ts.len() != m.layout.entries.len() {
        let known: std::collections::HashSet<&str> =
            m.layout.entries.iter().map(|e| e.name.as_str()).collect();
        return Err(match ts.iter().find(|(n, _)| !known.contains(n.as_str())) {
            Some((extra, _)) => BackendError::UnexpectedTensor(extra.clone()),
            None => BackendError::invalid("weight snapshot", "a parameter is given twice"),
        });
    }
    Ok(by_name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;
    use crate::config::ModelConfig;
    use crate::seam::{RolloutEngine, SnapshotPayload, WeightSnapshot};
    use crate::weights::Weights;

    type Tensors = Vec<(String, TypedTensor)>;

    fn engine(dtype: DType, seed: u64) -> (ModelConfig, CpuBackend) {
        let cfg = ModelConfig::tiny();
        let w = Weights::random(&cfg, seed).unwrap();
        (
            cfg.clone(),
            CpuBackend::with_dtype(&cfg, &w, 1, dtype).unwrap(),
        )
    }

    /// What the engine stores, widened (exact).
    fn stored(b: &CpuBackend) -> Vec<f32> {
        b.flat_f32()
    }

    /// The old route: named f32 weights, flattened, rounded to the store's dtype.
    fn through_f32(cfg: &ModelConfig, w: &Weights, dtype: DType) -> Vec<f32> {
        let flat: Vec<f32> = crate::model::Layout::new(cfg).flatten(w).unwrap();
        match dtype {
            DType::F32 => flat,
            d => HalfData::round(&flat, d).unwrap().to_f32(),
        }
    }

    #[test]
    fn every_dtype_pair_loads_what_the_f32_route_loaded() {
        for engine_dtype in [DType::F32, DType::Bf16, DType::F16] {
            for snap_dtype in [DType::F32, DType::Bf16, DType::F16] {
                let (cfg, mut b) = engine(engine_dtype, 1);
                let w = Weights::random(&cfg, 2).unwrap();
                let snap = WeightSnapshot::host(&cfg, &w, snap_dtype).unwrap();
                b.load_weights(&snap).unwrap();
                let want = through_f32(&cfg, &snap.host_weights(&cfg).unwrap(), engine_dtype);
                let got = stored(&b);
                assert_eq!(got.len(), want.len());
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{engine_dtype} engine from a {snap_dtype} snapshot");
                assert_ne!(
                    got,
                    stored(&engine(engine_dtype, 1).1),
                    "the weights changed"
                );
            }
        }
    }

    #[test]
    fn a_bad_snapshot_is_refused_by_name_and_changes_nothing() {
        let (cfg, mut b) = engine(DType::Bf16, 1);
        let before = stored(&b);
        let w = Weights::random(&cfg, 2).unwrap();
        let good = WeightSnapshot::host(&cfg, &w, DType::Bf16).unwrap();
        let SnapshotPayload::Host(ts) = &good.payload else {
            panic!("a host snapshot")
        };
        let last = ts.len() - 1;
        let with = |f: &dyn Fn(&mut Tensors)| {
            let mut ts = ts.clone();
            f(&mut ts);
            WeightSnapshot {
                config: cfg.clone(),
                payload: SnapshotPayload::Host(ts),
            }
        };
        let nan = with(&|ts| {
            if let TensorData::Bf16(v) = &mut ts[last].1.data {
                v[0] = half::bf16::NAN;
            }
        });
        let missing = with(&|ts| {
            ts.remove(0);
        });
        let extra = with(&|ts| {
            let t = ts[0].1.clone();
            ts.push(("model.extra.weight".into(), t));
        });
        let reshaped = with(&|ts| {
            ts[0].1.shape.reverse();
        });
        let name0 = &ts[0].0;
        for (snap, says) in [
            (nan, ts[last].0.clone()),
            (missing, name0.clone()),
            (extra, "model.extra.weight".to_string()),
            (reshaped, name0.clone()),
        ] {
            let e = b.load_weights(&snap).unwrap_err().to_string();
            assert!(e.contains(&says), "{e} (expected {says})");
            assert_eq!(stored(&b), before, "a refused snapshot changed the weights");
        }
    }

    #[test]
    fn an_f32_value_past_f16_range_is_refused_naming_its_tensor() {
        let (cfg, mut b) = engine(DType::F16, 1);
        let mut w = Weights::random(&cfg, 2).unwrap();
        let name = w.tensors.keys().next().unwrap().clone();
        w.tensors.get_mut(&name).unwrap().data[0] = 1e6;
        let snap = WeightSnapshot::host(&cfg, &w, DType::F32).unwrap();
        let e = b.load_weights(&snap).unwrap_err().to_string();
        assert!(e.contains(&name) && e.contains("f16"), "{e}");
    }
}
