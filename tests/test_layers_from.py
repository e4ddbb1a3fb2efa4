"""`--layers-from DRAFT`: a draft config in each peer's real format (keys as their checked-in configs and code
write them) gives the layers that peer's own code captures, in hsx's convention (decoder layer i's output); a
config hsx cannot read faithfully is one line naming the key, exit 2; hsx.json says where the layers came from.

Expected layers are the peers' own: SpecForge's checked-in configs (configs/qwen3-8b-dflash.json,
qwen3.6-27b-dspark.json, ...; SGLang captures "before layer id + 1", so its id is the 0-based layer), z-lab's
`extract_context_feature` (hidden_states[id + 1]) and `build_target_layer_ids`, speculators' converter from z-lab
(`i + 1 for i in target_layer_ids`: its ids count the embedding output as 0) and EAGLE's own hard-coded taps
(the inputs of layers 2, N//2, N-3)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import assert_one_error_line, hsx_main
from hsx.drafts import draft_layers
from hsx.errors import UsageError

QWEN3_8B = SimpleNamespace(num_hidden_layers=36, hidden_size=4096, vocab_size=151936)
QWEN36_27B = SimpleNamespace(num_hidden_layers=64, hidden_size=5120, vocab_size=248320)
LLAMA31_8B = SimpleNamespace(num_hidden_layers=32, hidden_size=4096, vocab_size=128256)

QWEN3_DRAFT = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 5, "vocab_size": 151936,
               "head_dim": 128, "num_attention_heads": 32, "num_key_value_heads": 8, "block_size": 16}


def write(tmp_path: Path, config: dict, name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


def test_specforge_dflash_config(tmp_path):
    # SpecForge configs/qwen3-8b-dflash.json
    cfg = {**QWEN3_DRAFT, "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
           "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
           "num_target_layers": 36}
    d = draft_layers(write(tmp_path, cfg), QWEN3_8B)
    assert (d.layers, d.final_hidden) == ([1, 9, 17, 25, 33], False)
    assert d.record["key"] == "dflash_config.target_layer_ids" and d.record["format"] == "dflash-family (DFlash)"


def test_specforge_dspark_config_adds_the_final_norm_state(tmp_path):
    # SpecForge configs/qwen3.6-27b-dspark.json: DSpark's offline record adds target_last_hidden_states, which
    # SpecForge takes from SGLang's logits processor after the final norm
    cfg = {"architectures": ["DSparkDraftModel"], "auto_map": {"AutoModel": "dspark.DSparkDraftModel"},
           "dflash_config": {"attention_mode": "gqa", "markov_rank": 256, "mask_token_id": 248070,
                             "projector_type": "dspark", "target_layer_ids": [2, 17, 32, 47, 62]},
           "block_size": 16, "target_hidden_size": None, "hidden_size": 5120, "num_hidden_layers": 5,
           "num_target_layers": 64, "vocab_size": 248320, "model_type": "qwen3"}
    d = draft_layers(write(tmp_path, cfg), QWEN36_27B)
    assert (d.layers, d.final_hidden) == ([2, 17, 32, 47, 62], True)


def test_dflash2_config(tmp_path):
    # DFlash2's config keeps DFlash's nested dflash_config (selector fields beside target_layer_ids); the taps of
    # SpecForge's Qwen3.8-27B recipe, 64 layers
    cfg = {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": 5120, "vocab_size": 248320,
           "num_hidden_layers": 5, "num_target_layers": 64,
           "dflash_config": {"block_size": 16, "conv_group_size": 16, "conv_kernel_size": 4, "mask_token_id": 248070,
                             "selector_rank": 256, "selector_top_k": 16, "target_layer_ids": [5, 19, 33, 47, 61]}}
    d = draft_layers(write(tmp_path, cfg), QWEN36_27B)
    assert (d.layers, d.final_hidden) == ([5, 19, 33, 47, 61], False)
    assert d.record["format"] == "dflash-family (DFlash2)"


def test_zlab_dflash_config_without_ids_uses_zlabs_rule(tmp_path):
    # z-lab's DFlashDraftModel: dflash_config.get("target_layer_ids", build_target_layer_ids(num_target_layers,
    # num_hidden_layers)); SpecForge's configs/qwen3.6-27b-dflash.json writes the same list out
    cfg = {**QWEN3_DRAFT, "hidden_size": 5120, "vocab_size": 248320, "architectures": ["DFlashDraftModel"],
           "dflash_config": {"mask_token_id": 248070}, "num_target_layers": 64}
    d = draft_layers(write(tmp_path, cfg), QWEN36_27B)
    assert d.layers == [1, 16, 31, 46, 61] and "build_target_layer_ids" in d.record["rule"]


def test_specforge_eagle3_config(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [1, 17, 32]}, "hidden_size": 4096, "num_hidden_layers": 1,
        "vocab_size": 151936, "draft_vocab_size": 32000}
    d = draft_layers(write(tmp_path, cfg), QWEN3_8B)
    assert (d.layers, d.final_hidden) == ([1, 17, 32], True)


def test_eagle_own_config_has_no_list_and_gets_eagles_taps(tmp_path):
    # SafeAILab eagle/traineagle3/config.json: no layer key; modeling_llama_kv.py keeps the inputs of layers
    # idx == 2, N//2, N-3, i.e. the outputs of 1, N//2-1, N-4 (SpecForge's default too)
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "model_type": "llama",
           "num_hidden_layers": 1, "vocab_size": 128256, "draft_vocab_size": 32000}
    d = draft_layers(write(tmp_path, cfg), LLAMA31_8B)
    assert (d.layers, d.final_hidden) == ([1, 15, 28], True) and "rule" in d.record


def test_speculators_configs_count_the_embedding_as_zero(tmp_path):
    verifier = {"speculators_config": {"verifier": {"name_or_path": "Qwen/Qwen3-8B"}}}
    layer = {"hidden_size": 4096, "vocab_size": 151936, "model_type": "qwen3"}
    eagle3 = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
              "eagle_aux_hidden_state_layer_ids": [2, 18, 33], "transformer_layer_config": layer, **verifier}
    d = draft_layers(write(tmp_path, eagle3, "e.json"), QWEN3_8B)
    # plus vLLM's layer N (hsx's N-1, before the final norm): its data generation always adds the verifier state
    assert (d.layers, d.final_hidden) == ([1, 17, 32, 35], False)
    # speculators' DFlash converter turns z-lab's [1, 9, 17, 25, 33] into i + 1: the same layers come back
    dflash = {"speculators_model_type": "dflash", "aux_hidden_state_layer_ids": [2, 10, 18, 26, 34],
              "block_size": 16, "transformer_layer_config": layer, **verifier}
    assert draft_layers(write(tmp_path, dflash, "d.json"), QWEN3_8B).layers == [1, 9, 17, 25, 33, 35]
    dflash2 = {**dflash, "speculators_model_type": "dflash2", "selector_rank": 256, "selector_top_k": 16}
    assert draft_layers(write(tmp_path, dflash2, "d2.json"), QWEN3_8B).layers == [1, 9, 17, 25, 33, 35]
    dspark = {**dflash, "speculators_model_type": "dspark", "aux_hidden_state_layer_ids": None}
    d = draft_layers(write(tmp_path, dspark, "s.json"), QWEN3_8B)  # resolve_target_layer_ids' [2, N//2, N-3]
    assert d.layers == [1, 17, 32, 35] and "resolve_target_layer_ids" in d.record["rule"]


def test_a_checkpoint_folder_is_read_through_its_config(tmp_path):
    cfg = {**QWEN3_DRAFT, "architectures": ["DFlashDraftModel"], "num_target_layers": 36,
           "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33]}}
    write(tmp_path, cfg)
    assert draft_layers(str(tmp_path), QWEN3_8B).layers == [1, 9, 17, 25, 33]


@pytest.mark.parametrize("change, key", [
    ({"dflash_config": {"target_layer_ids": [9, 1, 17]}}, "dflash_config.target_layer_ids"),  # order
    ({"dflash_config": {"target_layer_ids": [1, 1, 17]}}, "dflash_config.target_layer_ids"),  # repeat
    ({"dflash_config": {"target_layer_ids": [1, 36]}}, "dflash_config.target_layer_ids"),  # out of range
    ({"dflash_config": {"target_layer_ids": [1, 35]}}, "dflash_config.target_layer_ids"),  # the final-norm output
    ({"dflash_config": {"target_layer_ids": "1,9"}}, "dflash_config.target_layer_ids"),
    ({"num_target_layers": 64}, "num_target_layers"),
    ({"vocab_size": 1000}, "vocab_size"),
    ({"hidden_size": 2048}, "hidden_size"),
    ({"dflash_config": [1, 2]}, "dflash_config"),
])
def test_an_inconsistent_config_names_its_key(tmp_path, change, key):
    cfg = {**QWEN3_DRAFT, "architectures": ["DFlashDraftModel"], "num_target_layers": 36,
           "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33]}, **change}
    with pytest.raises(UsageError) as e:
        draft_layers(write(tmp_path, cfg), QWEN3_8B)
    assert key in str(e.value) and "\n" not in str(e.value)


def test_a_speculators_embedding_index_is_refused(tmp_path):
    cfg = {"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": [0, 18, 33],
           "transformer_layer_config": {"hidden_size": 4096, "vocab_size": 151936}}
    with pytest.raises(UsageError, match="eagle_aux_hidden_state_layer_ids .*embedding output"):
        draft_layers(write(tmp_path, cfg), QWEN3_8B)


def test_cli_unknown_or_conflicting(tmp_path, model4):
    target = json.loads((model4.path / "config.json").read_text())  # a target's own config is no draft's
    rc, _, err = hsx_main(["plan", "--model", str(model4.path), "--layers-from", write(tmp_path, target)])
    assert rc == 2
    assert_one_error_line(rc, err, "not a draft config hsx knows", "dflash_config.target_layer_ids")
    rc, _, err = hsx_main(["plan", "--model", str(model4.path), "--layers-from", str(tmp_path / "nothing"),
                           "--layers", "1"])
    assert rc == 2
    assert_one_error_line(rc, err, "--layers and --layers-from")
    rc, _, err = hsx_main(["plan", "--model", str(model4.path), "--layers-from", str(tmp_path / "no" / "such")])
    assert rc == 2
    assert_one_error_line(rc, err, "--layers-from")


@pytest.mark.slow
def test_extract_records_where_the_layers_came_from(tmp_path, model4, small_chat_path):
    from hsx.load import read_info

    vocab = json.loads((model4.path / "config.json").read_text())["vocab_size"]
    draft = {"architectures": ["DSparkDraftModel"], "num_target_layers": 4, "hidden_size": 64,
             "vocab_size": vocab, "num_hidden_layers": 2,
             "dflash_config": {"projector_type": "dspark", "target_layer_ids": [0, 2]}}
    out = tmp_path / "out"
    rc, said, err = hsx_main(["extract", "--model", str(model4.path), "--dataset", str(small_chat_path),
                              "--layers-from", write(tmp_path, draft), "--output-dir", str(out), "--compile", "off"])
    assert rc == 0, err
    info = read_info(out)
    assert info.layers == [0, 2] and info.final_hidden  # DSpark: the taps and the final-norm state
    record = info.raw["layers_from"]
    assert record["key"] == "dflash_config.target_layer_ids" and record["ids"] == [0, 2]
    assert record["format"] == "dflash-family (DSpark)" and len(record["sha256"]) == 64


def test_a_hub_id_is_read_from_huggingface_hubs_cache_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--z-lab--Qwen3-8B-DFlash-b16"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    cfg = {**QWEN3_DRAFT, "architectures": ["DFlashDraftModel"], "num_target_layers": 36,
           "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33]}}
    write(repo / "snapshots" / commit, cfg)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    d = draft_layers("z-lab/Qwen3-8B-DFlash-b16", QWEN3_8B)
    assert d.layers == [1, 9, 17, 25, 33] and d.record["config"] == f"z-lab/Qwen3-8B-DFlash-b16@{commit}"
    with pytest.raises(UsageError, match="--layers-from z-lab/not-cached: cannot get its config.json"):
        draft_layers("z-lab/not-cached", QWEN3_8B)
