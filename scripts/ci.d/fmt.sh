#!/usr/bin/env bash
# Formatting: every crate as `cargo fmt` leaves it (the workspace, and the two crates outside
# it: the Python extension and the fuzz targets). A few seconds; it caught two merges that had
# landed unformatted.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt
cargo fmt --all --check
(cd harness/python && cargo fmt --check)
(cd fuzz && cargo fmt --check)
echo "formatting: clean"
