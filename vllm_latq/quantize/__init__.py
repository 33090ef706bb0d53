"""Offline quantization: the paper's algorithms (this package's public API) and the
pipeline that applies them to a Hugging Face model.

``W`` is ``[out, in]`` (torch layout), ``H = XᵀX`` is ``[in, in]``. See the README's
"Python API" section for the contract.
"""
from .hptq import hptq, hrtn
from .lattice import error_bound, ldl_diag, min_pivot_order
from .result import CSR, QuantResult
from .solvers import babai, gptq, rtn
from .ssqr import ssqr

__all__ = ["rtn", "gptq", "babai", "ssqr", "hptq", "hrtn", "min_pivot_order", "error_bound",
           "ldl_diag", "QuantResult", "CSR"]
