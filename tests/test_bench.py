"""`hsx bench` smoke test on CPU (not a timing test): every run reports, and (c) writes real, loadable output."""

import json
import os
import re
import subprocess
import sys

import pytest

import hsx
from helpers import free_port, one_torch_thread
from hsx.cli import main


@pytest.mark.slow
def test_bench_tiny_reports_all_runs_and_keeps_output(tmp_path, capsys, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # --keep keeps its inputs too: not in the real /tmp
    report, out = tmp_path / "bench.json", tmp_path / "out"
    rc = main(["bench", "--shape", "tiny", "--count", "40", "--max-length", "256", "--subset-a", "6",
               "--subset-b", "40", "--json", str(report), "--output-dir", str(out), "--keep"])
    assert rc == 0
    r = json.loads(report.read_text())
    for run in ("a", "b", "c"):
        assert r[run]["tok_per_s"] > 0 and 0 < r[run]["mfu"] < 1, run
    c = r["c"]
    assert c["rows"] == 40 and c["tokens"] == r["tokens"]
    assert c["padding"] < r["b"]["padding"]  # length buckets vs dataset-order batches of 32
    assert 0 <= c["gpu_idle"] <= 1 and c["output_bytes"] > 0 and c["compile_warmup_seconds"] > 0
    assert r["c_over_a"] == c["tok_per_s"] / r["a"]["tok_per_s"]
    assert "| (c) hsx extract |" in capsys.readouterr().out
    assert len(hsx.load(str(out))) == 40  # the real Arrow output of (c)


@pytest.mark.slow
def test_bench_on_cpu_is_quick_and_says_cpu(tmp_path, capsys, monkeypatch):
    """On CPU with no --shape and no --max-length: the tiny shape and rows of at most 512 tokens (an 8B float32
    model, and (b)'s padded batches over a 4k-token tail, took minutes), a storage probe scaled to (c)'s output (it
    wrote 4 GB after a run that wrote megabytes), the matmul rate MFU is taken against printed as measured (not
    "0.0 TFLOP/s"), and no GPU in the report."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    report = tmp_path / "bench.json"
    assert main(["bench", "--count", "24", "--skip", "a,b", "--json", str(report)]) == 0
    r, shown = json.loads(report.read_text()), capsys.readouterr().out
    assert r["model"] == "random:tiny" and r["max_length_drawn"] <= 512 and r["device"] == "cpu"
    assert r["storage"]["bytes"] <= 0.3e9 < 4e9
    assert "GPU" not in shown and "(c): CPU idle" in shown and "the CPU alone" in shown
    assert " 0.0 TFLOP/s" not in shown and re.search(r"matmul rate [1-9][0-9.,]* [GT]FLOP/s", shown), shown


def test_bench_deletes_its_temp_output_unless_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["bench", "--shape", "tiny", "--count", "20", "--max-length", "128", "--skip", "a,b"]) == 0
    assert not any(p.name.startswith("hsx-bench-") for p in tmp_path.iterdir())


@pytest.mark.slow
def test_bench_data_parallel_reports_the_job(tmp_path):
    """`torchrun --nproc_per_node 2 -m hsx bench`: (c) runs over both processes (same seeded weights, one input),
    and the report is the job's: every row once, both ranks' tokens, each rank's numbers."""
    report, one = tmp_path / "bench.json", tmp_path / "one.json"
    flags = ["--shape", "tiny", "--count", "60", "--max-length", "256"]
    with one_torch_thread():
        assert main(["bench", *flags, "--skip", "a,b", "--json", str(one), "--storage-gb", "0"]) == 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "hsx", "bench", *flags, "--json", str(report), "--output-dir", str(tmp_path / "out"), "--keep",
           "--scaling-baseline", str(one)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(report.read_text())
    assert result["processes"] == 2 and "a" not in result and "b" not in result
    ranks = result["c"]["ranks"]
    assert [x["rank"] for x in ranks] == [0, 1] and all(x["tokens"] > 0 for x in ranks)
    assert sum(x["tokens"] for x in ranks) == result["c"]["tokens"] == result["tokens"]
    assert result["c"]["rows"] == 60 and len(hsx.load(str(tmp_path / "out"))) == 60
    # scaling: each process's own rate, the job's, and the efficiency against the one-process run's
    sc, baseline = result["scaling"], json.loads(one.read_text())["c"]["tok_per_s"]
    assert sc["per_process_tok_per_s"] == [x["tokens"] / x["seconds"] for x in ranks]
    assert sc["efficiency"] == pytest.approx(result["c"]["tok_per_s"] / (2 * baseline))
    assert "(c) over 2 processes" in r.stdout and f"{sc['efficiency']:.1%}" in r.stdout


def test_bench_scaling_baseline_must_be_the_same_bench_in_one_process(tmp_path):
    from hsx.bench import read_baseline
    from hsx.config import HsxError

    ours = {"model": "random:tiny", "layers": [1, 2], "final_hidden": False, "rows": 60, "tokens": 9000,
            "dtype": "float32"}
    f = tmp_path / "one.json"
    f.write_text(json.dumps({**ours, "c": {"tok_per_s": 500.0}}))
    assert read_baseline(str(f), ours) == 500.0
    f.write_text(json.dumps({**ours, "rows": 61, "c": {"tok_per_s": 500.0}}))
    with pytest.raises(HsxError, match="differs in: rows"):
        read_baseline(str(f), ours)
    f.write_text(json.dumps({**ours, "processes": 2, "c": {"tok_per_s": 500.0}}))
    with pytest.raises(HsxError, match="one-process"):
        read_baseline(str(f), ours)


def test_bench_json_on_stdout_progress_and_no_nan_on_cpu(tmp_path, capsys, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["bench", "--shape", "tiny", "--count", "20", "--max-length", "128", "--subset-a", "4",
                 "--subset-b", "20", "--json"]) == 0
    captured = capsys.readouterr()
    r = json.loads(captured.out)  # `--json` alone: the JSON is stdout, as `hsx plan --json`
    assert r["c"]["rows"] == 20
    assert "(a) batch 1" in captured.err and "(b) padded 32" in captured.err  # the slow baselines show progress
    table = captured.err[captured.err.index("| run |"):]
    assert "nan" not in table.lower() and "| n/a |" in table  # no GPU memory to report on a CPU


class _FakeNvml:
    """libnvidia-ml's calls that hsx.bench.gpu_clocks makes, answering through their ctypes.byref arguments."""

    def __init__(self):
        self.uuids, self.polls, self.shut = [], 0, False

    def nvmlInit_v2(self):
        return 0

    def nvmlDeviceGetHandleByUUID(self, uuid, handle):
        self.uuids.append(uuid)
        return 0

    def nvmlDeviceGetUtilizationRates(self, handle, util):
        self.polls += 1
        util._obj.gpu = 100 if self.polls % 2 else 10  # every other sample idle: left out
        return 0

    def nvmlDeviceGetClockInfo(self, handle, kind, clock):
        clock._obj.value = 1500 if self.polls % 4 == 1 else 1600
        return 0

    def nvmlDeviceGetPowerUsage(self, handle, power):
        power._obj.value = 690_000
        return 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle, reasons):
        reasons._obj.value = 0x4 if self.polls % 4 == 1 else 0
        return 0

    def nvmlDeviceGetMaxClockInfo(self, handle, kind, clock):
        clock._obj.value = 1980
        return 0

    def nvmlShutdown(self):
        self.shut = True
        return 0


def test_gpu_clocks_reports_busy_samples_only(monkeypatch):
    """The clock sampler beside (c): busy samples only (utilization ≥ 50%), their mean SM clock, power and share
    power-capped; the device found by its UUID; NVML shut down after; nothing at all where NVML is missing."""
    import time
    import types

    import torch

    from hsx import bench

    fake = _FakeNvml()
    monkeypatch.setattr(bench.ctypes, "CDLL", lambda name: fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid="ab-12"))
    with bench.gpu_clocks("cuda:0", every=0.005) as stats:
        deadline = time.monotonic() + 10
        while fake.polls < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert fake.uuids == [b"GPU-ab-12"] and fake.shut
    assert 0 < stats["busy_samples"] < fake.polls  # the idle half left out
    assert 1500 < stats["busy_sm_clock_mhz"] < 1600 and stats["max_sm_clock_mhz"] == 1980
    assert stats["busy_power_w"] == 690 and 0 < stats["power_capped_share"] < 1
    line = bench.format_table({"num_model_layers": 2, "matmul_tflops": 1.0, "c": {
        "rows": 1, "tok_per_s": 1.0, "mfu": 0.5, "padding": 0.0, "gpu_idle": 0.0, "output_gb_per_s": 1.0,
        "compile_warmup_seconds": 1.0, "compile": True, "sdpa_backend": "flash", "token_budget": 1,
        "layers_run": 2, "gpu_clocks": stats}})
    assert "SM clock" in line and "of 1980 MHz" in line and "waited" not in line and "DeepGEMM" not in line
    line = bench.format_table({"num_model_layers": 2, "matmul_tflops": 1.0, "c": {
        "rows": 1, "tok_per_s": 1.0, "mfu": 0.5, "padding": 0.0, "gpu_idle": 0.0, "output_gb_per_s": 1.0,
        "compile_warmup_seconds": 50.2, "compile": True, "compiled": True, "sdpa_backend": "flash", "token_budget": 1,
        "layers_run": 2, "deepgemm_build": {"weight_shapes": 7, "rows": [8192, 16384], "products": 903,
                                             "seconds": 26.04},
        "kernels": {"deepgemm_build": {"weight_shapes": 7, "rows": [8192, 16384], "products": 0, "seconds": 0.0}}}})
    # the warm-up's build, not the timed run's (which found every kernel built in this process)
    assert "warm-up 50.2 s (compile: True, compiled, DeepGEMM's kernels 26.0 s)" in line
    writer_bound = {"pipeline": {"gpu_seconds": 11.98, "gpu_waited_for_writer_seconds": 3.43},
                    "writer_gb_per_s": 2.59, "crc32": "zlib"}  # (an H100 run's numbers)
    assert bench._writer_note(writer_bound) == [
        "(c): the GPU waited 3.43 s of 11.98 s for the writer (busy at 2.59 GB/s); its CRC-32 ran on zlib: pip "
        "install zlib-ng (hsx's gpu extra) checksums about twice as fast"]
    assert bench._writer_note({**writer_bound, "crc32": "zlib-ng"})[0].endswith("for the writer (busy at 2.59 GB/s)")
    assert bench._writer_note({"pipeline": {"gpu_seconds": 16.13, "gpu_waited_for_writer_seconds": 0.44}}) == []

    def missing(name):
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(bench.ctypes, "CDLL", missing)
    with bench.gpu_clocks("cuda:0") as stats:
        pass
    assert stats == {}
    unknown = _FakeNvml()
    unknown.nvmlDeviceGetHandleByUUID = lambda uuid, handle: 13  # NVML_ERROR_NOT_FOUND (a MIG device, say)
    monkeypatch.setattr(bench.ctypes, "CDLL", lambda name: unknown)
    with bench.gpu_clocks("cuda:0") as stats:
        pass
    assert stats == {} and unknown.shut and unknown.polls == 0


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_5_moe_text"])
def test_bench_drift_column_covers_fp8_experts_and_hybrid_layers(kind):
    """The drift column (hsx.target.drift, as `hsx verify --against-bf16`) on random FP8 weights built as `--shape
    NAME-fp8`
    builds them (here on CPU, tiny; FP8 modules run their torch reference): MoE experts and Gated DeltaNet layers
    included, each captured state gets a relative error, non-zero (activation quantization) and small; a module the
    bf16 reference would not switch leaves the column "not measured", in one line, never a number."""
    import numpy as np
    import torch
    import transformers

    from hsx import bench_models
    from hsx.bench import bench_drift
    from hsx.target import fp8_model, moe

    if not hasattr(transformers, "Qwen3_5MoeTextConfig") and kind != "qwen3_moe":
        pytest.skip("this transformers has no Qwen3.5-MoE")
    from test_fp8 import OFFICIAL, _moe_config

    config = _moe_config(kind)
    config.quantization_config = dict(OFFICIAL)
    torch.manual_seed(0)
    causal = bench_models.random_causal_lm(config, torch.device("cpu"), "sdpa")
    moe.use_experts(causal, moe.EXPERTS_IMPLEMENTATION)
    rows = [np.arange(3, 40), np.arange(100, 130)]
    lines = []
    with one_torch_thread():
        d = bench_drift(causal.model, [0, 1], True, rows, torch.device("cpu"), lines.append)
    assert d["rows"] == 2 and d["tokens"] == 67 and set(d["relative_error"]) == {"0", "1", "final_hidden_state"}
    assert all(1e-3 < v < 0.5 for v in d["relative_error"].values()), d
    assert "relative error per layer on 2 rows" in lines[0]
    for m in causal.modules():  # experts left on transformers' FP8 forward: the reference cannot switch them
        if getattr(m, fp8_model.FP8_EXPERTS, False):
            setattr(m, fp8_model.FP8_EXPERTS, False)
    lines.clear()
    d = bench_drift(causal.model, [0, 1], True, rows, torch.device("cpu"), lines.append)
    assert set(d) == {"not_measured"} and "no bf16 reference" in lines[0]


def test_the_warm_up_holds_a_budget_of_median_rows_and_every_length():
    """(c)'s warm-up reaches a batch as large as the timed run's (the compile's sample: CompileAhead starts on a
    forward of half the budget) and still spans the length distribution (every bucket's batch shapes)."""
    import numpy as np

    from hsx.bench import warmup_rows

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(344), 0.8, 2000), 16, 4096).astype(np.int64)
    warm = warmup_rows(lengths, 16384)
    assert np.all(np.diff(warm) > 0) and warm.min() >= 0 and warm.max() < 2000
    median = np.median(lengths)
    near = warm[np.abs(lengths[warm] - median) <= 0.25 * median]
    assert lengths[near].sum() >= 16384  # one budget of median-length rows: a bucket's full batch
    assert lengths[warm].min() == lengths.min() and lengths[warm].max() >= np.quantile(lengths, 0.99)
    assert len(warm) < 400  # a warm-up, not a second run
