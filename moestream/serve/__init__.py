"""OpenAI-compatible HTTP server: request/response schemas, the single engine worker, the FastAPI app.

`create_app(runtime, model_id)` builds the app; `moestream serve` (cli.py) runs it under uvicorn.
FastAPI and uvicorn come with the `serve` extra: `pip install 'moestream[serve]'`.
"""
