"""An eighth round: an export's journal read a line at a time, the JSON files hsx reads from a model folder bounded
before they are parsed, `hsx verify --against-bf16` taking only a commit as a Hub model's revision, a slow tokenizer
refused before any row is tokenized, and a resume that changes how the states are computed (compile, kernels,
packing) said at resume and recorded in hsx.json."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from helpers import copy_of, fault_argv, finished_job, hsx_main, message_lines, write_jsonl

import hsx
from hsx.config import ExtractConfig, HsxError


def one_error_line(err: str) -> str:
    assert "Traceback" not in err, err[-2000:]
    errors = [line for line in message_lines(err) if line.startswith("hsx: error: ")]
    assert len(errors) == 1, err[-2000:]
    return errors[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, model4, small_chat_path) -> Path:
    return finished_job(tmp_path_factory, model4, small_chat_path, "round8")


@pytest.fixture
def out(finished, tmp_path) -> Path:
    return copy_of(finished, tmp_path)


# ---- the export journal: a line at a time ------------------------------------------------------------------------

def test_an_export_journal_line_longer_than_any_hsx_writes_is_refused_naming_it(out, tmp_path, monkeypatch):
    """The journal was read whole (up to 1 GiB) and split into lines; it is read a line at a time as the ledgers
    are, each line bounded (hsx.schema: a unit's files at most), so a line past that is one error naming the line."""
    import hsx.export
    from hsx.export import JOURNAL, export_specforge

    dest = tmp_path / "dest"
    export_specforge(out, dest, layout="dflash")
    journal = dest / JOURNAL
    token = json.loads(journal.read_text().splitlines()[0])["token"]
    longest = max(len(line) for line in journal.read_bytes().splitlines(keepends=True))
    monkeypatch.setattr(hsx.export, "MAX_JOURNAL_LINE_BYTES", longest + 10)
    export_specforge(out, dest, layout="dflash")  # (every line hsx wrote is within the bound: a resume)
    with open(journal, "a") as f:
        f.write(json.dumps({"token": token, "unit": "x", "skipped": 0, "files": {"a" * (longest + 10): [1, "0"]}})
                + "\n")
    number = len(journal.read_text().splitlines())
    with pytest.raises(HsxError, match=f"{JOURNAL}: line {number} is damaged: over {longest + 10:,} bytes"):
        export_specforge(out, dest, layout="dflash")


def test_the_journal_bounds_follow_from_the_counts():
    from hsx import schema

    assert schema.MAX_JOURNAL_LINE_BYTES >= schema.MAX_EXPORT_FILES_PER_UNIT * schema.EXPORT_FILE_ENTRY_BYTES
    assert schema.MAX_JOURNAL_BYTES >= schema.MAX_EXPORT_FILES * schema.EXPORT_FILE_ENTRY_BYTES
    entry = json.dumps({"hidden_states/hs_123456789.safetensors": [123456789012, "89abcdef:01234567"]})
    assert len(entry) < schema.EXPORT_FILE_ENTRY_BYTES


# ---- model folders: config.json and the checkpoint index, bounded ------------------------------------------------

def _big_json(path: Path, size: int, obj: dict) -> None:
    """A valid JSON object of at least `size` bytes (its padding in one key)."""
    path.write_text(json.dumps({**obj, "padding": "x" * size}))


@pytest.mark.parametrize("name,bound", [("config.json", "MAX_CONFIG_BYTES"),
                                        ("model.safetensors.index.json", "MAX_INDEX_BYTES")])
def test_a_model_folder_json_past_its_bound_is_refused_before_it_is_parsed(model4, tmp_path, monkeypatch, name,
                                                                            bound):
    """config.json and model.safetensors.index.json were read whole, whatever their size (json.loads of 1 GB of
    `[[],...]` takes ~20 GB): past a bound far above any real one, one line naming the file, nothing parsed."""
    import hsx.model

    model = Path(shutil.copytree(model4.path, tmp_path / "model"))
    monkeypatch.setattr(hsx.model, bound, 1 << 20)
    if name == "config.json":
        _big_json(model / name, 2 << 20, json.loads((model / name).read_text()))
    else:
        _big_json(model / name, 2 << 20, {"metadata": {}, "weight_map": {}})
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(hsx.model.json, "loads", lambda s, *a, **k: parsed.append(len(s)) or real_loads(s, *a, **k))
    cfg = ExtractConfig(model=str(model), dataset="d", layers=[1], output_dir="o", dtype="float32")
    with pytest.raises(HsxError, match=re.escape(str(model / name)) + r" is [\d,]+ bytes, more than any"):
        hsx.model.load_model(cfg, __import__("torch").device("cpu"))
    assert not [n for n in parsed if n > 1 << 20]


def test_a_model_folder_json_that_is_not_a_file_is_one_line(model4, tmp_path):
    import os

    model = Path(shutil.copytree(model4.path, tmp_path / "model"))
    (model / "model.safetensors.index.json").unlink(missing_ok=True)
    os.mkfifo(model / "model.safetensors.index.json")  # (read, it would wait forever)
    cfg = ExtractConfig(model=str(model), dataset="d", layers=[1], output_dir="o", dtype="float32")
    with pytest.raises(HsxError, match="model.safetensors.index.json is not a regular file"):
        hsx.model.load_model(cfg, __import__("torch").device("cpu"))


def test_real_sized_model_jsons_are_within_the_bounds():
    from hsx.model import MAX_CHECKPOINT_TENSORS, MAX_CONFIG_BYTES, MAX_INDEX_BYTES

    name = "model.language_model.layers.60.mlp.experts.383.down_proj.weight_scale_inv"
    entry = json.dumps({name: "model-01999-of-02000.safetensors"})
    assert MAX_INDEX_BYTES >= MAX_CHECKPOINT_TENSORS * len(entry) and MAX_CONFIG_BYTES >= 1 << 20


# ---- verify --against-bf16: a Hub model's revision is a commit -------------------------------------------------

def test_against_bf16_takes_only_a_commit_as_a_hub_models_revision(finished, tmp_path, model4):
    """hsx records a Hub model's commit (its snapshot folder's name, 40 hex digits) with its id; a record naming a
    branch or tag ("main") let any folder named `main` pass as that model's snapshot."""
    out = Path(shutil.copytree(finished, tmp_path / "out"))
    folder = Path(shutil.copytree(model4.path, tmp_path / "snap" / "main"))
    info = json.loads((out / "hsx.json").read_text())
    info["model_path"] = str(folder)
    (out / "hsx.json").write_text(json.dumps(info))
    job = json.loads((out / ".hsx" / "job.json").read_text())
    job["inputs"].update(model="someone/model", revision="main")
    (out / ".hsx" / "job.json").write_text(json.dumps(job))
    rc, _, err = hsx_main(["verify", str(out), "--against-bf16", "2"])
    line = one_error_line(err)
    assert rc != 0 and "job.json" in line and "40-digit hex" in line and "'main'" in line, line


# ---- a slow tokenizer: refused before any row is tokenized -----------------------------------------------------

def slow_tokenizer(template: str):
    """A word-level slow (Python) tokenizer: transformers' PreTrainedTokenizer, no tokenizer.json, no offsets."""
    from transformers import PreTrainedTokenizer

    words = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "hi", "ok", "\n", " "]

    class WordTokenizer(PreTrainedTokenizer):
        def __init__(self, **kwargs):
            self.vocab = {w: i for i, w in enumerate(words)}
            super().__init__(unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>"], **kwargs)

        @property
        def vocab_size(self):
            return len(self.vocab)

        def get_vocab(self):
            return dict(self.vocab)

        def _tokenize(self, text):
            return re.findall(r"\w+|\s|[^\w\s]", text)

        def _convert_token_to_id(self, token):
            return self.vocab.get(token, 0)

        def _convert_id_to_token(self, index):
            return words[index] if 0 <= index < len(words) else "<unk>"

    tok = WordTokenizer()
    tok.chat_template = template
    assert not tok.is_fast
    return tok


PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MARKERS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
           "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n"
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template,rows,extra,method", [
    (PLAIN, [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}], {},
     "derived"),
    (MARKERS, [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}], {},
     "markers"),
    (PLAIN, [{"prompt": "hi", "completion": "ok"}], {"prompt_completion": "text"}, "completion"),
])
def test_a_slow_tokenizer_is_refused_before_any_row_when_the_masks_need_offsets(tmp_path, template, rows, extra,
                                                                                 method):
    """Masks read off the chat template (derived turns, generation markers, plain completions) take character
    offsets from the tokenizer; a slow one has none (its encodings silently lack offset_mapping: a KeyError
    traceback from inside datasets.map, or from deriving the turns): one line naming the tokenizer and the fix."""
    from hsx import data

    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = ExtractConfig(model="slow-model", dataset=str(path), layers=[1], output_dir="o", **extra)
    with pytest.raises(HsxError, match=f"tokenizer slow-model is a slow .* the '{method}' loss masks .* "
                                       "tokenizer.json"):
        data.tokenize(data.load_input(cfg), slow_tokenizer(template), cfg, str(tmp_path / "t.arrow"),
                      fingerprint="test-slow")


def test_a_slow_tokenizer_still_tokenizes_text_rows(tmp_path):
    from hsx import data

    path = write_jsonl(tmp_path / "rows.jsonl", [{"text": "hi ok"}])
    cfg = ExtractConfig(model="slow-model", dataset=str(path), layers=[1], output_dir="o")
    rows = data.tokenize(data.load_input(cfg), slow_tokenizer(PLAIN), cfg, str(tmp_path / "t.arrow"),
                         fingerprint="test-slow-text")
    assert rows[0]["input_ids"] == [6, 9, 7] and rows[0]["loss_mask"] == [1, 1, 1]


# ---- a resume that computes otherwise: said, and recorded -------------------------------------------------------

def _resume(out: Path, model4, small_chat_path, *extra: str) -> tuple[dict, list[str]]:
    """Delete one unit of the finished `out` and run the job again (it redoes that unit) with `extra` flags."""
    next((out / "data").glob("train-*.arrow")).unlink()
    rc, stdout, err = hsx_main(fault_argv(model4.path, small_chat_path, out, "--unit-tokens", "200", *extra))
    assert rc == 0, err
    notices = [line for line in message_lines(stdout + "\n" + err) if line.startswith("hsx: notice:")]
    return json.loads((out / "hsx.json").read_text()), notices


def test_a_resume_with_other_packing_says_so_and_hsx_json_lists_every_value(out, model4, small_chat_path):
    """compile, sdpa_backend, packing and the kernels are outside the fingerprint (a resume may change them), and
    hsx.json's run kept only the last run's: an output of units packed and units padded said `packing varlen`.
    The resume says in one notice which key differs, and run.values_used lists every value its units ran with."""
    first = json.loads((out / "hsx.json").read_text())["run"]
    assert first["packing"] == "none" and first["values_used"]["packing"] == ["none"]
    info, notices = _resume(out, model4, small_chat_path, "--packing", "varlen")
    assert len(notices) == 1 and "packing varlen" in notices[0] and "packing none" in notices[0], notices
    assert "compile" not in notices[0]
    assert info["run"]["packing"] == "varlen"  # (the last run's, as readers always read it)
    assert info["run"]["values_used"]["packing"] == ["none", "varlen"]
    assert info["run"]["values_used"]["compile"] == [False]
    rc, _, err = hsx_main(["verify", str(out), "--samples", "0"])
    assert rc == 0, err
    hsx.load(str(out))


def test_a_resume_with_the_same_settings_says_nothing_and_lists_one_value(out, model4, small_chat_path):
    info, notices = _resume(out, model4, small_chat_path)
    assert notices == [] and info["run"]["values_used"]["packing"] == ["none"]


def test_units_of_an_hsx_that_kept_no_run_ledger_are_compared_with_hsx_json(out, model4, small_chat_path):
    """Units written before the run ledger: hsx.json's run (the last run's values) is what they ran with."""
    for ledger in (out / ".hsx").glob("runs-*.jsonl"):
        ledger.unlink()
    info = json.loads((out / "hsx.json").read_text())
    del info["run"]["values_used"]
    (out / "hsx.json").write_text(json.dumps(info))
    info, notices = _resume(out, model4, small_chat_path, "--packing", "varlen")
    assert len(notices) == 1 and "packing none" in notices[0], notices
    assert info["run"]["values_used"]["packing"] == ["none", "varlen"]


def test_a_damaged_run_ledger_is_one_line(out, model4, small_chat_path):
    (out / ".hsx" / "runs-00000.jsonl").write_text(json.dumps({"session": "x", "packing": ["a"] * 3}) + "\n")
    next((out / "data").glob("train-*.arrow")).unlink()
    rc, _, err = hsx_main(fault_argv(model4.path, small_chat_path, out, "--unit-tokens", "200"))
    line = one_error_line(err)
    assert rc != 0 and "runs-00000.jsonl: line 1 is damaged: packing must be" in line, line


def test_a_hub_ids_config_json_is_bounded_too(tmp_path, monkeypatch):
    """A Hub id's config.json (what `hsx plan` and the benchmark read by id) is checked in the HF cache before
    transformers parses it, as a folder's is."""
    import huggingface_hub

    import hsx.model

    snapshot = tmp_path / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    _big_json(snapshot / "config.json", 2 << 20, {"model_type": "llama", "num_hidden_layers": 2})
    monkeypatch.setattr(hsx.model, "MAX_CONFIG_BYTES", 1 << 20)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name, **k: str(snapshot / name))
    with pytest.raises(HsxError, match=re.escape(str(snapshot / "config.json")) + " is [\\d,]+ bytes, more than any"):
        hsx.model.read_model_config("someone/model", "someone/model", False)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 10**11}))
    with pytest.raises(HsxError, match="num_hidden_layers = 100000000000"):
        hsx.model.read_model_config("someone/model", "someone/model", False)
