#!/usr/bin/env bash
# Run the test suite (sets up .venv first if needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers (QSPEC_TEST_WORKERS overrides; 0 runs in this process). worksteal hands each worker a
# contiguous half and rebalances at the end, so tests of one file mostly share a process.
exec .venv/bin/python -m pytest -q -n "${QSPEC_TEST_WORKERS:-2}" --dist worksteal tests "$@"
