"""The HTTP front of a runtime: OpenAI-compatible (/v1/chat/completions, /v1/completions, /v1/models)
and SGLang-native (/generate, /flush_cache, /health, /metrics) routes, plus the worker routes that
sglang-router calls (worker_api.py: /server_info, /model_info, /get_load, /health_generate).

It reaches the runtime only through `sgl_lite.runtime.client.RuntimeClient`. Build the app with
`sgl_lite.http.app.create_app(client)`; start a server with `sgl_lite.http.launch` (run_http_server, HttpServerThread,
HttpFront, the `http` click command).
"""
