r"""Vocabulary-parallel (tensor-parallel) LM heads: each rank holds a slice of the classes.

The head ``W`` (``V × H``) and its bias are split by rows over the ``p`` ranks of a process group:
rank ``r`` holds the classes ``[o_r, o_r + V_r)`` with ``o_r = V_0 + … + V_{r-1}`` (shards in group
rank order, of any sizes ``V_r ≥ 1``: ``V`` need not divide by ``p``). ``x`` and the targets are
the same on every rank, and every rank gets the same loss. Nothing of size ``V`` crosses the wire:

* **Layout and validation, once per call**: one ``all_gather`` of a short int64 row per rank
  (:data:`FACTS`: its shard size ``V_r``, ``H``, the row count, the smallest and largest valid
  target and a fingerprint of each target tensor, the class-weight length, a checksum of the
  options, and whether its own argument checks failed). Every rank then reads the same table and
  takes the same decision: the offsets ``o_r`` by a prefix sum, and the same error on every rank
  when any rank rejected its arguments, the ranks disagree (``H``, rows, targets, options, a
  DTensor's global ``V``), or a target lies outside the *global* ``[0, V)``. A rank that fails
  therefore never leaves the others blocked in a later collective.
* **Log-sum-exp merge, per chunk of rows**: from each rank's :math:`m_r = \max_j c_j` and
  :math:`s_r = \sum_j e^{c_j - m_r}` over its own classes,

  .. math::

      M = \max_r m_r \ (\text{all\_reduce MAX}), \qquad
      S = \sum_r s_r\, e^{m_r - M} \ (\text{all\_reduce SUM}), \qquad
      \mathrm{lse} = M + \log S,

  exact (no term is dropped) and overflow-free (every exponent is ≤ 0). Other per-row sums ride in
  the same SUM (:meth:`VocabShard.merge_logsumexp`, one all-reduce of ``rows × k`` floats).
* **The target's logit comes from its owner**: the rank with :math:`o_r \le y < o_r + V_r` puts
  :math:`c_y` (or a log-prob) in its column of that SUM, every other rank puts 0
  (:meth:`VocabShard.owns`), so the sum is the owner's value.
* **Gradients**: with the global lse each rank forms its own ``dz_r`` (``rows × V_r``) locally, so
  ``dW_r = dz_rᵀ x`` and ``db_r`` stay local and ``dx = Σ_r dz_r W_r`` is one all-reduce (SUM) of
  ``N × H`` per call (:meth:`VocabShard.sum_`), after the last chunk. The caller must not reduce
  ``dx`` again (it is the gradient of the replicated ``x``, complete on every rank).

The group is ``process_group``, or the 1-D device mesh's group of a DTensor ``weight`` sharded on
dim 0 (``placements == (Shard(0),)``; its local tensor is the shard, and the gradient flows back to
the DTensor). A DTensor does not say why it is split: FSDP2's parameters outside their module's
forward look the same (``Shard(0)`` over the data-parallel mesh), but there each rank has its own
tokens. That shows in the one check over the ranks (the targets' checksums differ), and the error
then says so and what to do instead (unshard it through the module's forward, or ``full_tensor()``). Only ``torch.distributed`` collectives are used; any backend that has ``all_gather``
and ``all_reduce`` (MAX, SUM) for int64 and float32 works (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: The int64 facts each rank contributes to the one ``all_gather`` of :func:`establish`, in order.
#: Per target tensor (two slots, the second unused by most losses): the smallest and largest valid
#: value and a position-weighted checksum, so that every rank can check every target's range.
FACTS = (
    "failed", "shard_size", "hidden", "rows", "class_weight_len", "options_crc", "dtensor_vocab",
    "lo_0", "hi_0", "sum_0", "lo_1", "hi_1", "sum_1",
)
_TARGET_SLOTS = 2
#: The exception type the other ranks raise when a rank's own checks fail, by the code it sends
#: (``failed`` = 1 + the index of the first type its error is an instance of).
_ERROR_TYPES = (TypeError, ValueError, NotImplementedError, RuntimeError, Exception)
_NONE = torch.iinfo(torch.int64).min  # "no value" (no valid target, no class weight, not a DTensor)


def _dtensor_types():
    """``(DTensor, Shard)``, or ``(None, None)`` where torch has no DTensor."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # a torch without torch.distributed.tensor: plain tensors only
        return None, None
    return DTensor, Shard


def is_dtensor(tensor) -> bool:
    dtensor, _ = _dtensor_types()
    return dtensor is not None and isinstance(tensor, dtensor)


def find_group(process_group, tensors: dict, shard_dim: int = 0):
    """The process group of a call, or None for the single-process path.

    ``process_group`` when given; else the device mesh's group of the DTensor arguments (``tensors``
    by name; each DTensor must be sharded on its class dimension ``shard_dim`` — 0 for a head's
    rows, 1 for ``(N, V)`` logits — over one and the same 1-D mesh). These checks
    read only arguments every rank sees alike (DTensor metadata is global), so they raise at once.

    Raises:
        ValueError: a DTensor that is not ``Shard(shard_dim)`` over a 1-D mesh, DTensors on different meshes,
            a ``process_group`` other than the DTensors' mesh group, a process outside the group.
    """
    _, shard_type = _dtensor_types()
    mesh, mesh_name = None, None
    for name, tensor in tensors.items():
        if not is_dtensor(tensor):
            continue
        wanted = (shard_type(shard_dim),)
        placements = tuple(shard_type(p.dim % tensor.ndim) if isinstance(p, shard_type) else p for p in tensor.placements)
        if tensor.device_mesh.ndim != 1 or placements != wanted:
            what = "a head takes (Shard(0),)" if shard_dim == 0 else f"{name} takes (Shard({shard_dim}),)"
            raise ValueError(
                f"{name} is a DTensor with placements {tuple(tensor.placements)} over a {tensor.device_mesh.ndim}-D "
                f"mesh; vocabulary-parallel, {what} over a 1-D device mesh (the classes split)"
            )
        if mesh is None:
            mesh, mesh_name = tensor.device_mesh, name
        elif tensor.device_mesh != mesh:
            raise ValueError(f"{name} and {mesh_name} are DTensors on different device meshes; give one mesh")
    group = process_group
    if mesh is not None:
        mesh_group = mesh.get_group()
        if process_group is not None and _ranks(process_group) != _ranks(mesh_group):
            raise ValueError(
                f"process_group is not the group of {mesh_name}'s device mesh; pass process_group=None with a "
                "DTensor head, or the mesh's group (mesh.get_group())"
            )
        group = mesh_group
    if group is not None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("process_group given, but torch.distributed is not initialized")
        if dist.get_rank(group) < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of process_group")
    return group


def _ranks(group) -> list[int] | None:
    """The global ranks of ``group``, None where this process is not a member."""
    if dist.get_rank(group) < 0:
        return None
    return dist.get_process_group_ranks(group)


def local(tensor):
    """A DTensor's local shard (differentiable: its gradient returns to the DTensor), else the tensor."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _comm_device(group) -> torch.device:
    """Where the small tensors of the collectives live: CUDA for an NCCL group, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _target_facts(target: torch.Tensor, ignore_index: int) -> list[torch.Tensor]:
    """``[lo, hi, checksum]`` of one target tensor (device scalars: read with the gather, one host sync)."""
    flat = target.reshape(-1).long()
    valid = flat != ignore_index
    lo = torch.where(valid, flat, torch.iinfo(torch.int64).max).min()
    hi = torch.where(valid, flat, torch.iinfo(torch.int64).min).max()
    position = torch.arange(flat.numel(), device=flat.device) % 65521 + 1
    return [lo, hi, (flat * position).sum()]


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice ``[offset, offset + size)`` of a ``n_classes``-class vocabulary split over ``group``."""

    group: object
    rank: int
    sizes: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.sizes[self.rank]

    @property
    def offset(self) -> int:
        return sum(self.sizes[: self.rank])

    @property
    def n_classes(self) -> int:
        return sum(self.sizes)

    def kernel_args(self) -> dict:
        """The kernels' ``col_offset`` and global ``n_classes``."""
        return dict(col_offset=self.offset, n_classes=self.n_classes)

    def owns(self, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
        """Where this rank owns the (global) target: ``offset ≤ y < offset + size``, ``y ≠ ignore_index``."""
        return (target != ignore_index) & (target >= self.offset) & (target < self.offset + self.size)

    def merge_logsumexp(self, m: torch.Tensor, log_s: torch.Tensor, extra: Callable | None = None):
        r"""The global log-sum-exp of rows split over the ranks, and further per-row sums.

        ``m``, ``log_s``: float32 ``(rows,)``, this rank's :math:`m_r` and :math:`\log s_r` (module
        docstring); ``extra(shift)`` gives more float32 ``(rows,)`` columns to sum over the ranks,
        from ``shift`` :math:`= m_r - M \le 0` (to rescale sums taken relative to :math:`m_r`), e.g.
        a target logit where this rank owns the target and 0 elsewhere.

        Returns ``(M, log S, sums)``: :math:`\mathrm{lse} = M + \log S`, and the summed extra columns.
        Wire: ``rows`` floats (MAX), then ``rows × (1 + k)`` floats (SUM), ``k`` the extra columns.
        """
        big_m = m.clone()
        dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=self.group)
        shift = m - big_m
        columns = [torch.exp(log_s + shift), *(extra(shift) if extra is not None else ())]
        packed = torch.stack(columns, 1)
        dist.all_reduce(packed, group=self.group)
        return big_m, packed[:, 0].log(), packed[:, 1:].unbind(1)

    def merge_token_logprobs(self, lse: torch.Tensor, pairs, ignore_index: int) -> None:
        r"""Turn one shard's per-row ``lse`` and target log-probs into the global ones, in place.

        ``lse``: float32 ``(rows,)``, :math:`\mathrm{lse}_r` of this shard's classes; ``pairs``:
        ``(target, logp)`` tensors, ``logp`` the log-prob under this shard's softmax,
        :math:`z_y - \mathrm{lse}_r`, where this rank owns ``target`` (anything elsewhere). Merged as
        :meth:`merge_logsumexp` with :math:`m_r = \mathrm{lse}_r`, :math:`s_r = 1`; the owner adds
        :math:`z_y - M = \log p_r + (\mathrm{lse}_r - M)` to the sum, every other rank 0, so
        :math:`\log p = (z_y - M) - \log S` (0 at ``ignore_index``). Wire per row: 1 float (MAX),
        ``1 + len(pairs)`` floats (SUM).
        """
        owned = [self.owns(target, ignore_index) for target, _ in pairs]

        def extra(shift):
            return [torch.where(mine, logp + shift, 0.0) for mine, (_, logp) in zip(owned, pairs)]

        big_m, log_s, sums = self.merge_logsumexp(lse, torch.zeros_like(lse), extra)
        lse.copy_(big_m + log_s)
        for (target, logp), total in zip(pairs, sums):
            logp.copy_(torch.where(target != ignore_index, total - log_s, 0.0))

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-reduce (SUM) ``tensor`` in place over the group (``dx = Σ_r dz_r W_r``); returns it."""
        dist.all_reduce(tensor, group=self.group)
        return tensor


def establish(
    group,
    weight: torch.Tensor,
    check: Callable[[], None],
    *,
    rows: Callable[[], int],
    targets: Callable[[], dict[str, torch.Tensor]],
    ignore_index: int,
    options: Callable[[], tuple] = tuple,
    class_weight: Callable[[], torch.Tensor | None] = lambda: None,
    dtensor_vocab: int | None = None,
    shard_size: Callable[[], int] | None = None,
) -> VocabShard:
    """Check the call on every rank with one ``all_gather``, and lay out the shards.

    ``check()`` runs this rank's own argument checks (those of the single-process function, with
    ``weight`` this rank's shard); ``rows()``, ``targets()`` (at most two target tensors by name,
    global class indices), ``class_weight()`` and ``options()`` are read only after it passes
    (``options``: the non-tensor arguments, the dtypes and which gradients are wanted, which must
    agree over the ranks: their ``repr`` is checksummed). ``dtensor_vocab``: the global ``V`` a DTensor head declares.
    ``weight``: this rank's ``(V_r, H)`` head shard; or None for a shard of logits, with
    ``shard_size()`` giving ``V_r`` (then there is no hidden size to agree on: sent as 0).

    Every rank reaches the gather, whatever its own checks found, then raises the same way:

    * a rank whose checks failed re-raises its own error; the others raise the same exception type,
      naming the rank(s) that failed;
    * ValueError on every rank when the ranks disagree (hidden size, rows, targets, class weights,
      options, a DTensor's ``V`` against the shards' sum) or a target lies outside ``[0, V)`` of the
      *global* vocabulary ``V = Σ_r V_r``.

    Cost: one all_gather of ``len(FACTS)`` int64 per rank and one host sync.
    """
    device = _comm_device(group)
    error = None
    try:
        check()
        named = targets()
        if len(named) > _TARGET_SLOTS:
            raise ValueError(f"at most {_TARGET_SLOTS} target tensors per call; got {list(named)}")
        weights = class_weight()
        size, hidden = (shard_size(), 0) if weight is None else weight.shape[:2]
        host = [0, size, hidden, rows(), _NONE if weights is None else weights.numel()]
        host += [zlib.crc32(repr(options()).encode()), _NONE if dtensor_vocab is None else dtensor_vocab]
        on_device = [fact for target in named.values() for fact in _target_facts(target, ignore_index)]
        unused = [_NONE] * (3 * (_TARGET_SLOTS - len(named)))
        mine = torch.cat([
            torch.tensor(host, dtype=torch.int64, device=device),
            torch.stack(on_device).to(device),
            torch.tensor(unused, dtype=torch.int64, device=device),
        ])
    except Exception as caught:  # noqa: BLE001 (whatever it is, the other ranks must not wait for this one)
        error = caught
        code = 1 + next(i for i, kind in enumerate(_ERROR_TYPES) if isinstance(caught, kind))
        mine = torch.full((len(FACTS),), _NONE, dtype=torch.int64, device=device)
        mine[0] = code
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    table = [dict(zip(FACTS, row)) for row in torch.stack(gathered).tolist()]
    failed = [r for r, row in enumerate(table) if row["failed"]]
    if error is not None:
        raise error
    if failed:
        kind = _ERROR_TYPES[table[failed[0]]["failed"] - 1]
        kind = RuntimeError if kind is Exception else kind
        raise kind(
            f"rank(s) {failed} of the process group rejected their arguments ({kind.__name__}, raised there with "
            "its message); every rank stops"
        )
    _check_agreement(table, list(named), ignore_index)
    return VocabShard(group, dist.get_rank(group), tuple(row["shard_size"] for row in table))


#: Appended to a disagreement on the rows or targets when the group came from a DTensor weight: a DTensor
#: cannot say what its split means, and ranks with their own tokens are data-parallel ones.
_DATA_PARALLEL_DTENSOR = (
    ". The weight is a DTensor sharded (Shard(0),), which kernels_lib takes for a vocabulary-parallel head (its "
    "classes split over the ranks, each rank with the same tokens); these ranks hold different tokens, as "
    "data-parallel ranks do. If it is an FSDP2-sharded parameter (fully_shard: its rows split for storage, not "
    "for the loss), call the loss where FSDP2 has unsharded it, inside the FSDP module's forward (kernels_lib.hf's "
    "patch and add_fused_lm_head do so for a head that is its own FSDP2 unit), or pass weight.full_tensor() "
    "(and bias.full_tensor()), whose gradient flows back to the shards"
)


def _check_agreement(table: list[dict], target_names: list[str], ignore_index: int) -> None:
    """The decisions every rank takes alike from the gathered :data:`FACTS` (see :func:`establish`)."""
    described = {
        "hidden": "the hidden size H (weight.shape[1] and x.shape[-1])",
        "rows": "the number of rows of x",
        "options_crc": "the options (reduction, label_smoothing, ..., which inputs require grad)",
        "class_weight_len": "class_weight's length",
    }
    for k, name in enumerate(target_names):
        described[f"sum_{k}"] = f"{name} (its values)"
    from_dtensor = table[0]["dtensor_vocab"] != _NONE
    for key, what in described.items():
        values = [row[key] for row in table]
        if len(set(values)) > 1:
            hint = _DATA_PARALLEL_DTENSOR if from_dtensor and (key == "rows" or key.startswith("sum_")) else ""
            raise ValueError(
                f"the ranks of the process group disagree on {what}: {values} by rank; x, the targets and the "
                f"options must be the same on every rank, only weight and bias are split{hint}"
            )
    sizes = [row["shard_size"] for row in table]
    n_classes = sum(sizes)
    split = " + ".join(map(str, sizes))
    declared = table[0]["dtensor_vocab"]
    if declared != _NONE and declared != n_classes:
        raise ValueError(f"the DTensor weight has {declared} rows but its local shards sum to {split} = {n_classes}")
    length = table[0]["class_weight_len"]
    if length != _NONE and length != n_classes:
        raise ValueError(
            f"class_weight must hold one weight per class of the whole vocabulary, (V,) = ({n_classes},) with "
            f"V = {split} over the ranks; got ({length},)"
        )
    for k, name in enumerate(target_names):
        lo, hi = table[0][f"lo_{k}"], table[0][f"hi_{k}"]
        bad = lo if lo < 0 else hi if hi >= n_classes else None
        if bad is not None and lo <= hi:  # lo > hi: no valid target at all
            raise ValueError(
                f"{name} holds value(s) outside the global vocabulary [0, {n_classes}) (V = {split} over the "
                f"ranks) that are not ignore_index={ignore_index} (e.g. {bad})"
            )


def shard_heads(process_group, heads: dict, check: Callable[[dict], None], *, rows: Callable[[], int],
                targets: Callable[[], dict[str, torch.Tensor]], ignore_index: int,
                options: Callable[[], tuple] = tuple) -> tuple[dict, VocabShard | None]:
    """A loss call's heads as this process runs them, and its vocabulary shard (None on one process).

    ``heads``: the head tensors by name, ``"weight"`` first (plain tensors, or DTensors sharded
    ``(Shard(0),)``; None entries allowed); all of them are this rank's rows of the same classes.
    ``check(heads)`` runs the call's own argument checks on the heads as given back (the local shards
    with a group), on every rank before the one gather of :func:`establish`, whose ``rows``,
    ``targets`` and ``options`` it takes. Without a group (:func:`find_group`) it runs ``check`` and
    gives the heads back unchanged.
    """
    group = find_group(process_group, heads)
    if group is None:
        check(heads)
        return heads, None
    weight = heads["weight"]
    dtensor_vocab = weight.shape[0] if is_dtensor(weight) else None
    shards = {name: local(tensor) for name, tensor in heads.items()}
    shard = establish(group, shards["weight"], lambda: check(shards), rows=rows, targets=targets,
                      ignore_index=ignore_index, options=options, dtensor_vocab=dtensor_vocab)
    return shards, shard
