"""Layer kinds: what each kind of layer keeps per request, one policy class per kind,
and the registry that sorts a model's layers into layer groups.

A new kind is one module here (a :class:`~._policy.LayerGroup` subclass with its ``from_layer``)
plus its line in ``kv_cache_manager_v2._life_cycle_registry.LAYER_KINDS``.
"""
