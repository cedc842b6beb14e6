#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and asks the embedded default model a question.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
slipstream generate --chat "What is the capital of France?"
