# specdec's OpenAI-compatible server. CPU by default:
#   docker build -t specdec .
#   docker run -p 8080:8080 -v $PWD/models:/models specdec /models/target.gguf --draft /models/draft.gguf
# For NVIDIA GPUs, build llama.cpp with CUDA (name your GPU's architecture; 90 = H100/H200):
#   docker build --build-arg BASE=nvidia/cuda:12.4.1-devel-ubuntu22.04 --build-arg \
#       CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90" -t specdec:cuda .
# and run it with --gpus all and -ngl -1.
# The image runs on any x86-64 CPU with AVX2 (llama.cpp's instruction sets without -march=native),
# not only on CPUs like the one that built it; for a fleet with AVX-512, add -DGGML_AVX512=ON.
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG CMAKE_ARGS="-DGGML_NATIVE=OFF"
ENV DEBIAN_FRONTEND=noninteractive \
    SPECDEC_VENV=/opt/specdec \
    SPECDEC_CACHE=/var/cache/specdec \
    SPECDEC_HOST=0.0.0.0 \
    SPECDEC_PORT=8080 \
    PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends \
        build-essential cmake git python3 python3-venv python3-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# setup.sh builds llama-cpp-python with CMAKE_ARGS and installs specdec with its server
# dependencies; the built wheel is not kept (the image installs it once).
RUN CMAKE_ARGS="${CMAKE_ARGS}" bash scripts/setup.sh \
    && rm -rf /root/.cache/pip "${SPECDEC_CACHE}/wheels"
# A numeric user, so that Kubernetes can check runAsNonRoot.
RUN useradd --uid 10001 --create-home specdec && mkdir -p /var/cache/specdec \
    && chown 10001 /var/cache/specdec
USER 10001
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s CMD \
    python3 -c "import os,urllib.request,sys; port=os.environ.get('SPECDEC_PORT','8080'); sys.exit(urllib.request.urlopen(f'http://127.0.0.1:{port}/health').status != 200)"
ENTRYPOINT ["/opt/specdec/bin/specdec-cli", "serve"]
