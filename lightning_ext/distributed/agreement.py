"""What the ranks must agree on for one reduction, and how the process-group path checks it.

A *descriptor* is one int64 word, non-negative and below ``2**62`` (so that ``[d, -d]`` rides in a
MAX): element count (bits 16-61), a NaN flag element (bit 15: the tensor is a float MAX or MIN staged
with it, see ``all_reduce._keeping_nans``, and named without it), dtype (bits 5-14), layout (bit 4: not
strided) and op (bits 0-3; 0: an op without a name). Every dtype of the installed torch has a code:
its place in a table of names that only grows (codes never change), or, for a dtype the table does
not name, a stable hash of its name into codes 256-1023; either way an error message names the dtype.

The process group (gloo aborts the process when the ranks send collectives of different sizes, NCCL
hangs or reads the wrong bytes) is checked by ``_Agreement``, which makes the wire symmetric before
sizes can differ, without an extra collective in the steady state. Its state is identical on every
rank by construction, because it only ever holds what every rank agreed on: the last ``_CONTEXT``
agreed descriptors (the *context*) and a table ``context -> the descriptor that followed it``. At
each reduction, the descriptor the table predicts for the current context (the same on every rank)
picks one of two paths:

- none (a context not seen yet), an op or dtype the flag below cannot ride in, or the debug mode: the
  *slow path* checks first, with one MAX all_reduce of ``[d, -d]`` (equal on every rank iff
  ``max(d) == min(d)``); only when they differ, an all_gather of one int64 per rank names every
  rank's descriptor and every rank raises. Then the payload's own all_reduce.
- a prediction: the *fast path* sends one all_reduce of the predicted op, dtype and element count
  plus one flag element. A rank whose tensor matches the prediction sends ``[tensor | normal flag]``,
  any other rank ``[zeros | mismatch flag]``; the op's reduction of the flags reveals whether any rank
  flagged (SUM, AVG, MAX, BOR: 0 normal, 1 mismatch; MIN, PRODUCT, BAND: 1 normal, 0 mismatch;
  dtypes where that sum or mean could wrap or round to 0, and BXOR or PREMUL_SUM, always take the
  slow path). The result is copied into the caller's tensor only when no rank flagged; on a flag,
  every rank (each sees it) runs the slow path's check, which raises naming the ranks, or, when
  every rank holds the same unpredicted tensor (a new sequence), reduces it and learns it.

A periodic sequence (SyncBatchNorm's layers, a flush every N steps) is predicted after its first
period and ``_CONTEXT`` reductions. Where a context is followed by different descriptors at
different times (a run of more than ``_CONTEXT`` equal layers), the ranks agree on a misprediction
and pay three collectives instead of one there. After torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``,
which checks every collective with an extra one (the slow path; here the opt-in debug mode).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__: list[str] = []  # the checks of all_reduce_: private, used through it only

_CONTEXT = 8  # agreed descriptors a prediction looks back on
_PREDICTIONS_MAX = 4096  # contexts a group remembers (then it forgets them all, on every rank alike)

_R = dist.ReduceOp
_OP_NAMES = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM")  # code: place + 1
_OP_CODES = {getattr(_R, name): code for code, name in enumerate(_OP_NAMES, 1) if hasattr(_R, name)}
_CODE_OPS = {code: op for op, code in _OP_CODES.items()}
_DTYPE_NAMES = (  # code: place + 1. Append only: a code never changes
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128", "complex32", "uint16", "uint32", "uint64", "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "qint8",
    "quint8", "qint32", "quint4x2", "quint2x4", "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
    *(f"int{bits}" for bits in range(1, 8)), *(f"uint{bits}" for bits in range(1, 8)),
)  # fmt: skip
_HASHED = 256  # codes 256-1023: dtypes the table does not name, by a stable hash of the name
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _dtype_code(name: str) -> int:
    if name in _DTYPE_NAMES:
        return _DTYPE_NAMES.index(name) + 1
    return _HASHED + zlib.crc32(name.encode()) % (1024 - _HASHED)


_DTYPE_CODES = {dtype: _dtype_code(name) for name, dtype in _TORCH_DTYPES.items()}
_CODE_NAMES = {_dtype_code(name): name for name in _TORCH_DTYPES}
_FLOAT, _COMPLEX = ("float64", "float32", "float16", "bfloat16"), ("complex128", "complex64", "complex32")
_WIDE, _NARROW = ("int64", "int32", "uint64", "uint32"), ("int16", "int8", "uint16", "uint8", "bool")
_FLAGS = {  # op -> (the flag of a rank that holds the predicted tensor, the dtypes the flag rides in)
    _R.SUM: (0, _FLOAT + _COMPLEX + _WIDE),  # a SUM of W flags in 8 or 16 bits could wrap to 0
    _R.AVG: (0, _FLOAT + _COMPLEX),  # an integer mean would round 1/W to 0
    _R.MAX: (0, _FLOAT + _WIDE + _NARROW),
    _R.BOR: (0, _WIDE + _NARROW),
    _R.MIN: (1, _FLOAT + _WIDE + _NARROW),
    _R.PRODUCT: (1, _FLOAT + _COMPLEX + _WIDE + _NARROW),
    _R.BAND: (1, _WIDE + _NARROW),
}
# (op, element count, the flag of a rank that holds the predicted tensor: as a number, as a (1,) tensor)
_Wire = tuple[Any, int, int, torch.Tensor]


def _descriptor(tensor: torch.Tensor, op: Any, nan_flag: bool = False) -> int:
    """What every rank must agree on for one reduction, as one int64 word (module docstring)."""
    dtype = _DTYPE_CODES.get(tensor.dtype) or _dtype_code(str(tensor.dtype).removeprefix("torch."))
    sparse = tensor.layout != torch.strided
    return tensor.numel() << 16 | nan_flag << 15 | dtype << 5 | sparse << 4 | _OP_CODES.get(op, 0)


def _describe(descriptor: int) -> str:
    """``"SUM of 9 float32"``: a descriptor in words (a tensor staged with a NaN flag, without it)."""
    op = _OP_NAMES[(descriptor & 0xF) - 1] if descriptor & 0xF else "another op"
    code = descriptor >> 5 & 0x3FF
    layout = " (not strided)" if descriptor >> 4 & 1 else ""
    numel = (descriptor >> 16) - (descriptor >> 15 & 1)
    return f"{op} of {numel} {_CODE_NAMES.get(code, f'dtype #{code}')}{layout}"


def _wire(descriptor: int, device: torch.device) -> _Wire | None:
    """How the fast path sends a reduction of ``descriptor``, or ``None``: always the slow path (a
    layout that is not strided, an op without a flag, a dtype the op's flags could wrap in)."""
    op, name = _CODE_OPS.get(descriptor & 0xF), _CODE_NAMES.get(descriptor >> 5 & 0x3FF)
    normal, dtypes = _FLAGS.get(op, (0, ()))
    if descriptor >> 4 & 1 or name not in dtypes:
        return None
    return op, descriptor >> 16, normal, torch.full((1,), normal, dtype=_TORCH_DTYPES[name], device=device)


def _check_agreement(descriptors: list[int], group: Any, transport: str) -> None:
    """Raise on every rank (each holds every rank's descriptor) unless the ranks reduce alike."""
    if len(set(descriptors)) == 1:
        return
    ranks = "; ".join(
        f"rank {dist.get_global_rank(group, r)}: {_describe(d)}" for r, d in enumerate(descriptors)
    )
    raise RuntimeError(
        f"all_reduce_ ({transport}): the {len(descriptors)} ranks of the group disagree on what they reduce "
        f"({ranks}). Every rank must run the same reductions in the same order, with tensors of the same "
        "dtype and element count. HINT: is a layer (its channel count) or a statistics collector "
        "configured differently on one rank?"
    )


@dataclass
class _Agreement:
    """The agreed history of one process group's reductions: identical on every rank by construction.

    Args:
        device: the group's collective device.
        check_every: the debug mode, agreed by the ranks: every reduction takes the slow path.
    """

    device: torch.device
    check_every: bool
    context: tuple[int, ...] = ()  # the last _CONTEXT agreed descriptors, oldest first
    predictions: dict[tuple[int, ...], tuple[int, _Wire | None]] = field(default_factory=dict)

    def all_reduce_(self, tensor: torch.Tensor, op: Any, descriptor: int, group: Any) -> None:
        """Reduce ``tensor`` (on ``device``) in place once every rank agreed on ``descriptor``; raise
        on every rank, before anything is published, when they do not (module docstring)."""
        context = self.context
        predicted, wire = (None, None) if self.check_every else self.predictions.get(context, (None, None))
        if wire is not None and self._send(tensor, descriptor == predicted, wire, group):
            self.context = (*context[1 - _CONTEXT :], predicted)
            return
        self._check(descriptor, group)
        if len(self.predictions) >= _PREDICTIONS_MAX:
            self.predictions.clear()
        self.predictions[context] = (descriptor, _wire(descriptor, self.device))
        self.context = (*context[1 - _CONTEXT :], descriptor)
        dist.all_reduce(tensor, op=op, group=group)

    def _send(self, tensor: torch.Tensor, hit: bool, wire: _Wire, group: Any) -> bool:
        """Fast path: one all_reduce of the predicted wire; whether no rank flagged (then ``tensor``
        holds the result). A rank that flagged always sees its own flag: every rank returns alike."""
        op, numel, normal, flag = wire
        if hit:
            buffer = torch.cat((tensor.detach().reshape(-1), flag))  # the staging copy
        else:
            buffer = torch.zeros(numel + 1, dtype=flag.dtype, device=self.device)
            buffer[numel] = 1 - normal
        dist.all_reduce(buffer, op=op, group=group)
        payload, reduced = buffer.split((numel, 1))
        if reduced.item() != normal:  # a host read (a device sync on CUDA)
            return False
        tensor.detach().copy_(payload.view(tensor.shape))
        return True

    def _check(self, descriptor: int, group: Any) -> None:
        """Slow path: one MAX all_reduce of ``[d, -d]``; when the ranks differ, an all_gather of one
        int64 per rank names every rank's descriptor, and every rank raises."""
        pair = torch.tensor([descriptor, -descriptor], dtype=torch.int64, device=self.device)
        dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=group)
        high, neg_low = pair.tolist()
        if high == -neg_low:
            return
        mine = pair[:1].fill_(descriptor)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        _check_agreement([int(d) for d in gathered], group, "process group")
