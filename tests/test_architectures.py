"""hsx is right on every architecture family it claims (issue 8), checked on tiny random models built in-process.

For each family a random float32 model is saved (safetensors) and then run through hsx's real path:
`hsx.target.model.load_model` (truncated, base model only) → `Extractor` driven by `Pipeline` over right-padded
multi-row
batches of varied lengths (hooks, gather of real tokens). The result is compared with the reference forward: the
full-depth model as a user loads it (or the original in-memory model), on ONE sample, unpadded:
`output_hidden_states[i+1]` for i < N-1, a forward hook for the last layer's pre-norm output, `hidden_states[N]`
for the final norm. float32: within 1e-5 before bf16 storage (and the stored bits are those values in bf16).
bf16: ||hsx - ref|| / ||ref|| < 1e-2 per layer, against the bf16 reference.

transformers 5's traps tested here: vision-language checkpoints (Qwen3.5 and Gemma 3) load only
the text model, from the right weights; Gated DeltaNet hybrids stay exact under right padding (and refuse packing);
GPT-OSS has no SDPA path and ignores a lowered num_hidden_layers; layer_types are cut with the layers; MoE models
keep their experts implementation; `kernel_report` says which kernels run.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pytest
import torch
import transformers

from helpers import as_table, bf16_ulps, make_cfg, rel_err, write_jsonl
from hsx.config import HsxError
from hsx.engine import Extractor, Pipeline
from hsx.target.checkpoint import text_weights_prefix
from hsx.target.model import load_model, truncated_view
from hsx.target.prepare import kernel_report, packing_blocker, prepare_model, resolve_packing

CPU = torch.device("cpu")
VOCAB = 512  # >= hsx.demo.build_tokenizer()'s vocabulary, for the end-to-end runs
LENGTHS = [23, 9, 31, 17, 5, 28]  # two batches of three rows: right padding inside each (to 32 and 32)
BATCHES = [(0, 3), (3, 6)]


# ---- the families ----------------------------------------------------------------------------------------------

def _common(**kw) -> dict[str, Any]:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
    base.update(kw)
    return base


def _qwen3_5_text(**kw) -> dict[str, Any]:
    return _common(num_hidden_layers=4, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4,
                   layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"], **kw)


def _gemma3_text(**kw) -> dict[str, Any]:
    sliding, full = "sliding_attention", "full_attention"
    return _common(num_hidden_layers=6, sliding_window=4, query_pre_attn_scalar=16,
                   layer_types=[sliding, sliding, full, sliding, sliding, full], **kw)


def _qwen3_5_moe_text(**kw) -> dict[str, Any]:
    """Qwen3.5/3.6-MoE's text model: the hybrid layers, each with 4 routed experts (2 per token) and a gated shared
    expert."""
    return _qwen3_5_text(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32, **kw)


def _vision_language(name: str):
    T = transformers
    if name == "qwen3_5_moe_vl":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, out_hidden_size=64,
                      num_position_embeddings=16, temporal_patch_size=2, spatial_merge_size=2)
        cfg = T.Qwen3_5MoeConfig(text_config=_qwen3_5_moe_text(), vision_config=vision, image_token_id=500,
                                 video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)
        return cfg, T.Qwen3_5MoeForConditionalGeneration
    if name == "qwen3_5_vl":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, out_hidden_size=64,
                      num_position_embeddings=16, temporal_patch_size=2, spatial_merge_size=2)
        cfg = T.Qwen3_5Config(text_config=_qwen3_5_text(), vision_config=vision, image_token_id=500,
                              video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)
        return cfg, T.Qwen3_5ForConditionalGeneration
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=16, patch_size=4)
    cfg = T.Gemma3Config(text_config=_gemma3_text(), vision_config=vision, mm_tokens_per_image=4,
                         image_token_index=500, boi_token_index=501, eoi_token_index=502)
    return cfg, T.Gemma3ForConditionalGeneration


def family_config(name: str):
    """(config, the class that saves it: AutoModelForCausalLM or a vision-language model class)."""
    T = transformers
    if name in VISION_LANGUAGE:
        return _vision_language(name)
    configs: dict[str, Callable[[], Any]] = {
        "llama": lambda: T.LlamaConfig(**_common(num_hidden_layers=4)),
        "mistral": lambda: T.MistralConfig(**_common(num_hidden_layers=4, sliding_window=8)),
        "qwen2": lambda: T.Qwen2Config(**_common(num_hidden_layers=4)),
        "qwen3": lambda: T.Qwen3Config(**_common(num_hidden_layers=4)),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(**_common(
            num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            decoder_sparse_step=1, mlp_only_layers=[1])),
        "qwen3_5": lambda: T.Qwen3_5TextConfig(**_qwen3_5_text()),
        "qwen3_5_moe": lambda: T.Qwen3_5MoeTextConfig(**_qwen3_5_moe_text()),
        "qwen3_next": lambda: T.Qwen3NextConfig(**_common(
            num_hidden_layers=4, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])),
        "gemma3": lambda: T.Gemma3TextConfig(**_gemma3_text()),
        "gpt_oss": lambda: T.GptOssConfig(**_common(
            num_hidden_layers=4, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
        "deepseek_v3": lambda: T.DeepseekV3Config(**_common(
            num_hidden_layers=4, num_key_value_heads=4, head_dim=8, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, moe_intermediate_size=32)),
    }
    return configs[name](), T.AutoModelForCausalLM


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_next", "qwen3_5_moe", "gemma3",
            "gpt_oss", "deepseek_v3", "qwen3_5_vl", "qwen3_5_moe_vl", "gemma3_vl"]
VISION_LANGUAGE = {"qwen3_5_vl", "qwen3_5_moe_vl", "gemma3_vl"}
HYBRID = {"qwen3_5", "qwen3_next", "qwen3_5_moe", "qwen3_5_vl", "qwen3_5_moe_vl"}
MOE = {"qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_vl", "gpt_oss", "deepseek_v3"}
SLIDING = {"mistral": 8, "gemma3": 4, "gpt_oss": 4, "gemma3_vl": 4}  # windows well under the lengths used


@dataclass
class Family:
    name: str
    path: Path
    model: Any  # the saved float32 model (CausalLM or vision-language model), eval mode
    num_layers: int
    ids: list[list[int]]
    _refs: dict = field(default_factory=dict, repr=False)

    @property
    def layers(self) -> list[int]:
        n = self.num_layers
        return [0, n // 2, n - 1]

    def decoder(self, model) -> torch.nn.Module:
        """The text decoder of a saved model (the language model for a vision-language one)."""
        inner = model.model
        return inner.language_model if self.name in VISION_LANGUAGE else inner

    def reference(self, dtype: torch.dtype) -> list[dict]:
        """Per sample: {layer i: (T, hidden) float32} for every i, and 'final' — the full-depth model on the sample
        alone, unpadded. float32: the in-memory model that was saved (independent of any loading code); bf16: the
        checkpoint loaded in bf16 with its own class, as a user would. Vision-language models run whole (text
        only), so the reference is what the multimodal model computes."""
        if dtype not in self._refs:
            model = self.model if dtype == torch.float32 else type(self.model).from_pretrained(
                self.path, dtype=dtype).eval()
            self._refs[dtype] = [self._forward(model, ids) for ids in self.ids]
        return self._refs[dtype]

    def _forward(self, model, ids: list[int]) -> dict:
        n = self.num_layers
        decoder = self.decoder(model)
        captured: dict[str, torch.Tensor] = {}

        def hook(module, args, output):
            captured["last"] = output[0] if isinstance(output, tuple) else output

        handle = decoder.layers[n - 1].register_forward_hook(hook)
        try:
            with torch.no_grad():
                out = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
        finally:
            handle.remove()
        hs = out.hidden_states
        assert len(hs) == n + 1
        ref: dict = {i: hs[i + 1][0].float() for i in range(n - 1)}
        ref[n - 1] = captured["last"][0].float()
        ref["final"] = hs[n][0].float()
        return ref


def _save_family(name: str, root: Path, seed: int = 0) -> Family:
    cfg, cls = family_config(name)
    torch.manual_seed(seed)
    if cls is transformers.AutoModelForCausalLM:
        model = cls.from_config(cfg, dtype=torch.float32)
    else:
        model = cls(cfg).to(torch.float32)
    model.eval()
    model.save_pretrained(root, safe_serialization=True)
    text = cfg.get_text_config()
    g = torch.Generator().manual_seed(seed + 1)
    ids = [torch.randint(3, 500, (t,), generator=g).tolist() for t in LENGTHS]  # clear of image/special ids
    return Family(name=name, path=root, model=model, num_layers=int(text.num_hidden_layers), ids=ids)


_FAMILY_CACHE: dict[str, Family] = {}


def get_family(name: str, tmp_path_factory) -> Family:
    """Built and saved once per test session."""
    if name not in _FAMILY_CACHE:
        _FAMILY_CACHE[name] = _save_family(name, tmp_path_factory.mktemp(f"arch-{name}"))
    return _FAMILY_CACHE[name]


QUICK_FAMILIES = {"qwen3", "qwen3_moe", "qwen3_5"}  # dense, MoE, hybrid: the others run without -m "not slow"


@pytest.fixture(params=[f if f in QUICK_FAMILIES else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def family(request, tmp_path_factory) -> Family:
    return get_family(request.param, tmp_path_factory)


# ---- hsx's path --------------------------------------------------------------------------------------------------

@dataclass
class HsxRun:
    loaded: Any
    states: list[dict]  # per sample: {layer: (T, hidden) as computed, before storage; 'final'}
    tables: list[pa.Table]
    padded: list[tuple[int, int]]  # (rows, padded length) of each forward


def run_hsx(fam: Family, layers, final_hidden: bool, dtype: str = "float32", packing: str = "none") -> HsxRun:
    """load_model → Extractor + Pipeline over two right-padded (or packed) batches; records each forward's hooked
    layer outputs and final-norm output (the compute dtype, before the bf16 conversion for storage)."""
    loaded = load_model(make_cfg(fam, layers, final_hidden, dtype), CPU)
    ex = Extractor(loaded, CPU, 1 << 16, prepare_model(loaded.base, packing))
    calls: list[tuple] = []
    final: dict[str, torch.Tensor] = {}
    if final_hidden:
        loaded.base.norm.register_forward_hook(lambda m, a, o: final.__setitem__("out", o.detach().clone()))
    forward = ex._forward

    def recording_forward(ids, index, packed=None):
        out = forward(ids, index, packed)
        calls.append((tuple(ids.shape), {i: t.detach().clone() for i, t in ex.store.items()}, final.get("out")))
        return out

    ex._forward = recording_forward
    batches = [as_table(fam.ids[a:z], first_id=a) for a, z in BATCHES]
    pipe = Pipeline(ex, iter(batches), max(len(b) * 32 for b in batches))
    try:
        tables = [pipe(t) for t in batches]
    finally:
        pipe.close()
    assert len(calls) == len(batches)  # one forward per batch: really batched
    states = []
    for (shape, store, fin), (a, z) in zip(calls, BATCHES):
        assert sorted(store) == sorted(loaded.layers)
        at = 0  # packed: rows back to back in one sequence
        for r, ids in enumerate(fam.ids[a:z]):
            t = len(ids)
            where = (0, slice(at, at + t)) if packing != "none" else (r, slice(0, t))
            s = {i: store[i][where] for i in loaded.layers}
            if final_hidden:
                s["final"] = fin[where]
            states.append(s)
            at += t
    return HsxRun(loaded=loaded, states=states, tables=tables, padded=[c[0] for c in calls])


def stored_rows(run: HsxRun, width: int, column: str = "hidden_states") -> list[torch.Tensor]:
    rows = []
    for table in run.tables:
        for values in table.column(column).to_pylist():
            rows.append(torch.tensor(values, dtype=torch.int16).view(torch.bfloat16).reshape(len(values), width))
    return rows


# ---- the matrix --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("final_hidden", [False, True], ids=["layers", "layers+final"])
def test_float32_matches_reference(family, final_hidden):
    """First, middle and last (pre-norm) layer, and the final norm: equal to the unpadded one-sample full-depth
    reference within 1e-5 in float32; the stored bf16 bits are exactly those values rounded."""
    run = run_hsx(family, family.layers, final_hidden)
    loaded = run.loaded
    assert next(loaded.base.parameters()).dtype == torch.float32
    assert loaded.depth == (family.num_layers if final_hidden else family.layers[-1] + 1)
    assert len(loaded.base.layers) == loaded.depth
    assert all(rows > 1 and length > min(LENGTHS) for rows, length in run.padded)  # multi-row, right-padded
    refs = family.reference(torch.float32)
    keys = list(family.layers) + (["final"] if final_hidden else [])
    for k, (got, ref) in enumerate(zip(run.states, refs)):
        for key in keys:
            assert got[key].dtype == torch.float32
            torch.testing.assert_close(got[key], ref[key], atol=1e-5, rtol=1e-5,
                                       msg=lambda m, key=key, k=k: f"{family.name} sample {k} layer {key}: {m}")
    h = 64
    stored = stored_rows(run, len(family.layers) * h)
    for got, row in zip(run.states, stored):
        expect = torch.cat([got[i] for i in family.layers], dim=1).to(torch.bfloat16)
        assert torch.equal(row, expect)
    if final_hidden:
        for got, ref, row in zip(run.states, refs, stored_rows(run, h, "final_hidden_state")):
            assert int(bf16_ulps(row, ref["final"]).max()) <= 1


PACKING_REFUSED = {*HYBRID}  # Gated DeltaNet without fla kernels (GPT-OSS sinks: lse renormalization)


def get_loaded(fam: Family):
    return load_model(make_cfg(fam, fam.layers, True), CPU).base


def test_packed_varlen_matches_reference(family):
    """--packing varlen (each batch one sequence, rows split by cu_seqlens; the per-row SDPA branch on CPU):
    equal to the unpadded one-sample reference within 1e-5, sliding windows and MLA included; refused with one
    line where rows would leak into each other."""
    blocker = packing_blocker(get_loaded(family))
    assert resolve_packing(get_loaded(family), "auto", True, True, "sdpa")[0] == ("none" if blocker else "varlen")
    assert resolve_packing(get_loaded(family), "auto", False, True, "sdpa")[0] == "none"  # CPU: padding is faster
    if family.name in PACKING_REFUSED:
        assert blocker
        with pytest.raises(HsxError, match="--packing varlen: .*use --packing none"):
            run_hsx(family, family.layers, True, packing="varlen")
        return
    run = run_hsx(family, family.layers, True, packing="varlen")
    assert all(rows == 1 and length == -(-sum(LENGTHS[a:z]) // 8) * 8
               for (rows, length), (a, z) in zip(run.padded, BATCHES))  # one packed sequence per batch
    for k, (got, ref) in enumerate(zip(run.states, family.reference(torch.float32))):
        for key in list(family.layers) + ["final"]:
            torch.testing.assert_close(got[key], ref[key], atol=1e-5, rtol=1e-5,
                                       msg=lambda m, key=key, k=k: f"{family.name} sample {k} layer {key}: {m}")


def test_bfloat16_matches_reference(family):
    """bf16 compute: per layer, ||hsx - ref||_F / ||ref||_F < 1e-2 over all tokens, against the bf16 reference;
    and hsx adds no error of its own: its distance to the float32 reference is no larger than the bf16 reference's
    (bf16 arithmetic itself is the only error)."""
    run = run_hsx(family, family.layers, True, dtype="bfloat16")
    assert next(run.loaded.base.parameters()).dtype == torch.bfloat16
    ref16, ref32 = family.reference(torch.bfloat16), family.reference(torch.float32)
    for key in list(family.layers) + ["final"]:
        got = torch.cat([s[key].float() for s in run.states])
        r16 = torch.cat([r[key] for r in ref16])
        r32 = torch.cat([r[key] for r in ref32])
        err = rel_err(got, r16)
        assert err < 1e-2, f"{family.name} layer {key}: {err:.2e}"
        assert rel_err(got, r32) <= 1.5 * rel_err(r16, r32) + 1e-3, f"{family.name} layer {key}"


def test_layers_are_distinguishable(family):
    """Guard for the matrix: neighbouring layers, and the last layer before/after the final norm, differ by far
    more than the tolerances (100x the float32 one, 5x the bf16 one), so an off-by-one layer cannot pass."""
    ref = family.reference(torch.float32)[0]
    n = family.num_layers
    for a, b in [(i, i + 1) for i in range(n - 1)] + [(n - 1, "final")]:
        assert (ref[a] - ref[b]).abs().max() > 1e-3, (a, b)
        assert rel_err(ref[b], ref[a]) > 5e-2, (a, b)


@pytest.mark.parametrize("name", sorted(SLIDING))
def test_sliding_window_matters(name, tmp_path_factory):
    """Guard: at the lengths used, the sliding window changes the outputs (so the matrix really tests it)."""
    fam = get_family(name, tmp_path_factory)
    decoder = fam.decoder(fam.model)
    cfg = decoder.config
    old = cfg.sliding_window
    assert old == SLIDING[name] and max(LENGTHS) > 2 * old
    ids = torch.tensor([max(fam.ids, key=len)])
    with torch.no_grad():
        narrow = decoder(input_ids=ids, use_cache=False).last_hidden_state
        try:
            cfg.sliding_window = 10_000
            wide = decoder(input_ids=ids, use_cache=False).last_hidden_state
        finally:
            cfg.sliding_window = old
    assert (narrow - wide).abs().max() > 1e-3


# ---- traps -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(VISION_LANGUAGE))
def test_vision_language_checkpoint_loads_only_the_text_model(name, tmp_path_factory):
    """A vision-language checkpoint: load_model builds the text model alone (no vision weights in memory), from a
    truncated text config with layer_types cut, on the checkpoint's own text weights (bit-exact), and its states
    equal the multimodal model's language model run alone."""
    fam = get_family(name, tmp_path_factory)
    assert type(fam.model).__name__.endswith("ForConditionalGeneration")
    layers = [0, 1]
    loaded = load_model(make_cfg(fam, layers, False), CPU)
    base = loaded.base
    assert type(base).__name__.endswith("TextModel")
    names = [k for k, _ in base.named_parameters()]
    assert not any(w in k for k in names for w in ("visual", "vision", "multi_modal", "lm_head"))
    text = fam.model.config.get_text_config()
    assert type(loaded.text_config) is type(text)
    assert loaded.text_config.num_hidden_layers == loaded.depth == 2 == len(base.layers)
    assert loaded.text_config.layer_types == text.layer_types[:2]
    assert base.config.layer_types == text.layer_types[:2]
    # every parameter is the checkpoint's (no random init), compared with the model that was saved
    source = fam.decoder(fam.model).state_dict()
    for k, p in base.state_dict().items():
        assert torch.equal(p, source[k]), k
    # and the language model run alone agrees with what the test matrix compared (the whole VLM)
    lm = fam.decoder(fam.model)
    with torch.no_grad():
        alone = lm(input_ids=torch.tensor([fam.ids[0]]), output_hidden_states=True, use_cache=False).hidden_states
    ref = fam.reference(torch.float32)[0]
    for i in layers:
        torch.testing.assert_close(alone[i + 1][0], ref[i], atol=1e-6, rtol=1e-6)


def test_text_weights_prefix():
    assert text_weights_prefix(["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
                                "lm_head.weight"]) == "model."
    assert text_weights_prefix(["language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
                                "language_model.model.layers.0.x.weight", "vision_tower.encoder.layers.0.y"]) \
        == "language_model.model."
    assert text_weights_prefix(["model.language_model.embed_tokens.weight", "model.language_model.layers.1.a",
                                "model.visual.blocks.0.b", "mtp.layers.0.c"]) == "model.language_model."
    assert text_weights_prefix(["embed_tokens.weight", "layers.0.a"]) == ""
    assert text_weights_prefix(["transformer.wte.weight", "transformer.h.0.a"]) is None
    assert text_weights_prefix(["a.embed_tokens.weight", "a.layers.0.x", "b.embed_tokens.weight",
                                "b.layers.0.x"]) is None  # ambiguous: transformers decides


def test_missing_weights_are_refused(tmp_path_factory, tmp_path):
    """A checkpoint that lacks decoder weights is an error, not a model with random layers."""
    from safetensors.torch import load_file, save_file

    from hsx.config import HsxError

    fam = get_family("qwen3", tmp_path_factory)
    for f in fam.path.iterdir():
        if f.suffix == ".safetensors":
            tensors = {k: v for k, v in load_file(f).items() if "layers.1.mlp" not in k}
            save_file(tensors, tmp_path / f.name, metadata={"format": "pt"})
        elif f.is_file():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = make_cfg(fam, [1], False)
    cfg.model = str(tmp_path)
    with pytest.raises(HsxError, match="not found in the checkpoint"):
        load_model(cfg, CPU)
    cfg = make_cfg(fam, [0], False)
    cfg.model = str(tmp_path)
    load_model(cfg, CPU)  # cut before the damaged layer: nothing it needs is missing


@pytest.mark.parametrize("name", sorted(HYBRID))
def test_hybrid_right_padding_is_exact(name, tmp_path_factory):
    """On transformers' forward (CPU: no fla) Gated DeltaNet layers leak across packed sequences, so hsx runs them
    right-padded; right padding keeps every real token exact, even for a row padded by 26 tokens, and the report
    says packing would not be safe."""
    fam = get_family(name, tmp_path_factory)
    loaded = load_model(make_cfg(fam, [0, fam.num_layers - 1], False), CPU)
    report = kernel_report(loaded.base)
    assert report["linear_attention"] in ("fla", "torch fallback")
    if report["linear_attention"] == "torch fallback" or report["causal_conv1d"] == "torch fallback":
        assert report["packing_safe"] is False
    short, long_ = min(fam.ids, key=len), max(fam.ids, key=len)
    ids = torch.zeros((2, 32), dtype=torch.long)
    ids[0, :len(long_)] = torch.tensor(long_)
    ids[1, :len(short)] = torch.tensor(short)
    ids[1, len(short):] = torch.randint(3, 500, (32 - len(short),))  # padding of arbitrary ids
    from hsx.target.capture import capture

    with torch.inference_mode(), capture(loaded.base, loaded.layers) as store:
        loaded.base(input_ids=ids, use_cache=False)
        got = {i: store[i].clone() for i in loaded.layers}
    refs = fam.reference(torch.float32)
    for row, sample in ((0, fam.ids.index(long_)), (1, fam.ids.index(short))):
        t = len(fam.ids[sample])
        for i in loaded.layers:
            torch.testing.assert_close(got[i][row, :t], refs[sample][i], atol=1e-5, rtol=1e-5)


def test_gpt_oss_eager_and_sliced(tmp_path_factory):
    """GPT-OSS has no SDPA path: hsx's default ("sdpa") falls back to the model's own (eager) and says so. Its
    forward loops over every entry of `layers` whatever num_hidden_layers says, so a truncated view must slice the
    list (finish_truncation), or it would run all layers."""
    fam = get_family("gpt_oss", tmp_path_factory)
    loaded = load_model(make_cfg(fam, [1], False), CPU)
    report = kernel_report(loaded.base)
    assert report["attn_implementation"] == "eager" and report["attn_implementation_requested"] == "sdpa"
    assert report["packing_safe"] is True  # packed batches run hsx's varlen attention (sinks included), no mask
    assert len(loaded.base.layers) == 2 == loaded.base.config.num_hidden_layers
    assert loaded.base.config.layer_types == fam.model.config.layer_types[:2]
    # a view over the full model: the layer list is sliced, and later layers never run
    view = truncated_view(fam.model, fam.model.config, [1], False)
    assert len(view.base.layers) == 2 and len(fam.model.model.layers) == fam.num_layers
    ran: list[int] = []
    handles = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
               for i, layer in enumerate(fam.model.model.layers)]
    try:
        with torch.no_grad():
            view.base(input_ids=torch.tensor([fam.ids[1]]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    assert ran == [0, 1]


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss", "qwen3_5", "qwen3_next", "qwen3_5_moe", "gemma3_vl",
                                  "qwen3_5_vl", "qwen3_5_moe_vl"])
def test_layer_types_cut_with_the_layers(name, tmp_path_factory):
    fam = get_family(name, tmp_path_factory)
    full = fam.model.config.get_text_config().layer_types
    for layers, final in (([0], False), ([fam.num_layers - 2], False), ([0], True)):
        loaded = load_model(make_cfg(fam, layers, final), CPU)
        assert len(loaded.text_config.layer_types) == loaded.depth == len(loaded.base.layers)
        assert loaded.base.config.layer_types == full[:loaded.depth]
        assert loaded.base.config.num_hidden_layers == loaded.depth


@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_keeps_experts_implementation(name, tmp_path_factory):
    """The truncated load keeps the experts implementation a plain from_pretrained picks, and reports it."""
    from transformers import AutoModel

    fam = get_family(name, tmp_path_factory)
    plain = AutoModel.from_pretrained(fam.path)
    loaded = load_model(make_cfg(fam, [1], False), CPU)
    expected = plain.config._experts_implementation
    assert expected  # e.g. grouped_mm
    assert loaded.base.config._experts_implementation == expected
    assert kernel_report(loaded.base)["experts_implementation"] == expected
    if name == "deepseek_v3":  # first_k_dense_replace=1: a dense layer, then MoE layers
        kinds = [type(layer.mlp).__name__ for layer in loaded.base.layers]
        assert kinds[0].endswith("MLP") and kinds[1].endswith("MoE")


# ---- kernel_report -----------------------------------------------------------------------------------------------

def test_kernel_report_plain_models(tmp_path_factory):
    fam = get_family("llama", tmp_path_factory)
    report = kernel_report(load_model(make_cfg(fam, [0], False), CPU).base)
    assert report == {"attn_implementation": "sdpa", "attn_implementation_requested": "sdpa",
                      "experts_implementation": None, "linear_attention": None, "causal_conv1d": None,
                      "linear_attention_forward": None, "packing_safe": True, "packing_note": ""}


def _fake_kernel_package(name: str, monkeypatch) -> None:
    """A stand-in for flash-linear-attention: fla-like `ops.gated_delta_rule.chunk_gated_delta_rule`."""
    root, ops, rule = (types.ModuleType(n) for n in (name, f"{name}.ops", f"{name}.ops.gated_delta_rule"))

    def chunk_gated_delta_rule(q, k, v, g, beta, **kwargs):
        raise AssertionError("not called")

    chunk_gated_delta_rule.__module__ = rule.__name__
    rule.chunk_gated_delta_rule = chunk_gated_delta_rule
    root.ops, ops.gated_delta_rule = ops, rule
    for m in (root, ops, rule):
        monkeypatch.setitem(sys.modules, m.__name__, m)


@pytest.mark.parametrize("kernel_present", [False, True])
def test_kernel_report_reads_the_fallback_wrapper(kernel_present, monkeypatch):
    """kernel_report reads which implementation transformers' `use_kernel_func_from_hub_with_fallback` bound, in
    the modeling module of the linear-attention layers: with a (fake) kernel package importable it says "fla"."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    package = "hsx_test_fake_fla" if kernel_present else "hsx_test_absent_package"
    if kernel_present:
        _fake_kernel_package(package, monkeypatch)
    module = types.ModuleType("hsx_test_fake_modeling")

    def torch_chunk_gated_delta_rule(q, k, v, g, beta, **kwargs):
        return q

    def causal_conv1d_fn(x, weight, bias=None, activation=None, **kwargs):
        return x

    module.torch_chunk_gated_delta_rule = use_kernel_func_from_hub_with_fallback(
        "chunk_gated_delta_rule", package)(torch_chunk_gated_delta_rule)
    module.causal_conv1d_fn = use_kernel_func_from_hub_with_fallback(
        "causal_conv1d_fn", "hsx_test_absent_conv")(causal_conv1d_fn)

    class FakeGatedDeltaNet(torch.nn.Module):
        pass

    FakeGatedDeltaNet.__module__ = module.__name__
    monkeypatch.setitem(sys.modules, module.__name__, module)
    base = torch.nn.Module()
    base.config = transformers.PretrainedConfig()
    base.layers = torch.nn.ModuleList([FakeGatedDeltaNet()])
    report = kernel_report(base)
    assert report["linear_attention"] == ("fla" if kernel_present else "torch fallback")
    assert report["causal_conv1d"] == "torch fallback"
    assert report["packing_safe"] is False  # needs both kernels


def test_kernel_report_hybrid_without_kernels(tmp_path_factory):
    """This CPU venv has neither fla nor causal-conv1d: the report says the torch fallback runs."""
    import importlib.util

    fam = get_family("qwen3_5", tmp_path_factory)
    report = kernel_report(load_model(make_cfg(fam, [0], False), CPU).base)
    if importlib.util.find_spec("fla") is None:
        assert report["linear_attention"] == "torch fallback"
    if importlib.util.find_spec("causal_conv1d") is None:
        assert report["causal_conv1d"] == "torch fallback"
    assert report["experts_implementation"] is None and report["attn_implementation"] == "sdpa"


def test_hybrid_packing_resolution_without_fla_or_cuda(tmp_path_factory, monkeypatch):
    """Gated DeltaNet layers pack only on hsx's fla forward: on CPU, or without flash-linear-attention, auto picks
    right-padded batches and says why in one line; an explicit --packing varlen is refused with the reason."""
    from hsx.target import gdn
    from hsx.target.prepare import use_packing

    fam = get_family("qwen3_5", tmp_path_factory)
    for fla_present, why in ((False, "flash-linear-attention is not installed"), (True, "need CUDA")):
        monkeypatch.setattr(gdn, "fla_importable", lambda present=fla_present: present)
        base = load_model(make_cfg(fam, [0, 3], False), CPU).base
        report = kernel_report(base)
        assert report["linear_attention_forward"] == "transformers" and why in report["linear_attention_note"]
        assert report["packing_safe"] is False
        assert resolve_packing(base, "auto", False, True, "sdpa") == ("none", None)  # CPU: padded, nothing to say
        packing, reason = resolve_packing(base, "auto", True, True, "sdpa")
        assert packing == "none" and why in reason and "\n" not in reason
        with pytest.raises(HsxError, match=f"--packing varlen: .*{why}.*use --packing none"):
            use_packing(base, "varlen")
        assert not gdn.install(base) and not gdn.installed(base)  # modules keep transformers' forward


# ---- end to end through hsx.run.extract -----------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "dtype"), [("gemma3", "float32"), ("qwen3_moe", "bfloat16"),
                                             ("qwen3_5_vl", "float32")])
def test_end_to_end(name, dtype, tmp_path_factory, tmp_path, tokenizer):
    """hsx.run.extract on a chat jsonl with the tiny tokenizer saved beside the model: bucketed, batched,
    right-padded, truncated, hooked, stored; every row equals the one-sample reference (float32 compute: within
    1 bf16 ulp of the float32 reference; bf16 compute: relative 1e-2 against the bf16 reference)."""
    import hsx
    from hsx.config import load_config
    from hsx.demo import chat_rows
    from hsx.run import extract

    fam = get_family(name, tmp_path_factory)
    tokenizer.save_pretrained(fam.path)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6, seed=5)[:6])
    n = fam.num_layers
    layers = [0, n // 2, n - 1]
    cfg = load_config(None, {"model": str(fam.path), "dataset": str(data), "output_dir": str(tmp_path / "out"),
                             "layers": [str(i) for i in layers], "final_hidden": True, "max_length": 96,
                             "token_budget": 256, "dtype": dtype, "compile": "off"})
    info = extract(cfg, log=lambda *a: None)
    assert info["layers"] == layers and info["num_model_layers"] == n and info["hidden_size"] == 64
    # the experts kernel that ran is in the run's record, as sdpa_backend and packing are (none without experts)
    ran = info["run"]["kernels"]["experts_implementation"]
    assert info["run"].get("experts_implementation") == ran and (ran is not None) == (name in MOE)
    assert "fp8_gemm" not in info["run"]  # (no FP8 target)
    versions = info["run"]["versions"]  # the libraries that computed the states, as pip names them
    assert versions["torch"] == torch.__version__ and versions["transformers"] == transformers.__version__
    view = hsx.torch_view(str(tmp_path / "out"))
    assert len(view) == info["counts"]["rows_written"] > 0
    model = fam.model if dtype == "float32" else type(fam.model).from_pretrained(fam.path, dtype=torch.bfloat16)
    for i in range(len(view)):
        row = view[i]
        ref = fam._forward(model.eval(), row["input_ids"].tolist())
        for k, layer in enumerate(layers):
            got = row["hidden_states"][:, k]
            if dtype == "float32":
                assert int(bf16_ulps(got, ref[layer]).max()) <= 1, (name, row["sample_id"], layer)
            else:
                assert rel_err(got, ref[layer]) < 1e-2, (name, row["sample_id"], layer)
        if dtype == "float32":
            assert int(bf16_ulps(row["final_hidden_state"], ref["final"]).max()) <= 1
        else:
            assert rel_err(row["final_hidden_state"], ref["final"]) < 1e-2
