"""The suite's helpers, imported by test files (`from helpers import ...`) and by conftest.py's fixtures: tiny models
and datasets built in-process, reference comparisons, hsx runs in this process and in children. CPU only, offline
(conftest.py sets the environment before anything imports the Hugging Face libraries)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent

# A hand-checked multi-turn conversation with a system prompt (see test_data.py for the expected rendering).
HAND_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather today?"},
    {"role": "assistant", "content": "The weather today is sunny."},
    {"role": "user", "content": "And the river?"},
    {"role": "assistant", "content": "The river is quiet, and the water is warm."},
]
LONG_USER = " ".join(["The quick brown fox jumps over the lazy dog near the quiet river bank."] * 20)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


@dataclass
class TinyModel:
    path: Path  # save_pretrained folder (float32 safetensors + tokenizer)
    model: Any  # the float32 Qwen3ForCausalLM, eval mode (the reference)
    tokenizer: Any
    num_layers: int
    hidden: int
    _ref_models: dict = field(default_factory=dict, repr=False)

    def reference(self, ids: list[int], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The full-depth model on ONE sample, unpadded: {layer i: (T, hidden)} for every i, and 'final'.

        output_hidden_states[i+1] for i < N-1, a forward hook for the pre-norm output of layer N-1,
        hidden_states[N] (after the final norm) for 'final'."""
        model = self._ref_models.get(dtype)
        if model is None:
            model = self.model if dtype == torch.float32 else load_full(self.path, dtype)
            self._ref_models[dtype] = model
        n = self.num_layers
        captured: dict[str, torch.Tensor] = {}

        def hook(module, args, output):
            captured["last"] = output[0] if isinstance(output, tuple) else output

        handle = model.model.layers[n - 1].register_forward_hook(hook)
        try:
            with torch.no_grad():
                out = model(torch.tensor([list(ids)], dtype=torch.long), output_hidden_states=True, use_cache=False)
        finally:
            handle.remove()
        hs = out.hidden_states
        assert len(hs) == n + 1
        ref = {i: hs[i + 1][0].float() for i in range(n - 1)}
        ref[n - 1] = captured["last"][0].float()
        ref["final"] = hs[n][0].float()
        return ref


def make_cfg(model, layers, final_hidden: bool, dtype: str = "float32"):
    """The config of a model (anything with `.path`: a TinyModel, a test family) driven through the engine
    directly: no dataset or output dir is read."""
    from hsx.config import ExtractConfig

    return ExtractConfig(model=str(model.path), dataset="unused", final_hidden=final_hidden, output_dir="unused",
                         layers=layers if isinstance(layers, str) else list(layers), dtype=dtype, compile="off")


def as_table(ids_lists: list[list[int]], first_id: int = 0):
    """A tokenized batch as the engine takes it: sample ids from `first_id`, every token in the loss mask."""
    import pyarrow as pa

    return pa.table({
        "sample_id": pa.array(range(first_id, first_id + len(ids_lists)), pa.int64()),
        "input_ids": pa.array(ids_lists, pa.list_(pa.int32())),
        "loss_mask": pa.array([[1] * len(i) for i in ids_lists], pa.list_(pa.int8())),
        "num_tokens": pa.array([len(i) for i in ids_lists], pa.int32()),
    })


def load_full(path: Path, dtype: torch.dtype):
    """The full CausalLM from the saved folder in `dtype`, as a user would load it (buffers such as rotary
    inv_freq stay float32, unlike `.to(dtype)`)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def save_tiny_model(root: Path, tokenizer, num_layers: int, hidden: int = 64, seed: int = 0) -> TinyModel:
    from hsx.demo import build_model

    model = build_model(tokenizer, num_layers=num_layers, hidden_size=hidden, dtype=torch.float32, seed=seed)
    model.save_pretrained(root, safe_serialization=True)
    tokenizer.save_pretrained(root)
    return TinyModel(path=root, model=model, tokenizer=tokenizer, num_layers=num_layers, hidden=hidden)


# ---- datasets --------------------------------------------------------------------------------------------------

@dataclass
class ChatData:
    path: Path
    rows: list[dict[str, Any]]
    skip: dict[int, str]  # sample_id -> expected skip reason (before the max_length cut)


def mixed_chat_rows() -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Good chat rows of many lengths plus one row per bad-input case, interleaved."""
    from hsx.demo import chat_rows

    good = chat_rows(28, seed=7)[:28]
    rows: list[dict[str, Any]] = [{"messages": HAND_CONVERSATION}]
    rows += good[:10]
    skip: dict[int, str] = {}

    def bad(row, reason):
        skip[len(rows)] = reason
        rows.append(row)

    bad({"messages": []}, "empty_conversation")
    bad({"messages": [{"role": "user", "content": "Is anyone there?"}]}, "no_assistant_turn")
    bad({"messages": [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": None}]},
        "null_content")
    bad({"messages": None}, "missing_value")
    rows += good[10:20]
    # Long prompt, then the answer: the answer falls after max_length -> nothing supervised is left.
    bad({"messages": [{"role": "user", "content": LONG_USER}, {"role": "assistant", "content": "Yes."}]},
        "no_supervised_tokens_after_truncation")
    # Long answer: truncated but usable.
    rows.append({"messages": [{"role": "user", "content": "Tell me about the fox."},
                              {"role": "assistant", "content": LONG_USER}]})
    rows += good[20:]
    return rows, skip



@dataclass
class Expected:
    rows: dict[int, tuple[list[int], list[int], bool]]  # usable sample_id -> (input_ids, loss_mask, truncated)
    skip: dict[int, str]  # sample_id -> skip reason
    skip_counts: dict[str, int]
    truncated: int


def expected_tokenization(chat: ChatData, tokenizer, max_length: int) -> Expected:
    """What hsx should make of `chat` rows, computed straight from the tokenizer (generation markers)."""
    rows, skip = {}, dict(chat.skip)
    for sid, row in enumerate(chat.rows):
        if sid in skip:
            continue
        enc = tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(enc["input_ids"])[:max_length], list(enc["assistant_masks"])[:max_length]
        truncated = len(enc["input_ids"]) > max_length
        if not any(mask):
            skip[sid] = "no_supervised_tokens_after_truncation" if truncated else "no_supervised_tokens"
            continue
        rows[sid] = (ids, mask, truncated)
    counts: dict[str, int] = {}
    for r in skip.values():
        counts[r] = counts.get(r, 0) + 1
    return Expected(rows=rows, skip=dict(sorted(skip.items())), skip_counts=dict(sorted(counts.items())),
                    truncated=sum(t for _, _, t in rows.values()))


def bucket_of(num_tokens: np.ndarray, max_length: int) -> np.ndarray:
    from hsx.buckets import bucket_bounds

    return np.searchsorted(bucket_bounds(max_length), num_tokens, side="left")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.float(), ref.float()
    return float(torch.linalg.norm(got - ref) / torch.linalg.norm(ref))


def bf16_ulps(got_bf16: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place between stored bf16 values and a float reference rounded to bf16
    (bf16 bit patterns are monotonic within a sign; values within 1e-6 of zero count as equal)."""
    a = got_bf16.to(torch.bfloat16).view(torch.int16).to(torch.int64)
    r = ref.to(torch.bfloat16)
    b = r.view(torch.int16).to(torch.int64)
    # map sign-magnitude bit patterns onto a monotonic integer line
    a = torch.where(a < 0, -(a & 0x7FFF), a)
    b = torch.where(b < 0, -(b & 0x7FFF), b)
    d = (a - b).abs()
    tiny = (got_bf16.float() - ref.float()).abs() <= 1e-6
    return torch.where(tiny, torch.zeros_like(d), d)


# ---- fault injection and multi-process runs (test_faults.py, test_distributed.py) ------------------------------
# One job, run many ways: model4, the shipped demo chat (99 rows, 3 unusable), layers 1 and -1 plus the final norm,
# units of ~400 tokens (~55 units, so kill points land between and inside units). The reference is an
# uninterrupted 1-process run in this process; every other run must give the same rows, bit for bit (CPU, one
# intra-op thread everywhere: subprocesses get OMP_NUM_THREADS=1, in-process runs torch.set_num_threads(1)).


FAULT_UNIT_TOKENS = 400
_PROGRESS = re.compile(r"\d+%\|| \d+ examples \[|(it|examples|tok)/s[\],]|^\s*$")


def fault_argv(model_path, dataset, out, *extra: str) -> list[str]:
    """`hsx extract` argv (without the program) of the fault and multi-process tests."""
    return ["extract", "--model", str(model_path), "--dataset", str(dataset), "--layers", "1", "-1",
            "--final-hidden", "--output-dir", str(out), "--unit-tokens", str(FAULT_UNIT_TOKENS),
            "--token-budget", "1024", "--compile", "off", *extra]


@contextlib.contextmanager
def one_torch_thread():
    """In-process runs compute with one intra-op thread, like the subprocesses (OMP_NUM_THREADS=1): same kernels,
    same bits, and no fight over the 2 shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def hsx_main(argv: list[str]) -> tuple[int, str, str]:
    """`hsx ...` in this process: (exit code, stdout, stderr)."""
    from hsx.cli import main

    out, err = io.StringIO(), io.StringIO()
    with one_torch_thread(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def message_lines(err: str) -> list[str]:
    """stderr without progress bars."""
    return [line for line in re.split(r"[\r\n]+", err) if line.strip() and not _PROGRESS.search(line)]


def assert_one_error_line(rc: int, err: str, *needles: str, prefix: str = "hsx: error: ") -> str:
    """A failed command's stderr is one line (progress bars aside), starting with `prefix`, holding `needles`."""
    assert rc != 0
    assert "Traceback" not in err, err
    lines = message_lines(err)
    assert len(lines) == 1, lines
    assert lines[0].startswith(prefix), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def the_error_line(err: str) -> str:
    """The one `hsx: error:` (or `hsx: verify failed:`) line of a command's stderr, which holds no traceback; other
    `hsx:` lines (warnings, progress) may come with it."""
    assert "Traceback" not in err, err[-2000:]
    lines = [line for line in message_lines(err) if line.startswith("hsx: ")]
    errors = [line for line in lines if line.startswith(("hsx: error: ", "hsx: verify failed: "))]
    assert len(errors) == 1, err[-2000:]
    return errors[0]


def child_env(**extra: str) -> dict[str, str]:
    """Environment of an hsx subprocess: offline, one thread per process, no leftover launcher variables."""
    env = dict(os.environ)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_CPU"):
        env.pop(k, None)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
                "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"})
    # This checkout's hsx, not the one installed (editable from another worktree, say): children run elsewhere.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    kids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4, after "pid (comm) state"
                kids.append(int(p.name))
    return kids


def descendants(pid: int) -> list[int]:
    todo, found = [pid], []
    while todo:
        for kid in child_pids(todo.pop()):
            if kid not in found:
                found.append(kid)
                todo.append(kid)
    return found


class Child:
    """A subprocess in its own session (so the whole tree can be killed), output to files (no pipe to drain)."""

    def __init__(self, cmd: list[str], logs: Path, env: dict[str, str] | None = None, cwd: Path | None = None):
        logs.mkdir(parents=True, exist_ok=True)
        self.stdout_path, self.stderr_path = logs / "stdout.txt", logs / "stderr.txt"
        self._files = (open(self.stdout_path, "w"), open(self.stderr_path, "w"))
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._files[0], stderr=self._files[1], env=env or child_env(),
                                      cwd=cwd or logs, start_new_session=True)

    def poll_until(self, predicate, timeout: float = 120.0, every: float = 0.005) -> bool:
        """Wait for predicate() (True) or for the process to end (False)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate():
                return True
            if self.proc.poll() is not None:
                return bool(predicate())
            time.sleep(every)
        raise AssertionError(f"timed out after {timeout} s waiting for a condition; stderr:\n{self.stderr}")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill_tree(self, sig: int = 9) -> None:
        """`sig` to the process and every descendant (torchrun/accelerate start each worker in its own session,
        so the launcher's process group alone would leave the workers running)."""
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def wait(self, timeout: float = 180.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_tree()
            self.proc.wait(30)
            raise AssertionError(f"did not end within {timeout} s; stderr:\n{self.stderr}") from None
        finally:
            for f in self._files:
                f.close()

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def hsx_child(argv: list[str], logs: Path, **env: str) -> Child:
    return Child([sys.executable, "-m", "hsx", *argv], logs, env=child_env(**env))


def manifest_records(out: Path) -> list[dict[str, Any]]:
    """Every parseable line of every rank's manifest."""
    recs = []
    for m in sorted((Path(out) / ".hsx").glob("manifest-*.jsonl")):
        for line in m.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                recs.append(json.loads(line))
    return recs


def committed_units(out: Path) -> int:
    try:
        return len(manifest_records(out))
    except OSError:
        return 0


def assert_units_intact(out: Path) -> list[dict[str, Any]]:
    """Every unit a manifest records is there, with the recorded size and CRC-32, and recorded once."""
    from hsx.checksums import file_crc32

    recs = manifest_records(out)
    names = [r["unit"] for r in recs]
    assert len(names) == len(set(names)), f"a unit is recorded twice: {sorted(names)}"
    for r in recs:
        f = Path(out) / "data" / r["file"]
        assert f.exists(), f"{r['file']} is in the manifest but not in data/"
        assert f.stat().st_size == r["bytes"], r
        # (a unit `hsx merge` linked is read where its link points: file_crc32 follows no link)
        assert file_crc32(Path(os.path.realpath(f))) == r["crc32"], f"{r['file']}: CRC-32 differs from the manifest"
    return recs


def is_complete(out: Path) -> bool:
    f = Path(out) / "hsx.json"
    try:
        return bool(json.loads(f.read_text()).get("complete"))
    except (OSError, json.JSONDecodeError):
        return False


def _states(col) -> np.ndarray:
    import pyarrow.compute as pc

    return pc.list_flatten(pc.list_flatten(col)).to_numpy(zero_copy_only=False).astype(np.int16)


def output_table(out: Path):
    """data/train-*.arrow of an output dir (Arrow IPC streams, as `datasets` writes them) in file-name order,
    which is output order, as one pyarrow Table."""
    import pyarrow as pa

    tables = []
    for f in sorted((Path(out) / "data").glob("train-*.arrow")):
        with pa.memory_map(str(f)) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    assert tables, f"{out}: no data files"
    return pa.concat_tables(tables)


def _without(table, sample_ids):
    import pyarrow as pa
    import pyarrow.compute as pc

    if not sample_ids:
        return table
    return table.filter(pc.invert(pc.is_in(table.column("sample_id"),
                                           value_set=pa.array(sorted(sample_ids), pa.int64()))))


def assert_same_output(out: Path, ref: Path, drop=(), ignore_states=(), exact: bool = True,
                       rel_tol: float = 1e-2) -> None:
    """The rows of `out` are the rows of `ref` (less the sample_ids in `drop`): same sample_ids in the same order,
    same input_ids / loss_mask / num_tokens, states bit-identical (or, with exact=False, each row's states within
    `rel_tol` relative Frobenius error of the reference row's, the bound `hsx verify` and the architecture tests hold
    bf16 to) except for the rows in `ignore_states`. Bit-identity holds only where the maths had the same shapes:
    CPU and GPU matmul kernels pick their blocking, and so the order of a sum, from the operands' shapes."""
    got, want = output_table(out), _without(output_table(ref), drop)
    ids = got.column("sample_id").to_pylist()
    assert len(ids) == len(set(ids)), "a sample_id repeats"
    assert ids == want.column("sample_id").to_pylist(), "sample_ids differ (or their order)"
    for c in ("input_ids", "loss_mask", "num_tokens"):
        assert got.column(c).equals(want.column(c)), f"column {c} differs"
    got, want = _without(got, ignore_states), _without(want, ignore_states)
    state_cols = [c for c in want.column_names if c in ("hidden_states", "final_hidden_state")]
    assert [c for c in got.column_names if c in ("hidden_states", "final_hidden_state")] == state_cols
    for c in state_cols:
        if got.column(c).equals(want.column(c)):
            continue
        a, b = _states(got.column(c)), _states(want.column(c))
        assert a.shape == b.shape, c
        assert not exact, f"column {c}: states differ in {(a != b).sum()} of {a.size} values (expected bit-identical)"
        ids = got.column("sample_id").to_pylist()
        for i, sid in enumerate(ids):
            x = torch.from_numpy(_states(got.column(c).slice(i, 1))).view(torch.bfloat16).float()
            y = torch.from_numpy(_states(want.column(c).slice(i, 1))).view(torch.bfloat16).float()
            err = rel_err(x, y)
            assert err <= rel_tol, f"column {c}, sample_id {sid}: relative error {err:.3g} over {rel_tol:g}"


@dataclass
class FaultReference:
    model: TinyModel
    dataset: Path
    out: Path
    info: dict
    sample_ids: list[int]

    def argv(self, out: Path, *extra: str) -> list[str]:
        return fault_argv(self.model.path, self.dataset, out, *extra)

    @property
    def units(self) -> int:
        return int(self.info["units"])


def assert_equals_reference(out: Path, ref: FaultReference, verify: bool = True,
                            world_size: int | None = None, exact: bool = True) -> None:
    """The finished `out` is the reference: rows, counts, units, manifests; `hsx verify OUT --samples 2` passes.
    States bit for bit, or with exact=False (rows computed at other batch shapes) within bf16 rounding."""
    info = json.loads((out / "hsx.json").read_text())
    assert info["complete"] is True
    assert info["counts"] == ref.info["counts"]
    assert info["units"] == ref.units and info["fingerprint"] == ref.info["fingerprint"]
    if world_size is not None:
        assert info["world_size"] == world_size
    assert sorted(p.name for p in (out / "data").iterdir()) == sorted(p.name for p in (ref.out / "data").iterdir())
    recs = assert_units_intact(out)
    assert sorted(r["unit"] for r in recs) == sorted(r["unit"] for r in manifest_records(ref.out))
    assert_same_output(out, ref.out, exact=exact)
    assert not (out / ".hsx" / "tmp").exists()  # finalize removed every rank's partial units
    if verify:
        rc, stdout, stderr = hsx_main(["verify", str(out), "--samples", "2"])
        assert rc == 0, stderr
        assert "is consistent" in stdout


def torn_manifest_copy(ref: FaultReference, out: Path) -> None:
    """A copy of the reference stopped half-way the way a kill or a full disk in the middle of appending a manifest
    line leaves it: units [0, k) recorded, unit k's file renamed into data/ but its line half written (no
    newline), the later units never written, no card, no hsx.json."""
    shutil.copytree(ref.out, out)
    (out / "hsx.json").unlink()
    (out / "README.md").unlink()
    manifest = out / ".hsx" / "manifest-00000.jsonl"
    lines = manifest.read_text().splitlines()
    k = len(lines) // 2
    manifest.write_text("\n".join(lines[:k]) + "\n" + lines[k][: len(lines[k]) // 2])
    for line in lines[k + 1:]:
        (out / "data" / json.loads(line)["file"]).unlink()


def chat_tokenize_peak(tok, conversations, fmt):
    """hsx.data.chat_tokenize of `conversations` (no kwargs, no tools) within the render bounds of a 64-token
    max_length, and the peak of Python's allocations (tracemalloc) while it ran: (rows, peak bytes)."""
    import tracemalloc

    from hsx import data, render

    tracemalloc.start()
    try:
        rows = data.chat_tokenize(tok, conversations, {}, None, fmt, render.render_char_limit(64))
        return rows, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def finished_argv(model, chat_path, out) -> list[str]:
    """The argv of finished_job's job with `out` as its output dir (run again on a copy: that copy's resume)."""
    return fault_argv(model.path, chat_path, out, "--unit-tokens", "200")


def finished_job(tmp_path_factory, model, chat_path, name: str) -> Path:
    """A finished extract of `chat_path` on `model` in 200-token units (conftest.py's `finished`)."""
    out = tmp_path_factory.mktemp(name) / "finished"
    rc, _, err = hsx_main(finished_argv(model, chat_path, out))
    assert rc == 0, err
    return out


def copy_of(finished: Path, tmp_path: Path, name: str = "out") -> Path:
    """A test's own copy of a finished output dir, as tmp_path/name (links kept as links)."""
    return Path(shutil.copytree(finished, tmp_path / name, symlinks=True))


# ---- damaging an output dir, and reading it under a deadline ----------------------------------------------------

LONG_DIGITS = "1" * 5000  # past Python's 4300-digit limit for int(str): json.loads and yaml raise a bare ValueError


def quiet(*a, **k) -> None:
    """A `log` that prints nothing."""


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file's bytes under `root` (lock files aside: taking a lock creates them)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(("lock", "busy"))}


def flip_unit_bytes(f: Path) -> None:
    """One byte of `f` changed in place: the same size, other bytes (a CRC-32 tells)."""
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def edit_info(out: Path, **changes) -> None:
    """`out`'s hsx.json with `changes` set at its top level."""
    info = json.loads((out / "hsx.json").read_text())
    info.update(changes)
    (out / "hsx.json").write_text(json.dumps(info))


def drop_manifest_line(out: Path, unit: str | None = None) -> str:
    """`unit`'s line (the first unit's by name, by default) taken out of `out`'s manifest, as a kill between a unit's
    file and its commit leaves it; that unit's name."""
    manifest = next((out / ".hsx").glob("manifest-*.jsonl"))
    lines = manifest.read_text().splitlines(keepends=True)
    unit = min(json.loads(ln)["unit"] for ln in lines) if unit is None else unit
    manifest.write_text("".join(ln for ln in lines if json.loads(ln)["unit"] != unit))
    return unit


def swap_for_link(f: Path, target: Path) -> None:
    """`f` replaced by a link to `target`, as an attacker does between hsx's check of a file and its open."""
    f.unlink()
    os.symlink(target, f)


def planted_secret(tmp_path: Path) -> Path:
    """A file outside any output (a token, say) that hsx must never read or upload through a link planted in one."""
    secret = tmp_path / "secret.txt"
    secret.write_text("hf_TopSecretTokenCCCCCCCCCCCCCCCCCCCC")
    return secret


def call_with_deadline(fn, seconds: float = 30.0, fifo: Path | None = None) -> tuple[bool, Any]:
    """fn() in a thread: (True, its result or the exception it raised) when it ends within `seconds`; (False, None)
    when it is still blocked, after opening `fifo` at both ends (which frees a reader or writer blocked opening it),
    so that a failing test ends instead of hanging."""
    import threading

    got: list = []

    def call():
        try:
            got.append(fn())
        except BaseException as e:  # noqa: BLE001
            got.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    if not t.is_alive():
        return True, got[0]
    if fifo is not None:
        fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        t.join(10)
        os.close(fd)
    return False, None
