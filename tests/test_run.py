"""torch's CPU threads per process: from the cores and the processes on this machine, as accelerate sets them; a
launcher's variable that is no count (WORLD_SIZE=abc, OMP_NUM_THREADS of 20 digits) is one line or as if unset."""

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


import pytest  # noqa: E402

from helpers import fault_argv, hsx_main, the_error_line  # noqa: E402


# ---- a launcher's environment --------------------------------------------------------------------------------------

@pytest.mark.parametrize("var,value", [("WORLD_SIZE", "abc"), ("WORLD_SIZE", "0"), ("WORLD_SIZE", "-3"),
                                       ("WORLD_SIZE", "1" * 5000), ("LOCAL_WORLD_SIZE", "x")])
def test_a_launcher_variable_that_is_no_count_is_one_line(model4, small_chat_path, tmp_path, monkeypatch, var, value):
    """WORLD_SIZE=abc (a ValueError in int()) or WORLD_SIZE=0 (a world of no process, which would fail at the first
    all_gather) is one line naming the variable, with nothing written."""
    monkeypatch.setenv(var, value)
    rc, _, err = hsx_main(fault_argv(model4.path, small_chat_path, tmp_path / "o"))
    line = the_error_line(err)
    assert rc != 0 and f"environment variable {var}=" in line, line
    assert not (tmp_path / "o" / "data").exists() or not any((tmp_path / "o" / "data").iterdir())


def test_an_omp_num_threads_torch_cannot_take_is_as_if_unset():
    """OMP_NUM_THREADS of 20 digits reached torch.set_num_threads (an overflow traceback)."""
    from hsx.run import cpu_threads

    assert cpu_threads(1, False, {"OMP_NUM_THREADS": "9" * 20}) == cpu_threads(1, False, {})
    assert cpu_threads(1, False, {"OMP_NUM_THREADS": "3"}) == 3
