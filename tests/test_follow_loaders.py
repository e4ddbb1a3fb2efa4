"""hsx.follow under the loaders trainers really use: a plain DataLoader, accelerate's prepared loaders
(DataLoaderShard, DataLoaderDispatcher), torchdata's StatefulDataLoader (alone, and under accelerate's
use_stateful_dataloader=True), HF Trainer (its gradient-accumulation window), and a follow batch_size= that differs
from the DataLoader's.

The bar, for each: a trainer killed inside steps and inside fetches, and started again, trains every row with the
default commit (a row may repeat, none is lost), and exactly once with the documented recipe (the rows in its last
checkpoint's "model" are every row, once). accelerate's loaders fetch one batch ahead of the step: the position
handed out is one batch past the position trained (the old recipe lost a batch per restart, the old default a unit
or two per kill).

The trainer (`train`) runs in this process with a kill simulated by an exception hsx does not catch and writes
nothing for on its way out (what is on disk is all a killed trainer leaves: the ledger, the deleted units, the
checkpoint), and, in the slow tests, as a child that SIGKILLs itself at the same points.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import hsx
from hsx.errors import HsxError

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated")  # (torchdata 0.11 on torch 2.13)
WRAPPERS = ["plain", "shard", "dispatcher", "stateful", "accelerate-stateful", "accelerate-stateful-shard", "mismatch"]
BATCH = 4  # rows per step (the fault reference: 96 rows in 40+ units)


class Killed(BaseException):
    """A simulated SIGKILL: hsx catches no such exception, so only what is on disk survives."""


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
              "accelerate-stateful": {"use_stateful_dataloader": True},  # (a Dispatcher: accelerate's default)
              "accelerate-stateful-shard": {"use_stateful_dataloader": True, "dispatch_batches": False}}[wrapper]
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**config))
    return accelerator.prepare(DataLoader(rows, batch_size=BATCH, collate_fn=collate))


def train(out: str, log: str, ckpt: str, wrapper: str, recipe: bool, kill: str = "", how: str = "raise",
          units_ahead: int | None = None) -> None:
    """One trainer run over `out` (delete_consumed; a grpc:// URL: over `hsx serve`, `units_ahead` read ahead):
    each step "trains" its batch into the model (the list of its sample ids) and appends the ids to `log`
    (fsynced). `recipe`: commit="manual" and a checkpoint after every step (the model, and the position:
    `rows.state_dict(batch)`, or the stateful loader's state_dict()), committed once durable, restored at start
    (docs/follow.md); else the default commit. `kill`: "step:N" dies inside step N (before it returns), "fetch:N"
    inside the Nth batch fetch (its collate)."""
    kind, _, at = kill.partition(":")
    fetches = [0]

    def collate(rows):
        fetches[0] += 1
        if kind == "fetch" and fetches[0] == int(at):
            die(how)
        return hsx.collate(rows)

    rows = hsx.follow(out, delete_consumed=True, commit="manual" if recipe else "unit", poll_seconds=0.01,
                      batch_size=BATCH if wrapper == "mismatch" else None,
                      **({} if units_ahead is None else {"units_ahead": units_ahead}))
    loader = loader_of(rows, wrapper, collate)
    stateful = wrapper.endswith("stateful") or wrapper.endswith("stateful-shard")
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


def run_all(tmp_path: Path, reference, wrapper: str, recipe: bool, seed: int, run,
            source=None) -> tuple[list[int], list[int]]:
    """The trainer killed at each of `kills(seed)` and started again each time, then run to the end: (the ids
    its steps trained, in the log; the model of its last checkpoint). `source(out)`: what the trainer is given
    to read OUT by (default: OUT's path)."""
    out = tmp_path / "out"
    shutil.copytree(reference.out, out)
    log, ckpt = tmp_path / "trained.jsonl", tmp_path / "ckpt.pt"
    given = str(out) if source is None else source(out)
    for kill in kills(seed):
        run(given, str(log), str(ckpt), wrapper, recipe, kill)
    run(given, str(log), str(ckpt), wrapper, recipe, "")
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


def sigkilled(out, log, ckpt, wrapper, recipe, kill, units_ahead=None) -> None:
    from helpers import Child, child_env

    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from test_follow_loaders import "
            f"train; train({out!r}, {log!r}, {ckpt!r}, {wrapper!r}, {recipe!r}, {kill!r}, 'sigkill', "
            f"{units_ahead!r})")
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


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("wrapper,recipe", [("shard", False), ("dispatcher", True), ("accelerate-stateful", True)])
def test_sigkilled_trainers_over_hsx_serve_with_units_read_ahead(tmp_path, fault_reference, wrapper, recipe):
    """The same kills, the trainer reading only over `hsx serve` with two units read ahead (on connections of their
    own, checked batch by batch): units read ahead and not handed out are never taken for consumed, and the server
    deletes only what the killed trainers' commits covered. (Each restart waits out its dead self's claim lease.)"""
    import functools

    from helpers import free_port, hsx_child

    port, servers = free_port(), []

    def serve(out: Path) -> str:
        servers.append(hsx_child(["serve", str(out), "--port", str(port)], tmp_path / "server"))
        return f"grpc://127.0.0.1:{port}"

    try:
        trained, model = run_all(tmp_path, fault_reference, wrapper, recipe, seed=11, source=serve,
                                 run=functools.partial(sigkilled, units_ahead=2))
    finally:
        for server in servers:
            server.kill_tree(signal.SIGKILL)
    assert sorted(set(trained)) == sorted(fault_reference.sample_ids)
    if recipe:
        assert sorted(model) == sorted(fault_reference.sample_ids)


# ---- HF Trainer (transformers): its accumulation window fetches ahead too ---------------------------------------

def hf_trainer(rows, work: Path, kill_at=None, ga: int = 2, dispatch=None, recipe: bool = False,
               ignore_data_skip: bool = True):
    """A Trainer over `rows` (hsx.collate batches of BATCH) whose model "trains" each micro-batch's ids
    (`model.trained`, once its optimizer step has returned; `model.pending` until then) and raises Killed in the
    forward numbered `kill_at`. `recipe`: the docs' Trainer recipe (a checkpoint every 2 steps holding
    `rows.state_dict(the batch trained last)`, committed once saved)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.pending, self.trained, self.calls = [], [], 0

        def forward(self, sample_id=None, **_):
            self.calls += 1
            if self.calls == kill_at:
                raise Killed
            self.pending += sample_id.tolist()
            return {"loss": (self.w ** 2).sum()}

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **_):
            model.trained += model.pending
            model.pending.clear()

    class FollowTrainer(Trainer):  # docs/follow.md's recipe: the batch trained last names the position
        def training_step(self, model, inputs, *args, **kwargs):
            self.hsx_batch = inputs
            return super().training_step(model, inputs, *args, **kwargs)

    class FollowCheckpoint(TrainerCallback):
        def on_save(self, args, state, control, model=None, **_):
            data = rows.state_dict(trainer.hsx_batch)
            torch.save({"model": model.trained, "data": data},
                       Path(args.output_dir) / f"checkpoint-{state.global_step}" / "hsx_follow.pt")
            rows.commit(data)

    args = TrainingArguments(output_dir=str(work), per_device_train_batch_size=BATCH, gradient_accumulation_steps=ga,
                             max_steps=1000, use_cpu=True, report_to=[], remove_unused_columns=False,
                             logging_strategy="no", disable_tqdm=True, ignore_data_skip=ignore_data_skip,
                             save_strategy="steps" if recipe else "no", save_steps=2,
                             accelerator_config={"dispatch_batches": dispatch})
    model = Model()
    trainer = FollowTrainer(model=model, args=args, train_dataset=rows, data_collator=hsx.collate,
                            callbacks=[Steps()] + ([FollowCheckpoint()] if recipe else []))
    return trainer, model


@contextmanager
def source_of(out: Path, where: str):
    """What a trainer follows for output dir `out`: its path ("local"), or the URL of an `hsx serve` of it (in a
    thread of this process, with a token) and that token ("serve")."""
    if where == "local":
        yield out, None
        return
    import threading

    from hsx.serve import make_server

    server = make_server(out, "127.0.0.1", 0, "trainer-token-0123456789")
    threading.Thread(target=server.serve, daemon=True).start()
    try:
        yield server.location, "trainer-token-0123456789"
    finally:
        server.shutdown()


@pytest.mark.parametrize("where", ["local", "serve"])
def test_hf_trainer_with_gradient_accumulation_loses_no_row_by_default(tmp_path, fault_reference, where):
    """The Trainer fetches its accumulation window (3 batches) before training the first: the old default
    recorded units of batches fetched but not trained (a kill lost 20 of 96 rows). The rows read from OUT or over
    `hsx serve`, each restart in this process (its killed reader still referenced)."""
    out = tmp_path / "out"
    shutil.copytree(fault_reference.out, out)
    with source_of(out, where) as (src, token):
        _trainer_default_loses_no_row(out, tmp_path, src, token, fault_reference)


def _trainer_default_loses_no_row(out, tmp_path, src, token, fault_reference):
    trained = []
    for kill_at, dispatch in ((7, None), (5, False), (None, False)):  # (the Dispatcher is Trainer's default)
        rows = hsx.follow(src, delete_consumed=True, poll_seconds=0.01, **({"token": token} if token else {}))
        trainer, model = hf_trainer(rows, tmp_path / "t", kill_at, ga=3, dispatch=dispatch)
        if kill_at:
            with pytest.raises(Killed):
                trainer.train()
        else:
            trainer.train()  # (to the end of the rows: a Dispatcher then finds an empty epoch: accelerate's error)
            rows.commit()
            trained += model.pending  # (a last window short of 3 batches: Trainer runs its steps, no optimizer step)
        trained += model.trained
    assert sorted(set(trained)) == sorted(fault_reference.sample_ids)
    assert not list((out / "data").glob("train-*.arrow"))


@pytest.mark.parametrize("where", ["local", "serve"])
def test_hf_trainer_recipe_resumes_exactly_once_and_a_resume_that_skips_batches_is_refused(tmp_path,
                                                                                          fault_reference, where):
    """The docs' Trainer recipe, the rows read from OUT or over `hsx serve` (units read ahead on connections of
    their own): killed, resumed from its checkpoint's state, every row trained exactly once, OUT's units deleted."""
    out, work = tmp_path / "out", tmp_path / "t"
    shutil.copytree(fault_reference.out, out)
    with source_of(out, where) as (src, token):
        _trainer_recipe_resumes(out, work, src, token, fault_reference)


def _trainer_recipe_resumes(out, work, src, token, fault_reference):
    from transformers.trainer_utils import get_last_checkpoint

    def follow():
        return hsx.follow(src, delete_consumed=True, commit="manual", poll_seconds=0.01,
                          **({"token": token} if token else {}))

    rows = follow()
    trainer, model = hf_trainer(rows, work, kill_at=11, recipe=True)
    with pytest.raises(Killed):
        trainer.train()
    last = get_last_checkpoint(str(work))
    assert last is not None
    # resumed the Trainer's way (it skips the batches its checkpoint trained): refused, nothing read
    rows = follow()
    trainer, model = hf_trainer(rows, work, recipe=True, ignore_data_skip=False)
    with pytest.raises(HsxError, match="ignore_data_skip=True"):
        trainer.train(resume_from_checkpoint=last)
    # the recipe: hsx.follow resumes from the state saved with the checkpoint
    rows = follow()
    saved = torch.load(Path(last) / "hsx_follow.pt")
    rows.load_state_dict(saved["data"])
    trainer, model = hf_trainer(rows, work, recipe=True, dispatch=False)
    model.trained = saved["model"]
    trainer.train(resume_from_checkpoint=last)
    rows.commit()  # the steps after the last checkpoint (the loop ended)
    assert sorted(model.trained + model.pending) == sorted(fault_reference.sample_ids)  # exactly once
    assert not list((out / "data").glob("train-*.arrow"))


# ---- what a batch's position names, and what the default commit refuses to guess --------------------------------

def test_a_batch_names_the_position_after_its_last_row_and_nothing_else(tmp_path, fault_reference):
    from torch.utils.data import DataLoader, default_collate

    out = tmp_path / "out"
    shutil.copytree(fault_reference.out, out)
    rows = hsx.follow(out, delete_consumed=True, commit="manual", rows="dict")
    loader = iter(DataLoader(rows, batch_size=5, collate_fn=list))
    first = next(loader)
    after_first = rows.state_dict()
    second = next(loader)
    assert rows.state_dict(first) == after_first  # handed out since: not in the first batch's position
    assert rows.state_dict(second) == rows.state_dict()
    assert sum(rows.state_dict(first)["position"].values()) == 5
    tensors = default_collate([{"sample_id": r["sample_id"]} for r in second])  # default_collate's batch
    assert rows.state_dict(tensors) == rows.state_dict(second)
    rows.commit(second)
    rows.commit(first)  # an older batch: the ledger does not go back
    assert hsx.follow(out, rows="dict").state_dict()["position"] == rows.state_dict(second)["position"]
    with pytest.raises(HsxError, match="not handed out one after another"):
        rows.state_dict([first[0], second[0]])  # (a shuffle between the reader and the batch)
    other = hsx.follow(out, commit="manual", rows="dict")
    with pytest.raises(HsxError, match="has not handed out in its current iteration"):
        other.state_dict(second)  # another reader's batch
    with pytest.raises(ValueError, match="not a batch of hsx.follow rows"):
        rows.state_dict({"input_ids": torch.zeros(2, 3)})


def test_a_stateful_loaders_state_is_the_readers_and_commits(tmp_path, fault_reference):
    from torchdata.stateful_dataloader import StatefulDataLoader

    out = tmp_path / "out"
    shutil.copytree(fault_reference.out, out)
    rows = hsx.follow(out, delete_consumed=True, commit="manual", rows="dict")
    loader = StatefulDataLoader(rows, batch_size=BATCH, collate_fn=list)
    it = iter(loader)
    batches = [next(it) for _ in range(3)]
    state = loader.state_dict()
    assert state["dataset_state"] == rows.state_dict(batches[-1])
    rows.commit(state)
    resumed = hsx.follow(out, commit="manual", rows="dict")
    again = StatefulDataLoader(resumed, batch_size=BATCH, collate_fn=list)
    again.load_state_dict(state)
    rest = [r["sample_id"] for b in again for r in b]
    seen = [r["sample_id"] for b in batches for r in b]
    assert sorted(seen + rest) == sorted(fault_reference.sample_ids)


def test_a_wrapper_whose_look_ahead_hsx_cannot_see_is_refused_unless_prefetch_names_it(tmp_path, fault_reference):
    from torch.utils.data import DataLoader

    def ahead_by_one(loader):  # fetches a batch before handing out the previous one
        it = iter(loader)
        held = next(it)
        for batch in it:
            yield held
            held = batch
        yield held

    out = tmp_path / "out"
    shutil.copytree(fault_reference.out, out)
    rows = hsx.follow(out, delete_consumed=True, rows="dict")
    with pytest.raises(HsxError, match=r"cannot tell how many batches .*ahead_by_one.* prefetch=N"):
        next(ahead_by_one(DataLoader(rows, batch_size=BATCH, collate_fn=list)))
    rows = hsx.follow(out, delete_consumed=True, rows="dict", prefetch=1)
    where = {r["sample_id"]: r["unit"] for r in unit_rows(out)}
    trained = []
    for batch in ahead_by_one(DataLoader(rows, batch_size=BATCH, collate_fn=list)):
        ids = [r["sample_id"] for r in batch]
        assert all((out / "data" / f"train-{where[i]}.arrow").exists() for i in ids)  # not released before its step
        trained += ids
    assert sorted(trained) == sorted(fault_reference.sample_ids)
    # a generator expression and tqdm hand each batch on as they get it: nothing to name
    from tqdm import tqdm

    out2 = tmp_path / "out2"
    shutil.copytree(fault_reference.out, out2)
    rows = hsx.follow(out2, delete_consumed=True, rows="dict")
    assert sum(len(b) for b in tqdm(DataLoader(rows, batch_size=BATCH, collate_fn=list), disable=True)) == 96


def unit_rows(out: Path) -> list[dict]:
    from datasets import Dataset

    return [{"sample_id": s, "unit": f.name[len("train-"):-len(".arrow")]}
            for f in sorted((out / "data").glob("train-*.arrow")) for s in Dataset.from_file(str(f))["sample_id"]]


def test_accelerate_loaders_that_would_lose_rows_are_refused(tmp_path, fault_reference):
    """A Dispatcher of several processes reads on process 0 only (each rank reading its share there would leave
    the other shares unread); accelerate's IterableDatasetShard (several processes, dispatch_batches=False) keeps 1
    of N batches of each process's rows; a loader skipping its first batches hands rows to no step."""
    from types import SimpleNamespace

    from accelerate import skip_first_batches
    from accelerate.data_loader import IterableDatasetShard

    out = tmp_path / "out"
    shutil.copytree(fault_reference.out, out)
    for commit in ("unit", "manual"):
        dispatcher = loader_of(hsx.follow(out, commit=commit, rank=0, world_size=2), "dispatcher", hsx.collate)
        dispatcher.state = SimpleNamespace(num_processes=2, process_index=0, device=torch.device("cpu"))
        with pytest.raises(HsxError, match=r"rank=0, world_size=1"):
            next(iter(dispatcher))
        sharded = torch.utils.data.DataLoader(IterableDatasetShard(hsx.follow(out, commit=commit), batch_size=BATCH,
                                                                   num_processes=2, process_index=0),
                                              batch_size=BATCH, collate_fn=hsx.collate)
        with pytest.raises(HsxError, match="IterableDatasetShard"):
            next(iter(sharded))
        skipping = skip_first_batches(loader_of(hsx.follow(out, commit=commit), "shard", hsx.collate), 2)
        with pytest.raises(HsxError, match="skips its first 2 batches"):
            next(iter(skipping))
    # process 0 reading every rank's units (rank=0, world_size=1) for a Dispatcher of 2: it fetches 2 batches per
    # step and one step ahead; no unit of a row handed to this process (or to process 1: the other half of the same
    # global batch) is released before its step
    rows = hsx.follow(out, delete_consumed=True, rank=0, world_size=1, rows="dict")
    ids = lambda rs: {"sample_id": torch.tensor([r["sample_id"] for r in rs])}  # noqa: E731
    dispatcher = loader_of(rows, "dispatcher", ids)
    dispatcher.state = SimpleNamespace(num_processes=2, process_index=0, device=torch.device("cpu"))
    where = {r["sample_id"]: r["unit"] for r in unit_rows(out)}
    global_batches = []
    for batch in dispatcher:
        global_batches.append(batch["sample_id"].tolist())
        assert all((out / "data" / f"train-{where[i]}.arrow").exists() for i in global_batches[-1])
    assert len(global_batches) == 96 // (2 * BATCH)


def test_under_a_look_ahead_the_rows_handed_out_are_never_taken_for_the_rows_trained(tmp_path, fault_reference):
    """accelerate's loader holds a batch fetched and not yet trained: the old recipe's `state_dict()` saved it as
    trained (a batch lost per restart): refused, naming state_dict(batch); `commit()` after a loop that stopped
    early records only the rows before it (the old one recorded every row handed out: a batch lost)."""
    out = tmp_path / "out"
    shutil.copytree(fault_reference.out, out)
    rows = hsx.follow(out, delete_consumed=True, rows="dict")
    loader = loader_of(rows, "shard", list)
    trained = []
    for step, batch in enumerate(loader, 1):
        trained += [r["sample_id"] for r in batch]
        with pytest.raises(HsxError, match=r"fetches 1 batch\(es\) ahead .* rows.state_dict\(batch\)"):
            rows.state_dict()
        assert sum(rows.state_dict(batch)["position"].values()) == len(trained)
        if step == 5:
            break
    rows.commit()
    rest = [r["sample_id"] for r in hsx.follow(out, rows="dict", commit="manual")]
    assert sorted(set(trained + rest)) == sorted(fault_reference.sample_ids)
    assert len(trained) + len(rest) - 96 < BATCH + max(e["rows"] for e in fault_reference.info["files"])


def test_a_loader_read_on_another_thread_is_refused_unless_prefetch_names_its_queue(tmp_path, fault_reference):
    """A background thread filling a queue of batches fetches as far ahead as the queue holds: hsx cannot see it."""
    import queue
    import threading

    from torch.utils.data import DataLoader

    def produce(loader, q):
        try:
            for batch in loader:
                q.put(batch)
            q.put(None)
        except HsxError as e:
            q.put(e)

    out = tmp_path / "out"
    shutil.copytree(fault_reference.out, out)
    for prefetch, depth in ((None, 2), (3, 2)):  # (a queue of 2, plus the batch the thread holds while it waits)
        q = queue.Queue(maxsize=depth)
        rows = hsx.follow(out, delete_consumed=True, rows="dict", prefetch=prefetch)
        thread = threading.Thread(target=produce, args=(DataLoader(rows, batch_size=BATCH, collate_fn=list), q))
        thread.start()
        got = []
        while (batch := q.get()) is not None and not isinstance(batch, HsxError):
            got += [r["sample_id"] for r in batch]
        thread.join()
        if prefetch is None:
            assert isinstance(batch, HsxError) and "background prefetcher" in str(batch)
        else:
            rows.commit()
            assert sorted(got) == sorted(fault_reference.sample_ids)


def test_rows_batched_by_a_generator_of_the_trainer_need_its_batch_size(tmp_path, fault_reference):
    """Without a DataLoader each row asked for was taken for a step of its own: a generator collecting rows into
    batches had units released while their last rows waited in its batch (a kill lost them). Refused; with
    batch_size= the same generator loses nothing."""
    def batches(rows, size):
        held = []
        for row in rows:
            held.append(row)
            if len(held) == size:
                yield held
                held = []
        if held:
            yield held

    out = tmp_path / "out"
    shutil.copytree(fault_reference.out, out)
    with pytest.raises(HsxError, match=r"read by .*batches.* not by a DataLoader.*batch_size=B"):
        next(batches(hsx.follow(out, delete_consumed=True, rows="dict"), BATCH))
    rows = hsx.follow(out, delete_consumed=True, rows="dict", batch_size=BATCH)
    where = {r["sample_id"]: r["unit"] for r in unit_rows(out)}
    trained = []
    for batch in batches(rows, BATCH):
        ids = [r["sample_id"] for r in batch]
        assert all((out / "data" / f"train-{where[i]}.arrow").exists() for i in ids)
        trained += ids
    assert sorted(trained) == sorted(fault_reference.sample_ids)
    assert sorted(r["sample_id"] for r in hsx.follow(fault_reference.out, rows="dict")) == sorted(trained)  # a loop
