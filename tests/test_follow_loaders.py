"""hsx.follow under the loaders trainers really use: a plain DataLoader, accelerate's prepared loaders
(DataLoaderShard, DataLoaderDispatcher), torchdata's StatefulDataLoader (alone, and under accelerate's
use_stateful_dataloader=True), and a follow batch_size= that differs from the DataLoader's.

The bar, for each: a trainer killed inside steps and inside fetches, and started again, trains every row with the
default commit (a row may repeat, none is lost), and exactly once with the documented recipe (the rows in its last
checkpoint's "model" are every row, once). accelerate's loaders fetch one batch ahead of the step: the position
handed out is one batch past the position trained (the old recipe lost a batch per restart, the old default a unit
or two per kill).

The trainer (`train`) runs in this process with a kill simulated by an exception nothing in hsx catches (what is
on disk is all a killed trainer leaves: the ledger, the deleted units, the checkpoint), and, in the slow tests, as a
child that SIGKILLs itself at the same points.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch

import hsx
from hsx.errors import HsxError

WRAPPERS = ["plain", "shard", "dispatcher", "stateful", "accelerate-stateful", "mismatch"]
BATCH = 4  # rows per step (the fault reference: 96 rows in 40+ units)


class Killed(BaseException):
    """A simulated SIGKILL: nothing in hsx catches a BaseException, so only what is on disk survives."""


def die(how: str) -> None:
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise Killed


def loader_of(rows, wrapper: str, collate):
    from torch.utils.data import DataLoader

    if wrapper == "mismatch":  # hsx.follow(..., batch_size=BATCH) under a DataLoader of twice that
        return DataLoader(rows, batch_size=2 * BATCH, collate_fn=collate)
    if wrapper == "plain":
        return DataLoader(rows, batch_size=BATCH, collate_fn=collate)
    if wrapper == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(rows, batch_size=BATCH, collate_fn=collate)
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration

    AcceleratorState._reset_state(True)  # (several trainers in one test process)
    GradientState._reset_state()
    config = {"shard": {"dispatch_batches": False}, "dispatcher": {"dispatch_batches": True},
              "accelerate-stateful": {"use_stateful_dataloader": True}}[wrapper]  # (the last: a Dispatcher)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**config))
    return accelerator.prepare(DataLoader(rows, batch_size=BATCH, collate_fn=collate))


def train(out: str, log: str, ckpt: str, wrapper: str, recipe: bool, kill: str = "", how: str = "raise") -> None:
    """One trainer run over `out` (delete_consumed): each step "trains" its batch into the model (the list of its
    sample ids) and appends the ids to `log` (fsynced). `recipe`: commit="manual" and a checkpoint after every
    step (the model, and the position: `rows.state_dict(batch)`, or the stateful loader's state_dict()), committed
    once durable, restored at start (docs/follow.md); else the default commit. `kill`: "step:N" dies inside step
    N (before it returns), "fetch:N" inside the Nth batch fetch (its collate)."""
    kind, _, at = kill.partition(":")
    fetches = [0]

    def collate(rows):
        fetches[0] += 1
        if kind == "fetch" and fetches[0] == int(at):
            die(how)
        return hsx.collate(rows)

    rows = hsx.follow(out, delete_consumed=True, commit="manual" if recipe else "unit", poll_seconds=0.01,
                      batch_size=BATCH if wrapper == "mismatch" else None)
    loader = loader_of(rows, wrapper, collate)
    stateful = wrapper in ("stateful", "accelerate-stateful")
    model: list[int] = []
    if recipe and os.path.exists(ckpt):
        saved = torch.load(ckpt)
        model = saved["model"]
        (loader if stateful else rows).load_state_dict(saved["data"])
    for step, batch in enumerate(loader, 1):
        ids = batch["sample_id"].tolist()
        if kind == "step" and step == int(at):
            die(how)
        model += ids
        with open(log, "a") as f:
            f.write(json.dumps(ids) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if recipe:
            state = loader.state_dict() if stateful else rows.state_dict(batch)
            torch.save({"model": model, "data": state}, ckpt + ".tmp")
            with open(ckpt + ".tmp", "rb") as f:
                os.fsync(f.fileno())
            os.replace(ckpt + ".tmp", ckpt)
            rows.commit(state)
    if not recipe:
        rows.commit()  # the last batch: the loop asks for no row after it


def kills(seed: int) -> list[str]:
    """Three seeded kill points: inside a step, inside a fetch, inside a step (96 rows: 24 steps of 4, 12 of 8)."""
    rng = random.Random(seed)
    return [f"step:{rng.randint(2, 4)}", f"fetch:{rng.randint(2, 4)}", f"step:{rng.randint(1, 3)}"]


def run_all(tmp_path: Path, reference, wrapper: str, recipe: bool, seed: int, run) -> tuple[list[int], list[int]]:
    """The trainer killed at each of `kills(seed)` and started again each time, then run to the end: (the ids
    its steps trained, in the log; the model of its last checkpoint)."""
    out = tmp_path / "out"
    shutil.copytree(reference.out, out)
    log, ckpt = tmp_path / "trained.jsonl", tmp_path / "ckpt.pt"
    for kill in kills(seed):
        run(str(out), str(log), str(ckpt), wrapper, recipe, kill)
    run(str(out), str(log), str(ckpt), wrapper, recipe, "")
    assert not list((out / "data").glob("train-*.arrow"))  # every unit released at the end
    trained = [s for line in log.read_text().splitlines() for s in json.loads(line)]
    return trained, (torch.load(ckpt)["model"] if recipe else [])


def in_process(out, log, ckpt, wrapper, recipe, kill) -> None:
    if kill:
        with pytest.raises(Killed):
            train(out, log, ckpt, wrapper, recipe, kill)
    else:
        train(out, log, ckpt, wrapper, recipe, kill)


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("recipe", [False, True], ids=["default", "recipe"])
def test_kills_inside_steps_and_fetches_lose_no_row_and_the_recipe_trains_each_once(tmp_path, fault_reference,
                                                                                      wrapper, recipe):
    trained, model = run_all(tmp_path, fault_reference, wrapper, recipe, seed=WRAPPERS.index(wrapper),
                             run=in_process)
    everything = sorted(fault_reference.sample_ids)
    assert sorted(set(trained)) == everything  # nothing lost
    if recipe:
        assert sorted(model) == everything  # exactly once in what the checkpoint holds


def sigkilled(out, log, ckpt, wrapper, recipe, kill) -> None:
    from helpers import Child, child_env

    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from test_follow_loaders import "
            f"train; train({out!r}, {log!r}, {ckpt!r}, {wrapper!r}, {recipe!r}, {kill!r}, 'sigkill')")
    child = Child([sys.executable, "-c", code], Path(log).parent / f"child-{kill or 'end'}", env=child_env())
    rc = child.wait(timeout=300)
    assert rc == (-signal.SIGKILL if kill else 0), child.stderr


@pytest.mark.slow
@pytest.mark.parametrize("wrapper,recipe", [("shard", False), ("dispatcher", True), ("accelerate-stateful", True),
                                            ("mismatch", False)])
def test_sigkilled_trainers_under_accelerate_and_a_batch_size_mismatch(tmp_path, fault_reference, wrapper, recipe):
    trained, model = run_all(tmp_path, fault_reference, wrapper, recipe, seed=7, run=sigkilled)
    assert sorted(set(trained)) == sorted(fault_reference.sample_ids)
    if recipe:
        assert sorted(model) == sorted(fault_reference.sample_ids)
