# The dgr image: consumer, demo producer and the RQ control plane all run from it.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY producer producer
COPY consumer consumer
COPY dgrtools dgrtools
COPY gateway gateway
# A portable CPU build: -march=native would bake in the build host's CPU, and AMX tiles advertised by
# a VM but not executable crash quantized matmuls with SIGILL (see docs/operations.md).
ENV CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
RUN pip install --no-cache-dir ".[gemma,serve]"
ENV DGR_MODEL_DIR=/models
RUN dgr model gemma && dgr model tiny /models/tiny-q8_0-seed0.gguf
ENTRYPOINT ["dgr"]
