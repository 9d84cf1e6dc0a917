"""The chat page `petals-chain api` serves at `/`: plain HTML, CSS and JavaScript shipped in the
package (petals_chain/api/static/; no CDN, no build step), talking to the gateway's own OpenAI
endpoint (`/v1/models`, streamed `/v1/chat/completions`) with the API key the user types in when the
gateway has keys.

Each turn sends the whole conversation; the swarm's servers keep the prompts' KV in their prefix
caches (server/prefix_cache.py), so a turn's session starts past what an earlier turn already
computed, and the page shows how many prompt tokens were reused (`usage.prompt_tokens_details.
cached_tokens`), the chain that served the answer (the finishing chunk's `petals_chain` field) and
the tokens per second it measured. A Content-Security-Policy of 'self' keeps the page from loading
anything from elsewhere.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

STATIC = {
    "/chat/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/chat/chat.css": ("chat.css", "text/css; charset=utf-8"),
}
PATHS = frozenset({"/", *STATIC})
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _read(name: str) -> str:
    return (resources.files("petals_chain.api") / "static" / name).read_text(encoding="utf-8")


def add_routes(app: FastAPI, *, enabled: bool, api_key_required: bool) -> None:
    if not enabled:

        async def running():
            # a plain answer at / still tells Ollama clients (which probe it) that the server is up
            return PlainTextResponse("petals-chain gateway is running (chat page off: --no-chat-page)\n")

        app.add_api_route("/", running, methods=["GET", "HEAD"], include_in_schema=False)
        return
    # read once: the files are part of the package and do not change while it runs
    html = _read("chat.html").replace(
        'data-key-required="false"', f'data-key-required="{"true" if api_key_required else "false"}"'
    )
    files = {path: (_read(name), media) for path, (name, media) in STATIC.items()}
    headers = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}

    async def page():
        return Response(html, media_type="text/html; charset=utf-8", headers=headers)

    app.add_api_route("/", page, methods=["GET", "HEAD"], include_in_schema=False)

    def serve(text: str, media: str):
        async def static():
            return Response(text, media_type=media, headers=headers)

        return static

    for path, (text, media) in files.items():
        app.add_api_route(path, serve(text, media), methods=["GET", "HEAD"], include_in_schema=False)
