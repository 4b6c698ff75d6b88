"""The worked example of docs/ray.md (examples/slime_style_loop.py): a Slime-style
generate-then-train loop on Ray actors whose admissions, aborts, dispatch and micro-batches
come from the core. It trains (the weights move, the rewarded first tokens gain probability)
and the core's counters add up: every drawn prompt is trained, filtered or aborted."""

import importlib.util
import pathlib
import sys

import pytest

ray = pytest.importorskip("ray")

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "slime_style_loop.py"


def load_example():
    spec = importlib.util.spec_from_file_location("slime_style_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    # The workers cannot import a module loaded from a path: ship its actors by value.
    ray.cloudpickle.register_pickle_by_value(module)
    return module


def test_slime_style_loop_trains_and_counts_every_prompt(ray_cluster, tmp_path):
    import rolloutpipe as rp

    ex = load_example()
    rp.write_tiny_model(str(tmp_path / "model"), seed=0)
    steps = 6
    r = ex.run(str(tmp_path / "model"), steps=steps, seed=0)
    assert len(r["counters"]) == steps
    for c in r["counters"]:
        filtered = (c["filtered_zero_variance"] + c["filtered_non_finite"]
                    + c["filtered_attempts"] + c["filtered_skipped"])
        assert c["drawn"] == c["trained"] + filtered + c["aborted"], c
        assert c["in_flight"] == 0, c
        assert c["trained"] == 4, "every step trains a full batch"
    assert sum(c["filtered_zero_variance"] for c in r["counters"]) > 0, \
        "zero-variance groups are filtered and replaced"
    assert sum(c["requests_aborted"] for c in r["counters"]) > 0, \
        "requests running when the batch is final are cancelled on their engines"
    assert len(r["grad_norms"]) == steps and all(g > 0 for g in r["grad_norms"])
    assert ex.max_weight_change(r["weights_before"], r["weights_after"]) > 1e-3
    assert r["mass_after"] > r["mass_before"] + 0.05, (r["mass_before"], r["mass_after"])
