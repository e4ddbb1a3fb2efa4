"""Config: layer specs and presets, YAML recipes, flag overrides, required fields."""

from __future__ import annotations

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
    from conftest import REPO

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
