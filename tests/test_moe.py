"""hsx's grouped-GEMM experts (hsx.target.moe) against transformers' eager experts, the MoE shapes and their budgets."""

import json

import pytest
import torch
import transformers

from hsx.cli import main
from hsx.config import HsxError, load_config
from hsx.target.moe import EXPERTS_IMPLEMENTATION, has_experts, resolve_experts, use_experts
from hsx.cost import (DEFAULT_BUDGET_CAP, MEASURED_MFU, MOE_TOKENS_PER_EXPERT, PLAN_MFU, PLAN_MFU_MOE,
                      auto_token_budget, budget_cap, plan_mfu, shape_config)

T = transformers
COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
CONFIGS = {
    "qwen3_moe": lambda: T.Qwen3MoeConfig(**COMMON, num_hidden_layers=3, num_experts=8, num_experts_per_tok=3,
                                          moe_intermediate_size=32, intermediate_size=48, mlp_only_layers=[1]),
    "gpt_oss": lambda: T.GptOssConfig(**COMMON, num_hidden_layers=2, intermediate_size=32, num_local_experts=8,
                                      num_experts_per_tok=2, sliding_window=4),
    "qwen3_next": lambda: T.Qwen3NextConfig(
        **COMMON, num_hidden_layers=2, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, layer_types=["linear_attention",
                                                                                  "full_attention"]),
    "qwen3_5_moe": lambda: T.Qwen3_5MoeTextConfig(
        **COMMON, num_hidden_layers=2, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, layer_types=["linear_attention",
                                                                                  "full_attention"]),
    "deepseek_v3": lambda: T.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4, "head_dim": 8}, num_hidden_layers=2, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        moe_intermediate_size=32),
}


def _model(name: str):
    torch.manual_seed(0)
    model = T.AutoModel.from_config(CONFIGS[name](), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms and biases away from their 1/0 init: GPT-OSS's expert biases count
                p.normal_(0.5 if p.abs().max() == 1 else 0.0, 0.2)
    return model


def _states(model, ids, impl):
    use_experts(model, impl)
    with torch.no_grad():
        return torch.stack(model(input_ids=ids, output_hidden_states=True).hidden_states)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_grouped_experts_equal_eager_in_float32(name):
    model = _model(name)
    assert has_experts(model)
    ids = torch.randint(0, 256, (3, 21), generator=torch.Generator().manual_seed(1))
    eager = _states(model, ids, "eager")
    ours = _states(model, ids, EXPERTS_IMPLEMENTATION)
    assert model.config._experts_implementation == EXPERTS_IMPLEMENTATION
    assert all(m.config._experts_implementation == EXPERTS_IMPLEMENTATION
               for m in model.modules() if type(m).__name__.endswith("Experts"))
    assert eager.abs().max() > 0.1 and not torch.equal(eager[1:], eager[:-1])
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)


def test_grouped_experts_with_unused_experts_and_one_token():
    """Experts that get no token (empty groups) and a single-token batch."""
    model = _model("gpt_oss")
    router = model.layers[0].mlp.router
    with torch.no_grad():
        router.bias[:4] = -100.0  # experts 0-3 never chosen
    for ids in (torch.randint(0, 256, (2, 9)), torch.tensor([[7]])):
        torch.testing.assert_close(_states(model, ids, EXPERTS_IMPLEMENTATION), _states(model, ids, "eager"),
                                   rtol=1e-5, atol=1e-5)


def test_dense_model_is_left_alone(model4):
    use_experts(model4.model, EXPERTS_IMPLEMENTATION)
    assert not has_experts(model4.model)
    assert getattr(model4.model.config, "_experts_implementation", None) != EXPERTS_IMPLEMENTATION


def test_resolve_experts():
    assert resolve_experts("auto", cuda=True) == EXPERTS_IMPLEMENTATION
    assert resolve_experts("auto", cuda=False) is None  # transformers' own choice on CPU
    assert resolve_experts("eager", cuda=True) == "eager"


def test_unknown_experts_implementation_is_refused(tmp_path):
    with pytest.raises(HsxError, match="experts.implementation"):
        load_config(None, {"model": "m", "dataset": "d", "output_dir": str(tmp_path), "layers": [1],
                           "experts_implementation": "fast"})


def test_moe_shapes_by_hub_id():
    """Sizes: tests/test_recipes.py; here what sets the two apart from a dense shape."""
    q = shape_config("Qwen/Qwen3-30B-A3B")
    assert q.to_dict() == shape_config("qwen3-30b-a3b").to_dict() and type(q).__name__ == "Qwen3MoeConfig"
    assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size) == (128, 8, 768)
    o = shape_config("openai/gpt-oss-20b")
    assert type(o).__name__ == "GptOssConfig" and o.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert o.sliding_window == 128 and o.rope_parameters["rope_type"] == "yarn"
    assert (o.num_local_experts, o.num_experts_per_tok) == (32, 4)
    assert plan_mfu(q) == plan_mfu(o) == PLAN_MFU_MOE and plan_mfu(shape_config("qwen3-8b")) == PLAN_MFU
    h = shape_config("Qwen/Qwen3.6-35B-A3B")
    assert h.to_dict() == shape_config("Qwen/Qwen3.5-35B-A3B").to_dict() == shape_config("qwen3.6-35b-a3b").to_dict()
    assert type(h).__name__ == "Qwen3_5MoeTextConfig" and plan_mfu(h) == PLAN_MFU_MOE
    assert (h.num_experts, h.num_experts_per_tok, h.moe_intermediate_size, h.shared_expert_intermediate_size) == (
        256, 8, 512, 512)
    assert h.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"] and len(h.layer_types) == 40


def test_moe_budget_gives_each_expert_its_rows():
    q, o = shape_config("qwen3-30b-a3b"), shape_config("gpt-oss-20b")
    assert budget_cap(shape_config("qwen3-8b")) == DEFAULT_BUDGET_CAP
    assert budget_cap(q) == max(DEFAULT_BUDGET_CAP, MOE_TOKENS_PER_EXPERT * 128 // 8)
    assert budget_cap(o) == max(DEFAULT_BUDGET_CAP, MOE_TOKENS_PER_EXPERT * 32 // 4)
    stored = 5 * q.hidden_size
    assert auto_token_budget(q, stored, 80 << 30, 4096) == budget_cap(q)  # room for it on an H200
    assert 4096 <= auto_token_budget(q, stored, 4 << 30, 4096) < budget_cap(q)  # memory still bounds it


def test_plan_moe_shape_offline(capsys):
    main(["plan", "--shape", "qwen3-30b-a3b", "--layers", "dflash", "--tokens", "1000000", "--json"])
    p = json.loads(capsys.readouterr().out)
    q = shape_config("qwen3-30b-a3b")
    assert p["token_budget"] == budget_cap(q) and p["gpus_per_copy"] == 1
    assert p["rate_source"] == f"{MEASURED_MFU['qwen3-30b-a3b']:.0%} of an H200's 790 TFLOP/s"  # the bench's
    assert p["layers_run"] == 46 and 53 < p["weight_bytes"] / 2**30 < 55  # every expert of 46 layers + embeddings


def test_compiled_block_keeps_the_pair_gathers_opaque():
    """One MoE block under torch.compile (fullgraph: no graph break) equals transformers' eager experts in bf16, and
    both pair gathers stay calls of their own: the tokens' rows and the pairs' routing weights. Fused into the
    activation, the weights' gather made Inductor recompute the router's top-k renormalization for each element
    (394 µs a Qwen3-30B-A3B layer at 16k tokens on an H200)."""
    from torch._inductor.utils import run_and_get_code

    model = _model("qwen3_moe").to(torch.bfloat16)
    block = model.layers[0].mlp
    x = torch.randn(2, 37, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    use_experts(model, "eager")
    with torch.no_grad():
        eager = block(x).float()
    use_experts(model, EXPERTS_IMPLEMENTATION)
    torch._dynamo.reset()
    with torch.no_grad():
        out, code = run_and_get_code(torch.compile(block, fullgraph=True, dynamic=True), x)
    assert eager.norm() > 0
    assert (out.float() - eager).norm() / eager.norm() < 1e-2
    assert "\n".join(code).count("torch.ops.hsx.gather_rows.default(") == 2
    assert "\n".join(code).count("torch.ops.hsx.sum_pairs.default(") == 1  # the un-permute and k-sum: one pass


def test_sum_pairs_is_each_tokens_ordered_float32_sum():
    """Token t's output is its k pair rows (at inverse[t·k + j]) added in float32 in order j = 0..k-1, plus the
    optional float32 addend, rounded once to the rows' dtype; with no pairs, no rows."""
    from hsx.target.moe_kernels import sum_pairs

    g = torch.Generator().manual_seed(7)
    tokens, k, hidden = 5, 3, 6
    z = torch.randn(tokens * k, hidden, generator=g).bfloat16()
    inverse = torch.randperm(tokens * k, generator=g)
    extra = torch.randn(tokens, hidden, generator=g)
    for addend in (None, extra):
        got = sum_pairs(z, inverse, k, addend)
        assert got.dtype == torch.bfloat16 and got.shape == (tokens, hidden)
        for t in range(tokens):
            acc = z[inverse[t * k]].float()
            for j in range(1, k):
                acc = acc + z[inverse[t * k + j]].float()
            if addend is not None:
                acc = acc + addend[t]
            assert torch.equal(got[t], acc.bfloat16()), t
    assert not torch.equal(sum_pairs(z, inverse, k), sum_pairs(z, torch.arange(tokens * k), k))
    assert sum_pairs(z[:0], inverse[:0], k).shape == (0, hidden)


@pytest.mark.parametrize(("name", "renormalizes"), [("qwen3_moe", False), ("qwen3_moe", True),
                                                     ("qwen3_5_moe", True)])
def test_qwen3_moe_router_runs_as_one_op_and_back(name, renormalizes):
    """hsx_grouped runs routers of Qwen3-MoE's form as `route_topk` (bit for bit their forward on CPU: the same
    torch ops), Qwen3.5/3.6-MoE's (which always renormalizes) included, and Qwen3-MoE's with and without renormalization;
    switching back to another experts implementation restores transformers' forward; a router of another form
    is left alone."""
    from hsx.target import moe

    model = _model(name)
    gate = model.layers[0].mlp.gate
    if name == "qwen3_moe":
        gate.norm_topk_prob = renormalizes
    x = torch.randn(45, 64, generator=torch.Generator().manual_seed(4))
    ref = type(gate).forward(gate, x)
    unnormalized = torch.softmax(ref[0].float(), -1).gather(1, ref[2]).to(ref[1].dtype)
    assert torch.equal(ref[1], unnormalized) is not renormalizes  # the two forms differ on these inputs
    use_experts(model, EXPERTS_IMPLEMENTATION)
    assert gate.forward.__func__ is moe.routed_forward
    for got, want in zip(gate(x), ref):
        assert torch.equal(got, want)
    use_experts(model, "eager")
    assert "forward" not in gate.__dict__
    assert moe._router_renormalizes(torch.nn.Linear(2, 2)) is None
    gpt = _model("gpt_oss")
    use_experts(gpt, EXPERTS_IMPLEMENTATION)
    assert not any("forward" in m.__dict__ for m in gpt.modules())  # GPT-OSS: bias, softmax after the top-k


def test_gate_up_activation_is_each_pairs_gated_product():
    """Row r of the fused gate/up op is pair p = order[r] through the expert whose rows hold r: silu(x @ G) · (x @ U)
    times the pair's routing weight, x the row of token p // k, gate columns first, in both of transformers'
    weight layouts; an expert without pairs and the last expert's rows included."""
    from hsx.target.moe_kernels import gate_up_activation

    g = torch.Generator().manual_seed(5)
    tokens, k, hidden, width, experts = 7, 2, 8, 4, 4
    index = torch.tensor([[0, 3], [3, 1], [0, 1], [3, 0], [1, 3], [0, 3], [3, 1]])  # expert 2: no pairs
    expert_of_pair, order = torch.sort(index.reshape(-1), stable=True)
    offsets = torch.searchsorted(expert_of_pair, torch.arange(1, experts + 1), out_int32=True)
    x = torch.randn(tokens, hidden, generator=g)
    weights = torch.rand(tokens, k, generator=g)
    gate_up = torch.randn(experts, 2 * width, hidden, generator=g)
    for transposed in (False, True):
        w = gate_up.transpose(-2, -1).contiguous() if transposed else gate_up
        got = gate_up_activation(x, order, offsets, weights, w, transposed, k)
        assert got.shape == (tokens * k, width)
        for r, p in enumerate(order.tolist()):
            e = int(index.reshape(-1)[p])
            t, j = divmod(p, k)
            want = torch.nn.functional.silu(gate_up[e, :width] @ x[t]) * (gate_up[e, width:] @ x[t]) * weights[t, j]
            torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-6)


def test_gate_up_activation_clamped_is_gpt_oss_gate():
    """The fused op's GPT-OSS form: pair p through expert e is (clamp(u, ±limit) + 1) · g' · sigmoid(alpha · g'),
    g' = min(g, limit), with [g, u] the interleaved columns of x @ W_e + b_e, times the routing weight; values
    past both clamps included."""
    from hsx.target.moe_kernels import gate_up_activation

    g = torch.Generator().manual_seed(6)
    tokens, k, hidden, width, experts, alpha, limit = 7, 2, 8, 4, 4, 1.702, 1.5
    index = torch.tensor([[0, 3], [3, 1], [0, 1], [3, 0], [1, 3], [0, 3], [3, 1]])  # expert 2: no pairs
    expert_of_pair, order = torch.sort(index.reshape(-1), stable=True)
    offsets = torch.searchsorted(expert_of_pair, torch.arange(1, experts + 1), out_int32=True)
    x = torch.randn(tokens, hidden, generator=g)
    weights = torch.rand(tokens, k, generator=g)
    gate_up = torch.randn(experts, hidden, 2 * width, generator=g)  # GPT-OSS's layout: (in, 2·width)
    bias = torch.randn(experts, 2 * width, generator=g)
    got = gate_up_activation(x, order, offsets, weights, gate_up, True, k, bias, True, alpha, limit)
    assert got.shape == (tokens * k, width)
    clamped = 0
    for r, p in enumerate(order.tolist()):
        e = int(index.reshape(-1)[p])
        t, j = divmod(p, k)
        y = x[t] @ gate_up[e] + bias[e]
        gate, up = y[::2], y[1::2]
        clamped += int((gate > limit).sum() + (up.abs() > limit).sum())
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        want = (up + 1) * gate * torch.sigmoid(gate * alpha) * weights[t, j]
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-6)
    assert clamped > 0


def test_fused_gate_up_only_where_it_applies():
    """use_experts marks the experts that the fused gate/up kernel may run: Qwen3-MoE's form (gate and up in one
    weight, SiLU, no bias) and GPT-OSS's (biases, its clamped gate of interleaved columns), and no others (another
    activation or gate; any other implementation)."""
    from hsx.target import moe

    qwen, gpt, hybrid = _model("qwen3_moe"), _model("gpt_oss"), _model("qwen3_5_moe")
    for model in (qwen, gpt, hybrid):
        use_experts(model, EXPERTS_IMPLEMENTATION)
    for model in (qwen, hybrid, gpt):  # Qwen3.5/3.6-MoE's experts have Qwen3-MoE's form
        marks = [getattr(m, moe.FUSED_GATE_UP) for m in model.modules() if moe._dispatched(m)]
        assert marks and all(marks)
    gpt_experts = next(m for m in gpt.modules() if moe._dispatched(m))
    assert moe._gate_up_form(gpt_experts) == "clamped"
    assert moe._clamped_gate(gpt_experts) == (gpt_experts.alpha, gpt_experts.limit)
    use_experts(qwen, "eager")
    assert not any(getattr(m, moe.FUSED_GATE_UP) for m in qwen.modules() if moe._dispatched(m))
    experts = next(m for m in qwen.modules() if moe._dispatched(m))
    experts.act_fn = torch.nn.GELU()
    assert not moe._gate_up_fusable(experts)
    # A biased gate of another form is not GPT-OSS's.
    gpt_experts._apply_gate = lambda y: torch.nn.functional.silu(y[..., ::2]) * y[..., 1::2]
    assert moe._clamped_gate(gpt_experts) is None and not moe._gate_up_fusable(gpt_experts)
