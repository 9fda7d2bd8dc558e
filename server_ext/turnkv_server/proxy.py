"""A minimal prefill-then-decode proxy over vLLM's built-in NixlConnector (pull).

This is the `standard` P/D path that deployments run today: round robin over prefill/decode
pairs, no session reuse. The prefill engine computes the prompt with ``max_tokens=1`` and
returns ``kv_transfer_params`` naming its blocks; the decode engine pulls them over NIXL and
generates. It is the baseline that the session router replaces.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

# What the prefill engine is told: compute the prompt, keep its blocks for a remote decode.
PREFILL_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Fields that would make a one-token prefill request fail or do needless work.
_DROP_FOR_PREFILL = ("stream_options", "min_tokens", "max_completion_tokens")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill engine gets: the same prompt, one token, no streaming."""
    out = copy.deepcopy(body)
    for key in _DROP_FOR_PREFILL:
        out.pop(key, None)
    out["max_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = dict(PREFILL_TRANSFER_PARAMS)
    return out


def decode_body(body: dict[str, Any], transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    out = dict(body)
    out["kv_transfer_params"] = transfer_params
    return out


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "code": status}}
    )


def create_app(prefill: list[str], decode: list[str]) -> FastAPI:
    if not prefill or not decode:
        raise ValueError("the proxy needs at least one prefill and one decode engine")
    # Independent round robins, as upstream's example proxy does: no affinity of any kind.
    prefill_cycle, decode_cycle = itertools.cycle(prefill), itertools.cycle(decode)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="turnkv standard P/D proxy", lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> Response:
        upstream = await client.get(f"{decode[0]}/v1/models")
        return Response(upstream.content, upstream.status_code,
                        media_type="application/json")

    async def relay(request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        if body.get("n", 1) != 1:
            return _error(400, "n > 1 is not supported by the P/D proxy")
        prefill_url, decode_url = next(prefill_cycle), next(decode_cycle)
        headers = {"X-Request-Id": str(uuid.uuid4())}
        auth = request.headers.get("authorization")
        if auth:
            headers["Authorization"] = auth

        first = await client.post(f"{prefill_url}{path}", json=prefill_body(body),
                                  headers=headers)
        if first.status_code != 200:
            return Response(first.content, first.status_code, media_type="application/json")
        params = first.json().get("kv_transfer_params")
        second = decode_body(body, params)

        if not body.get("stream"):
            upstream = await client.post(f"{decode_url}{path}", json=second, headers=headers)
            return Response(upstream.content, upstream.status_code,
                            media_type="application/json")

        upstream_req = client.build_request("POST", f"{decode_url}{path}", json=second,
                                            headers=headers)
        upstream_resp = await client.send(upstream_req, stream=True)
        if upstream_resp.status_code != 200:
            content = await upstream_resp.aread()
            await upstream_resp.aclose()
            return Response(content, upstream_resp.status_code, media_type="application/json")

        async def chunks() -> AsyncIterator[bytes]:
            # Closing the upstream stream when the client goes away makes vLLM abort the
            # request and free its blocks.
            try:
                async for chunk in upstream_resp.aiter_raw():
                    yield chunk
            finally:
                await upstream_resp.aclose()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await relay(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await relay(request, "/v1/completions")

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prefill", action="append", required=True, help="prefill engine URL")
    parser.add_argument("--decode", action="append", required=True, help="decode engine URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    uvicorn.run(create_app(args.prefill, args.decode), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
