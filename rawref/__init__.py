"""Non-owning references usable from mypyc-compiled code (see ``_rawref.c``)."""

from rawref._rawref import NULL, fresh, invalidate, ref, untrack

__all__ = ["NULL", "fresh", "invalidate", "ref", "untrack"]
