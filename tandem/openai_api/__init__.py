"""The OpenAI-compatible HTTP API of the scheduler (docs/api.md).

``schema`` (pydantic bodies), ``convert`` (OpenAI <-> GenerateRequest/GenerateResponse,
pure), ``app`` (the FastAPI routes over a :class:`backend.Backend`), ``remote_images``
(the optional, guarded image fetcher) and ``http_server`` (uvicorn in the caller's loop).
The backend lives in the service: the scheduler's runs the engine in-process.
"""
