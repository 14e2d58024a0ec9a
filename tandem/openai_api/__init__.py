"""The OpenAI-compatible HTTP API of the scheduler and the router (docs/api.md).

``schema`` (pydantic bodies), ``convert`` (OpenAI <-> GenerateRequest/GenerateResponse,
pure), ``app`` (the FastAPI routes over a :class:`backend.Backend`), ``remote_images``
(the optional, guarded image fetcher) and ``http_server`` (uvicorn in the caller's loop).
The backends live in the services: the scheduler's runs the engine in-process, the
router's forwards to a cell over gRPC.
"""
