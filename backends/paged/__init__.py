"""Generic paged attention: plan schema and the reference attention that reads it."""

from backends.paged.attention import paged_attention
from backends.paged.plan import PagedPlan

__all__ = ["PagedPlan", "paged_attention"]
