"""The router in front of a disaggregated vLLM deployment over kvferry.

Pull mode (the default): each completion request goes to a prefill engine with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``; the prefill answers
with the ``kv_transfer_params`` that say where its kvferry node is and which room holds the
prompt's KV. The original request then goes to a decode engine with those parameters, and
the decode's answer (streamed or not) goes back to the client. A prefill that fails or cannot
be reached answers the client with 502 and the reason; nothing waits forever
(``--timeout``)::

    python -m kvferry.vllm_proxy --port 8000 \\
        --prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200

Push mode (``--push``, each prefill given as ``URL=HOST:PORT`` with its kvferry listener, or
``URL=HOST:PORT,HOST:PORT,...`` with one per TP rank in rank order, or for a pipeline-parallel
prefill ``URL=pp=N,HOST:PORT,...`` with one per worker, stage-major: stage s, rank r at
s x TP + r):
the router draws the room and sends the request to both engines at once; the decode opens
the room over its blocks while the prefill computes, and the prefill sends each step's blocks
layer by layer as its forward pass writes them. If the prefill fails, the decode's room
fails and vLLM recomputes the prompt there.

Prefills and decodes are taken round-robin.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import secrets
import uuid

from aiohttp import ClientError, ClientSession, ClientTimeout, web

from kvferry._addrs import socket_addr

logger = logging.getLogger("kvferry.vllm_proxy")

#: The bit of a room id that says a router drew it (push mode); ``kvferry.vllm.PUSH_BIT``,
#: written out so that the proxy runs without vLLM installed.
PUSH_BIT = 1 << 62


def parse_prefill(spec: str) -> tuple[str, list[str] | None, int]:
    """``URL``, ``URL=HOST:PORT,...`` or ``URL=pp=N,HOST:PORT,...``: the prefill's base URL,
    its workers' kvferry listeners (None if not named) and its pipeline stage count."""
    if "=" not in spec:
        return spec, None, 1
    url, _, rest = spec.partition("=")
    items = [a.strip() for a in rest.split(",") if a.strip()]
    pp = 1
    if items and items[0].startswith("pp="):
        try:
            pp = int(items[0][3:])
        except ValueError:
            raise ValueError(f"--prefill {spec!r}: {items[0]!r} is not pp=STAGES") from None
        items = items[1:]
    if not items:
        raise ValueError(f"--prefill {spec!r} names no kvferry listener")
    if pp < 1 or len(items) % pp:
        raise ValueError(f"--prefill {spec!r}: {len(items)} listeners do not split into {pp} equal stages")
    for a in items:
        if not socket_addr(a):
            # A decode dials listeners by address only: it would refuse every room.
            raise ValueError(f"--prefill {spec!r}: {a!r} is not an ip:port ([v6]:port) kvferry listener")
    return url, items, pp


def push_params(room: int, kv_addrs: list[str], pp: int) -> tuple[dict, dict]:
    """The ``kv_transfer_params`` of a push room: the prefill's, then the decode's."""
    decode = {"do_remote_prefill": True, "kvferry_push": True, "kvferry_room": room,
              "kvferry_addrs": list(kv_addrs)}
    if pp > 1:
        decode["kvferry_pp"] = pp
    return {"do_remote_decode": True, "kvferry_push": True, "kvferry_room": room}, decode


def prefill_body(body: dict, params: dict) -> dict:
    """The request a prefill computes: the prompt, one token, no streaming."""
    p = dict(body)
    p["kv_transfer_params"] = params
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        p.pop(key, None)
    return p


class Router:
    """Round-robin over the prefill and decode engines."""

    def __init__(self, prefills: list[str], decodes: list[str], timeout: float, push: bool = False):
        # "URL=HOST:PORT" names a prefill's kvferry listener too, which push mode needs.
        parsed = [parse_prefill(p) for p in prefills]
        if push and any(kv is None for _, kv, _ in parsed):
            raise ValueError("--push needs every --prefill as URL=KVFERRY_HOST:PORT")
        self._push = push
        self._prefills = itertools.cycle(parsed)
        self._decodes = itertools.cycle(decodes)
        self._timeout = ClientTimeout(total=timeout)
        self._session: ClientSession | None = None

    async def start(self, _app) -> None:
        self._session = ClientSession(timeout=self._timeout)

    async def stop(self, _app) -> None:
        if self._session is not None:
            await self._session.close()

    async def route(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return web.json_response({"error": f"the request is not JSON: {e}"}, status=400)
        headers = {"X-Request-Id": request.headers.get("X-Request-Id") or str(uuid.uuid4())}
        prefill, kv_addrs, pp = next(self._prefills)
        if self._push:
            return await self._push_route(request, body, headers, prefill, kv_addrs, pp)
        return await self._pull_route(request, body, headers, prefill)

    async def _pull_route(self, request, body, headers, prefill) -> web.StreamResponse:
        assert self._session is not None
        pre = prefill_body(body, {"do_remote_decode": True, "do_remote_prefill": False})
        try:
            async with self._session.post(prefill + request.path, json=pre, headers=headers) as r:
                if r.status != 200:
                    text = await r.text()
                    return web.json_response(
                        {"error": f"prefill {prefill} answered {r.status}: {text[:500]}"}, status=502
                    )
                answer = await r.json()
        except (ClientError, TimeoutError) as e:
            return web.json_response({"error": f"prefill {prefill} failed: {e!r}"}, status=502)
        params = answer.get("kv_transfer_params")
        if params:
            body = dict(body, kv_transfer_params=params)
        else:
            logger.warning("prefill %s returned no kv_transfer_params: decode computes the prompt", prefill)
        return await self._decode(request, body, headers)

    async def _push_route(self, request, body, headers, prefill, kv_addrs, pp) -> web.StreamResponse:
        assert self._session is not None
        room = PUSH_BIT | (secrets.randbits(32) or 1)
        to_prefill, to_decode = push_params(room, kv_addrs, pp)
        pre = prefill_body(body, to_prefill)
        body = dict(body, kv_transfer_params=to_decode)

        async def compute() -> None:
            try:
                async with self._session.post(prefill + request.path, json=pre, headers=headers) as r:
                    if r.status != 200:
                        # The decode's room fails with the prefill's abort: it recomputes.
                        logger.warning("prefill %s answered %d: %s", prefill, r.status, (await r.text())[:500])
                    else:
                        await r.read()
            except (ClientError, TimeoutError) as e:
                logger.warning("prefill %s failed: %r", prefill, e)

        task = asyncio.ensure_future(compute())
        try:
            return await self._decode(request, body, headers)
        finally:
            await task

    async def _decode(self, request, body, headers) -> web.StreamResponse:
        assert self._session is not None
        decode = next(self._decodes)
        try:
            async with self._session.post(decode + request.path, json=body, headers=headers) as r:
                out = web.StreamResponse(status=r.status, headers={
                    "Content-Type": r.headers.get("Content-Type", "application/json")})
                await out.prepare(request)
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (ClientError, TimeoutError) as e:
            return web.json_response({"error": f"decode {decode} failed: {e!r}"}, status=502)


def app(prefills: list[str], decodes: list[str], timeout: float = 600.0, push: bool = False) -> web.Application:
    """The proxy as an aiohttp application."""
    router = Router(prefills, decodes, timeout, push)
    a = web.Application()
    a.on_startup.append(router.start)
    a.on_cleanup.append(router.stop)
    a.router.add_post("/v1/completions", router.route)
    a.router.add_post("/v1/chat/completions", router.route)
    a.router.add_get("/health", lambda _: web.Response(text="ok"))
    return a


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", action="append", required=True,
                    help="a prefill engine's base URL, or URL=HOST:PORT,... with its workers' kvferry "
                         "listeners (push mode; URL=pp=N,HOST:PORT,... for N pipeline stages, stage-major)")
    ap.add_argument("--decode", action="append", required=True, help="a decode engine's base URL")
    ap.add_argument("--push", action="store_true",
                    help="tell both engines the room at once: the prefill sends each layer as it is computed")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take in all")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    try:
        application = app(args.prefill, args.decode, args.timeout, args.push)
    except ValueError as e:
        ap.error(str(e))
    web.run_app(application, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
