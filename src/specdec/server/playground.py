"""The playground: a chat page and a live dashboard at `GET /` (static/), and the read-only JSON of
the machine's measured costs it shows (`GET /v1/specdec/costs`).

The page is three files shipped in the package, served as they are: no build step, nothing
fetched from elsewhere (its Content-Security-Policy allows only this origin). Its files need no
key, as a browser cannot send one when it opens a page; everything it reads afterwards (the
completions, /metrics, the costs) is fetched with the key the user enters.
"""
from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from starlette.responses import Response

from specdec.backends.cost_model import CostModel
from specdec.server.errors import json_response
from specdec.server.serving import state_of

STATIC_FILES = {  # path -> (file in static/, content type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
    "/static/playground.css": ("playground.css", "text/css; charset=utf-8"),
}
PAGE_PATHS = frozenset(STATIC_FILES)  # open without a key (app.py, deploy/proxy.py)
COSTS_PATH = "/v1/specdec/costs"
HEADERS = {
    # Only this origin: the page fetches nothing from outside, and no injected text can run.
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a server moved onto a newer specdec serves its page at once
}

router = APIRouter()


def _static(name: str) -> bytes:
    return resources.files("specdec.server").joinpath("static").joinpath(name).read_bytes()


def _file_route(path: str, name: str, media_type: str) -> None:
    async def serve() -> Response:
        return Response(_static(name), media_type=media_type, headers=HEADERS)

    router.add_api_route(path, serve, methods=["GET"], include_in_schema=False, name=f"playground {name}")


for _path, (_name, _media_type) in STATIC_FILES.items():
    _file_route(_path, _name, _media_type)


def costs_of(cost: CostModel) -> dict:
    """t(1) and v(n) = t(n)/t(1) as `auto` prices them now (updated online from real rounds)."""
    # A copy: the scheduler's thread updates the model while this reads it.
    snapshot = CostModel(dict(cost.target_seconds), cost.draft_step_seconds, cost.draft_prefill_seconds)
    table = snapshot.as_dict()
    return {**table, "v": {str(n): v for n, v in table["v"].items()}, "summary": snapshot.summary()}


@router.get(COSTS_PATH, summary="The machine's measured costs: t(1), v(n) = t(n)/t(1), the draft step; slots")
async def costs(request: Request) -> Response:
    engine = state_of(request).engine
    cost = engine.cost_model
    measured = {"calibrated": False} if cost is None else {"calibrated": True, **costs_of(cost)}
    return json_response({**measured, "slots": len(engine.slots)})
