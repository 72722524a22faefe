"""The host expert pool: every routed expert of every MoE layer, in host memory (paper §3, §4.2).

The pool is the source of truth; the GPU holds only copies. Experts are stored as banks (one
tensor per expert weight kind: ``w13``, ``w2``, their scales for a quantized checkpoint and
bias banks when the model has them, as ``experts/formats.py`` describes) whose
leading index is the flattened layer–expert id ``l*E + e``, where ``l`` is the MoE layer's
ordinal (0 for the first MoE layer) and ``e`` its local expert id. Row ``l*E + e`` of every
bank together forms one complete expert.

Weights are loaded straight into the banks (each layer's parameters are views of its rows),
and the memory is pinned only afterwards (paper §3.3): pinning empty buffers first would
fault in and zero every page just to overwrite it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

GIB = 1 << 30

# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every context and mapped
# into the device address space, so kernels can read it through UVA.
_CUDA_HOST_REGISTER_FLAGS = 1 | 2


PAGE = 4096


def _clear_cuda_error() -> None:
    """Consume the CUDA runtime's last error after a failed ``cudaHostRegister``.

    torch's binding (``torch.cuda.cudart().cudaHostRegister``) returns the error code but
    leaves it as the thread's last error, and the next kernel launch's check
    (``C10_CUDA_KERNEL_LAUNCH_CHECK``, which calls ``cudaGetLastError``) would raise it as
    ``CUDA error: invalid argument`` from an unrelated op. A tiny launch here reads and clears
    it; the error is not sticky, so the context stays usable.
    """
    try:
        torch.full((1,), 1, device="cuda")
    except Exception:  # noqa: BLE001 - the stale error, consumed by this launch's check
        pass
    torch.cuda.synchronize()


_CUDA_ERRORS = {1: "invalid argument", 2: "out of memory", 712: "already registered",
                801: "operation not supported"}


def _cuda_error_name(cudart, code: int) -> str:
    try:
        return str(cudart.cudaGetErrorString(code))
    except Exception:  # noqa: BLE001 - the binding takes only its own enum values
        return _CUDA_ERRORS.get(code, "see cudaError_t")


def _page_aligned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor whose first byte is page-aligned (torch's CPU allocator
    aligns to 64 bytes), so FTW's O_DIRECT reads land straight in the bank
    (``experts/ftw.py``)."""
    n = 1
    for d in shape:
        n *= int(d)
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    # device="cpu" explicitly: SGLang builds the model under a CUDA default device.
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, device="cpu")
    off = (-raw.data_ptr()) % PAGE
    return raw[off:off + nbytes].view(dtype).view(shape)


@dataclass(frozen=True)
class BankSpec:
    """One bank: the per-expert shape and dtype of a weight kind."""

    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


class _UvaArray:
    """``__cuda_array_interface__`` of pinned host memory, so torch sees it as a CUDA tensor
    (the device reads it over PCIe through unified virtual addressing)."""

    def __init__(self, ptr: int, shape: Tuple[int, ...], typestr: str):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


class HostExpertPool:
    """All routed experts of all MoE layers as host banks with leading index ``l*E + e``.

    Args:
        moe_layer_ids: the transformer layer ids of the MoE layers, in order; layer id
            ``moe_layer_ids[l]`` has ordinal ``l``.
        num_experts: routed experts per MoE layer (E).
        specs: bank name -> BankSpec.

    The banks are allocated pageable and untouched (no page is faulted in until a weight is
    loaded into it). ``pin()`` registers them with CUDA afterwards.
    """

    def __init__(
        self,
        moe_layer_ids: Sequence[int],
        num_experts: int,
        specs: Dict[str, BankSpec],
    ):
        self.moe_layer_ids: List[int] = list(moe_layer_ids)
        self.ordinal_of_layer = {lid: i for i, lid in enumerate(self.moe_layer_ids)}
        self.num_layers = len(self.moe_layer_ids)
        self.num_experts = num_experts
        self.specs = dict(specs)
        rows = self.num_layers * num_experts
        self.banks: Dict[str, torch.Tensor] = {
            name: _page_aligned_empty((rows, *spec.shape), spec.dtype)
            for name, spec in self.specs.items()
        }
        self.pinned = False
        self.pin_error: Optional[str] = None  # CUDA's answer when pin() failed
        self.pin_error_code: Optional[int] = None
        self._registered_ptrs: List[int] = []
        self.device_banks: Dict[str, torch.Tensor] = {}

    # ---- layout -------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """L*E: the number of (layer, expert) pairs."""
        return self.num_layers * self.num_experts

    @property
    def expert_bytes(self) -> int:
        """Bytes of one complete expert across all banks (S in paper Eq. 3)."""
        return sum(spec.row_bytes for spec in self.specs.values())

    @property
    def nbytes(self) -> int:
        return self.expert_bytes * self.num_rows

    def ordinal(self, layer_id: int) -> int:
        """The MoE ordinal ``l`` of transformer layer ``layer_id``.

        Raises:
            KeyError: ``layer_id`` is not an MoE layer of this pool.
        """
        try:
            return self.ordinal_of_layer[layer_id]
        except KeyError:
            raise KeyError(
                f"layer {layer_id} is not one of the MoE layers {self.moe_layer_ids}"
            ) from None

    def flat_id(self, layer_id: int, expert: int) -> int:
        """``l*E + e`` of expert ``expert`` of transformer layer ``layer_id``."""
        return self.ordinal(layer_id) * self.num_experts + expert

    def layer_rows(self, name: str, layer_id: int) -> torch.Tensor:
        """Rows ``[l*E, (l+1)*E)`` of bank ``name``: a view, shape ``[E, *spec.shape]``."""
        l = self.ordinal(layer_id)
        return self.banks[name][l * self.num_experts : (l + 1) * self.num_experts]

    # ---- pinning ------------------------------------------------------------------------
    def pin(self) -> bool:
        """Page-lock every bank in place (``cudaHostRegister``) and map it for UVA reads.

        Returns True when pinned. When CUDA refuses (memlock limit: error 2; no CUDA), the
        banks stay pageable, nothing is raised, and ``pin_error`` / ``pin_error_code`` say
        what CUDA answered (the runtime refuses to start on it: a GPU cache cannot fill from
        pageable memory).
        """
        if self.pinned:
            return True
        if not torch.cuda.is_available():
            self.pin_error, self.pin_error_code = "no CUDA device", None
            return False
        cudart = torch.cuda.cudart()
        for name, bank in self.banks.items():
            nbytes = bank.numel() * bank.element_size()
            if nbytes == 0:
                continue
            code = self._register(cudart, bank.data_ptr(), nbytes)
            if code:
                self.unpin()
                self.pin_error_code = code
                self.pin_error = (
                    f"cudaHostRegister error {code}, {_cuda_error_name(cudart, code)}, on bank "
                    f"{name}: {nbytes / GIB:.1f} GiB at address {bank.data_ptr():#x}"
                )
                return False
        self.pinned = True
        self.pin_error = self.pin_error_code = None
        self.device_banks = {
            name: self._uva_view(bank) for name, bank in self.banks.items()
        }
        return True

    def _register(self, cudart, ptr: int, nbytes: int) -> int:
        """``cudaHostRegister`` one range: 0, or CUDA's error code (the error consumed)."""
        err = cudart.cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_FLAGS)
        code = int(err.value) if hasattr(err, "value") else int(err)
        if code == 0:
            self._registered_ptrs.append(ptr)
        else:
            _clear_cuda_error()
        return code

    def unpin(self) -> None:
        """Undo ``pin`` (used when pinning fails part way)."""
        if not self._registered_ptrs:
            return
        cudart = torch.cuda.cudart()
        for ptr in self._registered_ptrs:
            cudart.cudaHostUnregister(ptr)
        self._registered_ptrs = []
        self.device_banks = {}
        self.pinned = False

    @staticmethod
    def _uva_view(bank: torch.Tensor) -> torch.Tensor:
        """A CUDA tensor aliasing the pinned host bank (device reads go over PCIe)."""
        raw, typestr = {
            1: (torch.uint8, "|u1"), 2: (torch.int16, "<i2"), 4: (torch.int32, "<i4"),
            8: (torch.int64, "<i8"),
        }[bank.element_size()]
        raw = bank.view(raw)
        alias = torch.as_tensor(
            _UvaArray(raw.data_ptr(), tuple(raw.shape), typestr), device="cuda"
        )
        return alias.view(bank.dtype)

    def describe(self) -> str:
        banks = ", ".join(
            f"{n}{list(s.shape)}:{str(s.dtype).replace('torch.', '')}"
            for n, s in self.specs.items()
        )
        return (
            f"{self.num_layers} MoE layers x {self.num_experts} experts = {self.num_rows} "
            f"experts of {self.expert_bytes / (1 << 20):.2f} MiB ({banks}), "
            f"{self.nbytes / GIB:.2f} GiB, {'pinned' if self.pinned else 'pageable'}"
        )


def bank_specs_for_layer(
    hidden_size: int,
    intermediate_size: int,
    dtype: torch.dtype,
    is_gated: bool = True,
    with_bias: bool = False,
) -> Dict[str, BankSpec]:
    """The banks of an unquantized ``FusedMoE`` layer, with SGLang's own layouts
    (``UnquantizedFusedMoEMethod.create_weights``): ``w13 [2I, H]`` (gate rows then up
    rows), ``w2 [H, I]``, and fp32 ``w13_bias [2I]`` / ``w2_bias [H]`` when present."""
    up = 2 * intermediate_size if is_gated else intermediate_size
    specs = {
        "w13_weight": BankSpec((up, hidden_size), dtype),
        "w2_weight": BankSpec((hidden_size, intermediate_size), dtype),
    }
    if with_bias:
        specs["w13_weight_bias"] = BankSpec((up,), torch.float32)
        specs["w2_weight_bias"] = BankSpec((hidden_size,), torch.float32)
    return specs


def pool_fits_host(nbytes: int) -> Optional[str]:
    """A message if ``nbytes`` exceeds the host's available memory, else None."""
    try:
        import psutil

        avail = psutil.virtual_memory().available
    except Exception:
        return None
    if nbytes > avail:
        return (
            f"the host expert pool needs {nbytes / GIB:.1f} GiB but only "
            f"{avail / GIB:.1f} GiB of host memory is available"
        )
    return None
