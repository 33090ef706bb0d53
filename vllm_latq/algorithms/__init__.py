"""The paper's algorithms, the package's Python API: GPTQ and Babai as one back substitution, the
min-pivot order, the certificate ¼·sᵀDs, SSQR and HPTQ; ``W`` is ``[out, in]``, ``H`` ``[in, in]``."""
from .hptq import hptq, hrtn
from .lattice import error_bound, ldl_diag, min_pivot_order
from .result import CSR, QuantResult
from .solvers import babai, gptq, rtn
from .ssqr import ssqr

__all__ = ["rtn", "gptq", "babai", "ssqr", "hptq", "hrtn", "min_pivot_order", "error_bound",
           "ldl_diag", "QuantResult", "CSR"]
