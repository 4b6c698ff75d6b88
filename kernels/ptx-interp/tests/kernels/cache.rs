//! kv_append: a step's new K/V rows land in their requests' cache rows (slot base +
//! position), other rows untouched, a destination past the cache skipped.

use rolloutpipe_kernels::PTX_ONLY;
use rolloutpipe_ptx_interp::{Arg, Device};

use crate::common::*;

#[test]
fn kv_append_scatters_rows_to_their_cache_rows() {
    let dev = Device::new();
    let p = PTX_ONLY
        .iter()
        .find(|p| p.name == "kv_append")
        .expect("kv_append");
    let m = dev
        .load_module(p.name, p.ptx)
        .unwrap_or_else(|e| panic!("{e}"));
    let k = K { dev, m };
    let mut r = rng(60);
    let (slots, slot_rows, kd) = (3usize, 8usize, 300usize);
    let rows = slots * slot_rows;
    // Request A (slot 0) prefills 3 rows at positions 0..3; request B (slot 2) decodes one at
    // position 5; a fifth row's window points past the cache.
    let qmeta: Vec<u32> = vec![0, 0, 0, 1, 0, 2, 16, 5, 16, 9];
    let n = qmeta.len() / 2;
    let (kn, vn) = (rand_f32(&mut r, n * kd, 1.0), rand_f32(&mut r, n * kd, 1.0));
    let (mut kc, mut vc) = (
        rand_f32(&mut r, rows * kd, 1.0),
        rand_f32(&mut r, rows * kd, 1.0),
    );
    let (pk, pv) = (k.up(&kc), k.up(&vc));
    k.run(
        "kv_append",
        cfg(n as u32, 256),
        &[
            pk.clone(),
            pv.clone(),
            k.up(&kn),
            k.up(&vn),
            k.up(&qmeta),
            Arg::U32(n as u32),
            Arg::U32(kd as u32),
            Arg::U32(rows as u32),
        ],
    );
    for t in 0..n {
        let row = (qmeta[2 * t] + qmeta[2 * t + 1]) as usize;
        if row < rows {
            kc[row * kd..][..kd].copy_from_slice(&kn[t * kd..][..kd]);
            vc[row * kd..][..kd].copy_from_slice(&vn[t * kd..][..kd]);
        }
    }
    assert_bits("kv_append kcache", &k.get::<f32>(&pk, rows * kd), &kc);
    assert_bits("kv_append vcache", &k.get::<f32>(&pv, rows * kd), &vc);
}
