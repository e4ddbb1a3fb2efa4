"""The dataset card (hsx.card): its YAML is what huggingface_hub and datasets read, and names exactly the files."""

from __future__ import annotations

import pytest
from datasets.utils.metadata import MetadataConfigs
from huggingface_hub import DatasetCard

from hsx.card import dataset_card
from hsx.sink import UNFINISHED, UNFINISHED_CARD

FILES = ["train-000-00000.arrow", "train-003-00001.arrow"]


def info_of(**changes) -> dict:
    info = {"counts": {"rows_in": 15, "rows_written": 12, "tokens_written": 3456, "skipped": {"empty_conversation": 1},
                       "truncated": 2}, "complete": True,
            "layers": [0, 1, 3], "hidden_size": 64, "storage_dtype": "bfloat16", "final_hidden": True,
            "config": {"dataset": "chat.jsonl", "split": "train"}, "fingerprint": "0123abcd", "model": "tiny",
            "hsx_version": "0.1.0", "num_model_layers": 4, "layer_convention": "layer i is decoder layer i",
            "max_length": 128, "files": [{"file": name, "bytes": 100, "crc32": "0000abcd"} for name in FILES]}
    return {**info, **changes}


def load_card(tmp_path, text: str) -> DatasetCard:
    path = tmp_path / "README.md"
    path.write_text(text)
    return DatasetCard.load(path)


def test_card_yaml_names_the_listed_files_as_the_train_split(tmp_path):
    card = load_card(tmp_path, dataset_card(info_of(), "hsx extract --config r.yaml"))
    assert card.data.configs == [{"config_name": "default", "description": "hsx job 0123abcd",
                                  "data_files": [{"split": "train", "path": [f"data/{n}" for n in FILES]}]}]
    assert card.data.hsx_fingerprint == "0123abcd" and card.data.tags == ["hsx", "hidden-states"]
    configs = MetadataConfigs.from_dataset_card_data(card.data)  # datasets' own reading of the block
    assert configs["default"]["data_files"] == [{"split": "train", "path": [f"data/{n}" for n in FILES]}]
    assert card.text.lstrip().startswith("# Hidden states of `tiny`")
    assert "layers **0, 1, 3** of 4" in card.text and "Produced by: `hsx extract --config r.yaml`" in card.text


def test_card_without_a_file_list_globs_the_units(tmp_path):
    card = load_card(tmp_path, dataset_card(info_of(files=[]), "hsx"))
    assert card.data.configs[0]["data_files"] == [{"split": "train", "path": "data/train-*.arrow"}]


@pytest.mark.parametrize("fingerprint", ["x\n---\nevil: 1", "a: b", "'quoted'", "#not a comment", ""])
def test_no_recorded_value_breaks_out_of_the_yaml(tmp_path, fingerprint):
    """hsx.json is read back (merge, push): whatever its fingerprint holds stays one string in the YAML."""
    card = load_card(tmp_path, dataset_card(info_of(fingerprint=fingerprint), "hsx"))
    data = card.data.to_dict()
    assert set(data) == {"configs", "tags"} | ({"hsx_fingerprint"} if fingerprint else set())
    assert data.get("hsx_fingerprint", "") == fingerprint
    assert data["configs"][0]["description"] == f"hsx job {fingerprint}"


def test_unfinished_card_points_at_a_file_that_does_not_exist(tmp_path):
    card = load_card(tmp_path, UNFINISHED_CARD)
    assert card.data.configs[0]["data_files"] == [{"split": "train", "path": UNFINISHED}]
