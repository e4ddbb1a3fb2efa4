"""FP8 block-quantized targets (hsx.target.fp8): the quantization maths and config reading on CPU; on CUDA, hsx's
states of an FP8 checkpoint equal transformers' own forward of it."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hsx import bench_models
from hsx.config import ExtractConfig, HsxError
from hsx.target import fp8, fp8_gemm, fp8_model

STD = 0.02  # the init std of Qwen3 (initializer_range)
OFFICIAL = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}


def official_quantize(w: torch.Tensor):
    """The official checkpoints' quantizer, written out independently of hsx: per 128×128 block,
    scale = amax / 448, weight_scale_inv = scale, e4m3 = w / scale."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty((n + 127) // 128, (k + 127) // 128, dtype=torch.float32, device=w.device)
    for i in range(0, n, 128):
        for j in range(0, k, 128):
            block = w[i:i + 128, j:j + 128].float()
            scale = block.abs().max() / 448.0
            s[i // 128, j // 128] = scale
            q[i:i + 128, j:j + 128] = (block / scale).to(torch.float8_e4m3fn)
    return q, s


# ---- CPU ------------------------------------------------------------------------------------------------------------

def test_quantize_weight_matches_the_official_quantizer_and_round_trips():
    torch.manual_seed(0)
    w = torch.randn(300, 200) * torch.logspace(-2, 1, 200)  # edge blocks on both axes, a wide range of magnitudes
    q, s = fp8.quantize_weight(w)
    q_ref, s_ref = official_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2) and s.dtype == torch.float32
    assert torch.allclose(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    back = fp8.dequantize_weight(q, s, torch.float32)
    assert back.shape == w.shape
    assert (back - w).norm() / w.norm() < 0.04  # e4m3 keeps 3 mantissa bits: ~2-3% relative
    assert back.abs().max() <= w.abs().max() * 1.0001


def test_activation_quantization_is_per_row_block_and_the_product_matches_float():
    torch.manual_seed(1)
    x = torch.randn(5, 256)
    x[2, :128] *= 100.0  # one loud block: the other blocks of that row keep their own scale
    x[4, 128:] = 0.0  # an all-zero block quantizes to zeros, not NaN
    xq, xs = fp8.quantize_activation(x)
    assert xs.shape == (5, 2)
    assert torch.allclose(xs[2, 0], x[2, :128].abs().max() / 448.0)
    assert torch.allclose(xs[2, 1], x[2, 128:].abs().max() / 448.0)
    assert torch.isfinite(xq.float()).all() and (xq[4, 128:].float() == 0).all()
    w = torch.randn(384, 256) * 0.05
    wq, ws = fp8.quantize_weight(w)
    y = fp8.reference_mm(xq, xs, wq, ws, torch.float32)
    want = x @ w.t()
    assert (y - want).norm() / want.norm() < 0.06
    # the custom op's CPU path is the reference
    assert torch.equal(fp8_gemm.fp8_linear(x, wq, ws), fp8.reference_mm(xq, xs, wq, ws))


def test_fp8_linear_shares_the_tensors_and_its_reference_mode_is_the_dequantized_weight():
    torch.manual_seed(2)
    wq, ws = fp8.quantize_weight(torch.randn(256, 128) * 0.05)
    lin = fp8_gemm.Fp8Linear(torch.nn.Parameter(wq, requires_grad=False), torch.nn.Parameter(ws, requires_grad=False),
                        None)
    assert lin.weight.data_ptr() == wq.data_ptr()
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    y = lin(x)
    assert y.shape == (2, 3, 256) and y.dtype == torch.bfloat16
    base = torch.nn.Module()
    base.proj = lin
    with fp8_model.bf16_reference(base) as n:
        assert n == 1
        ref = lin(x)
    assert not lin.reference
    want = x.float() @ fp8.dequantize_weight(wq, ws, torch.float32).t()
    assert (ref.float() - want).norm() / want.norm() < 1e-2
    assert 0 < (y.float() - want).norm() / want.norm() < 0.06  # activation quantization: close, not equal


def test_padded_quantization_is_the_reference_in_cublas_layout():
    torch.manual_seed(3)
    x = (torch.randn(37, 512) * torch.logspace(-3, 2, 512)).bfloat16()
    x[3, 128:256] = 0.0
    q, s = fp8.quantize_activation(x)
    qp, sp = fp8.quantize_activation_padded(x, 16)
    assert qp.shape == (48, 512) and sp.shape == (48, 4) and sp.stride() == (1, 48)  # M-major scales
    assert torch.equal(qp[:37].view(torch.uint8), q.view(torch.uint8)) and torch.equal(sp[:37], s)
    assert (qp[37:].float() == 0).all()


@pytest.mark.slow
def test_compiled_layer_quantizes_each_input_once_and_equals_eager():
    """Compiled, each input is quantized once however many projections read it (q and k share one here), the
    GEMMs run on the shared e4m3 tensor, and the result equals eager bit for bit."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(4)

    def linear(n, k):
        return fp8_gemm.Fp8Linear(*(torch.nn.Parameter(t, requires_grad=False)
                               for t in fp8.quantize_weight(torch.randn(n, k) * 0.05)), None)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.up, self.down = linear(256, 256), linear(128, 256), linear(512, 256), linear(256, 512)
            self.norm = torch.nn.Parameter(torch.full((256,), 1.3, dtype=torch.bfloat16), requires_grad=False)

        def forward(self, x):
            xf = x.float()
            h = self.norm * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
            a = torch.cat([self.q(h), self.k(h)], -1)[..., :256]
            return self.down(torch.nn.functional.silu(self.up(a)))

    block = Block()
    x = torch.randn(2, 37, 256, dtype=torch.bfloat16)
    with torch.inference_mode():
        eager = block(x)
        compiled = torch.compile(block, dynamic=True, options=fp8_model.compile_options(block))
        got, code = run_and_get_code(compiled, x)
    code = "\n".join(code)
    assert code.count("torch.ops.hsx.fp8_mm.default(") == 4 and "hsx.fp8_linear" not in code
    assert code.count("torch.ops.hsx.fp8_quantize.default(") == 3  # h (q and k), a, silu(up)
    assert torch.equal(got, eager)
    assert fp8_model.compile_options(torch.nn.Linear(2, 2)) is None  # bf16 layers compile as before


def test_dedupe_merges_equal_pure_calls_and_leaves_graphs_with_mutations_alone():
    from torch.fx.experimental.proxy_tensor import make_fx

    def two(x):  # q/k/v alike: two projections quantize one input
        return fp8.quantize_activation_padded(x)[0].float().sum() + fp8.quantize_activation_padded(x)[0].float().sum()

    x = torch.randn(20, 256)
    gm = make_fx(two)(x)
    before = len(gm.graph.nodes)
    assert fp8_model._dedupe(gm.graph) > 0 and len(gm.graph.nodes) < before
    gm.recompile()
    assert torch.equal(gm(x), two(x))

    def mutating(x):
        y = x.abs()
        x.add_(1.0)
        return y + x.abs()  # the same call as y's, on a tensor mutated in between

    gm = make_fx(mutating)(torch.zeros(3))
    assert fp8_model._dedupe(gm.graph) == 0

    def returned(x):  # two tensors the caller gets: merged, mutating one would change the other
        return x.abs() + 1.0, x.abs() + 1.0

    gm = make_fx(returned)(torch.zeros(3))
    fp8_model._dedupe(gm.graph)
    gm.recompile()
    a, b = gm(torch.zeros(3))
    assert a.data_ptr() != b.data_ptr()


def test_fused_gated_mlp_equals_its_own_forward_and_keeps_the_reference_mode():
    import transformers
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    torch.manual_seed(5)
    mlp = Qwen3MLP(transformers.Qwen3Config(hidden_size=256, intermediate_size=384, hidden_act="silu"))
    for name in ("gate_proj", "up_proj", "down_proj"):
        q, s = fp8.quantize_weight(getattr(mlp, name).weight.detach() * 2.0)
        setattr(mlp, name, fp8_gemm.Fp8Linear(torch.nn.Parameter(q, requires_grad=False),
                                         torch.nn.Parameter(s, requires_grad=False), None))
    x = torch.randn(3, 7, 256, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = mlp(x)  # its own forward: three Fp8Linear calls
        assert fp8_model.fuse_gated_mlps(mlp) == 1 and fp8_model.fuse_gated_mlps(torch.nn.Linear(2, 2)) == 0
        got = mlp(x)
        assert got.shape == want.shape and torch.equal(got, want)
        with fp8_model.bf16_reference(mlp):
            ref = mlp(x)
        assert 0 < (ref.float() - got.float()).norm() / ref.float().norm() < 0.1  # the bf16 product: near


def test_quantization_config_reading():
    q = fp8.quantization_of(SimpleNamespace(quantization_config=dict(OFFICIAL)))
    assert q.record() == {**OFFICIAL, "scale_fmt": "float"} and q.blocker() is None
    assert fp8.quantization_of(SimpleNamespace()) is None
    assert fp8.quantization_of(SimpleNamespace(quantization_config={"quant_method": "gptq", "bits": 4})) is None
    other = fp8.quantization_of(SimpleNamespace(quantization_config={**OFFICIAL, "weight_block_size": [64, 64]}))
    assert "weight_block_size [64, 64]" in other.blocker()
    assert "static" in fp8.quantization_of(SimpleNamespace(
        quantization_config={**OFFICIAL, "activation_scheme": "static"})).blocker()
    for bad in ({**OFFICIAL, "weight_block_size": [128]}, {**OFFICIAL, "weight_block_size": "128"},
                {**OFFICIAL, "fmt": 3}, {**OFFICIAL, "modules_to_not_convert": "lm_head"}):
        with pytest.raises(HsxError):
            fp8.quantization_of(SimpleNamespace(quantization_config=bad))
    # a vision-language checkpoint keeps quantization_config on the outer config: the text config gets it
    text = SimpleNamespace()
    full = SimpleNamespace(quantization_config=dict(OFFICIAL))
    assert fp8.quantization_of(fp8.carry_quantization(full, text)).record()["quant_method"] == "fp8"


def test_runs_instead_says_what_runs_on_cpu():
    q = fp8.quantization_of(SimpleNamespace(quantization_config=dict(OFFICIAL)))
    line = fp8.runs_instead(q, torch.device("cpu"))
    assert line.startswith("hsx: FP8 checkpoint, no CUDA device: transformers dequantizes its weights")
    odd = fp8.quantization_of(SimpleNamespace(quantization_config={**OFFICIAL, "fmt": "e5m2"}))
    assert "transformers' FP8 forward" in fp8.runs_instead(odd, torch.device("cpu"))


def test_fp8_shapes_plan_with_one_byte_weights_and_the_fp8_rate():
    from hsx.cost import HUB_SHAPES, MEASURED_MATMUL, is_fp8, job_plan, shape_config, weight_bytes

    c8, c = shape_config("qwen3-8b-fp8"), shape_config("qwen3-8b")
    assert is_fp8(c8) and not is_fp8(c)
    assert fp8.quantization_of(c8).blocker() is None
    layers_bf16 = weight_bytes(c, 36) - 2 * c.vocab_size * c.hidden_size
    assert weight_bytes(c8, 36) - 2 * c.vocab_size * c.hidden_size == layers_bf16 // 2
    assert HUB_SHAPES["Qwen/Qwen3.6-27B-FP8"] == "qwen3.6-27b-fp8"
    p = job_plan(None, {"model": "Qwen/Qwen3.6-27B-FP8", "layers": "dflash"}, tokens=10**9)
    assert f"{MEASURED_MATMUL['fp8_matmul_tflops']:.0f} TFLOP/s" in p["rate_source"]
    with pytest.raises(HsxError):
        shape_config("nope-fp8")


@pytest.mark.slow
def test_fp8_checkpoint_loads_on_cpu_dequantized_and_the_fingerprint_records_it(tmp_path):
    """On CPU, transformers dequantizes at load: the states equal the bf16 model of the dequantized weights (the
    line above says so), and the job fingerprint / kernel report name the quantization."""
    from hsx.job import _quantization_identity
    from hsx.target.model import load_model
    from hsx.target.prepare import kernel_report

    folder, causal = _save_fp8_checkpoint(tmp_path, torch.device("cpu"))
    loaded = load_model(ExtractConfig(model=str(folder), dataset="unused", output_dir="unused", layers=[1, 3],
                                      dtype="float32", compile="off"), torch.device("cpu"))
    assert _quantization_identity(loaded.text_config)["quantization"]["quant_method"] == "fp8"
    assert kernel_report(loaded.base)["quantization"]["linear"] == "dequantized by transformers"
    ids = torch.arange(3, 40)[None]
    with torch.inference_mode():
        got = loaded.base(input_ids=ids, output_hidden_states=True).hidden_states[2]
        want = causal.model(input_ids=ids, output_hidden_states=True).hidden_states[2]
    assert (got - want).norm() / want.norm() < 1e-3


def _save_fp8_checkpoint(folder, device, num_layers=4, seed=0):
    """A small random Qwen3 quantized the official way and saved with its quantization_config; also returns the
    float32 model of the dequantized weights (what the checkpoint means, on CPU)."""
    import transformers
    from safetensors.torch import save_file

    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=768,
                                   num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, STD)
    state = {}
    for name, t in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and ".layers." in name and t.dim() == 2:
            q, s = official_quantize(t)
            state[name], state[module + ".weight_scale_inv"] = q, s
            with torch.no_grad():  # the float model of what the checkpoint says
                model.get_parameter(name).copy_(fp8.dequantize_weight(q, s, torch.float32))
        else:
            state[name] = t.to(torch.bfloat16).contiguous()
            with torch.no_grad():
                model.get_parameter(name).copy_(state[name].float())
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = cfg.to_dict()
    config["quantization_config"] = dict(OFFICIAL)
    config["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    return folder, model


# ---- CUDA -----------------------------------------------------------------------------------------------------------

def _emulated_fp8_linear_forward(self, x):
    """transformers' FP8Linear maths, emulated in float32: 1×128 dynamic activation quantization (scale = block
    amax / 448), then the block-scaled product, accumulated in float32."""
    k = x.shape[-1]
    xf = x.reshape(-1, k).float().view(-1, k // 128, 128)
    s = xf.abs().amax(-1, keepdim=True) / 448.0
    xq = (xf / s).to(torch.float8_e4m3fn).float() * s
    w = self.weight.float() * self.weight_scale_inv.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[
        :self.weight.shape[0], :k]
    y = (xq.view(-1, k) @ w.t()).to(x.dtype).view(*x.shape[:-1], -1)
    return y + self.bias if self.bias is not None else y


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton quantization kernel)")
def test_activation_quantization_builds_one_kernel_for_every_row_count_on_cuda():
    """The quantization kernel is built once for all row counts (a batch's token count is any number): a variant
    per M % 16 would be compiled mid-run by the first batch of a multiple-of-16 length. Each result is the torch
    quantization's."""
    device = torch.device("cuda", 0)
    g = torch.Generator(device=device).manual_seed(4)
    for m in (17, 32, 33, 48, 1000, 1024):
        x = torch.randn(m, 512, device=device, generator=g, dtype=torch.bfloat16)
        q, s = fp8_gemm.fp8_quantize(x)
        want_q, want_s = fp8.quantize_activation_padded(x, fp8_gemm.ROW_ALIGN)
        assert q.shape == want_q.shape and torch.allclose(s, want_s, rtol=1e-6, atol=0), m
        assert (q.view(torch.uint8) != want_q.view(torch.uint8)).float().mean() < 1e-3, m  # (division's last bit)
    kernel = fp8_gemm._QUANT_KERNEL
    caches = getattr(kernel, "device_caches", None)
    built = caches[device.index][0] if caches is not None else kernel.cache[device.index]
    assert len(built) == 1, list(built)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with FP8 tensor cores")
@pytest.mark.parametrize("compile_model", [False, True])
def test_fp8_states_equal_transformers_fp8_forward(tmp_path, compile_model):
    import pyarrow as pa
    import transformers

    from hsx.engine import Extractor, Pipeline
    from hsx.target.model import load_model
    from hsx.target.prepare import kernel_report, prepare_model

    device = torch.device("cuda", 0)
    folder, _ = _save_fp8_checkpoint(tmp_path, torch.device("cpu"))
    layers = [1, 2]  # (hidden_states[4] of a 4-layer model is after the final norm)
    cfg = ExtractConfig(model=str(folder), dataset="unused", output_dir="unused", layers=layers, dtype="bfloat16",
                        compile="off")
    loaded = load_model(cfg, device)
    report = kernel_report(loaded.base)["quantization"]
    assert report["linear"].startswith("hsx fp8") and report["fp8_linears"] == 3 * 7, report
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in loaded.base.modules()
               if isinstance(m, fp8_gemm.Fp8Linear))
    x = torch.randn(100, 768, device=device, dtype=torch.bfloat16)
    for name, m in loaded.base.named_modules():  # each layer alone first: the kernels equal the maths
        if isinstance(m, fp8_gemm.Fp8Linear):
            xi = x[:, :m.in_features]
            want = _emulated_fp8_linear_forward(m, xi).float()
            assert ((m(xi).float() - want).norm() / want.norm()).item() < 1e-2, name
    # the bf16 forward of the same (dequantized) weights is measurably away: the activations' quantization
    from hsx.target import drift

    d = drift.compare(loaded.base, layers, False, [drift.DriftRow(np.arange(3, 40))], device)
    assert d["switched"] == 3 * 7 and all(0 < v < 0.5 for v in d["relative_error"]["fp8_vs_bf16"].values()), d
    ex = Extractor(loaded, device, 1024, prepare_model(loaded.base, "varlen", compile_model, cuda=True))
    rng = np.random.default_rng(0)
    rows = [rng.integers(3, 500, n).astype(np.int32) for n in (17, 200, 5, 130)]
    table = pa.table({
        "sample_id": pa.array(np.arange(len(rows)), pa.int64()),
        "input_ids": pa.array([r.tolist() for r in rows], pa.list_(pa.int32())),
        "loss_mask": pa.array([[1] * len(r) for r in rows], pa.list_(pa.int8())),
        "num_tokens": pa.array([len(r) for r in rows], pa.int32()),
    })
    if compile_model:
        warm = Pipeline(ex, iter([table]), max_batch_tokens=4096)
        warm(table)
        warm.close()
        assert ex.compiler.wait(600) and ex.compiler.ready.is_set()
    pipe = Pipeline(ex, iter([table]), max_batch_tokens=4096)
    out = pipe(table)
    got = torch.from_numpy(out.column("hidden_states").combine_chunks().flatten().flatten().to_numpy().copy())
    got = got.view(torch.bfloat16)
    pipe.close()

    # transformers' own forward of the same checkpoint, one unpadded row at a time, with two attention kernels
    def reference(attn):
        model = transformers.AutoModel.from_pretrained(str(folder), device_map={"": device}, dtype=torch.bfloat16,
                                                       attn_implementation=attn).eval()
        linears = [m for m in model.modules() if type(m).__name__ == "FP8Linear"]
        assert len(linears) == 4 * 7 and linears[0].weight.dtype == torch.float8_e4m3fn

        def run():
            refs = []
            with torch.inference_mode():
                for r in rows:
                    o = model(input_ids=torch.from_numpy(r.astype(np.int64))[None].to(device),
                              output_hidden_states=True, use_cache=False)
                    refs.append(torch.cat([o.hidden_states[i + 1][0] for i in layers], dim=-1))
            return torch.cat(refs).cpu().reshape(-1)

        try:
            return run(), "transformers FP8Linear"
        except (ImportError, RuntimeError) as e:  # its kernel comes from the Hub (`kernels`): offline, emulate it
            print(f"transformers' FP8 kernel unavailable ({str(e).splitlines()[0][:100]}): its maths emulated")
            for m in linears:
                m.forward = _emulated_fp8_linear_forward.__get__(m)
            return run(), "transformers FP8Linear maths, float32 emulation"

    (ref, which), (other, _) = reference("sdpa"), reference("eager")
    rel = _rel(got, ref)
    # Activation quantization turns bf16-level differences upstream (one attention kernel's rounding against
    # another's) into flipped e4m3 values: transformers' own FP8 forward with eager attention is this far from
    # itself with SDPA. hsx (its packed attention kernel, compiled norms) must be no further than twice that.
    noise = _rel(other, ref)
    print(f"hsx vs {which}: relative error {rel:.2e}; transformers eager vs sdpa attention {noise:.2e} "
          f"(compile={compile_model}, {fp8_gemm.backend_of(device)})")
    assert rel < max(2 * noise, 1e-2), (which, rel, noise)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---- FP8 experts (MoE) --------------------------------------------------------------------------------------------

def _moe_config(kind: str):
    import transformers as T

    common = dict(vocab_size=512, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  num_experts=8, num_experts_per_tok=3, moe_intermediate_size=128, tie_word_embeddings=False,
                  max_position_embeddings=4096)
    if kind == "qwen3_moe":
        return T.Qwen3MoeConfig(**common, num_hidden_layers=2, intermediate_size=384, norm_topk_prob=True)
    return T.Qwen3_5MoeTextConfig(**common, num_hidden_layers=2, linear_conv_kernel_dim=4, linear_key_head_dim=64,
                                  linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                                  shared_expert_intermediate_size=128,
                                  layer_types=["linear_attention", "full_attention"])


MOE_KINDS = ["qwen3_moe"] + (["qwen3_5_moe_text"] if hasattr(__import__("transformers"), "Qwen3_5MoeTextConfig")
                             else [])


def _save_fp8_moe_checkpoint(folder, kind, seed=0):
    """A small random MoE quantized the official way: each expert's gate_proj / up_proj / down_proj stored as its own
    e4m3 weight with 128×128 block scales (the `-FP8` checkpoints' per-expert keys), the router and the shared
    expert's gate in bf16 (`modules_to_not_convert`); also the float32 model of the dequantized weights."""
    import transformers
    from safetensors.torch import save_file

    cfg = _moe_config(kind)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    width = cfg.moe_intermediate_size
    state = {}
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, STD * 3)
        for name, t in model.state_dict().items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                prefix = name.rsplit(".", 1)[0]
                for e in range(t.shape[0]):
                    parts = ({"gate_proj": slice(0, width), "up_proj": slice(width, 2 * width)}
                             if name.endswith("gate_up_proj") else {"down_proj": slice(None)})
                    for part, rows in parts.items():
                        q, s = official_quantize(t[e, rows])
                        state[f"{prefix}.{e}.{part}.weight"], state[f"{prefix}.{e}.{part}.weight_scale_inv"] = q, s
                        model.get_parameter(name)[e, rows] = fp8.dequantize_weight(q, s, torch.float32)
            elif (name.endswith(".weight") and ".layers." in name and t.dim() == 2 and t.shape[0] % 128 == 0
                  and not name.endswith("mlp.gate.weight")):
                q, s = official_quantize(t)
                state[name], state[name.rsplit(".", 1)[0] + ".weight_scale_inv"] = q, s
                model.get_parameter(name).copy_(fp8.dequantize_weight(q, s, torch.float32))
            else:
                state[name] = t.to(torch.bfloat16).contiguous()
                if name in dict(model.named_parameters()):
                    model.get_parameter(name).copy_(state[name].float())
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = cfg.to_dict()
    # (Gated DeltaNet's in_proj_a / in_proj_b, one row per head, stay bf16 too: no 128-row block)
    config["quantization_config"] = dict(OFFICIAL, modules_to_not_convert=["lm_head", "mlp.gate", "shared_expert_gate",
                                                                             "in_proj_a", "in_proj_b"])
    config["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    return folder, model


def _emulated_fp8_experts_linear(self, x, w, ws, activation_scale=None):
    """transformers' FP8Experts.linear (one expert's FP8 product), its maths emulated in float32."""
    return _emulated_fp8_linear_forward(SimpleNamespace(weight=w, weight_scale_inv=ws, bias=None), x)


def _load_fp8_as_stored_on_cpu(folder, monkeypatch):
    """transformers' load of the checkpoint as on a GPU (FP8Linear / FP8Experts modules holding the e4m3 tensors,
    the per-expert keys fused into its (E, 2·width, hidden) layout), here on CPU: it dequantizes whenever it sees
    no CUDA device, so the test tells it there is one during the load."""
    import transformers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    model = transformers.AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    monkeypatch.undo()
    for m in model.modules():  # transformers' FP8 GEMM is a CUDA kernel: its maths emulated (as on CUDA above)
        if type(m).__name__ == "FP8Linear":
            m.forward = _emulated_fp8_linear_forward.__get__(m)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_fp8_experts_run_in_hsx_grouped_path_and_equal_transformers_fp8_maths(tmp_path, monkeypatch, kind):
    """The checkpoint's experts as transformers loads them for a GPU (e4m3, block scales) run through hsx's grouped
    FP8 path (on CPU its torch reference, one expert dequantized at a time): the states equal transformers' own
    FP8 experts forward (its eager loop, the FP8 GEMM's maths emulated in float32)."""
    from transformers.integrations import finegrained_fp8 as hf_fp8

    from hsx.target import moe

    folder, _ = _save_fp8_moe_checkpoint(tmp_path, kind)
    model = _load_fp8_as_stored_on_cpu(folder, monkeypatch)
    experts = [m for m in model.modules() if isinstance(m, hf_fp8.FP8Experts)]
    assert len(experts) == 2 and experts[0].gate_up_proj.dtype == torch.float8_e4m3fn
    assert all(moe._fp8_experts_form(m) for m in experts)

    monkeypatch.setattr(hf_fp8.FP8Experts, "linear", _emulated_fp8_experts_linear)
    ids = torch.randint(3, 500, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        moe.use_experts(model, "eager")
        want = torch.stack(model(input_ids=ids, output_hidden_states=True).hidden_states[1:])
        moe.use_experts(model, moe.EXPERTS_IMPLEMENTATION)
        assert all(getattr(m, fp8_model.FP8_EXPERTS) for m in experts)
        got = torch.stack(model(input_ids=ids, output_hidden_states=True).hidden_states[1:])
    assert want.abs().max() > 0.1
    assert _rel(got, want) < 1e-3, _rel(got, want)
    report = fp8_model.report(model, fp8.quantization_of(model.config))
    assert report["experts"] == "hsx fp8 grouped (torch reference)" and report["fp8_experts"] == 2


def test_fp8_expert_ops_are_the_block_scaled_products():
    """The two ops against the maths written out per pair: x quantized per 1×128 block, each expert's weight
    dequantized per 128×128 block."""
    from hsx.target import moe_kernels

    torch.manual_seed(7)
    experts, hidden, width, k, tokens = 4, 256, 256, 2, 9
    gu = torch.randn(experts, 2 * width, hidden) * 0.05
    dn = torch.randn(experts, hidden, width) * 0.05
    gq, gs = zip(*(fp8.quantize_weight(g) for g in gu))
    dq, ds = zip(*(fp8.quantize_weight(d) for d in dn))
    gq, gs, dq, ds = (torch.stack(t) for t in (gq, gs, dq, ds))
    x = torch.randn(tokens, hidden)
    ids = torch.stack([torch.randperm(experts - 1)[:k] for _ in range(tokens)])  # expert 3: no rows
    w = torch.rand(tokens, k)
    expert_of_pair, order = torch.sort(ids.reshape(-1), stable=True)
    offsets = torch.searchsorted(expert_of_pair, torch.arange(1, experts + 1), out_int32=True)
    xq, xs = fp8_gemm.fp8_quantize(x)
    y = moe_kernels.fp8_gate_up_activation(xq, xs, order, offsets, gq, gs, k, torch.float32)
    aq, a_s = fp8_gemm.fp8_quantize(y)
    z = moe_kernels.fp8_grouped_down(aq, a_s, order, offsets, w, dq, ds, torch.float32)
    for r, p in enumerate(order.tolist()):
        e, t = ids.reshape(-1)[p].item(), p // k
        xr = fp8.reference_mm(*fp8.quantize_activation(x[t:t + 1]), gq[e], gs[e], torch.float32)
        want_y = torch.nn.functional.silu(xr[:, :width]) * xr[:, width:]
        torch.testing.assert_close(y[r:r + 1], want_y, rtol=1e-5, atol=1e-6)
        want_z = fp8.reference_mm(*fp8.quantize_activation(y[r:r + 1]), dq[e], ds[e], torch.float32) * w.reshape(-1)[p]
        torch.testing.assert_close(z[r:r + 1], want_z, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fp8_moe_checkpoint_loads_on_cpu_dequantized(tmp_path, capsys):
    """On CPU transformers dequantizes the experts too: the states equal the float32 model of the dequantized
    weights, the line says so, and hsx.json's report names it."""
    from hsx.target.model import load_model
    from hsx.target.prepare import kernel_report

    folder, causal = _save_fp8_moe_checkpoint(tmp_path, "qwen3_moe")
    loaded = load_model(ExtractConfig(model=str(folder), dataset="unused", output_dir="unused", layers=[1],
                                      dtype="float32", compile="off"), torch.device("cpu"))
    report = kernel_report(loaded.base)["quantization"]
    assert report["experts"] == "dequantized by transformers" and report["fp8_experts"] == 0
    assert "experts" in fp8.runs_instead(fp8.quantization_of(loaded.text_config), torch.device("cpu"))
    ids = torch.arange(3, 40)[None]
    with torch.inference_mode():
        got = loaded.base(input_ids=ids, output_hidden_states=True).hidden_states[1]
        want = causal.model(input_ids=ids, output_hidden_states=True).hidden_states[1]
    assert _rel(got, want) < 1e-3


def test_fp8_moe_shape_plans_and_builds_random_e4m3_experts():
    """`--shape qwen3-30b-a3b-fp8` is an FP8 MoE config; its random experts are built e4m3 with block scales, in
    the form hsx's FP8 experts path runs (built here on CPU at a tiny size)."""
    from hsx.cost import is_fp8, job_plan, shape_config
    from hsx.target import moe

    c = shape_config("qwen3-30b-a3b-fp8")
    assert is_fp8(c) and c.num_experts == 128
    # unmeasured: planned no faster than the bf16 checkpoint
    fast, slow = (job_plan(None, {"layers": "eagle3"}, shape=s, tokens=10**9)
                  for s in ("qwen3-30b-a3b-fp8", "qwen3-30b-a3b"))
    assert fast["expected_seconds"] >= 0.99 * slow["expected_seconds"]
    tiny = _moe_config("qwen3_moe")
    tiny.quantization_config = dict(OFFICIAL)
    causal = bench_models.random_causal_lm(tiny, torch.device("cpu"), "sdpa")
    experts = [m for m in causal.modules() if type(m).__name__.endswith("Experts")]
    assert experts and all(m.gate_up_proj.dtype == torch.float8_e4m3fn and m.down_proj_scale_inv.shape == (8, 2, 1)
                           for m in experts)
    moe.use_experts(causal, moe.EXPERTS_IMPLEMENTATION)
    assert all(getattr(m, fp8_model.FP8_EXPERTS) for m in experts)
    assert type(causal.model.layers[0].mlp.gate).__name__.endswith("Router")  # the router stays bf16
    with torch.inference_mode():
        out = causal.model(input_ids=torch.arange(3, 40)[None]).last_hidden_state
    assert torch.isfinite(out.float()).all() and out.float().abs().max() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with FP8 tensor cores")
@pytest.mark.parametrize("tokens", [1, 333, 4096])
def test_fp8_expert_kernels_equal_the_reference(tokens):
    """The Triton FP8 experts kernels against their torch reference (the same ops on CPU tensors), at
    Qwen3-30B-A3B's expert shape (hidden 2048, width 768, 128 experts, top-8), some experts without rows."""
    from hsx.target import moe_kernels

    device = torch.device("cuda", 0)
    g = torch.Generator(device=device).manual_seed(0)
    experts, hidden, width, k = 128, 2048, 768, 8
    gq = torch.empty(experts, 2 * width, hidden, device=device, dtype=torch.float8_e4m3fn)
    gs = torch.empty(experts, 2 * width // 128, hidden // 128, device=device)
    dq = torch.empty(experts, hidden, width, device=device, dtype=torch.float8_e4m3fn)
    ds = torch.empty(experts, hidden // 128, width // 128, device=device)
    for e in range(experts):
        gq[e], gs[e] = fp8.quantize_weight(torch.randn(2 * width, hidden, device=device, generator=g) * 0.02)
        dq[e], ds[e] = fp8.quantize_weight(torch.randn(hidden, width, device=device, generator=g) * 0.02)
    x = torch.randn(tokens, hidden, device=device, generator=g, dtype=torch.bfloat16)
    ids = torch.rand(tokens, experts - 5, device=device, generator=g).topk(k, dim=-1).indices  # 5 experts idle
    w = torch.rand(tokens, k, device=device, generator=g).bfloat16()
    expert_of_pair, order = torch.sort(ids.reshape(-1).to(torch.int16), stable=True)
    offsets = torch.searchsorted(expert_of_pair, torch.arange(1, experts + 1, device=device, dtype=torch.int16),
                                 out_int32=True)
    xq, xs = fp8_gemm.fp8_quantize(x)
    y = moe_kernels.fp8_gate_up_activation(xq, xs, order, offsets, gq, gs, k, torch.bfloat16)
    cpu = [t.cpu() for t in (xq, xs, order, offsets, gq, gs)]
    y_ref = moe_kernels.fp8_gate_up_activation(*cpu, k, torch.bfloat16)
    assert _rel(y.cpu(), y_ref) < 1e-2, _rel(y.cpu(), y_ref)
    aq, a_s = fp8_gemm.fp8_quantize(y)
    z = moe_kernels.fp8_grouped_down(aq, a_s, order, offsets, w, dq, ds, torch.bfloat16)
    z_ref = moe_kernels.fp8_grouped_down(*(t.cpu() for t in (aq, a_s, order, offsets, w, dq, ds)), torch.bfloat16)
    assert _rel(z.cpu(), z_ref) < 1e-2, _rel(z.cpu(), z_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with FP8 tensor cores")
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_fp8_moe_blocks_equal_transformers_fp8_forward(tmp_path, kind):
    """On CUDA hsx loads the FP8 MoE checkpoint as stored and runs its experts on the FP8 kernels: each MoE block
    (router, e4m3 experts, shared expert), given the very input transformers' own FP8 forward gave it, returns what
    transformers' block returned. Block by block, not the model's states: in a random MoE, activation quantization
    turns a last-bit difference upstream (one attention or delta-rule kernel's rounding against another's) into
    flipped e4m3 values and flipped expert choices downstream (on an H200 transformers' own eager and SDPA forwards
    of this model are 8% apart at its second layer), which would hide the experts' own error."""
    import transformers

    from hsx.target import moe
    from hsx.target.model import load_model
    from hsx.target.prepare import kernel_report

    device = torch.device("cuda", 0)
    folder, _ = _save_fp8_moe_checkpoint(tmp_path, kind)
    loaded = load_model(ExtractConfig(model=str(folder), dataset="unused", output_dir="unused", layers=[0, 1],
                                      dtype="bfloat16", compile="off"), device)
    moe.use_experts(loaded.base, moe.EXPERTS_IMPLEMENTATION)
    report = kernel_report(loaded.base)["quantization"]
    assert report["experts"] == "hsx fp8 grouped (triton)" and report["fp8_experts"] == 2, report
    ref = transformers.AutoModel.from_pretrained(str(folder), device_map={"": device}, dtype=torch.bfloat16).eval()
    seen = []  # (layer, the block's input, its output) as transformers' forward ran it
    for i, layer in enumerate(ref.layers):
        layer.mlp.register_forward_hook(lambda m, args, out, i=i: seen.append(
            (i, args[0].detach().clone(), (out[0] if isinstance(out, tuple) else out).detach().clone())))
    rng = np.random.default_rng(0)
    with torch.inference_mode():
        for n in (17, 200, 5):
            ids = torch.from_numpy(rng.integers(3, 500, n))[None].to(device)
            try:
                ref(input_ids=ids)
            except (ImportError, RuntimeError):  # its FP8 kernels come from the Hub (`kernels`): offline, emulated
                from transformers.integrations import finegrained_fp8 as hf_fp8

                seen.clear()
                for m in ref.modules():
                    if type(m).__name__ == "FP8Linear":
                        m.forward = _emulated_fp8_linear_forward.__get__(m)
                    elif isinstance(m, hf_fp8.FP8Experts):
                        m.linear = _emulated_fp8_experts_linear.__get__(m)
                moe.use_experts(ref, "eager")  # (the loop that calls `linear`)
                ref(input_ids=ids)
        assert len(seen) == 2 * 3
        for i, x, want in seen:
            out = loaded.base.layers[i].mlp(x)
            got = out[0] if isinstance(out, tuple) else out
            rel = _rel(got, want)
            print(f"hsx FP8 MoE block {i} vs transformers' FP8 forward ({kind}, {x.shape[1]} tokens): {rel:.2e}")
            assert want.float().abs().max() > 0 and rel < 2e-2, (i, x.shape, rel)


def test_fp8_expert_kernels_are_checked_once_and_a_failing_one_leaves_the_reference(monkeypatch):
    from hsx.target import moe_kernels

    g = torch.Generator().manual_seed(0)
    gate_up, gate_up_scale = fp8.quantize_weight(torch.randn(4, 256, 256, generator=g).flatten(0, 1))
    gate_up, gate_up_scale = gate_up.view(4, 256, 256), gate_up_scale.view(4, 2, 2)
    monkeypatch.setattr(moe_kernels, "_FP8_KERNEL_CHECKS", {})
    with pytest.warns(UserWarning, match="gate_up kernel failed its check on cpu .*slow reference"):
        # no Triton kernel runs on CPU tensors
        assert not moe_kernels._fp8_kernels_take(gate_up, gate_up_scale, "gate_up")
    assert not moe_kernels._fp8_kernels_take(gate_up, gate_up_scale, "gate_up")  # decided once: no second warning
    # a kernel that computes the reference passes; one that is off by 5% does not
    monkeypatch.setattr(moe_kernels, "_FP8_KERNEL_CHECKS", {})
    monkeypatch.setattr(moe_kernels, "_fp8_gate_up_cuda", moe_kernels._fp8_gate_up_reference)
    assert moe_kernels._fp8_kernels_take(gate_up, gate_up_scale, "gate_up")
    down, down_scale = fp8.quantize_weight(torch.randn(4 * 256, 128, generator=g))
    down, down_scale = down.view(4, 256, 128), down_scale.view(4, 2, 1)
    monkeypatch.setattr(moe_kernels, "_fp8_down_cuda", lambda *a: moe_kernels._fp8_down_reference(*a) * 1.05)
    with pytest.warns(UserWarning, match="down kernel failed its check .*differs from the reference"):
        assert not moe_kernels._fp8_kernels_take(down, down_scale, "down")


def test_the_record_says_which_fp8_experts_ran_on_the_reference_after_a_failed_check(monkeypatch):
    """hsx.json's `experts` names what ran: an FP8 experts module whose kernel failed its check runs (and is
    recorded as) the torch reference, not "triton"."""
    from hsx.target import moe_kernels

    g = torch.Generator().manual_seed(0)
    gate_up, gate_up_scale = fp8.quantize_weight(torch.randn(4 * 256, 256, generator=g))
    down, down_scale = fp8.quantize_weight(torch.randn(4 * 256, 128, generator=g))

    class TinyExperts(torch.nn.Module):  # the attributes report and the checks read
        has_gate = True

        def __init__(self):
            super().__init__()
            self.gate_up_proj, self.gate_up_proj_scale_inv = gate_up.view(4, 256, 256), gate_up_scale.view(4, 2, 2)
            self.down_proj, self.down_proj_scale_inv = down.view(4, 256, 128), down_scale.view(4, 2, 1)

    monkeypatch.setattr(moe_kernels, "_FP8_KERNEL_CHECKS", {})
    # (CPU tensors: the kernels' maths)
    monkeypatch.setattr(moe_kernels, "_fp8_gate_up_cuda", moe_kernels._fp8_gate_up_reference)
    monkeypatch.setattr(moe_kernels, "_fp8_down_cuda", moe_kernels._fp8_down_reference)
    right = TinyExperts()
    assert moe_kernels.fp8_experts_run_on(right, cuda=True) == "triton"
    assert moe_kernels.fp8_experts_run_on(right, cuda=False) == "torch reference"
    monkeypatch.setattr(moe_kernels, "_FP8_KERNEL_CHECKS", {})
    monkeypatch.setattr(moe_kernels, "_fp8_down_cuda", lambda *a: moe_kernels._fp8_down_reference(*a) * 1.05)
    with pytest.warns(UserWarning, match="down kernel failed its check"):
        assert moe_kernels.fp8_experts_run_on(right, cuda=True) == "torch reference"
    layers = torch.nn.ModuleList([TinyExperts(), TinyExperts()])
    for m, ran in zip(layers, ("triton", "torch reference")):
        setattr(m, fp8_model.FP8_EXPERTS, True)
        setattr(m, fp8_model.FP8_EXPERTS_RUN_ON, ran)
    report = fp8_model.report(layers, fp8.quantization_of(SimpleNamespace(quantization_config=OFFICIAL)))
    assert report["experts"] == "hsx fp8 grouped (torch reference, triton)" and report["fp8_experts"] == 2


# ---- the block-scaled GEMM's choice (fbgemm, cuBLAS, Triton) ---------------------------------------------------------

class warnings_recorded:
    """Every warning raised within, recorded (none filtered out)."""

    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings(record=True)
        seen = self._ctx.__enter__()
        warnings.simplefilter("always")
        return seen

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def _fbgemm_contract(calls):
    """A stand-in for torch.ops.fbgemm.f8f8bf16_groupwise that holds its callers to fbgemm 1.6.0's contract (CUTLASS
    SM90 block scaling, MN-major scales; the kernel checks none of it): XQ (M, K) and WQ (N, K) e4m3, contiguous;
    x_scale (K/128, M) and w_scale (K/128, N/128) float32, contiguous; bf16 (M, N) out."""
    def op(xq, wq, x_scale, w_scale):
        (m, k), n = xq.shape, wq.shape[0]
        assert xq.dtype == wq.dtype == torch.float8_e4m3fn and xq.is_contiguous() and wq.is_contiguous()
        assert x_scale.dtype == w_scale.dtype == torch.float32
        assert x_scale.shape == (k // 128, m) and x_scale.is_contiguous(), (x_scale.shape, x_scale.stride())
        assert w_scale.shape == (k // 128, n // 128) and w_scale.is_contiguous(), (w_scale.shape, w_scale.stride())
        calls.append((m, n, k))
        return fp8.reference_mm(xq, x_scale.t(), wq, w_scale.t())
    return op


CUBLAS_MM = fp8_gemm._cublas_mm  # (gemm_state stands in for it)


@pytest.fixture
def gemm_state(monkeypatch):
    """hsx.target.fp8_gemm's GEMM choice and checks, fresh; cuBLAS stood in for by the reference product (CPU
    tensors)."""
    for name in ("_BACKEND", "_CHOSEN", "_SHAPES", "_JIT_BUILT"):
        monkeypatch.setattr(fp8_gemm, name, {})
    cublas = []

    def reference(xq, xs, w, ws):
        cublas.append(w.shape)
        return fp8.reference_mm(xq, xs, w, ws)

    monkeypatch.setattr(fp8_gemm, "_cublas_mm", reference)
    return monkeypatch, cublas


def _weights(n=256, k=384, seed=0):
    return fp8.quantize_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05)


def test_fbgemm_runs_the_gemm_where_it_agrees_with_the_reference(gemm_state):
    monkeypatch, cublas = gemm_state
    calls = []
    monkeypatch.setattr(fp8_gemm, "_FBGEMM", [(_fbgemm_contract(calls), None)])
    cpu = torch.device("cpu")
    with warnings_recorded() as seen:
        assert fp8_gemm.use_gemm(cpu, "fbgemm") == "fbgemm" and fp8_gemm.backend_of(cpu) == "fbgemm"
    assert not seen and calls  # checked on a small product (16 and 200 rows), silently
    w, ws = _weights()
    xq, xs = fp8.quantize_activation_padded(torch.randn(37, 384), fp8_gemm.ROW_ALIGN)  # rows padded: M = 48
    calls.clear()
    y = fp8_gemm._block_mm(xq, xs, w, ws)
    assert calls[-1] == (48, 256, 384) and not cublas  # the shape's check, then the product itself
    torch.testing.assert_close(y.float(), fp8.reference_mm(xq, xs, w, ws, torch.float32), rtol=1e-2, atol=1e-3)


def test_a_wrong_or_failing_fbgemm_falls_back_to_cublas_with_one_warning(gemm_state):
    monkeypatch, cublas = gemm_state
    cpu = torch.device("cpu")
    right = _fbgemm_contract([])

    def scales_row_major(xq, wq, x_scale, w_scale):  # reads w_scale (N/128, K/128) as if it were (K/128, N/128)
        return right(xq, wq, x_scale, w_scale.t().contiguous().view(w_scale.shape))

    monkeypatch.setattr(fp8_gemm, "_FBGEMM", [(scales_row_major, None)])
    with pytest.warns(UserWarning, match=r"fbgemm's f8f8bf16_groupwise: relative error .* cuBLAS's block-scaled "
                                         r"_scaled_mm instead") as seen:
        assert fp8_gemm.use_gemm(cpu, "fbgemm") == "cublas"
    assert len(seen) == 1
    with warnings_recorded() as again:
        assert fp8_gemm.use_gemm(cpu, "fbgemm") == "cublas" and fp8_gemm.backend_of(cpu) == "cublas"  # decided once
        w, ws = _weights(256, 512)
        xq, xs = fp8.quantize_activation_padded(torch.randn(5, 512), fp8_gemm.ROW_ALIGN)
        fp8_gemm._block_mm(xq, xs, w, ws)
    assert not again and cublas[-1] == (256, 512)

    def raises(*a):
        raise RuntimeError("cutlass cannot initialize\nmore")

    for name in ("_BACKEND", "_CHOSEN"):
        monkeypatch.setattr(fp8_gemm, name, {})
    monkeypatch.setattr(fp8_gemm, "_FBGEMM", [(raises, None)])
    with pytest.warns(UserWarning, match="RuntimeError: cutlass cannot initialize more;") as seen:
        assert fp8_gemm.use_gemm(cpu, "fbgemm") == "cublas"
    assert len(seen) == 1


def test_auto_runs_cublas_the_fastest_and_no_fbgemm_is_said_only_when_asked_for(gemm_state):
    monkeypatch, cublas = gemm_state
    calls = []
    monkeypatch.setattr(fp8_gemm, "_FBGEMM", [(_fbgemm_contract(calls), None)])
    cpu = torch.device("cpu")
    with warnings_recorded() as seen:
        assert fp8_gemm.use_gemm(cpu) == "cublas"  # fbgemm installed and right, but slower: not even checked
    assert not seen and not calls and cublas

    def cublas_fails(*a):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    for name in ("_BACKEND", "_CHOSEN"):
        monkeypatch.setattr(fp8_gemm, name, {})
    monkeypatch.setattr(fp8_gemm, "_cublas_mm", cublas_fails)
    with pytest.warns(UserWarning, match="CUBLAS_STATUS_NOT_SUPPORTED; FP8 linears run on fbgemm's"):
        assert fp8_gemm.use_gemm(cpu) == "fbgemm"  # the next fastest
    for name in ("_BACKEND", "_CHOSEN"):
        monkeypatch.setattr(fp8_gemm, name, {})
    monkeypatch.setattr(fp8_gemm, "_FBGEMM", [(None, None)])
    monkeypatch.setattr(fp8_gemm, "_triton_mm", fp8.reference_mm)  # (a CUDA kernel: its maths here)
    with pytest.warns(UserWarning, match="CUBLAS_STATUS_NOT_SUPPORTED; FP8 linears run on hsx's Triton") as seen:
        assert fp8_gemm.use_gemm(cpu) == "triton"
    assert "fbgemm" not in str(seen[0].message)  # not installed, not asked for: not a word
    monkeypatch.setattr(fp8_gemm, "_cublas_mm", lambda *a: cublas.append(a[2].shape) or fp8.reference_mm(*a))
    for name in ("_BACKEND", "_CHOSEN"):
        monkeypatch.setattr(fp8_gemm, name, {})
    with warnings_recorded() as seen:
        assert fp8_gemm.use_gemm(cpu) == "cublas"
    assert not seen
    with pytest.warns(UserWarning, match="fbgemm_gpu is not installed .*cuBLAS's block-scaled _scaled_mm instead"):
        assert fp8_gemm.use_gemm(cpu, "fbgemm") == "cublas"
    with warnings_recorded() as seen:
        assert fp8_gemm.use_gemm(cpu, "cublas") == "cublas"  # asked for: fbgemm not even looked at
    assert not seen
    with pytest.raises(HsxError, match="fp8_gemm 'fast' is not one of auto, cublas, deepgemm, fbgemm, flashinfer, "
                                       "triton"):
        fp8_gemm.use_gemm(cpu, "fast")


def test_a_weight_shape_fbgemm_gets_wrong_runs_on_cublas_and_the_report_says_so(gemm_state):
    monkeypatch, cublas = gemm_state
    right = _fbgemm_contract([])
    monkeypatch.setattr(fp8_gemm, "_FBGEMM", [(lambda xq, wq, a, b: right(xq, wq, a, b) * (1.1 if wq.shape[0] == 512
                                                                                       else 1.0), None)])
    cpu = torch.device("cpu")
    assert fp8_gemm.use_gemm(cpu, "fbgemm") == "fbgemm"  # its check's shape (384 × 512) is right
    (w1, s1), (w2, s2) = _weights(256, 512), _weights(512, 512, seed=1)
    xq, xs = fp8.quantize_activation_padded(torch.randn(5, 512), fp8_gemm.ROW_ALIGN)
    with pytest.warns(UserWarning, match=r"fbgemm's f8f8bf16_groupwise failed its check for 512×512 FP8 weights on "
                                         r"cpu \(relative error .*\); cuBLAS's block-scaled _scaled_mm, else hsx's "
                                         r"Triton block GEMM runs weights of this shape") as seen:
        fp8_gemm._block_mm(xq, xs, w2, s2)
    assert len(seen) == 1 and cublas[-1] == (512, 512)
    with warnings_recorded() as again:
        fp8_gemm._block_mm(xq, xs, w2, s2)
    assert not again
    layers = torch.nn.Sequential(fp8_gemm.Fp8Linear(w1, s1, None), fp8_gemm.Fp8Linear(w2, s2, None))
    report = fp8_model.report(layers, fp8.quantization_of(SimpleNamespace(quantization_config=OFFICIAL)))
    assert report["linear"] == "hsx fp8 (fbgemm)" and report["gemm_by_shape"] == {"512x512": "cublas"}


def test_the_fallback_warning_names_only_gemms_that_are_installed_and_deepgemm_from_its_row_floor(gemm_state):
    monkeypatch, cublas = gemm_state
    right = _fbgemm_contract([])
    monkeypatch.setattr(fp8_gemm, "_FBGEMM", [(lambda xq, wq, a, b: right(xq, wq, a, b) * (1.1 if wq.shape[0] == 512
                                                                                       else 1.0), None)])
    monkeypatch.setattr(fp8_gemm, "_DEEPGEMM", [(_deepgemm_contract([]), None)])
    cpu = torch.device("cpu")
    assert fp8_gemm.use_gemm(cpu, "fbgemm") == "fbgemm"
    w2, s2 = _weights(512, 512, seed=1)
    xq, xs = fp8.quantize_activation_padded(torch.randn(5, 512), fp8_gemm.ROW_ALIGN)
    with pytest.warns(UserWarning, match=r"512×512 FP8 weights on cpu \(relative error .*\); DeepGEMM's fp8_gemm_nt "
                                         r"\(from 8,192 rows\), else cuBLAS's block-scaled _scaled_mm, else hsx's "
                                         r"Triton block GEMM runs weights of this shape") as seen:
        fp8_gemm._block_mm(xq, xs, w2, s2)  # (5 rows: cuBLAS multiplies them)
    assert len(seen) == 1 and cublas[-1] == (512, 512)


def test_weights_whose_k_cublas_cannot_scale_run_on_the_next_gemm_without_a_word(gemm_state):
    """cuBLAS's 128×128 scales need K/128 a multiple of 4: torch 2.11 returned wrong products for K = 256 on an
    H200 and refused padded scales, so such weights go to the next GEMM unasked, and hsx.json's record says so."""
    monkeypatch, cublas = gemm_state
    monkeypatch.setattr(fp8_gemm, "_FBGEMM", [(None, None)])
    monkeypatch.setattr(fp8_gemm, "_triton_mm", fp8.reference_mm)  # (a CUDA kernel: its maths here)
    cpu = torch.device("cpu")
    assert fp8_gemm.use_gemm(cpu) == "cublas"
    (w1, s1), (w2, s2) = _weights(256, 512), _weights(256, 256, seed=1)
    with warnings_recorded() as seen:
        assert fp8_gemm._runs(w1, s1) == "cublas" and fp8_gemm._runs(w2, s2) == "triton"
    assert not seen and (256, 256) not in cublas
    layers = torch.nn.Sequential(fp8_gemm.Fp8Linear(w1, s1, None), fp8_gemm.Fp8Linear(w2, s2, None))
    report = fp8_model.report(layers, fp8.quantization_of(SimpleNamespace(quantization_config=OFFICIAL)))
    assert report["linear"] == "hsx fp8 (cublas)" and report["gemm_by_shape"] == {"256x256": "triton"}
    xq, xs = fp8.quantize_activation_padded(torch.randn(5, 256), fp8_gemm.ROW_ALIGN)
    with pytest.raises(ValueError, match="K/128 a multiple of 4"):  # never a wrong product, even called directly
        CUBLAS_MM(xq, xs, w2, s2)


def test_fbgemm_import_keeps_the_root_logger_unconfigured_and_a_missing_op_is_named(tmp_path, monkeypatch, capfd):
    """fbgemm_gpu 1.6.0 logs a version-table warning through the root logger as it imports; an unconfigured root
    logger would install a stderr handler for the whole process. A package without the op is one reason."""
    import logging
    import sys

    pkg = tmp_path / "fbgemm_gpu"
    (pkg / "experimental" / "gen_ai").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import logging\nlogging.warning('no entry for 1.6.0 of FBGEMM')\n")
    (pkg / "experimental" / "__init__.py").write_text("")
    (pkg / "experimental" / "gen_ai" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(logging.root, "handlers", [])
    try:
        op, why = fp8_gemm._load_fbgemm()
    finally:
        for name in [m for m in sys.modules if m == "fbgemm_gpu" or m.startswith("fbgemm_gpu.")]:
            del sys.modules[name]
    assert op is None and why == "this fbgemm_gpu has no torch.ops.fbgemm.f8f8bf16_groupwise (it is fbgemm-gpu-genai's)"
    assert logging.root.handlers == [] and logging.root.manager.disable == 0
    assert "no entry" not in capfd.readouterr().err


def _deepgemm_contract(calls):
    """A stand-in for the deep_gemm module holding its callers to fp8_gemm_nt's SM90 contract (recipe (1, 128, 128),
    DeepGEMM 2.6): a (M, K) and b (N, K) e4m3, K-major; sfa float32 (M, K/128) MN-major with M a multiple of 4 (TMA
    alignment); sfb float32 (N/128, K/128) K-major, contiguous; d bf16 (M, N) row-major, written in place."""
    def fp8_gemm_nt(a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="nk",
                    disable_ue8m0_cast=False):
        (xq, xs), (wq, ws) = a, b
        (m, k), n = xq.shape, wq.shape[0]
        assert xq.dtype == wq.dtype == torch.float8_e4m3fn and xq.stride(-1) == 1 and wq.stride(-1) == 1
        assert xs.dtype == ws.dtype == torch.float32 and c is None and recipe is None
        assert xs.shape == (m, k // 128) and xs.stride(0) == 1 and m % 4 == 0, (xs.shape, xs.stride())
        assert ws.shape == (n // 128, k // 128) and ws.is_contiguous()
        assert d.dtype == torch.bfloat16 and d.shape == (m, n) and d.is_contiguous()
        calls.append((m, n, k))
        d.copy_(fp8.reference_mm(xq, xs, wq, ws))
    return SimpleNamespace(fp8_gemm_nt=fp8_gemm_nt)


def _runs_from_its_row_floor(name: str, calls: list, cublas: list) -> None:
    """JIT GEMM `name` (its stand-in recording `calls`) asked for on the CPU device: checked on JIT_MIN_ROWS rows
    without a word; products from that floor (rows padded to ROW_ALIGN decide: floor - 1 rows are the floor's) run
    on it, smaller ones on cuBLAS (`cublas`), each equal to the float32 product; the report names it and what runs
    under its floor."""
    cpu, floor = torch.device("cpu"), fp8_gemm.JIT_MIN_ROWS
    with warnings_recorded() as seen:
        assert fp8_gemm.use_gemm(cpu, name) == name and fp8_gemm.backend_of(cpu) == name
    assert not seen and calls == [(floor, 384, 512)] and not cublas  # the device's check: the floor's rows
    w, ws = _weights(256, 512)
    for rows, runs_on in ((37, "cublas"), (floor - fp8_gemm.ROW_ALIGN, "cublas"), (floor - 1, name),
                          (floor + 5, name)):
        xq, xs = fp8.quantize_activation_padded(torch.randn(rows, 512), fp8_gemm.ROW_ALIGN)
        calls.clear(), cublas.clear()
        y = fp8_gemm._block_mm(xq, xs, w, ws)
        assert (calls[-1] == (xq.shape[0], 256, 512) and not cublas) if runs_on == name else \
            (cublas[-1] == (256, 512) and all(m == floor for m, _, _ in calls)), (rows, calls, cublas)
        torch.testing.assert_close(y.float(), fp8.reference_mm(xq, xs, w, ws, torch.float32), rtol=1e-2, atol=1e-3)
    layers = torch.nn.Sequential(fp8_gemm.Fp8Linear(w, ws, None))
    report = fp8_model.report(layers, fp8.quantization_of(SimpleNamespace(quantization_config=OFFICIAL)))
    assert report["linear"] == f"hsx fp8 ({name})" and "gemm_by_shape" not in report
    assert report["gemm_under_rows"] == {"rows": floor, "gemm": "cublas"}


def test_deepgemm_runs_when_asked_from_its_row_floor_and_the_next_gemm_below(gemm_state):
    """DeepGEMM compiles a kernel per tile shape, which its heuristic picks from M: products of fewer than
    JIT_MIN_ROWS rows run on the next GEMM, and its checks multiply that many rows (the kernel larger ones run)."""
    monkeypatch, cublas = gemm_state
    calls = []
    monkeypatch.setattr(fp8_gemm, "_DEEPGEMM", [(_deepgemm_contract(calls), None)])
    _runs_from_its_row_floor("deepgemm", calls, cublas)


def test_deepgemm_kernels_are_built_before_the_first_batch_for_every_row_count_a_batch_can_have(gemm_state):
    """DeepGEMM picks a tile shape (and compiles its kernel) from ceil(M / block_m), block_m 64, 128 or 256: one
    product per weight shape DeepGEMM runs and per multiple of 64 rows from its floor to the job's largest batch
    builds them all; weights it does not run (N not whole scale blocks) and row counts under the floor are left."""
    monkeypatch, cublas = gemm_state
    calls = []
    monkeypatch.setattr(fp8_gemm, "_DEEPGEMM", [(_deepgemm_contract(calls), None)])
    cpu, floor = torch.device("cpu"), fp8_gemm.JIT_MIN_ROWS
    assert fp8_gemm.use_gemm(cpu, "deepgemm") == "deepgemm"
    layers = torch.nn.Sequential(*(fp8_gemm.Fp8Linear(*_weights(n, k), None)
                                   for n, k in ((256, 512), (128, 512), (256, 512), (200, 512))))
    calls.clear()
    assert fp8_gemm.build_jit_kernels(layers, floor - 1) == {} and not calls
    assert [fp8_gemm._runs(m.weight, m.weight_scale_inv, floor) for m in layers] == ["deepgemm"] * 3 + ["triton"]
    calls.clear()  # (each weight shape's check multiplied `floor` rows)
    (shapes, products, seconds), = fp8_gemm.build_jit_kernels(layers, floor + 100).values()
    rows = [floor, floor + 64, floor + 128]  # 8,292 rows pick the tile shape of 8,320
    assert (shapes, products) == (2, 6) and seconds >= 0 and not cublas
    assert calls == [(m, n, 512) for n in (256, 128) for m in rows], calls
    calls.clear()  # a second job in this process: nothing built again, only row counts it had not reached
    assert fp8_gemm.build_jit_kernels(layers, floor + 100)["deepgemm"][:2] == (2, 0) and not calls
    assert fp8_gemm.build_jit_kernels(layers, floor + 150)["deepgemm"][:2] == (2, 2)
    assert calls == [(floor + 192, n, 512) for n in (256, 128)], calls


def test_auto_runs_deepgemm_where_installed_and_one_missing_or_failing_is_said_only_when_asked_for(gemm_state):
    monkeypatch, cublas = gemm_state
    calls = []
    monkeypatch.setattr(fp8_gemm, "_DEEPGEMM", [(_deepgemm_contract(calls), None)])
    cpu = torch.device("cpu")
    with warnings_recorded() as seen:
        assert fp8_gemm.use_gemm(cpu) == "deepgemm"  # installed and right: auto's first
    assert not seen and calls == [(fp8_gemm.JIT_MIN_ROWS, 384, 512)] and not cublas
    for name in ("_BACKEND", "_CHOSEN"):
        monkeypatch.setattr(fp8_gemm, name, {})
    monkeypatch.setattr(fp8_gemm, "_DEEPGEMM", [(None, None)])
    with warnings_recorded() as seen:
        assert fp8_gemm.use_gemm(cpu) == "cublas"  # not installed: auto goes on without a word
    assert not seen
    w, ws = _weights(256, 512)
    xq, xs = fp8.quantize_activation_padded(torch.randn(fp8_gemm.JIT_MIN_ROWS, 512), fp8_gemm.ROW_ALIGN)
    calls.clear()
    fp8_gemm._block_mm(xq, xs, w, ws)
    assert not calls and cublas[-1] == (256, 512)
    for name in ("_BACKEND", "_CHOSEN"):
        monkeypatch.setattr(fp8_gemm, name, {})
    with pytest.warns(UserWarning, match=r"deep_gemm is not installed \(github.com/deepseek-ai/DeepGEMM\); FP8 "
                                         r"linears run on cuBLAS's block-scaled _scaled_mm instead") as seen:
        assert fp8_gemm.use_gemm(cpu, "deepgemm") == "cublas"
    assert len(seen) == 1

    def no_compiler(a, b, d, **kw):  # DeepGEMM's JIT without nvcc (or a kernel its nvcc cannot build)
        raise RuntimeError("Assertion error (compiler.hpp:228): false and \"NVCC compilation failed\"")

    monkeypatch.setattr(fp8_gemm, "_DEEPGEMM", [(SimpleNamespace(fp8_gemm_nt=no_compiler), None)])
    for choice in ("auto", "deepgemm"):  # installed but failing: said either way
        for name in ("_BACKEND", "_CHOSEN", "_SHAPES"):
            monkeypatch.setattr(fp8_gemm, name, {})
        with pytest.warns(UserWarning, match=r"DeepGEMM's fp8_gemm_nt: RuntimeError: .*NVCC compilation failed.*; "
                                             r"FP8 linears run on cuBLAS's") as seen:
            assert fp8_gemm.use_gemm(cpu, choice) == "cublas"
        assert len(seen) == 1


def test_every_fp8_gemm_choice_is_tried_by_auto_or_runs_only_asked_for_and_each_has_a_name():
    from hsx.config import FP8_GEMM_CHOICES
    from hsx.target.kernels import FP8_ASKED_ONLY

    assert sorted(fp8_gemm.GEMMS + FP8_ASKED_ONLY) == sorted(FP8_GEMM_CHOICES[1:]) and fp8_gemm.GEMMS[-1] == "triton"
    assert not set(fp8_gemm.GEMMS) & set(FP8_ASKED_ONLY)
    assert all(name in fp8_gemm._GEMM_NAMES and callable(fp8_gemm._gemm(name)) for name in FP8_GEMM_CHOICES[1:])
    assert fp8_gemm._gemms_from("deepgemm") == ["deepgemm", "cublas", "fbgemm", "triton"]
    # (an asked-only GEMM is nobody's fallback)
    assert fp8_gemm._gemms_from("flashinfer") == ["flashinfer", "deepgemm", "cublas", "fbgemm", "triton"]


def test_deepgemm_import_failures_are_named_and_a_missing_package_is_none(tmp_path, monkeypatch):
    import sys

    def load(init: str | None):
        for name in [m for m in sys.modules if m == "deep_gemm" or m.startswith("deep_gemm.")]:
            monkeypatch.delitem(sys.modules, name)
        if init is not None:
            root = tmp_path / str(len(list(tmp_path.iterdir())))
            (root / "deep_gemm").mkdir(parents=True)
            (root / "deep_gemm" / "__init__.py").write_text(init)
            monkeypatch.syspath_prepend(str(root))
        try:
            return fp8_gemm._load_deepgemm()
        finally:
            for name in [m for m in sys.modules if m == "deep_gemm" or m.startswith("deep_gemm.")]:
                del sys.modules[name]

    if __import__("importlib").util.find_spec("deep_gemm") is None:
        assert load(None) == (None, None)
    assert load("x = 1\n") == (None, "this deep_gemm has no fp8_gemm_nt")
    assert load("assert False, 'no CUDA home'\n") == (None, "deep_gemm does not import: AssertionError: no CUDA home")
    module, why = load("def fp8_gemm_nt(a, b, d):\n    pass\n")
    assert why is None and callable(module.fp8_gemm_nt)


def _flashinfer_contract(calls, runners):
    """A stand-in for flashinfer.gemm holding its callers to flashinfer 0.7.4's SM90 block-scale GEMM as hsx calls it:
    a runner of its own (`gemm_base.get_fp8_blockscale_gemm_runner_sm90.__wrapped__()`; the cached one and the public
    `fp8_blockscale_gemm_sm90`, which allocates a workspace at every call, are not used), configured with a workspace
    before its first product; `run_gemm(input, weight, out, scales_a, scales_b)` reading raw pointers, as
    TensorRT-LLM's kernel does: input (M, K) and weight (N, K) e4m3 contiguous, N a multiple of 64; scales_a read as
    (K/128, M) contiguous with M a multiple of 4 (its TMA descriptor's leading dimension is M rounded up to 4);
    scales_b (N/128, K/128) contiguous; out bf16 (M, N) contiguous, written in place."""
    class Runner:
        workspace = None

        def configure_workspace(self, workspace):
            assert workspace.dtype == torch.uint8 and workspace.numel() > 0
            self.workspace = workspace

        def run_gemm(self, xq, w, out, xs, ws):
            (m, k), n = xq.shape, w.shape[0]
            assert self.workspace is not None, "Workspace not configured. Call configure_workspace first."
            assert xq.dtype == w.dtype == torch.float8_e4m3fn and xq.is_contiguous() and w.is_contiguous()
            assert m % 4 == 0 and n % 64 == 0 and k % 128 == 0, (m, n, k)
            assert xs.dtype == ws.dtype == torch.float32 and ws.shape == (n // 128, k // 128) and ws.is_contiguous()
            raw = xs.t()  # (what its pointer holds, read (K/128, M))
            assert raw.shape == (k // 128, m) and raw.is_contiguous(), (xs.shape, xs.stride())
            assert out.dtype == torch.bfloat16 and out.shape == (m, n) and out.is_contiguous()
            calls.append((m, n, k))
            out.copy_(fp8.reference_mm(xq, raw.t(), w, ws))

    def make_runner():
        runners.append(Runner())
        return runners[-1]

    def cached():
        raise AssertionError("the runner flashinfer shares process-wide: its workspace is another caller's")

    def public(*args, **kwargs):
        raise AssertionError("the public GEMM allocates a workspace sized for its bf16 paths at every call")

    cached.__wrapped__ = make_runner
    return SimpleNamespace(fp8_blockscale_gemm_sm90=public,
                           gemm_base=SimpleNamespace(get_fp8_blockscale_gemm_runner_sm90=cached))


def test_flashinfer_runs_only_when_asked_from_its_row_floor_on_a_runner_of_its_own(gemm_state):
    """flashinfer's SM90 block-scale GEMM (TensorRT-LLM's copy of DeepGEMM's kernels) is not measured yet: auto never
    tries it, even installed and right; asked for (fp8_gemm flashinfer), it runs products of JIT_MIN_ROWS rows or
    more (its checks multiply that many), the next GEMM smaller ones, on one runner per device with its own
    workspace; the report names it and what runs under its floor."""
    monkeypatch, cublas = gemm_state
    calls, runners = [], []
    monkeypatch.setattr(fp8_gemm, "_FLASHINFER", [(_flashinfer_contract(calls, runners), None)])
    monkeypatch.setattr(fp8_gemm, "_FLASHINFER_RUNNERS", {})
    cpu, floor = torch.device("cpu"), fp8_gemm.JIT_MIN_ROWS
    with warnings_recorded() as seen:
        assert fp8_gemm.use_gemm(cpu) == "cublas"
    assert not seen and not calls and not runners  # auto: not even looked at
    for name in ("_BACKEND", "_CHOSEN"):
        monkeypatch.setattr(fp8_gemm, name, {})
    cublas.clear()
    _runs_from_its_row_floor("flashinfer", calls, cublas)
    assert len(runners) == 1  # one runner for the device, its workspace configured once
    w64, ws64 = _weights(192, 512)  # N = 192: not whole 128-blocks, so no block-scaled GEMM but Triton takes it
    assert fp8_gemm._runs(w64, ws64, floor) == "triton"


def test_flashinfer_kernels_are_built_before_the_first_batch_a_tile_row_step_apart(gemm_state):
    """TensorRT-LLM's heuristic reads M only as ceil(M / 128) above 64 rows: one product per weight shape and per
    multiple of 128 rows from the floor to the job's largest batch builds every kernel it will pick."""
    monkeypatch, cublas = gemm_state
    calls, runners = [], []
    monkeypatch.setattr(fp8_gemm, "_FLASHINFER", [(_flashinfer_contract(calls, runners), None)])
    monkeypatch.setattr(fp8_gemm, "_FLASHINFER_RUNNERS", {})
    cpu, floor = torch.device("cpu"), fp8_gemm.JIT_MIN_ROWS
    assert fp8_gemm.use_gemm(cpu, "flashinfer") == "flashinfer"
    layers = torch.nn.Sequential(*(fp8_gemm.Fp8Linear(*_weights(n, k), None) for n, k in ((256, 512), (256, 512))))
    assert [fp8_gemm._runs(m.weight, m.weight_scale_inv, floor) for m in layers] == ["flashinfer"] * 2
    calls.clear()  # (the weight shape's check multiplied `floor` rows)
    built = fp8_gemm.build_jit_kernels(layers, floor + 200)
    assert list(built) == ["flashinfer"] and built["flashinfer"][:2] == (1, 3) and not cublas
    assert calls == [(m, 256, 512) for m in (floor, floor + 128, floor + 256)], calls


def test_flashinfer_asked_for_but_missing_or_failing_is_said_once_and_the_next_gemm_runs(gemm_state):
    monkeypatch, cublas = gemm_state
    cpu = torch.device("cpu")
    monkeypatch.setattr(fp8_gemm, "_FLASHINFER", [(None, None)])
    with pytest.warns(UserWarning, match=r"flashinfer is not installed \(pip install flashinfer-python\); FP8 "
                                         r"linears run on cuBLAS's block-scaled _scaled_mm instead") as seen:
        assert fp8_gemm.use_gemm(cpu, "flashinfer") == "cublas"
    assert len(seen) == 1
    for name in ("_BACKEND", "_CHOSEN"):
        monkeypatch.setattr(fp8_gemm, name, {})
    calls, runners = [], []
    broken = _flashinfer_contract(calls, runners)

    def no_nvcc():  # flashinfer's JIT build of its module without a CUDA compiler
        raise RuntimeError("nvcc not found and PyTorch is not built with CUDA support. Could not determine CUDA "
                           "version.")

    no_nvcc.__wrapped__ = no_nvcc
    broken.gemm_base.get_fp8_blockscale_gemm_runner_sm90 = no_nvcc
    monkeypatch.setattr(fp8_gemm, "_FLASHINFER", [(broken, None)])
    monkeypatch.setattr(fp8_gemm, "_FLASHINFER_RUNNERS", {})
    with pytest.warns(UserWarning, match=r"flashinfer's fp8_blockscale_gemm_sm90: RuntimeError: nvcc not found .*; "
                                         r"FP8 linears run on cuBLAS's block-scaled _scaled_mm instead") as seen:
        assert fp8_gemm.use_gemm(cpu, "flashinfer") == "cublas"
    assert len(seen) == 1 and not calls


def test_flashinfer_import_failures_are_named_and_a_missing_package_is_none(tmp_path, monkeypatch):
    import sys

    def load(files: dict[str, str] | None):
        for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
            monkeypatch.delitem(sys.modules, name)
        if files is not None:
            root = tmp_path / str(len(list(tmp_path.iterdir())))
            for rel, text in files.items():
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / rel).write_text(text)
            monkeypatch.syspath_prepend(str(root))
        try:
            return fp8_gemm._load_flashinfer()
        finally:
            for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
                del sys.modules[name]

    if __import__("importlib").util.find_spec("flashinfer") is None:
        assert load(None) == (None, None)
    init = {"flashinfer/__init__.py": ""}
    assert load({**init, "flashinfer/gemm/__init__.py": "import tvm_ffi_not_here\n"}) == (
        None, "flashinfer does not import: ModuleNotFoundError: No module named 'tvm_ffi_not_here'")
    older = {**init, "flashinfer/gemm/__init__.py": "def fp8_blockscale_gemm_sm90(*a):\n    pass\n"}
    assert load(older) == (None, "this flashinfer has no gemm.fp8_blockscale_gemm_sm90 runner (flashinfer-python 0.6 "
                                 "or later has)")
    ok = {**init, "flashinfer/gemm/__init__.py": "from . import gemm_base\nfrom .gemm_base import "
          "fp8_blockscale_gemm_sm90\n",
          "flashinfer/gemm/gemm_base.py": "import functools\n\n@functools.cache\ndef "
          "get_fp8_blockscale_gemm_runner_sm90():\n    return object()\n\ndef fp8_blockscale_gemm_sm90(*a):\n"
          "    pass\n"}
    module, why = load(ok)
    assert why is None and callable(module.gemm_base.get_fp8_blockscale_gemm_runner_sm90.__wrapped__)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs an SM90 CUDA GPU (fbgemm's CUTLASS kernel, DeepGEMM's and flashinfer's kernels)")
@pytest.mark.parametrize("name", ["fbgemm", "deepgemm", "flashinfer"])
def test_optional_gemm_equals_the_float32_product_on_cuda(name, monkeypatch):
    """fbgemm-gpu-genai's f8f8bf16_groupwise, DeepGEMM's fp8_gemm_nt and flashinfer's fp8_blockscale_gemm_sm90 as hsx
    calls them (hsx's scales, M padded to 16) against the float32 product, at Qwen3-8B's and Qwen3.6-27B's linear
    shapes: fbgemm at row counts on both of its kernels (M <= 16 and larger), the JIT GEMMs from JIT_MIN_ROWS rows;
    then chosen by use_gemm and run through hsx::fp8_linear (the JIT GEMMs' smaller products on cuBLAS). Skipped
    where the package is not installed."""
    run, why = fp8_gemm.gemm(name)
    if run is None:
        pytest.skip(why)
    device = torch.device("cuda", 0)
    g = torch.Generator(device=device).manual_seed(0)
    floor = fp8_gemm.JIT_MIN_ROWS
    for n, k in ((1024, 4096), (12288, 4096), (4096, 12288), (5120, 6144), (17408, 5120)):
        w, ws = fp8.quantize_weight(torch.randn(n, k, device=device, generator=g) * 0.02)
        for m in (1, 16, 17, 300, 2048) if name == "fbgemm" else (floor, floor + 333, floor + 2000):
            xq, xs = fp8_gemm.fp8_quantize(torch.randn(m, k, device=device, generator=g, dtype=torch.bfloat16))
            got = run(xq, xs, w, ws)
            want = fp8.reference_mm(xq, xs, w, ws, torch.float32)
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            assert _rel(got, want) < 1e-2, (n, k, m, _rel(got, want))
    for state in ("_BACKEND", "_CHOSEN", "_SHAPES"):
        monkeypatch.setattr(fp8_gemm, state, {})
    with warnings_recorded() as seen:
        assert fp8_gemm.use_gemm(device, name) == name
    assert not seen, [str(s.message) for s in seen]
    w, ws = fp8.quantize_weight(torch.randn(4096, 4096, device=device, generator=g) * 0.02)
    for m in (77, floor):
        x = torch.randn(m, 4096, device=device, generator=g, dtype=torch.bfloat16)
        xq, xs = fp8.quantize_activation(x)
        assert _rel(fp8_gemm.fp8_linear(x, w, ws), fp8.reference_mm(xq, xs, w, ws, torch.float32)) < 1e-2
        assert fp8_gemm._runs(w, ws, m) == (name if name == "fbgemm" or m >= floor else "cublas")


def test_gemm_bench_takes_each_shapes_fp8_linears_formats_its_table_and_needs_a_gpu(capsys):
    from hsx.bench import format_gemms
    from hsx.cli import main
    from hsx.cost import shape_config
    from hsx.target.model import text_config_of

    # Qwen3-8B: q/o 4096², k/v 1024 × 4096, gate/up 12288 × 4096 (2 each of 36 layers), down 4096 × 12288
    assert bench_models.linear_shapes(text_config_of(shape_config("qwen3-8b"))) == {
        (4096, 4096): 72, (1024, 4096): 72, (12288, 4096): 72, (4096, 12288): 36}
    rows = [{"n": 4096, "k": 4096, "count": 2, "bf16": 700.0, "cublas": 1000.0, "cublas_error": 7e-4,
             "fbgemm": "RuntimeError: cutlass cannot run"}]
    table = format_gemms("x", 16384, rows, {"bf16": 2e-3, "cublas": 1e-3, "fbgemm": None})
    assert "| N × K | per model | bf16 | cuBLAS block-scaled | DeepGEMM | fbgemm groupwise |" in table
    assert "| 4096 × 4096 | 2 | 700 | 1,000 (7.0e-04) | – | failed |" in table  # DeepGEMM not run: "–"
    assert "| all linears | | 2.0 ms | 1.0 ms (2.00×) | – | – |" in table and "4096×4096 fbgemm: RuntimeError" in table
    if not torch.cuda.is_available():
        assert main(["bench", "--gemms", "qwen3-8b,qwen3.6-27b"]) != 0
        assert "hsx: error: --gemms measures FP8 GEMMs: it needs a CUDA GPU" in capsys.readouterr().err


def test_fp8_modules_left_to_transformers_without_its_kernel_are_one_error_line(tmp_path, monkeypatch):
    """FP8 experts under --experts-implementation eager or grouped_mm (and FP8Linear modules hsx did not replace)
    run transformers' FP8 forward, which loads its finegrained-fp8 kernel (the `kernels` package, a Hub download) at
    each call: without it every batch ended in an ImportError traceback inside transformers. The job now names it
    before the first batch."""
    from transformers.integrations import finegrained_fp8 as hf_fp8

    from hsx.target import moe

    def unavailable():
        raise ImportError("finegrained-fp8 kernel unavailable: `kernels` is either not installed or uses an "
                          "incompatible version")

    folder, _ = _save_fp8_moe_checkpoint(tmp_path, "qwen3_moe")
    model = _load_fp8_as_stored_on_cpu(folder, monkeypatch)
    monkeypatch.setattr(hf_fp8, "load_finegrained_fp8_kernel", unavailable)
    # transformers' FP8Linear modules: their forward needs the kernel too
    why = fp8_model.transformers_fp8_blocker(model)
    assert why.startswith("8 FP8 linear layers and 2 FP8 experts modules would run on transformers' FP8 forward"), why
    fp8_model.install(model)  # what hsx does on CUDA: its Fp8Linear in their place
    ids = torch.randint(3, 500, (1, 9), generator=torch.Generator().manual_seed(0))
    for name in ("eager", "grouped_mm"):
        moe.use_experts(model, name)
        with pytest.raises(ImportError, match="finegrained-fp8 kernel unavailable"), torch.inference_mode():
            model(input_ids=ids)  # (the crash the line replaces)
        assert fp8_model.transformers_fp8_blocker(model) == (
            "2 FP8 experts modules would run on transformers' FP8 forward, whose finegrained-fp8 kernel does not "
            "load here (finegrained-fp8 kernel unavailable: `kernels` is either not installed or uses an "
            "incompatible version); --experts-implementation auto (or hsx_grouped) runs FP8 experts on hsx's "
            "kernels")
    moe.use_experts(model, moe.EXPERTS_IMPLEMENTATION)
    assert fp8_model.transformers_fp8_blocker(model) is None
    monkeypatch.setattr(hf_fp8, "load_finegrained_fp8_kernel", lambda: None)  # a kernel that loads: no objection
    moe.use_experts(model, "eager")
    assert fp8_model.transformers_fp8_blocker(model) is None


@pytest.mark.slow
def test_extract_with_fp8_experts_on_transformers_eager_without_its_kernel_is_one_error(tmp_path, monkeypatch):
    """The job itself: FP8 experts (loaded as stored) under --experts-implementation eager, transformers' FP8 kernel
    not loadable. Before: an ImportError traceback from inside transformers at the first batch; now an HsxError
    before it, and no unit written."""
    import datasets
    import transformers
    from transformers.integrations import finegrained_fp8 as hf_fp8

    from hsx.run import extract
    from hsx.target.model import truncated_view

    def unavailable():
        raise ImportError("finegrained-fp8 kernel unavailable: `kernels` is either not installed")

    folder, _ = _save_fp8_moe_checkpoint(tmp_path, "qwen3_moe")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    causal = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    monkeypatch.undo()
    monkeypatch.setattr(hf_fp8, "load_finegrained_fp8_kernel", unavailable)
    loaded = truncated_view(causal, causal.config, [1], False)
    rows = [list(range(3, 3 + n)) for n in (9, 17, 5)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(tmp_path / "input"))
    cfg = ExtractConfig(model=str(folder), dataset=str(tmp_path / "input"), output_dir=str(tmp_path / "out"),
                        layers=[1], dtype="float32", compile="off", experts_implementation="eager")
    with pytest.raises(HsxError, match=r"2 FP8 experts modules would run on transformers' FP8 forward, whose "
                                       r"finegrained-fp8 kernel does not load here .*--experts-implementation auto"):
        extract(cfg, log=lambda *a, **k: None, model=loaded)
    assert not list((tmp_path / "out").glob("**/*.arrow"))


# ---- FP8 against bf16 (hsx.target.drift; `hsx verify --against-bf16`) ------------------------------------------------

def _pretokenized(path, seed=0, count=12):
    """Pre-tokenized rows (no tokenizer needed) with a loss mask on the second half of each row."""
    from helpers import write_jsonl

    rng = np.random.default_rng(seed)
    rows = [{"input_ids": rng.integers(3, 500, n).tolist(), "loss_mask": [0] * (n // 2) + [1] * (n - n // 2)}
            for n in map(int, rng.integers(5, 60, count))]
    return write_jsonl(path, rows)


def _extract(folder, data, out, *extra):
    from helpers import hsx_main

    rc, _, err = hsx_main(["extract", "--model", str(folder), "--dataset", str(data), "--layers", "1", "2",
                           "--final-hidden", "--output-dir", str(out), "--compile", "off", "--dtype", "float32",
                           *extra])
    assert rc == 0, err
    return out


def _loaded_as_stored(monkeypatch):
    """hsx.target.model.load_model keeping the checkpoint's e4m3 tensors on CPU (transformers dequantizes whenever it
    sees no CUDA device, so the load is told there is one) and hsx's FP8 modules installed: on CPU they run their torch
    reference (activations quantized per 1×128 block, block-scaled products), so the FP8 forward is FP8 maths."""
    from hsx.target import model as hsx_model
    from hsx.target import moe

    real = hsx_model.load_model

    def load(cfg, device, *a, **k):
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_available", lambda: True)
            m.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
            loaded = real(cfg, device, *a, **k)
        assert fp8_model.install(loaded.base) > 0
        if moe.has_experts(loaded.base):
            moe.register()
            moe.use_experts(loaded.base, moe.EXPERTS_IMPLEMENTATION)
        return loaded

    monkeypatch.setattr(hsx_model, "load_model", load)
    monkeypatch.setattr("hsx.target.moe.resolve_experts", lambda requested, cuda: None)  # (left as `load` set them)


DENSE_STATES = {"1": 2, "2": 3, "final_hidden_state": 4}  # stored state → its output_hidden_states index (4 layers)


def _independent_errors(out, positions, want_model, got_model=None, states=None):
    """Relative errors per state over `positions` of the output, computed here: the stored states (read with
    datasets, the bf16 bits decoded by hand) against `want_model`'s forward (transformers, output_hidden_states:
    `states` maps each stored state to its index there; the last is after the final norm, the
    final_hidden_state), or `got_model`'s forward against `want_model`'s. All tokens, and the loss-masked ones."""
    from datasets import Dataset, concatenate_datasets

    states = states or DENSE_STATES
    files = sorted((out / "data").glob("*.arrow"))
    ds = concatenate_datasets([Dataset.from_file(str(f)) for f in files]).with_format("numpy")
    sums = {}
    sample_ids = []
    with torch.inference_mode():
        for p in positions:
            row = ds[int(p)]
            sample_ids.append(int(row["sample_id"]))
            ids = torch.as_tensor(row["input_ids"].astype(np.int64))[None]
            mask = torch.as_tensor(row["loss_mask"]).bool()
            hs = want_model(input_ids=ids, output_hidden_states=True).hidden_states
            want = {name: hs[i][0] for name, i in states.items()}
            if got_model is None:
                stored = torch.from_numpy(np.stack(row["hidden_states"]).astype(np.int16)).view(torch.bfloat16)
                final = torch.from_numpy(np.stack(row["final_hidden_state"]).astype(np.int16)).view(torch.bfloat16)
                layers = [n for n in states if n != "final_hidden_state"]
                got = {n: stored[:, j * 256:(j + 1) * 256] for j, n in enumerate(layers)}
                got["final_hidden_state"] = final
            else:
                hg = got_model(input_ids=ids, output_hidden_states=True).hidden_states
                got = {name: hg[i][0] for name, i in states.items()}
            for name in want:
                d = (got[name].float() - want[name].float()).pow(2).sum(-1)
                r = want[name].float().pow(2).sum(-1)
                for masked, sel in ((False, slice(None)), (True, mask)):
                    e, b = sums.get((name, masked), (0.0, 0.0))
                    sums[(name, masked)] = (e + float(d[sel].sum()), b + float(r[sel].sum()))
    errors = {k: (e / b) ** 0.5 for k, (e, b) in sums.items()}
    return sample_ids, errors


@pytest.mark.slow
def test_verify_against_bf16_reports_stored_states_against_the_bf16_model(tmp_path):
    """On CPU the target runs on its dequantized weights (the bf16 model): the command picks rows spread over the
    output, its stored-vs-bf16 numbers (all tokens and loss-masked) equal the errors computed here against
    transformers' forward of the float model of the dequantized weights, and FP8 vs bf16 is 0 by construction
    (said in a note). --json writes the same report."""
    from helpers import hsx_main

    folder, causal = _save_fp8_checkpoint(tmp_path, torch.device("cpu"))
    out = _extract(folder, _pretokenized(tmp_path / "d.jsonl"), tmp_path / "out")
    rc, stdout, err = hsx_main(["verify", str(out), "--against-bf16", "5", "--json", str(tmp_path / "r.json")])
    assert rc == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    positions = [0, 3, 6, 8, 11]  # 5 of 12 rows, evenly spaced, first and last included
    sample_ids, want = _independent_errors(out, positions, causal)
    assert report["sample_ids"] == sample_ids and report["rows"] == 5
    for name in ("1", "2", "final_hidden_state"):
        for masked, key in ((False, "relative_error"), (True, "relative_error_masked")):
            got = report[key]["stored_vs_bf16"][name]
            assert 1e-4 < got < 1e-2 and abs(got - want[(name, masked)]) < 0.02 * want[(name, masked)], (name, masked)
        assert report["relative_error"]["fp8_vs_bf16"][name] == 0.0
    assert report["masked_tokens"] < report["tokens"]
    assert "0 by construction" in stdout and "stored vs bf16" in stdout and "final_hidden_state" in stdout
    table = [line.split() for line in stdout.splitlines() if line.startswith("  1 ")]
    assert table == [["1"] + [f"{v:.3e}" for v in (
        report["relative_error"]["stored_vs_bf16"]["1"], report["relative_error_masked"]["stored_vs_bf16"]["1"],
        0.0, 0.0, report["relative_error"]["stored_vs_fp8"]["1"])]], stdout


@pytest.mark.slow
def test_verify_against_bf16_measures_fp8_drift_where_fp8_maths_runs(tmp_path, monkeypatch):
    """With the checkpoint's e4m3 tensors kept and hsx's FP8 linear layers running their torch reference on CPU
    (as on an FP8 GPU): the command's FP8-vs-bf16 numbers equal the errors computed here between transformers'
    FP8 forward (its FP8 maths emulated in float32) and the float model of the dequantized weights, and are not 0
    (the bf16 forward switched every FP8 module)."""
    from helpers import hsx_main

    folder, causal = _save_fp8_checkpoint(tmp_path, torch.device("cpu"))
    out = _extract(folder, _pretokenized(tmp_path / "d.jsonl", count=6), tmp_path / "out")
    _loaded_as_stored(monkeypatch)
    rc, stdout, err = hsx_main(["verify", str(out), "--against-bf16", "3", "--json", str(tmp_path / "r.json")])
    assert rc == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["switched"] == 4 * 7 and "by construction" not in stdout  # (4 layers: --final-hidden)
    assert "the extraction ran the dequantized weights" in stdout
    fp8_model = _load_fp8_as_stored_on_cpu(folder, monkeypatch)
    _, want = _independent_errors(out, [0, 2, 5], causal.model, fp8_model)
    for name in ("1", "2", "final_hidden_state"):
        got = report["relative_error"]["fp8_vs_bf16"][name]
        assert 1e-3 < got < 0.5 and abs(got - want[(name, False)]) < 0.05 * want[(name, False)], (name, got, want)
        assert report["relative_error"]["stored_vs_bf16"][name] < 0.01  # (the output was extracted dequantized)
        assert report["relative_error"]["stored_vs_fp8"][name] > 1e-3  # (... so it is the FP8 forward's distance)


@pytest.mark.slow
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_drift_covers_fp8_experts(tmp_path, monkeypatch, kind):
    """FP8 experts on hsx's grouped path (CPU: its torch reference): within `bf16_reference` they run on their
    dequantized weights, so the bf16 forward equals the float model of the dequantized weights (given as stored
    states: stored vs bf16 ~0) while the FP8 forward is measurably away. transformers' own FP8 experts, which the
    reference would not switch, are refused in one line instead of understating the drift."""
    from hsx.target import drift, moe

    folder, causal = _save_fp8_moe_checkpoint(tmp_path, kind)
    model = _load_fp8_as_stored_on_cpu(folder, monkeypatch)
    rows = [np.arange(3, 40), np.arange(100, 117)]
    with pytest.raises(HsxError, match="no bf16 reference"):
        drift.compare(model, [0, 1], True, [drift.DriftRow(r) for r in rows], torch.device("cpu"))
    fp8_model.install(model)
    moe.register()
    moe.use_experts(model, moe.EXPERTS_IMPLEMENTATION)
    stored = []
    with torch.inference_mode():
        for r in rows:  # (hidden_states[2] of a 2-layer model is after the final norm)
            hs = causal.model(input_ids=torch.as_tensor(r)[None], output_hidden_states=True).hidden_states
            stored.append({"0": hs[1][0], drift.FINAL: hs[2][0]})
    d = drift.compare(model, [0], True, [drift.DriftRow(r, None, s) for r, s in zip(rows, stored)],
                      torch.device("cpu"))
    assert d["switched"] > 2  # the FP8 linear layers and both layers' experts
    for name in ("0", drift.FINAL):
        assert d["relative_error"]["stored_vs_bf16"][name] < 1e-4, d
        assert 1e-3 < d["relative_error"]["fp8_vs_bf16"][name] < 0.5, d


@pytest.mark.slow
def test_verify_against_bf16_refusals_and_clamping(tmp_path):
    """One `hsx: error:` line each: a target that is not FP8; the recorded model folder gone; a --model folder whose
    files differ from the job's fingerprint. N past the output's rows compares all of them (and says so); N < 1 and
    --json without --against-bf16 are usage errors."""
    from helpers import assert_one_error_line, hsx_main

    model_dir = tmp_path / "m"
    model_dir.mkdir()
    folder, causal = _save_fp8_checkpoint(model_dir, torch.device("cpu"))
    data = _pretokenized(tmp_path / "d.jsonl", count=4)
    out = _extract(folder, data, tmp_path / "out")

    rc, stdout, err = hsx_main(["verify", str(out), "--against-bf16", "50", "--json", "-"])
    assert rc == 0, err
    assert json.loads(stdout)["rows"] == 4 and "holds 4 rows; all of them are compared" in err
    for argv in (["--against-bf16", "0"], ["--json", "x.json"]):
        rc, _, err = hsx_main(["verify", str(out), *argv])
        assert_one_error_line(rc, err, "--against-bf16")
        assert rc == 2

    other = tmp_path / "other"  # the same architecture, other bytes: not the job's model
    other.mkdir()
    _save_fp8_checkpoint(other, torch.device("cpu"), seed=1)
    rc, _, err = hsx_main(["verify", str(out), "--against-bf16", "2", "--model", str(other)])
    assert_one_error_line(rc, err, "differs from the one the output was extracted from", "model.safetensors")

    folder.rename(tmp_path / "moved")
    rc, _, err = hsx_main(["verify", str(out), "--against-bf16", "2"])
    assert_one_error_line(rc, err, "is not here", "--model PATH")
    rc, _, err = hsx_main(["verify", str(out), "--against-bf16", "2", "--model", str(tmp_path / "moved")])
    assert rc == 0, err  # a copy of the same files, named on the command line

    plain = tmp_path / "bf16"  # the float model of the same weights, saved without quantization_config
    causal.save_pretrained(plain)
    out2 = _extract(plain, data, tmp_path / "out2")
    rc, _, err = hsx_main(["verify", str(out2), "--against-bf16", "2"])
    assert_one_error_line(rc, err, "not an FP8 checkpoint")
    assert rc == 1
    plain.rename(tmp_path / "bf16-moved")  # the output's own record says so, without the folder
    rc, _, err = hsx_main(["verify", str(out2), "--against-bf16", "2"])
    assert_one_error_line(rc, err, "not an FP8 checkpoint")


@pytest.mark.slow
def test_verify_against_bf16_storage_check_sees_stored_error(tmp_path, monkeypatch):
    """stored vs FP8 is the stored states' own check: a stored layer scaled by 1.1 after the fact reads 0.1 there
    (the other states unchanged); float8_e4m3 storage reads its rounding there, and a note says every stored
    number includes it."""
    import importlib

    from helpers import hsx_main

    load_module = importlib.import_module("hsx.load")  # (the package's `hsx.load` is the function)
    folder, _ = _save_fp8_checkpoint(tmp_path, torch.device("cpu"))
    data = _pretokenized(tmp_path / "d.jsonl", count=4)
    out = _extract(folder, data, tmp_path / "out")
    rc, stdout, err = hsx_main(["verify", str(out), "--against-bf16", "4", "--json", "-"])
    assert rc == 0, err
    clean = json.loads(stdout)["relative_error"]["stored_vs_fp8"]
    real = load_module.torch_view

    class Scaled:  # the output's rows with stored layer 2 (the second stored) scaled by 1.1
        def __init__(self, *a, **k):
            self.view = real(*a, **k)

        def __len__(self):
            return len(self.view)

        def __getitem__(self, i):
            row = dict(self.view[i])
            hs = row["hidden_states"].clone()
            hs[:, 1] *= 1.1
            row["hidden_states"] = hs
            return row

    with monkeypatch.context() as m:
        m.setattr(load_module, "torch_view", Scaled)
        rc, stdout, err = hsx_main(["verify", str(out), "--against-bf16", "4", "--json", "-"])
    assert rc == 0, err
    scaled = json.loads(stdout)["relative_error"]["stored_vs_fp8"]
    assert clean["2"] < 3e-3 and abs(scaled["2"] - 0.1) < 5e-3, (clean, scaled)
    assert scaled["1"] == clean["1"] and scaled["final_hidden_state"] == clean["final_hidden_state"]

    out8 = _extract(folder, data, tmp_path / "out8", "--storage-dtype", "float8_e4m3")
    rc, stdout, err = hsx_main(["verify", str(out8), "--against-bf16", "4", "--json", "-"])
    assert rc == 0, err
    e4m3 = json.loads(stdout)["relative_error"]["stored_vs_fp8"]
    assert all(5e-3 < v < 0.1 for v in e4m3.values()), e4m3
    assert "stored in float8_e4m3" in err


@pytest.mark.slow
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_verify_against_bf16_on_an_fp8_moe_output(tmp_path, monkeypatch, kind):
    """The command on a finished output of an FP8 MoE (Qwen3-MoE; Qwen3.5-MoE, whose layer 0 is Gated DeltaNet),
    extracted on CPU (dequantized at load), then compared with the e4m3 tensors kept and hsx's FP8 linear layers
    and experts on their torch reference: every FP8 module switched, FP8 vs bf16 not 0, and stored vs bf16 equal to
    the errors computed here against transformers' forward of the float model of the dequantized weights."""
    from helpers import hsx_main

    folder, causal = _save_fp8_moe_checkpoint(tmp_path, kind)
    data = _pretokenized(tmp_path / "d.jsonl", count=5)
    rc, _, err = hsx_main(["extract", "--model", str(folder), "--dataset", str(data), "--layers", "0",
                           "--final-hidden", "--output-dir", str(tmp_path / "out"), "--compile", "off",
                           "--dtype", "float32"])
    assert rc == 0, err
    _loaded_as_stored(monkeypatch)
    rc, stdout, err = hsx_main(["verify", str(tmp_path / "out"), "--against-bf16", "3", "--json", "-"])
    assert rc == 0, err
    report = json.loads(stdout)
    experts = report["runs_here"]
    assert experts["fp8_experts"] == 2 and experts["experts"].startswith("hsx fp8 grouped")
    assert report["switched"] == experts["fp8_linears"] + 2
    _, want = _independent_errors(tmp_path / "out", [0, 2, 4], causal.model,
                                  states={"0": 1, "final_hidden_state": 2})
    for name in ("0", "final_hidden_state"):
        assert 1e-3 < report["relative_error"]["fp8_vs_bf16"][name] < 0.5, report
        for masked, key in ((False, "relative_error"), (True, "relative_error_masked")):
            got = report[key]["stored_vs_bf16"][name]
            assert abs(got - want[(name, masked)]) < 0.02 * want[(name, masked)], (name, masked, got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with FP8 tensor cores")
def test_verify_against_bf16_on_an_fp8_gpu(tmp_path):
    """On an FP8 GPU: extracted with hsx's FP8 kernels (packed), the stored states are nearer a fresh FP8 forward
    (one row at a time) than that is to the bf16 model's: within what activation quantization makes of the two
    paths' last-bit differences (on an H200 1.6-2.2e-2 against a drift of 5.8e-2)."""
    from helpers import hsx_main

    folder, _ = _save_fp8_checkpoint(tmp_path, torch.device("cpu"))
    rc, _, err = hsx_main(["extract", "--model", str(folder), "--dataset", str(_pretokenized(tmp_path / "d.jsonl")),
                           "--layers", "1", "2", "--final-hidden", "--output-dir", str(tmp_path / "out"),
                           "--compile", "off"])
    assert rc == 0, err
    rc, stdout, err = hsx_main(["verify", str(tmp_path / "out"), "--against-bf16", "6", "--json", "-"])
    assert rc == 0, err
    report = json.loads(stdout)
    assert report["switched"] == 4 * 7 and report["runs_here"]["linear"].startswith("hsx fp8"), report
    rel = report["relative_error"]
    for name in ("1", "2", "final_hidden_state"):
        assert rel["stored_vs_fp8"][name] < 0.5 * rel["fp8_vs_bf16"][name], rel
        assert 1e-3 < rel["fp8_vs_bf16"][name] < 0.5 and 1e-3 < rel["stored_vs_bf16"][name] < 0.5, rel


def test_library_versions_name_the_kernel_packages_present_and_a_source_tree_module_by_its_version(monkeypatch):
    """hsx.json's run.versions (and the bench JSON's versions): pip's versions; DeepGEMM built in its source tree has
    no distribution, so an imported deep_gemm is named by its __version__; absent packages are left out."""
    import sys
    from importlib import metadata

    from hsx.target.prepare import STATE_LIBRARIES, library_versions

    found = library_versions()
    assert found["torch"] == torch.__version__ and found["datasets"] == metadata.version("datasets")
    assert ("cuda" in found) == (torch.version.cuda is not None)
    real = metadata.version

    def version(dist):
        if dist in ("deep_gemm", "triton"):
            raise metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.setitem(sys.modules, "deep_gemm", SimpleNamespace(__version__="2.6.1"))
    monkeypatch.setitem(sys.modules, "triton", SimpleNamespace())  # no version to say: left out
    found = library_versions()
    assert found["deep_gemm"] == "2.6.1" and "triton" not in found and set(found) <= set(STATE_LIBRARIES) | {"cuda"}


def _jit_cache(name: str):
    """Where JIT GEMM `name` keeps its compiled kernels (one entry each)."""
    import os
    from pathlib import Path

    if name == "deepgemm":
        return Path(os.environ.get("DG_JIT_CACHE_DIR") or Path.home() / ".deep_gemm") / "cache", "kernel.*"
    return Path(os.environ.get("TRTLLM_DG_CACHE_DIR") or Path.home() / ".tensorrt_llm") / "cache", "*"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs an SM90 CUDA GPU (DeepGEMM's and flashinfer's kernels)")
@pytest.mark.parametrize("name", ["deepgemm", "flashinfer"])
def test_jit_gemm_builds_every_kernel_a_batch_can_want_before_the_first_on_cuda(name, monkeypatch):
    """After `build_jit_kernels(model, R)`, products of any row count from JIT_MIN_ROWS to R compile nothing more
    (the GEMM's disk cache holds no new kernel) and equal the float32 product. Skipped where the package is not
    installed."""
    run, why = fp8_gemm.gemm(name)
    if run is None:
        pytest.skip(why)
    for state in ("_BACKEND", "_CHOSEN", "_SHAPES", "_JIT_BUILT"):
        monkeypatch.setattr(fp8_gemm, state, {})
    device = torch.device("cuda", 0)
    g = torch.Generator(device=device).manual_seed(0)
    assert fp8_gemm.use_gemm(device, name) == name
    layers = torch.nn.Sequential(*(fp8_gemm.Fp8Linear(*fp8.quantize_weight(torch.randn(n, k, device=device, generator=g)
                                                                       * 0.02), None)
                                   for n, k in ((1024, 4096), (4096, 4096), (1024, 4096))))
    floor, top = fp8_gemm.JIT_MIN_ROWS, fp8_gemm.JIT_MIN_ROWS + 1000
    step = fp8_gemm.JIT_ROW_STEP[name]
    shapes, products, _ = fp8_gemm.build_jit_kernels(layers, top)[name]
    assert (shapes, products) == (2, 2 * len(range(floor, -(-top // step) * step + 1, step)))
    cache, pattern = _jit_cache(name)
    built = sorted(p.name for p in cache.glob(pattern))
    assert built, f"no {name} kernel under {cache}"
    for m in range(floor + 1, top + 1, 37):
        for layer in layers[:2]:
            x = torch.randn(m, 4096, device=device, generator=g, dtype=torch.bfloat16)
            xq, xs = fp8_gemm.fp8_quantize(x)
            want = fp8.reference_mm(xq, xs, layer.weight, layer.weight_scale_inv, torch.float32)
            assert fp8_gemm._runs(layer.weight, layer.weight_scale_inv, xq.shape[0]) == name
            assert _rel(fp8_gemm._block_mm(xq, xs, layer.weight, layer.weight_scale_inv), want) < 1e-2, m
    assert sorted(p.name for p in cache.glob(pattern)) == built  # nothing compiled after the build


# ---- damaged FP8 checkpoints: refused before extracting, in one line naming the tensor -----------------------------
# transformers trusts what it finds: on CPU it dequantizes with whatever scale grid is there (none: the e4m3 values
# unscaled, off by ~1e10; [1, 1]: broadcast) and never reads weight_block_size; on a GPU it casts what it finds
# into its e4m3 / float32 parameters. Each damage below gave other states with exit 0 (or, NaN scales, a line
# blaming the data) before hsx checked the checkpoint (hsx.target.checkpoint.check_checkpoint,
# hsx.target.fp8.stored_problems).

DOWN = "model.layers.0.mlp.down_proj.weight"  # (256, 768): 2 × 6 scales of 128 × 128 blocks
EXPERT = "model.layers.0.mlp.experts.3.up_proj.weight"  # (128, 256): 1 × 2


def _rewritten(src, dst, state_fn=None, config_fn=None):
    """A copy of checkpoint folder `src` whose tensors (model.safetensors, or each shard) and config.json went
    through `state_fn(state)` and `config_fn(config)`."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if state_fn is not None:
        files = sorted(dst.glob("*.safetensors"))
        state = {k: v for f in files for k, v in load_file(str(f)).items()}
        state_fn(state)
        if len(files) == 1:
            save_file(state, str(files[0]), metadata={"format": "pt"})
        else:
            index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
            index = {k: index.get(k, files[0].name) for k in state}  # (a new tensor in the first shard)
            for f in files:
                save_file({k: v for k, v in state.items() if index[k] == f.name}, str(f), metadata={"format": "pt"})
            (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    if config_fn is not None:
        config = json.loads((dst / "config.json").read_text())
        config_fn(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _sharded(src, dst):
    """`src` in two shards with an index, every block scale in the other shard from its weight's."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {k: names[k.endswith("_scale_inv")] for k in state}
    for i, name in enumerate(names):
        save_file({k: v for k, v in state.items() if weight_map[k] == name}, str(dst / name), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


@pytest.fixture(scope="module")
def fp8_folders(tmp_path_factory):
    """The intact checkpoints the damages start from: dense (one file, and sharded), MoE (per-expert scales)."""
    root = tmp_path_factory.mktemp("fp8-intact")
    for name in ("dense", "moe"):
        (root / name).mkdir()
    _save_fp8_checkpoint(root / "dense", torch.device("cpu"))
    _save_fp8_moe_checkpoint(root / "moe", "qwen3_moe")
    _sharded(root / "dense", root / "sharded")
    return root


def _set(key, fn):
    return lambda state: state.__setitem__(key, fn(state[key]))


def _quant(**changes):
    return lambda config: config["quantization_config"].update(changes)


def _pop_all_scales(state):
    for k in [k for k in state if k.endswith("_scale_inv")]:
        del state[k]


def _fuse_experts(state, experts=8):
    """The per-expert keys as one fused tensor per projection (transformers' FP8Experts names and layout)."""
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            for suffix in ("", "_scale_inv"):
                state[f"{p}.{fused}{suffix}"] = torch.stack([torch.cat([
                    state.pop(f"{p}.{e}.{part}.weight{suffix}") for part in parts]) for e in range(experts)])


DAMAGES = {  # id: (intact folder, state_fn, config_fn, what the one line must name)
    "every-scale-removed": ("dense", _pop_all_scales, None,
                            f"{DOWN} has no block scales ({DOWN}_scale_inv is not in the checkpoint) (and 27 more"),
    "one-scale-removed": ("dense", lambda s: s.pop(DOWN + "_scale_inv"), None, f"{DOWN} has no block scales"),
    "scale-1x1-where-2x6-belongs": ("dense", _set(DOWN + "_scale_inv", lambda t: t[:1, :1].clone()), None,
                                    f"{DOWN}_scale_inv has shape [1, 1], not [2, 6]"),
    "scale-with-an-extra-dim": ("dense", _set(DOWN + "_scale_inv", lambda t: t[None].clone()), None,
                                f"{DOWN}_scale_inv has shape [1, 2, 6], not [2, 6]"),
    "scale-under-another-name": ("dense", lambda s: s.__setitem__(DOWN.replace("weight", "weight_scale"),
                                                                  s.pop(DOWN + "_scale_inv")), None,
                                 f"{DOWN} has no block scales"),
    "block-64x64": ("dense", None, _quant(weight_block_size=[64, 64]),
                    f"{DOWN}_scale_inv has shape [2, 6], not [4, 12]: {DOWN} [256, 768] in weight_block_size [64, 64]"),
    "block-1x1": ("dense", None, _quant(weight_block_size=[1, 1]),
                  f"{DOWN}_scale_inv has shape [2, 6], not [256, 768]"),
    "block-2**62": ("dense", None, _quant(weight_block_size=[2**62, 2**62]),
                    f"weight_block_size [{2**62}, {2**62}] is not two integers in [1, 65,536]"),
    "weight-e5m2-under-fmt-e4m3": ("dense", _set(DOWN, lambda t: t.float().to(torch.float8_e5m2)), None,
                                   f"{DOWN} is stored F8_E5M2, not F8_E4M3 as quantization_config's fmt 'e4m3' says"),
    "fmt-e5m2": ("dense", None, _quant(fmt="e5m2"), "fmt is 'e5m2': transformers' FP8 layers hold e4m3 weights"),
    "zero-scale": ("dense", _set(DOWN + "_scale_inv", lambda t: t.index_fill(1, torch.tensor([4]), 0.0)), None,
                   f"{DOWN}_scale_inv holds 2 of 12 block scales that are not positive finite numbers (the first, "
                   "at [0, 4], is 0.0)"),
    "negative-scale": ("dense", _set(DOWN + "_scale_inv", lambda t: t * torch.tensor([1.0, -1.0])[:, None]), None,
                       f"{DOWN}_scale_inv holds 6 of 12 block scales that are not positive finite numbers (the "
                       "first, at [1, 0], is -"),
    "nan-scale": ("dense", _set(DOWN + "_scale_inv", lambda t: t.index_fill(0, torch.tensor([1]), float("nan"))), None,
                  f"{DOWN}_scale_inv holds 6 of 12 block scales that are not positive finite numbers (the first, at "
                  "[1, 0], is nan)"),
    "inf-scale": ("dense", _set(DOWN + "_scale_inv", lambda t: t.index_fill(0, torch.tensor([0]), float("inf"))), None,
                  f"{DOWN}_scale_inv holds 6 of 12 block scales that are not positive finite numbers (the first, at "
                  "[0, 0], is inf)"),
    "scale-float16": ("dense", _set(DOWN + "_scale_inv", lambda t: t.half()), None,
                      f"{DOWN}_scale_inv is stored F16; scale_fmt 'float' scales are F32 or BF16"),
    "scale-float64": ("dense", _set(DOWN + "_scale_inv", lambda t: t.double()), None,
                      f"{DOWN}_scale_inv is stored F64; scale_fmt 'float' scales are F32 or BF16"),
    "quant-method-upper-case": ("dense", None, _quant(quant_method="FP8"),
                                "quantization_config has quant_method 'FP8' (the method is spelled 'fp8'), which "
                                "transformers does not know: it would load the weights as if unquantized"),
    "quant-method-unknown": ("dense", None, _quant(quant_method="fp8_blockwise"),
                             "quant_method 'fp8_blockwise', which transformers does not know"),
    "quant-method-missing": ("dense", None, lambda c: c["quantization_config"].pop("quant_method"),
                             "quantization_config has no quant_method"),
    "quantization-config-removed": ("dense", None, lambda c: c.pop("quantization_config"),
                                    "is stored F8_E4M3 but config.json declares no quantization_config"),
    "orphan-scale": ("dense", lambda s: s.__setitem__("model.layers.0.mlp.extra.weight_scale_inv",
                                                      s[DOWN + "_scale_inv"].clone()), None,
                     "model.layers.0.mlp.extra.weight_scale_inv has no weight"),
    "bf16-weight-beside-its-scales": ("dense", _set(DOWN, lambda t: t.to(torch.bfloat16)), None,
                                      f"{DOWN} is stored BF16, not F8_E4M3, beside its block scales"),
    "sharded-scale-removed": ("sharded", lambda s: s.pop(DOWN + "_scale_inv"), None, f"{DOWN} has no block scales"),
    "sharded-nan-scale": ("sharded", _set(DOWN + "_scale_inv", lambda t: t * float("nan")), None,
                          f"{DOWN}_scale_inv holds 12 of 12 block scales"),
    "expert-scale-removed": ("moe", lambda s: s.pop(EXPERT + "_scale_inv"), None, f"{EXPERT} has no block scales"),
    "expert-scale-misshapen": ("moe", _set(EXPERT + "_scale_inv", lambda t: t[:, :1].clone()), None,
                               f"{EXPERT}_scale_inv has shape [1, 1], not [1, 2]"),
    "expert-scale-negative": ("moe", _set(EXPERT + "_scale_inv", lambda t: -t), None,
                              f"{EXPERT}_scale_inv holds 2 of 2 block scales that are not positive finite"),
    "expert-weight-e5m2": ("moe", _set(EXPERT, lambda t: t.float().to(torch.float8_e5m2)), None,
                           f"{EXPERT} is stored F8_E5M2"),
    "fused-experts-scale-removed": ("moe", lambda s: (_fuse_experts(s),
                                                      s.pop("model.layers.1.mlp.experts.down_proj_scale_inv")), None,
                                    "model.layers.1.mlp.experts.down_proj has no block scales"),
    "fused-experts-scale-misshapen": ("moe", lambda s: (_fuse_experts(s), _set(
        "model.layers.0.mlp.experts.gate_up_proj_scale_inv", lambda t: t[:, :, :1].clone())(s)), None,
        "model.layers.0.mlp.experts.gate_up_proj_scale_inv has shape [8, 2, 1], not [8, 2, 2]"),
}


def _edit_index(folder, **moves):
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"].update(moves)
    path.write_text(json.dumps(index))


def _cut(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def _second_copy(folder):
    """DOWN's scales in the first shard as well as in the second."""
    from safetensors.torch import load_file, save_file

    first, second = sorted(folder.glob("model-*.safetensors"))
    save_file({**load_file(str(first)), DOWN + "_scale_inv": load_file(str(second))[DOWN + "_scale_inv"]},
              str(first), metadata={"format": "pt"})


def _garbled_header(path):
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xfe not json")


def _lists_header(path, size=4 << 20):
    """A header of `[[],[],...]` (a Python parse of it would make ~10^6 lists), its file sized to hold it."""
    body = b"[" + b"[]," * (size // 3) + b"[]]"
    path.write_bytes(len(body).to_bytes(8, "little") + body)


SHARD2 = "model-00002-of-00002.safetensors"
def _header_edited(path, edit):
    """`path`'s safetensors header rewritten as `edit(text)` returns it (padded to 8 bytes), its data unchanged."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    text = edit(raw[8:8 + n].decode().rstrip()).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def _entry(path, key):
    raw = path.read_bytes()
    return json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])[key]


def _named_twice(path):
    """DOWN's scales named a second time, last, with layer 1's bytes (json keeps the last; safetensors refuses)."""
    other = json.dumps(_entry(path, DOWN.replace("layers.0", "layers.1") + "_scale_inv"))
    _header_edited(path, lambda h: f'{h[:-1]},"{DOWN}_scale_inv":{other}}}')


def _sharing_bytes(path):
    """DOWN's scales pointed at layer 1's scales' bytes (same size): two tensors share bytes, some bytes are no
    tensor's."""
    key = DOWN + "_scale_inv"
    entry, other = _entry(path, key), _entry(path, DOWN.replace("layers.0", "layers.1") + "_scale_inv")
    def shown(e):
        return json.dumps({key: e}, separators=(",", ":"))[1:-1]

    _header_edited(path, lambda h: h.replace(shown(entry), shown(other)) if shown(entry) in h else "not edited")


FILE_DAMAGES = {  # id: (intact folder, what is done to the copy, what the one line must name)
    "header-metadata-not-strings": ("dense", lambda d: _header_edited(d / "model.safetensors", lambda h: h.replace(
        '"__metadata__":{"format":"pt"}', '"__metadata__":{"format":5}')),
        "model.safetensors: its safetensors header's __metadata__ is not a map of strings"),
    "a-tensor-named-twice-in-a-header": ("dense", lambda d: _named_twice(d / "model.safetensors"),
                                         f"model.safetensors: its safetensors header names {DOWN}_scale_inv twice"),
    "two-tensors-sharing-bytes": ("dense", lambda d: _sharing_bytes(d / "model.safetensors"),
                                  "(tensors overlap or leave a gap)"),
    "index-names-a-missing-shard": (
        "sharded", lambda d: _edit_index(d, **{"model.embed_tokens.weight": "model-00003-of-00003.safetensors"}),
        "model.safetensors.index.json puts model.embed_tokens.weight in model-00003-of-00003.safetensors, which is "
        "not in the model folder"),
    "index-puts-a-scale-in-the-wrong-shard": (
        "sharded", lambda d: _edit_index(d, **{DOWN + "_scale_inv": "model-00001-of-00002.safetensors"}),
        f"model.safetensors.index.json puts {DOWN}_scale_inv in model-00001-of-00002.safetensors, which does not "
        "hold it"),
    "index-names-a-shard-by-no-name": (
        "sharded", lambda d: _edit_index(d, **{DOWN: 5}),
        f"model.safetensors.index.json puts {DOWN} in 5, which is no file name"),
    "index-names-a-shard-outside-the-folder": (
        "sharded", lambda d: _edit_index(d, **{DOWN + "_scale_inv": "../" + SHARD2}),
        f"puts {DOWN}_scale_inv in ../{SHARD2}, outside the model folder"),
    "scales-shard-cut-short": ("sharded", lambda d: _cut(d / SHARD2, (d / SHARD2).stat().st_size - 40),
                               f"{SHARD2}: the header's entry for "),
    "scale-in-two-shards": ("sharded", _second_copy, f"{DOWN}_scale_inv is in both "),
    "header-not-json": ("dense", lambda d: _garbled_header(d / "model.safetensors"),
                        "model.safetensors: its safetensors header is not JSON"),
    "header-of-empty-lists": ("dense", lambda d: _lists_header(d / "model.safetensors"),
                              "model.safetensors: its safetensors header is not a list of tensors"),
}


def _refused(folder, tmp_path, *needles) -> str:
    """`hsx extract` of `folder`: exit 1, one `hsx: error:` line naming the model folder and holding `needles`, no
    state written."""
    from helpers import assert_one_error_line, hsx_main

    out = tmp_path / "out"
    rc, _, err = hsx_main(["extract", "--model", str(folder), "--dataset", str(_pretokenized(tmp_path / "d.jsonl")),
                           "--layers", "1", "--output-dir", str(out), "--compile", "off", "--dtype", "float32"])
    assert rc == 1
    line = assert_one_error_line(rc, err, f"hsx: error: model '{folder}': ", *needles)
    assert not out.exists() or not any(out.rglob("*.arrow"))
    return line


@pytest.mark.parametrize("damage", list(DAMAGES) + list(FILE_DAMAGES))
def test_a_damaged_fp8_checkpoint_is_refused_before_extracting_naming_the_tensor(tmp_path, fp8_folders, damage):
    if damage in DAMAGES:
        source, state_fn, config_fn, needle = DAMAGES[damage]
        folder = _rewritten(fp8_folders / source, tmp_path / "model", state_fn, config_fn)
    else:
        source, edit, needle = FILE_DAMAGES[damage]
        folder = _rewritten(fp8_folders / source, tmp_path / "model")
        edit(folder)
    line = _refused(folder, tmp_path, needle)
    assert "input" not in line and "dataset" not in line  # (the model folder is blamed, not the data)
    assert not (tmp_path / "out" / ".hsx" / "job.json").exists()  # refused before the job claimed the dir


def test_load_model_refuses_a_damaged_checkpoint_as_extract_does(tmp_path, fp8_folders):
    """hsx.target.model.load_model (the API, `hsx verify --against-bf16`) checks the checkpoint too, before transformers
    reads a weight."""
    from hsx.target.model import load_model

    folder = _rewritten(fp8_folders / "moe", tmp_path / "model", _set(EXPERT + "_scale_inv", lambda t: t * 0))
    with pytest.raises(HsxError, match=rf"^model '{folder}': {EXPERT}_scale_inv holds 2 of 2 block scales that are "
                                       r"not positive finite numbers \(the first, at \[0, 0\], is 0.0\)"):
        load_model(ExtractConfig(model=str(folder), dataset="unused", output_dir="unused", layers=[1],
                                 dtype="float32", compile="off"), torch.device("cpu"))


def test_scales_a_loaded_module_leaves_unused_are_refused(tmp_path, fp8_folders, monkeypatch):
    """A module the config leaves unquantized (modules_to_not_convert) whose weight is stored e4m3 with its scales:
    loaded as stored (a GPU), transformers casts the e4m3 values into its plain Linear and reports the scales as
    unexpected; hsx refuses rather than run the unscaled weight."""
    from hsx.target.model import load_model

    folder = _rewritten(fp8_folders / "dense", tmp_path / "model",
                        config_fn=_quant(modules_to_not_convert=["lm_head", "down_proj"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    with pytest.raises(HsxError, match=r"transformers loaded layers.0.mlp.down_proj.weight without its block scales "
                                       rf"{DOWN}_scale_inv, left unused"):
        load_model(ExtractConfig(model=str(folder), dataset="unused", output_dir="unused", layers=[1],
                                 dtype="float32", compile="off"), torch.device("cpu"))


@pytest.mark.slow
def test_fused_fp8_experts_transformers_would_dequantize_unscaled_are_refused(tmp_path, fp8_folders):
    """Experts stored fused (gate_up_proj, down_proj and their _scale_inv, FP8Experts' own names) load as stored on
    a GPU, but transformers' CPU dequantization pairs only `weight` with `weight_scale_inv`: the fused e4m3 values
    came out unscaled (states off by ~1e10). Now refused, naming the weight and its unused scales."""
    folder = _rewritten(fp8_folders / "moe", tmp_path / "model", _fuse_experts)
    _refused(folder, tmp_path, "transformers loaded layers.0.mlp.experts.down_proj without its block scales "
             "model.layers.0.mlp.experts.down_proj_scale_inv, left unused")


@pytest.mark.slow
def test_intact_fp8_checkpoints_still_load_and_give_the_same_states(tmp_path, fp8_folders):
    """The checks refuse no intact layout: one file, two shards with every scale in the other shard from its
    weight (the same states, byte for byte), bf16 block scales (as Qwen3.5/3.6 MoE `-FP8` checkpoints store their
    experts'), per-expert MoE scales. The states are still those of the float model of the dequantized weights."""
    from datasets import Dataset
    from helpers import hsx_main

    from hsx.target.model import load_model

    data = _pretokenized(tmp_path / "d.jsonl")
    bf16 = _rewritten(fp8_folders / "moe", tmp_path / "bf16-scales",
                      lambda s: s.update({k: v.to(torch.bfloat16) for k, v in s.items() if k.endswith("_scale_inv")}))
    states = {}
    for name, folder in (("dense", fp8_folders / "dense"), ("sharded", fp8_folders / "sharded"),
                         ("moe", fp8_folders / "moe"), ("bf16-scales", bf16)):
        out = tmp_path / f"out-{name}"
        rc, _, err = hsx_main(["extract", "--model", str(folder), "--dataset", str(data), "--layers", "1",
                               "--output-dir", str(out), "--compile", "off", "--dtype", "float32"])
        assert rc == 0, err
        states[name] = [Dataset.from_file(str(f)).data.column("hidden_states")
                        for f in sorted((out / "data").glob("*.arrow"))]
    assert len(states["dense"]) == len(states["sharded"]) > 0
    assert all(a.equals(b) for a, b in zip(states["dense"], states["sharded"]))
    _, causal = _save_fp8_checkpoint(tmp_path, torch.device("cpu"))  # (the same seed: the float model of "dense")
    loaded = load_model(ExtractConfig(model=str(fp8_folders / "sharded"), dataset="unused", output_dir="unused",
                                      layers=[1, 3], dtype="float32", compile="off"), torch.device("cpu"))
    ids = torch.arange(3, 40)[None]
    with torch.inference_mode():
        got = loaded.base(input_ids=ids, output_hidden_states=True).hidden_states[2]
        want = causal.model(input_ids=ids, output_hidden_states=True).hidden_states[2]
    assert _rel(got, want) < 1e-3


@pytest.mark.parametrize("tensor,damage", [
    (DOWN, lambda t: t.view(torch.uint8).index_fill(1, torch.tensor([5]), 0x7F).view(torch.float8_e4m3fn)),
    ("model.layers.0.post_attention_layernorm.weight", lambda t: t.index_fill(0, torch.tensor([3]), float("inf")))])
def test_a_nan_or_inf_weight_is_refused_naming_it_not_the_data(tmp_path, fp8_folders, tensor, damage):
    """A weight stored with NaN bytes (e4m3 0x7F), or a bf16 weight with an inf, made the job stop on its first row
    with a line blaming the data; the loaded weights are now checked (one reduction per tensor) and the weight is
    named."""
    folder = _rewritten(fp8_folders / "dense", tmp_path / "model", _set(tensor, damage))
    _refused(folder, tmp_path, f"its weight {tensor.removeprefix('model.')} holds NaN or inf values; the model "
             "folder is damaged")


@pytest.mark.parametrize("config", [[1], "fp8", 8])
def test_a_quantization_config_that_is_no_mapping_is_one_line(tmp_path, fp8_folders, config):
    """config.json's quantization_config as a list, string or number: transformers' config class raised
    AttributeError ('list' object has no attribute 'to_dict') as a traceback while hsx read the config."""
    from helpers import assert_one_error_line, hsx_main

    folder = _rewritten(fp8_folders / "dense", tmp_path / "model",
                        config_fn=lambda c: c.__setitem__("quantization_config", config))
    rc, _, err = hsx_main(["extract", "--model", str(folder), "--dataset", str(_pretokenized(tmp_path / "d.jsonl")),
                           "--layers", "1", "--output-dir", str(tmp_path / "out"), "--compile", "off"])
    assert_one_error_line(rc, err, f"hsx: error: cannot read the config of model '{folder}': ")
    assert not (tmp_path / "out" / ".hsx" / "job.json").exists()
