"""/openapi.json, Swagger UI (/docs) and ReDoc (/redoc), behind the API key when one is set.

The pages' scripts and styles come from the fastapi-offline package (kept current with Swagger UI and
ReDoc releases) and are served from here, so the pages work with no internet access: FastAPI's own pages
load them from a CDN.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from starlette.responses import FileResponse, HTMLResponse, Response

from embed_service.api.errors import APIError
from embed_service.api.routes import Authorized, json_response

ASSETS = Path(fastapi_offline.__file__).parent / "static"
ASSET_TYPES = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "redoc.standalone.js": "text/javascript",
    "favicon.png": "image/png",
}

router = APIRouter(include_in_schema=False)


def _root(request: Request) -> str:
    return str(request.scope.get("root_path", ""))


@router.get("/openapi.json")
async def openapi(request: Request, _: Authorized) -> Response:
    return json_response(request.app.openapi())


@router.get("/docs")
async def swagger_ui(request: Request, _: Authorized) -> HTMLResponse:
    root = _root(request)
    return get_swagger_ui_html(
        openapi_url=f"{root}/openapi.json",
        title=f"{request.app.title} - Swagger UI",
        swagger_js_url=f"{root}/docs/assets/swagger-ui-bundle.js",
        swagger_css_url=f"{root}/docs/assets/swagger-ui.css",
        swagger_favicon_url=f"{root}/docs/assets/favicon.png",
    )


@router.get("/redoc")
async def redoc(request: Request, _: Authorized) -> HTMLResponse:
    root = _root(request)
    return get_redoc_html(
        openapi_url=f"{root}/openapi.json",
        title=f"{request.app.title} - ReDoc",
        redoc_js_url=f"{root}/docs/assets/redoc.standalone.js",
        redoc_favicon_url=f"{root}/docs/assets/favicon.png",
        with_google_fonts=False,
    )


@router.get("/docs/assets/{name}")
async def asset(name: str, _: Authorized) -> Response:
    if name not in ASSET_TYPES:
        raise APIError(404, f"no asset {name!r}", "not_found_error")
    return FileResponse(ASSETS / name, media_type=ASSET_TYPES[name])
