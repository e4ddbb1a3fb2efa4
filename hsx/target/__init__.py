"""The target's wing: the model a job reads states from, checked, loaded and made ready to run (a subpackage
because these modules import mostly each other; tests/test_imports.py places each in the package's layers).

What each module does (lowest first):
- `checkpoint`: the untrusted model folder checked before transformers reads it: every file's size, config.json's
  layer count, the safetensors headers against the config (names, shapes, dtypes, FP8 scales), the weights
  loaded finite.
- `model`: the target loaded from safetensors, cut after the deepest layer asked for (`read_target`, `Target`,
  `load_model`, `decoder_layers`, `text_config_of`).
- `kernels`: one table (`KERNELS`) of which of hsx's kernels runs on which GPU, `choose` that reads it, and the
  FP8 GEMMs' order (`FP8_GEMMS`, `fp8_gemm_order`).
- `attention`: hsx's packed (varlen) attention, registered with transformers; `gdn`: Gated DeltaNet layers run
  packed on fla's and hsx's kernels.
- `moe` (grouped experts and fused routers put into transformers) over `moe_kernels` (their Triton kernels);
  `expert_parallel`: the routed experts sharded over `--ep-size` ranks.
- `fp8` (the FP8 checkpoint format) under `fp8_gemm` (block-scaled GEMMs, `Fp8Linear`) and `fp8_model` (hsx's FP8
  layers put into a model, the bf16 reference).
- `prepare`: packing, compile ahead, the kernel report; `capture`: hooks on the target layers; `drift`: FP8
  states against bf16 ones; `ready`: the walk over all of these that makes the target ready for one job.

To add a model family: `model` (its text config and `decoder_layers`, where transformers nests them otherwise),
`checkpoint` (`text_weights_prefix`, where its weights are named otherwise), `attention` or `gdn` (a new attention
kind: `gdn.is_linear_attention`), `moe` (its experts' or router's form: `QWEN3_MOE_ROUTERS`) and `expert_parallel`
(its experts sharded), `fp8_model` (its FP8 linears and experts), `prepare` (what of it packs and compiles), and,
outside the wing, hsx/cost.py's `SHAPES` (`hsx plan --shape`) and a tiny one built in tests/test_architectures.py.
To add a kernel: write it beside its layer (`attention`, `gdn`, `moe_kernels`, `fp8_gemm`), give it its row in
`kernels.KERNELS` (the capabilities it was checked on, its fallback) and read `kernels.choose` where it is picked;
test its branch on CPU in tests/test_kernels.py and against its reference in tests/test_gpu.py.
To add an FP8 GEMM: its product in `fp8_gemm` (a `_NAME_mm(xq, xs, w, ws)` in `_gemm`'s table, its name in
`_GEMM_NAMES`, what it needs in `_missing`; a GEMM that compiles per tile shape in `JIT_GEMMS`), its place in
`kernels.FP8_GEMMS` (auto's order; `FP8_ASKED_ONLY` until measured) and `kernels.fp8_gemm_order` (where it may run
unasked), its name in hsx/config.py's `FP8_GEMM_CHOICES`; it is
checked against the float32 product on the device before it runs (`_disagrees`); tests in tests/test_fp8.py, and
its column in the GEMM bench (hsx/bench.py's `GEMM_BENCH`, `hsx bench --gemms`).
"""
