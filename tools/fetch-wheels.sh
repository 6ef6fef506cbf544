#!/bin/bash
# Download (here, with network) the wheels the lent GPU machine lacks into .whl/.
# Wraps ../shared/device/fetch-wheels.sh and adds what tiercache needs beyond it.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info && touch .git/info/exclude
EXTRA="xxhash pydantic pydantic-core annotated-types typing-inspection ${EXTRA:-}" bash ../shared/device/fetch-wheels.sh
