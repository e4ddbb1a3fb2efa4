"""Expert parallelism with each rank on its own batches (`--ep-size N`): the routed experts of a mixture of experts
sharded over the N ranks of a group, everything else (embeddings, attention, dense and shared MLPs, routers)
whole on each rank, and each (token, expert) pair sent to its expert's rank and back with
`torch.distributed.all_to_all_single` (first the counts, then the rows). Every rank runs its own batches, hooks and
units as in data parallelism; only the experts' GEMMs see the other ranks' tokens.

Behind transformers' experts seam: each experts module keeps the forward transformers dispatches through its
`ExpertsInterface` (hsx.target.moe's "hsx_grouped", its FP8 path, or transformers' own) and runs it on its local
experts;
`shard_experts` wraps it with the dispatch and the combine. transformers 5.25 has an expert-parallel path of its own
(`DistributedConfig(ep_size=N, fsdp_size=N, ...)` with the `ep_dispatch_experts` rule's `AllToAllEP`), but it ties
the ranks' own batches to FSDP-sharded dense weights (gathered at every forward; FSDP2 fails under
`torch.inference_mode`) and shards over the whole world; hsx replicates the dense weights instead.

The ranks of a group run their forwards in lockstep (every MoE layer is a collective): before each forward they
agree whether any of them has one to run (`EpGroup.agree`), and a rank with none runs a one-token forward whose
output is dropped (`Extractor.idle_in_lockstep`), so the others never wait on it; their token budgets are agreed
(the smallest). The pairs' outputs come back and each token's k outputs are summed in float32 in the routing order,
as hsx.target.moe's one-process `sum_pairs` does.

Each rank reads only its own experts from the checkpoint (`loading_local_experts`, around transformers'
from_pretrained): the experts modules are built with the rank's share of the experts, and of the checkpoint's
tensors transformers is handed the non-expert ones, this rank's per-expert ones (renumbered from 0) and the rows of
stacked experts tensors that are this rank's; the other ranks' expert bytes are never read, so a rank's memory is
the replicated weights plus its share of the experts (hsx.cost's `expert_parallel_gpu_bytes`). transformers' own
shard-on-read (`DtensorShardOperation`, which skips the experts a rank does not own) needs the experts as DTensors
of a device mesh, which hsx's plain tensors behind the dispatch are not.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from hsx.errors import HsxError

GROUP = "_hsx_expert_parallel"  # set on the decoder stack by shard_experts: its EpGroup (the engine's lockstep)
LOADED_SHARD = "_hsx_loaded_shard"  # set on an experts module loaded with only this rank's experts: (first, local)


@dataclass
class EpGroup:
    """The ranks that share one model's experts: ranks [k·size, (k+1)·size) of the job."""
    group: Any  # torch.distributed ProcessGroup of the group's ranks (NCCL on GPUs, gloo on the CPU)
    size: int
    rank: int  # within the group
    device: torch.device  # where the collectives' tensors live

    def agree(self, has_work: bool) -> bool:
        """Whether any rank of the group has a forward to run (every rank calls this before each forward, and an
        idle one until it returns False)."""
        import torch.distributed as dist

        flag = torch.tensor([int(has_work)], device=self.device)
        self.collective(dist.all_reduce, flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def agree_min(self, value: int) -> int:
        import torch.distributed as dist

        t = torch.tensor([value], device=self.device, dtype=torch.int64)
        self.collective(dist.all_reduce, t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def collective(self, fn, *args, **kwargs):
        """One collective of the group; a rank of it that ended (killed, failed) is one line, not the backend's
        traceback: the group cannot go on without it."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:  # (torch.distributed's DistError and the backends' errors are RuntimeErrors)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise HsxError(f"--ep-size {self.size}: a rank of this process's expert-parallel group ended or failed "
                           f"({first}); the group cannot go on without it. The units committed are kept: run the "
                           "same command to continue") from None


def make_groups(rank: int, world: int, ep_size: int, device: torch.device) -> EpGroup:
    """Every rank creates every group, in order (torch.distributed's rule); returns this rank's."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    mine = None
    for first in range(0, world, ep_size):
        group = dist.new_group(list(range(first, first + ep_size)), backend=backend)
        if first <= rank < first + ep_size:
            mine = EpGroup(group, ep_size, rank - first, device)
    return mine


def group_of(base: torch.nn.Module) -> EpGroup | None:
    return getattr(base, GROUP, None)


def _experts_modules(base: torch.nn.Module):
    """transformers' fused experts modules: 3-D expert weights (experts first) and `num_experts`."""
    for name, module in base.named_modules():
        w = getattr(module, "down_proj", None)
        if (isinstance(getattr(module, "num_experts", None), int) and isinstance(w, torch.Tensor) and w.dim() == 3
                and w.shape[0] == module.num_experts):
            yield name, module


def shard_experts(base: torch.nn.Module, ep: EpGroup) -> tuple[int, int]:
    """Keep this rank's contiguous share of every experts module (every parameter and buffer whose first dimension
    is the experts), and wrap each module's forward with the dispatch and combine. Returns (how many modules, the
    experts this rank holds in each)."""
    count = local = 0
    for name, module in _experts_modules(base):
        loaded = getattr(module, LOADED_SHARD, None)
        if loaded is not None:  # read from the checkpoint as this rank's share already (`loading_local_experts`)
            lo, local = loaded
            if lo != ep.rank * local:
                raise HsxError(f"--ep-size {ep.size}: {name} was loaded with experts {lo}..{lo + local - 1}, not rank "
                               f"{ep.rank}'s share")
            _install(module, ep, lo, local)
            count += 1
            continue
        experts = int(module.num_experts)
        _check_split(name, experts, ep.size)
        local = experts // ep.size
        lo = ep.rank * local
        for pname, p in list(module.named_parameters(recurse=False)):
            if p.dim() >= 1 and p.shape[0] == experts:
                module.register_parameter(pname, torch.nn.Parameter(p.data[lo:lo + local].clone(),
                                                                    requires_grad=False))
        for bname, b in list(module.named_buffers(recurse=False)):
            if b is not None and b.dim() >= 1 and b.shape[0] == experts:
                module.register_buffer(bname, b[lo:lo + local].clone())
        module.num_experts = local
        _install(module, ep, lo, local)
        count += 1
    if not count:
        raise HsxError("--ep-size: this model has no routed experts to shard (a dense model runs one copy per "
                       "process: leave --ep-size out)")
    setattr(base, GROUP, ep)
    return count, local


def _check_split(name: str, experts: int, size: int) -> None:
    if experts % size:
        raise HsxError(f"--ep-size {size}: {name} has {experts} experts, which do not split evenly over "
                       f"{size} ranks; give an --ep-size that divides {experts}")


# ---- loading only this rank's experts --------------------------------------------------------------------------------

@dataclass
class LocalExpertsLoad:
    """What `loading_local_experts` did: the checkpoint tensors left unread (other ranks' experts), the ones read
    as rows of a stacked experts tensor, and the experts modules built with this rank's share."""
    size: int
    rank: int
    modules: int = 0
    skipped: list[str] = field(default_factory=list)
    sliced: list[str] = field(default_factory=list)


class _Rows:
    """Rows [first, first + count) of a checkpoint tensor that transformers reads lazily (safetensors' slice):
    only those rows' bytes are read when transformers materialises it."""

    def __init__(self, source, first: int, count: int):
        self.source, self.first, self.count = source, first, count

    def get_shape(self) -> list[int]:
        return [self.count, *list(self.source.get_shape())[1:]]

    def get_dtype(self) -> str:
        return self.source.get_dtype()

    def __getitem__(self, index):
        rows = self.source[self.first:self.first + self.count]
        return rows if index is Ellipsis else rows[index]


def _shrink_to_share(model: torch.nn.Module, size: int, rank: int) -> dict[str, tuple[int, int, int]]:
    """Give each experts module of a model not yet loaded (meta tensors) only this rank's experts: every parameter
    and buffer whose first dimension is the experts, cut to the share. {module name: (experts, first, local)}."""
    shares = {}
    for name, module in list(_experts_modules(model)):
        experts = int(module.num_experts)
        _check_split(name, experts, size)
        local = experts // size
        first = rank * local
        for table in (module._parameters, module._buffers):
            for key, t in list(table.items()):
                if t is not None and t.dim() >= 1 and t.shape[0] == experts:
                    new = torch.empty((local, *t.shape[1:]), dtype=t.dtype, device=t.device)
                    table[key] = (torch.nn.Parameter(new, requires_grad=t.requires_grad) if table is module._parameters
                                  else new)
        module.num_experts = local
        setattr(module, LOADED_SHARD, (first, local))
        shares[name] = (experts, first, local)
    return shares


def _local_state_dict(state: dict[str, Any], shares: dict[str, tuple[int, int, int]], renamings,
                      record: LocalExpertsLoad) -> dict[str, Any]:
    """The checkpoint tensors this rank reads: every one that is no expert's; of each sharded experts module, its
    per-expert tensors (`...experts.<e>.<name>`, keys as transformers' renamings name them) of this rank's experts,
    renumbered from 0, and the rows of its stacked tensors (`...experts.<name>`, experts first) that are this
    rank's. Other ranks' per-expert tensors are left out, unread."""
    from transformers.core_model_loading import apply_renamings

    if not shares:
        return state
    by_path = re.compile(r"(?:^|\.)(" + "|".join(re.escape(n) for n in sorted(shares, key=len, reverse=True))
                         + r")\.(.+)$")
    out = {}
    shapes: dict[tuple[str, str], tuple[str, tuple[int, ...]]] = {}  # (module, tensor name) → the first expert's
    for key, tensor in state.items():
        found = by_path.search(apply_renamings(key, renamings)) or by_path.search(key)
        if found is None:
            out[key] = tensor
            continue
        experts, first, local = shares[found.group(1)]
        head, _, tail = found.group(2).partition(".")
        if not head.isdigit():  # a stacked tensor of every expert: this rank's rows
            shape = tensor.get_shape() if hasattr(tensor, "get_shape") else list(tensor.shape)
            if shape and shape[0] == experts:
                out[key] = _Rows(tensor, first, local) if hasattr(tensor, "get_shape") else tensor[first:first + local]
                record.sliced.append(key)
            else:  # (another shape: transformers reports the mismatch)
                out[key] = tensor
            continue
        e = int(head)
        shape = tuple(tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape)  # (the header's)
        peer = shapes.setdefault((found.group(1), tail), (key, shape))
        if peer[1] != shape:
            raise HsxError(f"the checkpoint's expert tensors disagree in shape: {key[:200]} is {list(shape)}, "
                           f"{peer[0][:200]} is {list(peer[1])}; the model folder is damaged")
        if not first <= e < first + local:
            record.skipped.append(key)
            continue
        parts = key.split(".")
        at = len(parts) - 2 - tail.count(".")  # the expert's number in the checkpoint's own key
        if at < 0 or parts[at] != head:
            raise HsxError(f"cannot read only this rank's experts: the checkpoint key {key[:200]!r} does not name "
                           f"its expert ({e}) where transformers' naming of it does; leave --ep-size out")
        parts[at] = str(e - first)
        out[".".join(parts)] = tensor
    return out


@contextmanager
def loading_local_experts(size: int, rank: int):
    """Within the block, transformers' from_pretrained (its `_load_pretrained_model`: after the model is built on
    the meta device and its quantized modules are in place, before any weight is read) builds every experts module
    with rank `rank`'s contiguous share of the experts of `size` ranks, and reads from the safetensors only the
    tensors `_local_state_dict` keeps. Yields a LocalExpertsLoad, filled as the load runs. One load at a time
    (transformers' class attribute is swapped for the block)."""
    from safetensors import safe_open
    from transformers.core_model_loading import WeightRenaming
    from transformers.modeling_utils import PreTrainedModel

    record = LocalExpertsLoad(size, rank)
    original = PreTrainedModel.__dict__["_load_pretrained_model"]

    def load(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        shares = _shrink_to_share(model, size, rank)
        record.modules += len(shares)
        if not shares:
            return original.__func__(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
        renamings = [m for m in (load_config.weight_mapping or []) if isinstance(m, WeightRenaming)]
        opened = []
        try:
            if state_dict is None:
                files = [f for f in (checkpoint_files or []) if str(f).endswith(".safetensors")]
                if not files:
                    raise HsxError("--ep-size reads a rank's experts from safetensors files only; this checkpoint "
                                   "has none")
                state_dict = {}
                for f in files:  # (as transformers does: lazily, each tensor's bytes read when materialised)
                    handle = safe_open(str(f), framework="pt", device="cpu")
                    opened.append(handle)
                    for k in handle.keys():
                        state_dict[k] = handle.get_slice(k)
            state_dict = _local_state_dict(state_dict, shares, renamings, record)
            return original.__func__(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
        finally:
            for handle in opened:
                handle.__exit__(None, None, None)

    PreTrainedModel._load_pretrained_model = staticmethod(load)
    try:
        yield record
    finally:
        PreTrainedModel._load_pretrained_model = original


def _install(module: torch.nn.Module, ep: EpGroup, first: int, local: int) -> None:
    inner = module.forward  # what transformers dispatches to (hsx_grouped, its FP8 path, or its own)

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return dispatch_combine(inner, hidden_states, top_k_index, top_k_weights, ep, local)

    module.forward = forward


def dispatch_combine(inner, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     ep: EpGroup, local: int) -> torch.Tensor:
    """Each (token, expert) pair to the rank holding the expert, its rows run there by `inner` as one pair per row
    (the routing weight applied there, as in one process), the outputs back, and each token's k outputs summed in
    float32 in routing order."""
    import torch.distributed as dist

    tokens, k = top_k_index.shape
    hidden = hidden_states.shape[-1]
    ids = top_k_index.reshape(-1)
    owner = torch.div(ids, local, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)  # pairs grouped by owner rank, (token, slot) order within
    send_counts = torch.bincount(owner, minlength=ep.size).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    ep.collective(dist.all_to_all_single, recv_counts, send_counts, group=ep.group)
    send_sizes, recv_sizes = send_counts.tolist(), recv_counts.tolist()  # the one host sync of the layer
    received = sum(recv_sizes)
    pair_rows = hidden_states.index_select(0, torch.div(order, k, rounding_mode="floor"))
    local_ids = (ids.index_select(0, order) - owner.index_select(0, order) * local).to(torch.int64)
    weights = top_k_weights.reshape(-1).index_select(0, order)

    def exchange(x: torch.Tensor, out_rows: int, out_sizes, in_sizes) -> torch.Tensor:
        out = x.new_empty((out_rows,) + tuple(x.shape[1:]))
        ep.collective(dist.all_to_all_single, out, x.contiguous(), out_sizes, in_sizes, group=ep.group)
        return out

    rows_in = exchange(pair_rows, received, recv_sizes, send_sizes)
    ids_in = exchange(local_ids, received, recv_sizes, send_sizes)
    weights_in = exchange(weights, received, recv_sizes, send_sizes)
    if received:
        out = inner(rows_in, ids_in.view(-1, 1), weights_in.view(-1, 1))
    else:  # nothing routed here this layer: the exchange still runs, with no rows
        out = rows_in.new_empty((0, hidden))
    back = exchange(out.to(hidden_states.dtype), tokens * k, send_sizes, recv_sizes)
    pairs = torch.empty_like(back)
    pairs[order] = back
    pairs = pairs.view(tokens, k, hidden)
    total = pairs[:, 0].float()
    for j in range(1, k):
        total = total + pairs[:, j]
    return total.to(hidden_states.dtype)
