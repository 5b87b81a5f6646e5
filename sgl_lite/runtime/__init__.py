"""The runtime: one folder per layer, lowest first (docs/architecture.md has the map).

protocol.py and server_args.py (wire format, flags), client/ (torch-free RuntimeClient), mem_cache/
(KV pool, radix tree), layers/ and models/ (attention backends, Llama family), sampling/ (sampler,
grammars), model_executor/ (loader, forward batch, runner, TP), managers/ (requests, policies,
scheduler), server/ (the process: RuntimeCore, transport, Engine). protocol, server_args and client
never import torch; tests/test_layering.py checks the import directions.
"""
