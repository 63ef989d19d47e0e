"""`dgr serve`: an OpenAI-compatible HTTP API over the fleet (docs/serve.md), text in and text out.

Split as llama.cpp's server is: `app` (HTTP: routes, streaming, limits, keys), `api` (the request models,
pydantic at the edge), `text` (tokenizer, chat templates, incremental detokenizer, stop strings), `runner`
(sessions over ONE AsyncProducer, the worker choice, usage), `errors` (OpenAI's error shape). The worker's
packages (consumer/, producer/, schemas/) never import this one.
"""
