#!/usr/bin/env bash
# Clippy on the crates that opt into the workspace lints (`[workspace.lints]` in the root
# Cargo.toml: clippy's default set, plus dbg!/todo!/unimplemented!): the harness (library,
# binary, tests, benches) and the C ABI, with warnings as errors. The CUDA code has its own
# clippy run in cuda.sh; the core and the backends join this list once they are clean.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo clippy --version >/dev/null 2>&1 || rustup component add clippy
cargo clippy --locked -p rolloutpipe-harness -p rolloutpipe-capi --all-targets -- -D warnings
echo "clippy: clean"
