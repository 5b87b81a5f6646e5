"""The disk tier under the radix tree (`--enable-hierarchical-cache`): KV blocks keyed by their token prefix,
kept in files that outlive the pool's evictions and the server's restarts."""
