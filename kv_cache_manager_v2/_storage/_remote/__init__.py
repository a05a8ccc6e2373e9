"""The remote tier's store: content-addressed pages in Redis (or Valkey), shared by many managers.

One key per page (one block of one layer group): ``kvcm:<namespace>:<layout fingerprint>:<layer
group>:<block key hex>``, where the block key is the SHA-256 reuse key (so scopes, salts and LoRA
adapters never share) and the fingerprint covers the model layout, so different models or layouts
never share either. A value is a 96-byte header (magic, format version, layer group, fingerprint,
block key, payload length, CRC-32 of the payload, the block's retention) then the slot's bytes of every
pool of the page's pool group. A value that is missing, truncated, foreign or corrupted is a miss, never bad KV.

Reads (``lookup``: one round trip returning every key's length; ``fetch``: one MGET) run on the
scheduler's thread, each call's replies bounded by one deadline of ``timeout_ms`` (``ReplyReader``
reads them from the socket; a cluster gives each node its own). Writes are queued (a bounded
deque; what does not fit is dropped and counted) and sent by a background thread in pipelined
batches. A failed round trip (no answer in time, a broken connection, or a reply of the wrong shape:
``BadReply``) marks the server down for ``retry_interval_ms``: meanwhile lookups are misses without
network traffic and queued writes are dropped. Nothing raises into the engine.

A cluster (``redis+cluster://``: Redis Cluster, Valkey cluster) is served by ``ClusterRouter``: keys
are grouped by hash slot (CRC-16 of the key, or of its ``{tag}``, mod 16384), one command per slot
group (STRLEN or the Lua lookup, MGET, MSET or SET), pipelined to each slot's master: every master
is sent its commands before any reply is read, so a lookup, a fetch or a write batch costs one round
trip to each node concerned, in parallel. ``MOVED`` updates the slot map (re-read from the cluster)
and ``ASK`` follows the migration with ``ASKING``, both retried at once. A node that fails counts as
down for ``retry_interval_ms``: lookups of its keys are misses and writes to it are dropped (counted),
while the other nodes keep serving.
"""
