# specdec's OpenAI-compatible server. CPU by default:
#   docker build -t specdec .
#   docker run -p 8080:8080 -v $PWD/models:/models specdec /models/target.gguf --draft /models/draft.gguf
# For NVIDIA GPUs, build llama.cpp with CUDA (name your GPU's architecture; 90 = H100/H200):
#   docker build --build-arg BASE=nvidia/cuda:12.4.1-devel-ubuntu22.04 \
#       --build-arg CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90" -t specdec:cuda .
# and run it with --gpus all and -ngl -1.
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG CMAKE_ARGS=""
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
# setup.sh builds llama-cpp-python for this machine's CPU (or with CMAKE_ARGS) and installs
# specdec with its server dependencies.
RUN CMAKE_ARGS="${CMAKE_ARGS}" bash scripts/setup.sh && rm -rf /root/.cache/pip
RUN useradd --create-home specdec && mkdir -p /var/cache/specdec && chown specdec /var/cache/specdec
USER specdec
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s CMD \
    python3 -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/health').status != 200)"
ENTRYPOINT ["/opt/specdec/bin/specdec-cli", "serve"]
