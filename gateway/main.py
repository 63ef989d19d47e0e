"""`dgr serve`: load the served models' vocabularies and templates, read the API keys, run uvicorn."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from .app import MAX_BODY_BYTES, ServeConfig, make_app, serve_producer
from .guard import ClientBounds, guarded_protocol
from .text import TextModel

log = logging.getLogger("dgr.serve")


def read_api_keys(path: Path | None, env: str | None) -> dict[str, str]:
    """Bearer keys -> account ids: lines `KEY ACCOUNT` in a file (`#` comments), and/or `KEY=ACCOUNT,...` in the
    environment (DGR_API_KEYS). An account id is a dgr id (the accounting hashes are named by it)."""
    from producer.validate import check_id

    pairs: list[tuple[str, str]] = []
    if path is not None:
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                key, _, account = line.partition(" ")
                pairs.append((key.strip(), account.strip()))
    for item in (env or "").split(","):
        if item.strip():
            key, _, account = item.strip().partition("=")
            pairs.append((key, account))
    out: dict[str, str] = {}
    for key, account in pairs:
        if not key or not account:
            raise ValueError("an API key line is `KEY ACCOUNT` (file) or `KEY=ACCOUNT` (DGR_API_KEYS)")
        out[key] = check_id(account, "account id")
    return out


def load_models(values: Sequence[str], chat_template: str | None) -> list[TextModel]:
    from consumer.runtime import model_choices, resolve_model

    return [TextModel.load(c.name, resolve_model(c.model), chat_template) for c in model_choices(values)]


def serve(redis_url: str, models: Sequence[str], *, host: str = "127.0.0.1", port: int = 8000,
          chat_template: str | None = None, api_keys_file: Path | None = None, max_body_bytes: int = MAX_BODY_BYTES,
          max_lag: int | None = 10_000, log_level: str = "info", bounds: ClientBounds = ClientBounds()) -> None:
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServeConfig(redis_url=redis_url, models=load_models(models, chat_template),
                         api_keys=read_api_keys(api_keys_file, os.environ.get("DGR_API_KEYS")),
                         max_body_bytes=max_body_bytes, body_timeout_s=bounds.body_timeout_s,
                         producer=serve_producer(max_lag=max_lag))
    log.info("dgr serve on http://%s:%d (models: %s; API keys: %s)", host, port,
             ", ".join(m.name for m in config.models), len(config.api_keys) or "none, open")
    # loop "auto": uvloop (the serve extra) when installed; the protocol uvicorn's "auto" picks (httptools, else
    # h11) with the clients' bounds (gateway/guard.py), h11's own bound on a head set to the same
    uvicorn.run(make_app(config), host=host, port=port, log_level=log_level, access_log=False,
                http=guarded_protocol(bounds), h11_max_incomplete_event_size=bounds.max_head_bytes)
