//! Whether an adapter can run `matmul_fwd_coop`, the forward product on cooperative matrices
//! (tensor cores), and with which fragment shape and subgroup size.
//!
//! It needs three things, each named when missing so a refusal is one line a user can act on:
//! - the features [`COOP_FEATURES`]: `shader-f16` (f16 operands in workgroup memory) and
//!   `wgpu-cooperative-matrix` (wgpu's experimental `EXPERIMENTAL_COOPERATIVE_MATRIX`, on
//!   Vulkan `VK_KHR_cooperative_matrix`, on Metal simdgroup matrices);
//! - an f16 x f16 -> f32 fragment of 8x8x8 or 16x16x16 ([`CoopTile`]; 16 preferred);
//! - one subgroup size (fragments belong to a subgroup and the kernel lays its workgroup out
//!   as [`MATMUL_COOP_SUBGROUPS`] of them), and a workgroup of that many subgroups allowed.
//!
//! Mesa 26's lavapipe has all three (8x8x8, subgroup 8); Mesa 22.3's (Debian bookworm's, the
//! CI machine's system driver) has none, and `scripts/coop_lavapipe.py` unpacks a newer one
//! for the tests. An H200 through NVIDIA's Vulkan driver offers 16x16x16 at subgroup 32.

use rolloutpipe_kernels::{CoopTile, MATMUL_COOP_SUBGROUPS};

/// The device features `matmul_fwd_coop` needs.
pub const COOP_FEATURES: wgpu::Features =
    wgpu::Features::SHADER_F16.union(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX);

/// What an adapter offers `matmul_fwd_coop`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoopSupport {
    /// The fragment shape the kernel is compiled for.
    pub tile: CoopTile,
    /// The adapter's subgroup size (the pipeline override `SG`).
    pub subgroup: u32,
}

impl CoopSupport {
    /// The adapter's support, or why it has none (one line).
    pub fn of(adapter: &wgpu::Adapter) -> Result<CoopSupport, String> {
        let info = adapter.get_info();
        let props = if adapter
            .features()
            .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
        {
            adapter.cooperative_matrix_properties()
        } else {
            Vec::new()
        };
        Self::decide(
            &info.name,
            adapter.features(),
            &props,
            (info.subgroup_min_size, info.subgroup_max_size),
            adapter.limits().max_compute_invocations_per_workgroup,
        )
    }

    /// [`CoopSupport::of`] from what the adapter reports (separate so that every refusal is
    /// tested without such an adapter).
    pub fn decide(
        name: &str,
        features: wgpu::Features,
        props: &[wgpu::CooperativeMatrixProperties],
        subgroup: (u32, u32),
        max_invocations: u32,
    ) -> Result<CoopSupport, String> {
        let missing: Vec<&str> = [
            (wgpu::Features::SHADER_F16, "shader-f16"),
            (
                wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
                "wgpu-cooperative-matrix",
            ),
        ]
        .iter()
        .filter(|(f, _)| !features.contains(*f))
        .map(|(_, n)| *n)
        .collect();
        if !missing.is_empty() {
            return Err(format!(
                "adapter {name:?} lacks the feature{} {} that tensor cores need",
                if missing.len() > 1 { "s" } else { "" },
                missing.join(" and ")
            ));
        }
        use wgpu::CooperativeScalarType as S;
        let has = |t: CoopTile| {
            let e = t.edge();
            props.iter().any(|p| {
                (p.m_size, p.n_size, p.k_size) == (e, e, e)
                    && p.ab_type == S::F16
                    && p.cr_type == S::F32
            })
        };
        let Some(tile) = [CoopTile::T16, CoopTile::T8].into_iter().find(|&t| has(t)) else {
            let offered: Vec<String> = props
                .iter()
                .map(|p| {
                    format!(
                        "{}x{}x{} {:?}->{:?}",
                        p.m_size, p.n_size, p.k_size, p.ab_type, p.cr_type
                    )
                })
                .collect();
            return Err(format!(
                "adapter {name:?} has cooperative matrices but no 8x8x8 or 16x16x16 f16 x f16 -> f32 \
                 fragment (it offers: {})",
                if offered.is_empty() {
                    "none".to_string()
                } else {
                    offered.join(", ")
                }
            ));
        };
        let (lo, hi) = subgroup;
        if lo != hi {
            return Err(format!(
                "adapter {name:?} runs subgroups of {lo} to {hi} lanes; tensor cores need one \
                 fixed subgroup size"
            ));
        }
        if MATMUL_COOP_SUBGROUPS * lo > max_invocations {
            return Err(format!(
                "adapter {name:?} allows {max_invocations} invocations per workgroup; tensor \
                 cores need {} ({MATMUL_COOP_SUBGROUPS} subgroups of {lo})",
                MATMUL_COOP_SUBGROUPS * lo
            ));
        }
        Ok(CoopSupport { tile, subgroup: lo })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wgpu::CooperativeScalarType as S;

    fn prop(e: u32, ab: S, cr: S) -> wgpu::CooperativeMatrixProperties {
        wgpu::CooperativeMatrixProperties {
            m_size: e,
            n_size: e,
            k_size: e,
            ab_type: ab,
            cr_type: cr,
            saturating_accumulation: false,
        }
    }

    #[test]
    fn support_needs_features_a_fragment_and_one_subgroup_size() {
        let lvp = [prop(8, S::F16, S::F32), prop(8, S::F32, S::F32)];
        let both = COOP_FEATURES;
        assert_eq!(
            CoopSupport::decide("llvmpipe", both, &lvp, (8, 8), 1024),
            Ok(CoopSupport {
                tile: CoopTile::T8,
                subgroup: 8
            })
        );
        // 16x16x16 is preferred where both are offered.
        let nv = [prop(8, S::F16, S::F32), prop(16, S::F16, S::F32)];
        assert_eq!(
            CoopSupport::decide("H200", both, &nv, (32, 32), 1024).map(|s| s.tile),
            Ok(CoopTile::T16)
        );
        let e = CoopSupport::decide("old", wgpu::Features::empty(), &[], (8, 8), 1024)
            .expect_err("no features");
        assert!(
            e.contains("shader-f16 and wgpu-cooperative-matrix") && !e.contains('\n'),
            "{e}"
        );
        let e = CoopSupport::decide("f16 only", wgpu::Features::SHADER_F16, &[], (8, 8), 1024)
            .expect_err("no coop");
        assert!(e.contains("feature wgpu-cooperative-matrix that"), "{e}");
        let e = CoopSupport::decide("f32 only", both, &[prop(8, S::F32, S::F32)], (8, 8), 1024)
            .expect_err("no f16 fragment");
        assert!(e.contains("offers: 8x8x8 F32->F32"), "{e}");
        let e = CoopSupport::decide("amd", both, &nv, (32, 64), 1024).expect_err("varying");
        assert!(e.contains("32 to 64 lanes"), "{e}");
        let e = CoopSupport::decide("small", both, &nv, (64, 64), 128).expect_err("too many");
        assert!(e.contains("need 256"), "{e}");
    }
}
