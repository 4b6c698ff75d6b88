#!/usr/bin/env bash
# Runs every test of the workspace on a fresh machine: installs what the
# tests need (Vulkan on the CPU through Mesa's lavapipe, the nightly
# toolchain's rust-src and miri for the no-alloc build and Miri), then runs
# `cargo test` for the whole workspace and each extra check in scripts/ci.d/.
#
# The core's proofs (scripts/ci.d/core.sh: Miri and the bounded fuzz run are single-threaded)
# run in the background beside the rest, so the second core is not idle while they interpret;
# their log is printed when they end, and their failure fails the whole run. Each part prints
# how long it took in wall time and in CPU time (user + sys of everything it ran), so the CI
# budget (30 minutes on 2 cores) can be watched, and so a part's cost can be read even on a
# machine shared with other work, where wall times mean little.
set -euo pipefail
cd "$(dirname "$0")/.."
total=$SECONDS
TIMEFORMAT='   (%R s wall, %U s user + %S s sys CPU)'
time bash scripts/setup.sh

core_log=$(mktemp)
core_pid=
# A failing foreground part ends the run: stop the background proofs with it.
trap '[ -n "$core_pid" ] && kill "$core_pid" 2>/dev/null; rm -f "$core_log"' EXIT
core_t0=$SECONDS
# Its own target directory: in the shared one its builds would wait on cargo's build-directory lock
# until the workspace build ahead of them ended (seen here: their first build sat blocked until then).
{ time CARGO_TARGET_DIR="$PWD/target/core-proofs" bash scripts/ci.d/core.sh; } >"$core_log" 2>&1 &
core_pid=$!

t0=$SECONDS
echo "== cargo test --workspace"
time cargo test --workspace --locked
echo "== cargo test --workspace took $((SECONDS - t0)) s"
for check in scripts/ci.d/*.sh; do
  [ -e "$check" ] || continue
  [ "$check" = scripts/ci.d/core.sh ] && continue
  t0=$SECONDS
  echo "== $check"
  time bash "$check"
  echo "== $check took $((SECONDS - t0)) s"
done

echo "== scripts/ci.d/core.sh (ran in the background; its log follows)"
core_rc=0
wait "$core_pid" || core_rc=$?
core_pid=
cat "$core_log"
echo "== scripts/ci.d/core.sh ended $((SECONDS - core_t0)) s after it started (exit $core_rc)"
[ "$core_rc" = 0 ] || { echo "scripts/ci.d/core.sh failed"; exit "$core_rc"; }
echo "all checks passed in $((SECONDS - total)) s"
