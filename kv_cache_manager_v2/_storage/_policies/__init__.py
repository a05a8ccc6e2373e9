"""The eviction policies: one module each, named in ``_storage/_policy_registry.py`` (one line each); the
interface is ``Evictor`` (``_page.py``)."""
