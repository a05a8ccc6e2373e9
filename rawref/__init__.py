"""Non-owning references usable from mypyc-compiled code (see ``_rawref.c``)."""

from rawref._rawref import NULL, ref, untrack

__all__ = ["NULL", "ref", "untrack"]
