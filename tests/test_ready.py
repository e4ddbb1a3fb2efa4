"""The target model made ready for a job (hsx.target.model.Target, hsx.target.ready.ready_model): its config read and
its layers resolved once per job, the output format made from the target, the set-up's choices on a CPU."""

from __future__ import annotations

import dataclasses

from helpers import fault_argv, hsx_main, make_cfg

from hsx.schema import OutputFormat


def test_a_job_reads_its_models_config_once(tmp_path, monkeypatch, model4, small_chat_path):
    """Job.prepare reads the target; the model is loaded from that target, not from the recipe read again (two
    reads could resolve two different layer lists)."""
    import hsx.target.model

    real, reads = hsx.target.model.read_model_config, []
    monkeypatch.setattr(hsx.target.model, "read_model_config", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    rc, _, err = hsx_main(fault_argv(model4.path, small_chat_path, tmp_path / "out"))
    assert rc == 0, err
    assert reads == [str(model4.path.resolve())]


def test_load_model_builds_the_layers_of_the_target_it_is_given(model8):
    from hsx.target.model import load_model, read_target

    cfg = make_cfg(model8, [1, 2], False)
    target = dataclasses.replace(read_target(cfg), layers=[0, 5])  # not what cfg says: the target decides
    loaded = load_model(cfg, __import__("torch").device("cpu"), target=target)
    assert loaded.layers == [0, 5] and loaded.depth == 6 and len(loaded.base.layers) == 6


def test_the_targets_format_is_the_jobs(model8):
    from hsx.target.model import read_target

    cfg = dataclasses.replace(make_cfg(model8, "dflash", True), storage_dtype="float8_e4m3", nonfinite="keep")
    target = read_target(cfg)
    assert target.format == OutputFormat(5, 64, True, "float8_e4m3", 0, True)
    assert target.format == OutputFormat.of_job(cfg, target.layers, target.hidden_size, target.final_hidden)


def test_ready_model_on_a_cpu_says_which_options_do_not_apply(model4):
    from hsx.run import current_process
    from hsx.target.model import read_target
    from hsx.target.ready import CPU_TOKEN_BUDGET, ready_model

    cfg = dataclasses.replace(make_cfg(model4, [1], False), experts_implementation="eager", fp8_gemm="triton")
    lines = []
    ready = ready_model(cfg, current_process(), read_target(cfg), log=lines.append)
    assert ready.owns_model and ready.budget == CPU_TOKEN_BUDGET and not ready.compile
    assert ready.fp8_gemm is None and not ready.fp8_matmuls and ready.prepared.packing == "none"
    assert ready.kernels["attn_implementation"] == ready.kernels["attn_implementation_requested"] == "sdpa"
    assert [line.split(" does not apply")[0] for line in lines[:2]] == [
        "hsx: --experts-implementation eager", "hsx: --fp8-gemm triton"]
    again = ready_model(cfg, current_process(), read_target(cfg), loaded=ready.loaded, log=lines.append)
    assert again.loaded is ready.loaded and not again.owns_model  # a caller's model: its compile outlives the job
