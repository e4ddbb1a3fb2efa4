"""The automatic token budget: capped at the measured-fastest 16k, limited by memory, never below one row; a budget
no memory holds is one line; a plan of a tiny model on a CPU says what it is for."""

import pytest

from hsx.cost import DEFAULT_BUDGET_CAP, auto_token_budget, shape_config


def test_budget_is_capped_limited_by_memory_and_holds_a_row():
    c = shape_config("qwen3-8b")
    stored = 5 * 4096
    assert auto_token_budget(c, stored, 100 << 30, 4096) == DEFAULT_BUDGET_CAP
    small = auto_token_budget(c, stored, 2 << 30, 1024)
    assert 1024 <= small < DEFAULT_BUDGET_CAP
    assert auto_token_budget(c, stored, 1 << 20, 4096) == 4096  # never below one full row


def test_eager_attention_scores_shrink_the_budget():
    c = shape_config("qwen3-8b")
    plain = auto_token_budget(c, 5 * 4096, 4 << 30, 4096)
    eager = auto_token_budget(c, 5 * 4096, 4 << 30, 4096, eager_attention=True)
    assert 4096 <= eager < plain


def test_a_96_gb_card_holds_the_27b_shape_at_rows_up_to_its_longest_planned_row():
    """The seed's RTX PRO 6000 (96 GB) at Qwen3.6-27B, DFlash layers: the token budget follows free memory, holds
    one full row at every --max-length up to the longest whose batch fits beside the weights (hsx's estimate, with
    its 1.5x margin: ~115k tokens), stays within the GPU's usable memory there, and past it the plan does not
    promise one GPU (at the model's 262,144 positions a row's activations alone are ~91 GiB by that estimate)."""
    from hsx.config import layers_run
    from hsx.cost import GPU_HEADROOM, GPUS, activation_bytes_per_token, plan, weight_bytes
    from hsx.target.model import text_config_of

    c = text_config_of(shape_config("qwen3.6-27b"))
    layers = [1, 16, 31, 46, 61]
    gpu = int(GPUS["rtx-pro-6000"]["memory_gib"] * 2**30)
    weights = weight_bytes(c, layers_run(int(c.num_hidden_layers), layers, False))
    per_token = activation_bytes_per_token(c, len(layers) * int(c.hidden_size))
    longest = int((GPU_HEADROOM * gpu - weights) // per_token)
    assert 100_000 < longest < int(c.max_position_embeddings)
    for max_length in (4096, 8192, 32768, 65536, longest):  # 8,192: measured on an H200 with 95 GiB free, no OOM
        p = plan(c, layers, False, max_length, gpu_bytes=gpu)
        assert p["gpus_per_copy"] == 1 and p["token_budget"] >= max_length
        assert p["peak_gpu_bytes_estimate"] <= GPU_HEADROOM * gpu
    assert plan(c, layers, False, longest + 1, gpu_bytes=gpu)["gpus_per_copy"] != 1
    assert plan(c, layers, False, int(c.max_position_embeddings), gpu_bytes=gpu)["gpus_per_copy"] != 1
    # the job's budget (hsx.job: auto_token_budget of the free memory it reads) shrinks with what is free
    free = [gpu - weights - (x << 30) for x in (0, 43, 45)]  # other processes holding 43, 45 GiB
    budgets = [auto_token_budget(c, len(layers) * int(c.hidden_size), f, 8192) for f in free]
    assert budgets[0] == DEFAULT_BUDGET_CAP and budgets[0] > budgets[1] > budgets[2] >= 8192
    assert all(b * per_token <= 0.8 * f for b, f in zip(budgets[1:], free[1:]))


def test_plan_knows_the_gpus_people_run_this_on(capsys, monkeypatch):
    """hsx plan --gpu: each GPU's memory, bf16 and FP8 rates (datasheet figures, planned at the share of its datasheet
    rate a matmul reached on the one GPU measured, said so), its compute capability, and the kernel lines hsx extract
    would log there."""
    from hsx.cost import GPUS, job_plan
    from hsx.target import kernels

    assert {"a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "rtx-pro-6000", "l40s"} <= set(GPUS)
    for spec in GPUS.values():
        assert spec["capability"] in kernels.GPU_KINDS
        assert (spec["fp8_matmul_tflops"] is None) == (spec["capability"] < kernels.FP8_TENSOR_CORES)
        assert spec["fp8_matmul_tflops"] is None or spec["fp8_matmul_tflops"] > spec["matmul_tflops"]
    assert GPUS["rtx-pro-6000"]["memory_gib"] == 96
    p = job_plan(None, {"layers": ["dflash"]}, shape="qwen3.6-27b", tokens=10**6, gpu="rtx-pro-6000")
    assert "datasheet" in p["planned_for"] and p["compute_capability"].startswith("12.0")
    assert any("packed causal attention" in line for line in p["kernel_fallbacks"])
    h200 = job_plan(None, {"layers": ["dflash"]}, shape="qwen3.6-27b", tokens=10**6, gpu="h200")
    assert "measured" in h200["planned_for"] and h200["kernel_fallbacks"] == []
    # an FP8 checkpoint on an A100 (no FP8 tensor cores) runs dequantized: planned at the bf16 rate
    a100 = job_plan(None, {"layers": ["dflash"]}, shape="qwen3-8b-fp8", tokens=10**6, gpu="a100-80gb")
    assert "70% of an A100-80GB's 249 TFLOP/s" in a100["rate_source"]  # 312 datasheet x the H200's 790/989
    h100 = job_plan(None, {"layers": ["dflash"]}, shape="qwen3-8b-fp8", tokens=10**6, gpu="h100-sxm")
    assert a100["weight_bytes"] > 1.8 * h100["weight_bytes"]  # its weights as bf16, not e4m3
    assert any("no FP8 tensor cores" in line for line in a100["kernel_fallbacks"])


def test_gpus_are_planned_on_one_basis_and_the_plan_says_which():
    """An H100-SXM was planned 25% faster than an H200 on the same job: its datasheet peak beside the H200's measured
    rate. Every GPU's rate is now its datasheet rate x the share of the datasheet a matmul reached on the measured
    GPU: GPUs of equal datasheet rates plan equal, the measured GPU at exactly its measured rate, and the plan
    says the basis."""
    from hsx.cost import GPUS, MEASURED_MATMUL, MEASURED_ON, job_plan

    plans = {g: job_plan(None, {"layers": ["eagle3"]}, shape="qwen3-8b", tokens=10**9, gpu=g) for g in GPUS}
    assert plans["h100-sxm"]["rate_tokens_per_s"] == pytest.approx(plans["h200"]["rate_tokens_per_s"])
    assert f"{MEASURED_MATMUL['matmul_tflops']:.0f} TFLOP/s" in plans[MEASURED_ON]["rate_source"]
    for g, p in plans.items():  # rate ∝ datasheet rate, for every GPU (the writer bound aside: an 8B is not bound)
        assert p["rate_tokens_per_s"] / plans["h200"]["rate_tokens_per_s"] == pytest.approx(
            GPUS[g]["matmul_tflops"] / GPUS["h200"]["matmul_tflops"])
        assert "datasheet" in p["rate_basis"] and p["rate_basis"] in p["planned_for"]
    assert "not measured on this GPU" in plans["h100-sxm"]["planned_for"]
    assert "measured" in plans["h200"]["planned_for"] and "not measured" not in plans["h200"]["planned_for"]
    fp8 = {g: job_plan(None, {"layers": ["dflash"]}, shape="qwen3-8b-fp8", tokens=10**9, gpu=g)
           for g in ("h200", "h100-sxm")}
    assert fp8["h100-sxm"]["rate_tokens_per_s"] == pytest.approx(fp8["h200"]["rate_tokens_per_s"])
    assert "FP8 matmul" in fp8["h100-sxm"]["rate_basis"]


def test_a_plan_says_what_makes_its_output_fit_with_its_numbers(capsys):
    """`hsx plan` said "8.7 TB on disk" and nothing of what makes it fit: the fp8 storage dtype (its bytes), training
    while extracting, node shares in local dirs."""
    from hsx.cli import main

    assert main(["plan", "--shape", "qwen3.6-27b", "--layers", "1", "16", "31", "46", "61", "--tokens",
                 "170000000"]) == 0
    shown = capsys.readouterr().out
    assert "→ 8.7 TB on disk" in shown
    assert "--storage-dtype float8_e4m3: 25,620 bytes per token, 4.4 TB in all (50%" in shown
    assert "--max-pending-gb N" in shown and "hsx.follow(OUT, delete_consumed=True)" in shown
    assert "4.4 TB over 2, 2.2 TB over 4, 1.1 TB over 8 nodes" in shown
    assert main(["plan", "--shape", "qwen3.6-27b", "--layers", "1", "--tokens", "1000", "--storage-dtype",
                 "float8_e4m3"]) == 0
    assert "--storage-dtype float8_e4m3:" not in capsys.readouterr().out  # (it is what the plan stores already)


import pytest
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from helpers import assert_one_error_line, fault_argv, hsx_main  # noqa: E402


# ---- the plan: a budget memory holds, and what a plan is for -------------------------------------------------------

def test_a_token_budget_no_memory_holds_is_one_line(tmp_path, model4, small_chat_path):
    argv = fault_argv(model4.path, small_chat_path, tmp_path / "out")
    argv[argv.index("--token-budget") + 1] = "2000000000"
    rc, _, err = hsx_main(argv)
    assert_one_error_line(rc, err, "--token-budget 2,000,000,000", "GiB", "memory")


def test_a_plan_of_a_tiny_model_on_a_cpu_says_what_it_is_for_and_no_nonsense_rate(tmp_path):
    from hsx.cost import WRITER_BYTES_PER_S

    repo = Path(__file__).resolve().parent.parent
    rc, said, err = hsx_main(["plan", "--config", str(repo / "recipes" / "demo.yaml"), "--json", "-"])
    assert rc == 0, err
    p = json.loads(said)
    assert p["write_bytes_per_s"] <= WRITER_BYTES_PER_S * 1.0001
    assert p["rate_bound"] == "writer"
    rc, said, err = hsx_main(["plan", "--config", str(repo / "recipes" / "demo.yaml")])
    assert said.startswith("planned for H200 GPUs")
    import torch

    assert ("this machine has no GPU" in said) == (not torch.cuda.is_available())
    assert "561" not in said and "GB/s per copy" in said


def test_the_plans_measured_mfu_is_the_readmes_measured_range():
    """`hsx plan` plans a known shape at MEASURED_MFU; the README's Benchmarks table states what was measured. Each
    planned figure lies in its row's range of MFU (rounded down by at most 3 points), so neither drifts alone."""
    import re
    from pathlib import Path

    from hsx.cost import MEASURED_MFU

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| ([\w.-]+)[^|]*\|[^|]*\| ([^|]*%[^|]*) \|", readme, re.M)}
    for shape, planned in MEASURED_MFU.items():
        assert shape in rows, f"{shape}: no row in the README's Benchmarks table"
        measured = [float(x) / 100 for x in re.findall(r"\d+(?:\.\d+)?", rows[shape])]
        assert min(measured) - 0.03 <= planned <= max(measured), (shape, planned, measured)
