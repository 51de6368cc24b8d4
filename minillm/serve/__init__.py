"""`minillm serve`: an OpenAI-compatible HTTP server over the engine.

    async_engine.py   the engine stepped by a background thread, fed by async handlers
    protocol.py       the request bodies accepted, mapped onto SamplingParams
    chat_template.py  chat messages -> a prompt, with the model's Jinja2 template
    metrics.py        Prometheus metrics with vLLM's names
    api_server.py     the FastAPI routes
    server.py         run_server / start_server (in-process) and serve_forever (the CLI)

Needs the `serve` extra (FastAPI, uvicorn, prometheus-client, Jinja2): the engine alone
does not, so nothing here is imported by `import minillm`.
"""

from minillm.serve.server import RunningServer, make_server_app, run_server, start_server

__all__ = ["RunningServer", "make_server_app", "run_server", "start_server"]
