# Sourced by scripts/{mux,migrate}/measure.sh: interleaved repeats of `train` variants from one
# SFT start. The caller sets `out`, `reps`, `bin`, the `common` array of --set flags, and a
# function `variant NAME` that sets `mode` and the `extra` array; then `interleave NAME...`
# runs, for each repeat, each variant in the given order into OUT/NAME/repR.
interleave() {
  if [ ! -f "$out/sft/sft/model.safetensors" ]; then
    nice -n 10 "$bin" train --out "$out/sft" --force --mode sync "${common[@]}" \
      --set sft.steps=300 --set run.steps=1 >/dev/null 2>&1
  fi
  local start=(--set sft.steps=0 --set "model.dir=$out/sft/sft") r v
  for r in $(seq 1 "$reps"); do
    for v in "$@"; do
      mode=rolloutpipe; extra=()
      variant "$v"
      nice -n 10 "$bin" train --out "$out/$v/rep$r" --force --mode "$mode" "${common[@]}" \
        "${start[@]}" "${extra[@]}" >/dev/null 2>&1
      echo "done $v rep$r" >&2
    done
  done
}
