"""Graph templates of the cached-chunk prefill: bucket grids, capture/replay backends, and the
per-step choice and replay of a template."""
