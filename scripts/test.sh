#!/usr/bin/env bash
# Runs every test of slimen: Go formatting and vet, the Go test suite, and the Python worker's
# pytest suite in a virtual environment cached outside the clone (scripts/pyenv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== gofmt"
unformatted=$(gofmt -l $(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))
if [ -n "$unformatted" ]; then
  echo "gofmt would change:"; echo "$unformatted"; exit 1
fi
echo "== go vet"
go vet ./...
echo "== go test"
go test -count=1 -timeout 15m ./...
echo "== go test -race (the packages where rollouts, dispatchers and engine streams run concurrently)"
go test -race -count=1 -timeout 10m ./host/... ./engines/remote ./engines/server ./engines/scripted ./engines/openai ./graphs ./starlib

echo "== python worker tests"
venv=$(scripts/pyenv.sh)
if [ -d engines/torch/tests ]; then
  set +e
  (cd engines/torch && "$venv/bin/python" -m pytest -q tests)
  rc=$?
  set -e
  # pytest exits 5 when it collects no tests: that is a failure of the suite, not a pass.
  if [ $rc -ne 0 ]; then exit $rc; fi
fi
echo "== all tests passed"
