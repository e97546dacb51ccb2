"""The chunk cache: content keys, the pool of cached sys and chunk KV with its eviction policies
and tiers (host memory, a directory), the host-side plan of a step's chunk work, and the
token-granular KV slot copies it asks of the device."""
