"""`hsx plan` for frontier mixtures of experts (DeepSeek-V3/R1, Kimi-K2, GLM-4.5, GLM-5, Qwen3-235B-A22B) from their
config.json values alone: parameter counts against the published totals and the checkpoint's index, the per-GPU
bytes of experts sharded over a node's GPUs, which GPUs hold each target, and the one-line refusal naming what
would hold it. No weights, except tiny random ones saved to check the byte arithmetic against real files."""

from __future__ import annotations

import json

import pytest

from helpers import REPO
from hsx.cli import main
from hsx.cost import (GPU_HEADROOM, decoder_layer_params, expert_parallel_gpu_bytes, expert_split_bytes, shape_config,
                      weight_bytes)

GIB = 1024**3
# deepseek-ai/DeepSeek-V3's model.safetensors.index.json, "total_size" (FP8 layers, bf16 embeddings, router and
# norms, float32 block scales; with its lm_head and the MTP layer 61, which hsx does not load)
DEEPSEEK_V3_INDEX_TOTAL = 688_586_727_753


def plan(argv, capsys, monkeypatch) -> tuple[int, str]:
    monkeypatch.chdir(REPO)
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out if rc == 0 else out.err


def plan_json(argv, capsys, monkeypatch) -> dict:
    rc, out = plan([*argv, "--json"], capsys, monkeypatch)
    assert rc == 0, out
    return json.loads(out)


def total_params(c) -> int:
    """Every parameter hsx counts for the whole model, plus the lm_head (the published totals include it)."""
    n = int(c.num_hidden_layers)
    return sum(decoder_layer_params(c, i, active=False) for i in range(n)) + 2 * c.vocab_size * c.hidden_size


@pytest.mark.parametrize("shape, published_b, active_b", [
    ("deepseek-v3", 671, 37),  # DeepSeek-V3's card: 671B main model (+14B MTP), 37B activated
    ("kimi-k2", 1040, 32),  # Kimi-K2's card: "1T total", 32B activated (1.04T in LMSYS's K2 post)
    ("glm-4.5", 355, 32),  # GLM-4.5's card: 355B total (its MTP layer included), 32B active
    ("glm-5", 744, 40),  # GLM-5: 744B total, 40B active
    ("qwen3-235b-a22b", 235, 22),
])
def test_frontier_parameter_counts_match_the_published_totals(shape, published_b, active_b):
    c = shape_config(shape)
    assert total_params(c) / 1e9 == pytest.approx(published_b, rel=0.03)
    n = int(c.num_hidden_layers)
    active = sum(decoder_layer_params(c, i) for i in range(n)) + 2 * c.vocab_size * c.hidden_size
    assert active / 1e9 == pytest.approx(active_b, rel=0.1)


def test_deepseek_v3_bytes_match_its_checkpoint_index():
    """The FP8 bytes hsx loads (every decoder layer + embeddings) against the index's total_size: within 5% as is,
    and within 0.5% once what the checkpoint adds is counted (lm_head; MTP layer 61: one MoE decoder layer, its
    eh_proj, and its own embedding and head copies)."""
    c = shape_config("deepseek-v3-fp8")
    n, h, v = int(c.num_hidden_layers), int(c.hidden_size), int(c.vocab_size)
    split = expert_split_bytes(c, n)
    loaded = split["routed"] + split["replicated"]
    assert abs(loaded - DEEPSEEK_V3_INDEX_TOTAL) / DEEPSEEK_V3_INDEX_TOTAL < 0.05
    assert abs(weight_bytes(c, n) - loaded) / loaded < 0.002  # the plain count agrees with the split
    one_moe = loaded - sum(expert_split_bytes(c, n - 1).values())  # the last (MoE) layer's bytes
    with_extras = loaded + 2 * v * h + one_moe + 2 * h * h + 2 * 2 * v * h
    assert abs(with_extras - DEEPSEEK_V3_INDEX_TOTAL) / DEEPSEEK_V3_INDEX_TOTAL < 0.005
    # sharded over 8 GPUs: the routed experts split, the rest whole on each
    per_gpu = expert_parallel_gpu_bytes(split, 8)
    assert per_gpu == pytest.approx(split["replicated"] + split["routed"] / 8, abs=1)
    assert 85 * GIB < per_gpu < 100 * GIB and split["replicated"] < 0.03 * loaded


def test_tiny_random_checkpoints_bytes_equal_the_files(tmp_path):
    """Tiny random DeepSeek-V3 (MLA, dense + routed + shared experts) and GLM-4.5 checkpoints saved in bf16: the split's
    bytes equal what the saved safetensors hold, less the lm_head (and GLM's attention biases and the final norm,
    which the count leaves out)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    shapes = {
        "deepseek_v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                            n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                            topk_group=1, vocab_size=128),
        "glm4_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8,
                         n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                         topk_group=1, vocab_size=128, attention_bias=True),
    }
    for model_type, kwargs in shapes.items():
        c = AutoConfig.for_model(model_type, **kwargs)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(c).to(torch.bfloat16)
        folder = tmp_path / model_type
        model.save_pretrained(folder)
        stored = 0
        for path in folder.glob("*.safetensors"):
            with safe_open(str(path), "pt") as f:
                for key in f.keys():
                    if key.startswith("lm_head") or key.endswith("bias") or key == "model.norm.weight":
                        continue
                    if key.endswith("e_score_correction_bias"):
                        continue
                    t = f.get_tensor(key)
                    stored += t.numel() * t.element_size()
        split = expert_split_bytes(c, int(c.num_hidden_layers))
        assert split["routed"] + split["replicated"] == stored, model_type
        with safe_open(str(next(folder.glob("*.safetensors"))), "pt") as f:
            routed = sum(f.get_tensor(k).numel() * 2 for k in f.keys() if ".mlp.experts." in k)
        assert split["routed"] == routed, model_type


def test_plan_places_each_target_on_the_gpus_that_hold_it(capsys, monkeypatch):
    # DeepSeek-V3 (FP8 as stored) on 8 H200s by experts: ~92 GiB per GPU, each GPU its own batches
    p = plan_json(["--model", "deepseek-ai/DeepSeek-V3", "--layers", "eagle3"], capsys, monkeypatch)
    ep = p["expert_parallel"]
    assert ep["fp8"] and ep["ep_size"] == 8 and 85 * GIB < ep["per_gpu_bytes"] < 100 * GIB
    held = {(r["format"], r["gpu"]): r["ep_size"] for r in ep["fit"]}
    assert held[("fp8", "h200")] == 8 and held[("fp8", "h100-sxm")] is None and held[("bf16", "h200")] is None
    # Qwen3-235B-A22B in bf16: 4 H200s, or 8 H100s
    q = plan_json(["--model", "Qwen/Qwen3-235B-A22B", "--layers", "eagle3"], capsys, monkeypatch)
    assert q["expert_parallel"]["ep_size"] == 4
    q80 = plan_json(["--model", "Qwen/Qwen3-235B-A22B", "--layers", "eagle3", "--gpu", "h100-sxm"], capsys,
                    monkeypatch)
    assert q80["expert_parallel"]["ep_size"] == 8
    assert q80["expert_parallel"]["per_gpu_bytes"] + q80["activation_bytes_per_token"] * q80["min_batch_tokens"] \
        <= GPU_HEADROOM * 80 * GIB
    # Kimi-K2 (FP8): its replicated part leaves no room by experts on 8 H200s; an even split holds it
    k = plan_json(["--model", "moonshotai/Kimi-K2-Instruct", "--layers", "eagle3"], capsys, monkeypatch)
    assert k["expert_parallel"]["ep_size"] is None and k["gpus_per_copy"] == 8
    rc, out = plan(["--model", "moonshotai/Kimi-K2-Instruct", "--layers", "eagle3"], capsys, monkeypatch)
    assert rc == 0 and "only an even split does (--tp-size 8" in out
    # GLM-4.5 FP8 on 8 H100s; GLM-5 FP8 on 8 H200s
    g = plan_json(["--model", "zai-org/GLM-4.5-FP8", "--layers", "eagle3", "--gpu", "h100-sxm"], capsys, monkeypatch)
    assert g["expert_parallel"]["ep_size"] == 8
    g5 = plan_json(["--model", "zai-org/GLM-5-FP8", "--layers", "eagle3"], capsys, monkeypatch)
    assert g5["expert_parallel"]["ep_size"] == 8
    rc, out = plan(["--model", "zai-org/GLM-5-FP8", "--layers", "eagle3"], capsys, monkeypatch)
    assert rc == 0 and "--ep-size 8:" in out and "replicated on every GPU" in out


def test_plan_gives_the_expert_parallel_launch_beside_device_maps_where_experts_fit(capsys, monkeypatch):
    """Where a copy needs several GPUs and sharding the experts fits, the plan names the command that keeps every
    GPU busy (--ep-size, each GPU its own batches), not only device_map's (one GPU busy at a time); a node holds
    NODE/ep_size groups. A dense model or one that fits one GPU gets no such line."""
    p = plan_json(["--model", "deepseek-ai/DeepSeek-V3", "--layers", "eagle3"], capsys, monkeypatch)
    assert "--gpus-per-copy 8" in p["launch"]
    assert "--ep-size 8" in p["launch_expert_parallel"] and "--num_processes 8 " in p["launch_expert_parallel"]
    q = plan_json(["--model", "Qwen/Qwen3-235B-A22B", "--layers", "eagle3"], capsys, monkeypatch)
    assert "--ep-size 4" in q["launch_expert_parallel"] and "--num_processes 8 " in q["launch_expert_parallel"]
    rc, out = plan(["--model", "deepseek-ai/DeepSeek-V3", "--layers", "eagle3"], capsys, monkeypatch)
    assert rc == 0 and "launch, expert parallel (every GPU on its own batches; unmeasured on GPUs): hsx launch" in out
    for argv in (["--model", "Qwen/Qwen3-8B"], ["--model", "deepseek-ai/DeepSeek-V3", "--tp-size", "8"]):
        assert "launch_expert_parallel" not in plan_json(argv + ["--layers", "eagle3"], capsys, monkeypatch)


@pytest.mark.parametrize("argv, names", [
    (["--model", "deepseek-ai/DeepSeek-V3", "--gpu", "h100-sxm"], ["FP8 on 8 H200 of 139 GiB", "2 nodes of these"]),
    (["--model", "zai-org/GLM-5"], ["an FP8 checkpoint on 8 H200 of 139 GiB", "2 nodes of these"]),
    (["--model", "zai-org/GLM-4.5", "--gpu", "h100-sxm"], ["an FP8 checkpoint on 8 H100-SXM of 80 GiB", "BF16 on 8 H200"]),
])
def test_plan_refuses_what_no_node_holds_in_one_line_naming_what_would(argv, names, capsys, monkeypatch):
    rc, err = plan([*argv, "--layers", "eagle3"], capsys, monkeypatch)
    assert rc == 1 and err.startswith("hsx: error: ") and err.count("\n") == 1, err
    assert "GiB replicated +" in err and "more than 90% of its" in err and "not built yet" in err
    for name in names:
        assert name in err, err


# deepseek-ai/DeepSeek-V3's config.json (the keys that shape the model; MTP and rope details as published)
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 8, "topk_group": 4,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 1, "vocab_size": 129280, "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
    "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                          "mscale": 1.0, "mscale_all_dim": 1.0,
                                          "original_max_position_embeddings": 4096},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}


def test_a_local_folder_with_only_its_config_plans_like_the_shipped_shape(tmp_path, capsys, monkeypatch):
    """A checkpoint folder holding config.json alone (no weights): planned from it, the same bytes as the shipped
    shape of its Hub id."""
    folder = tmp_path / "DeepSeek-V3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    local = plan_json(["--model", str(folder), "--layers", "eagle3"], capsys, monkeypatch)
    hub = plan_json(["--model", "deepseek-ai/DeepSeek-V3", "--layers", "eagle3"], capsys, monkeypatch)
    assert local["weight_bytes"] == hub["weight_bytes"]
    assert local["expert_parallel"] == hub["expert_parallel"] and local["expert_parallel"]["ep_size"] == 8
    rc, err = plan(["--model", str(folder), "--layers", "eagle3", "--gpu", "h100-sxm"], capsys, monkeypatch)
    assert rc == 1 and "FP8 on 8 H200 of 139 GiB" in err
