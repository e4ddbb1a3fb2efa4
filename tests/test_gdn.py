"""hsx.target.gdn on CPU: which fla kernel configs hsx settles ahead (the GPU side is in tests/test_gpu.py)."""

from types import SimpleNamespace

import torch

from hsx.target import gdn


def _config(kwargs, num_warps, num_stages=3):
    return SimpleNamespace(kwargs=dict(kwargs), num_warps=num_warps, num_stages=num_stages)


def _tuned(attribute):
    return [t for t in gdn.TUNED_CONFIGS if t.kernel.endswith(":" + attribute)]


H_KERNEL = "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"
H_KEYS = ["H", "HV", "K", "V", "BT", "STATE_V_FIRST"]
H_CANDIDATES = [_config({"BV": bv}, w, s) for w in (2, 4) for s in (2, 3, 4) for bv in (32, 64)]


def test_the_tuned_config_is_chosen_for_its_key_and_other_head_counts():
    tuned = _tuned(H_KERNEL)
    args = dict(H=16, HV=48, K=128, V=128, BT=64, STATE_V_FIRST=False, T=16384)
    choice = gdn.tuned_choice(tuned, H_KEYS, H_CANDIDATES, args)
    assert (choice.kwargs, choice.num_warps, choice.num_stages) == ({"BV": 64}, 4, 4)
    assert choice is next(c for c in H_CANDIDATES if c.kwargs == {"BV": 64} and c.num_warps == 4
                          and c.num_stages == 4)  # one of fla's own candidates, not a new object
    # Qwen3-Next-80B and Qwen3.5-397B have other head counts, the same head sizes: the same tile
    assert gdn.tuned_choice(tuned, H_KEYS, H_CANDIDATES, {**args, "H": 16, "HV": 32}) is choice
    assert gdn.tuned_choice(tuned, H_KEYS, H_CANDIDATES, {**args, "H": 2, "HV": 64}) is choice


def test_other_keys_kernels_and_candidates_autotune_as_before():
    tuned = _tuned(H_KERNEL)
    args = dict(H=16, HV=48, K=128, V=128, BT=64, STATE_V_FIRST=False)
    assert gdn.tuned_choice(tuned, H_KEYS, H_CANDIDATES, {**args, "K": 64}) is None  # another head size
    assert gdn.tuned_choice(tuned, H_KEYS, H_CANDIDATES, {**args, "STATE_V_FIRST": True}) is None
    assert gdn.tuned_choice(tuned, H_KEYS + ["NEW"], H_CANDIDATES, args) is None  # fla changed the kernel's key
    without = [c for c in H_CANDIDATES if c.kwargs != {"BV": 64}]  # fla no longer offers the tuned tile
    assert gdn.tuned_choice(tuned, H_KEYS, without, args) is None
    # right-padded batches (no cu_seqlens) are another key of the gate kernel
    gate = _tuned("gdn_gate_chunk_cumsum_scalar_kernel")
    keys = ["H", "BT", "IS_VARLEN", "REVERSE"]
    candidates = [_config({}, w) for w in (1, 2, 4, 8)]
    assert gdn.tuned_choice(gate, keys, candidates, dict(H=48, BT=64, IS_VARLEN=True, REVERSE=False)) is candidates[2]
    assert gdn.tuned_choice(gate, keys, candidates, dict(H=48, BT=64, IS_VARLEN=False, REVERSE=False)) is None


def test_narrowing_keeps_fla_pruning_first():
    """fla's own early pruning (shared-memory limits) runs first; the tuned tile only where it survived."""
    autotuner = SimpleNamespace(keys=H_KEYS)
    args = dict(H=16, HV=48, K=128, V=128, BT=64, STATE_V_FIRST=False)
    narrowed = gdn._narrowed(autotuner, _tuned(H_KERNEL), None)
    assert [(c.kwargs, c.num_warps, c.num_stages) for c in narrowed(H_CANDIDATES, args)] == [({"BV": 64}, 4, 4)]
    small = gdn._narrowed(autotuner, _tuned(H_KERNEL), lambda configs, named, **kw: [c for c in configs
                                                                                       if c.kwargs["BV"] == 32])
    assert all(c.kwargs == {"BV": 32} for c in small(H_CANDIDATES, args)) and len(small(H_CANDIDATES, args)) == 6
    assert narrowed(H_CANDIDATES, {**args, "K": 256}) == H_CANDIDATES  # not tuned: every candidate is timed


def test_the_table_names_what_it_matches():
    assert len({t.kernel for t in gdn.TUNED_CONFIGS}) == len(gdn.TUNED_CONFIGS) == 5
    for t in gdn.TUNED_CONFIGS:
        module, attribute = t.kernel.split(":")
        assert module.startswith("fla.") and "kernel" in attribute
        names = [name for name, _ in t.key]
        assert set(t.counts) <= set(names) and len(names) == len(set(names)), t
        assert t.num_warps in (1, 2, 4, 8, 16) and t.num_stages >= 1


def test_a_users_fla_config_cache_and_other_gpus_are_left_alone(monkeypatch):
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    if not torch.cuda.is_available():
        assert gdn.autotuning_note() == "fla's autotuning" and gdn.settle_autotuning() == 0
    monkeypatch.setenv("FLA_CACHE_MODE", "fuzzy")
    assert gdn.autotuning_note().startswith("fla's config cache") and gdn.settle_autotuning() == 0
    monkeypatch.delenv("FLA_CACHE_MODE")
    monkeypatch.setenv("FLA_CONFIG_DIR", "/somewhere")
    assert gdn.autotuning_note().startswith("fla's config cache") and gdn.settle_autotuning() == 0


def test_the_convolution_kernel_is_named_by_the_layers_head_layout():
    """hsx.json's run.kernels says which kernel ran the short convolution: hsx's fused one for Qwen3.5/3.6 and
    Qwen3-Next's layout (one power-of-two head size over q, k and v, SiLU), fla's for layouts it does not take."""
    import types

    import torch

    def layer(head_k=128, head_v=128, key_heads=16, value_heads=32, activation="silu"):
        channels = 2 * key_heads * head_k + value_heads * head_v
        return types.SimpleNamespace(conv1d=types.SimpleNamespace(weight=torch.empty(channels, 1, 4)),
                                     head_k_dim=head_k, head_v_dim=head_v, key_dim=key_heads * head_k,
                                     activation=activation)

    assert gdn.conv_kernel(layer()) == "hsx"  # Qwen3.6-35B-A3B
    assert gdn.conv_kernel(layer(value_heads=48)) == "hsx"  # Qwen3.6-27B
    assert gdn.conv_kernel(layer(head_k=96, head_v=96)) == "fla"  # not a power of two
    assert gdn.conv_kernel(layer(head_k=512, head_v=512)) == "fla"  # past one tile
    assert gdn.conv_kernel(layer(head_v=192, value_heads=3)) == "fla"  # values not in key-head-sized blocks
    assert gdn.conv_kernel(layer(activation="gelu")) == "fla"
    damaged = layer()
    damaged.head_v_dim = 0
    assert gdn.conv_kernel(damaged) == "fla"  # a damaged config: named, not a ZeroDivisionError


def test_the_gated_norm_off_cuda_is_transformers_formula():
    """`gated_rms_norm` away from CUDA (and for heads the kernel does not take) is transformers'
    Qwen3_5RMSNormGated bit for bit, with a bf16 weight (its product rounded) and a float32 one (not)."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    torch.manual_seed(0)
    for dim, weight_dtype in ((128, torch.bfloat16), (96, torch.float32)):
        norm = Qwen3_5RMSNormGated(dim, eps=1e-6).to(weight_dtype)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(37, dim, dtype=torch.bfloat16) * 4
        gate = torch.randn(37, dim, dtype=torch.bfloat16) * 2
        got = gdn.gated_rms_norm(x, gate, norm.weight, 1e-6)
        assert got.dtype == torch.bfloat16 and torch.equal(got, norm(x, gate))
