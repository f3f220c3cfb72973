"""cedserve: disaggregated prefill/decode serving for DeepSeek-V4.1-Flash-class (CED) models.

Importing this package has no side effects and needs no GPU: GPU-only and optional packages (NIXL,
Triton kernels, Ray, the Kubernetes client) are imported lazily by the parts that use them.
"""

__version__ = "0.1.0"
