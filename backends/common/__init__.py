"""What every paged backend shares: the staged batch inputs and the generic metadata ops.

Importing the package registers the generic ops (``ops``), whose ``torch``
providers (``torch_ref``) are the exact references and whose ``triton``
providers (``triton_kernels``) are the fast path, bit-equal to them.
"""

from backends.common import ops  # noqa: F401  (registers the generic ops)
