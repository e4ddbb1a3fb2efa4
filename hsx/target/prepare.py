"""A loaded model (hsx.target.model) prepared to run a job's batches, and the report of what runs.

- `prepare_model`: packed (padding-free) batches through hsx's varlen attention (`use_packing`, `resolve_packing`
  says whether a model can), Gated DeltaNet layers on fla's kernels, and regional compilation (`compile_layers`:
  each decoder layer's forward compiled ahead of time by a worker thread, `CompileAhead`).
- `kernel_report`: which kernels run (attention, linear attention, experts, FP8, fallbacks) and `library_versions`:
  what hsx.json's run record names.
"""

from __future__ import annotations

import inspect
import signal
import sys
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from hsx.config import HsxError
from hsx.target import attention, fp8, fp8_gemm, fp8_model, gdn, kernels
from hsx.target.model import checkpoint_quantization, decoder_layers, requested_attention

# How `compile_layers` compiled a model, kept beside it (weakly: gone with it), not as an attribute on
# transformers' objects
_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()


@dataclass
class PreparedModel:
    """How a prepared model runs its batches (`prepare_model`)."""

    packing: str  # "none": right-padded rows; "varlen": one packed sequence per forward
    linear_attention: bool  # its Gated DeltaNet layers run on fla's kernels
    compiler: "CompileAhead | None"  # the layers' background compilation (None: eager, or compiled in place)


def prepare_model(base: torch.nn.Module, packing: str = "none", compile_model: bool = False, cuda: bool = False,
                  log=print) -> PreparedModel:
    """Switch a loaded model, in place, to run as the job asks; each step once per model. Packed batches
    (`use_packing`: the model's configs name hsx's varlen attention, registered with transformers'
    AttentionInterface; the one change outside the model, idempotent), Gated DeltaNet layers on fla's kernels
    (CUDA with fla installed; packed rows need it), compiled layers (`compile_layers`)."""
    use_packing(base, packing)
    linear = gdn.install(base) if cuda else False
    compiler = compile_layers(base, log=log) if compile_model else None
    return PreparedModel(packing=packing, linear_attention=linear, compiler=compiler)


def compile_layers(base: torch.nn.Module, ahead: bool = True, log=print) -> "CompileAhead | None":
    """Regional compilation: torch.compile each decoder layer's forward, once per model.

    Layers of one class share one graph (compiled once, ~1 graph per layer type), and the capture hooks stay
    outside the compiled code, so adding or removing them never recompiles. Blocks that do not compile well run
    eager inside the compiled layers (`torch.compiler.disable`): the Gated DeltaNet mixers (fla's Triton kernels
    are fused already; traced with dynamic shapes, Inductor spent minutes in sympy on the 27B shape without
    finishing). With `ahead` (the default) no forward ever waits for Inductor: layers run eager until a worker
    thread has compiled every layer kind on a batch's inputs (`CompileAhead.start`), then run only cached graphs
    (a shape whose guards fail runs eager, never recompiles on the extraction thread). Returns the CompileAhead
    (None when `ahead` is off: then the first forwards compile in place)."""
    state = _COMPILED.get(base)
    if state is not None:
        return state or None
    for m in gdn.linear_attention_modules(base):
        m.forward = torch.compiler.disable(m.forward)
    layers = decoder_layers(base)
    if not ahead:
        for layer in layers:
            layer.forward = torch.compile(layer.forward, dynamic=True, options=fp8_model.compile_options(layer))
        _COMPILED[base] = False
        return None
    ahead_state = CompileAhead(log=log)
    for layer in layers:
        layer.forward = _AheadLayer(layer.forward, ahead_state, _layer_kind(layer), fp8_model.compile_options(layer))
    _COMPILED[base] = ahead_state
    return ahead_state


def compiled_state(base: torch.nn.Module) -> "CompileAhead | bool | None":
    """How `compile_layers` compiled this model: its CompileAhead, False (compiled in place), None (not)."""
    return _COMPILED.get(base)


def _layer_kind(layer: torch.nn.Module) -> tuple:
    """Layers of one kind share a compiled graph (their class and the attributes its forward branches on)."""
    return (type(layer).__name__,) + tuple(str(getattr(layer, a, "")) for a in ("block_type", "layer_type",
                                                                               "attention_type"))


class CompileAhead:
    """Compiles the decoder layers in a worker thread while extraction runs eager (`compile_layers`).

    Forwards record each layer kind's inputs (with the thread's context variables, e.g. packed rows), the largest
    seen; `start` then compiles and runs each kind once on them, on the worker, in inference mode: after the first
    forward of at least half the token budget, or after SAMPLE_FORWARDS forwards. Inductor picks its kernels' tiles
    for the sample's sizes (dynamic shapes keep the sizes symbolic, not the tiles): compiled on a 16-token first
    batch, kernels ran several times slower on full batches (docs/benchmarks.md, session 12).
    `ready` is set when every kind compiled; `wait` gives up after a deadline with one line (extraction keeps
    running eager). `close` ends the worker before the job returns: a thread still inside torch's C++ code when the
    interpreter exits is unwound by glibc's thread cancellation through C++ frames, which aborts the process
    ("FATAL: exception not rethrown") after its work is done. A compile in progress cannot be cut short, so `close`
    waits for it."""

    def __init__(self, log=print):
        self.log = log
        self.samples: dict[tuple, tuple] = {}  # kind -> (args, kwargs, context, tokens) of its largest call
        self.forwards = 0  # forwards seen before the compile started
        self.device: torch.device | None = None
        self.layers: list[tuple] = []  # (kind, compiled forward) of every layer
        self.ready = threading.Event()
        self.stopping = threading.Event()  # `close(finish=False)`: compile no further kind
        self.failed: str | None = None
        self.thread: threading.Thread | None = None
        self.seconds: float | None = None  # compile time, once done

    def record(self, kind, args, kwargs) -> None:
        import contextvars

        if self.thread is not None:
            return
        tokens = _call_tokens(args, kwargs)
        if kind in self.samples and self.samples[kind][3] >= tokens:
            return
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        self.samples[kind] = (args, dict(kwargs), contextvars.copy_context(), tokens)

    def start(self, device: torch.device, tokens: int = 0, budget: int = 0) -> None:
        """After a forward of `tokens` (of a `budget` per batch): compile every recorded kind in the background
        (once), if this forward was representative (at least half the budget) or SAMPLE_FORWARDS have run."""
        if self.thread is not None or not self.samples:
            return
        self.device = device
        self.forwards += 1
        if 2 * tokens < budget and self.forwards < SAMPLE_FORWARDS:
            return
        self._launch(device)

    def _launch(self, device: torch.device) -> None:
        trace_fx_once()
        # Not a daemon: the worker always ends on its own, and if no `close` joins it, the interpreter's exit does.
        self.thread = threading.Thread(target=self._compile, args=(device,), name="hsx-compile")
        self.thread.start()

    def close(self, finish: bool) -> None:
        """Join the worker: after every kind compiled (`finish`: the model outlives the job, e.g. `hsx bench`'s),
        or after the kind compiling now (no further kind starts; the layers stay eager). A SIGINT/SIGTERM while
        joining (a second Ctrl-C as a stopped job ends) stops the worker after its kind and is handled once the
        worker ended: raised in the join, it would leave the worker compiling while the job reports it stopped, and
        the interpreter's exit waiting for it, where a further Ctrl-C prints a traceback."""
        if self.thread is None:
            return
        if not finish:
            self.stopping.set()
        if self.thread.is_alive():
            self.log("hsx: waiting for torch.compile's worker to finish the layer kind it is compiling")
        with _signals_held(self._stop_on_signal):
            self.thread.join()

    def _stop_on_signal(self, signum: int) -> None:
        if not self.stopping.is_set():
            self.stopping.set()
            self.log(f"hsx: {signal.Signals(signum).name}: stopping once torch.compile's worker ends the layer kind "
                     "it is compiling (a compile cannot be cut short)")

    def _compile(self, device: torch.device) -> None:
        import time

        t0 = time.perf_counter()
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            with torch.inference_mode():
                for kind, compiled in self.layers:  # every layer: one compile per kind, then guard checks
                    if self.stopping.is_set():
                        return
                    if kind in self.samples:
                        args, kwargs, context, _ = self.samples[kind]
                        context.run(compiled, *args, **kwargs)
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
        except Exception as e:  # noqa: BLE001 - any compiler failure leaves the model eager, as it was
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.log(f"hsx: torch.compile failed ({self.failed[:200]}); the layers keep running eager")
            return
        finally:
            self.samples.clear()  # free the recorded inputs
        self.seconds = time.perf_counter() - t0
        self.ready.set()

    def wait(self, timeout: float) -> bool:
        """Block until compiled (True) or `timeout` seconds (False, with one line); for benchmarks' warm-up. A
        compile still waiting for a representative batch starts now, on the largest recorded."""
        if self.thread is None and self.samples and self.device is not None:
            self._launch(self.device)
        if self.thread is None or self.failed:
            return False
        if not self.ready.wait(timeout):
            self.log(f"hsx: torch.compile not done after {timeout:.0f} s; extraction goes on eager meanwhile")
            return False
        return True


SAMPLE_FORWARDS = 16  # forwards (run eager) a compile waits for a representative batch before it takes the largest


def _call_tokens(args, kwargs) -> int:
    """Tokens in a decoder layer call: its hidden states' elements over the hidden size."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    return hidden.shape[:-1].numel() if isinstance(hidden, torch.Tensor) and hidden.dim() else 0


@contextmanager
def _signals_held(on_signal):
    """SIGINT/SIGTERM, where Python code handles them (not SIG_DFL/SIG_IGN), call `on_signal(signum)` inside the
    block and reach their handler (hsx.run's stop, KeyboardInterrupt) after it. Main thread only (where signals are
    delivered and handlers set); elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum, frame):
        held.append(signum)
        on_signal(signum)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous = {sig: h for sig, h in previous.items() if callable(h)}
    for sig in previous:
        signal.signal(sig, hold)
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
        for signum in held:
            signal.raise_signal(signum)


def trace_fx_once() -> None:
    """Run, on this thread, the one torch.fx symbolic trace Inductor makes per process. While it traces, torch.fx
    swaps `nn.Module.__call__` for every thread (Inductor's first lowering traces a dummy graph,
    `torch._inductor.loop_body.InterpreterShim._dummy_gm`, cached after): made by the compile worker, it broke an
    eager forward on the extraction thread at the same moment ("NameError: module is not installed as a
    submodule"; the qwen3-8b shape's warm-up). Traced here before the worker starts, the worker reads the cache. The
    tracers that AOTAutograd uses swap it too, but call the original forward for modules outside their graph."""
    try:
        from torch._inductor.loop_body import InterpreterShim

        InterpreterShim._dummy_gm()
    except Exception:  # noqa: BLE001 - another torch: nothing of this kind to trace ahead
        pass


class _AheadLayer:
    """A decoder layer's forward: eager until its CompileAhead is ready, then the cached compiled graphs only."""

    def __init__(self, forward, state: CompileAhead, kind: tuple, options: dict | None = None):
        self.eager = forward
        self.compiled = torch.compile(forward, dynamic=True, options=options)
        self.cached_only = torch._dynamo.run(self.compiled)  # never compiles: a cache miss runs eager
        self.state, self.kind = state, kind
        state.layers.append((kind, self.compiled))

    def __call__(self, *args, **kwargs):
        if self.state.ready.is_set():
            return self.cached_only(*args, **kwargs)
        if self.state.thread is None and not torch.compiler.is_compiling():
            self.state.record(self.kind, args, kwargs)
        return self.eager(*args, **kwargs)


# ---- which kernels run ---------------------------------------------------------------------------------------------

LINEAR_ATTENTION_KERNEL = "chunk_gated_delta_rule"  # Gated DeltaNet over a whole sequence (fla when installed)
CONV_KERNEL = "causal_conv1d_fn"  # its short causal convolution (causal-conv1d when installed)


# The libraries whose code computes or writes the states (pip's distribution name → module): kernels differ by version
# in their last bits, so a run's record names them. Optional ones not installed are left out.
STATE_LIBRARIES = {"torch": "torch", "transformers": "transformers", "datasets": "datasets",
                   "accelerate": "accelerate", "triton": "triton", "flash-linear-attention": "fla",
                   "causal-conv1d": "causal_conv1d", "kernels": "kernels", "deep_gemm": "deep_gemm",
                   "fbgemm-gpu-genai": "fbgemm_gpu", "flashinfer-python": "flashinfer"}


def library_versions() -> dict[str, str]:
    """The versions of STATE_LIBRARIES present (as pip reports them; for a module imported from a source tree, with
    no distribution, its __version__), and "cuda": the CUDA torch was built for. Nothing is imported here."""
    from importlib import metadata

    found: dict[str, str] = {}
    for dist, module in STATE_LIBRARIES.items():
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = getattr(sys.modules.get(module), "__version__", None)
            if isinstance(version, str):
                found[dist] = version
    if torch.version.cuda:
        found["cuda"] = torch.version.cuda
    return found


def kernel_report(base: torch.nn.Module) -> dict[str, Any]:
    """Which code paths the model's forward runs, for hsx.json and the run summary.

    attn_implementation: transformers' attention path (and attn_implementation_requested, what the job asked for;
    they differ when the model has no SDPA path, e.g. GPT-OSS runs eager). experts_implementation: the MoE experts'
    path (None without experts). For hybrid models with Gated DeltaNet layers (Qwen3.5/3.6, Qwen3-Next):
    linear_attention_forward is "hsx fla" when hsx.target.gdn runs them on fla's delta rule (CUDA with
    flash-linear-attention; linear_attention is then "fla" and causal_conv1d "hsx", `gdn.conv_kernel`: hsx's kernel
    for the convolution, q/k l2norm and layout, or "fla" for head layouts it does not take), else "transformers",
    with linear_attention_note saying why and linear_attention / causal_conv1d naming what transformers' own forward
    binds: "fla" / "causal_conv1d" for those packages' kernels, "torch fallback" for its reference PyTorch code
    (correct for right-padded batches, much slower); on fla's kernels fla_autotune says how their tiles are chosen
    (`gdn.autotuning_note`). All are None without such layers. packing_safe: whether packed (padding-free) batches
    would keep sequences apart (`--packing`)."""
    config = base.config
    modules = list(base.modules())
    has_experts = any(type(m).__name__.endswith("Experts") for m in modules)
    linear = gdn.linear_attention_modules(base)
    report: dict[str, Any] = {
        "attn_implementation": getattr(config, "_attn_implementation", None),
        "attn_implementation_requested": requested_attention(base),
        "experts_implementation": getattr(config, "_experts_implementation", None) if has_experts else None,
        "linear_attention": None,
        "causal_conv1d": None,
        "linear_attention_forward": None,
    }
    if linear:
        blocker = None if gdn.installed(base) else gdn.fla_blocker(linear)
        if blocker is None:
            conv = {gdn.conv_kernel(m) for m in linear}
            report.update(linear_attention="fla", causal_conv1d=conv.pop() if len(conv) == 1 else "hsx, fla",
                          linear_attention_forward="hsx fla",
                          fla_autotune=gdn.autotuning_note(linear[0].conv1d.weight.device))
        else:
            kernels = _fallback_kernels(linear)
            report["linear_attention"] = "fla" if kernels.get(LINEAR_ATTENTION_KERNEL, _importable(
                "fla.ops.gated_delta_rule", "chunk_gated_delta_rule")) else "torch fallback"
            report["causal_conv1d"] = "causal_conv1d" if kernels.get(CONV_KERNEL, _importable(
                "causal_conv1d", "causal_conv1d_fn")) else "torch fallback"
            report.update(linear_attention_forward="transformers", linear_attention_note=blocker)
    report["packing_safe"], report["packing_note"] = _packing(report, config)
    quantization = fp8_model.report(base, checkpoint_quantization(base) or fp8.quantization_of(config))
    if quantization is not None:  # (absent for unquantized models: their hsx.json stays as it was)
        report["quantization"] = quantization
    report.update(kernel_choices(base, has_experts, bool(linear), quantization))
    return report


def kernel_choices(base: torch.nn.Module, has_experts: bool, linear: bool, quantization: dict | None
                   ) -> dict[str, Any]:
    """On CUDA, this GPU's compute capability, those hsx's kernels were checked on, what runs for each kernel choice
    of this model (`hsx.target.kernels.choose`) and, where a kernel does not run here, the line saying what runs instead
    (`fallbacks`, logged by hsx extract); {} off CUDA."""
    device = next((p.device for p in base.parameters()), torch.device("cpu"))
    cap = kernels.capability_of(device)
    if cap is None:
        return {}
    hsx_fp8 = bool(quantization) and str(quantization.get("linear", "")).startswith("hsx fp8")
    picks = kernels.choose(cap, kernels.installed_packages(), str(getattr(base, "dtype", "")).removeprefix("torch."),
                           experts=has_experts, linear_attention=linear, fp8=hsx_fp8,
                           fp8_gemm=fp8_gemm._CHOSEN.get(device.index, "auto"))
    out: dict[str, Any] = {"compute_capability": kernels.cap_str(cap),
                           "kernels_checked_on": sorted({kernels.cap_str(c) for k in kernels.KERNELS.values()
                                                         for c in k.checked_on}),
                           # (the GEMM FP8 linears ran on, after its checks: quantization.linear)
                           "kernel_choices": {name: p.runs for name, p in picks.items() if name != "fp8_linear"}}
    lines = {name: p.line for name, p in picks.items() if p.line}
    if lines:
        out["fallbacks"] = lines
    return out


def _packing(report: dict[str, Any], config) -> tuple[bool, str]:
    if report["linear_attention_forward"] == "transformers":
        return False, ("Gated DeltaNet layers on transformers' forward ignore sequence boundaries "
                       f"({report['linear_attention_note']}): packed sequences would leak into each other")
    return True, ""


def fallback_closure(obj, depth: int = 3) -> dict[str, Any] | None:
    """The variables the function `use_kernel_func_from_hub_with_fallback` made for `obj` closes over (`func_name`,
    `is_new_implementation`, `torch_function`: 5.17 to 5.25 at least), or None when `obj` is not one. With the
    `kernels` package installed (a dependency of transformers from 5.25) that function is wrapped once more, in an
    nn.Module whose forward closes over it as `func`."""
    if depth == 0:
        return None
    if isinstance(obj, torch.nn.Module):
        obj = getattr(type(obj), "forward", None)
    if not callable(obj) or not hasattr(obj, "__code__"):
        return None
    try:
        free = inspect.getclosurevars(obj).nonlocals
    except (TypeError, ValueError):
        return None
    if "is_new_implementation" in free and isinstance(free.get("func_name"), str):
        return free
    return fallback_closure(free.get("func"), depth - 1)


def _fallback_kernels(modules: list[torch.nn.Module]) -> dict[str, bool]:
    """{kernel name: True when its package's implementation is used} for the functions that transformers wraps with
    `use_kernel_func_from_hub_with_fallback` in the modules' modeling files (`fallback_closure`). Older layouts keep
    the kernel as a module attribute."""
    found: dict[str, bool] = {}
    for mod_name in {type(m).__module__ for m in modules}:
        namespace = vars(sys.modules.get(mod_name, object()))
        for obj in list(namespace.values()):
            free = fallback_closure(obj)
            if free is not None:
                found[free["func_name"]] = bool(free["is_new_implementation"])
    for m in modules:  # older transformers: self.chunk_gated_delta_rule = fla's or torch's
        for attr, key in ((LINEAR_ATTENTION_KERNEL, LINEAR_ATTENTION_KERNEL), (CONV_KERNEL, CONV_KERNEL)):
            fn = getattr(m, attr, None)
            if key not in found and callable(fn) and not isinstance(fn, torch.nn.Module):
                found[key] = (getattr(fn, "__module__", "") or "").split(".")[0] in ("fla", "causal_conv1d")
    return found


def _importable(module: str, name: str) -> bool:
    import importlib

    try:
        return getattr(importlib.import_module(module), name, None) is not None
    except Exception:  # noqa: BLE001 - a broken optional kernel package is the same as none
        return False


# ---- packed (padding-free) batches ---------------------------------------------------------------------------------

VARLEN_ATTENTION = "hsx_varlen"  # our attention function's name in transformers' AttentionInterface


def packing_blocker(base: torch.nn.Module) -> str | None:
    """Why this model cannot run packed batches exactly (None when it can)."""
    report = kernel_report(base)
    if report["linear_attention_forward"] == "transformers":
        return f"its Gated DeltaNet layers run right-padded only: {report['linear_attention_note']}"
    if any(hasattr(m, "sinks") for m in base.modules()) and not _varlen_returns_lse():
        return f"attention sinks (GPT-OSS) need varlen attention's log-sum-exp (return_aux), not in torch {torch.__version__}"
    if getattr(base.config, "attn_logit_softcapping", None):
        return "attention logit softcapping has no varlen kernel"
    cap = kernels.capability_of(next((p.device for p in base.parameters()), torch.device("cpu")))
    if cap is not None and not kernels.runs_on("flash_varlen", cap):
        return kernels.fallback_line("flash_varlen", cap).removeprefix("hsx: ")
    if not report["packing_safe"]:
        return report["packing_note"]
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no varlen attention (2.9+)"
    return None


def _varlen_returns_lse() -> bool:
    return "return_aux" in attention.VARLEN_PARAMS  # (empty without torch's varlen module)


def resolve_packing(base: torch.nn.Module, requested: str, cuda: bool, one_gpu_per_copy: bool,
                    attn_implementation: str | None) -> tuple[str, str | None]:
    """The packing to run, and why auto chose none. auto = varlen on one CUDA device with the default attention,
    where it is exact: it cut GPU time against right-padded batches (docs/design.md, padding-free batches; the
    runs in docs/benchmarks.md). Hybrid Gated DeltaNet models pack only on hsx's fla forward
    (hsx.target.gdn: CUDA with flash-linear-attention). On CPU the varlen path runs SDPA per row: slower than
    padding."""
    if requested != "auto":  # asked for: `use_packing` refuses varlen where it would not be exact
        return requested, None
    if not cuda:
        return "none", None
    if not one_gpu_per_copy or attn_implementation not in ("sdpa", None):
        return "none", "a copy over several GPUs, or another attention implementation, runs right-padded"
    blocker = packing_blocker(base)
    return ("none", blocker) if blocker else ("varlen", None)


def use_packing(base: torch.nn.Module, packing: str) -> None:
    """Switch the model's attention to run a batch as one packed sequence of rows (`Extractor` passes per-row
    `position_ids` and the row boundaries as `cu_seq_lens_q`): torch's flash-attention varlen kernel, registered
    as a transformers attention function. No mask is built (transformers skips mask creation for an attention
    name it has no mask function for)."""
    if packing == "none":
        return
    blocker = packing_blocker(base)
    if blocker:
        raise HsxError(f"--packing {packing}: {blocker}; use --packing none (right-padded batches, exact here)")
    from transformers import AttentionInterface

    gdn.install(base)  # Gated DeltaNet layers: the row bounds reach fla's convolution and delta rule
    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)
    # Modules read `config._attn_implementation` at every forward; a truncated view's layers keep the full
    # model's config object, so set it on every config in the model.
    for config in {id(c): c for c in (getattr(m, "config", None) for m in base.modules()) if c is not None}.values():
        config._attn_implementation = VARLEN_ATTENTION


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                     max_length_q: int | None = None, softcap: float | None = None,
                     s_aux: torch.Tensor | None = None, **kwargs):
    """transformers attention function for one packed sequence: q, k, v are (1, heads, T, dim); the rows are
    delimited by `cu_seq_lens_q` (int32, rows + 1 offsets) and each attends causally to itself only.

    On CUDA this is one call per layer: hsx.target.attention's packed kernel where it takes the heads (plain causal
    attention), else flash-attention varlen (torch.nn.attention.varlen: sinks, sliding windows); on CPU (tests)
    it runs SDPA per row, which is exact and slow. Attention sinks (`s_aux`, GPT-OSS: one extra logit per head in every
    softmax's denominator) rescale the kernel's output: softmax over scores + sink = softmax over scores ×
    sigmoid(lse - sink), lse the log-sum-exp of the row's scores that flash attention returns."""
    if softcap is not None:
        raise HsxError("--packing varlen: this model's attention uses a logit softcap; use --packing none")
    if cu_seq_lens_q is None or max_length_q is None:
        raise HsxError("--packing varlen: the forward was called without row boundaries (cu_seq_lens_q)")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, heads, dim)
    dim_v = v.shape[-1]
    if q.is_cuda:
        if dim_v != q.shape[-1]:  # MLA (DeepSeek): the kernel wants one head dim; pad values, slice the output
            v = torch.nn.functional.pad(v, (0, q.shape[-1] - dim_v))
        if s_aux is None and not sliding_window and attention.supports(q, k, v):
            out = attention.attention(q, k, v, cu_seq_lens_q, max_length_q, scaling)  # (FA2 past its row limit)
        else:
            out = attention.flash_varlen(q, k, v, cu_seq_lens_q, int(max_length_q), scaling, sliding_window,
                                         s_aux is not None)
        if s_aux is not None:
            out, lse = out  # lse: (heads, T) float32
            out = (out.float() * torch.sigmoid(lse.transpose(0, 1) - s_aux.float()).unsqueeze(-1)).to(q.dtype)
        out = out[..., :dim_v]
    else:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        bounds = cu_seq_lens_q.tolist()
        out = torch.cat([_causal_sdpa(q[a:z], k[a:z], v[a:z], scaling, sliding_window, s_aux)
                         for a, z in zip(bounds[:-1], bounds[1:])])
    return out.unsqueeze(0), None  # (1, T, heads, dim): what transformers' attention functions return


def _causal_sdpa(q, k, v, scale, sliding_window, sinks=None):
    """One row's causal attention, (T, heads, dim) in and out; with `sinks`, softmax over the scores and one
    sink logit per head (GPT-OSS's eager attention, written out)."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    if sinks is not None:
        t = q.shape[1]
        i = torch.arange(t)
        keep = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :] < sliding_window) if sliding_window else True)
        scores = (q @ k.transpose(1, 2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        scores = scores.masked_fill(~keep, float("-inf"))
        logits = torch.cat([scores, sinks.reshape(-1, 1, 1).expand(-1, t, 1).to(scores.dtype)], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        return (probs.to(v.dtype) @ v).transpose(0, 1)
    if sliding_window:
        t = q.shape[1]
        i = torch.arange(t)
        mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < sliding_window)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.transpose(0, 1)
