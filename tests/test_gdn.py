"""hsx.gdn on CPU: which fla kernel configs hsx settles ahead (the GPU side is in tests/test_gpu.py)."""

from types import SimpleNamespace

import torch

from hsx import gdn


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


def _qwen3_5_linear_attention(dtype=torch.float32):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    torch.manual_seed(0)
    return Qwen3_5GatedDeltaNet(config, layer_idx=0).to(dtype)


def test_merged_projections_are_one_weight_the_modules_view():
    """Qwen3.5/3.6's four input projections become one weight (the four modules' weights its row blocks, no second
    copy, the state dict unchanged) and one product gives what the four gave."""
    m = _qwen3_5_linear_attention()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(2, 5, 64)
    separate = [getattr(m, n)(x) for n in gdn.QWEN3_5_PROJECTIONS]
    assert gdn.merge_projections(m) and not gdn.merge_projections(m)  # once
    merged = getattr(m, gdn.MERGED_PROJECTIONS)
    width = sum(t.shape[-1] for t in separate)  # 16·2·2 + 64 + 4 + 4 = 136, a multiple of 8: no padding
    assert merged.shape == (width, 64)
    assert all(getattr(m, n).weight.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()
               for n in gdn.QWEN3_5_PROJECTIONS)
    after = m.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    mixed, z, b, a = gdn._projections(m, x)
    assert torch.allclose(mixed, separate[0], atol=1e-5) and torch.allclose(b, separate[2], atol=1e-5)
    assert torch.allclose(a, separate[3], atol=1e-5)
    assert z.shape == (2, 5, 4, 16) and torch.allclose(z, separate[1].reshape(2, 5, 4, 16), atol=1e-5)
    # a weight written in place (load_state_dict copies into the views) reaches the merged product
    with torch.no_grad():
        m.in_proj_b.weight.mul_(2)
    assert torch.allclose(gdn._projections(m, x)[2], 2 * separate[2], atol=1e-5)


def test_parted_or_unmergeable_projections_run_as_the_modules():
    """After a `.to()` that parts the views from the merged weight the layer runs its four modules as they are;
    quantized or biased projections (not plain bias-free Linears) are not merged."""
    m = _qwen3_5_linear_attention()
    assert gdn.merge_projections(m)
    m.to(torch.float64)
    with torch.no_grad():
        m.in_proj_a.weight.zero_()  # only in the module's own weight now
    x = torch.randn(1, 3, 64, dtype=torch.float64)
    assert gdn._merged_weight(m) is None
    assert torch.equal(gdn._projections(m, x)[3], torch.zeros(1, 3, 4, dtype=torch.float64))

    class QuantizedLinear(torch.nn.Linear):
        pass

    odd = _qwen3_5_linear_attention()
    odd.in_proj_z = QuantizedLinear(64, 64, bias=False)
    assert not gdn.merge_projections(odd) and not hasattr(odd, gdn.MERGED_PROJECTIONS)
    biased = _qwen3_5_linear_attention()
    biased.in_proj_b = torch.nn.Linear(64, 4, bias=True)
    assert not gdn.merge_projections(biased)


def test_the_gated_norm_reads_a_gate_of_heads_from_a_wider_product():
    """(tokens, heads, dim) with the gate a view of a wider row (z in the merged product) is the 2-d norm's result."""
    torch.manual_seed(0)
    weight = torch.rand(16) + 0.5
    x = torch.randn(7, 4, 16, dtype=torch.bfloat16)
    wide = torch.randn(7, 100, dtype=torch.bfloat16)
    gate = wide[:, 20:84].unflatten(-1, (4, 16))
    got = gdn.gated_rms_norm(x, gate, weight, 1e-6)
    flat = gdn.gated_rms_norm(x.reshape(-1, 16), gate.reshape(-1, 16), weight, 1e-6)
    assert got.shape == x.shape and torch.equal(got.reshape(-1, 16), flat)


def test_merged_projections_keep_the_products_rows_aligned():
    """An odd number of value heads (b and a one column each) would leave the product's rows unaligned: zero rows
    pad the merged weight to a multiple of 8, and the four outputs are still the modules'."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(hidden_size=64, linear_num_key_heads=1, linear_num_value_heads=3,
                               linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    torch.manual_seed(0)
    m = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    x = torch.randn(1, 4, 64)
    separate = [getattr(m, n)(x) for n in gdn.QWEN3_5_PROJECTIONS]
    assert gdn.merge_projections(m)
    merged = getattr(m, gdn.MERGED_PROJECTIONS)
    width = sum(t.shape[-1] for t in separate)  # 16·2 + 48 + 48 + 3 + 3 = 134
    assert merged.shape[0] == 136 and width == 134 and not merged[width:].any()
    for got, want in zip(gdn._projections(m, x), separate):
        assert torch.allclose(got.reshape(want.shape), want, atol=1e-5)
