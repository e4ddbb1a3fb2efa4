"""Config: layer specs and presets, YAML recipes, flag overrides, required fields."""

from __future__ import annotations

import argparse
import os

import pytest

from hsx.config import ExtractConfig, HsxError, load_config, parse_layer_spec, preset_layers, resolve_layers

DEPTHS = (8, 36, 64, 94)


def dflash_formula(n: int, k: int) -> list[int]:
    if k == 1:
        return [n // 2]
    return [round(1 + j * (n - 4) / (k - 1)) for j in range(k)]


# ---- presets --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", DEPTHS)
def test_eagle3_preset(n):
    layers, final = resolve_layers("eagle3", n, False)
    assert layers == [1, n // 2 - 1, n - 4]
    assert final is True


@pytest.mark.parametrize(("n", "expected"), [(8, [1, 3, 4]), (36, [1, 17, 32]), (64, [1, 31, 60]), (94, [1, 46, 90])])
def test_eagle3_preset_values(n, expected):
    assert resolve_layers("eagle3", n, False) == (expected, True)


@pytest.mark.parametrize("n", DEPTHS)
def test_dflash_is_dflash5(n):
    assert resolve_layers("dflash", n, False) == resolve_layers("dflash-5", n, False)
    assert resolve_layers("dflash", n, False)[0] == dflash_formula(n, 5)
    assert resolve_layers("dflash", n, False)[1] is False


@pytest.mark.parametrize(("n", "expected"), [
    (8, [1, 2, 3, 4, 5]),
    (36, [1, 9, 17, 25, 33]),
    (64, [1, 16, 31, 46, 61]),
    (94, [1, 24, 46, 68, 91]),  # Python's round: 23.5 -> 24, 68.5 -> 68
])
def test_dflash_values(n, expected):
    assert resolve_layers("dflash", n, False) == (expected, False)


@pytest.mark.parametrize("n", DEPTHS)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 6])
def test_dflash_k(n, k):
    expected = dflash_formula(n, k)
    if len(set(expected)) != len(expected):
        with pytest.raises(HsxError):
            resolve_layers(f"dflash-{k}", n, False)
        return
    layers, final = resolve_layers(f"dflash-{k}", n, False)
    assert layers == sorted(expected)
    assert final is False
    assert all(0 <= i < n for i in layers)


def test_dflash_1_is_middle():
    assert [resolve_layers("dflash-1", n, False)[0] for n in DEPTHS] == [[4], [18], [32], [47]]


def test_final_hidden_flag_kept_with_preset():
    assert resolve_layers("dflash-2", 8, True) == ([1, 5], True)
    assert preset_layers("dflash-2", 8) == ([1, 5], False)


@pytest.mark.parametrize("bad", ["dflash-0", "eagle", "dflash-x", "eagle3,1"])
def test_bad_preset_names_are_errors(bad):
    with pytest.raises(HsxError):
        resolve_layers(parse_layer_spec(bad), 8, False)


def test_preset_with_duplicates_is_an_error():
    with pytest.raises(HsxError, match="duplicate"):
        resolve_layers("dflash-8", 8, False)  # 1,2,2,3,... on 8 layers


# ---- layer lists ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [["1", "-1"], ["1,-1"], "1,-1", "1 -1", " 1, -1 ", [1, -1], ["1", "-1,"]])
def test_layer_spec_forms(spec):
    assert parse_layer_spec(spec) == [1, -1]
    assert resolve_layers(parse_layer_spec(spec), 8, False) == ([1, 7], False)


@pytest.mark.parametrize("spec", ["eagle3", ["eagle3"], "dflash-3", ["dflash"]])
def test_preset_spec_forms(spec):
    assert isinstance(parse_layer_spec(spec), str)


def test_layers_resolved_sorted_nonnegative():
    assert resolve_layers([5, -8, 2, -1], 8, False) == ([0, 2, 5, 7], False)
    assert resolve_layers(parse_layer_spec(3), 8, False) == ([3], False)


@pytest.mark.parametrize("spec", [[8], [-9], [0, 100], [1, -9]])
def test_out_of_range_layers_are_errors(spec):
    with pytest.raises(HsxError, match="out of range"):
        resolve_layers(spec, 8, False)


@pytest.mark.parametrize("spec", [[1, 1], [7, -1], [0, 3, -8]])
def test_duplicate_layers_are_errors(spec):
    with pytest.raises(HsxError, match="duplicate"):
        resolve_layers(spec, 8, False)


@pytest.mark.parametrize("spec", ["one", ["1", "x"], "1.5"])
def test_non_integer_layers_are_errors(spec):
    with pytest.raises(HsxError):
        parse_layer_spec(spec)


# ---- YAML and flags -------------------------------------------------------------------------------------------

def write(tmp_path, text):
    p = tmp_path / "recipe.yaml"
    p.write_text(text)
    return str(p)


BASE = "model: m\ndataset: d.jsonl\noutput_dir: out\n"


@pytest.mark.parametrize(("yaml_layers", "expected"), [
    ("[1, -1]", [1, -1]), ("'1,-1'", [1, -1]), ("1 -1", [1, -1]), ("eagle3", "eagle3"), ("3", [3]),
    ("\n  - 2\n  - -2", [2, -2]),
])
def test_yaml_layers(tmp_path, yaml_layers, expected):
    cfg = load_config(write(tmp_path, BASE + f"layers: {yaml_layers}\n"), {})
    assert cfg.layers == expected


def test_unknown_yaml_key_is_an_error(tmp_path):
    with pytest.raises(HsxError, match="layerz"):
        load_config(write(tmp_path, BASE + "layers: [1]\nlayerz: [2]\n"), {})


def test_yaml_that_is_not_a_mapping_is_an_error(tmp_path):
    with pytest.raises(HsxError):
        load_config(write(tmp_path, "- 1\n- 2\n"), {})


def test_flags_override_yaml(tmp_path):
    path = write(tmp_path, BASE + "layers: [1]\nmax_length: 512\nfinal_hidden: true\nsplit: validation\n")
    cfg = load_config(path, {"max_length": 128, "final_hidden": False, "layers": ["2", "-1"], "split": None})
    assert cfg.max_length == 128
    assert cfg.final_hidden is False  # an explicit False overrides
    assert cfg.layers == [2, -1]
    assert cfg.split == "validation"  # None means "not given"


def test_defaults_need_only_four_fields():
    cfg = load_config(None, {"model": "m", "dataset": "d", "layers": ["1"], "output_dir": "o"})
    assert (cfg.split, cfg.max_length, cfg.final_hidden, cfg.strict) == ("train", 4096, False, False)
    assert cfg.storage_dtype == "bfloat16"


@pytest.mark.parametrize("missing", ["model", "dataset", "layers", "output_dir"])
def test_required_fields(missing):
    values = {"model": "m", "dataset": "d", "layers": ["1"], "output_dir": "o"}
    values.pop(missing)
    with pytest.raises(HsxError, match=missing.replace("_", "-")):
        load_config(None, values)


@pytest.mark.parametrize(("key", "value"), [("max_length", 0), ("dtype", "int8"), ("storage_dtype", "int4"),
                                            ("token_budget", 0), ("compile", "maybe"),
                                            ("chat_template_kwargs", "{not json")])
def test_bad_values_are_errors(key, value):
    values = {"model": "m", "dataset": "d", "layers": ["1"], "output_dir": "o", key: value}
    with pytest.raises(HsxError):
        load_config(None, values)


def test_chat_template_kwargs_json_flag():
    cfg = load_config(None, {"model": "m", "dataset": "d", "layers": ["1"], "output_dir": "o",
                             "chat_template_kwargs": '{"enable_thinking": false}'})
    assert cfg.chat_template_kwargs == {"enable_thinking": False}


# ---- recipe-relative paths --------------------------------------------------------------------------------------

@pytest.fixture
def recipe_tree(tmp_path, monkeypatch):
    """tmp/project/{recipes/r.yaml, data/d.jsonl, models/m/}, and a working directory elsewhere."""
    proj = tmp_path / "project"
    (proj / "recipes").mkdir(parents=True)
    (proj / "data").mkdir()
    (proj / "data" / "d.jsonl").write_text("{}\n")
    (proj / "models" / "m").mkdir(parents=True)
    (proj / "recipes" / "local.jsonl").write_text("{}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return proj


def test_recipe_paths_resolve_against_the_recipe_from_anywhere(recipe_tree):
    recipe = recipe_tree / "recipes" / "r.yaml"
    recipe.write_text("model: ../models/m\ntokenizer: ../models/m\ndataset: ../data/d.jsonl\nlayers: [1]\n"
                      "output_dir: out\n")
    cfg = load_config(str(recipe), {})
    assert cfg.model == cfg.tokenizer == str(recipe_tree / "models" / "m")  # normalized: no "recipes/.."
    assert cfg.dataset == str(recipe_tree / "data" / "d.jsonl")
    assert cfg.output_dir == "out"  # the output is where the user runs, not next to the recipe


def test_recipe_paths_without_a_leading_dot(recipe_tree):
    recipe = recipe_tree / "recipes" / "r.yaml"
    recipe.write_text("model: Org/hub-model\ndataset: local.jsonl\nlayers: [1]\noutput_dir: out\n")
    cfg = load_config(str(recipe), {})
    assert cfg.dataset == str(recipe_tree / "recipes" / "local.jsonl")
    assert cfg.model == "Org/hub-model"  # exists nowhere: a Hub id, left as written


def test_recipe_paths_relative_recipe_and_cwd_first(recipe_tree, monkeypatch):
    monkeypatch.chdir(recipe_tree)
    recipe = recipe_tree / "recipes" / "r.yaml"
    recipe.write_text("model: ../models/m\ndataset: data/d.jsonl\nlayers: [1]\noutput_dir: out\n")
    cfg = load_config("recipes/r.yaml", {})
    assert cfg.model == os.path.join("models", "m")  # recipes/../models/m, normalized, still relative
    assert cfg.dataset == "data/d.jsonl"  # exists from the working directory: as written
    # a flag is never rewritten
    cfg = load_config("recipes/r.yaml", {"dataset": "../data/d.jsonl"})
    assert cfg.dataset == "../data/d.jsonl"


def test_demo_recipe_paths(monkeypatch, tmp_path):
    from helpers import REPO

    recipe = REPO / "recipes" / "demo.yaml"
    monkeypatch.chdir(REPO)
    cfg = load_config("recipes/demo.yaml", {"output_dir": "o"})
    assert (cfg.model, cfg.dataset) == ("hsx/demo/tiny-qwen3", "hsx/demo/chat.jsonl")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(str(recipe), {"output_dir": "o"})
    assert cfg.model == str(REPO / "hsx" / "demo" / "tiny-qwen3")
    assert cfg.dataset == str(REPO / "hsx" / "demo" / "chat.jsonl")
    assert os.path.isdir(cfg.model) and os.path.isfile(cfg.dataset)


def test_to_dict_round_trips():
    cfg = ExtractConfig(model="m", dataset="d", layers=[1], output_dir="o")
    assert ExtractConfig(**cfg.to_dict()) == cfg


# ---- typed values: every key parsed to its declared type, no coercion (recipes, flags, keyword options) --------

from hsx.config import CHOICES, FIELD_KINDS, check_config, check_topk_logits, config_from, read_recipe  # noqa: E402

BOOL_KEYS = [k for k, (kind, _) in FIELD_KINDS.items() if kind == "bool"]
REQUIRED = {"model": "m", "dataset": "d", "layers": [1], "output_dir": "o"}


def test_every_boolean_key_is_known():
    assert {"trust_remote_code", "overwrite", "final_hidden", "strict", "hub_private",
            "delete_after_upload"} <= set(BOOL_KEYS)


@pytest.mark.parametrize("key", BOOL_KEYS)
@pytest.mark.parametrize("text", ['"false"', "'true'", "no", "yes", "on", "off", "y", "n", "0", "1", "NO", "Off",
                                  "~", "[]"])
def test_a_boolean_is_only_an_unquoted_true_or_false(tmp_path, key, text):
    """`trust_remote_code: "false"` once ran the model's code, `overwrite: "false"` deleted a finished output and
    `final_hidden: "no"` wrote the final column: each is a string (truthy), a YAML 1.1 boolean or a number."""
    with pytest.raises(HsxError, match=f"config .*recipe.yaml: {key} must") as e:
        load_config(write(tmp_path, BASE + f"layers: [1]\n{key}: {text}\n"), {})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("text", "value"), [("true", True), ("false", False), ("True", True), ("FALSE", False)])
def test_yaml_booleans(tmp_path, text, value):
    cfg = load_config(write(tmp_path, BASE + f"layers: [1]\nfinal_hidden: {text}\nstrict: {text}\n"), {})
    assert cfg.final_hidden is value and cfg.strict is value


@pytest.mark.parametrize(("line", "key"), [
    ('max_length: "512"', "max_length"), ("max_length: 512.0", "max_length"), ("max_length: true", "max_length"),
    ("max_length: 0", "max_length"), ("max_length: null", "max_length"), ("limit: -1", "limit"),
    ("limit: 0", "limit"), ("limit: '10'", "limit"), ("token_budget: 1k", "token_budget"),
    ("topk_logits: -1", "topk_logits"), ("tp_size: 0", "tp_size"), ("num_proc: 0", "num_proc"),
    ("unit_tokens: 1:30", "unit_tokens"),  # YAML 1.1 would read sexagesimal 90
    ("model: [1, 2]", "model"), ("model: 123", "model"), ("split: true", "split"), ("model: null", "model"),
    ("revision: 2024-01-01", None),  # a date stays a string: accepted
    ("dtype: int8", "dtype"), ("storage_dtype: bf16", "storage_dtype"), ("compile: yes", "compile"),
    ("packing: [varlen]", "packing"), ("chat_template_kwargs: [1]", "chat_template_kwargs"),
    ("chat_template_kwargs: '{not json'", "chat_template_kwargs"),
    ('dataset: "a\\0b"', "dataset"),
])
def test_wrong_types_and_ranges_name_the_key(tmp_path, line, key):
    path = write(tmp_path, BASE.replace(f"{line.split(':')[0]}:", "#") + f"layers: [1]\n{line}\n")
    if key is None:
        assert load_config(path, {}).revision == "2024-01-01"
        return
    with pytest.raises(HsxError, match=key) as e:
        load_config(path, {})
    assert "\n" not in str(e.value)


def test_null_is_allowed_where_the_type_says_so(tmp_path):
    cfg = load_config(write(tmp_path, BASE + "layers: [1]\nlimit: null\ntoken_budget: ~\nrevision:\n"), {})
    assert (cfg.limit, cfg.token_budget, cfg.revision) == (None, None, None)


@pytest.mark.parametrize("layers", ["[1, true]", "[1.5]", "[[1]]", "{a: 1}", "true", "1.0", "[]", "''",
                                    "dflash-1234567"])
def test_bad_yaml_layers_are_one_line(tmp_path, layers):
    with pytest.raises(HsxError, match="layers") as e:
        load_config(write(tmp_path, BASE + f"layers: {layers}\n"), {})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("content", [b"\x00\x01\x02\xff\xfe binary", b"model: \xff\xfe\n", b"- 1\n- 2\n",
                                     b"just a string\n", b"model: m\nmodel: n\n", b"a: &x [1]\nb: *x\n",
                                     b"[" * 5000 + b"]" * 5000, b"model: m\n---\nmodel: n\n", b"model: [unclosed\n",
                                     b"\tmodel: m\n"])
def test_a_recipe_that_is_not_a_yaml_mapping_is_one_line(tmp_path, content):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(content)
    with pytest.raises(HsxError, match="recipe.yaml") as e:
        read_recipe(str(path))
    assert "\n" not in str(e.value)


def test_a_huge_recipe_is_refused_unread(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(b"# " + b"x" * (2 << 20) + b"\n")
    with pytest.raises(HsxError, match="MiB"):
        read_recipe(str(path))


def test_yaml_integers_of_other_bases_and_strings_that_look_like_ints(tmp_path):
    cfg = load_config(write(tmp_path, BASE + "layers: [1]\nmax_length: 0x200\nsplit: '123'\n"), {})
    assert (cfg.max_length, cfg.split) == (512, "123")


def test_config_from_keyword_options_is_typed_like_a_recipe():
    cfg = config_from({**REQUIRED, "final_hidden": True, "limit": 5, "layers": "dflash"})
    assert (cfg.final_hidden, cfg.limit, cfg.layers) == (True, 5, "dflash")
    for bad in ({"trust_remote_code": "false"}, {"overwrite": 0}, {"max_length": "512"}, {"max_length": 512.0},
                {"layers": [1, True]}, {"model": ["m"]}, {"limit": -1}, {"storage_dtype": "int4"}, {"laers": [1]}):
        with pytest.raises(HsxError, match=next(iter(bad))):
            config_from({**REQUIRED, **bad})


def test_check_config_types_a_dataclass_built_in_python():
    """hsx.run.extract checks an ExtractConfig built directly, as Python code may."""
    with pytest.raises(HsxError, match="overwrite"):
        check_config(ExtractConfig(**REQUIRED, overwrite="false"))
    cfg = ExtractConfig(**{**REQUIRED, "layers": "1,-1"})
    assert check_config(cfg).layers == [1, -1]
    assert cfg.layers == "1,-1"  # the caller's config is left as it was


def test_topk_logits_is_bounded_by_the_vocabulary():
    check_topk_logits(100, 100)
    with pytest.raises(HsxError, match="vocabulary"):
        check_topk_logits(101, 100)


def test_flags_take_their_types_and_choices_from_the_config():
    from hsx.cli import build_parser

    parser = build_parser()
    base = ["extract", "--model", "m", "--dataset", "d", "--layers", "1", "--output-dir", "o"]
    for flag, value in (("--max-length", "512.5"), ("--limit", "ten"), ("--storage-dtype", "bf16"),
                        ("--compile", "yes"), ("--nonfinite", "drop")):
        with pytest.raises(SystemExit):
            parser.parse_args([*base, flag, value])
    args = parser.parse_args([*base, "--storage-dtype", "float8_e4m3", "--no-hub-private", "--limit", "3"])
    assert (args.storage_dtype, args.hub_private, args.limit) == ("float8_e4m3", False, 3)
    assert set(CHOICES) <= {k for k, (kind, _) in FIELD_KINDS.items() if kind == "str"}


@pytest.mark.parametrize("argv_tail", [["--limit", "-1"], ["--limit", "0"], ["--layers", ""],
                                       ["--layers", "dflash-999999999"], ["--chat-template-kwargs", "[1]"],
                                       ["--token-budget", "0"]])
def test_bad_flag_values_are_one_line(capsys, argv_tail):
    from hsx.cli import main

    argv = ["extract", "--model", "m", "--dataset", "d", "--output-dir", "o", "--layers", "1", *argv_tail]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("hsx: error: "), err


def test_every_config_key_has_help_and_its_metadata_is_what_is_checked():
    import dataclasses

    from hsx.config import MINIMUM, ExtractConfig, parse_value

    for f in dataclasses.fields(ExtractConfig):
        assert f.metadata.get("help", "").strip(), f"ExtractConfig.{f.name} has no help"
        assert set(f.metadata) <= {"help", "choices", "minimum", "maximum", "advanced"}, f.name
    assert CHOICES["storage_dtype"] == ("bfloat16", "float16", "float32", "float8_e4m3")
    assert MINIMUM["limit"] == 1 and MINIMUM["topk_logits"] == 0
    from hsx.config import FIELDS, MAXIMUM

    assert MAXIMUM["max_length"][0] == 2**31 - 1 and set(MAXIMUM) == set(FIELDS)
    for name, (most, _) in MAXIMUM.items():  # every integer key is held to its largest value
        if FIELD_KINDS[name][0] == "int":
            assert parse_value(name, most) == most
            with pytest.raises(HsxError, match="must be at most"):
                parse_value(name, most + 1)
    for name, choices in CHOICES.items():  # the metadata's choices are the ones a recipe is held to
        assert parse_value(name, choices[-1]) == choices[-1]
        with pytest.raises(HsxError, match="must be one of"):
            parse_value(name, choices[0] + "x")


def test_extract_help_shows_each_keys_help_default_and_choices():
    import dataclasses

    from hsx.cli import build_parser
    from hsx.config import ExtractConfig, default_of

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["extract"].format_help().split())  # unwrapped
    for f in dataclasses.fields(ExtractConfig):
        flag = "--" + f.name.replace("_", "-")
        start = text.index(f" {flag}", text.index("options:"))
        entry = text[start:start + len(flag) + 600]
        assert " ".join(f.metadata["help"].split()) in entry, f.name
        default = default_of(f.name)
        if isinstance(default, bool):
            assert f"(default: {'on' if default else 'off'})" in entry, f.name
        elif default not in (None, "", [], {}):
            assert f"(default: {default})" in entry, f.name
        if "choices" in f.metadata:
            assert flag + " {" + ",".join(f.metadata["choices"]) + "}" in entry, f.name
    assert "--storage-dtype {bfloat16,float16,float32,float8_e4m3}" in text  # (the check above can fail)


def test_bench_and_push_take_the_config_keys_help_default_and_choices():
    from hsx.cli import build_parser
    from hsx.config import FIELDS

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bench = {a.dest: a for a in sub.choices["bench"]._actions}
    for name in ("compile", "sdpa_backend", "packing", "storage_dtype", "experts_implementation", "fp8_gemm"):
        assert bench[name].choices == FIELDS[name].metadata["choices"], name
        assert bench[name].default == FIELDS[name].default, name
        assert FIELDS[name].metadata["help"] in bench[name].help, name
    assert bench["layers"].default == ["dflash"]
    push = {a.dest: a for a in sub.choices["push"]._actions}
    assert push["hub_private"].default is True and push["hub_revision"].default is None
    assert FIELDS["hub_private"].metadata["help"] in push["hub_private"].help


# ---- dataset_config: a dataset's named configuration ------------------------------------------------------------

def test_dataset_config_reads_the_named_configuration_of_a_folder(tmp_path):
    """`dataset_config` is `load_dataset(DATASET, NAME)`'s name: a Hub dataset's configuration, or one a local
    folder's README.md lists (a snapshot of a Hub dataset with configs); the name is part of the input's identity."""
    from hsx.inputs import input_fingerprint, load_input

    folder = tmp_path / "ds"
    for name, texts in (("easy", ["a"]), ("hard", ["b", "c"])):
        (folder / name).mkdir(parents=True)
        (folder / name / "rows.jsonl").write_text("".join(f'{{"text": "{t}"}}\n' for t in texts))
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: easy\n  data_files: easy/*.jsonl\n"
                                      "- config_name: hard\n  data_files: hard/*.jsonl\n---\n")
    base = {"model": "m", "dataset": str(folder), "output_dir": "o", "layers": [1]}
    hard, easy = config_from({**base, "dataset_config": "hard"}), config_from({**base, "dataset_config": "easy"})
    assert load_input(hard)["text"] == ["b", "c"] and load_input(easy)["text"] == ["a"]
    assert sorted(load_input(config_from(base))["text"]) == ["a", "b", "c"]  # without it: every file, as before
    ds = load_input(hard)
    assert input_fingerprint(hard, ds) != input_fingerprint(easy, ds)
    assert "config" not in input_fingerprint(config_from(base), ds)  # (jobs without it keep their fingerprint)
    with pytest.raises(HsxError, match="cannot read dataset .*nope"):
        load_input(config_from({**base, "dataset_config": "nope"}))
    with pytest.raises(HsxError, match="is a file; a configuration is one of a Hub dataset"):
        load_input(config_from({**base, "dataset": str(folder / "easy" / "rows.jsonl"), "dataset_config": "easy"}))


import json  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402

from helpers import LONG_DIGITS, assert_one_error_line, fault_argv, hsx_main, the_error_line  # noqa: E402
from hsx.config import parse_value  # noqa: E402


# ---- numbers: bounded, and too long for int() is one line ----------------------------------------------------------

@pytest.mark.parametrize("name, value", [("max_length", 99999999999999999999), ("token_budget", 99999999999999),
                                         ("unit_tokens", 2**40), ("limit", 10**30), ("topk_logits", 2**31),
                                         ("num_proc", 10**25), ("gpus_per_copy", 10**19)])
def test_an_integer_key_too_large_for_any_machine_is_one_line(name, value):
    with pytest.raises(HsxError, match=f"{name} must be at most"):
        parse_value(name, value)


def test_a_huge_max_length_in_a_recipe_is_one_usage_line(tmp_path, model4, small_chat_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_length: 99999999999999999999\n")
    rc, _, err = hsx_main(["extract", "--config", str(recipe), *fault_argv(model4.path, small_chat_path,
                                                                           tmp_path / "out")[1:]])
    assert rc == 2
    assert_one_error_line(rc, err, "max_length must be at most 2,147,483,647")


def test_a_recipe_with_a_number_too_long_is_one_line(tmp_path, capsys):
    from hsx.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"layers: [1]\nlimit: {LONG_DIGITS}\n")
    rc = main(["extract", "--config", str(recipe), "--model", "m", "--dataset", "d", "--output-dir",
               str(tmp_path / "o")])
    line = the_error_line(capsys.readouterr().err)
    assert rc == 2 and str(recipe) in line, line
    rc = main(["extract", "--model", "m", "--dataset", "d", "--layers", "1", "--output-dir", str(tmp_path / "o"),
               "--chat-template-kwargs", f'{{"x": {LONG_DIGITS}}}'])
    line = the_error_line(capsys.readouterr().err)
    assert rc == 2 and "chat_template_kwargs" in line, line


def test_a_huge_dflash_k_fails_before_building_anything():
    tracemalloc.start()
    t = time.perf_counter()
    with pytest.raises(HsxError, match="at most 33"):
        resolve_layers(parse_layer_spec("dflash-999999"), 36, False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.perf_counter() - t < 0.5 and peak < 1 << 20, peak  # no million-entry list was built
    with pytest.raises(HsxError, match="--layers"):
        parse_layer_spec("dflash-999999999")  # no model is that deep: refused as it is parsed


def test_layers_flag_with_a_huge_preset_or_nothing_is_one_line(tmp_path, model4, small_chat_path):
    for layers in (["dflash-999999999"], [""], ["dflash-99999"]):
        t = time.perf_counter()
        argv = ["extract", "--model", str(model4.path), "--dataset", str(small_chat_path), "--output-dir",
                str(tmp_path / "o"), "--layers", *layers]
        rc, _, err = hsx_main(argv)
        assert_one_error_line(rc, err, "layers", prefix="hsx: error: ")
        assert time.perf_counter() - t < 5


def test_topk_logits_above_the_vocabulary_is_one_line(tmp_path, model4, small_chat_path):
    argv = fault_argv(model4.path, small_chat_path, tmp_path / "o", "--topk-logits", "1000000")
    rc, _, err = hsx_main(argv)
    assert_one_error_line(rc, err, "--topk-logits 1000000", "vocabulary", prefix="hsx: error: ")
    assert not (tmp_path / "o" / "hsx.json").exists()


# ---- recipe files and paths ----------------------------------------------------------------------------------------

def test_a_recipe_that_is_a_fifo_or_a_folder_is_one_line(tmp_path, capsys):
    from hsx.cli import main

    os.mkfifo(tmp_path / "fifo.yaml")
    for recipe in (tmp_path / "fifo.yaml", tmp_path):
        rc = main(["extract", "--config", str(recipe), "--output-dir", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert rc == 2 and "is not a regular file" in the_error_line(err), err


def test_a_recipe_path_starting_with_tilde_is_under_home(tmp_path, monkeypatch):
    """`output_dir: ~/out` in a recipe wrote into a folder literally named `~` in the working directory."""
    from hsx.config import load_config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("output_dir: ~/out\nmodel: ~/models/m\ndataset: d.jsonl\nlayers: [1]\n")
    cfg = load_config(str(recipe), {})
    assert cfg.output_dir == str(tmp_path / "home" / "out") and cfg.model == str(tmp_path / "home" / "models" / "m")


# ---- chat_template_kwargs may not set what hsx passes --------------------------------------------------------------

@pytest.mark.parametrize("key", ["tokenize", "messages", "tools", "add_generation_prompt", "eos_token",
                                 "return_assistant_tokens_mask"])
def test_chat_template_kwargs_may_not_set_a_key_hsx_passes(tmp_path, model4, small_chat_path, key):
    argv = fault_argv(model4.path, small_chat_path, tmp_path / "out", "--chat-template-kwargs",
                      json.dumps({key: True, "enable_thinking": False}))
    rc, _, err = hsx_main(argv)
    assert rc == 2
    assert_one_error_line(rc, err, f"chat_template_kwargs may not set {key}")
    assert not (tmp_path / "out").exists()


def test_the_reserved_template_kwargs_cover_apply_chat_template(tokenizer):
    import inspect

    from transformers import PreTrainedTokenizerBase

    from hsx.config import RESERVED_TEMPLATE_KWARGS

    params = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"self", "kwargs"}
    assert params <= RESERVED_TEMPLATE_KWARGS
    assert set(tokenizer.special_tokens_map) <= RESERVED_TEMPLATE_KWARGS  # (what it passes the template too)


def test_every_config_key_is_listed_here():
    """The keys a recipe and the flags may set, each config's in its order: a new knob (or one gone) is a deliberate
    change to this list, reviewed with its docs, not a field that slips into a dataclass."""
    import dataclasses

    from hsx.config import RegenerateConfig

    assert [f.name for f in dataclasses.fields(ExtractConfig)] == [
        "model", "revision", "tokenizer", "dataset", "dataset_config", "split", "limit", "layers", "layers_from",
        "final_hidden", "topk_logits", "teacher_policy", "teacher_top_p", "teacher_temperature", "max_length",
        "chat_template_kwargs", "prompt_completion", "output_dir", "storage_dtype", "strict", "allow_empty",
        "push_to_hub", "push_mode", "delete_after_upload", "hub_private", "hub_revision", "hub_overwrite",
        "max_pending_gb", "elastic", "nonfinite", "overwrite", "check_crc", "dtype", "attn_implementation",
        "sdpa_backend", "experts_implementation", "fp8_gemm", "packing", "gpus_per_copy", "tp_size", "ep_size",
        "token_budget", "unit_tokens", "compile", "num_proc", "trust_remote_code"]
    assert [f.name for f in dataclasses.fields(RegenerateConfig)] == [
        "model", "tokenizer", "dataset", "dataset_config", "split", "limit", "allow_empty", "output_dir", "overwrite",
        "servers", "served_model_name", "concurrency", "timeout", "retries", "dtype", "trust_remote_code",
        "temperature", "top_p", "top_k", "max_new_tokens", "seed", "n", "turns", "rows", "enable_thinking",
        "chat_template_kwargs", "reasoning", "cut_answers", "unit_size"]
