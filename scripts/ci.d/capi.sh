#!/usr/bin/env bash
# The C ABI from C: builds rolloutpipe-capi's static library, compiles harness/capi/tests/step.c
# with `cc` against the committed header, and runs it (it drives one whole step and exits
# non-zero on any counter mismatch); then runs HeapScheduler's unit tests under Miri, the one
# place with `unsafe` around the core (a self-referential owner of the slot storage). The
# header-is-current check, the C-ABI misuse tests and the random-call storm are `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/../.."
target="${CARGO_TARGET_DIR:-$PWD/target}"
cargo build -p rolloutpipe-capi --locked
cc -std=c99 -Wall -Wextra -Werror -I harness/capi/include harness/capi/tests/step.c \
  "$target/debug/librolloutpipe_capi.a" -lpthread -ldl -lm -o "$target/capi-step"
"$target/capi-step"
cargo +nightly miri test -p rolloutpipe-capi --lib --locked
