"""The vLLM layout on a two-node Ray cluster on this machine, every Ray server on 127.0.0.1:

    .venv-vllm/bin/python scripts/vllm/two_node.py --out runs/vllm-two-node

A head raylet (2 CPUs, resource ``rp_head``) and a second raylet (2 CPUs, ``rp_node2``), each
with its own object store, joined to the head's GCS; the job (the tiny job of the tests,
rolloutpipe mode) joins the cluster with ``--address`` and lays the trainer and the two vLLM
engines out with ``spread``. It checks that both nodes are alive on 127.0.0.1, that the actors
ran on both nodes (so an engine on the other node than the trainer fetched each sync's
weights object across raylets), that every group is accounted for, and prints where each
actor ran and the weight-sync seconds. Exit status 0 only when every check passed.

Why not ``ray start --address``: the switch that keeps Ray on the loopback address
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, docs/ray.md) makes ``ray start --address`` abort
("Multi-node Ray clusters are not supported on Windows and OSX"); with it on, Ray registers
the machine's interface address and its servers listen on every interface (measured). The
second raylet is therefore started the way Ray's own test suite runs several nodes on one
machine, ``ray.cluster_utils.Cluster.add_node``: a separate raylet process with its own object
store and resources, on 127.0.0.1. Its processes are stopped by their ids when the script ends.
"""

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "..", "harness", "python", "tests_vllm")


def main(argv=None):
    p = argparse.ArgumentParser(description="the vLLM layout on a two-node local Ray cluster")
    p.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    a = p.parse_args(argv)
    from rolloutpipe import ray as rp_ray  # sets the loopback switch before Ray is imported
    from rolloutpipe import vllm as rp_vllm
    import ray
    from ray.cluster_utils import Cluster

    sys.path.insert(0, TESTS)
    from conftest import TINY

    out = a.out or tempfile.mkdtemp(prefix="rp-vllm-two-node-")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"rp_head": 1}, "include_dashboard": False})
    failures = []
    try:
        cluster.add_node(num_cpus=2, resources={"rp_node2": 1})
        cluster.wait_for_nodes()
        os.makedirs(out, exist_ok=True)
        cfg = os.path.join(out, "tiny.toml")
        with open(cfg, "w") as f:
            f.write(TINY)
        run_dir = os.path.join(out, "run")
        r = rp_vllm.train(cfg, run_dir, sets=['run.mode="rolloutpipe"', "run.steps=3"],
                          use_ray=True, address=cluster.address, placement="spread",
                          force=True)
        nodes = [n for n in ray.nodes() if n["Alive"]]
        addrs = sorted(n["NodeManagerAddress"] for n in nodes)
        print(f"nodes: {len(nodes)} alive at {addrs}")
        if len(nodes) != 2 or set(addrs) != {rp_ray.LOOPBACK}:
            failures.append(f"expected 2 nodes on {rp_ray.LOOPBACK}, got {addrs}")
        names = {n["NodeID"]: ("head" if "rp_head" in n["Resources"] else "node2")
                 for n in nodes}
        pl = r["ray"]["placements"]
        where = {"trainer": names.get(pl["trainer"]["node_id"]),
                 "engines": [names.get(e["node_id"]) for e in pl["engines"]]}
        print(f"placements (spread): {json.dumps(where)}")
        if len({where["trainer"], *where["engines"]}) != 2:
            failures.append(f"the actors did not use both nodes: {where}")
        remote = [i for i, n in enumerate(where["engines"]) if n != where["trainer"]]
        if not remote:
            failures.append("no engine on another node than the trainer")
        if r["ray"]["trainer_publishes"] != r["steps"]:
            failures.append(f"{r['ray']['trainer_publishes']} syncs read the trainer's own put, "
                            f"expected {r['steps']}")
        for c in r["counters"]:
            filtered = (c["filtered_zero_variance"] + c["filtered_non_finite"]
                        + c["filtered_attempts"] + c["filtered_skipped"])
            if c["drawn"] != c["trained"] + filtered + c["aborted"] or c["in_flight"]:
                failures.append(f"unaccounted groups: {c}")
        syncs = [m["sync_s"] for m in r["metrics"]]
        print(f"steps {r['steps']}, weight sync s per step {[round(s, 4) for s in syncs]}, "
              f"trainer puts {r['ray']['trainer_publishes']}, engines on the trainer's other "
              f"node: {remote}")
        for e in r["ray"]["engine_reports"]:
            print(f"engine {e.get('engine')}: start {e.get('start_s', 0):.1f}s, loads "
                  f"{[round(x, 4) for x in e.get('sync_s', [])]}, order {e.get('order')}")
    finally:
        ray.shutdown()
        cluster.shutdown()
    for f in failures:
        print(f"FAILED: {f}")
    print("two-node run: " + ("ok" if not failures else f"{len(failures)} check(s) failed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
