"""torch's CPU threads per process: from the cores and the processes on this machine, as accelerate sets them."""

import torch

from hsx.data import cpu_count
from hsx.run import cpu_threads, current_process


def test_threads_share_the_cores_between_local_processes():
    cores = cpu_count()
    assert cpu_threads(1, cpu_device=False, environ={}) == cores
    assert cpu_threads(2, cpu_device=False, environ={}) == max(1, cores // 2)
    assert cpu_threads(cores * 4, cpu_device=False, environ={}) == 1  # never 0
    # on a CPU device one core is left to the map thread that writes while the producer thread computes
    assert cpu_threads(1, cpu_device=True, environ={}) == max(1, cores - 1)


def test_omp_num_threads_wins():
    assert cpu_threads(8, cpu_device=True, environ={"OMP_NUM_THREADS": "3"}) == 3
    assert cpu_threads(1, cpu_device=False, environ={"OMP_NUM_THREADS": "junk"}) == cpu_count()


def test_a_job_sets_them(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(max(1, cpu_count()) + 3)  # oversubscribed, as torch's default is under load
        proc = current_process()
        assert torch.get_num_threads() == cpu_threads(1, cpu_device=proc.device.type == "cpu", environ={})
    finally:
        torch.set_num_threads(before)
