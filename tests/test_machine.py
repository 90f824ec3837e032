"""Report headers say how our loop's OpenMP threads waited: it moves a batch-1 step by up to 2x."""

from taps_ray.machine import omp_wait_line


def test_omp_wait_line_names_the_policy_it_ran_under(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert omp_wait_line() == "OpenMP's own wait, as a serve replica's"
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert omp_wait_line() == "OMP_WAIT_POLICY=PASSIVE"
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")  # a replica's default (ray_runtime.OMP_WAIT_ENV)
    assert omp_wait_line() == "GOMP_SPINCOUNT=300000 (OMP_WAIT_POLICY=PASSIVE)"
