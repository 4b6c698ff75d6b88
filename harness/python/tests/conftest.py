"""One local Ray instance (127.0.0.1, 4 logical CPUs) for every test that needs one: starting
Ray takes seconds, so the Ray tests and the worked example share it."""

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from rolloutpipe import ray as rp_ray

    node = rp_ray.start_ray(num_cpus=4)
    yield node
    ray.shutdown()
