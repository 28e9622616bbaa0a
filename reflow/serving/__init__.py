"""An OpenAI-compatible endpoint over a rollout engine: ``engine_loop`` (one thread owns the engine),
``openai_api`` (the HTTP API's shapes and errors), ``chat`` (templates and tool calls), ``server`` (uvicorn on a
thread, a key per run). ``python -m reflow.serve`` serves a checkpoint with them."""
